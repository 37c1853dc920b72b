// The one-sided server and client of a communicator (docs/vectored.md, "One-sided operations").
//
// One thread per communicator, started on first use (a registration or a one-sided call), serves both roles over
// framed channels of its own (core/onesided_wire.h), apart from the collectives' unframed channels and workers:
//   - as a target, it accepts channels from initiators, reads their requests, checks every field, copies from or
//     into (or reduces into) the registered region, and answers; the application makes no call for that;
//   - as an initiator, it sends the calls posted on its channels to targets and completes their requests as the
//     answers come in. Several calls may be outstanding on a channel; a target serves one initiator's requests
//     in the order they were sent.
// All I/O is non-blocking and a message is served only once it is whole, so one slow peer never stalls the others.
// The target's memory is bounded: a channel is read at most one message per pass of the loop, not at all while
// more than kMaxQueued bytes of its answers wait to be sent, and a request's staging (a put's payload, a get's
// answer) is taken only while all channels together hold less than kMaxHeld (one request at a time may exceed it).
// A channel that leaves a message half sent, or its answers unread, for the timeout knob is closed.
// The region is touched under its lock only while copying (a get gathers into a staging buffer under it, then
// sends from there; a put or accumulate receives into staging, then scatters under it), so deregistering waits
// at most for one copy and leaves nothing that points into the buffer.
//
// Between processes of one host (Settings::pids) a get or put without a codec, of pieces of 4 KiB or more on
// average, skips the server: the initiator reads the pieces straight from the target's memory, or writes them
// straight into it (process_vm_readv / process_vm_writev, one copy), in the call itself. Each target keeps a
// directory of its regions in memory shared with the processes of its host (a memfd they map): a slot per region
// (a tag, base and size), then a word per rank of the world, the region that rank is writing into directly. A
// tag is the target's secret xor the region's id and ids are never reused.
//   - A get reads the region's slot, the pieces, then the slot's tag again: the same tag both times means the
//     region was registered throughout the read.
//   - A put first sets its word to the region's id, then checks the tag, writes, and clears the word.
//     Deregistering clears the tag first, then waits until no word holds the region's id (or that word's process
//     has exited). Both sides' stores come before their loads (sequentially consistent atomics in the shared
//     memory), so either the put sees the tag gone or the deregistration sees the put's word: the buffer is never
//     written after deregistering returns.
// A region whose memory the communicator allocated (allocate) lives in a sealed memfd, whose descriptor its slot
// names too: a peer on this host maps it on first use (checking the tag after mapping: a descriptor closed and
// reused meanwhile is never taken for the region's) and copies with the gather and scatter kernels, for pieces of
// any size, with the same tags and words as above; it keeps the mapping until it sees the slot's tag changed (at
// its next direct call to that rank, or the server thread's look over every mapping, about once a second). The owner
// closes the descriptor only after clearing the tag, and the mapping keeps the memory alive for a peer that is
// still copying: no copy ever touches memory that is not the region's.
// Anything else (not registered, changed, a piece outside the region, a failed copy) sends the call to the
// server, which serves it or refuses it as for any peer.
// An accumulate without a codec into an allocated region is reduced straight into the mapping, under the slot's
// accumulate lock (a word in the directory: the holder's rank plus 1), which the server also takes for its own
// accumulates into allocated regions: concurrent accumulates, direct or served, apply one at a time. The
// initiator announces itself in its word first, as a put does. Into any other buffer, accumulatev goes through the
// server, which applies them one at a time under the region's lock. A call is copied directly only while
// none of this rank's calls to that target is outstanding at the server, so that one initiator's calls to a
// target still land in the order it made them.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/onesided_wire.h"
#include "smartcoll/comm.h"
#include "smartcoll/onesided.h"
#include "smartcoll/store.h"
#include "transport/shared_memory.h"
#include "transport/socket.h"

namespace smartcoll::rma {

using Clock = net::Clock;

inline constexpr uint64_t kMaxQueued = uint64_t{8} << 20;   // answers waiting on one channel before it is not read
inline constexpr uint64_t kMaxHeld = uint64_t{256} << 20;   // staging of all channels together (see above)
inline constexpr size_t kMaxPendingHellos = 64;             // accepted connections whose hello has not come

struct Settings {
  int rank = 0, size = 1;
  std::string host;  // where to listen (the collectives' listening address)
  uint64_t job = 0;  // job_fingerprint of the job id, carried in every hello
  // [rank]: the claim rank 0 accepted at start-up (empty for a world of one): each communicator publishes its
  // one-sided address under its own key, so an earlier communicator's entry is never read.
  std::vector<std::string> claims;
  double timeout = 60, connect_timeout = 120;
  int sockbuf = 0;
  bool unix_sockets = true;  // initiators on this host connect over a Unix socket (the unix_sockets knob)
  // [rank]: its process id, where every rank shares this host and may read the others' memory (the same-host
  // path is usable and the rma_direct knob allows it); empty: gets always go to the server.
  std::vector<int> pids;
};

class Service {
 public:
  // Listens, publishes "rma/<rank>/<claim>" in the (job's) store and starts the thread.
  Service(const Settings& settings, std::shared_ptr<Store> store);
  // Fails the calls still outstanding ("the communicator was closed") and joins the thread: once it returns,
  // the server touches no registered region, nor does a peer's direct write (see close_directory).
  ~Service();
  // Makes every region unreachable directly and waits for the peers' direct writes into registered regions in
  // progress. Returns, by region id, why a region's writer did not finish within the timeout: those buffers
  // must stay allocated. The destructor runs it where the owner did not.
  std::map<uint64_t, std::string> close_directory();
  // Fails the calls outstanding and every later one with `why` (Communicator::abort).
  void abort(const std::string& why);
  // Bytes of staging the target holds now (requests being received or served, answers queued): for tests.
  uint64_t held_bytes() const { return held_; }
  // Gets served by reading the target's memory directly so far, and puts by writing into it.
  uint64_t direct_gets() const { return direct_gets_.load(std::memory_order_relaxed); }
  uint64_t direct_puts() const { return direct_puts_.load(std::memory_order_relaxed); }
  uint64_t direct_accumulates() const { return direct_accumulates_.load(std::memory_order_relaxed); }

  // memory: the region's memfd (allocate), which peers on this host may map; null: any buffer.
  uint64_t add(void* base, size_t bytes, DataType dtype, std::shared_ptr<cma::SharedMemory> memory = nullptr);
  AllocatedRegion allocate(size_t bytes, DataType dtype);
  // Waits until no request is copying from or into the region, and no peer on this host is writing into it
  // directly (CommError after the timeout knob if one still is: a stopped process; the buffer must then stay);
  // later requests are refused, naming it.
  void remove(uint64_t id);
  // Checks the call as the target will, connects to the peer on first use (on this thread, within
  // connect_timeout), and queues it. The local buffers must stay valid until the request completes.
  // codec: float32 only; put and accumulate encode here (on this thread) and decode at the target, get the
  // reverse. The identity codec means raw bytes (no codec).
  std::shared_ptr<Request> post(Kind kind, const RemoteRegion& region, std::span<const RemotePiece> pieces,
                                std::span<const LocalPiece> local, ReduceOp op, const std::optional<Codec>& codec);

  struct Region;
  struct Slot;
  struct Conn;
  struct Call;
  struct Accepting;

 private:
  void run();
  void connect(int peer);
  void take_inbox();
  void accept_all(Clock::time_point now, bool connecting);  // connecting: the listener is readable
  void take_hellos(Clock::time_point now);
  void update_listener(Clock::time_point now);
  void warn(const std::string& what);
  void progress(Conn& c);
  static bool paused(const Conn& c);
  void receive(Conn& c);
  bool take_header(Conn& c);
  bool take_pieces(Conn& c);
  void send(Conn& c);
  bool serve(Conn& c);  // false: it waits for an accumulate lock, tried again on a later pass
  void answer(Conn& c);
  // retry: a later call may open a new channel to the peer (after a timeout); otherwise calls to it fail
  // with `why` from now on.
  void close(Conn& c, const std::string& why, bool retry = false);
  std::shared_ptr<Region> find(uint64_t id, std::string& why);
  std::string key(int rank) const;  // where `rank` publishes its one-sided address
  std::string local_name(int rank, int port) const;
  // A call to a process on this host copied (or reduced) directly (see above); null where the server must serve it.
  std::shared_ptr<Request> copy_directly(Kind kind, const RemoteRegion& region, std::span<const RemotePiece> pieces,
                                         std::span<const LocalPiece> local, uint64_t local_bytes, ReduceOp op);
  // Waits until no peer's word in this rank's directory holds `id`; CommError naming the writer after the
  // timeout knob.
  void wait_for_writers(uint64_t id);
  struct Directory;
  // `peer`'s directory, mapped on first use; null where it cannot be (the server serves).
  Directory* directory(int peer);
  // Region `id` of `peer` (its memfd `fd`, `bytes` long), mapped on first use; null where it cannot be (the
  // region is gone, or the descriptor cannot be mapped: calls on it then take the other ways).
  std::shared_ptr<cma::SharedMemory> mapping(Directory& d, int peer, uint64_t id, int fd, uint64_t bytes);
  // Drops d's mappings of regions deregistered since (their slot's tag changed); d.maps_mu held.
  static void drop_stale(Directory& d);
  // drop_stale on every peer's directory: the server thread's look, so that a deregistered region's memory is
  // not kept by a peer that makes no more direct calls to its owner.
  void drop_stale_mappings();

  Settings s_;
  // [peer]: this rank's calls to it that the server path holds (posted, not yet done): while any is, calls to
  // that peer are not copied directly (their order). Declared before every container of calls, which it outlives.
  std::unique_ptr<std::atomic<int>[]> outstanding_;
  uint8_t token_[16];  // what initiators must present (Hello::token)
  std::shared_ptr<Store> store_;
  net::Fd listener_, epfd_, wakefd_;
  net::Fd local_listener_;  // the Unix socket initiators on this host reach (none: unix_sockets=off, or it failed)
  std::thread thread_;
  std::atomic<bool> stop_{false};  // set under mu_, so that no call is queued after the thread's last look
  std::string aborted_;            // under mu_: Communicator::abort's reason
  std::atomic<uint64_t> held_{0};
  std::atomic<uint64_t> next_call_{1};

  std::mutex regions_mu_;
  std::map<uint64_t, std::shared_ptr<Region>> regions_;
  uint64_t next_region_ = 1;
  std::unique_ptr<Directory> own_;  // this rank's directory, which peers on this host map
  std::mutex directories_mu_;
  std::vector<std::unique_ptr<Directory>> directories_;  // [peer]: looked up on the first direct call to it
  std::atomic<uint64_t> direct_gets_{0}, direct_puts_{0}, direct_accumulates_{0};
  Clock::time_point swept_{};  // the server thread's last drop_stale_mappings
  bool directory_closed_ = false;

  // [peer]: one caller connects to a peer at a time; callers to other peers, or to connected ones, go on.
  std::unique_ptr<std::mutex[]> connecting_;
  std::mutex mu_;          // the inbox, and which peers have a channel
  std::vector<std::pair<int, net::Fd>> new_conns_;
  std::vector<std::shared_ptr<Call>> new_calls_;
  std::vector<bool> connected_;          // [peer]: a channel from this rank is open or being handed over
  std::vector<std::string> last_close_;  // [peer]: why the last channel to it closed
  std::vector<bool> gone_;               // [peer]: that channel closed for good (no retry)

  // The thread's own state.
  std::vector<std::unique_ptr<Conn>> conns_;
  std::vector<Conn*> to_peer_;  // [peer]: this rank's channel to it, or null
  std::vector<std::unique_ptr<Accepting>> accepting_;
  bool listening_ = true;
  Clock::time_point accept_resume_{}, last_warn_{};
  uint64_t unwarned_ = 0;  // warnings not logged since last_warn_ (at most one a second)
};

}  // namespace smartcoll::rma
