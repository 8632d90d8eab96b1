// A rank program for tests/e2e/launcher_test.cpp: stops a rank exactly where a death leaked its
// /dev/shm segment. It runs the communicator's segment set-up (src/comm/shm_exchange.h) as rank 0
// of 2 ranks over an in-process store that rank 1 never joins: the segment is created and named
// (with mfsdp-run's MFSDP_SHM_TAG), then rank 0 waits for rank 1's "mapped" flag, which never
// comes; ranks unlink the segment only once every rank has mapped it. The test SIGKILLs this
// process while it waits.
#include <cstdio>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/shm_exchange.h"

int main() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(120));
  std::printf("creating the segment\n");
  std::fflush(stdout);
  try {
    auto exchange = mfsdp::ShmExchange::connect(*store, 0, 2, std::chrono::seconds(120), /*enabled=*/true);
  } catch (const std::exception& error) {
    std::printf("gave up: %s\n", error.what());
    return 1;
  }
  return 0;
}
