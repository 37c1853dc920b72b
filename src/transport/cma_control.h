// The control channel of the same-host path (transport/cma.h): how the ranks of one host tell each other what
// they call and where their buffers are, and wait for each other (barriers). Two implementations behind one
// interface: a shared-memory segment mapped by every rank (stores and loads of atomics, bounded spinning then a
// futex wait: no system call on the critical path when the peers are running), and the Transport's TCP
// channels, the fallback when the segment cannot be made.
//
// The segment is a memfd that rank 0 creates and the others open through /proc/<pid>/fd/<fd> (the same ptrace
// access that cross-memory attach already needs) and map; every rank closes its descriptor once all have mapped
// it. It has no name anywhere, so nothing outlives the job: the kernel frees it with the last mapping, also when
// ranks crash.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/task.h"
#include "smartcoll/types.h"
#include "transport/shared_memory.h"
#include "transport/transport.h"

namespace smartcoll::cma {

// What a rank calls, and where its buffers are (a non-root's `out` in reduce: its reduced chunk). A list call's
// side with several pieces publishes instead the address of its piece table (`in_pieces` or `out_pieces` Extents,
// transport/cma.h), which peers read once per call: the descriptor keeps its size whatever the list.
struct Addresses {
  uint32_t magic;
  uint8_t coll, dtype, op, pad;
  int64_t root;
  uint64_t count;
  uint64_t in, out;
  uint32_t in_pieces, out_pieces;  // 0: `in` (`out`) is the buffer itself
  uint32_t layout;                 // a list call's digest of its counts where calls are compared; else 0
  uint32_t through_segment;        // 1: the call's data goes through the control segment (Local::Call)
};
static_assert(sizeof(Addresses) == 56);
inline constexpr uint32_t kAddrMagic = 0x434d4144;  // "CMAD": with through_segment

// The call agreement's descriptor of the call (algo cma, or shm where its data goes through the segment), which
// smartcoll::describe names ("allreduce(count=16, float32, op=sum, algo=shm)"; codes out of range as corrupted).
Descriptor as_descriptor(const Addresses& a);

// A call that a rank makes on another path (a TCP algorithm, or a call of no elements) while its peers may take
// this one: `auto` decides from each rank's own arguments, so ranks that pass different ones can part ways. The
// rank leaves the call's descriptor (kCallBytes: core/task.h's Descriptor) where a peer that waits for that call
// here finds it, and that peer fails at once naming both calls instead of waiting for the timeout.
inline constexpr size_t kCallBytes = 32;
struct OtherPath : CommError {
  OtherPath(int peer, const std::array<unsigned char, kCallBytes>& desc)
      : CommError("rank " + std::to_string(peer) + " made this call on another path"), peer(peer), desc(desc) {}
  int peer;
  std::array<unsigned char, kCallBytes> desc;
};

class Control {
 public:
  virtual ~Control() = default;
  // Publishes this rank's call (through the segment: with the data this rank wrote to next_data()).
  virtual void publish(const Addresses& mine) = 0;
  // Fills all[p] with rank p's call published last (all[rank] = mine) and returns true once every rank has
  // published it; false where `until` came first (a later collect() goes on waiting). Throws CommError naming a
  // rank that died, failed or did not publish within the timeout (counted from publish()), and OtherPath where a
  // peer left word (elsewhere()) that it made the communicator's call number `call` on another path (0: not
  // numbered, no such check). Over TCP too it returns at `until` and the next collect() goes on with the
  // exchange (the barriers there still block: peers reach them within a call's reads).
  virtual bool collect(Addresses* all, uint64_t call, std::chrono::steady_clock::time_point until) = 0;
  // This rank makes the communicator's call number `call` (from 1) on another path; `desc` is its descriptor
  // (kCallBytes). Never waits and makes no system call: the TCP channel keeps nothing (its peers meet the
  // other path's messages instead).
  virtual void elsewhere(uint64_t /*call*/, const void* /*desc*/) {}
  // Returns once every rank has reached this barrier (every rank passes the same barriers in the same order;
  // `phase` tells them apart where the channel can check it). Throws as collect() does. Without `wait` the
  // channel may return as soon as this rank is counted in (the shared segment does; TCP waits anyway): for a
  // rank whose buffers nobody reads any more, while the ranks that wait on it still know when it is done.
  virtual void barrier(uint8_t phase, bool wait = true) = 0;
  // This rank fails or closes: peers that wait on it fail at once, naming it, instead of timing out.
  virtual void leave() {}
  virtual const char* kind() const = 0;  // "shm" or "tcp"

  // Bytes of data per rank that a call may put in the channel next to its descriptor: a small call's data then
  // travels with it (Local::Call::through_segment). 0: none (over TCP, or no room was asked for).
  virtual size_t data_bytes() const { return 0; }
  // Where this rank writes the data of its next publish() (data_bytes() of room), and, once every rank has
  // published (collect()), where rank p's data of it is. Valid until this rank's next publish() but one: a rank
  // reaches its call k + 2 only after every peer has published call k + 1, which each does after its call k is
  // done.
  virtual char* next_data() { return nullptr; }
  virtual const char* data(int /*p*/) const { return nullptr; }
  // data(rank), writable: a call may put its result there for its peers to read after a barrier, in a part that
  // no peer reads before it.
  virtual char* own_data() { return nullptr; }
};

// Control messages over the Transport (stream 0), failing after its timeout without progress.
std::unique_ptr<Control> tcp_control(Transport& t);

// A segment for `n` ranks, as rank 0 creates it (fd() >= 0) or another rank maps it.
class Segment {
 public:
  // Creates a zeroed segment stamped with `token`, with `data_bytes` of room per rank and call for data
  // (Control::data_bytes; rounded up to a cache line); on failure fd() < 0 and `error` says why.
  static Segment create(int n, size_t data_bytes, uint64_t token, std::string& error);
  // Maps rank 0's segment through /proc/<pid>/fd/<fd>; checks its size, token and data room. Empty (and `error`)
  // on failure.
  static Segment open(int pid, int fd, int n, size_t data_bytes, uint64_t token, std::string& error);
  bool mapped() const { return mem_.mapped(); }
  int fd() const { return mem_.fd(); }
  void close_fd() { mem_.close_fd(); }  // once every rank has mapped it: the mapping alone keeps it alive
  void* base() const { return mem_.base(); }
  size_t data_bytes() const { return data_bytes_; }

 private:
  SharedMemory mem_;
  size_t data_bytes_ = 0;
};

// The control channel over a mapped segment, for the ranks of `t` (its rank, size and timeout). `exited(p)`
// says why rank p's process has exited ("" while it runs); between waits a peer that exited without getting to
// what is waited for fails the wait. One that got there and then exited did its part: a peer may finish a call
// whose last barrier it does not wait at, and close. A wait spins for `spin_us` where this process may use at
// least as many CPUs as there are ranks (none otherwise), then sleeps on a futex in short slices.
// A peer that fails is named with its reason where it left one (Transport::peer_failure).
std::unique_ptr<Control> shm_control(Segment segment, Transport& t, double spin_us,
                                     std::function<std::string(int)> exited);

}  // namespace smartcoll::cma
