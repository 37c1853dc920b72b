#include "core/spin.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "smartcoll/types.h"

namespace smartcoll {

namespace {

// A yield that returns this much later ran another thread on the core for a while: someone else needs it. Shorter
// gaps are the kernel's network work or an idle worker's look at its queue: with 50 us, ranks on 2 emulated hosts
// (2 cores, a core each) stopped polling most of the time and took 53-180 us per 8 B-4 KiB call against 32-67 us
// polling; with 200 us, 37-71 against 40-98 (docs/latency.md).
constexpr auto kGaveAway = std::chrono::microseconds(200);
// How many late yields in a row mean that: another thread that wants the core (a busy process, a rank sharing it)
// makes every yield late, while a single late one is the host's hiccup.
constexpr int kLateInARow = 2;
// How long waiters then sleep instead of polling before they try again.
constexpr auto kQuiet = std::chrono::milliseconds(100);

}  // namespace

SpinMode parse_spin(const std::string& value) {
  if (value == "on") return SpinMode::on;
  if (value == "off") return SpinMode::off;
  if (value == "auto") return SpinMode::automatic;
  throw InvalidArgument("spin must be auto, on or off, got '" + value + "'");
}

bool core_per_rank(const std::vector<int>& hosts, int rank, int others) {
  long here = 1;
  if (rank >= 0 && static_cast<size_t>(rank) < hosts.size())
    here = std::count(hosts.begin(), hosts.end(), hosts[static_cast<size_t>(rank)]);
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE")) here = std::max(here, std::atol(local));
  cpu_set_t set;
  const int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  return here + others <= cpus;
}

Spinner::Spinner(SpinMode mode, double spin_us, bool core_per_rank)
    : enabled_(spin_us > 0 && (mode == SpinMode::on || (mode == SpinMode::automatic && core_per_rank))),
      watch_(mode == SpinMode::automatic),
      limit_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::micro>(spin_us))) {}

bool Spinner::again(Clock::time_point now, Clock::time_point idle_since) {
  if (!enabled_ || now - idle_since >= limit_ || now < quiet_until_) return false;
  std::this_thread::yield();  // ranks that share cores: let the peer this rank waits for run
  yielded(now, Clock::now() - now);
  return true;
}

void Spinner::yielded(Clock::time_point now, Clock::duration took) {
  if (!watch_) return;
  late_ = took > kGaveAway ? late_ + 1 : 0;
  if (late_ >= kLateInARow) {
    quiet_until_ = now + kQuiet;
    late_ = 0;
  }
}

}  // namespace smartcoll
