// Files of tests: a fresh folder for a test's files, removed with everything in it when it goes
// away, and reading a whole file.
#pragma once

#include <string>

namespace indexer::testing {

// A fresh folder under $TMPDIR (or /tmp); a test failure when none can be made.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The whole file (empty when it cannot be read).
std::string ReadFile(const std::string& path);

}  // namespace indexer::testing
