// Settings parsed once into types, so that the engine never looks a knob up by name on its hot path.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "coll/cost.h"
#include "core/spin.h"
#include "smartcoll/codec.h"
#include "smartcoll/knobs.h"

namespace smartcoll {

enum class LogLevel : uint8_t { error, warn, info, debug };

struct Config {
  std::string algo;
  bool cma = true;
  bool cma_shm = true;     // the same-host path's control messages go through a shared segment (cma=auto)
  bool rma_direct = true;  // one-sided gets and puts on one host copy from or into the target's memory directly
  bool unix_sockets = true;  // peers in this network namespace are reached over Unix-domain sockets
  size_t rhd_max_bytes = 0;
  size_t shm_bytes = 0;  // room per rank for small calls' data in the same-host control segment
  std::shared_ptr<const coll::Profile> profile;  // model_profile, loaded; null: the size rules
  size_t segment_size = 0;
  size_t list_stage_bytes = 0;
  int streams = 1;
  int engine_threads = 1;  // resolved: never 0
  std::vector<int> engine_cpus;
  double spin_us = 0;
  SpinMode spin = SpinMode::automatic;
  bool core_per_rank = true;  // set by the communicator from the host layout (spin=auto)
  double timeout = 0, connect_timeout = 0;
  std::string ifname, addr;
  std::string host;    // as set; empty: detected
  std::string job_id;  // as set; the communicator resolves an empty one (see the knob) before the transport starts
  int sockbuf = 0;
  Codec codec;
  bool codec_owner = false;
  bool check = true;
  bool one_poster = true;  // posting=one_thread
  std::string switches;    // host:port list, parsed by the communicator (switch/client.h)
  bool switch_fallback_ring = true;
  double switch_timeout = 2;
  double switch_keepalive = 15;  // seconds without a switch call before the join goes again (0: never)
  uint32_t switch_slots = 128, switch_packet = 1408;
  uint64_t switch_retry = 100;  // calls on the ring after a fallback before a probe (0: never)
  bool switch_full_auth = false;
  bool switch_offload = true;
  bool nicd = false;        // engine=nicd
  std::string nicd_socket;  // resolved: never empty
  LogLevel log = LogLevel::warn;

  // Throws InvalidArgument naming the knob for a value that cannot be used (a bad codec, an unknown CPU).
  static Config from(const Options& o);
  // "name=value ..." of the knobs every rank must share.
  static std::string must_match(const Options& o);
  // What ranks compare at start-up: must_match and the digest of the cost-model profile this config loaded (ranks
  // compare what they loaded, not where from).
  std::string start_up_settings(const Options& o) const;
};

// engine_threads = 0: one worker per two CPUs this process may use, shared among LOCAL_WORLD_SIZE ranks, 1 to 4.
int default_engine_threads();

}  // namespace smartcoll
