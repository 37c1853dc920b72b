// Ranks as threads sharing an in-memory store, over real loopback TCP: the harness of the engine-level tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "smartcoll/comm.h"

namespace smartcoll::harness {

inline Options test_options(std::map<std::string, std::string> extra = {}) {
  extra.emplace("timeout", "20");
  extra.emplace("connect_timeout", "20");
  return Options::resolve(extra);
}

// Runs body(rank, store) on `n` threads sharing one in-memory store; fails the test naming every rank that threw.
inline void run_threads(int n, const std::function<void(int, std::shared_ptr<Store>)>& body) {
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(n);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r, store);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
}

// Runs body(comm) on `n` threads, one communicator each.
inline void run_ranks(int n, const std::function<void(Communicator&)>& body,
                      const Options& options = test_options()) {
  run_threads(n, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, n, std::move(store), options);
    body(comm);
  });
}

// Pseudo-random floats in [-0.5, 0.5), a stream per rank and seed: sums of them are inexact, so equal results
// mean the same order of operations.
inline std::vector<float> noise(int rank, size_t count, uint32_t seed = 777u) {
  std::vector<float> x(count);
  uint32_t state = seed + static_cast<uint32_t>(rank) * 1013u;
  for (auto& v : x) {
    state = state * 1664525u + 1013904223u;
    v = static_cast<float>(state >> 8) / 16777216.0f - 0.5f;
  }
  return x;
}

}  // namespace smartcoll::harness
