// Collectives with ranks as threads sharing an in-memory store, over real loopback TCP.
#include <array>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "ranks.h"
#include "smartcoll/comm.h"

namespace smartcoll {
namespace {

using harness::run_ranks;
using harness::test_options;

// Small integers so float sums are exact and the expected value is known.
float value(int rank, size_t i) { return static_cast<float>((rank * 7 + static_cast<int>(i % 13)) % 17 - 8); }

struct Shape {
  int world;
  size_t count;
};

class Collectives : public ::testing::TestWithParam<Shape> {};

TEST_P(Collectives, AllreduceEveryAlgorithmMatchesReference) {
  const auto [n, count] = GetParam();
  for (Algorithm algo : {Algorithm::ring, Algorithm::rhd}) {
    for (bool in_place : {false, true}) {
      run_ranks(n, [&](Communicator& comm) {
        std::vector<float> in(count), out(count, -1.0f);
        for (size_t i = 0; i < count; ++i) in[i] = value(comm.rank(), i);
        float* dst = in_place ? in.data() : out.data();
        comm.allreduce(in.data(), dst, count, DataType::f32, ReduceOp::sum, algo)->wait();
        for (size_t i = 0; i < count; ++i) {
          float expect = 0;
          for (int r = 0; r < n; ++r) expect += value(r, i);
          ASSERT_EQ(dst[i], expect) << algorithm_name(algo) << " element " << i << " rank " << comm.rank();
        }
      });
    }
  }
}

TEST_P(Collectives, ReduceScatterAllgatherBroadcastReduceAlltoall) {
  const auto [n, count] = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    std::vector<float> in(count * n), block(count), all(count * n);
    for (size_t i = 0; i < in.size(); ++i) in[i] = value(r, i);

    comm.reduce_scatter(in.data(), block.data(), count, DataType::f32, ReduceOp::max)->wait();
    for (size_t i = 0; i < count; ++i) {
      float expect = value(0, r * count + i);
      for (int p = 1; p < n; ++p) expect = std::max(expect, value(p, r * count + i));
      ASSERT_EQ(block[i], expect) << "reduce_scatter element " << i;
    }

    std::vector<float> mine(count);
    for (size_t i = 0; i < count; ++i) mine[i] = value(r, i);
    comm.allgather(mine.data(), all.data(), count, DataType::f32)->wait();
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(all[p * count + i], value(p, i)) << "allgather from " << p;

    const int root = n - 1;
    std::vector<float> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = r == root ? value(root, i) : -99.0f;
    comm.broadcast(buf.data(), count, DataType::f32, root)->wait();
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(buf[i], value(root, i)) << "broadcast element " << i;

    std::vector<float> sum(count, -1.0f);
    comm.reduce(mine.data(), r == 0 ? sum.data() : nullptr, count, DataType::f32, ReduceOp::sum, 0)->wait();
    if (r == 0)
      for (size_t i = 0; i < count; ++i) {
        float expect = 0;
        for (int p = 0; p < n; ++p) expect += value(p, i);
        ASSERT_EQ(sum[i], expect) << "reduce element " << i;
      }

    std::vector<int32_t> send(count * n), recv(count * n, -1);
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < count; ++i) send[p * count + i] = static_cast<int32_t>(r * 1000000 + p * 1000 + i);
    for (Algorithm a : {Algorithm::direct, Algorithm::bruck, Algorithm::pairwise}) {
      std::fill(recv.begin(), recv.end(), -1);
      comm.alltoall(send.data(), recv.data(), count, DataType::i32, a)->wait();
      for (int p = 0; p < n; ++p)
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(recv[p * count + i], static_cast<int32_t>(p * 1000000 + r * 1000 + i))
              << "alltoall (" << algorithm_name(a) << ") from " << p;
    }
    comm.barrier()->wait();
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, Collectives,
                         ::testing::Values(Shape{1, 5}, Shape{2, 0}, Shape{2, 1}, Shape{2, 1000}, Shape{3, 7},
                                           Shape{3, 100003}, Shape{4, 2}, Shape{4, 4099}, Shape{5, 1000},
                                           Shape{5, 3}, Shape{6, 1001}, Shape{7, 9}, Shape{8, 65536 + 3}, Shape{8, 5}),
                         [](const auto& info) {
                           return "n" + std::to_string(info.param.world) + "_count" +
                                  std::to_string(info.param.count);
                         });

TEST(Collectives, SegmentsStripedOverStreamsAgreeBitwise) {
  // Random floats: sums are inexact, so this checks that every rank ends with identical bits.
  const int n = 3;
  const size_t count = 200001;
  std::vector<std::vector<float>> results(n);
  run_ranks(
      n,
      [&](Communicator& comm) {
        std::vector<float> x(count);
        uint32_t state = 12345u + comm.rank();
        for (auto& v : x) {
          state = state * 1664525u + 1013904223u;
          v = static_cast<float>(state >> 8) / 16777216.0f - 0.5f;
        }
        comm.allreduce(x.data(), x.data(), count, DataType::f32, ReduceOp::sum, Algorithm::ring)->wait();
        results[comm.rank()] = x;
      },
      test_options({{"streams", "3"}, {"segment_size", "4096"}}));
  for (int r = 1; r < n; ++r)
    ASSERT_EQ(std::memcmp(results[0].data(), results[r].data(), count * sizeof(float)), 0) << "rank " << r;
}

TEST(Errors, MismatchedCountNamesEveryRank) {
  const int n = 3;
  std::vector<std::string> errors(n);
  run_ranks(n, [&](Communicator& comm) {
    size_t count = comm.rank() == 1 ? 99 : 100;
    std::vector<float> x(100, 1.0f);
    try {
      comm.allreduce(x.data(), x.data(), count, DataType::f32, ReduceOp::sum)->wait();
    } catch (const CommError& e) {
      errors[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_NE(errors[r].find("ranks disagree"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank(s) 1 called allreduce(count=99"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank(s) 0,2 called allreduce(count=100"), std::string::npos) << errors[r];
  }
}

TEST(Errors, ACallOfNoElementsOnOneRankIsNotPairedWithTheOthersCall) {
  // Rank 0's first call has no elements: it sends nothing and completes at once. Its second call's messages must
  // not be taken for the first call's by the others (same shape: the sums would be silently wrong).
  const int n = 3;
  std::vector<std::array<std::string, 2>> errors(n);
  run_ranks(
      n,
      [&](Communicator& comm) {
        const auto r = static_cast<size_t>(comm.rank());
        std::vector<float> x(4, 1.0f + static_cast<float>(r));
        for (size_t call = 0; call < 2; ++call) {
          const size_t count = call == 0 && r == 0 ? 0 : x.size();
          try {
            comm.allreduce(x.data(), x.data(), count, DataType::f32, ReduceOp::sum, Algorithm::ring)->wait();
          } catch (const CommError& e) {
            errors[r][call] = e.what();
          }
        }
      },
      test_options({{"cma", "off"}}));
  EXPECT_EQ(errors[0][0], "");  // of no elements: nothing to disagree with
  for (size_t r = 1; r < n; ++r) EXPECT_NE(errors[r][0], "") << "rank " << r << " took rank 0's next call";
  for (size_t r = 0; r < n; ++r) EXPECT_NE(errors[r][1], "") << "rank " << r;
  // Found by rank 1 or 2 (rank 0's message is a call ahead) or by rank 0 (theirs is a call behind).
  const std::string all = errors[0][1] + errors[1][0] + errors[2][0];
  EXPECT_TRUE(all.find("as its call #1 (it is ahead: it made call #0 with no message to this rank") !=
                  std::string::npos ||
              all.find("in its call #0 (this rank's call #0 took no message from it") != std::string::npos)
      << all;
}

TEST(Errors, PeerThatLeavesFailsTheOthersNamingIt) {
  const int n = 4;
  std::vector<std::string> errors(n);
  auto start = std::chrono::steady_clock::now();
  run_ranks(n, [&](Communicator& comm) {
    if (comm.rank() == 2) return;  // closes its connections without taking part
    std::vector<float> x(1 << 20, 1.0f);
    try {
      comm.allreduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum)->wait();
    } catch (const CommError& e) {
      errors[comm.rank()] = e.what();
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  for (int r : {0, 1, 3}) EXPECT_NE(errors[r], "") << "rank " << r << " did not fail";
  // Whoever notices first names rank 2; a rank that fails aborts its connections, so the others may instead
  // see that rank's connection close first. On one host the call goes through the same-host path, whose control
  // segment says that rank 2 closed its communicator.
  int naming = 0;
  for (int r : {0, 1, 3})
    naming += errors[r].find("connection to rank 2") != std::string::npos ||
              errors[r].find("rank 2 failed or closed its communicator") != std::string::npos;
  EXPECT_GE(naming, 1) << errors[0] << "\n" << errors[1] << "\n" << errors[3];
}

TEST(Errors, LaterCallsFailWithTheFirstError) {
  run_ranks(2, [&](Communicator& comm) {
    std::vector<float> x(10);
    size_t count = comm.rank() == 0 ? 10 : 9;
    EXPECT_THROW(comm.allreduce(x.data(), x.data(), count, DataType::f32, ReduceOp::sum)->wait(), CommError);
    try {
      comm.barrier()->wait();
      ADD_FAILURE() << "barrier after a failure succeeded";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("failed earlier"), std::string::npos) << e.what();
    }
  });
}

TEST(Errors, BadArgumentsAreRejectedBeforeSubmission) {
  run_ranks(1, [&](Communicator& comm) {
    int32_t x[4] = {};
    EXPECT_THROW(comm.allreduce(x, x, 4, DataType::i32, ReduceOp::avg), InvalidArgument);
    EXPECT_THROW(comm.broadcast(x, 4, DataType::i32, 3), InvalidArgument);
  });
}

TEST(Knobs, UnknownAndMalformedOptionsAreNamed) {
  try {
    Options::resolve({{"segmnt_size", "1"}});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("segment_size"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Options::resolve({{"streams", "two"}}), InvalidArgument);
  EXPECT_THROW(Options::resolve({{"algo", "tree"}}), InvalidArgument);
  EXPECT_EQ(Options::resolve({{"algo", "ring"}}).str("algo"), "ring");
}

// A number knob whose value is NaN is outside every range (the comparisons with the bounds are all false).
TEST(Knobs, NotANumberIsOutsideTheRange) {
  for (const char* nan : {"nan", "NaN", "-nan"}) {
    try {
      Options::resolve({{"timeout", nan}});
      FAIL() << nan;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("is outside"), std::string::npos) << e.what();
    }
  }
}

// SMARTCOLL_* variables that no knob reads are named (a typo would be ignored in silence); the other variables
// smartcoll reads are not.
TEST(Knobs, UnknownVariablesAreNamedWithTheClosestKnob) {
  ::setenv("SMARTCOLL_TIMEOUTS", "3", 1);
  ::setenv("SMARTCOLL_QUITE_UNLIKE_ANY", "1", 1);
  ::setenv("SMARTCOLL_SECRET", "x", 1);
  ::setenv("SMARTCOLL_STREAMS", "2", 1);
  const std::vector<std::string> lines = unknown_variables();
  for (const char* name : {"SMARTCOLL_TIMEOUTS", "SMARTCOLL_QUITE_UNLIKE_ANY", "SMARTCOLL_SECRET", "SMARTCOLL_STREAMS"})
    ::unsetenv(name);
  std::string all;
  for (const std::string& line : lines) all += line + "\n";
  EXPECT_NE(all.find("SMARTCOLL_TIMEOUTS is not a smartcoll setting and is ignored (did you mean SMARTCOLL_TIMEOUT?)"),
            std::string::npos) << all;
  EXPECT_NE(all.find("SMARTCOLL_QUITE_UNLIKE_ANY is not a smartcoll setting and is ignored; `smartcoll info`"),
            std::string::npos) << all;
  EXPECT_EQ(all.find("SMARTCOLL_SECRET"), std::string::npos) << all;
  EXPECT_EQ(all.find("SMARTCOLL_STREAMS"), std::string::npos) << all;
}

// Byte counts take K, M and G (powers of two) and are kept as integers, so that ranks that write one size two
// ways agree; anything else is refused naming the form.
TEST(Knobs, ByteCountsTakeBinarySuffixes) {
  EXPECT_EQ(Options::resolve({{"shm_bytes", "16M"}}).integer("shm_bytes"), 16 << 20);
  EXPECT_EQ(Options::resolve({{"shm_bytes", "16M"}}).str("shm_bytes"), "16777216");
  EXPECT_EQ(Options::resolve({{"segment_size", "64k"}}).integer("segment_size"), 65536);
  EXPECT_EQ(Options::resolve({{"sockbuf", "1G"}}).integer("sockbuf"), 1 << 30);
  EXPECT_EQ(Options::resolve({{"list_stage_bytes", "300"}}).integer("list_stage_bytes"), 300);
  for (const char* bad : {"16MB", "M", "1.5M", "16T", "", "16 M"}) {
    try {
      Options::resolve({{"shm_bytes", bad}});
      FAIL() << bad;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("a byte count, e.g. 1048576 or 1M"), std::string::npos) << e.what();
    }
  }
  // The range applies to the count: 128M is over shm_bytes' 2^26.
  EXPECT_THROW(Options::resolve({{"shm_bytes", "128M"}}), InvalidArgument);
  EXPECT_THROW(Options::resolve({{"streams", "2K"}}), InvalidArgument);  // an int knob takes no suffix
}

}  // namespace
}  // namespace smartcoll

namespace smartcoll {
namespace {

// Rank 1 gets `knob` = `odd`, the others `usual`; every rank must refuse to start, naming rank 1's value.
void expect_settings_mismatch(const std::string& knob, const std::string& usual, const std::string& odd) {
  const int n = 3;
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        Communicator comm(r, n, store, test_options({{knob, r == 1 ? odd : usual}, {"streams", "2"}}));
      } catch (const CommError& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_NE(errors[r].find("ranks disagree on settings"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find(knob + "=" + odd), std::string::npos) << errors[r];
  }
}

TEST(Errors, SettingsThatMustMatchAreCheckedAtStartUp) {
  expect_settings_mismatch("check", "1", "0");
  // Segments are striped over streams by index: different cuts would silently scramble data.
  expect_settings_mismatch("segment_size", "65536", "131072");
  expect_settings_mismatch("algo", "auto", "ring");
}

}  // namespace
}  // namespace smartcoll
