// The algorithm table: per collective, every algorithm with its name, what it is, the function that builds its
// schedule, what it supports and its cost. The single source of the algo knob's choices, `smartcoll info`,
// docs/knobs.md and `auto`.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "coll/algorithms.h"
#include "smartcoll/comm.h"

namespace smartcoll::coll {

// A call as selection sees it.
struct Query {
  int n;
  size_t bytes;  // of the whole vector (allreduce, broadcast, reduce) or of one rank's block
  bool compressed;
  bool cma_usable;
  bool switch_set;  // the switch knob names aggregation switches
  int hosts = 1, per_host = 0;  // the host layout; per_host 0: hosts have different numbers of ranks
  int switches = 1;             // aggregation switches the vector's chunks are spread over
  size_t shm_room = 0;          // bytes per rank a same-host call may put through the control segment (algo=shm)
  bool interleaved = false;     // some host's ranks are not consecutive (hosts_interleaved)
};

struct AlgorithmInfo {
  Algorithm algo;
  std::string_view description;
  void (*build)(Builder&, const Args&);
  // Empty when it can run the call; otherwise why not.
  std::string (*unsupported)(const Query&);
  // Steps on the critical path and bytes this rank sends on its busiest link, per byte of `bytes`: with a per-step
  // latency a and a link rate B the time is about steps * a + wire * bytes / B (docs/algorithms.md); `reduced`:
  // bytes this rank adds up, per byte of `bytes` (the cost model's reduction term, docs/cost-model.md).
  double (*steps)(int n);
  double (*wire)(int n);
  double (*reduced)(int n);
  // When auto may pick it from a profile's predictions: always; for small calls only (up to rhd_max_bytes in all,
  // where the model's latency term decides); or never, where the cost entry leaves out what decides between it
  // and the others. It runs whenever asked for by name.
  enum class Auto : uint8_t { always, small_only, never };
  Auto automatic = Auto::always;
};

// The bytes a call moves in all: n blocks of Query::bytes where that is one rank's block (reduce_scatter,
// allgather, alltoall), else the vector.
size_t call_bytes(Collective c, const Query& q);

std::span<const AlgorithmInfo> algorithms(Collective c);
// Throws InvalidArgument naming the collectives.
Collective parse_collective(std::string_view name);
// Throws InvalidArgument naming the collective's algorithms.
const AlgorithmInfo& find(Collective c, Algorithm a);
struct Profile;
// `requested` if it supports the call (else InvalidArgument saying why); for automatic: with a profile, the
// algorithm the cost model (coll/cost.h) predicts to be fastest; without one, latency-optimized algorithms up to
// small_bytes, bandwidth-optimized ones above.
Algorithm choose(Collective c, const Query& q, Algorithm requested, size_t small_bytes,
                 const Profile* profile = nullptr);

}  // namespace smartcoll::coll
