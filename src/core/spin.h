// How a rank that waits for its peers spends its core (the spin knob). Polling the sockets sees a message
// within a microsecond but holds the core; sleeping in epoll gives the core away and pays a wake-up. Polling
// pays only while every rank has a core of its own: with more ranks than cores (4 ranks on 2 cores, or
// emulated hosts that share them) a polling rank takes the core from the rank it waits for (BENCHMARKS.md,
// "Small-message latency: polling only with a core per rank").
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace smartcoll {

enum class SpinMode : uint8_t { automatic, on, off };

SpinMode parse_spin(const std::string& value);

// True when this host has a CPU (of those this process may use) for every rank on it, and `others` more (an
// offload daemon's): the ranks of this rank's host by the start-up layout (hosts[r]: rank r's host), or
// LOCAL_WORLD_SIZE where that says more.
bool core_per_rank(const std::vector<int>& hosts, int rank, int others = 0);

// One engine worker's polling state; whoever holds the worker's drive lock uses it.
class Spinner {
 public:
  using Clock = std::chrono::steady_clock;
  Spinner(SpinMode mode, double spin_us, bool core_per_rank);

  // A pass found nothing to do: returns true after yielding the core once (poll again), false when the waiter
  // should sleep. `idle_since`: when the last progress or wake-up was.
  bool again(Clock::time_point now, Clock::time_point idle_since);

  // What `again` learns from a yield that began at `now` and took `took` (auto): yields that come back late
  // twice in a row stop polling for a while.
  void yielded(Clock::time_point now, Clock::duration took);

 private:
  bool enabled_;
  bool watch_;  // automatic: a yield that gives the core away stops polling for a while
  Clock::duration limit_;
  Clock::time_point quiet_until_{};
  int late_ = 0;  // yields in a row that came back late
};

}  // namespace smartcoll
