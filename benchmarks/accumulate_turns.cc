// Served accumulates against direct ones that follow each other with no gap, into one allocated region: how long
// the target's server keeps an accumulatev waiting for the region's accumulate lock. Ranks are threads of this
// process (one communicator each, loopback). Rank 0 owns a region of int64; rank 1 (rma_direct=off, so the target's
// server applies its calls) adds into all of it --calls times; every other rank, rank 0 too, adds into all of it
// directly, back to back, until rank 1 is done. Prints rank 1's median and worst call and checks the final sums.
// (benchmarks/accumulate_turns.py is the same from Python, whose gaps between calls leave the lock free more often.)
//
//     build-tests/smartcoll_accumulate_bench [--ranks N] [--bytes B] [--calls K]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "smartcoll/comm.h"
#include "smartcoll/store.h"

namespace {

using namespace smartcoll;
using Clock = std::chrono::steady_clock;

struct Args {
  int ranks = 3, calls = 200;
  size_t bytes = size_t{1} << 20;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--ranks") {
      a.ranks = std::atoi(argv[i + 1]);
    } else if (k == "--bytes") {
      a.bytes = std::strtoull(argv[i + 1], nullptr, 10) / 8 * 8;
    } else if (k == "--calls") {
      a.calls = std::atoi(argv[i + 1]);
    } else {
      std::fprintf(stderr, "usage: %s [--ranks N >= 3] [--bytes B] [--calls K]\n", argv[0]);
      std::exit(2);
    }
  }
  if (a.ranks < 3 || a.bytes == 0 || a.calls < 1) {
    std::fprintf(stderr, "needs --ranks >= 3, --bytes >= 8, --calls >= 1\n");
    std::exit(2);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  auto store = std::make_shared<MemoryStore>();
  std::atomic<bool> done{false};
  std::atomic<uint64_t> region_id{0}, direct_calls{0};
  std::vector<double> ms;
  std::string wrong;
  std::vector<std::thread> threads;
  for (int r = 0; r < a.ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        Communicator comm(r, a.ranks, store,
                          Options::resolve({{"rma_direct", r == 1 ? "off" : "auto"}, {"timeout", "60"}}));
        std::optional<AllocatedRegion> mine;
        if (r == 0) {
          mine.emplace(comm.allocate_region(a.bytes, DataType::i64));
          std::memset(mine->data, 0, a.bytes);
          region_id = mine->id;
        }
        comm.barrier()->wait();
        std::vector<int64_t> ones(a.bytes / 8, 1);
        const LocalPiece local{ones.data(), a.bytes};
        const RemotePiece piece{0, a.bytes};
        const RemoteRegion into{0, region_id.load(), a.bytes, DataType::i64};
        if (r == 1) {
          for (int i = 0; i < a.calls; ++i) {
            const auto t0 = Clock::now();
            comm.accumulatev({&local, 1}, into, {&piece, 1}, ReduceOp::sum)->wait();
            ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
          }
          done = true;
        } else {
          const auto end = Clock::now() + std::chrono::seconds(60);
          while (!done && Clock::now() < end) {
            comm.accumulatev({&local, 1}, into, {&piece, 1}, ReduceOp::sum)->wait();
            ++direct_calls;
          }
        }
        comm.barrier()->wait();
        if (r == 0) {
          const auto want = static_cast<int64_t>(a.calls + direct_calls.load());
          const auto* got = static_cast<const int64_t*>(mine->data);
          if (std::any_of(got, got + a.bytes / 8, [&](int64_t v) { return v != want; }))
            wrong = "the region does not hold " + std::to_string(want) + " in every element";
        }
        comm.barrier()->wait();
      } catch (const std::exception& e) {
        wrong = "rank " + std::to_string(r) + ": " + e.what();
      }
    });
  for (auto& t : threads) t.join();
  if (!wrong.empty()) {
    std::fprintf(stderr, "%s\n", wrong.c_str());
    return 1;
  }
  double all = 0;
  for (double m : ms) all += m;
  std::sort(ms.begin(), ms.end());
  std::printf("%d served accumulates of %zu B beside %d direct ranks (%llu direct calls meanwhile): median %.2f ms, "
              "worst %.2f ms, all %.2f s\n",
              a.calls, a.bytes, a.ranks - 1, static_cast<unsigned long long>(direct_calls.load()), ms[ms.size() / 2],
              ms.back(), all / 1e3);
  return 0;
}
