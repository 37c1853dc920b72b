// The analytical cost model (docs/cost-model.md): what a collective costs with a given algorithm and codec on a
// machine described by a Profile, and what a data-parallel training iteration costs (the FPGA smart-NIC paper's
// Sec. IV-C). `auto` picks the cheapest algorithm with it when a profile is loaded (the model_profile knob);
// `smartcoll model predict` prints and draws it. The per-algorithm terms (steps, bytes on the busiest link,
// bytes reduced) come from the algorithm table (coll/table.h).
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "coll/table.h"

namespace smartcoll::coll {

// Encode and decode throughput of one codec, in float32 bytes per second on one core.
struct CodecRates {
  double encode_Bps = 0, decode_Bps = 0;
};

struct Profile {
  // Seconds per step on the critical path (a message's latency plus the per-call work); `alpha_algo` overrides
  // it for one algorithm (by name), since a pipelined ring pays more per step than one exchange of rhd.
  double alpha_s = 0;
  std::map<std::string, double> alpha_algo;
  double link_Bps = 0;         // link rate between hosts, bytes per second each way
  double link_efficiency = 1;  // the share of it one rank's streams reach (the paper's alpha)
  // Overrides of link_efficiency per algorithm: a ring keeps the link busy; an exchange that waits for its
  // partner between steps (rhd, rd) leaves it idle part of the time.
  std::map<std::string, double> efficiency_algo;
  double reduce_Bps = 0;       // float32 bytes added per second on one core
  double cores = 1;            // cores the engine spreads reductions and codec work over
  double mem_Bps = 0;          // memory bandwidth: bytes read plus written per second (the paper's PCIe term)
  double copy_Bps = 0;         // same-host copy rate: bytes per second one rank reads from another's memory
  // Aggregation switch: float32 bytes one switch sums per second (0: not measured, and auto never picks it),
  // and the switch's own link rate (0: in the network at line rate on every port; a host aggregator has one).
  double switch_Bps = 0;
  double switch_link_Bps = 0;
  std::map<std::string, CodecRates> codecs;  // by canonical codec name
  // The training-iteration model: the worker's float32 GEMM rate, and weight-update seconds per parameter byte.
  double flops = 0;
  double update_s_per_byte = 0;
  // CPU seconds a rank's process spends per byte it sends on its busiest link, the receiving of as many included
  // (system calls, the kernel's TCP path, the engine's bookkeeping and polling), beyond reductions and codecs; 0:
  // not measured. What an all-reduce takes from a compute that shares the rank's cores (iteration()).
  double wire_cpu_s_per_byte = 0;
  std::string origin = "built-in";  // the file it came from, for messages

  // Parameters of a 1 Gbit/s Ethernet cluster of ordinary hosts; docs/cost-model.md gives their sources.
  static Profile builtin();
  // Throws InvalidArgument naming `origin` and the field for malformed text, a missing or unknown field, or a
  // value that is not a positive number.
  static Profile parse(std::string_view json_text, const std::string& origin);
  static Profile load(const std::string& path);
  // Canonical JSON (sorted fields, full precision): parse(to_json()) gives the same profile, and equal profiles
  // give equal text, so ranks compare its digest.
  std::string to_json() const;
  uint64_t digest() const;
  double alpha(Algorithm a) const;
  double efficiency(Algorithm a) const;
};

// The predicted time of one call, and the terms it is made of (seconds).
struct Cost {
  double total = 0;
  double latency = 0;  // steps x alpha
  double link = 0;     // bytes on the busiest link (compressed by the codec's ratio) / the link's goodput
  double reduce = 0;   // bytes reduced / (reduction rate x cores)
  double codec = 0;    // bytes encoded and decoded / (codec rates x cores)
  double mem = 0;      // the caller's buffers read and written / memory bandwidth
  double copy = 0;     // same-host bytes / copy rate (cma, the on-host phases of hier)
  double steps = 0;
  double wire_bytes = 0;  // bytes on the busiest link
  // CPU seconds the call costs this rank in all, whatever overlaps: its reductions and codec work at one core's
  // rates, its same-host copies, and its share of wire_bytes (a host's ranks share its link) x
  // wire_cpu_s_per_byte.
  double cpu = 0;
  std::string bound;      // the term the pipeline is limited by: link, reduce, codec, mem or copy
};

// q.bytes as in Query: the whole vector for allreduce, broadcast and reduce, one rank's block otherwise.
// `codec` is a codec name ("" or identity: none). The pipelined terms overlap, so the time is
//   latency + max(link, reduce, codec, mem) (+ copy for the same-host phases),
// the paper's T_AR = max(T_ring, T_add, T_mem) with a latency term added. Throws InvalidArgument when the
// profile lacks the codec's rates.
Cost predict(Collective c, Algorithm a, const Query& q, const Profile& p, std::string_view codec = "");

// A call run by the offload daemons (engine=nicd, docs/nicd.md), q.hosts of them with q.per_host ranks each
// (per_host 0: q.n / q.hosts): each daemon reads its ranks' inputs and writes their outputs at the same-host copy
// rate, combines the inputs in one thread at one core's reduction rate, and runs the daemons' collective (with
// `inter`; automatic: what the daemons' size rules pick for one chunk, as they get no profile) among the hosts,
// in chunks of kOffloadChunkBytes that overlap the copies but for one chunk's (the shorter side's). A rank's own
// part is posting and waiting: two alpha; a world of one rank has no daemon and costs nothing. Cost::cpu is the daemon's CPU over its
// ranks (what each rank's host gives up where the daemon shares its cores); Cost::copy the daemon's copies and
// combining, and `bound` "daemon" where they outlast the daemons' collective.
Cost predict_offloaded(Collective c, const Query& q, const Profile& p, std::string_view codec = "",
                       Algorithm inter = Algorithm::automatic);
// Why the daemons cannot run the call so ("" if they can): a codec on another collective than allreduce, or an
// algorithm their call among the hosts does not have or cannot run.
std::string offloaded_unsupported(Collective c, const Query& q, std::string_view codec, Algorithm inter);
inline constexpr double kOffloadChunkBytes = 4 << 20;  // the daemon's chunk (nicd/server.cc, kChunkBytes)

// The algorithm with the least predicted time among those that support the call (the switch only when the
// profile has its rate).
// Algorithms that auto may pick for small calls only are candidates up to `small_bytes` in all (table.h).
Algorithm cheapest(Collective c, const Query& q, const Profile& p, size_t small_bytes = 262144);

// The paper's training iteration (Sec. IV-C): L square layers of `elems[l]` parameters, batch `batch` per worker;
// T_F = 2 M^2 B / P, T_B = 4 M^2 B / P (times `compute_scale` for a worker that gives cores to communication),
// T_U = update_s_per_byte x 4 M^2, T_AR = the allreduce of each layer's gradient with `algo` and `codec`, and
//   T_total = sum T_F + T_B,L + max(T_B,L-1, T_AR,L) + sum_{l=2}^{L-1} max(T_U,l+1 + T_B,l-1, T_AR,l)
//             + max(T_U,2, T_AR,1) + T_U,1.
// With `error_feedback` (a compressing codec, n > 1), T_B of each layer also carries the DDP hook's error feedback,
// which runs on the backward pass's thread before the layer's gradient is posted: one encode and one decode of the
// gradient plus kFeedbackPasses passes over it in memory (add the residual, subtract, the finiteness check).
struct IterationCost {
  double fwd = 0, bwd = 0, update = 0, allreduce = 0;  // sums over layers
  double feedback = 0;                                 // the error feedback's share of bwd
  double exposed = 0;  // total - fwd - bwd - update: what overlap did not hide, contention included
  double contention = 0;  // what the all-reduces' CPU work added to the overlapped windows (CoreSharing)
  double total = 0;
  std::vector<double> layer_allreduce;
};
// The worker's compute as measured (seconds per iteration, all layers together, e.g. `smartcoll bench train`'s
// phases): where given, each layer's T_F, T_B and T_U are its share of these (in proportion to its parameters)
// instead of the GEMM and update model's, and compute_scale and error_feedback do not apply (the measured
// backward pass already holds whatever ran on its thread). What is left to the model is the all-reduce and how
// it overlaps.
struct MeasuredCompute {
  double fwd = 0, bwd = 0, update = 0;
};
// How the worker's compute and its all-reduces share the cores (the paper's worker has a NIC for the all-reduce
// and all its cores for compute). `cores`: the cores one rank has (its host's cores over the ranks on it; 0: the
// paper's model, the all-reduce costs the compute nothing). `engine_cores` of them are set aside for the engine
// (the engine_cpus knob, or the offload daemon's --cpus on the rank's host): the compute runs on the rest,
// cores / (cores - engine_cores) times longer (measured phases are taken as measured so: the run must have set
// the cores aside), the all-reduce takes nothing from it and at least Cost::cpu / engine_cores. With none set
// aside, a compute that keeps the rank's cores busy shares them with the all-reduce's CPU work (Cost::cpu / cores of
// their time): each window where they overlap is shared_window's. A measured backward pass already ran beside the
// all-reduces, so part of that may be in it twice; the GEMM model's compute is not scaled for cores under 1.
struct CoreSharing {
  double cores = 0, engine_cores = 0;
};
// How long compute (seconds of the cores' full use) and an all-reduce (`allreduce` seconds alone, `cpu` seconds
// of the same cores' time in it) take when they overlap on shared cores, as a fair scheduler shares them: while
// both run, the all-reduce gets the share it needs but at most half, the compute the rest; whichever ends first
// leaves the cores to the other. An all-reduce that needs at most half (or no CPU) ends as it would alone, and
// the window is max(compute + cpu, allreduce), the bound of the paper's overlap plus the CPU work; one that needs
// more is slowed while the compute runs (both demands near each other: the uncompressed ring on shared cores).
double shared_window(double compute, double allreduce, double cpu);

// `offloaded`: each all-reduce runs through an offload daemon per worker's host (predict_offloaded, one rank a
// host), its CPU counted as the host's.
IterationCost iteration(const std::vector<double>& elems, double batch, int n, Algorithm algo, std::string_view codec,
                        const Profile& p, double compute_scale = 1, bool error_feedback = false,
                        const MeasuredCompute* measured = nullptr, const CoreSharing& sharing = {},
                        bool offloaded = false);
inline constexpr double kFeedbackPasses = 7.5;  // float32 passes: 3 (x += r), 3 (r = x - q), 1.5 (isfinite, any)

}  // namespace smartcoll::coll
