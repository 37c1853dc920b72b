// The worker side of the switch protocol: joins the job to each switch, then runs allreduce calls through them.
//
// A call's vector is cut into chunks of at most `packet` bytes; chunk c goes to switch c mod k. Each switch has a
// window of `window` slots for the job: chunk number seq (counted over the job's life, alike on every worker)
// uses slot seq mod window, and is sent only once the result of the chunk that used the slot before it is in.
// A chunk whose result does not come back within the retransmission timeout is sent again; the switch answers
// a copy it already has with the result (if done) or with `pending` (who it still waits for), so a switch that
// answers nothing at all for switch_timeout seconds is taken for gone.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "smartcoll/store.h"
#include "switch/protocol.h"
#include "transport/socket.h"
#include "transport/udp.h"

namespace smartcoll::sw {

// A switch stopped answering (or never did): the caller may fall back to another algorithm.
class SwitchGone : public CommError {
 public:
  using CommError::CommError;
};
// Another rank lost the switch (it said so through the rendezvous store): this one stops waiting for it.
class PeerLostSwitch : public SwitchGone {
 public:
  using SwitchGone::SwitchGone;
};

// One call through the switches. allreduce (share 0): every rank sends the whole vector of `count` elements
// and gets every sum. reduce_scatter (kScatter): `count` elements per rank's block, `in` holds every block;
// every rank sends them all and gets the sums of its own block alone. allgather (kGather): every rank sends its
// block of `count` elements and gets the others' into `out` (n blocks; its own block is not written).
struct Call {
  const char* in;
  char* out;
  size_t count;
  DataType dt;
  ReduceOp op;
  const Codec* codec = nullptr;  // allreduce only
  uint8_t share = 0;             // 0, kScatter or kGather
};

struct ClientSettings {
  std::vector<net::Endpoint> switches;
  uint32_t window = 128;    // slots per switch
  uint32_t packet = 1408;   // payload bytes per datagram (a multiple of 8)
  bool full_auth = false;   // the MAC covers payloads too
  bool offload = true;      // UDP segmentation offload (GSO on send, GRO on receive; udp.h)
  Codec codec;              // the job's codec for float32 sums (identity: none); calls may also go raw
  double switch_timeout = 2;  // seconds of silence after which a switch is gone
  double timeout = 60;        // seconds without any result before the call fails
  // Seconds without a call after which the join goes to every switch again (0: never): a switch frees the slots
  // of a job it has heard nothing from for its job timeout, and a join of a job it holds counts as hearing.
  double keepalive = 15;
  // Cleared when the communicator fails: its keepalives stop, so that the switch frees a failed job's slots.
  std::shared_ptr<std::atomic<bool>> job_alive;
  // [worker]: the communicator's rank that worker is, for messages (a job of some of its ranks: a column of
  // algo=switch_hier); empty: the same numbers.
  std::vector<int> ranks;
};

// "host:port,host:port": throws InvalidArgument naming the bad entry.
std::vector<net::Endpoint> parse_switches(const std::string& text);

class Client {
 public:
  Client(int rank, int world, ClientSettings settings, const SipKey& key, uint64_t job);
  ~Client();  // leaves every switch (best effort: a switch also frees a silent job's slots on its own)
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Joins the job to every switch. Throws SwitchGone when one does not answer within switch_timeout, CommError
  // when one refuses (saying why).
  void join();
  // Elements per chunk: a packet's worth, raw or encoded with `codec` (null: raw; a whole number of blocks).
  size_t chunk_elems(DataType dt, const Codec* codec) const;
  // Chunks of a call: each block of `count` elements (one for allreduce, one per rank otherwise) is cut alone.
  size_t chunks_per_block(const Call& c) const {
    return (c.count + chunk_elems(c.dt, c.codec) - 1) / chunk_elems(c.dt, c.codec);
  }
  size_t chunks(const Call& c) const { return chunks_per_block(c) * (c.share ? static_cast<size_t>(world_) : 1); }
  // One call through the switches; done[c] becomes 1 for each chunk c this rank is finished with: its result is
  // in `out` (avg already divided), or the switch said it is done. With `codec` (float32 sum or avg; it must be
  // the job's), chunks travel encoded and the switch sums them in float32. Throws SwitchGone when a switch
  // stops answering, CommError when the call cannot complete (ranks disagree, or no result for `timeout`
  // seconds, naming the ranks the switch waits for).
  // `peers_lost`, when set, is asked now and then while no result comes (first after switch_timeout / 2 without
  // one, then at growing gaps up to switch_timeout / 2): a non-empty answer (which rank lost the switch, and
  // why) ends the call with PeerLostSwitch.
  void run(const Call& call, std::vector<uint8_t>& done, const std::function<std::string()>& peers_lost = {});
  std::string name(size_t j) const;  // "switch 10.0.0.1:7000"
  // Tells every switch that took this rank's join that it is done with the job (once; the destructor too), after
  // stopping the keepalives.
  void leave();
  uint64_t job() const { return job_; }  // the job's id on the switches: fresh per communicator and per probe

 private:
  struct Remote;
  Header header(Type type) const;  // this rank's fields of every datagram it sends
  int switch_of(const sockaddr_in& from) const;  // -1: not one of ours
  void keep_alive();  // the keeper thread: sends the join again after `keepalive` seconds without a call
  void stop_keeper();

  int rank_, world_;
  ClientSettings settings_;
  SipKey key_;
  uint64_t job_;
  net::Fd fd_;
  std::vector<Remote> remotes_;
  uint64_t calls_ = 0;
  udp::SendBatch batch_;
  udp::RecvBatch inbox_;
  std::vector<uint8_t> encoded_;  // the call's input, encoded
  std::vector<uint8_t> join_datagram_;  // this rank's join, the same for every switch
  // The keeper thread and what it reads: whether a call runs, and when the switches last heard from this rank.
  std::mutex keep_mu_;
  std::condition_variable keep_cv_;
  bool keep_stop_ = false, in_call_ = false;
  std::chrono::steady_clock::time_point last_heard_;
  std::thread keeper_;
};

// What a communicator keeps for the switch algorithm between calls (coll/allreduce_switch.cc).
struct Path {
  std::unique_ptr<Client> client;
  bool fallback_ring = true;  // switch_fallback=ring
  // Every rank agreed that a switch is gone (at start-up or during a call): calls go straight to the ring until
  // the next probe.
  bool gone = false;
  // Calls with algo=switch so far. Every rank makes the same calls in the same order, so this number (not a
  // clock) says alike on every rank when to probe the switches again and names a call in the store.
  uint64_t calls = 0;
  uint64_t retry = 0;       // switch_retry: calls on the ring after a fallback before a probe (0: never)
  uint64_t next_probe = 0;  // the call that probes
  // Fallbacks and failed probes since the last call that completed through the switches: each doubles the wait
  // for the next probe, up to 64 x retry. A probe whose join succeeds does not reset it: a fault that lets joins
  // through but loses data would otherwise stall a call every `retry` calls forever.
  int backoff = 0;
  uint64_t epoch = 0;       // probes so far: each joins a fresh job, whatever the last one left at the switch
  std::function<std::unique_ptr<Client>(uint64_t epoch)> make_client;
  // The hierarchical allreduce's client (algo=switch_hier): this rank's column, the ranks with its local index on
  // every host, joined as a job of its own at the first such call (and again after each probe that succeeds).
  std::unique_ptr<Client> column;
  // The column of local index `index`: `members` (the communicator's ranks, one per host), this rank at `pos`.
  std::function<std::unique_ptr<Client>(uint64_t epoch, int index, const std::vector<int>& members, int pos)>
      make_column;
  // Where a rank that lost its switch says so (key switch/lost/<job id>, value "<call> <why>"), so that the others
  // stop waiting for it in that call and every later one.
  std::shared_ptr<Store> store;
  // The key this rank wrote there, if any: the next probe deletes it (every rank has finished the job's calls).
  std::string lost_key;
  // Every rank agreed to stop using the switches: calls go to the ring until the next probe, and this rank leaves
  // the job at once, so that the switches free its slots as soon as every rank that joined has left.
  void fall_back() {
    gone = true;
    schedule_probe();
    if (client) client->leave();
    if (column) column->leave();
  }
  void schedule_probe() {
    next_probe = retry ? calls + (retry << std::min(backoff, 6)) : UINT64_MAX;
    ++backoff;
  }
};

}  // namespace smartcoll::sw
