// Reading indexer-bench's JSON reports in tests: the text parsed as a protobuf Struct, and its
// fields, each a test failure when missing. For the bench tests (report_test, bench_binary_test).
#pragma once

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <string>

namespace indexer::bench {

inline google::protobuf::Struct ParseJson(const std::string& text) {
  google::protobuf::Struct s;
  const auto status = google::protobuf::util::JsonStringToMessage(text, &s);
  EXPECT_TRUE(status.ok()) << status.ToString() << "\n" << text.substr(0, 2000);
  return s;
}

// s[key]; a default Value (and a failure) when s has no such field.
inline const google::protobuf::Value& Field(const google::protobuf::Struct& s,
                                            const std::string& key) {
  static const google::protobuf::Value kMissing;
  const auto it = s.fields().find(key);
  EXPECT_TRUE(it != s.fields().end()) << "no field " << key;
  return it == s.fields().end() ? kMissing : it->second;
}

}  // namespace indexer::bench
