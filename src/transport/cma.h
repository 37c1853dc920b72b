// Same-host fast path: collectives between processes on one host that read each other's buffers directly with
// Linux cross-memory attach (process_vm_readv), so each byte is copied once instead of going through two socket
// copies per hop. The Transport still carries the small control messages (addresses, barriers), so a dead or stalled
// peer is reported the same way (by name, within the no-progress timeout).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "smartcoll/types.h"
#include "transport/transport.h"

namespace smartcoll::cma {

class Local {
 public:
  // Exchanges pid and host identity (boot id, host name, network and pid namespaces) with every rank through the
  // Transport, then probes that process_vm_readv of every peer works (each rank reads a random token from every
  // peer). All ranks reach the same verdict: usable() is true everywhere only if every rank found every peer on
  // its host and readable. Under Yama ptrace_scope=1 it calls prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) first so
  // that sibling processes may read this one, and undoes that when the path is unusable and at destruction. Throws CommError only when the Transport fails (a peer died).
  // A world of size 1 is usable (allreduce is a copy).
  explicit Local(Transport& t);
  ~Local();
  Local(const Local&) = delete;
  Local& operator=(const Local&) = delete;

  bool usable() const { return usable_; }
  std::string why_not() const { return why_not_; }  // empty when usable

  // Allreduce of `count` elements; in may equal out (other overlap is not allowed). Every rank ends with identical
  // bits, the same from run to run: each element is x_0 op x_1 op ... op x_{n-1} in rank order, and avg divides the
  // sum by n once. Buffers must not be touched by the caller during the call. Throws CommError naming the peer when
  // a read fails (the peer died: ESRCH) or a barrier fails, and when ranks pass different counts, dtypes or ops.
  // Requires usable().
  void allreduce(Transport& t, const char* in, char* out, size_t count, DataType dt, ReduceOp op);

  // Bytes per piece of the reduce phase (read from a peer into an L2-resident staging buffer, then reduced).
  // Exposed for benchmarks; a multiple of every element size.
  static constexpr size_t kPieceBytes = 256 * 1024;

 private:
  void barrier(Transport& t, uint8_t phase);
  // Reads `len` bytes at `remote` in rank `peer`'s memory into `local`; throws CommError naming the peer.
  void read_peer(Transport& t, int peer, void* local, uint64_t remote, size_t len);
  // Throws CommError naming a peer whose process has exited (guards against reads from a recycled pid).
  void check_alive(Transport& t);

  void narrow();         // undoes the PR_SET_PTRACER widening, if this made one
  bool widened_ = false;  // PR_SET_PTRACER_ANY is in force because of this communicator
  bool usable_ = false;
  std::string why_not_;
  std::vector<int> pids_;    // [rank]
  std::vector<int> pidfds_;  // [rank]; -1 for this rank or where pidfd_open is unavailable
  std::vector<char> staging_;
  uint64_t token_ = 0;  // read by every peer's probe during setup
};

}  // namespace smartcoll::cma
