#include "coll/table.h"

#include <cmath>

#include "coll/cost.h"
#include "transport/cma.h"

namespace smartcoll::coll {

namespace {

double log2n(int n) { return std::ceil(std::log2(static_cast<double>(n))); }
// rhd and rd run among the largest power of two p <= n; the n - p extra ranks fold their vector in first and get
// the result back last: two more steps, and one more vector on the busiest link, only when n is not a power of 2.
int pow2_below(int n) { return 1 << static_cast<int>(std::floor(std::log2(static_cast<double>(n)))); }
double fold(int n) { return pow2_below(n) == n ? 0.0 : 1.0; }
double log2p(int n) { return std::log2(static_cast<double>(pow2_below(n))); }
std::string any(const Query&) { return ""; }
std::string raw_only(const Query& q) { return q.compressed ? "it does not support codecs; use ring" : ""; }
std::string needs_cma(const Query& q) {
  if (q.compressed) return "it does not support codecs; use ring";
  return q.cma_usable ? ""
                      : "the same-host path is not usable here (same_host_path in Python, cma_unusable_reason() "
                        "in C++, says why)";
}
// algo=shm: what a rank puts in its place in the segment must fit there (its vector or block; all n blocks in
// reduce_scatter and alltoall).
std::string fits_segment(const Query& q, size_t need) {
  if (q.compressed) return "it does not support codecs; use ring";
  if (!q.cma_usable) return needs_cma(q);
  if (q.shm_room == 0)
    return "the same-host control segment is not in use here (see Communicator.same_host_control and the shm_bytes "
           "knob)";
  if (need > q.shm_room)
    return "it puts " + std::to_string(need) + " bytes per rank through the segment, which has room for " +
           std::to_string(q.shm_room) + " (the shm_bytes knob); use cma";
  return "";
}
std::string needs_shm(const Query& q) { return fits_segment(q, q.bytes); }
std::string needs_shm_blocks(const Query& q) { return fits_segment(q, q.bytes * static_cast<size_t>(q.n)); }
std::string needs_switch(const Query& q) {
  // Codecs too: the switch decodes, sums in float32 and encodes the result once.
  return q.switch_set ? "" : "no aggregation switch is set: SMARTCOLL_SWITCH=host:port (start one with smartcoll switch)";
}
std::string needs_switch_raw(const Query& q) {
  return q.compressed ? "it does not support codecs; use ring" : needs_switch(q);
}
double ring_wire(int n) { return 2.0 * (n - 1) / n; }
double share(int n) { return (n - 1.0) / n; }  // all but this rank's 1/n of the vector
double none(int) { return 0.0; }

std::string needs_layout(const Query& q) {
  if (q.hosts < 2 || q.per_host < 2)
    return "it needs several hosts with the same number (at least 2) of ranks each; this job has " +
           std::to_string(q.hosts) + " host(s)" + (q.per_host ? "" : " with different numbers of ranks") +
           " (see Communicator.hosts and the host knob)";
  return "";
}
std::string needs_hosts(const Query& q) {
  return q.compressed ? "it does not support codecs; use ring or switch_hier" : needs_layout(q);
}
std::string needs_switch_hosts(const Query& q) {
  const std::string why = needs_switch(q);
  return why.empty() ? needs_layout(q) : why;
}

// Same host, small calls: every rank copies its input into the segment and, once all have, computes its output
// from every rank's place there (reading n vectors or blocks): one round, no system call while the ranks run.
// `wire` counts the bytes read from the segment. allreduce and reduce from 16 KiB (transport/cma.cc) take two
// rounds: rank q reduces chunk q of every rank's vector in place of its own, then the chunks are copied out
// (reading one vector in chunks and the others' chunks; (n-1)/n of a vector reduced); their entries count that.
double all_n(int n) { return static_cast<double>(n); }
double one(int) { return 1.0; }
constexpr char kShmText[] = "same host, small calls: the data goes through the shared control segment, one round";
constexpr AlgorithmInfo shm_entry(std::string (*unsupported)(const Query&), double (*read)(int), double (*reduced)(int),
                                  const char* text = kShmText) {
  return {Algorithm::shm, text, same_host_shm, unsupported, one, read, reduced,
          // choose() takes it by its own rule before any profile: the cost entry leaves out the cache that
          // decides between it and the reads.
          AlgorithmInfo::Auto::never};
}
constexpr char kShmChunksText[] =
    "same host, small calls: the data goes through the shared control segment; from 16 KiB rank q reduces chunk q "
    "there and the chunks are copied out, two rounds";
constexpr AlgorithmInfo kAllreduceAlgos[] = {
    {Algorithm::ring, "pipelined segmented ring (reduce-scatter + allgather in one pipeline), any codec",
     allreduce_ring, any, [](int n) { return 2.0 * (n - 1); }, ring_wire, share},
    {Algorithm::rhd, "recursive halving-doubling; non-power-of-two worlds fold the extra ranks in first",
     allreduce_rhd, raw_only, [](int n) { return 2 * log2p(n) + 2 * fold(n); },
     [](int n) { return ring_wire(pow2_below(n)) + fold(n); }, [](int n) { return share(pow2_below(n)) + fold(n); }},
    {Algorithm::rd, "recursive doubling: log2(n) exchanges of the whole vector; fewest steps for tiny messages",
     allreduce_rd, raw_only, [](int n) { return log2p(n) + 2 * fold(n); }, [](int n) { return log2p(n) + fold(n); },
     [](int n) { return log2p(n) + fold(n); }},
    {Algorithm::cma, "same host: every rank reads its peers' buffers once with process_vm_readv", same_host_cma,
     needs_cma, [](int) { return 4.0; }, share, share},
    shm_entry(needs_shm, [](int n) { return 1.0 + share(n); }, share, kShmChunksText),
    {Algorithm::hier,
     "hierarchical: reduce-scatter on each host, allreduce across hosts per local index, allgather on each host",
     allreduce_hier, needs_hosts, [](int n) { return 2.0 * (n - 1); }, ring_wire, share},
    // Each rank sends its vector once and receives the sum once, whatever n; the switch adds one hop each way.
    {Algorithm::switch_, "in-network aggregation: the switches of the switch knob sum chunks as they arrive",
     allreduce_switch, needs_switch, [](int) { return 2.0; }, [](int) { return 1.0; }, none},
    // Per rank as the switch's, 1/k of the vector from each of a host's k ranks; cost.cc has the host's link.
    {Algorithm::switch_hier,
     "hierarchical through the switches: reduce-scatter on each host, chunk i through the switches among the i-th "
     "ranks of every host, allgather on each host; a host's link carries the vector once each way, any codec",
     allreduce_switch_hier, needs_switch_hosts, [](int) { return 2.0; }, [](int) { return 1.0; }, share},
};
// Same host, the other collectives: one exchange of addresses, single-copy reads, one closing barrier.
constexpr AlgorithmInfo kCmaGather = {Algorithm::cma, "same host: each rank reads its peers' blocks once", same_host_cma,
                                      needs_cma, [](int) { return 3.0; }, [](int n) { return n - 1.0; }, none};
constexpr char kCmaReduceText[] = "same host: chunk q reduced by rank q from every rank's input";
constexpr AlgorithmInfo kCmaReduce = {Algorithm::cma, kCmaReduceText, same_host_cma, needs_cma,
                                      [](int) { return 4.0; }, share, share};
constexpr AlgorithmInfo kReduceScatterAlgos[] = {
    {Algorithm::ring, "pipelined ring, any codec", reduce_scatter_ring, any, [](int n) { return n - 1.0; },
     [](int n) { return n - 1.0; }, [](int n) { return n - 1.0; }},
    // `bytes` is one rank's block here: it reads and adds the n-1 other ranks' copies of its block.
    {Algorithm::cma, kCmaReduceText, same_host_cma, needs_cma, [](int) { return 4.0; }, [](int n) { return n - 1.0; },
     [](int n) { return n - 1.0; }},
    shm_entry(needs_shm_blocks, all_n, [](int n) { return n - 1.0; }),
    // Its cost depends on the hosts (predict's own case): the flat counts here are the ring's. Picked by choose()'s
    // rule, for interleaved hosts only.
    {Algorithm::hier, "hierarchical: reduce-scatter rings on each host, then a ring across hosts per local index",
     reduce_scatter_hier, needs_hosts, [](int n) { return n - 1.0; }, [](int n) { return n - 1.0; },
     [](int n) { return n - 1.0; }, AlgorithmInfo::Auto::never},
    // Each rank sends all n blocks and gets its own block's sums: more bytes out than the ring's n - 1.
    {Algorithm::switch_, "in-network aggregation: every rank sends every block, the switch sends each block's sums "
     "to its owner alone", reduce_scatter_switch, needs_switch_raw, [](int) { return 2.0; },
     [](int n) { return static_cast<double>(n); }, none},
};
constexpr AlgorithmInfo kAllgatherAlgos[] = {
    {Algorithm::ring, "pipelined ring, any codec", allgather_ring, any, [](int n) { return n - 1.0; },
     [](int n) { return n - 1.0; }, none},
    // Its steps are not pipelined: on 8 emulated hosts it took up to 2x the ring's time from 1 MiB, where the model
    // has the two level (BENCHMARKS.md, "The cost model against every collective and algorithm").
    {Algorithm::bruck, "Bruck: ceil(log2 n) steps, blocks rotated into place at the end", allgather_bruck, raw_only,
     [](int n) { return log2n(n); }, [](int n) { return n - 1.0; }, none, AlgorithmInfo::Auto::small_only},
    kCmaGather,
    shm_entry(needs_shm, all_n, none),
    {Algorithm::hier, "hierarchical: a ring across hosts per local index, then rings on each host", allgather_hier,
     needs_hosts, [](int n) { return n - 1.0; }, [](int n) { return n - 1.0; }, none, AlgorithmInfo::Auto::never},
    // Each rank sends its block once and receives the n - 1 others (and 48-byte headers of theirs).
    {Algorithm::switch_, "through the aggregation switches: each rank sends its block once, the switch forwards it "
     "to the others", allgather_switch, needs_switch_raw, [](int) { return 2.0; }, [](int n) { return n - 1.0; },
     none},
};
constexpr AlgorithmInfo kBroadcastAlgos[] = {
    {Algorithm::tree, "binomial tree: log2(n) steps", broadcast_tree, raw_only, [](int n) { return log2n(n); },
     [](int n) { return log2n(n); }, none},
    {Algorithm::chain, "pipelined chain: the link rate whatever n, n-1 steps to fill", broadcast_chain, raw_only,
     [](int n) { return n - 1.0; }, [](int) { return 1.0; }, none},
    {Algorithm::cma, "same host: every rank reads the root's buffer once", same_host_cma, needs_cma,
     [](int) { return 3.0; }, [](int) { return 1.0; }, none},
    shm_entry(needs_shm, one, none),
    // Steps as the chain's (the two chains fill one after the other); picked by choose()'s rule, for interleaved
    // hosts only.
    {Algorithm::hier, "hierarchical: a pipelined chain across hosts, then a chain on each host", broadcast_hier,
     needs_hosts, [](int n) { return n - 1.0; }, [](int) { return 1.0; }, none, AlgorithmInfo::Auto::never},
};
constexpr AlgorithmInfo kReduceAlgos[] = {
    {Algorithm::tree, "binomial tree: log2(n) steps", reduce_tree, raw_only, [](int n) { return log2n(n); },
     [](int n) { return log2n(n); }, [](int n) { return log2n(n); }},
    {Algorithm::chain, "pipelined chain: the link rate whatever n, n-1 steps to fill", reduce_chain, raw_only,
     [](int n) { return n - 1.0; }, [](int) { return 1.0; }, [](int) { return 1.0; }},
    kCmaReduce,
    shm_entry(needs_shm, [](int n) { return 1.0 + share(n); }, share, kShmChunksText),
    {Algorithm::hier, "hierarchical: a pipelined chain on each host, then a chain across hosts", reduce_hier,
     needs_hosts, [](int n) { return n - 1.0; }, [](int) { return 1.0; }, [](int) { return 1.0; },
     AlgorithmInfo::Auto::never},
};
// Blocks a Bruck alltoall sends per rank: one per set bit of every slot index below n.
double bruck_blocks(int n) {
  double blocks = 0;
  for (int i = 1; i < n; ++i) blocks += __builtin_popcount(static_cast<unsigned>(i));
  return blocks;
}
constexpr AlgorithmInfo kAlltoallAlgos[] = {
    {Algorithm::direct, "every pair at once", alltoall_direct, raw_only, [](int) { return 1.0; },
     [](int n) { return n - 1.0; }, none},
    // Not picked by auto: direct's entry counts its n-1 messages as one step and leaves out incast, which is what
    // these two would save (docs/cost-model.md, Limits).
    {Algorithm::bruck, "Bruck: ceil(log2 n) steps of about n/2 blocks each, for small blocks", alltoall_bruck,
     raw_only, [](int n) { return log2n(n); }, bruck_blocks, none, AlgorithmInfo::Auto::never},
    {Algorithm::pairwise, "pairwise: n-1 rounds, one peer each way per round (no incast at a receiver)",
     alltoall_pairwise, raw_only, [](int n) { return n - 1.0; }, [](int n) { return n - 1.0; }, none,
     AlgorithmInfo::Auto::never},
    kCmaGather,
    shm_entry(needs_shm_blocks, all_n, none),
};
constexpr AlgorithmInfo kAlltoallvAlgos[] = {
    {Algorithm::direct, "every pair at once, each block after its count (checked by the receiver)", alltoallv_direct,
     raw_only, [](int) { return 1.0; }, [](int n) { return n - 1.0; }, none},
};
constexpr AlgorithmInfo kBarrierAlgos[] = {
    {Algorithm::dissemination, "dissemination: ceil(log2 n) rounds of one signal each", barrier_dissemination,
     any, [](int n) { return log2n(n); }, none, none},
    shm_entry(needs_shm, one, none),
};

// auto without a profile, where a switch is set: the switch when the built-in cost model predicts it faster than
// the ring for this size and world (each rank moves S each way where the ring moves 2(n-1)/n S, against one
// round trip through the switch where the ring pays 2(n-1) steps): from 3 ranks on, above the small sizes.
bool faster(Algorithm a, Algorithm than, const Query& q) {
  static const Profile builtin = Profile::builtin();
  return predict(Collective::allreduce, a, q, builtin).total < predict(Collective::allreduce, than, q, builtin).total;
}

}  // namespace

std::span<const AlgorithmInfo> algorithms(Collective c) {
  switch (c) {
    case Collective::allreduce: return kAllreduceAlgos;
    case Collective::reduce_scatter: return kReduceScatterAlgos;
    case Collective::allgather: return kAllgatherAlgos;
    case Collective::broadcast: return kBroadcastAlgos;
    case Collective::reduce: return kReduceAlgos;
    case Collective::alltoall: return kAlltoallAlgos;
    case Collective::barrier: return kBarrierAlgos;
    case Collective::alltoallv: return kAlltoallvAlgos;
  }
  return {};
}

size_t call_bytes(Collective c, const Query& q) {
  const bool blocks = c == Collective::reduce_scatter || c == Collective::allgather || c == Collective::alltoall;
  return q.bytes * (blocks ? static_cast<size_t>(q.n) : 1);
}

Collective parse_collective(std::string_view name) {
  std::string names;
  for (int i = 0; i < kCollectives; ++i) {
    const auto c = static_cast<Collective>(i);
    if (collective_name(c) == name) return c;
    names += (names.empty() ? "" : ", ") + std::string(collective_name(c));
  }
  throw InvalidArgument("unknown collective '" + std::string(name) + "'; choose " + names);
}

const AlgorithmInfo& find(Collective c, Algorithm a) {
  for (const AlgorithmInfo& info : algorithms(c))
    if (info.algo == a) return info;  // every call: the names below only for the error
  std::string names;
  for (const AlgorithmInfo& info : algorithms(c))
    names += (names.empty() ? "" : ", ") + std::string(algorithm_name(info.algo));
  throw InvalidArgument(std::string(collective_name(c)) + " has no algorithm '" + std::string(algorithm_name(a)) +
                        "'; choose auto, " + names);
}

Algorithm choose(Collective c, const Query& q, Algorithm requested, size_t small_bytes, const Profile* profile) {
  if (requested != Algorithm::automatic) {
    const AlgorithmInfo& info = find(c, requested);
    if (std::string why = info.unsupported(q); !why.empty())
      throw InvalidArgument(std::string(collective_name(c)) + ": algo '" + std::string(algorithm_name(requested)) +
                            "' cannot run this call: " + why);
    return requested;
  }
  // On one host a call whose data fits the control segment goes through it, profile or not: one round of stores
  // and loads where the reads pay a system call and page pins per read, and TCP a system call per message. But
  // each rank copies its contribution in and reads n vectors (or blocks) out, where the reads copy each byte once:
  // it wins while that stays cache-sized. Measured at 2 and 4 ranks (a 2-core EPYC, 32 MiB L3; BENCHMARKS.md,
  // "Small calls through the same-host segment"): faster than the reads up to 4-5 MiB copied per rank (1 MiB
  // allreduce at 4 ranks: 269 against 365 us), level or slower from 8 MiB (alltoall of 4 MiB at 2 ranks: 292
  // against 162 us). Calibration runs across hosts, where the path does not exist.
  if (c != Collective::alltoallv) {
    constexpr double kShmRankBytes = 6 << 20, kShmCallBytes = 24 << 20;
    const AlgorithmInfo& shm = find(c, Algorithm::shm);
    const bool blocks = c == Collective::reduce_scatter || c == Collective::alltoall;
    // allreduce and reduce read n vectors below the size where they go in chunks (the table's entry is theirs).
    const bool one_round = (c == Collective::allreduce || c == Collective::reduce) && q.bytes < cma::kSplitReductionBytes;
    const double in = static_cast<double>(q.bytes) * (blocks ? q.n : 1),
                 per_rank = in + (one_round ? q.n : shm.wire(q.n)) * static_cast<double>(q.bytes);
    if (shm.unsupported(q).empty() && per_rank <= kShmRankBytes && q.n * per_rank <= kShmCallBytes)
      return Algorithm::shm;
  }
  // allgather, reduce_scatter, broadcast and reduce over hosts whose ranks are interleaved: a flat ring (or chain)
  // crosses the network at every hop, so each host's link carries about k times what the hierarchical rings
  // (chains) put on it; on 4 hosts x 2 interleaved ranks hier was 1.5-2.3x faster. Where each host's ranks are
  // consecutive, the flat chains cross each link once, as hier's do, and stay; a host's last rank in a flat ring
  // sends kH - 1 blocks over its link, hier's ranks k(H - 1) in all (7 against 6 on 4 hosts x 2), and hier's rings
  // on the host go through Unix sockets: 1.06-1.29x the ring's speed for allgather there, 0.99-1.09x for
  // reduce_scatter (BENCHMARKS.md, "Unix sockets between ranks of one host"). The model does not see the layout:
  // the rule comes before a profile.
  const bool spread = c != Collective::allreduce && c != Collective::alltoall && c != Collective::alltoallv &&
                      c != Collective::barrier;
  const bool rings = c == Collective::allgather || c == Collective::reduce_scatter;
  if (spread && (q.interleaved || rings) && needs_hosts(q).empty() && call_bytes(c, q) > small_bytes)
    return Algorithm::hier;
  // alltoall across many hosts: direct's n-1 senders converge on every receiver at once and overflow a port with
  // a short queue (incast): on 8 emulated 1 Gbit/s hosts 1 MiB per rank took 154-252 ms with direct, 8-10 ms with
  // pairwise, which sends to one peer at a time; from 16 MiB both stalled and direct less (BENCHMARKS.md, "The
  // cost model against every collective and algorithm"). The model has no incast term (with a calibrated profile
  // it picked direct: 211 ms against pairwise's 7.9): the rule comes before a profile.
  constexpr int kIncastHosts = 8;
  constexpr size_t kPairwiseMaxBytes = size_t{4} << 20;
  if (c == Collective::alltoall && q.hosts >= kIncastHosts && call_bytes(c, q) > small_bytes &&
      call_bytes(c, q) <= kPairwiseMaxBytes && !q.compressed)
    return Algorithm::pairwise;
  if (profile) return cheapest(c, q, *profile, small_bytes);
  const bool small = q.bytes <= small_bytes;
  const bool small_total = call_bytes(c, q) <= small_bytes;
  // On one host, single-copy reads beat copying every byte through TCP twice once the call is not tiny: with
  // the control messages in shared memory they won from 256 KiB in all for every collective, measured side by
  // side (BENCHMARKS.md, "Same-host collectives with a shared-memory control channel").
  const bool same_host = q.cma_usable && !q.compressed;
  switch (c) {
    case Collective::allreduce:
      if (q.compressed) return Algorithm::ring;
      // Recursive doubling sends the whole vector log2(n) times: only while the latency dominates. Among two
      // ranks (n < 4 folds into two) it sends what halving-doubling does in one step instead of two.
      if (small) return q.bytes <= 8192 || q.n < 4 ? Algorithm::rd : Algorithm::rhd;
      if (same_host) return Algorithm::cma;
      // Several ranks per host with a switch: the switches take one host's share (1/k of the vector from each of its
      // k ranks) where the hierarchical ring sends 2(H-1)/H of it over each host's link, from 3 hosts on.
      if (needs_hosts(q).empty())
        return q.switch_set && faster(Algorithm::switch_hier, Algorithm::hier, q) ? Algorithm::switch_hier
                                                                                   : Algorithm::hier;
      if (q.switch_set && faster(Algorithm::switch_, Algorithm::ring, q)) return Algorithm::switch_;
      return Algorithm::ring;
    case Collective::allgather:
      if (small_total) return q.compressed ? Algorithm::ring : Algorithm::bruck;
      return same_host ? Algorithm::cma : Algorithm::ring;
    case Collective::reduce_scatter:
      return same_host && !small_total ? Algorithm::cma : algorithms(c).front().algo;
    case Collective::alltoall:
      return same_host && !small_total ? Algorithm::cma : Algorithm::direct;
    case Collective::broadcast:
    case Collective::reduce:
      if (small) return Algorithm::tree;
      return same_host ? Algorithm::cma : Algorithm::chain;
    default: return algorithms(c).front().algo;
  }
}

}  // namespace smartcoll::coll
