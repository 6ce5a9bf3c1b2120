// fuzz_corpus_test: runs files through the fuzz target (LLVMFuzzerTestOneInput) without
// libFuzzer, so that every build, with any compiler, replays the committed corpus: the seeds and
// the inputs fuzzing found interesting stay regression tests. Arguments: files or folders
// (every regular file inside, recursively). Exits 0 when every input ran (the target aborts on a
// broken invariant), 1 when there was nothing to run or a file could not be read.
// With INDEXER_FUZZ_DEVICE=cuda the inputs run on the CUDA backend; where no GPU is usable it
// prints "SKIPPED" with the reason and exits 77 (ctest's SKIP_RETURN_CODE).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "engine/backend_factory.h"
#include "engine/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

bool RunFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "fuzz_corpus_test: cannot read %s\n", path.c_str());
    return false;
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  return true;
}

// Whether the backend INDEXER_FUZZ_DEVICE names can be built here (a one-page pool).
bool DeviceUsable() {
  const char* device = std::getenv("INDEXER_FUZZ_DEVICE");
  if (device == nullptr || std::string(device) != "cuda") return true;
  indexer::engine::EngineConfig config;
  config.head_dim = 64;
  config.capacity_pages = 1;
  const auto backend = indexer::engine::MakeBackend(config, "cuda");
  if (backend.ok()) return true;
  std::printf("fuzz_corpus_test: SKIPPED: no usable CUDA device: %s\n",
              backend.status().ToString().c_str());
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (!DeviceUsable()) return 77;
  int ran = 0;
  bool ok = true;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_directory(arg)) {
      for (const auto& entry : std::filesystem::recursive_directory_iterator(arg)) {
        if (entry.is_regular_file()) files.push_back(entry.path());
      }
    } else {
      files.push_back(arg);
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      ok = RunFile(f) && ok;
      ++ran;
    }
  }
  std::printf("fuzz_corpus_test: %d inputs ran\n", ran);
  return ok && ran > 0 ? 0 : 1;
}
