// indexer-hash-ring-dump: prints the server that client/cpp's HashRing picks for each sequence id
// read from stdin (one a line), as "id<TAB>server". The Python client's test
// (tests/python/test_hash_ring.py) runs it to check that both rings agree.
//
//   indexer-hash-ring-dump SERVER[,SERVER...] [VIRTUAL_NODES] < ids
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "client/cpp/hash_ring.h"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr,
                 "usage: indexer-hash-ring-dump SERVER[,SERVER...] [VIRTUAL_NODES] < ids\n");
    return 2;
  }
  const std::vector<std::string> servers = absl::StrSplit(argv[1], ',');
  const int vnodes =
      argc == 3 ? std::atoi(argv[2]) : indexer::client::HashRing::kDefaultVirtualNodes;
  absl::StatusOr<indexer::client::HashRing> ring =
      indexer::client::HashRing::Create(servers, vnodes);
  if (!ring.ok()) {
    std::fprintf(stderr, "indexer-hash-ring-dump: %s\n", ring.status().ToString().c_str());
    return 2;
  }
  std::string id;
  while (std::getline(std::cin, id)) {
    std::cout << id << '\t' << *ring->Lookup(id) << '\n';
  }
  return 0;
}
