#include "core/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>

namespace smartcoll::log {

namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::warn)};
constexpr const char* kNames[] = {"error", "warn", "info", "debug"};
}  // namespace

void set_level(LogLevel level) { g_level = static_cast<int>(level); }

bool enabled(LogLevel level) { return static_cast<int>(level) <= g_level.load(std::memory_order_relaxed); }

Line::~Line() {
  using namespace std::chrono;
  const double t = duration<double>(system_clock::now().time_since_epoch()).count();
  std::ostringstream line;
  line.setf(std::ios::fixed);
  line.precision(6);
  line << "[smartcoll " << t << " rank " << rank_ << " " << kNames[static_cast<int>(level_)];
  if (!context_.empty()) line << " " << context_;
  line << "] " << text_.str() << "\n";
  const std::string s = line.str();
  // One write() per line so that lines of several threads and processes do not interleave.
  [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, s.data(), s.size());
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

}  // namespace smartcoll::log
