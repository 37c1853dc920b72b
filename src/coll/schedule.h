// Building blocks of every algorithm: a Builder that turns an algorithm's steps into a Task's lanes, the
// reductions a receive can finish with, how a vector is cut into chunks and segments, and the ring schedule.
// docs/algorithms.md gives each algorithm's steps and bytes on the wire.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <initializer_list>
#include <memory>
#include <vector>

#include "core/task.h"
#include "smartcoll/comm.h"
#include "smartcoll/codec.h"
#include "smartcoll/types.h"

namespace smartcoll {
class BufferPool;
class Transport;
namespace cma {
class Local;
}
namespace sw {
struct Path;
}
}  // namespace smartcoll

namespace smartcoll::coll {

struct Views;

// What a call's algorithm needs to know besides its buffers.
struct Context {
  int rank, size, streams;
  Transport* transport = nullptr;  // for the same-host path, which drives its own control messages
  cma::Local* cma = nullptr;
  sw::Path* sw = nullptr;          // the aggregation switches, when the switch knob is set
  size_t segment_bytes;          // pipeline unit of ring and chain algorithms
  bool codec_owner = false;      // compressed allreduce, reduce_scatter: encode each contribution once
  std::shared_ptr<BufferPool> pool;
  const std::vector<int>* hosts = nullptr;  // [rank]: its host (hierarchical algorithms)
};

// The reduction of a call, kept alive by the task for the lanes' `after`.
struct ReduceSpec {
  DataType dtype;
  ReduceOp op;
  int divisor;  // for avg: the world size
  Codec codec;  // identity: elements travel as they are
  std::shared_ptr<const Views> views = nullptr;  // a list call's (coll/segmented.h), which its codec steps address
  const Codec* wire() const { return codec.kind() == CodecKind::identity ? nullptr : &codec; }
};

// What a receive does once its bytes are in (Op::finish).
enum Finish : uint8_t {
  kNone = 0,
  kReduce,               // dst = local op received
  kReduceFromLeft,       // dst = received op local (the sender's operand goes first: a fixed order everywhere)
  kCodecReduceEncode,    // enc = encode(local + decode(received)): a partial sum forwarded to the next hop
  kCodecReduce,          // dst = local + decode(received)
  kCodecReduceShare,     // dst = decode(enc = encode(local + decode(received))): the final sum every rank gets
  kCodecDecode,          // dst = decode(received)
  kCheckCount,           // the received uint64 must equal elems (alltoallv's pairwise counts)
};

class Builder {
 public:
  Builder(Task& task, const Context& cx, std::shared_ptr<const ReduceSpec> spec);

  const Context& cx;
  const ReduceSpec& spec;

  // Ops on `stream` (its lane), returning the op's index in the lane for later dependencies (-1: none).
  int32_t send(int stream, int peer, const char* buf, size_t len, std::initializer_list<int32_t> deps = {});
  int32_t recv(int stream, int peer, char* buf, size_t len, std::initializer_list<int32_t> deps = {},
               Finish finish = kNone, char* dst = nullptr, const char* local = nullptr, size_t elems = 0,
               bool divide = false, uint8_t* enc = nullptr);
  int32_t compute(int stream, std::function<void()> fn, std::initializer_list<int32_t> deps = {});
  // memmove(dst, src, bytes) as an op: unlike a compute's, its addresses may lie in a segmented view
  // (coll/segmented.h), which splits it per piece.
  int32_t copy(int stream, char* dst, const char* src, size_t bytes, std::initializer_list<int32_t> deps = {});
  // A no-op that completes once all of `ops` have (to depend on many ops at once).
  int32_t join(int stream, const std::vector<int32_t>& ops);
  // Memory that lives as long as the task, from the engine's pool.
  char* scratch(size_t bytes);
  // The call runs `body` alone instead of lanes (core/task.h); with `lanes_instead`, the lanes built next to it
  // (of algorithm `lanes_algo`) run instead where that says so, once every earlier call that runs alone is done.
  void exclusive(std::function<void()> body, std::function<bool()> lanes_instead = {},
                 Algorithm lanes_algo = Algorithm::ring);
  // A body that may stop waiting for its peers at `until` and go on when run again (Task::exclusive).
  void exclusive_until(std::function<bool(std::chrono::steady_clock::time_point until)> body);
  Collective collective() const;
  // A list call's digest of its counts where ranks compare their calls (the check knob); else 0.
  uint32_t compared_layout() const;
  // The call being built: its number and descriptor are final when it runs.
  const Task& task() const { return task_; }

 private:
  Lane& lane(int stream);
  int32_t add(int stream, Op op, std::initializer_list<int32_t> deps);
  Task& task_;
  std::vector<int> lane_of_stream_;
  std::vector<uint8_t> said_;  // [(peer * streams + stream) * 2 + send]: the call's header went already
};

// Element ranges [off, off + len) of consecutive pieces of at most `piece` elements.
template <class F>
void for_each_segment(size_t len, size_t piece, F&& f) {
  for (size_t off = 0; off < len; off += piece) f(off, std::min(piece, len - off));
}

// Part p of m elements cut n ways, the first m % n parts one longer: [part_begin(p), part_begin(p + 1)).
inline size_t part_begin(size_t m, int n, int p) {
  const auto parts = static_cast<size_t>(n), at = static_cast<size_t>(p);
  return at * (m / parts) + std::min(at, m % parts);
}

// One chunk per rank, in elements, and where each chunk sits on the wire. With a codec every chunk is encoded
// on its own (a sequence of whole blocks, only its last one partial), so wire offsets add up encoded sizes.
struct Chunks {
  std::vector<size_t> off, len, wire_off, wire_len;
  size_t wire_total() const { return wire_off.empty() ? 0 : wire_off.back() + wire_len.back(); }
};
// A vector cut into n chunks at block boundaries, so that only the vector's last block is partial.
Chunks split_vector(size_t count, int n, size_t esize, const Codec* codec);
// n blocks of `per_rank` elements each.
Chunks equal_blocks(size_t per_rank, int n, size_t esize, const Codec* codec);
size_t segment_elems(size_t segment_bytes, size_t esize, const Codec* codec);
std::vector<char*> chunk_pointers(char* base, const Chunks& ch, size_t esize);

enum class Step : uint8_t { reduce, last_reduce, gather };

// Buffers of a ring: `in` is this rank's input (the local operand of reductions), acc[c] where chunk c's
// reduced or gathered elements go, enc the encoded vector (codec only; chunk c at wire_off[c]).
struct RingBuffers {
  const char* in;
  std::vector<char*> acc;
  uint8_t* enc;
  bool share_final;  // the last reduction is encoded once and decoded by every rank (allreduce)
  bool pre_encoded;  // enc already holds the chunk sent first
};

// The ranks a schedule runs over, in ring order; members[pos] is this rank. Empty members: the whole world.
struct Group {
  std::vector<int> members;
  int pos = 0;
};

// Where this rank sits in the host layout: `local`, the ranks of its host (ascending), and `cross`, the ranks
// with its local index on every host (hosts in order of their numbers). Only for a layout of at least two hosts
// with the same number of ranks each (host_layout_shape: per_host > 0); host_grid gives it.
struct Layout {
  Group local, cross;
};
// [g][j]: the j-th rank (ascending) of the g-th host (hosts in order of their numbers).
std::vector<std::vector<int>> ranks_by_host(const std::vector<int>& hosts);
// The host layout as the hierarchical algorithms walk it: k ranks on each of `hosts` hosts; this rank is the i-th
// of the h-th host; rank_at(g, j) is the j-th rank of host g.
struct HostGrid {
  Layout at;
  std::vector<std::vector<int>> by_host;
  int k, hosts, i, h;
  int rank_at(int g, int j) const { return by_host[static_cast<size_t>(g)][static_cast<size_t>(j)]; }
  // The two chains of a rooted collective (broadcast, reduce): across hosts among the ranks with the root's local
  // index i0, from the root's host g0 on, and on each host from its i0-th rank on; this rank's places in them.
  struct Chains {
    int g0, i0;
    bool across;  // this rank is in the chain across hosts
    int cpos, lpos;
  };
  Chains chains(int root) const;
};
HostGrid host_grid(const std::vector<int>& hosts, int rank);
// Hosts and ranks per host when every host has the same number of ranks; {hosts, 0} otherwise.
std::pair<int, int> host_layout_shape(const std::vector<int>& hosts);
// Whether some host's ranks are not consecutive (round-robin placement, mpirun --map-by node): a ring over the
// ranks in order then crosses the network at every hop.
bool hosts_interleaved(const std::vector<int>& hosts);

// The ops a ring added: what later steps of a call depend on. Step k's receives are recvs[step_recvs[k]] up to
// recvs[step_recvs[k + 1]] (the last step's, to the end).
struct RingOps {
  std::vector<int32_t> sends, recvs;
  std::vector<size_t> step_recvs;
  // The receives that brought chunk `c` (of a ring of n members starting at `first`): empty for the chunk sent
  // first, which the ring never receives.
  std::vector<int32_t> received(int c, int first, int n) const;
};

// Ring schedule: at step k this rank sends chunk first-k to the next member and receives chunk first-k-1 from the
// previous one (chunks and `first` count members: one chunk per member); what it receives at step k it sends at
// step k+1, so the whole schedule is one pipeline. Segment j of every chunk travels on stream j mod streams, so
// each stream is an independent pipeline (one lane, one worker). `ready` (lane 0 only) must be done before
// anything is sent or received; `streams` 0: all of cx.streams. `step_ready` (lane 0 only; -1 entries: none): op
// step_ready[k] must be done before step k's receives finish (what their reductions read).
RingOps ring(Builder& b, int steps, int first, const std::function<Step(int)>& kind_of, const Chunks& ch,
             const RingBuffers& buf, int streams = 0, int32_t ready = -1, const Group& group = {},
             const std::vector<int32_t>& step_ready = {});

// The finish step of a receive (Lane::after).
void after_receive(const void* spec, const Op& op, const char* data);

int mod(int a, int n);

}  // namespace smartcoll::coll
