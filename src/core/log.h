// Leveled logging to stderr (SMARTCOLL_LOG=error|warn|info|debug). Each line names the rank and, where one is
// running, the collective, so that interleaved output of many ranks can be read.
#pragma once

#include <sstream>
#include <string>

#include "core/config.h"

namespace smartcoll::log {

void set_level(LogLevel level);
bool enabled(LogLevel level);

// One line, written to stderr in one call when it goes out of scope.
class Line {
 public:
  Line(LogLevel level, int rank, std::string_view context) : level_(level), rank_(rank), context_(context) {}
  ~Line();
  template <class T>
  Line& operator<<(const T& v) {
    text_ << v;
    return *this;
  }

 private:
  LogLevel level_;
  int rank_;
  std::string_view context_;
  std::ostringstream text_;
};

// "2.5 s": a duration in seconds as error messages name it (a knob's value, without trailing zeros).
std::string seconds(double s);

}  // namespace smartcoll::log

// SC_LOG(LogLevel::warn, rank, "allreduce #3") << "text " << value; nothing is formatted below the level.
#define SC_LOG(level, rank, context)                                                            \
  for (bool sc_log_on = ::smartcoll::log::enabled(level); sc_log_on; sc_log_on = false) \
  ::smartcoll::log::Line(level, rank, context)
