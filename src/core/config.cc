#include "core/config.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <cctype>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <sstream>

#include "nicd/protocol.h"
#include "smartcoll/types.h"

namespace smartcoll {

namespace {

std::string show(double x) {
  std::ostringstream s;
  s << std::setprecision(15) << x;
  return s.str();
}

// Checks `value` against the knob's type and range; returns it canonical (a "bytes" knob's as its integer).
std::string validate(const Knob& knob, const std::string& value) {
  const std::string_view type = knob.type;
  auto fail = [&](std::string_view expected) {
    throw InvalidArgument("option '" + std::string(knob.name) + "' (" + knob_env_name(knob.name) + ") = '" +
                          value + "': expected " + std::string(expected));
  };
  if (type == "int" || type == "bytes" || type == "float") {
    char* end = nullptr;
    double v = type == "float" ? std::strtod(value.c_str(), &end)
                               : static_cast<double>(std::strtoll(value.c_str(), &end, 10));
    if (type == "bytes" && !value.empty() && end != value.c_str() && *end != '\0' && end[1] == '\0') {
      const char unit = static_cast<char>(std::toupper(static_cast<unsigned char>(*end)));
      const int shift = unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : -1;
      if (shift > 0) v = std::ldexp(v, shift), ++end;
    }
    if (value.empty() || *end != '\0')
      fail(type == "int" ? "an integer" : type == "bytes" ? "a byte count, e.g. 1048576 or 1M (K, M, G: 2^10, 2^20, 2^30)"
                                                          : "a number");
    if (!(v >= knob.lo && v <= knob.hi))  // NaN too
      throw InvalidArgument("option '" + std::string(knob.name) + "' (" + knob_env_name(knob.name) + ") = " +
                            value + " is outside [" + show(knob.lo) + ", " + show(knob.hi) + "]");
    if (type == "bytes") return std::to_string(static_cast<int64_t>(v));
  } else if (type.starts_with("choice:")) {
    std::string_view choices = type.substr(7);
    size_t pos = 0;
    while (pos <= choices.size()) {
      size_t bar = choices.find('|', pos);
      if (bar == std::string_view::npos) bar = choices.size();
      if (choices.substr(pos, bar - pos) == value) return value;
      pos = bar + 1;
    }
    fail("one of " + std::string(choices));
  }
  return value;
}

std::vector<int> parse_cpus(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long cpu = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || cpu < 0)
      throw InvalidArgument("option 'engine_cpus' (SMARTCOLL_ENGINE_CPUS) = '" + text +
                            "': expected CPU numbers separated by commas, e.g. 2,3");
    cpu_set_t allowed;
    if (cpu >= CPU_SETSIZE || sched_getaffinity(0, sizeof allowed, &allowed) != 0 || !CPU_ISSET(cpu, &allowed))
      throw InvalidArgument("cannot pin the engine workers to CPU " + std::to_string(cpu) +
                            " (SMARTCOLL_ENGINE_CPUS): no such CPU or not allowed for this process");
    cpus.push_back(static_cast<int>(cpu));
  }
  return cpus;
}

}  // namespace

std::string knob_env_name(std::string_view name) {
  std::string env = "SMARTCOLL_";
  for (char c : name) env += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return env;
}

const Knob& find_knob(std::string_view name) {
  for (const Knob& k : kKnobs)
    if (k.name == name) return k;
  std::string valid;
  for (const Knob& k : kKnobs) valid += (valid.empty() ? "" : ", ") + std::string(k.name);
  throw InvalidArgument("unknown option '" + std::string(name) + "'; valid options: " + valid);
}

namespace {
// What smartcoll reads besides the knobs' variables: the launcher's store secret and MPI job, the emulated
// cluster's (tools/netemu), the fuzz driver's seed.
constexpr std::string_view kOtherVariables[] = {"SMARTCOLL_SECRET",       "SMARTCOLL_MPI_JOB",
                                                "SMARTCOLL_CLUSTER",      "SMARTCOLL_CLUSTER_DIR",
                                                "SMARTCOLL_CLUSTER_HOST", "SMARTCOLL_CLUSTER_SWITCH_ADDR",
                                                "SMARTCOLL_FUZZ_SEED"};

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = above;
    }
  }
  return row[b.size()];
}
}  // namespace

std::vector<std::string> unknown_variables() {
  std::vector<std::string> lines;
  for (char** e = environ; *e; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (!name.starts_with("SMARTCOLL_") ||
        std::find(std::begin(kOtherVariables), std::end(kOtherVariables), name) != std::end(kOtherVariables))
      continue;
    std::string closest;
    size_t best = SIZE_MAX;
    bool known = false;
    for (const Knob& k : kKnobs) {
      const std::string env = knob_env_name(k.name);
      known |= env == name;
      if (const size_t d = edit_distance(name, env); d < best) best = d, closest = env;
    }
    if (!known)
      lines.push_back(std::string(name) + " is not a smartcoll setting and is ignored" +
                      (best <= 2 ? " (did you mean " + closest + "?)" : "") + "; `smartcoll info` lists them");
  }
  return lines;
}

Options Options::resolve(const std::map<std::string, std::string>& explicit_options) {
  Options o;
  for (const Knob& k : kKnobs) {
    std::string value(k.default_value);
    if (const char* env = std::getenv(knob_env_name(k.name).c_str())) value = env;
    o.values_[std::string(k.name)] = value;
  }
  for (const auto& [name, value] : explicit_options) o.values_[std::string(find_knob(name).name)] = value;
  for (const Knob& k : kKnobs) {
    std::string& value = o.values_[std::string(k.name)];
    value = validate(k, value);
  }
  return o;
}

const std::string& Options::str(std::string_view name) const {
  return values_.at(std::string(find_knob(name).name));
}

int64_t Options::integer(std::string_view name) const { return std::strtoll(str(name).c_str(), nullptr, 10); }

double Options::real(std::string_view name) const { return std::strtod(str(name).c_str(), nullptr); }

int default_engine_threads() {
  cpu_set_t set;
  const int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  int local = 1;  // ranks on this host, as torchrun and smartcoll run say
  if (const char* l = std::getenv("LOCAL_WORLD_SIZE")) local = std::max(1, std::atoi(l));
  return std::clamp(cpus / local / 2, 1, 4);
}

Config Config::from(const Options& o) {
  Config c;
  c.algo = o.str("algo");
  c.cma = o.str("cma") != "off";
  c.cma_shm = o.str("cma") == "auto";
  c.rma_direct = o.str("rma_direct") == "auto";
  c.unix_sockets = o.str("unix_sockets") == "auto";
  c.rhd_max_bytes = static_cast<size_t>(o.integer("rhd_max_bytes"));
  c.shm_bytes = static_cast<size_t>(o.integer("shm_bytes"));
  if (const std::string& path = o.str("model_profile"); !path.empty())
    c.profile = std::make_shared<const coll::Profile>(coll::Profile::load(path));
  c.segment_size = static_cast<size_t>(o.integer("segment_size"));
  c.list_stage_bytes = static_cast<size_t>(o.integer("list_stage_bytes"));
  c.streams = static_cast<int>(o.integer("streams"));
  c.engine_threads = static_cast<int>(o.integer("engine_threads"));
  if (c.engine_threads == 0) c.engine_threads = default_engine_threads();
  c.engine_cpus = parse_cpus(o.str("engine_cpus"));
  c.spin_us = static_cast<double>(o.integer("spin_us"));
  c.spin = parse_spin(o.str("spin"));
  c.timeout = o.real("timeout");
  c.connect_timeout = o.real("connect_timeout");
  c.ifname = o.str("ifname");
  c.addr = o.str("addr");
  c.job_id = o.str("job_id");
  c.host = o.str("host");
  c.sockbuf = static_cast<int>(o.integer("sockbuf"));
  c.codec = Codec::parse(o.str("codec"));  // a bad SMARTCOLL_CODEC fails here, not at the first collective
  c.codec_owner = o.str("codec_mode") == "owner";
  c.check = o.integer("check") != 0;
  c.one_poster = o.str("posting") == "one_thread";
  c.switches = o.str("switch");
  c.switch_fallback_ring = o.str("switch_fallback") == "ring";
  c.switch_timeout = o.real("switch_timeout");
  c.switch_keepalive = o.real("switch_keepalive");
  c.switch_slots = static_cast<uint32_t>(o.integer("switch_slots"));
  c.switch_retry = static_cast<uint64_t>(o.integer("switch_retry"));
  c.switch_packet = static_cast<uint32_t>(o.integer("switch_packet"));
  if (c.switch_packet % 8)
    throw InvalidArgument("option 'switch_packet' (SMARTCOLL_SWITCH_PACKET) = " + o.str("switch_packet") +
                          ": expected a multiple of 8 (whole elements of every dtype)");
  c.switch_full_auth = o.str("switch_auth") == "full";
  c.switch_offload = o.str("switch_offload") == "on";
  c.nicd = o.str("engine") == "nicd";
  c.nicd_socket = o.str("nicd_socket").empty() ? nicd::default_socket() : o.str("nicd_socket");
  constexpr std::string_view levels[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; ++i)
    if (o.str("log") == levels[i]) c.log = static_cast<LogLevel>(i);
  return c;
}

std::string Config::must_match(const Options& o) {
  std::string s;
  for (const Knob& k : kKnobs)
    if (k.must_match) s += (s.empty() ? "" : " ") + std::string(k.name) + "=" + o.str(k.name);
  return s;
}

std::string Config::start_up_settings(const Options& o) const {
  char digest[32] = "none";
  if (profile) std::snprintf(digest, sizeof digest, "%016" PRIx64, profile->digest());
  return must_match(o) + " model_profile_digest=" + digest;
}

}  // namespace smartcoll
