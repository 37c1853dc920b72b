// How waiting ranks poll (the spin knob): the policy's decisions, and the same results whichever way ranks wait.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "core/spin.h"
#include "ranks.h"
#include "smartcoll/comm.h"

namespace smartcoll {
namespace {

using Clock = Spinner::Clock;

TEST(Spin, ParsesItsChoices) {
  EXPECT_EQ(parse_spin("auto"), SpinMode::automatic);
  EXPECT_EQ(parse_spin("on"), SpinMode::on);
  EXPECT_EQ(parse_spin("off"), SpinMode::off);
  EXPECT_THROW(parse_spin("yes"), InvalidArgument);
}

TEST(Spin, PollsForSpinUsThenSleeps) {
  const auto start = Clock::now();
  Spinner on(SpinMode::on, 1000, false);  // on: polls whatever the layout says
  EXPECT_TRUE(on.again(start, start));
  EXPECT_FALSE(on.again(start + std::chrono::microseconds(1001), start));
  Spinner off(SpinMode::off, 1000, true);
  EXPECT_FALSE(off.again(start, start));
  Spinner zero(SpinMode::on, 0, true);  // spin_us=0: never polls
  EXPECT_FALSE(zero.again(start, start));
}

TEST(Spin, AutoPollsOnlyWithACorePerRank) {
  const auto start = Clock::now();
  EXPECT_FALSE(Spinner(SpinMode::automatic, 1000, false).again(start, start));
  // With a core per rank it polls (until a yield gives the core away: the next test).
  EXPECT_TRUE(Spinner(SpinMode::automatic, 1000, true).again(Clock::now(), Clock::now()));
}

TEST(Spin, AutoStopsOnceYieldsGiveTheCoreAway) {
  // A `now` far in the past reads as a yield that took long: another thread had the core.
  Spinner s(SpinMode::automatic, 1e9, true);
  const auto past = Clock::now() - std::chrono::milliseconds(1);
  s.yielded(past, std::chrono::milliseconds(1));
  EXPECT_TRUE(s.again(past, past)) << "stopped after one late yield";  // its own yield is late too: the second
  EXPECT_FALSE(s.again(past + std::chrono::microseconds(1), past)) << "polls on after giving the core away twice";
  EXPECT_TRUE(s.again(past + std::chrono::milliseconds(101), past)) << "never tries polling again";
}

TEST(Spin, AutoPollsOnAfterSingleLateYields) {
  // A late yield between prompt ones is the host's hiccup, not a thread that wants the core.
  Spinner s(SpinMode::automatic, 1e9, true);
  const auto t = Clock::now();
  for (int i = 0; i < 5; ++i) {
    s.yielded(t, std::chrono::milliseconds(1));
    s.yielded(t, std::chrono::microseconds(5));
  }
  EXPECT_TRUE(s.again(t, t)) << "single late yields stopped the polling";
  Spinner on(SpinMode::on, 1e9, true);  // on watches nothing
  for (int i = 0; i < 3; ++i) on.yielded(t, std::chrono::milliseconds(1));
  EXPECT_TRUE(on.again(t, t));
}

TEST(Spin, CorePerRankCountsTheRanksOfThisHost) {
  const char* saved = std::getenv("LOCAL_WORLD_SIZE");
  const std::string keep = saved ? saved : "";
  unsetenv("LOCAL_WORLD_SIZE");
  EXPECT_TRUE(core_per_rank({0}, 0));
  EXPECT_FALSE(core_per_rank(std::vector<int>(100000, 0), 0));
  EXPECT_TRUE(core_per_rank(std::vector<int>{0, 1, 2, 3}, 2)) << "one rank per host";
  setenv("LOCAL_WORLD_SIZE", "100000", 1);
  EXPECT_FALSE(core_per_rank({0}, 0));
  if (saved)
    setenv("LOCAL_WORLD_SIZE", keep.c_str(), 1);
  else
    unsetenv("LOCAL_WORLD_SIZE");
}

// Exact small-integer sums, the same on every rank, whether ranks poll or sleep (off exercises epoll wake-ups).
TEST(Spin, SameResultsWhicheverWayRanksWait) {
  for (const char* mode : {"on", "off", "auto"}) {
    harness::run_ranks(4, [&](Communicator& comm) {
      for (size_t count : {size_t{2}, size_t{256}, size_t{16384}}) {
        std::vector<float> x(count), y(count);
        for (size_t i = 0; i < count; ++i) x[i] = static_cast<float>((i + 3 * comm.rank()) % 9) - 4;
        for (int call = 0; call < 20; ++call) {
          comm.allreduce(x.data(), y.data(), count, DataType::f32, ReduceOp::sum)->wait();
          comm.barrier()->wait();
        }
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int r = 0; r < comm.size(); ++r) want += static_cast<float>((i + 3 * r) % 9) - 4;
          ASSERT_EQ(y[i], want) << "spin=" << mode << " count " << count << " element " << i;
        }
      }
    }, harness::test_options({{"spin", mode}}));
  }
}

}  // namespace
}  // namespace smartcoll
