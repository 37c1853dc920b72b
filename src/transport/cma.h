// Same-host fast path: collectives between processes on one host that read each other's buffers directly with
// Linux cross-memory attach (process_vm_readv), so each byte is copied once instead of going through two socket
// copies per hop. The small control messages (what each rank calls, its buffer addresses, barriers) go through a
// shared-memory segment, or through the Transport where the segment cannot be made (transport/cma_control.h);
// either way a dead or stalled peer is reported by name within the no-progress timeout.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <atomic>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "smartcoll/comm.h"
#include "smartcoll/types.h"
#include "transport/cma_control.h"
#include "transport/transport.h"

namespace smartcoll::cma {

// Through the segment, an allreduce or reduce of at least this many bytes is reduced in chunks, one per rank,
// then copied out after a barrier: each rank adds (n-1)/n of a vector instead of n-1 vectors, and reads two
// instead of n. Measured at 4 ranks on 2 cores (BENCHMARKS.md, "Same-host reductions through the segment in
// chunks"): 1 MiB in 377-407 us against 667-704, level from 1 to 16 KiB, where the barrier costs what the
// chunks save.
inline constexpr size_t kSplitReductionBytes = 16384;

// Bytes at an address of this process: a piece of a list call, as its table, which peers read, lists them.
struct Extent {
  uint64_t at, bytes;
};

// One side of a call (a rank's input or output) as the byte ranges that hold it, in order: one buffer, or a list
// call's pieces. Offsets are into the vector they make up. Also how the offload daemon maps a rank's list call.
class Vector {
 public:
  Vector() = default;
  Vector(uint64_t at, uint64_t bytes) { add(at, bytes); }
  explicit Vector(std::span<const Extent> parts) {
    for (const Extent& e : parts) add(e.at, e.bytes);
  }
  uint64_t bytes() const { return ends_.empty() ? 0 : ends_.back(); }

  // fn(address, offset in the range, n) over the runs of [off, off + len), in order (within bytes()).
  template <class F>
  void runs(uint64_t off, uint64_t len, F&& fn) const {
    auto i = static_cast<size_t>(std::upper_bound(ends_.begin(), ends_.end(), off) - ends_.begin());
    for (uint64_t done = 0; done < len; ++i) {
      const uint64_t in = off + done - (ends_[i] - parts_[i].bytes);
      const uint64_t n = std::min(len - done, parts_[i].bytes - in);
      fn(reinterpret_cast<char*>(static_cast<uintptr_t>(parts_[i].at + in)), done, n);
      done += n;
    }
  }
  // [off, off + len) as iovecs of at most 1 GiB each (the kernel caps one transfer near 2 GiB).
  std::vector<iovec> iov(uint64_t off, uint64_t len) const {
    std::vector<iovec> v;
    runs(off, len, [&v](char* at, uint64_t, uint64_t n) {
      for (uint64_t k = 0; k < n; k += kStep) v.push_back({at + k, std::min(n - k, kStep)});
    });
    return v;
  }
  // The address of byte `off` (< bytes()) and how many bytes of its part follow it.
  std::pair<char*, uint64_t> locate(uint64_t off) const {
    const auto i = static_cast<size_t>(std::upper_bound(ends_.begin(), ends_.end(), off) - ends_.begin());
    const uint64_t in = off - (ends_[i] - parts_[i].bytes);
    return {reinterpret_cast<char*>(static_cast<uintptr_t>(parts_[i].at + in)), parts_[i].bytes - in};
  }

 private:
  static constexpr uint64_t kStep = uint64_t{1} << 30;
  // Parts that follow each other in memory (a list of views of one buffer) become one: fewer, longer iovecs.
  void add(uint64_t at, uint64_t n) {
    if (n == 0) return;
    if (!parts_.empty() && parts_.back().at + parts_.back().bytes == at) {
      parts_.back().bytes += n;
      ends_.back() += n;
      return;
    }
    ends_.push_back(bytes() + n);
    parts_.push_back({at, n});
  }
  std::vector<Extent> parts_;
  std::vector<uint64_t> ends_;  // [i]: where part i ends in the vector
};

// Which kernel and namespaces this process runs in: two processes may read each other's memory by pid only when
// these all match. Empty (and `error` says why) when it cannot be read.
std::string host_identity(std::string& error);

// Reads the bytes of `remote` in process `pid`'s memory into `local` (the same total, cut alike or not), in
// batches of IOV_MAX; a short read resumes where it stopped. Returns 0, or the errno that stopped it (-1: a read
// that moved nothing).
int read_process(int pid, std::span<const iovec> local, std::span<const iovec> remote);
// The same, writing `local` into `remote` (process_vm_writev).
int write_process(int pid, std::span<const iovec> local, std::span<const iovec> remote);
// Whether process `pid` has exited (gone, or a zombie with no thread left running); false where it cannot tell.
bool process_gone(int pid);

class Local {
 public:
  // Exchanges pid and host identity (boot id, host name, network and pid namespaces) with every rank through the
  // Transport, then probes that process_vm_readv of every peer works (each rank reads a random token from every
  // peer). All ranks reach the same verdict: usable() is true everywhere only if every rank found every peer on
  // its host and readable. Under Yama ptrace_scope=1 it calls prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) first so
  // that sibling processes may read this one, and undoes that when the path is unusable and at destruction.
  // With `shm`, rank 0 also creates the control segment and every rank maps it during the probe; the ranks use it
  // only if all of them could, else the Transport carries the control messages. `spin_us`: how long a wait for
  // the peers spins before it sleeps. `data_bytes`: room per rank in the segment for the data of small calls
  // (Call::through_segment; every rank must pass the same). Throws CommError only when the Transport fails (a
  // peer died). A world of size 1 is usable (allreduce is a copy).
  explicit Local(Transport& t, bool shm = true, double spin_us = 200, size_t data_bytes = 0);
  ~Local();
  Local(const Local&) = delete;
  Local& operator=(const Local&) = delete;

  bool usable() const { return usable_; }
  // [rank]: its process id, where usable().
  const std::vector<int>& pids() const { return pids_; }
  std::string why_not() const { return why_not_; }  // empty when usable
  // Where the control messages go: "shm" (the shared segment), "tcp" (the Transport), "" when unusable.
  std::string control() const { return control_ ? control_->kind() : ""; }
  // Peers waiting on this rank in a call fail at once, naming it (an abort; the destructor does the same).
  void leave() {
    if (control_) control_->leave();
  }

  // A collective among ranks that all share this host, as the communicator's call passes it (count per rank for
  // reduce_scatter, allgather and alltoall; broadcast's buffer is `out`; reduce's out is read on the root only).
  // A list call (docs/vectored.md) gives a side as its pieces instead, in vector order, each a whole number (not
  // 0) of elements (in_list for in, out_list for out; an empty list: the pointer is the buffer), and the digest
  // of its counts (`layout`, 0 where calls are not compared): the call reads and writes the pieces where they are.
  // `call` and `desc` (a core/task.h Descriptor) number and describe the communicator's call, so that a peer
  // that made that call on another path is named with it (0 and null: not numbered).
  struct Call {
    Collective coll;
    DataType dt;
    ReduceOp op;
    int root;
    size_t count;
    const char* in;
    char* out;
    std::span<const Extent> in_list = {}, out_list = {};
    uint32_t layout = 0;
    uint64_t call = 0;
    const void* desc = nullptr;
    // The data goes through the control segment instead of single-copy reads: each rank copies its input into
    // its place there, publishes, and once every rank has published computes its output from the places (the
    // same rank-order reduction as the reads; no closing barrier, as nobody reads a rank's buffers). One round
    // of the segment per call, two for allreduce and reduce from kSplitReductionBytes: for small calls, where a
    // read's system call and page pinning cost more than the copies. What a rank puts there must fit
    // segment_room().
    bool through_segment = false;
  };
  // Runs `c` with single-copy reads of the peers' buffers: each byte crosses memory once (allgather, alltoall,
  // broadcast) or is read once by the rank that reduces it (chunk q of a reduction by rank q, in rank order: every
  // rank gets identical bits, the same from run to run, for a list as for the same elements in one buffer; avg
  // divides the sum by n once). Buffers must not be touched by the caller during the call; in == out (the same
  // pieces, for lists) is in place, other overlap is not allowed. Throws CommError naming the peer when a read
  // fails (the peer died: ESRCH) or a barrier fails, and when ranks call different collectives, counts, dtypes,
  // ops, roots or list layouts. Requires usable().
  // Returns false where it stopped waiting for its peers to publish the call at `until` (a caller's wait
  // deadline): the next run() with the same call goes on where this one stopped (the no-progress timeout counts
  // from the first); nothing else may run on this Local in between. Only that first wait stops at `until`: once
  // every rank published, the reads' barriers wait for the peers to finish their reads (within the timeout).
  // Refused before publishing (InvalidArgument: the call does not fit, avg of integers), the path stays usable.
  bool run(Transport& t, const Call& c, std::chrono::steady_clock::time_point until);
  void run(Transport& t, const Call& c) { run(t, c, std::chrono::steady_clock::time_point::max()); }
  void allreduce(Transport& t, const char* in, char* out, size_t count, DataType dt, ReduceOp op) {
    run(t, {Collective::allreduce, dt, op, -1, count, in, out});
  }

  // Bytes per rank that a call may put through the segment (Call::through_segment); 0 where it cannot (no
  // segment, control messages over TCP, or no room asked for).
  size_t segment_room() const { return usable_ && control_ ? control_->data_bytes() : 0; }
  // What rank `rank` of `n` puts through the segment in call `c` (its input: its vector, all n blocks, or
  // nothing for a broadcast's non-roots and a barrier).
  static size_t segment_need(const Call& c, int rank, int n);

  // Calls run on this path so far (the tests check which path a call took).
  uint64_t calls() const { return calls_.load(std::memory_order_relaxed); }

  // This rank makes the communicator's call number `seq` (from 0) on another path; `desc` is its descriptor
  // (kCallBytes). Peers that wait for that call here fail at once, naming it (Control::elsewhere).
  void elsewhere(uint64_t seq, const void* desc) {
    if (control_) control_->elsewhere(seq + 1, desc);
  }

  // Bytes per piece of the reduce phase (read from a peer into an L2-resident staging buffer, then reduced).
  // Exposed for benchmarks; a multiple of every element size.
  static constexpr size_t kPieceBytes = 256 * 1024;

 private:
  struct Sides;
  // What this rank publishes for `c`: where its sides are (for the reads), or its call after it has copied its
  // data into its place in the segment.
  const Addresses& addresses(Transport& t, const Call& c);
  const Addresses& into_segment(Transport& t, const Call& c);
  // Waits (until `until`: false) for every rank's call and checks it against this rank's: a peer that made the
  // call on another path or called something else fails the call naming both calls. Fills all_.
  bool agree(Transport& t, const Call& c, std::chrono::steady_clock::time_point until);
  // The rest of the call once every rank has published it.
  void run_reads(Transport& t, const Call& c);
  void from_segment(Transport& t, const Call& c);
  // Elements [from, from + len) of every rank's input, reduced in rank order piece by piece, into bytes
  // [dst_off, ...) of this rank's output.
  void reduce_from_all(Transport& t, Sides& s, const Call& c, size_t from, size_t len, uint64_t dst_off);
  // Reads the bytes of `remote` in rank `peer`'s memory into `local` (the same total, cut alike or not, in batches
  // of IOV_MAX); throws CommError naming the peer.
  void read_peer(Transport& t, int peer, std::span<const iovec> local, std::span<const iovec> remote);
  // Throws CommError naming a peer whose process has exited (guards against reads from a recycled pid).
  void check_alive(Transport& t);
  // Why rank p's process has exited (the CommError's text), or "" while it runs.
  std::string exited(Transport& t, int p) const;
  std::string exited_text(Transport& t, int p) const;

  void narrow();         // undoes the PR_SET_PTRACER widening, if this made one
  bool widened_ = false;  // PR_SET_PTRACER_ANY is in force because of this communicator
  bool usable_ = false;
  std::string why_not_;
  std::vector<int> pids_;    // [rank]
  std::vector<int> pidfds_;  // [rank]; -1 for this rank or where pidfd_open is unavailable
  std::vector<char> staging_;
  uint64_t token_ = 0;  // read by every peer's probe during setup
  std::atomic<uint64_t> calls_{0};
  std::unique_ptr<Control> control_;
  // The call published and waited for, across run()s that stopped at their `until`.
  bool published_ = false;
  Addresses published_call_{};
  std::vector<Addresses> all_;      // [rank]: its call as published
  std::vector<char> reduce_chunk_;  // reduce: a non-root's reduced chunk, which the root reads
};

}  // namespace smartcoll::cma
