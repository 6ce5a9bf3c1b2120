// JsonWriter: a small streaming JSON writer for indexer-bench's JSON report (objects, arrays,
// strings with escapes, numbers; non-finite numbers are written as null). The caller nests
// Begin/End calls correctly; keys are given with Key() before each member of an object.
//
// Threads: one writer per thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace indexer::bench {

class JsonWriter {
 public:
  // inline: the members go on one line ({"a": 1, "b": 2}), for rows of a long array.
  JsonWriter& BeginObject(bool inline_members = false) { return Open('{', inline_members); }
  JsonWriter& EndObject() { return Close('}'); }
  JsonWriter& BeginArray() { return Open('['); }
  JsonWriter& EndArray() { return Close(']'); }

  JsonWriter& Key(absl::string_view key) {
    Separate();
    String(key);
    out_ += ": ";
    after_key_ = true;
    return *this;
  }
  JsonWriter& Value(absl::string_view s) {
    Separate();
    String(s);
    return *this;
  }
  JsonWriter& Value(const char* s) { return Value(absl::string_view(s)); }
  JsonWriter& Value(const std::string& s) { return Value(absl::string_view(s)); }
  JsonWriter& Value(bool b) {
    Separate();
    out_ += b ? "true" : "false";
    return *this;
  }
  JsonWriter& Value(int64_t v) {
    Separate();
    out_ += std::to_string(v);
    return *this;
  }
  JsonWriter& Value(int v) { return Value(static_cast<int64_t>(v)); }
  JsonWriter& Value(double v) {
    Separate();
    if (!std::isfinite(v)) {
      out_ += "null";
    } else {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.10g", v);
      out_ += buf;
    }
    return *this;
  }
  // A short array of integers on one line: [1, 2, 3].
  JsonWriter& CompactInts(std::initializer_list<int64_t> values) {
    Separate();
    out_ += '[';
    bool first = true;
    for (int64_t v : values) {
      if (!first) out_ += ", ";
      first = false;
      out_ += std::to_string(v);
    }
    out_ += ']';
    return *this;
  }
  JsonWriter& Null() {
    Separate();
    out_ += "null";
    return *this;
  }
  // Key and value in one call.
  template <typename T>
  JsonWriter& Field(absl::string_view key, const T& value) {
    Key(key);
    return Value(value);
  }

  const std::string& str() const { return out_; }

 private:
  JsonWriter& Open(char c, bool inline_members = false) {
    Separate();
    out_ += c;
    first_.push_back(true);
    inline_.push_back(inline_members || (!inline_.empty() && inline_.back()));
    return *this;
  }
  JsonWriter& Close(char c) {
    const bool empty = first_.back();
    const bool was_inline = inline_.back();
    first_.pop_back();
    inline_.pop_back();
    if (!empty && !was_inline) Newline();
    out_ += c;
    return *this;
  }
  // A comma and newline before every member but the first; nothing right after a key.
  void Separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (first_.empty()) return;
    if (!first_.back()) out_ += inline_.back() ? ", " : ",";
    first_.back() = false;
    if (!inline_.back()) Newline();
  }
  void Newline() {
    out_ += '\n';
    out_.append(2 * first_.size(), ' ');
  }
  void String(absl::string_view s) {
    out_ += '"';
    for (const char c : s) {
      switch (c) {
        case '"':
          out_ += "\\\"";
          break;
        case '\\':
          out_ += "\\\\";
          break;
        case '\n':
          out_ += "\\n";
          break;
        case '\r':
          out_ += "\\r";
          break;
        case '\t':
          out_ += "\\t";
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned char>(c));
            out_ += buf;
          } else {
            out_ += c;
          }
      }
    }
    out_ += '"';
  }

  std::string out_;
  std::vector<bool> first_;   // per open container: no member written yet
  std::vector<bool> inline_;  // per open container: members on one line
  bool after_key_ = false;
};

}  // namespace indexer::bench
