// List collectives and alltoallv (docs/vectored.md): every list call bitwise equal to the same data fused by hand
// and run as one call with the same algorithm; alltoallv against a reference; mismatches fail by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/frame.h"
#include "ranks.h"
#include "smartcoll/comm.h"
#include "smartcoll/reduce.h"

namespace smartcoll {
namespace {

using harness::run_ranks;
using harness::test_options;

// Mixed sizes, odd counts, empty entries; the small segment size makes segments straddle entries.
const std::vector<size_t> kCounts = {7, 0, 1, 300, 33, 0, 1029, 5, 64, 2};

template <class T>
std::vector<std::vector<T>> random_list(const std::vector<size_t>& counts, size_t times, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-4, 4);
  std::vector<std::vector<T>> list;
  for (size_t c : counts) {
    std::vector<T> v(c * times);
    for (T& x : v) x = static_cast<T>(dist(gen));  // not exactly summable: the order of the sums shows
    list.push_back(std::move(v));
  }
  return list;
}

template <class T>
std::vector<T> concat(const std::vector<std::vector<T>>& list) {
  std::vector<T> all;
  for (const auto& v : list) all.insert(all.end(), v.begin(), v.end());
  return all;
}

template <class T>
std::vector<void*> pointers(std::vector<std::vector<T>>& list) {
  std::vector<void*> p;
  for (auto& v : list) p.push_back(v.data());
  return p;
}

template <class T>
void expect_bitwise(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(T)), 0) << what;
}

// Staging of tiny entries (list_stage_bytes): none, runs of kCounts' entries below 2 KiB (all but one in float32),
// and every entry (the whole list one piece).
const char* const kStages[] = {"0", "2048", "1048576"};

Options small_segments(const char* stage = "2048") {
  return test_options({{"segment_size", "256"}, {"streams", "2"}, {"list_stage_bytes", stage}});
}

template <class T>
void allreduce_matches_fused(DataType dt, ReduceOp op) {
  for (const char* stage : kStages)
    for (int n : {2, 3})
      for (Algorithm algo : {Algorithm::ring, Algorithm::rhd, Algorithm::rd, Algorithm::automatic})
        run_ranks(n, [&](Communicator& comm) {
          auto list = random_list<T>(kCounts, 1, 100 + comm.rank());
          std::vector<T> fused = concat(list);
          comm.allreduce(fused.data(), fused.data(), fused.size(), dt, op, algo)->wait();
          std::vector<void*> bufs = pointers(list);
          comm.allreduce(bufs, kCounts, dt, op, algo)->wait();
          expect_bitwise(concat(list), fused, std::string(algorithm_name(algo)) + " n=" + std::to_string(n) + " " +
                                                  std::string(dtype_name(dt)) + " " + std::string(op_name(op)) +
                                                  " list_stage_bytes=" + stage);
        }, small_segments(stage));
}

TEST(ListCollectives, AllreduceMatchesFusedCall) {
  allreduce_matches_fused<float>(DataType::f32, ReduceOp::sum);
  allreduce_matches_fused<float>(DataType::f32, ReduceOp::avg);
  allreduce_matches_fused<double>(DataType::f64, ReduceOp::max);
  allreduce_matches_fused<int32_t>(DataType::i32, ReduceOp::sum);
}

TEST(Frame, PartialTransfersResumeInsideAPiece) {
  // A message of a header and 300 pieces, moved in parts of random sizes (what the kernel takes per system call):
  // every call's iovecs must continue the message exactly where the last one stopped.
  std::mt19937 gen(11);
  std::vector<char> memory(1 << 20);
  std::vector<iovec> pieces;
  std::vector<const char*> stream;  // the address of every byte of the message, in order
  Descriptor header{};
  for (size_t i = 0; i < sizeof header; ++i) stream.push_back(reinterpret_cast<const char*>(&header) + i);
  for (size_t at = 0; pieces.size() < 300; at += 2 * 1024) {
    const size_t len = 1 + gen() % 1024;
    pieces.push_back({memory.data() + at, len});
    for (size_t i = 0; i < len; ++i) stream.push_back(memory.data() + at + i);
  }
  Op op;
  op.pieces = pieces.data();
  op.npieces = static_cast<uint32_t>(pieces.size());
  op.len = stream.size() - sizeof header;
  PieceCursor cursor;
  size_t done = 0, calls = 0;
  while (done < stream.size()) {
    iovec iov[kMaxIov + 1];
    const int n = frame(iov, &header, sizeof header, op, done, cursor);
    ASSERT_GT(n, 0);
    ASSERT_LE(n, kMaxIov + 1);
    size_t pos = done;
    for (int k = 0; k < n; ++k)
      for (size_t b = 0; b < iov[k].iov_len; ++b, ++pos)
        ASSERT_EQ(static_cast<const char*>(iov[k].iov_base) + b, stream[pos]) << "call " << calls << " byte " << pos;
    done += 1 + gen() % std::min<size_t>(pos - done, 700);  // the kernel moves part of what was offered
    ++calls;
  }
  EXPECT_GT(calls, 100u);
}

TEST(ListCollectives, ManyTinyEntriesInLargeSegments) {
  // Segments spanning thousands of entries: one message gathers or scatters more pieces than one system call
  // takes.
  std::vector<size_t> counts;
  std::mt19937 gen(5);
  for (int i = 0; i < 3000; ++i) counts.push_back(gen() % 40);
  counts.insert(counts.begin() + 1000, 700000);
  counts.push_back(300001);
  for (Algorithm algo : {Algorithm::ring, Algorithm::rhd})
    run_ranks(3, [&](Communicator& comm) {
      auto list = random_list<float>(counts, 1, 400 + comm.rank());
      std::vector<float> fused = concat(list);
      comm.allreduce(fused.data(), fused.data(), fused.size(), DataType::f32, ReduceOp::sum, algo)->wait();
      std::vector<void*> bufs = pointers(list);
      comm.allreduce(bufs, counts, DataType::f32, ReduceOp::sum, algo)->wait();
      expect_bitwise(concat(list), fused, "many tiny entries, " + std::string(algorithm_name(algo)));
      // one message spans thousands of entries, each its own piece
    }, test_options({{"segment_size", "8388608"}, {"list_stage_bytes", "0"}}));
}

TEST(ListCollectives, HierarchicalAllreduceMatchesFusedCall) {
  // 2 hosts x 2 ranks (the host knob): reduce-scatter per host, allreduce across hosts, allgather per host.
  const std::vector<std::string> host_of = {"a", "b", "a", "b"};
  harness::run_threads(4, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 4, std::move(store),
                      test_options({{"host", host_of[static_cast<size_t>(r)]}, {"segment_size", "256"}}));
    auto list = random_list<float>(kCounts, 1, 500 + r);
    std::vector<float> fused = concat(list);
    comm.allreduce(fused.data(), fused.data(), fused.size(), DataType::f32, ReduceOp::sum, Algorithm::hier)->wait();
    std::vector<void*> bufs = pointers(list);
    comm.allreduce(bufs, kCounts, DataType::f32, ReduceOp::sum, Algorithm::hier)->wait();
    expect_bitwise(concat(list), fused, "hier rank " + std::to_string(r));
  });
}

TEST(ListCollectives, HierarchicalReduceScatterAllgatherBroadcastMatchTheRing) {
  // 2 hosts x 2 ranks, interleaved: the list forms of the hierarchical algorithms against the ring's (the chain's).
  const std::vector<std::string> host_of = {"a", "b", "a", "b"};
  const int n = 4;
  harness::run_threads(n, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, n, std::move(store),
                      test_options({{"host", host_of[static_cast<size_t>(r)]}, {"segment_size", "256"}}));
    auto name = [&](const char* what) { return std::string(what) + " rank " + std::to_string(r); };
    // Integers: reduce_scatter's sums are exact in any order.
    const auto ins = random_list<int32_t>(kCounts, static_cast<size_t>(n), 7 + r);
    std::vector<const void*> in_ptrs;
    for (auto& v : ins) in_ptrs.push_back(v.data());
    auto hier_out = random_list<int32_t>(kCounts, 1, 0), ring_out = hier_out;
    std::vector<void*> hier_ptrs = pointers(hier_out), ring_ptrs = pointers(ring_out);
    comm.reduce_scatter(in_ptrs, hier_ptrs, kCounts, DataType::i32, ReduceOp::sum, Algorithm::hier)->wait();
    comm.reduce_scatter(in_ptrs, ring_ptrs, kCounts, DataType::i32, ReduceOp::sum, Algorithm::ring)->wait();
    expect_bitwise(concat(hier_out), concat(ring_out), name("reduce_scatter"));

    const auto mine = random_list<float>(kCounts, 1, 50 + r);
    std::vector<const void*> mine_ptrs;
    for (auto& v : mine) mine_ptrs.push_back(v.data());
    auto hier_all = random_list<float>(kCounts, static_cast<size_t>(n), 0), ring_all = hier_all;
    std::vector<void*> hier_all_ptrs = pointers(hier_all), ring_all_ptrs = pointers(ring_all);
    comm.allgather(mine_ptrs, hier_all_ptrs, kCounts, DataType::f32, Algorithm::hier)->wait();
    comm.allgather(mine_ptrs, ring_all_ptrs, kCounts, DataType::f32, Algorithm::ring)->wait();
    expect_bitwise(concat(hier_all), concat(ring_all), name("allgather"));

    auto buf = random_list<double>(kCounts, 1, 90 + r);
    const std::vector<double> root_data = concat(random_list<double>(kCounts, 1, 90 + 1));
    std::vector<void*> buf_ptrs = pointers(buf);
    comm.broadcast(buf_ptrs, kCounts, DataType::f64, 1, Algorithm::hier)->wait();
    expect_bitwise(concat(buf), root_data, name("broadcast"));
  });
}

TEST(ListCollectives, CodecsMatchFusedCalls) {
  // Codec blocks (32 floats) straddle the list's buffers: those steps go through a segment's staging.
  for (int n : {2, 3})
    for (const char* name : {"bfp16", "mxfp4_e2m1", "bf16"})
      run_ranks(n, [&](Communicator& comm) {
        const Codec codec = Codec::parse(name);
        auto list = random_list<float>(kCounts, 1, 200 + comm.rank());
        std::vector<float> fused = concat(list);
        comm.allreduce(fused.data(), fused.data(), fused.size(), DataType::f32, ReduceOp::avg, Algorithm::ring,
                       codec)->wait();
        std::vector<void*> bufs = pointers(list);
        comm.allreduce(bufs, kCounts, DataType::f32, ReduceOp::avg, Algorithm::ring, codec)->wait();
        expect_bitwise(concat(list), fused, std::string("allreduce ") + name + " n=" + std::to_string(n));
        std::vector<float> raw = concat(random_list<float>(kCounts, 1, 200 + comm.rank()));
        comm.allreduce(raw.data(), raw.data(), raw.size(), DataType::f32, ReduceOp::avg, Algorithm::ring)->wait();
        EXPECT_NE(std::memcmp(raw.data(), fused.data(), raw.size() * sizeof(float)), 0) << name << " compressed";

        auto ins = random_list<float>(kCounts, static_cast<size_t>(n), 300 + comm.rank());
        std::vector<float> by_rank;
        for (int j = 0; j < n; ++j)
          for (size_t i = 0; i < kCounts.size(); ++i)
            by_rank.insert(by_rank.end(), ins[i].begin() + j * kCounts[i], ins[i].begin() + (j + 1) * kCounts[i]);
        std::vector<float> fused_out(by_rank.size() / n);
        comm.reduce_scatter(by_rank.data(), fused_out.data(), fused_out.size(), DataType::f32, ReduceOp::sum,
                            codec)->wait();
        auto outs = random_list<float>(kCounts, 1, 0);
        std::vector<const void*> in_ptrs;
        for (auto& v : ins) in_ptrs.push_back(v.data());
        std::vector<void*> out_ptrs = pointers(outs);
        comm.reduce_scatter(in_ptrs, out_ptrs, kCounts, DataType::f32, ReduceOp::sum, Algorithm::automatic,
                            codec)->wait();
        expect_bitwise(concat(outs), fused_out, std::string("reduce_scatter ") + name);
      }, small_segments());
}

TEST(ListCollectives, CodecOwnerModeIsRefusedByName) {
  run_ranks(2, [&](Communicator& comm) {
    std::vector<float> a(40);
    std::vector<void*> bufs = {a.data()};
    std::vector<size_t> counts = {40};
    try {
      comm.allreduce(bufs, counts, DataType::f32, ReduceOp::sum, Algorithm::automatic, Codec::parse("bfp16"));
      ADD_FAILURE() << "owner mode with a codec was accepted for a list";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("codec_mode hop only"), std::string::npos) << e.what();
    }
  }, test_options({{"codec_mode", "owner"}}));
}

TEST(ListCollectives, ReduceScatterAllgatherBroadcastMatchFusedCalls) {
  for (const char* stage : kStages)
    for (int n : {2, 3})
      run_ranks(n, [&](Communicator& comm) {
        const int r = comm.rank();
        const size_t total = [] { size_t t = 0; for (size_t c : kCounts) t += c; return t; }();
        // reduce_scatter: rank j's block of every entry, in list order, is block j of the fused vector.
        auto ins = random_list<float>(kCounts, static_cast<size_t>(n), 7 + r);
        std::vector<float> fused_in;
        for (int j = 0; j < n; ++j)
          for (size_t i = 0; i < kCounts.size(); ++i)
            fused_in.insert(fused_in.end(), ins[i].begin() + j * kCounts[i], ins[i].begin() + (j + 1) * kCounts[i]);
        std::vector<float> fused_out(total);
        comm.reduce_scatter(fused_in.data(), fused_out.data(), total, DataType::f32, ReduceOp::sum)->wait();
        auto outs = random_list<float>(kCounts, 1, 0);
        std::vector<const void*> in_ptrs;
        for (auto& v : ins) in_ptrs.push_back(v.data());
        std::vector<void*> out_ptrs = pointers(outs);
        comm.reduce_scatter(in_ptrs, out_ptrs, kCounts, DataType::f32, ReduceOp::sum)->wait();
        expect_bitwise(concat(outs), fused_out, "reduce_scatter n=" + std::to_string(n) + " stage " + stage);

        // allgather: entry i of rank j lands at block j of output i.
        auto mine = random_list<float>(kCounts, 1, 50 + r);
        std::vector<float> gathered(total * n);
        const std::vector<float> mine_fused = concat(mine);
        comm.allgather(mine_fused.data(), gathered.data(), total, DataType::f32)->wait();
        std::vector<float> want;
        for (size_t i = 0, off = 0; i < kCounts.size(); off += kCounts[i], ++i)
          for (int j = 0; j < n; ++j)
            want.insert(want.end(), gathered.begin() + j * total + off,
                        gathered.begin() + j * total + off + kCounts[i]);
        for (Algorithm algo : {Algorithm::bruck, Algorithm::ring}) {
          auto all = random_list<float>(kCounts, static_cast<size_t>(n), 0);
          std::vector<const void*> mine_ptrs;
          for (auto& v : mine) mine_ptrs.push_back(v.data());
          std::vector<void*> all_ptrs = pointers(all);
          comm.allgather(mine_ptrs, all_ptrs, kCounts, DataType::f32, algo)->wait();
          expect_bitwise(concat(all), want, "allgather " + std::string(algorithm_name(algo)) + " n=" +
                                                std::to_string(n) + " stage " + stage);
        }

        // broadcast from the last rank, with the chain and the tree.
        for (Algorithm algo : {Algorithm::chain, Algorithm::tree}) {
          auto buf = random_list<double>(kCounts, 1, 90 + r);
          const std::vector<double> root_data = concat(random_list<double>(kCounts, 1, 90 + n - 1));
          std::vector<void*> ptrs = pointers(buf);
          comm.broadcast(ptrs, kCounts, DataType::f64, n - 1, algo)->wait();
          expect_bitwise(concat(buf), root_data, "broadcast " + std::string(algorithm_name(algo)) + " stage " + stage);
        }
      }, small_segments(stage));
}

// Only runs of two or more consecutive entries under list_stage_bytes are staged: here (float32, 2048) entries 1-4
// (60 bytes, the empty one included) and 8-9 (120 bytes); entry 6 is small but alone, 0, 5 and 7 are large.
TEST(ListCollectives, StagingCopiesRunsOfTinyEntriesOnly) {
  const std::vector<size_t> counts = {1000, 3, 5, 0, 7, 600, 2, 100000, 10, 20};
  for (const char* stage : {"0", "2048"})
    for (Algorithm algo : {Algorithm::ring, Algorithm::cma})
      run_ranks(2, [&](Communicator& comm) {
        const std::string what = std::string(algorithm_name(algo)) + " list_stage_bytes=" + stage;
        const bool staging = std::string(stage) != "0";
        auto list = random_list<float>(counts, 1, 60 + comm.rank());
        std::vector<float> fused = concat(list);
        comm.allreduce(fused.data(), fused.data(), fused.size(), DataType::f32, ReduceOp::sum, algo)->wait();
        uint64_t before = comm.engine_stats().staged_bytes;
        comm.allreduce(pointers(list), counts, DataType::f32, ReduceOp::sum, algo)->wait();
        expect_bitwise(concat(list), fused, "allreduce " + what);
        EXPECT_EQ(comm.engine_stats().staged_bytes - before, staging ? 180u : 0u) << what;

        // allgather: the input's runs (180 bytes) and the output's, once per rank's block (2 x 180)
        auto mine = random_list<float>(counts, 1, 70 + comm.rank());
        const std::vector<float> mine_fused = concat(mine);
        std::vector<float> gathered(mine_fused.size() * 2);
        comm.allgather(mine_fused.data(), gathered.data(), mine_fused.size(), DataType::f32)->wait();
        auto all = random_list<float>(counts, 2, 0);
        std::vector<const void*> mine_ptrs;
        for (auto& v : mine) mine_ptrs.push_back(v.data());
        before = comm.engine_stats().staged_bytes;
        comm.allgather(mine_ptrs, pointers(all), counts, DataType::f32,
                       algo == Algorithm::cma ? Algorithm::cma : Algorithm::ring)->wait();
        EXPECT_EQ(comm.engine_stats().staged_bytes - before, staging ? 540u : 0u) << what;
        for (size_t i = 0, off = 0; i < counts.size(); off += counts[i], ++i)
          for (size_t j = 0; j < 2 && counts[i]; ++j)  // an empty entry's data() may be null
            ASSERT_EQ(std::memcmp(all[i].data() + j * counts[i], gathered.data() + j * mine_fused.size() + off,
                                  counts[i] * sizeof(float)), 0)
                << "allgather entry " << i << " block " << j << " " << what;
      }, test_options({{"list_stage_bytes", stage}}));
}

TEST(ListCollectives, OneRankCopiesAndEmptyListsAreFine) {
  run_ranks(1, [&](Communicator& comm) {
    auto ins = random_list<float>(kCounts, 1, 3);
    auto outs = random_list<float>(kCounts, 1, 4);
    std::vector<const void*> in_ptrs;
    for (auto& v : ins) in_ptrs.push_back(v.data());
    std::vector<void*> out_ptrs = pointers(outs);
    comm.allgather(in_ptrs, out_ptrs, kCounts, DataType::f32)->wait();
    expect_bitwise(concat(outs), concat(ins), "allgather of one rank");
  });
  run_ranks(2, [&](Communicator& comm) {
    std::vector<void*> none;
    comm.allreduce(none, {}, DataType::f32, ReduceOp::sum)->wait();
    std::vector<float> x(4, 1.0f);
    comm.allreduce(x.data(), x.data(), 4, DataType::f32, ReduceOp::sum)->wait();  // numbering stays in step
    for (float v : x) ASSERT_EQ(v, 2.0f);
  });
}

TEST(ListCollectives, MismatchedListsFailNamingTheLayout) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](Communicator& comm) {
    // The same total (8 elements) cut differently: without the layout check the sums would mix entries.
    std::vector<size_t> counts = comm.rank() == 0 ? std::vector<size_t>{3, 5} : std::vector<size_t>{5, 3};
    std::vector<float> a(5, 1.0f), b(5, 1.0f);
    std::vector<void*> bufs = {a.data(), b.data()};
    try {
      comm.allreduce(bufs, counts, DataType::f32, ReduceOp::sum)->wait(std::chrono::seconds(30));
    } catch (const CommError& e) {
      errors[comm.rank()] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("ranks disagree"), std::string::npos) << e;
    EXPECT_NE(e.find("list of counts digest"), std::string::npos) << e;
  }
}

TEST(ListCollectives, BadArgumentsAreRefusedLocally) {
  run_ranks(2, [&](Communicator& comm) {
    std::vector<float> a(3), b(2);
    std::vector<void*> bufs = {a.data(), nullptr};
    std::vector<size_t> counts = {3, 2};
    try {
      comm.allreduce(bufs, counts, DataType::f32, ReduceOp::sum);
      ADD_FAILURE() << "a null entry with elements was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("buffer 1 is null"), std::string::npos) << e.what();
    }
    bufs[1] = b.data();
    try {
      comm.allreduce(bufs, counts, DataType::f32, ReduceOp::sum, Algorithm::switch_);
      ADD_FAILURE() << "algo switch was accepted for a list";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("list calls do not take the aggregation switch"), std::string::npos)
          << e.what();
    }
  });
}

// ---- lists on the same-host path (algo cma): every piece read and written where it is ----

// auto picks the same-host path at every size; the calls' counters tell which path each took.
Options same_host(const char* stage = "2048") {
  return test_options({{"rhd_max_bytes", "0"}, {"list_stage_bytes", stage}});
}

struct ListCase {
  DataType dt;
  ReduceOp op;
};
constexpr ListCase kSameHostCases[] = {{DataType::f32, ReduceOp::sum},
                                       {DataType::f32, ReduceOp::avg},
                                       {DataType::f64, ReduceOp::max},
                                       {DataType::i32, ReduceOp::sum},
                                       {DataType::bf16, ReduceOp::sum}};

using Bytes = std::vector<char>;

// Entries of `counts[i] * times` random elements of `dt` (inexact floats: the order of the sums shows).
std::vector<Bytes> random_entries(DataType dt, const std::vector<size_t>& counts, size_t times, unsigned seed) {
  std::vector<Bytes> list;
  for (const auto& entry : random_list<double>(counts, times, seed)) {
    Bytes b(entry.size() * dtype_size(dt));
    for (size_t k = 0; k < entry.size(); ++k) {
      const double x = entry[k] * 1.37;
      const float f = static_cast<float>(x);
      const int32_t i = static_cast<int32_t>(x * 1e8);
      const uint16_t h = float_to_bf16(f);
      const void* from = dt == DataType::f64 ? static_cast<const void*>(&x)
                         : dt == DataType::f32 ? static_cast<const void*>(&f)
                         : dt == DataType::i32 ? static_cast<const void*>(&i)
                                               : static_cast<const void*>(&h);
      std::memcpy(&b[k * dtype_size(dt)], from, dtype_size(dt));
    }
    list.push_back(std::move(b));
  }
  return list;
}

Bytes joined(const std::vector<Bytes>& list) {
  Bytes all;
  for (const Bytes& b : list) all.insert(all.end(), b.begin(), b.end());
  return all;
}

// Entries of n blocks each, as the fused call takes them: block j of every entry, in list order, then block j + 1.
Bytes by_rank(const std::vector<Bytes>& list, int n) {
  Bytes all;
  for (int j = 0; j < n; ++j)
    for (const Bytes& b : list) {
      const size_t block = b.size() / static_cast<size_t>(n);
      all.insert(all.end(), b.begin() + static_cast<ptrdiff_t>(j * block),
                 b.begin() + static_cast<ptrdiff_t>((j + 1) * block));
    }
  return all;
}

std::vector<void*> addresses(std::vector<Bytes>& list) {
  std::vector<void*> p;
  for (Bytes& b : list) p.push_back(b.data());
  return p;
}

// Every list collective of every case, in place and out of place, against the fused call on the same path: the
// same bits on every rank, and every call (the fused ones too) counted on the same-host path.
void same_host_lists_match_fused(int n, const std::vector<size_t>& counts, Algorithm algo,
                                 const char* stage = "2048") {
  size_t total = 0;
  for (size_t c : counts) total += c;
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const uint64_t before = comm.engine_stats().same_host_calls;
    uint64_t calls = 0;
    for (const ListCase& c : kSameHostCases) {
      const std::string what = std::string(dtype_name(c.dt)) + " " + std::string(op_name(c.op)) + " n=" +
                               std::to_string(n) + " algo " + std::string(algorithm_name(algo)) + " stage " + stage;
      const size_t esize = dtype_size(c.dt);
      // allreduce (in place)
      auto list = random_entries(c.dt, counts, 1, 10 + r);
      Bytes fused = joined(list);
      comm.allreduce(fused.data(), fused.data(), total, c.dt, c.op, Algorithm::cma)->wait();
      comm.allreduce(addresses(list), counts, c.dt, c.op, algo)->wait();
      expect_bitwise(joined(list), fused, "allreduce " + what);
      calls += 2;
      if (n == 2) {  // two operands in either order give the same bits: the TCP list call agrees too
        auto tcp = random_entries(c.dt, counts, 1, 10 + r);
        comm.allreduce(addresses(tcp), counts, c.dt, c.op, Algorithm::ring)->wait();
        expect_bitwise(joined(tcp), fused, "allreduce over TCP (ring) " + what);
      }

      // reduce_scatter: out of place, then in place (out[i] is this rank's block of x[i])
      auto ins = random_entries(c.dt, counts, static_cast<size_t>(n), 20 + r);
      const Bytes fused_in = by_rank(ins, n);
      Bytes want(total * esize);
      comm.reduce_scatter(fused_in.data(), want.data(), total, c.dt, c.op, std::nullopt, Algorithm::cma)->wait();
      std::vector<const void*> in_ptrs;
      for (const Bytes& b : ins) in_ptrs.push_back(b.data());
      auto outs = random_entries(c.dt, counts, 1, 0);
      comm.reduce_scatter(in_ptrs, addresses(outs), counts, c.dt, c.op, algo)->wait();
      expect_bitwise(joined(outs), want, "reduce_scatter " + what);
      std::vector<void*> in_place;
      for (size_t i = 0; i < counts.size(); ++i) in_place.push_back(ins[i].data() + r * counts[i] * esize);
      comm.reduce_scatter(in_ptrs, in_place, counts, c.dt, c.op, algo)->wait();
      Bytes got;
      for (size_t i = 0; i < counts.size(); ++i)
        got.insert(got.end(), ins[i].begin() + static_cast<ptrdiff_t>(r * counts[i] * esize),
                   ins[i].begin() + static_cast<ptrdiff_t>((r + 1) * counts[i] * esize));
      expect_bitwise(got, want, "reduce_scatter in place " + what);
      calls += 3;

      // allgather: out of place, then in place (x[i] is this rank's block of out[i])
      auto mine = random_entries(c.dt, counts, 1, 30 + r);
      const Bytes mine_fused = joined(mine);
      Bytes gathered(total * esize * static_cast<size_t>(n));
      comm.allgather(mine_fused.data(), gathered.data(), total, c.dt, std::nullopt, Algorithm::cma)->wait();
      std::vector<const void*> mine_ptrs;
      for (const Bytes& b : mine) mine_ptrs.push_back(b.data());
      auto all = random_entries(c.dt, counts, static_cast<size_t>(n), 0);
      comm.allgather(mine_ptrs, addresses(all), counts, c.dt, algo)->wait();
      expect_bitwise(by_rank(all, n), gathered, "allgather " + what);
      std::vector<const void*> own_block;
      for (size_t i = 0; i < counts.size(); ++i) {
        const size_t block = counts[i] * esize;
        for (int j = 0; j < n; ++j)  // the other blocks are overwritten
          std::fill_n(all[i].begin() + static_cast<ptrdiff_t>(j * block), block, static_cast<char>(0x5a));
        std::copy(mine[i].begin(), mine[i].end(), all[i].begin() + static_cast<ptrdiff_t>(r * block));
        own_block.push_back(all[i].data() + r * block);
      }
      comm.allgather(own_block, addresses(all), counts, c.dt, algo)->wait();
      expect_bitwise(by_rank(all, n), gathered, "allgather in place " + what);
      calls += 3;

      // broadcast from the last rank
      auto buf = random_entries(c.dt, counts, 1, 40 + r);
      comm.broadcast(addresses(buf), counts, c.dt, n - 1, algo)->wait();
      expect_bitwise(joined(buf), joined(random_entries(c.dt, counts, 1, 40 + n - 1)), "broadcast " + what);
      calls += 1;
    }
    EXPECT_EQ(comm.engine_stats().same_host_calls - before, calls) << "calls that did not take the same-host path";
  }, same_host(stage));
}

// Mixed sizes with empty entries and odd counts; one entry larger than the reduce phase's staging piece, so that
// pieces of the list straddle its pieces.
const std::vector<size_t> kSameHostCounts = {7, 0, 1, 300, 33, 0, 1029, 5, 100003, 64, 2, 0};

TEST(SameHostLists, EveryCollectiveMatchesTheFusedCall) {
  for (int n : {2, 3, 4}) same_host_lists_match_fused(n, kSameHostCounts, Algorithm::automatic);
  for (const char* stage : kStages) same_host_lists_match_fused(3, kSameHostCounts, Algorithm::cma, stage);
}

// 3000 entries of 0 to 2 elements: more pieces than one process_vm_readv takes (IOV_MAX), on both sides of a read,
// and piece tables of 48 KB.
TEST(SameHostLists, ListsLongerThanIovMax) {
  std::vector<size_t> counts(3000);
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = (i * 7) % 3;
  same_host_lists_match_fused(2, counts, Algorithm::cma, "0");
}

// Lists cut differently (the same total) fail on every rank before any read, naming both calls with their
// layouts; so does a list against one buffer.
TEST(SameHostLists, MismatchedLayoutsNameBothCalls) {
  std::vector<std::string> errors(2), against_buffer(2);
  run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    std::vector<size_t> counts = r == 0 ? std::vector<size_t>{3, 5} : std::vector<size_t>{5, 3};
    std::vector<float> a(5, 1.0f), b(5, 1.0f);
    std::vector<void*> bufs = {a.data(), b.data()};
    try {
      comm.allreduce(bufs, counts, DataType::f32, ReduceOp::sum, Algorithm::cma)->wait(std::chrono::seconds(30));
    } catch (const CommError& e) {
      errors[r] = e.what();
    }
  });
  run_ranks(2, [&](Communicator& comm) {
    std::vector<float> a(8, 1.0f);
    const std::vector<size_t> counts = {8};
    std::vector<void*> bufs = {a.data()};
    try {
      if (comm.rank() == 0)
        comm.allreduce(bufs, counts, DataType::f32, ReduceOp::sum, Algorithm::cma)->wait(std::chrono::seconds(30));
      else
        comm.allreduce(a.data(), a.data(), 8, DataType::f32, ReduceOp::sum, Algorithm::cma)
            ->wait(std::chrono::seconds(30));
    } catch (const CommError& e) {
      against_buffer[comm.rank()] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("ranks disagree"), std::string::npos) << e;
    const size_t first = e.find("a list of counts digest ");
    ASSERT_NE(first, std::string::npos) << e;
    const size_t second = e.find("a list of counts digest ", first + 1);
    ASSERT_NE(second, std::string::npos) << e;
    EXPECT_NE(e.substr(first, 32), e.substr(second, 32)) << e;
  }
  for (const std::string& e : against_buffer) {
    EXPECT_NE(e.find("ranks disagree"), std::string::npos) << e;
    EXPECT_NE(e.find("allreduce(count=8, float32, op=sum, algo=cma)"), std::string::npos) << e;
    EXPECT_NE(e.find("allreduce(count=8, float32, op=sum, algo=cma, a list of counts digest"), std::string::npos)
        << e;
  }
}

// auto takes the same-host path for a list exactly where it takes it for one buffer of the same bytes: below and
// above rhd_max_bytes (the default, 256 KiB), for every collective. A list of views of one buffer (pieces that
// follow each other in memory, which the path reads as one) gives the same bits as the buffer itself.
TEST(SameHostLists, AutoPicksThePathAsForOneBufferOfTheSameBytes) {
  run_ranks(3, [&](Communicator& comm) {
    const int n = comm.size();
    for (const std::vector<size_t>& counts : {kCounts, kSameHostCounts}) {
      size_t total = 0;
      for (size_t c : counts) total += c;
      auto path_of = [&comm](const std::function<void()>& call) {
        const uint64_t before = comm.engine_stats().same_host_calls;
        call();
        return comm.engine_stats().same_host_calls - before;
      };
      std::vector<float> one = harness::noise(comm.rank(), total * n), whole(total * n);
      std::vector<void*> views;
      std::vector<const void*> ins;
      for (size_t i = 0, off = 0; i < counts.size(); off += counts[i++]) views.push_back(one.data() + off);
      const std::string what = std::to_string(total) + " elements";
      std::vector<float> fused(one.begin(), one.begin() + static_cast<ptrdiff_t>(total));
      EXPECT_EQ(path_of([&] {
                  comm.allreduce(fused.data(), fused.data(), total, DataType::f32, ReduceOp::sum)->wait();
                }),
                path_of([&] { comm.allreduce(views, counts, DataType::f32, ReduceOp::sum)->wait(); }))
          << "allreduce " << what;
      expect_bitwise(std::vector<float>(one.begin(), one.begin() + static_cast<ptrdiff_t>(total)), fused,
                     "allreduce of views " + what);
      EXPECT_EQ(path_of([&] { comm.broadcast(whole.data(), total, DataType::f32, 0)->wait(); }),
                path_of([&] { comm.broadcast(views, counts, DataType::f32, 0)->wait(); }))
          << "broadcast " << what;
      for (void* v : views) ins.push_back(v);
      std::vector<Bytes> outs;
      for (size_t c : counts) outs.emplace_back(c * 4 * n);
      EXPECT_EQ(path_of([&] { comm.allgather(one.data(), whole.data(), total, DataType::f32)->wait(); }),
                path_of([&] { comm.allgather(ins, addresses(outs), counts, DataType::f32)->wait(); }))
          << "allgather " << what;
      // One buffer of n blocks as a list of its n blocks, one entry each: the fused call's bits too.
      std::vector<float> block(total), from_list(total);
      std::vector<const void*> rank_blocks;
      for (int j = 0; j < n; ++j) rank_blocks.push_back(one.data() + static_cast<size_t>(j) * total);
      const std::vector<size_t> one_entry = {total};
      std::vector<void*> out_entry = {from_list.data()};
      EXPECT_EQ(path_of([&] {
                  comm.reduce_scatter(one.data(), block.data(), total, DataType::f32, ReduceOp::sum)->wait();
                }),
                path_of([&] {
                  std::vector<const void*> whole_in = {one.data()};
                  comm.reduce_scatter(whole_in, out_entry, one_entry, DataType::f32, ReduceOp::sum)->wait();
                }))
          << "reduce_scatter " << what;
      expect_bitwise(from_list, block, "reduce_scatter of one entry " + what);
    }
    EXPECT_GT(comm.engine_stats().same_host_calls, 0u);
  });
}

// A list with a codec keeps the TCP path (the same-host path has no codecs): auto goes around it, algo cma is
// refused by name.
TEST(SameHostLists, CodecsKeepTheTcpPath) {
  run_ranks(2, [&](Communicator& comm) {
    auto list = random_list<float>(kSameHostCounts, 1, 5 + comm.rank());
    const uint64_t before = comm.engine_stats().same_host_calls;
    comm.allreduce(pointers(list), kSameHostCounts, DataType::f32, ReduceOp::sum, Algorithm::automatic,
                   Codec::parse("bfp16"))->wait();
    EXPECT_EQ(comm.engine_stats().same_host_calls, before);
    try {
      comm.allreduce(pointers(list), kSameHostCounts, DataType::f32, ReduceOp::sum, Algorithm::cma,
                     Codec::parse("bfp16"));
      ADD_FAILURE() << "a codec was accepted on the same-host path";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("does not support codecs"), std::string::npos) << e.what();
    }
  }, same_host());
}

TEST(Alltoallv, MatchesReference) {
  for (int n : {2, 3, 4})
    run_ranks(n, [&](Communicator& comm) {
      const int r = comm.rank();
      // Rank i sends (i + 2 j) % 5 elements to rank j (some of them zero), valued 1000 i + 100 j + k.
      auto count = [](int from, int to) { return static_cast<size_t>((from + 2 * to) % 5); };
      std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
      size_t st = 0, rt = 0;
      for (int j = 0; j < n; ++j) {
        sc[j] = count(r, j), rc[j] = count(j, r);
        sd[j] = st + 1, rd[j] = rt + 2;  // gaps between blocks: displacements are honoured
        st += sc[j] + 1, rt += rc[j] + 2;
      }
      std::vector<int64_t> in(st + 1), out(rt + 2, -1);
      for (int j = 0; j < n; ++j)
        for (size_t k = 0; k < sc[j]; ++k) in[sd[j] + k] = 1000 * r + 100 * j + static_cast<int64_t>(k);
      comm.alltoallv(in.data(), sc, sd, out.data(), rc, rd, DataType::i64)->wait();
      std::vector<int64_t> want(rt + 2, -1);
      for (int j = 0; j < n; ++j)
        for (size_t k = 0; k < rc[j]; ++k) want[rd[j] + k] = 1000 * j + 100 * r + static_cast<int64_t>(k);
      ASSERT_EQ(out, want) << "rank " << r << " of " << n;
    });
}

TEST(Alltoallv, ListFormReadsAndWritesEachBufferInPlace) {
  // One buffer per peer each way, blocks of 0 to 2999 elements (large ones span many segments), each against
  // the values its sender put there; the buffers after each output must stay untouched.
  for (const char* stage : {"0", "1048576"})
    for (int n : {2, 3, 4})
      run_ranks(n, [&](Communicator& comm) {
        const int r = comm.rank();
        // Rank 1 sends nothing (empty blocks, to itself too).
        auto count = [](int from, int to) {
          return from == 1 ? size_t{0} : static_cast<size_t>((from * 1237 + to * 311 + 5) % 3000);
        };
        std::vector<std::vector<double>> ins(n), outs(n);
        std::vector<size_t> sc(n), rc(n);
        for (int j = 0; j < n; ++j) {
          sc[j] = count(r, j), rc[j] = count(j, r);
          ins[j].resize(sc[j]);
          for (size_t k = 0; k < sc[j]; ++k) ins[j][k] = 1e6 * r + 1e3 * j + static_cast<double>(k);
          outs[j].assign(rc[j] + 1, -1.0);  // one element past the block
        }
        std::vector<const void*> in_ptrs;
        std::vector<void*> out_ptrs;
        for (int j = 0; j < n; ++j) in_ptrs.push_back(ins[j].data()), out_ptrs.push_back(outs[j].data());
        comm.alltoallv(in_ptrs, sc, out_ptrs, rc, DataType::f64)->wait();
        for (int j = 0; j < n; ++j) {
          std::vector<double> want(rc[j] + 1, -1.0);
          for (size_t k = 0; k < rc[j]; ++k) want[k] = 1e6 * j + 1e3 * r + static_cast<double>(k);
          ASSERT_EQ(outs[j], want) << "rank " << r << " of " << n << ", block from " << j << ", stage " << stage;
        }
      }, test_options({{"segment_size", "4096"}, {"list_stage_bytes", stage}}));
}

TEST(Alltoallv, ListFormRefusesOverlapsAndWrongLengths) {
  run_ranks(2, [&](Communicator& comm) {
    std::vector<float> a(8), b(8), c(8);
    const std::vector<size_t> counts = {4, 4};
    auto refused = [&](std::vector<const void*> ins, std::vector<void*> outs, std::vector<size_t> sc,
                       const std::string& error) {
      try {
        comm.alltoallv(ins, sc, outs, counts, DataType::f32);
        ADD_FAILURE() << "accepted; expected: " << error;
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(error), std::string::npos) << e.what();
      }
    };
    refused({a.data(), b.data()}, {c.data(), a.data() + 2}, counts, "alltoallv: input 0 overlaps output 1");
    refused({a.data(), a.data()}, {c.data(), c.data() + 3}, counts, "alltoallv: outputs 0 and 1 overlap");
    // One buffer each way: receive blocks that overlap, and a send block inside the output.
    const std::vector<size_t> two = {2, 2}, packed = {0, 2}, crossed = {0, 1};
    try {
      comm.alltoallv(a.data(), two, packed, b.data(), two, crossed, DataType::f32);
      ADD_FAILURE() << "overlapping receive blocks accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("alltoallv: outputs 0 and 1 overlap (the blocks by rank"),
                std::string::npos) << e.what();
    }
    try {
      comm.alltoallv(c.data() + 2, two, packed, c.data(), two, packed, DataType::f32);
      ADD_FAILURE() << "a send block inside a receive block accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("alltoallv: input 0 overlaps output 1"), std::string::npos) << e.what();
    }
    refused({a.data()}, {b.data(), c.data()}, counts, "1 input and 2 output buffers; the list form takes one of each");
    refused({a.data(), b.data()}, {c.data(), c.data() + 4}, {4, 4, 4}, "sendcounts has 3 entries");
    refused({a.data(), b.data()}, {c.data(), c.data() + 4}, {comm.rank() == 0 ? 3u : 4u, comm.rank() == 1 ? 3u : 4u},
            "this rank sends itself 3 elements but expects 4");
    // adjacent but not overlapping: fine
    const std::vector<const void*> halves_a = {a.data(), a.data() + 4};
    const std::vector<void*> halves_b = {b.data(), b.data() + 4};
    comm.alltoallv(halves_a, counts, halves_b, counts, DataType::f32)->wait();
  });
}

TEST(Alltoallv, CountsThatDisagreePairwiseFail) {
  const int n = 3;
  std::vector<std::string> errors(n);
  const auto start = std::chrono::steady_clock::now();
  run_ranks(n, [&](Communicator& comm) {
    std::vector<size_t> sc(n, 2), disp = {0, 2, 4}, rc(n, 2);
    if (comm.rank() == 2) rc[0] = 1;  // rank 0 sends it 2
    std::vector<float> in(6, 1.0f), out(6);
    try {
      // Ranks whose own counts agree may finish the call; the failure reaches them by their next one.
      comm.alltoallv(in.data(), sc, disp, out.data(), rc, disp, DataType::f32)->wait(std::chrono::seconds(30));
      comm.barrier()->wait(std::chrono::seconds(30));
    } catch (const CommError& e) {
      errors[comm.rank()] = e.what();
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  EXPECT_NE(errors[2].find("rank 0 sends 2 elements to this rank, whose recvcounts[0] is 1"), std::string::npos)
      << errors[2];
  for (const std::string& e : errors) EXPECT_NE(e.find("recvcounts"), std::string::npos) << e;
}

}  // namespace
}  // namespace smartcoll
