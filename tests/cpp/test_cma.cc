// Same-host allreduce over cross-memory attach (src/cma.h). Ranks as threads (one pid: checks the algorithm) and
// as forked processes (real cross-process reads, setup verdicts, a peer that dies or stops mid-job). The control
// messages go through the shared segment (transport/cma_control.h) unless a test asks for TCP.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ranks.h"
#include "transport/cma.h"
#include "smartcoll/knobs.h"
#include "smartcoll/reduce.h"
#include "smartcoll/store.h"
#include "transport/tcp.h"

namespace smartcoll {
namespace {

Options cma_options(const std::string& timeout = "20") {
  return Options::resolve({{"timeout", timeout}, {"connect_timeout", "20"}});
}

// ---- data and the serial reference (rank order 0..n-1, one rounding per step, avg divides once) ----

struct Case {
  const char* name;
  DataType dt;
  ReduceOp op;
};
constexpr Case kCases[] = {{"f32_sum", DataType::f32, ReduceOp::sum},
                           {"f32_avg", DataType::f32, ReduceOp::avg},
                           {"i32_max", DataType::i32, ReduceOp::max},
                           {"bf16_sum", DataType::bf16, ReduceOp::sum}};

uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// Inexact floats (so a different summation order would change the bits) and full-range integers.
std::vector<char> input(const Case& c, int rank, size_t count) {
  std::vector<char> v(count * dtype_size(c.dt));
  for (size_t i = 0; i < count; ++i) {
    uint32_t h = mix(static_cast<uint32_t>(i) * 2654435761u + static_cast<uint32_t>(rank) * 40503u + 17u);
    float f = static_cast<float>(h >> 8) / 16777216.0f * 2.0f - 1.0f;
    switch (c.dt) {
      case DataType::f32: std::memcpy(&v[i * 4], &f, 4); break;
      case DataType::i32: {
        auto x = static_cast<int32_t>(h);
        std::memcpy(&v[i * 4], &x, 4);
        break;
      }
      case DataType::bf16: {
        uint16_t b = float_to_bf16(f * 100.0f);
        std::memcpy(&v[i * 2], &b, 2);
        break;
      }
      default: ADD_FAILURE() << "no generator";
    }
  }
  return v;
}

std::vector<char> reference(const Case& c, int n, size_t count) {
  std::vector<std::vector<char>> ins;
  for (int r = 0; r < n; ++r) ins.push_back(input(c, r, count));
  std::vector<char> out = ins[0];
  for (size_t i = 0; i < count; ++i) {
    if (c.dt == DataType::f32) {
      float acc;
      std::memcpy(&acc, &ins[0][i * 4], 4);
      for (int r = 1; r < n; ++r) {
        float x;
        std::memcpy(&x, &ins[r][i * 4], 4);
        acc = acc + x;
      }
      if (c.op == ReduceOp::avg) acc = acc / static_cast<float>(n);
      std::memcpy(&out[i * 4], &acc, 4);
    } else if (c.dt == DataType::i32) {
      int32_t acc;
      std::memcpy(&acc, &ins[0][i * 4], 4);
      for (int r = 1; r < n; ++r) {
        int32_t x;
        std::memcpy(&x, &ins[r][i * 4], 4);
        acc = std::max(acc, x);
      }
      std::memcpy(&out[i * 4], &acc, 4);
    } else {
      uint16_t acc;
      std::memcpy(&acc, &ins[0][i * 2], 2);
      for (int r = 1; r < n; ++r) {
        uint16_t x;
        std::memcpy(&x, &ins[r][i * 2], 2);
        acc = float_to_bf16(bf16_to_float(acc) + bf16_to_float(x));
      }
      std::memcpy(&out[i * 2], &acc, 2);
    }
  }
  return out;
}

// Runs every case in place and out of place on one Local; returns the concatenated results.
std::vector<char> run_cases(Transport& t, cma::Local& local, size_t count) {
  std::vector<char> all;
  for (const Case& c : kCases) {
    for (bool in_place : {false, true}) {
      std::vector<char> in = input(c, t.rank(), count);
      const std::vector<char> original = in;
      std::vector<char> out(in.size(), static_cast<char>(0xAB));
      char* dst = in_place ? in.data() : out.data();
      local.allreduce(t, in.data(), dst, count, c.dt, c.op);
      if (!in_place && in != original) throw std::runtime_error(std::string(c.name) + ": input was modified");
      all.insert(all.end(), dst, dst + in.size());
    }
  }
  return all;
}

std::vector<char> expected_cases(int n, size_t count) {
  std::vector<char> all;
  for (const Case& c : kCases) {
    std::vector<char> ref = reference(c, n, count);
    for (int k = 0; k < 2; ++k) all.insert(all.end(), ref.begin(), ref.end());
  }
  return all;
}

// Names the first case and element where `got` differs from `want`.
std::string first_difference(int n, size_t count, const std::vector<char>& got, const std::vector<char>& want) {
  if (got.size() != want.size())
    return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
  size_t pos = 0;
  for (const Case& c : kCases)
    for (const char* place : {"out of place", "in place"}) {
      size_t bytes = count * dtype_size(c.dt);
      for (size_t i = 0; i < bytes; ++i)
        if (got[pos + i] != want[pos + i])
          return std::string(c.name) + " " + place + " n=" + std::to_string(n) + " element " +
                 std::to_string(i / dtype_size(c.dt));
      pos += bytes;
    }
  return "";
}

// ---- ranks as threads ----

constexpr size_t kRoom = 64 * 1024;  // room per rank for calls with their data through the segment

void run_threads(int n, const std::function<void(Transport&, cma::Local&)>& body,
                 const Options& options = cma_options(), bool shm = true) {
  harness::run_threads(n, [&](int r, std::shared_ptr<Store> store) {
    TcpTransport t(r, n, std::move(store), Config::from(options), "");
    cma::Local local(t, shm, 200, kRoom);
    if (!local.usable()) throw std::runtime_error("not usable: " + local.why_not());
    const std::string want = n == 1 ? "" : shm ? "shm" : "tcp";
    if (local.control() != want) throw std::runtime_error("control over '" + local.control() + "', not " + want);
    body(t, local);
  });
}

struct Shape {
  int world;
  size_t count;
};

class CmaThreads : public ::testing::TestWithParam<Shape> {};

TEST_P(CmaThreads, AllreduceMatchesSerialReferenceBitwise) {
  const auto [n, count] = GetParam();
  std::vector<std::vector<char>> results(n);
  run_threads(n, [&](Transport& t, cma::Local& local) { results[t.rank()] = run_cases(t, local, count); });
  const std::vector<char> want = expected_cases(n, count);
  for (int r = 0; r < n; ++r) EXPECT_EQ(first_difference(n, count, results[r], want), "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Cma, CmaThreads,
                         ::testing::Values(Shape{2, 0}, Shape{2, 1}, Shape{2, 7}, Shape{2, 100003}, Shape{3, 0},
                                           Shape{3, 1}, Shape{3, 7}, Shape{3, 100003}, Shape{4, 0}, Shape{4, 1},
                                           Shape{4, 7}, Shape{4, 100003}, Shape{5, 0}, Shape{5, 1}, Shape{5, 7},
                                           Shape{5, 100003},
                                           // chunks of several staging pieces, with a ragged last piece
                                           Shape{2, (1u << 20) + 3}, Shape{3, 1000003}),
                         [](const auto& info) {
                           return "n" + std::to_string(info.param.world) + "_count" +
                                  std::to_string(info.param.count);
                         });

// The fallback: the same calls with the control messages over TCP give the same bits.
TEST(CmaThreads, TcpControlGivesTheSameBits) {
  const int n = 3;
  const size_t count = 100003;
  std::vector<std::vector<char>> results(n);
  run_threads(
      n, [&](Transport& t, cma::Local& local) { results[t.rank()] = run_cases(t, local, count); }, cma_options(),
      false);
  const std::vector<char> want = expected_cases(n, count);
  for (int r = 0; r < n; ++r) EXPECT_EQ(first_difference(n, count, results[r], want), "") << "rank " << r;
}

// Broadcasts whose non-roots do not wait for each other at the end, back to back with rotating roots and other
// collectives in between: every rank gets every root's values of that very call.
TEST(CmaThreads, BackToBackBroadcastsGetEachCallsValues) {
  const int n = 4, calls = 200;
  const size_t count = 4099;
  std::vector<std::string> problems(n);
  run_threads(n, [&](Transport& t, cma::Local& local) {
    std::vector<uint32_t> buf(count), gathered(count * n);
    for (int i = 0; i < calls && problems[t.rank()].empty(); ++i) {
      const int root = i % n;
      for (size_t j = 0; j < count; ++j) buf[j] = t.rank() == root ? static_cast<uint32_t>(i * 1000003 + j) : 0;
      char* p = reinterpret_cast<char*>(buf.data());
      local.run(t, {Collective::broadcast, DataType::i32, ReduceOp::sum, root, count, p, p});
      for (size_t j = 0; j < count; ++j)
        if (buf[j] != static_cast<uint32_t>(i * 1000003 + j)) {
          problems[t.rank()] = "call " + std::to_string(i) + " element " + std::to_string(j);
          break;
        }
      if (i % 7 == 0)
        local.run(t, {Collective::allgather, DataType::i32, ReduceOp::sum, -1, count, p,
                      reinterpret_cast<char*>(gathered.data())});
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(problems[r], "") << "rank " << r;
}

// Lists are read through their piece tables whatever their cut: here every rank cuts its input and output
// differently, into 2 to 2000 pieces (calls whose layouts are not compared, as with check=0), and every rank gets the reference of the
// same elements in one buffer, bit for bit, in place and out of place.
TEST(CmaThreads, ListsCutDifferentlyOnEveryRankReadAsOneVector) {
  const int n = 3;
  const size_t count = 100003;
  std::vector<std::string> problems(n);
  run_threads(n, [&](Transport& t, cma::Local& local) {
    // Pieces of `bytes` at `p`: `cuts` of them, the last one ragged, each a whole number of elements.
    auto cut = [](char* p, size_t bytes, size_t esize, size_t cuts) {
      std::vector<cma::Extent> list;
      const size_t step = bytes / esize / cuts * esize;
      for (size_t off = 0; off < bytes; off += step)
        list.push_back({reinterpret_cast<uintptr_t>(p + off), std::min(step, bytes - off)});
      return list;
    };
    const size_t r = static_cast<size_t>(t.rank());
    for (const Case& c : kCases)
      for (bool in_place : {false, true}) {
        std::vector<char> in = input(c, t.rank(), count), out(in.size(), static_cast<char>(0xAB));
        const size_t esize = dtype_size(c.dt);
        // More pieces than one process_vm_readv takes (IOV_MAX) on some ranks, on one side of a read or both.
        const size_t in_cuts[] = {2, 1500, 7}, out_cuts[] = {1200, 3, 2000};
        const auto ins = cut(in.data(), in.size(), esize, in_cuts[r]);
        const auto outs = in_place ? ins : cut(out.data(), out.size(), esize, out_cuts[r]);
        local.run(t, {Collective::allreduce, c.dt, c.op, -1, count, nullptr, nullptr, ins, outs});
        if ((in_place ? in : out) != reference(c, n, count))
          problems[r] += std::string(c.name) + (in_place ? " in place; " : " out of place; ");
      }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(problems[r], "") << "rank " << r;
}

// Lists whose buffers lie apart (a gap after each, so that no two merge into one part): reductions read this
// rank's input run by run where a piece straddles its buffers, and every rank, first, middle or last in the fold,
// gets the reference's bits; allreduce in place and out of place, reduce_scatter, at 2 to 4 ranks.
TEST(CmaThreads, ListsOfBuffersApartReduceToTheReferenceBitwise) {
  constexpr size_t kGap = 64;
  // `data` cut into `cuts` buffers of whole elements, each followed by a gap, in `storage`.
  auto spread = [](const std::vector<char>& data, size_t esize, size_t cuts, std::vector<char>& storage) {
    std::vector<cma::Extent> list;
    const size_t step = std::max<size_t>(1, data.size() / esize / cuts) * esize;
    storage.assign(data.size() + (data.size() / step + 1) * kGap, static_cast<char>(0xAB));
    for (size_t off = 0, at = 0; off < data.size(); off += step, at += step + kGap) {
      const size_t len = std::min(step, data.size() - off);
      std::memcpy(storage.data() + at, data.data() + off, len);
      list.push_back({reinterpret_cast<uintptr_t>(storage.data() + at), len});
    }
    return list;
  };
  auto gather = [](const std::vector<cma::Extent>& list) {
    std::vector<char> v;
    for (const cma::Extent& e : list) {
      const char* p = reinterpret_cast<const char*>(static_cast<uintptr_t>(e.at));
      v.insert(v.end(), p, p + e.bytes);
    }
    return v;
  };
  for (const int n : {2, 3, 4}) {
    const size_t block = 33337, count = static_cast<size_t>(n) * block;
    std::vector<std::string> problems(n);
    run_threads(n, [&](Transport& t, cma::Local& local) {
      const int r = t.rank();
      // Buffers of a few hundred bytes to a whole piece and more, cut differently on every rank.
      const size_t in_cuts[] = {1500, 2, 300, 7}, out_cuts[] = {3, 1200, 9, 40};
      for (const Case& c : kCases) {
        const size_t esize = dtype_size(c.dt);
        const std::vector<char> want = reference(c, n, count);
        for (int shape = 0; shape < 3; ++shape) {  // allreduce in place, out of place; reduce_scatter
          const bool scatter = shape == 2, in_place = shape == 0;
          std::vector<char> in_store, out_store;
          const auto ins = spread(input(c, r, count), esize, in_cuts[r], in_store);
          const size_t out_count = scatter ? block : count;
          const auto outs = in_place ? ins : spread(std::vector<char>(out_count * esize), esize, out_cuts[r], out_store);
          local.run(t, {scatter ? Collective::reduce_scatter : Collective::allreduce, c.dt, c.op, -1, out_count,
                        nullptr, nullptr, ins, outs});
          const auto first = want.begin() + static_cast<ptrdiff_t>(scatter ? r * block * esize : 0);
          if (gather(outs) != std::vector<char>(first, first + static_cast<ptrdiff_t>(out_count * esize)))
            problems[r] += std::string(c.name) + (scatter ? " reduce_scatter; " : in_place ? " in place; " : " out of place; ");
        }
      }
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(problems[r], "") << n << " ranks, rank " << r;
  }
}

// ---- calls with their data through the segment ----

// Every collective, dtype and op with its data through the segment gives the bits of the same call by
// single-copy reads (both reduce in rank order), in place and out of place, for lists too; the input is left
// alone; calls follow each other with no barrier in between, so each reuses the place of the call before last.
struct ThroughSegment {
  int world;
  size_t count;
};
class CmaSegmentData : public ::testing::TestWithParam<ThroughSegment> {};

TEST_P(CmaSegmentData, EveryCollectiveMatchesTheReadsBitwise) {
  const auto [n, count] = GetParam();
  std::vector<std::string> problems(n);
  run_threads(n, [&, n = n, count = count](Transport& t, cma::Local& local) {
    const int r = t.rank();
    std::string& problem = problems[r];
    const Collective colls[] = {Collective::allreduce, Collective::reduce,    Collective::reduce_scatter,
                                Collective::allgather, Collective::alltoall, Collective::broadcast};
    for (const Case& c : kCases)
      for (Collective coll : colls)
        for (bool in_place : {false, true}) {
          // allgather's in-place form is a block of out; alltoall has none (the Communicator refuses it).
          if (in_place && (coll == Collective::allgather || coll == Collective::alltoall)) continue;
          const bool blocks_in = coll == Collective::reduce_scatter || coll == Collective::alltoall;
          const bool blocks_out = coll == Collective::allgather || coll == Collective::alltoall;
          const size_t in_count = blocks_in ? count * n : count, out_count = blocks_out ? count * n : count;
          if (in_place && in_count != out_count) continue;
          const int root = coll == Collective::reduce || coll == Collective::broadcast ? (n - 1) % n : -1;
          // The wide cases are there for the reductions in chunks (16 KiB and more): calls that do not fit the
          // room are left out (refused: CmaSegmentDataErrors).
          size_t need = 0;
          for (int q = 0; q < n; ++q)
            need = std::max(need, cma::Local::segment_need({coll, c.dt, c.op, root, count, nullptr, nullptr}, q, n));
          if (need > kRoom) continue;
          const std::vector<char> original = input(c, r * 7 + 3, in_count);
          std::vector<char> results[2];
          for (bool through : {false, true}) {
            std::vector<char> in = original, out(out_count * dtype_size(c.dt), static_cast<char>(0x5A));
            char* dst = in_place ? in.data() : out.data();
            if (coll == Collective::broadcast) dst = in.data();
            cma::Local::Call call{coll, c.dt, c.op, root, count, in.data(), dst};
            call.through_segment = through;
            local.run(t, call);
            if (!in_place && coll != Collective::broadcast && in != original) problem += "input changed; ";
            if (coll != Collective::reduce || r == root) results[through].assign(dst, dst + out.size());
          }
          if (results[0] != results[1])
            problem += std::string(c.name) + " " + std::string(collective_name(coll)) +
                       (in_place ? " in place; " : "; ");
        }
    // A list of three pieces on each side (the middle one 1 element) against the same call in one buffer.
    if (count >= 3) {
      const Case& c = kCases[0];
      std::vector<char> in = input(c, r, count), one(in.size()), listed(in.size());
      auto cut = [&](char* p) {
        const uint64_t at = reinterpret_cast<uintptr_t>(p), e = dtype_size(c.dt);
        return std::vector<cma::Extent>{{at, e}, {at + e, e}, {at + 2 * e, (count - 2) * e}};
      };
      cma::Local::Call call{Collective::allreduce, c.dt, c.op, -1, count, in.data(), one.data()};
      call.through_segment = true;
      local.run(t, call);
      const auto ins = cut(in.data()), outs = cut(listed.data());
      call = {Collective::allreduce, c.dt, c.op, -1, count, nullptr, nullptr, ins, outs};
      call.through_segment = true;
      local.run(t, call);
      if (one != listed) problem += "list; ";
    }
    // Barriers of no data.
    for (int i = 0; i < 3; ++i) {
      cma::Local::Call barrier{Collective::barrier, DataType::f32, ReduceOp::sum, -1, 0, nullptr, nullptr};
      barrier.through_segment = true;
      local.run(t, barrier);
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(problems[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Cma, CmaSegmentData,
                         ::testing::Values(ThroughSegment{2, 1}, ThroughSegment{2, 100}, ThroughSegment{3, 7},
                                           ThroughSegment{4, 1000}, ThroughSegment{5, 3},
                                           // allreduce and reduce of 16 KiB and more go in chunks: ragged ones
                                           // (4099 elements over 3 and 5 ranks), and lists cut across them
                                           ThroughSegment{2, 4099}, ThroughSegment{3, 4099},
                                           ThroughSegment{5, 8191}),
                         [](const auto& info) {
                           return "n" + std::to_string(info.param.world) + "_count" +
                                  std::to_string(info.param.count);
                         });

// Back to back with no barrier in between, one rank sleeping now and then: a place in the segment is rewritten
// only once every peer is done with it, so every call gets its own values.
TEST(CmaSegmentData, BackToBackCallsWithASlowRankGetTheirOwnValues) {
  const int n = 3, calls = 3000;
  std::vector<std::string> problems(n);
  run_threads(n, [&](Transport& t, cma::Local& local) {
    const int r = t.rank();
    std::vector<int64_t> buf(4099);
    for (int i = 0; i < calls && problems[r].empty(); ++i) {
      if (r == i % n && i % 97 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      // Every other call from 16 KiB (in chunks, with a barrier between reducing and copying out).
      const size_t count = i % 2 ? 1 + static_cast<size_t>(i) % 257 : 2048 + static_cast<size_t>(i) % 2051;
      for (size_t j = 0; j < count; ++j) buf[j] = i * 1000 + static_cast<int64_t>(j) + r;
      cma::Local::Call call{Collective::allreduce, DataType::i64, ReduceOp::sum, -1, count,
                            reinterpret_cast<char*>(buf.data()), reinterpret_cast<char*>(buf.data())};
      call.through_segment = true;
      local.run(t, call);
      for (size_t j = 0; j < count; ++j)
        if (buf[j] != n * (i * 1000 + static_cast<int64_t>(j)) + n * (n - 1) / 2) {
          problems[r] = "call " + std::to_string(i) + " element " + std::to_string(j);
          break;
        }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(problems[r], "") << "rank " << r;
}

// A call whose data does not fit is refused before anything is published, naming the room and the knob; one
// rank's data through the segment against another's by reads fails on both, naming both calls.
TEST(CmaSegmentDataErrors, TooLargeIsRefusedAndMixedWaysDisagree) {
  const int n = 2;
  std::vector<std::string> too_large(n), mixed(n);
  run_threads(n, [&](Transport& t, cma::Local& local) {
    EXPECT_EQ(local.segment_room(), kRoom);
    std::vector<float> x(kRoom / 4 * 2 + 1, 1.0f);  // alltoall: 2 blocks of kRoom / 8 + 1 floats, kRoom + 8 bytes
    cma::Local::Call call{Collective::alltoall, DataType::f32, ReduceOp::sum, -1, kRoom / 8 + 1,
                          reinterpret_cast<char*>(x.data()), reinterpret_cast<char*>(x.data())};
    call.through_segment = true;
    try {
      local.run(t, call);
    } catch (const InvalidArgument& e) {
      too_large[t.rank()] = e.what();
    }
    cma::Local::Call small{Collective::allreduce, DataType::f32, ReduceOp::sum, -1, 4,
                           reinterpret_cast<char*>(x.data()), reinterpret_cast<char*>(x.data())};
    small.through_segment = t.rank() == 0;
    try {
      local.run(t, small);
    } catch (const CommError& e) {
      mixed[t.rank()] = e.what();
    }
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_NE(too_large[r].find("65544 bytes per rank through the control segment, which has room for 65536 (the "
                                "shm_bytes knob)"),
              std::string::npos)
        << too_large[r];
    EXPECT_NE(mixed[r].find("allreduce(count=4, float32, op=sum, algo=shm)"), std::string::npos) << mixed[r];
    EXPECT_NE(mixed[r].find("allreduce(count=4, float32, op=sum, algo=cma)"), std::string::npos) << mixed[r];
  }
}

TEST(CmaSegmentDataErrors, NoRoomOverTcpControl) {
  run_threads(
      2, [](Transport&, cma::Local& local) { EXPECT_EQ(local.segment_room(), 0u); }, cma_options(), false);
}

TEST(CmaThreadsSingle, WorldOfOneIsUsableAndCopies) {
  run_threads(1, [](Transport& t, cma::Local& local) {
    EXPECT_EQ(local.why_not(), "");
    std::vector<float> in{1.5f, -2.0f, 3.25f}, out(3, 0.0f);
    local.allreduce(t, reinterpret_cast<char*>(in.data()), reinterpret_cast<char*>(out.data()), 3, DataType::f32,
                    ReduceOp::avg);
    EXPECT_EQ(out, in);
  });
}

TEST(CmaThreadsErrors, MismatchedCountIsCommErrorOnEveryRank) {
  const int n = 3;
  std::vector<std::string> errors(n);
  run_threads(n, [&](Transport& t, cma::Local& local) {
    const size_t count = t.rank() == 1 ? 10 : 12;
    std::vector<float> buf(count, 1.0f);
    try {
      local.allreduce(t, reinterpret_cast<char*>(buf.data()), reinterpret_cast<char*>(buf.data()), count,
                      DataType::f32, ReduceOp::sum);
    } catch (const CommError& e) {
      errors[t.rank()] = e.what();
    }
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_NE(errors[r].find("disagree"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("count=10"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("count=12"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// Ranks that call different collectives fail before any read, every one naming both calls; the calls after a
// mismatch are numbered alike on every rank, so a later mismatch is caught the same way.
TEST(CmaThreadsErrors, DifferentCollectivesFailEveryRankNamingBoth) {
  const int n = 4;
  std::vector<std::string> errors(n);
  run_threads(n, [&](Transport& t, cma::Local& local) {
    std::vector<float> in(8 * n, 1.0f), out(8 * n, 0.0f);
    const cma::Local::Call call{t.rank() == 2 ? Collective::broadcast : Collective::allgather,
                                DataType::f32,
                                ReduceOp::sum,
                                t.rank() == 2 ? 0 : -1,
                                8,
                                reinterpret_cast<const char*>(in.data()),
                                reinterpret_cast<char*>(out.data())};
    try {
      local.run(t, call);
    } catch (const CommError& e) {
      errors[t.rank()] = e.what();
    }
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_NE(errors[r].find("disagree"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("broadcast(count=8, float32, algo=cma, root=0)"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("allgather(count=8, float32, algo=cma)"), std::string::npos) << errors[r];
  }
}

TEST(CmaThreadsErrors, IntegerAvgIsInvalidArgument) {
  run_threads(2, [](Transport& t, cma::Local& local) {
    int32_t x = 1;
    EXPECT_THROW(local.allreduce(t, reinterpret_cast<char*>(&x), reinterpret_cast<char*>(&x), 1, DataType::i32,
                                 ReduceOp::avg),
                 InvalidArgument);
  });
}

// ---- ranks whose own arguments send `auto` down different paths ----

// Rank 0's call takes the same-host path, rank 1's a TCP algorithm (auto decides from each rank's own
// arguments). Both must fail well before the timeout (20 s here) with the disagreement, each naming both calls.
struct SplitCase {
  const char* name;
  std::function<void(Communicator&)> call;  // throws CommError on the disagreement
  std::vector<std::string> named;           // what every failing rank's message must contain
  std::vector<int> failing = {0, 1};
  std::string shm_bytes = "262144";  // 0: small calls take TCP algorithms, not the segment's data places
};
void PrintTo(const SplitCase& c, std::ostream* os) { *os << c.name; }

class CmaPathSplit : public ::testing::TestWithParam<SplitCase> {};

TEST_P(CmaPathSplit, EveryRankFailsAtOnceNamingBothCalls) {
  const SplitCase& c = GetParam();
  std::vector<std::string> errors(2), control(2);
  std::vector<double> seconds(2, 0.0);
  harness::run_ranks(2, [&](Communicator& comm) {
    control[comm.rank()] = comm.cma_control();
    const auto start = std::chrono::steady_clock::now();
    try {
      c.call(comm);
    } catch (const CommError& e) {
      errors[comm.rank()] = e.what();
    }
    seconds[comm.rank()] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }, harness::test_options({{"shm_bytes", c.shm_bytes}}));
  for (int r = 0; r < 2; ++r) ASSERT_EQ(control[r], "shm") << "rank " << r << ": the test needs the segment";
  for (int r : c.failing) {
    EXPECT_NE(errors[r].find("ranks disagree"), std::string::npos) << "rank " << r << ": " << errors[r];
    for (const std::string& what : c.named)
      EXPECT_NE(errors[r].find(what), std::string::npos) << "rank " << r << " does not name " << what << ": "
                                                         << errors[r];
    EXPECT_LT(seconds[r], 2.0) << "rank " << r << ": " << errors[r];
  }
}

constexpr size_t kLarge = size_t{1} << 17;  // 512 KiB of float32: above rhd_max_bytes, so auto takes cma
// 128 KiB of float32: above shm_bytes and up to rhd_max_bytes, so auto takes a TCP algorithm.
constexpr size_t kMiddle = size_t{1} << 15;  // with shm_bytes=0

INSTANTIATE_TEST_SUITE_P(
    Auto, CmaPathSplit,
    ::testing::Values(
        SplitCase{"count",
                  [](Communicator& comm) {
                    std::vector<float> x(kLarge, 1.0f);
                    const size_t count = comm.rank() == 0 ? kLarge : kMiddle;  // recursive doubling over TCP
                    comm.allreduce(x.data(), x.data(), count, DataType::f32, ReduceOp::sum)->wait();
                  },
                  {"allreduce(count=131072, float32, op=sum, algo=cma)",
                   "allreduce(count=32768, float32, op=sum, algo=rd)"},
                  {0, 1},
                  "0"},
        // Both on the segment, one with its data through it: the descriptors tell the calls apart.
        SplitCase{"segment",
                  [](Communicator& comm) {
                    std::vector<float> x(kLarge, 1.0f);
                    const size_t count = comm.rank() == 0 ? kLarge : 16;
                    comm.allreduce(x.data(), x.data(), count, DataType::f32, ReduceOp::sum)->wait();
                  },
                  {"allreduce(count=131072, float32, op=sum, algo=cma)",
                   "allreduce(count=16, float32, op=sum, algo=shm)"}},
        SplitCase{"collective",
                  [](Communicator& comm) {
                    std::vector<float> in(kLarge, 1.0f), out(2 * kLarge);
                    if (comm.rank() == 0)
                      comm.allgather(in.data(), out.data(), kLarge, DataType::f32)->wait();
                    else
                      comm.broadcast(in.data(), kMiddle, DataType::f32, 0)->wait();  // the tree, over TCP
                  },
                  {"allgather(count=131072, float32, algo=cma)",
                   "broadcast(count=32768, float32, algo=tree, root=0)"},
                  {0, 1},
                  "0"},
        SplitCase{"list",
                  [](Communicator& comm) {
                    // The same elements as one buffer and as a list: both take the same-host path, where the
                    // list's layout digest tells the calls apart.
                    std::vector<float> x(kLarge, 1.0f);
                    if (comm.rank() == 0) {
                      comm.allreduce(x.data(), x.data(), kLarge, DataType::f32, ReduceOp::sum)->wait();
                    } else {
                      std::vector<void*> bufs = {x.data(), x.data() + kLarge / 2};
                      std::vector<size_t> counts = {kLarge / 2, kLarge / 2};
                      comm.allreduce(bufs, counts, DataType::f32, ReduceOp::sum)->wait();
                    }
                  },
                  {"allreduce(count=131072, float32, op=sum, algo=cma)", "a list of counts digest"}},
        SplitCase{"nothing",
                  [](Communicator& comm) {
                    // A call of no elements returns at once; the peer must not wait for it on the segment.
                    std::vector<float> x(kLarge, 1.0f);
                    const size_t count = comm.rank() == 0 ? kLarge : 0;
                    comm.allreduce(x.data(), x.data(), count, DataType::f32, ReduceOp::sum)->wait();
                  },
                  {"allreduce(count=131072, float32, op=sum, algo=cma)", "allreduce(count=0, float32, op=sum"},
                  {0}}),
    [](const auto& info) { return std::string(info.param.name); });

// auto sends a same-host call through the segment where it fits and each rank reads at most 1 MiB there;
// algo=shm refuses a call that does not fit, naming the room and the knob; without room it is never chosen.
TEST(CmaSegmentData, AutoTakesItWhereTheCallFits) {
  for (const std::string room : {"262144", "0"}) {
    std::vector<std::vector<std::string>> picked(2);
    std::vector<std::string> refused(2);
    harness::run_ranks(
        2,
        [&](Communicator& comm) {
          std::vector<float> x(1 << 17, 1.0f), y(1 << 18);
          auto& got = picked[comm.rank()];
          for (size_t count : {size_t{16}, size_t{1} << 15, (size_t{1} << 16) + 1}) {
            auto req = comm.allreduce(x.data(), x.data(), count, DataType::f32, ReduceOp::sum);
            req->wait();
            got.push_back(std::string(algorithm_name(req->algorithm())));
          }
          auto req = comm.allgather(x.data(), y.data(), size_t{1} << 16, DataType::f32);  // 256 KiB blocks
          req->wait();
          got.push_back(std::string(algorithm_name(req->algorithm())));
          req = comm.barrier();
          req->wait();
          got.push_back(std::string(algorithm_name(req->algorithm())));
          EXPECT_EQ(x[0], 8.0f);  // three sums of two ranks
          try {
            comm.allreduce(x.data(), x.data(), (size_t{1} << 16) + 1, DataType::f32, ReduceOp::sum, Algorithm::shm);
          } catch (const InvalidArgument& e) {
            refused[comm.rank()] = e.what();
          }
        },
        harness::test_options({{"shm_bytes", room}}));
    const std::vector<std::string> want =
        room == "0" ? std::vector<std::string>{"rd", "rd", "cma", "cma", "dissemination"}
                    : std::vector<std::string>{"shm", "shm", "cma", "shm", "shm"};
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(picked[r], want) << "shm_bytes=" << room << " rank " << r;
      EXPECT_NE(refused[r].find(room == "0" ? "control segment is not in use"
                                            : "262148 bytes per rank through the segment, which has room for 262144"),
                std::string::npos)
          << refused[r];
    }
  }
}

// A same-host call whose peer is late: a wait with a timeout returns when it runs out, through the segment and
// by reads alike, with the control messages in the segment or over TCP (the call stops waiting for its peers
// there and goes on at the next wait), and the call then completes with the right values.
TEST(CmaSegmentData, AWaitWithATimeoutReturnsWhileAPeerIsLate) {
  struct Case {
    const char* control;
    size_t count;
    Algorithm algo;
  };
  for (const auto& [control, count, algo] : {Case{"auto", 16, Algorithm::shm}, Case{"auto", 1 << 17, Algorithm::cma},
                                             Case{"tcp", 16, Algorithm::cma}, Case{"tcp", 1 << 17, Algorithm::cma}}) {
    std::vector<double> waited(2, -1.0);
    std::vector<float> got(2, 0.0f);
    harness::run_ranks(2, [&](Communicator& comm) {
      std::vector<float> x(count, 1.0f + comm.rank());
      // Late enough that a wait which ignored its timeout (returning when the peer comes) stays above the bound
      // even where rank 0 gets to its call well after rank 1 started sleeping.
      if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2000));
      auto req = comm.allreduce(x.data(), x.data(), count, DataType::f32, ReduceOp::sum, algo);
      if (comm.rank() == 0) {
        const auto start = std::chrono::steady_clock::now();
        EXPECT_FALSE(req->wait(std::chrono::milliseconds(200)));
        waited[0] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_FALSE(req->wait(std::chrono::milliseconds(100)));
      }
      EXPECT_TRUE(req->wait());
      got[comm.rank()] = x[count - 1];
    }, harness::test_options({{"cma", control}}));
    EXPECT_GE(waited[0], 0.19) << control << " " << count;
    EXPECT_LT(waited[0], 1.2) << control << " " << count;  // a loaded machine may wake it late; the peer came at 2 s
    EXPECT_EQ(got, std::vector<float>(2, 3.0f)) << control << " " << count;
  }
}

// A wait without a deadline sees a peer that comes more than a second late as soon as it comes: the engine
// does not sleep after the call stopped at its own one-second slice.
TEST(CmaSegmentData, APeerLateBySecondsIsSeenAsSoonAsItComes) {
  std::atomic<int64_t> called{0}, arrived{0}, finished{0};
  harness::run_ranks(2, [&](Communicator& comm) {
    float x = 1.0f;
    if (comm.rank() == 1) {
      // 1.2 s after rank 0's call (not after this thread started, which load may put far apart): past its first
      // slice, so an engine that slept a second after it would see this rank only ~0.8 s late.
      while (called.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      const std::chrono::steady_clock::time_point t0{std::chrono::steady_clock::duration(called.load())};
      std::this_thread::sleep_until(t0 + std::chrono::milliseconds(1200));
      arrived = std::chrono::steady_clock::now().time_since_epoch().count();
    } else {
      called = std::chrono::steady_clock::now().time_since_epoch().count();
    }
    comm.allreduce(&x, &x, 1, DataType::f32, ReduceOp::sum, Algorithm::shm)->wait();
    if (comm.rank() == 0) finished = std::chrono::steady_clock::now().time_since_epoch().count();
    EXPECT_EQ(x, 2.0f);
  });
  const double after = std::chrono::duration<double>(std::chrono::steady_clock::duration(finished - arrived)).count();
  EXPECT_LT(after, 0.6) << "rank 0 finished " << after << " s after rank 1 called";
}

// abort() from another thread ends a same-host call waiting on a late peer at once, naming the abort. The peer
// that comes later finds rank 0's part published (its call completes, as over TCP where the bytes were sent) and
// fails its next call naming rank 0; both long before the timeout.
TEST(CmaSegmentData, AbortEndsAWaitOnALatePeer) {
  std::vector<std::string> errors(2);
  std::vector<double> took(2, -1.0);
  float late_sum = 0.0f;
  harness::run_ranks(2, [&](Communicator& comm) {
    float x = 1.0f;
    if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2000));
    const auto start = std::chrono::steady_clock::now();
    std::thread aborter;
    if (comm.rank() == 0)
      aborter = std::thread([&comm] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        comm.abort("stopped by the test");
      });
    try {
      comm.allreduce(&x, &x, 1, DataType::f32, ReduceOp::sum, Algorithm::shm)->wait();
      late_sum = x;
      comm.allreduce(&x, &x, 1, DataType::f32, ReduceOp::sum, Algorithm::shm)->wait();
    } catch (const CommError& e) {
      errors[comm.rank()] = e.what();
    }
    took[comm.rank()] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (aborter.joinable()) aborter.join();
  });
  EXPECT_NE(errors[0].find("stopped by the test"), std::string::npos) << errors[0];
  EXPECT_EQ(late_sum, 2.0f);
  EXPECT_NE(errors[1].find("rank 0 failed"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("stopped by the test"), std::string::npos) << errors[1];
  EXPECT_LT(took[0], 1.2);  // the abort came at 0.2 s; rank 1 at 2 s
  EXPECT_LT(took[1], 2.0);
}

// ---- ranks as forked processes ----

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/smartcoll-cma-XXXXXX";
    const char* p = mkdtemp(tmpl);
    if (p) path = p;
    if (p) chmod(p, 0777);  // a child may drop privileges
  }
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

struct ChildOutcome {
  std::string output;  // what the child wrote to its pipe
  int status = -1;     // waitpid status
  bool killed = false; // the parent killed it at the deadline
};

// What a child gets: its rank, a way to report, and a way to wait until every rank has reported (so that no
// rank's exit closes its connections while others are still inside a call).
struct ChildIo {
  int rank;
  int out_fd;
  int release_fd;
  void write(const std::string& s) const {
    for (size_t done = 0; done < s.size();) {
      ssize_t k = ::write(out_fd, s.data() + done, s.size() - done);
      if (k <= 0) _exit(97);
      done += static_cast<size_t>(k);
    }
  }
  // Closes the report pipe and blocks until the parent has every report.
  void finish() const {
    ::close(out_fd);
    char c;
    while (::read(release_fd, &c, 1) > 0) {
    }
  }
};

// Forks `n` children running body(io) (exit status: body's return value, 99 on an exception, whose text is
// written as "EXCEPTION: ..."); collects their outputs, then releases them; kills all at `deadline_s`.
std::vector<ChildOutcome> run_processes(int n, const std::function<int(const ChildIo&)>& body,
                                        double deadline_s = 120) {
  std::vector<ChildOutcome> outcomes(n);
  std::vector<pid_t> pids(n, -1);
  std::vector<int> outs(n, -1), releases(n, -1);
  for (int r = 0; r < n; ++r) {
    int out[2], rel[2];
    if (pipe(out) != 0 || pipe(rel) != 0) {
      ADD_FAILURE() << "pipe failed";
      break;
    }
    pid_t pid = fork();
    if (pid == 0) {
      ::close(out[0]);
      ::close(rel[1]);
      for (int q = 0; q < r; ++q) ::close(outs[q]), ::close(releases[q]);
      ChildIo io{r, out[1], rel[0]};
      int code = 99;
      try {
        code = body(io);
      } catch (const std::exception& e) {
        io.write(std::string("EXCEPTION: ") + e.what());
        io.finish();
      }
      _exit(code);
    }
    ::close(out[1]);
    ::close(rel[0]);
    pids[r] = pid;
    outs[r] = out[0];
    releases[r] = rel[1];
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(deadline_s);
  auto left_ms = [&] {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count()));
  };
  bool timed_out = false;
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<int> who;
    for (int r = 0; r < n; ++r)
      if (outs[r] >= 0) fds.push_back({outs[r], POLLIN, 0}), who.push_back(r);
    if (fds.empty()) break;
    int ms = left_ms();
    if (ms == 0 || poll(fds.data(), fds.size(), ms) == 0) {
      timed_out = true;
      break;
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      char buf[65536];
      ssize_t k = ::read(fds[i].fd, buf, sizeof buf);
      if (k > 0) {
        outcomes[who[i]].output.append(buf, static_cast<size_t>(k));
      } else if (k == 0 || errno != EINTR) {
        ::close(outs[who[i]]);
        outs[who[i]] = -1;
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    if (outs[r] >= 0) ::close(outs[r]);
    if (releases[r] >= 0) ::close(releases[r]);
  }
  for (int r = 0; r < n; ++r) {
    if (pids[r] < 0) continue;
    for (;;) {
      pid_t w = waitpid(pids[r], &outcomes[r].status, WNOHANG);
      if (w == pids[r]) break;
      if (timed_out || left_ms() == 0) {
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &outcomes[r].status, 0);
        outcomes[r].killed = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  return outcomes;
}

bool exited_with(const ChildOutcome& o, int code) {
  return !o.killed && WIFEXITED(o.status) && WEXITSTATUS(o.status) == code;
}

// A child's rank as the process tests set it up: a file store in `dir`, the transport, the same-host path.
struct ChildRank {
  std::shared_ptr<FileStore> store;
  TcpTransport t;
  cma::Local local;
  ChildRank(const std::string& dir, int rank, int n, const Options& options)
      : store(std::make_shared<FileStore>(dir)), t(rank, n, store, Config::from(options), ""),
        local(t, true, 200, kRoom) {}
  // False, reported and finished, unless the path is usable with its control segment.
  bool over_shm(const ChildIo& io) {
    if (local.usable() && local.control() == "shm") return true;
    io.write("NOT USABLE OVER SHM: " + local.why_not() + local.control());
    io.finish();
    return false;
  }
};

class CmaProcesses : public ::testing::TestWithParam<int> {};

TEST_P(CmaProcesses, AllreduceAcrossProcessesMatchesReferenceBitwise) {
  const int n = GetParam();
  const std::vector<size_t> counts{0, 1, 7, 100003, 600011};
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  auto outcomes = run_processes(n, [&](const ChildIo& io) {
    auto store = std::make_shared<FileStore>(dir.path);
    TcpTransport t(io.rank, n, store, Config::from(cma_options()), "");
    cma::Local local(t);
    if (!local.usable()) {
      io.write("NOT USABLE: " + local.why_not());
      io.finish();
      return 3;
    }
    std::string report = std::to_string(getpid()) + "\n";
    for (size_t count : counts) {
      std::vector<char> got = run_cases(t, local, count);
      report.append(got.begin(), got.end());
    }
    io.write(report);
    io.finish();
    return 0;
  });
  std::vector<std::string> pids;
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(exited_with(outcomes[r], 0)) << "rank " << r << " status " << outcomes[r].status << " killed "
                                             << outcomes[r].killed << ": " << outcomes[r].output.substr(0, 500);
    auto nl = outcomes[r].output.find('\n');
    ASSERT_NE(nl, std::string::npos);
    pids.push_back(outcomes[r].output.substr(0, nl));
    outcomes[r].output.erase(0, nl + 1);
  }
  for (int r = 1; r < n; ++r) EXPECT_NE(pids[r], pids[0]) << "ranks must be distinct processes";
  size_t pos = 0;
  for (size_t count : counts) {
    const std::vector<char> want = expected_cases(n, count);
    for (int r = 0; r < n; ++r) {
      ASSERT_GE(outcomes[r].output.size(), pos + want.size());
      std::vector<char> got(outcomes[r].output.begin() + static_cast<ptrdiff_t>(pos),
                            outcomes[r].output.begin() + static_cast<ptrdiff_t>(pos + want.size()));
      EXPECT_EQ(first_difference(n, count, got, want), "") << "rank " << r << " count " << count;
      if (r > 0) {  // bitwise agreement across processes
        EXPECT_EQ(outcomes[r].output.compare(pos, want.size(), outcomes[0].output, pos, want.size()), 0);
      }
    }
    pos += want.size();
  }
}

INSTANTIATE_TEST_SUITE_P(Cma, CmaProcesses, ::testing::Values(2, 3, 4, 5),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// One rank that cannot read its peers (another user, or not readable by them) disables the path on every rank,
// with the same reason everywhere.
TEST(CmaProcessesSetup, OneRankFailingItsProbeDisablesItEverywhere) {
  const int n = 3;
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  const bool root = geteuid() == 0;
  auto outcomes = run_processes(n, [&](const ChildIo& io) {
    if (io.rank == 1) {
      if (root) {  // nobody cannot read root's processes
        if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) return 4;
      } else {  // peers of the same user cannot read a non-dumpable process
        prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
      }
    }
    auto store = std::make_shared<FileStore>(dir.path);
    TcpTransport t(io.rank, n, store, Config::from(cma_options()), "");
    cma::Local local(t);
    std::string report = (local.usable() ? "usable|" : "unusable|") + local.why_not();
    float x = 1.0f;
    try {
      local.allreduce(t, reinterpret_cast<char*>(&x), reinterpret_cast<char*>(&x), 1, DataType::f32, ReduceOp::sum);
      report += "|allreduce ran";
    } catch (const InvalidArgument&) {
      report += "|allreduce refused";
    }
    io.write(report);
    io.finish();
    return 0;
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(exited_with(outcomes[r], 0)) << "rank " << r << ": " << outcomes[r].output;
    EXPECT_EQ(outcomes[r].output.rfind("unusable|rank ", 0), 0u) << "rank " << r << ": " << outcomes[r].output;
    EXPECT_NE(outcomes[r].output.find("not permitted"), std::string::npos) << outcomes[r].output;
    EXPECT_NE(outcomes[r].output.find("|allreduce refused"), std::string::npos) << outcomes[r].output;
    EXPECT_EQ(outcomes[r].output, outcomes[0].output) << "ranks must agree";
  }
}

// Rank 2 exits abruptly while ranks 0 and 1 run allreduce after allreduce: each survivor gets a CommError (never a
// crash or a hang) within the 3 s no-progress timeout, and the error names rank 2 on at least one of them (the
// other may first see the survivor that failed and aborted its connections, as the Communicator does). With
// `list`, the buffer goes as a list of three pieces, which peers find through its piece table.
void peer_dies_mid_call(int delay_ms, bool list, bool through_segment = false) {
  const int n = 3;
  const size_t count = through_segment ? 1024 : 8u << 20;  // 4 KiB or 32 MiB of float32 per rank
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  auto outcomes = run_processes(n, [&](const ChildIo& io) {
    ChildRank rank(dir.path, io.rank, n, cma_options("3"));
    auto& [store, t, local] = rank;
    t.context = "allreduce on rank " + std::to_string(io.rank);
    if (!rank.over_shm(io)) return 3;
    std::vector<float> buf(count, 1.0f);
    char* p = reinterpret_cast<char*>(buf.data());
    const uint64_t at = reinterpret_cast<uintptr_t>(p), third = count / 3 * 4;
    const std::vector<cma::Extent> pieces = {{at, third}, {at + third, third}, {at + 2 * third, count * 4 - 2 * third}};
    cma::Local::Call call{Collective::allreduce, DataType::f32, ReduceOp::sum, -1, count, p, p};
    if (list) call = {Collective::allreduce, DataType::f32, ReduceOp::sum, -1, count, nullptr, nullptr, pieces, pieces};
    call.through_segment = through_segment;
    local.run(t, call);  // all alive
    if (io.rank == 2) {
      std::thread([delay_ms] {
        std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        _exit(42);
      }).detach();
      for (;;) local.run(t, call);
    }
    for (int i = 0; i < 100000; ++i) {
      auto start = std::chrono::steady_clock::now();
      try {
        local.run(t, call);
      } catch (const CommError& e) {
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        t.abort(e.what());  // as the Communicator does, so that the other survivor fails at once
        io.write("COMMERROR after " + std::to_string(s) + " s: " + e.what());
        io.finish();
        return s < 5.0 ? 0 : 5;
      }
    }
    io.write("all calls succeeded");
    io.finish();
    return 6;
  });
  EXPECT_TRUE(exited_with(outcomes[2], 42)) << "rank 2: " << outcomes[2].output;
  bool named = false;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(exited_with(outcomes[r], 0)) << "delay " << delay_ms << " list " << list << " rank " << r << ": "
                                             << outcomes[r].output;
    EXPECT_EQ(outcomes[r].output.rfind("COMMERROR", 0), 0u) << outcomes[r].output;
    named |= outcomes[r].output.find("rank 2") != std::string::npos;
  }
  EXPECT_TRUE(named) << outcomes[0].output << "\n" << outcomes[1].output;
}

// A rank that does not wait at a call's last barrier (reduce's non-roots in chunks through the segment, and
// broadcast's non-roots after their reads) may finish the call and exit while the root still waits there for a
// slower rank: that is not a failure. Rank 2 stops waiting for the call at once (a deadline) and comes back 0.7 s
// later; rank 1 finishes and exits meanwhile; the root must get the right result.
void finished_peer_exits_while_the_root_waits(Collective coll, size_t count, bool through_segment) {
  const int n = 3;
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  auto outcomes = run_processes(n, [&](const ChildIo& io) {
    int code = 0;
    {
      ChildRank rank(dir.path, io.rank, n, cma_options("5"));
      auto& [store, t, local] = rank;
      if (!rank.over_shm(io)) return 3;
      std::vector<float> in(count, 1.0f + static_cast<float>(io.rank)), out(count, 0.0f);
      char* dst = reinterpret_cast<char*>(coll == Collective::broadcast ? in.data() : out.data());
      cma::Local::Call call{coll, DataType::f32, ReduceOp::sum, 0, count, reinterpret_cast<char*>(in.data()), dst};
      call.through_segment = through_segment;
      if (io.rank == 2 && !local.run(t, call, std::chrono::steady_clock::now()))
        std::this_thread::sleep_for(std::chrono::milliseconds(700));
      else if (io.rank != 2)
        std::this_thread::sleep_for(std::chrono::milliseconds(150));
      try {
        local.run(t, call);
        const float want = coll == Collective::broadcast ? 1.0f : 6.0f;  // rank 0's 1, or 1 + 2 + 3
        const float got = coll == Collective::broadcast ? in[count - 1] : out[count - 1];
        io.write(io.rank != 0 || got == want ? "ok" : "wrong: " + std::to_string(got));
      } catch (const std::exception& e) {
        io.write(std::string("error: ") + e.what());
        code = 7;
      }
      if (io.rank == 1) {
        ::close(io.out_fd);  // reported; exits at once, not waiting for the others' reports as finish() does
        _exit(code);
      }
    }
    io.finish();
    return code;
  });
  for (int r = 0; r < n; ++r)
    EXPECT_TRUE(exited_with(outcomes[r], 0) && outcomes[r].output == "ok")
        << collective_name(coll) << " rank " << r << ": " << outcomes[r].output;
}

TEST(CmaProcessesErrors, APeerThatFinishedAndExitedIsNoFailure) {
  finished_peer_exits_while_the_root_waits(Collective::reduce, 8192, true);  // in chunks: 32 KiB
  finished_peer_exits_while_the_root_waits(Collective::broadcast, 8192, false);
}

TEST(CmaProcessesErrors, PeerDyingMidCallIsCommErrorNamingIt) {
  for (int delay_ms : {0, 15, 60}) peer_dies_mid_call(delay_ms, false);
}

TEST(CmaProcessesErrors, PeerDyingMidCallThroughTheSegmentIsCommErrorNamingIt) {
  for (int delay_ms : {0, 15}) peer_dies_mid_call(delay_ms, false, true);
}

TEST(CmaProcessesErrors, PeerDyingMidListCallIsCommErrorNamingIt) {
  for (int delay_ms : {0, 15}) peer_dies_mid_call(delay_ms, true);
}

// Rank 2 stops (SIGSTOP) between two calls, as a rank stuck in a debugger or swapped out would: ranks 0 and 1
// wait for it in the control segment and fail with a CommError naming it once the 2 s timeout has passed, not
// before and not much later; then rank 0 lets it continue.
TEST(CmaProcessesErrors, StoppedPeerFailsTheCallNamingItAfterTheTimeout) {
  const int n = 3;
  const double timeout = 2.0;
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  auto outcomes = run_processes(n, [&](const ChildIo& io) {
    ChildRank rank(dir.path, io.rank, n, cma_options("2"));
    auto& [store, t, local] = rank;
    if (!rank.over_shm(io)) return 3;
    std::vector<float> buf(1 << 18, 1.0f);
    char* p = reinterpret_cast<char*>(buf.data());
    local.allreduce(t, p, p, buf.size(), DataType::f32, ReduceOp::sum);  // all running
    if (io.rank == 2) {
      std::ofstream(dir.path + "/stopped.pid") << getpid();
      raise(SIGSTOP);
      io.write("continued");
      io.finish();
      return 0;
    }
    const auto start = std::chrono::steady_clock::now();
    std::string outcome = "no error";
    try {
      local.allreduce(t, p, p, buf.size(), DataType::f32, ReduceOp::sum);
    } catch (const CommError& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      outcome = "COMMERROR after " + std::to_string(s) + " s: " + e.what();
      if (s < timeout || s > timeout + 3) outcome = "WRONG TIME " + outcome;
    }
    if (io.rank == 0) {
      int pid = 0;
      std::ifstream(dir.path + "/stopped.pid") >> pid;
      if (pid > 0) kill(pid, SIGCONT);
    }
    io.write(outcome);
    io.finish();
    return 0;
  }, 60);
  for (int r = 0; r < n; ++r) ASSERT_TRUE(exited_with(outcomes[r], 0)) << "rank " << r << ": " << outcomes[r].output;
  EXPECT_EQ(outcomes[2].output, "continued");
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(outcomes[r].output.rfind("COMMERROR", 0), 0u) << outcomes[r].output;
    EXPECT_NE(outcomes[r].output.find("no progress for 2 s: rank 2 has not got to its call #2 on this path"),
              std::string::npos)
        << outcomes[r].output;
  }
}

// Lines of /proc/self/maps (or links under /proc/self/fd) that name the control segment.
int segment_mentions(const std::string& what) {
  int found = 0;
  if (what == "maps") {
    std::ifstream maps("/proc/self/maps");
    for (std::string line; std::getline(maps, line);) found += line.find("memfd:smartcoll-cma") != std::string::npos;
    return found;
  }
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    found += std::filesystem::read_symlink(e.path(), ec).string().find("memfd:smartcoll-cma") != std::string::npos;
  }
  return found;
}

// The segment has no name: once set up, every rank holds a mapping of it and no descriptor, nothing appears under
// /dev/shm, and the segment goes with the last process, also when ranks are killed.
TEST(CmaProcessesSetup, SegmentIsMappedWithoutDescriptorsAndLeavesNothingBehind) {
  const int n = 3;
  auto dev_shm = [] {
    std::vector<std::string> names;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) names.push_back(e.path().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  const auto before = dev_shm();
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  auto outcomes = run_processes(n, [&](const ChildIo& io) {
    ChildRank rank(dir.path, io.rank, n, cma_options());
    auto& [store, t, local] = rank;
    float x = 1.0f;
    local.allreduce(t, reinterpret_cast<char*>(&x), reinterpret_cast<char*>(&x), 1, DataType::f32, ReduceOp::sum);
    io.write(local.control() + " maps=" + std::to_string(segment_mentions("maps")) +
             " fds=" + std::to_string(segment_mentions("fd")) + " sum=" + std::to_string(x));
    io.finish();
    if (io.rank == 1) _exit(9);  // killed ranks leave nothing either
    return 0;
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(exited_with(outcomes[r], r == 1 ? 9 : 0)) << "rank " << r << ": " << outcomes[r].output;
    EXPECT_EQ(outcomes[r].output, "shm maps=1 fds=0 sum=3.000000") << "rank " << r;
  }
  EXPECT_EQ(dev_shm(), before);
}

}  // namespace
}  // namespace smartcoll
