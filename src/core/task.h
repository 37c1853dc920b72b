// A collective as the engine runs it: a schedule of sends, receives and local computations, split into lanes.
//
// Each lane's sends and receives all go on one stream, so one engine worker runs the whole lane and the
// dependencies between its ops (a send that forwards what a receive brought, a reduction before the next step)
// never cross threads. A channel (peer, stream) carries the ops of every call in the order the calls were made
// and, within a call, in the lane's order: both ends of a channel see the same sequence of message sizes.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "smartcoll/types.h"

namespace smartcoll {

class Request;
enum class Algorithm : uint8_t;
class BufferPool;

// What a call is, as ranks compare it: carried in front of the call's first message on every channel (when the
// check knob is on) and compared by the receiver before anything it carries is used.
struct Descriptor {
  uint16_t magic;
  // The call's number in its communicator, low 16 bits: a rank whose message belongs to another call (one that
  // skipped a call of no elements, which sends nothing) is caught as a disagreement, not paired with it.
  uint16_t call;
  uint8_t coll, dtype, op, algo;
  uint8_t codec, codec_mant, codec_exp, codec_owner;
  uint32_t codec_block;
  int64_t root;
  uint64_t count;
  bool operator==(const Descriptor&) const = default;
};
static_assert(sizeof(Descriptor) == 32, "the descriptor is a wire format: no padding");

struct Op {
  // copy: len bytes from `local` to `dst` (memmove), a compute whose addresses a schedule can still rewrite;
  // alone: Task::exclusive, done once it returns true
  enum class Kind : uint8_t { send, recv, compute, copy, alone };
  Kind kind = Kind::send;
  bool header = false;  // send: the call's descriptor goes first; recv: it comes first and is checked
  bool divide = false;  // recv: avg divides by the world size after this reduction (read by Lane::after)
  uint8_t finish = 0;   // recv: what Lane::after does with the bytes (0: nothing, they landed where they belong)
  int peer = -1;
  int32_t deps[2] = {-1, -1};  // ops of the same lane that must be done before this one starts
  char* buf = nullptr;         // send: bytes to send; recv: where they land
  size_t len = 0;
  // Instead of buf: len bytes in these pieces, in order (one message gathered from, or scattered into, several
  // buffers of a list call: coll/segmented.h). They live in Task::piece_lists.
  const iovec* pieces = nullptr;
  uint32_t npieces = 0;
  // Operands of Lane::after: where the result goes, the local operand, the encoded copy, elements.
  char* dst = nullptr;
  const char* local = nullptr;
  uint8_t* enc = nullptr;
  size_t elems = 0;
  uint32_t compute = 0;  // compute: index into Task::computes
  bool done = false;     // engine state
};

struct Lane {
  int stream = 0;  // every send and receive of the lane goes on this stream; its worker runs the lane
  std::vector<Op> ops;
  // Runs when a receive with finish != 0 has all its bytes (on the worker, in the lane's order).
  void (*after)(const void* ctx, const Op& op, const char* data) = nullptr;
  const void* ctx = nullptr;
  // Engine state.
  size_t left = 0;
  std::vector<uint32_t> computes;  // compute ops, run in this order as their dependencies complete
  size_t next_compute = 0;
};

// Scratch memory from the engine's pool, returned when the task ends.
class Scratch {
 public:
  Scratch(std::shared_ptr<BufferPool> pool, size_t bytes);
  Scratch(Scratch&& o) noexcept : pool_(std::move(o.pool_)), data_(std::move(o.data_)), capacity_(o.capacity_) {}
  ~Scratch();
  char* data() const { return data_.get(); }

 private:
  std::shared_ptr<BufferPool> pool_;
  std::unique_ptr<char[]> data_;
  size_t capacity_;
};

// "allreduce #12 on rank 3": the context of every message about call `seq`, built only when a message needs it.
std::string call_name(uint8_t coll, uint64_t seq, int rank);

struct Task {
  std::string name() const { return call_name(desc.coll, seq, rank); }
  uint64_t seq = 0;  // the call's number on this communicator: the same call has the same number on every rank
  int rank = 0;
  Descriptor desc{};
  bool check = true;
  std::vector<Lane> lanes;
  std::vector<std::function<void()>> computes;
  std::vector<Scratch> scratch;
  std::deque<std::vector<iovec>> piece_lists;  // Op::pieces
  std::shared_ptr<const void> state;  // what lanes and computes point into (reduction spec, codec)
  // Runs alone, with no other call in flight and nothing else using the channels (the same-host path, which
  // drives its own control messages); when set, lanes is empty, unless `lanes_instead` is set too: asked once
  // every earlier call that runs alone has finished (so its answer follows from them alone, alike on every rank),
  // true runs the lanes (of algorithm `lanes_algo`) as any call's instead, without waiting for the calls in
  // flight (the switch path's ring while the switches are unusable). It returns false where it stopped waiting
  // for its peers at `until` (the deadline of the caller that runs it): it runs again later and goes on.
  std::function<bool(std::chrono::steady_clock::time_point until)> exclusive;
  std::function<bool()> lanes_instead;
  Algorithm lanes_algo{};
  // Runs once every lane is done and the call succeeded, before its request completes (a list call's staged
  // results copied back to its entries).
  std::function<void()> epilogue;
  std::shared_ptr<Request> req;
  std::atomic<int> lanes_left{0};
};

}  // namespace smartcoll
