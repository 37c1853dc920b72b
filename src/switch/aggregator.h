// The aggregation switch's state, without sockets: jobs, their slots, and what each datagram does to them.
// server.h runs it on UDP sockets; the unit tests run it on an in-process channel that loses, duplicates and
// reorders datagrams.
//
// A job (one communicator) joins with its id, world size, secret and window: the switch sets aside `window`
// slots for it, each able to hold one chunk from every worker. Slot s is only ever touched by thread
// s mod threads, so the data path takes no lock. A slot keeps every worker's contribution to its chunk until all
// have arrived, sums them in rank order (the same bits whatever the arrival order), sends the result to every
// worker and keeps it (the shadow copy): a worker that lost the result retransmits its contribution and gets the
// result again, never a second sum. A worker sends chunk seq + window to a slot only after it has the result of
// chunk seq, so a slot only ever sees its current chunk and the one before (docs/wire-format.md).
#pragma once

#include <netinet/in.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "switch/protocol.h"

namespace smartcoll::sw {

using Clock = std::chrono::steady_clock;

// Where the datagrams of one thread go out. `stable`: data stays valid until flushed (a slot's result);
// otherwise the outbox copies it.
class Outbox {
 public:
  virtual ~Outbox() = default;
  virtual void send(const sockaddr_in& to, const uint8_t* data, size_t len, bool stable) = 0;
};

// Why a datagram of a known job was not used (per job), and of no job at all (per switch).
enum class Drop : uint8_t { bad_mac, bad_field, mismatch, stale, early, kCount };
std::string_view drop_name(Drop d);

struct JobStats {
  uint64_t job = 0;
  int world = 0;
  uint32_t window = 0, busy_slots = 0;
  bool full_auth = false;
  uint64_t contributions = 0, bytes_in = 0, results = 0, bytes_out = 0;
  uint64_t resent = 0;      // retransmitted contributions answered from a shadow copy
  uint64_t duplicates = 0;  // contributions that had already arrived (answered with `pending`)
  uint64_t retransmits = 0; // contributions flagged as retransmitted by their worker
  std::array<uint64_t, static_cast<size_t>(Drop::kCount)> drops{};
  double idle_s = 0;
  void add(const JobStats& o);  // sums the counters (for the totals of jobs that ended)
};

struct SwitchStats {
  std::vector<JobStats> jobs;
  JobStats ended;  // the counters of every job that left or expired, summed
  std::array<uint64_t, kRejectReasons> malformed{};  // by parse()'s reason
  uint64_t datagrams_in = 0;
  uint64_t unknown_job = 0;    // well-formed, but of no job this switch knows
  uint64_t join_refused = 0;   // joins refused (no room, too large, auth) or conflicting (another secret)
  uint64_t jobs_joined = 0, jobs_left = 0, jobs_expired = 0;
  uint64_t queries = 0, queries_refused = 0;  // stats queries answered; refused (bad MAC, too little room)
  uint32_t slots_total = 0, slots_free = 0;
  int threads = 0;
  // The sockets' side (server.h): send system calls, kernel messages and datagrams out, segmented sends the
  // kernel refused, received messages that held several datagrams (UDP_GRO).
  uint64_t send_calls = 0, messages_out = 0, datagrams_out = 0, offload_refused = 0, joined_in = 0;
};

// The open counters of a query's answer (docs/wire-format.md): JSON of at most `room` bytes, jobs left out
// (and "truncated": true) where they do not fit; empty when not even the switch's own counters fit.
std::string stats_json(const SwitchStats& s, size_t room);

class Aggregator {
 public:
  // slot_budget: slots of all jobs together; require_full_auth: refuse jobs that do not authenticate payloads.
  Aggregator(int threads, uint32_t slot_budget, bool require_full_auth);
  ~Aggregator();
  Aggregator(const Aggregator&) = delete;
  Aggregator& operator=(const Aggregator&) = delete;

  int threads() const { return threads_; }
  // One datagram received by thread t (0 <= t < threads) from `from`. Thread t alone may call it with t.
  void handle(int t, const uint8_t* data, size_t len, const sockaddr_in& from, Outbox& out, Clock::time_point now);
  // Frees the jobs that have had no valid datagram for `idle`; returns their ids. Any thread.
  std::vector<uint64_t> expire(Clock::time_point now, Clock::duration idle);
  SwitchStats stats(Clock::time_point now) const;

  // Largest memory one job may take (window x (world + 1) x max payload), and all jobs together: joins past it are
  // refused for want of room, so that senders who make up jobs cannot make the switch take all of a host's memory.
  static constexpr size_t kMaxJobBytes = size_t{256} << 20;
  static constexpr size_t kMaxTotalBytes = size_t{4} << 30;

 private:
  struct Job;
  struct Slot;
  struct Thread;
  std::shared_ptr<Job> lookup(int t, uint64_t id);
  void join(int t, const Packet& p, const uint8_t* raw, const sockaddr_in& from, Outbox& out, Clock::time_point now);
  void leave(int t, const Packet& p, const uint8_t* raw);
  void answer_query(int t, const Packet& p, const uint8_t* raw, const sockaddr_in& from, Outbox& out,
                    Clock::time_point now);
  void contribute(int t, const Packet& p, const uint8_t* raw, const sockaddr_in& from, Outbox& out,
                  Clock::time_point now);
  JobStats snapshot(const Job& job, Clock::time_point now) const;
  void retire(const Job& job);  // mu_ held: the job leaves the table; its counters go to ended_
  void reply(int t, const Job& job, Type type, const Header& about, const void* body, size_t len,
             const sockaddr_in& to, Outbox& out);
  // Tells `rank` that the chunk of slot s whose result is out is complete (its data went to other ranks).
  void send_done(int t, const Job& job, const Slot& s, int rank, const sockaddr_in& to, Outbox& out);

  const int threads_;
  const uint32_t budget_;
  const bool require_full_;
  std::vector<std::unique_ptr<Thread>> per_thread_;

  mutable std::mutex mu_;  // the job table; joins, leaves and expiry (rare) take it, the data path does not
  std::map<uint64_t, std::shared_ptr<Job>> jobs_;
  uint32_t used_slots_ = 0;
  size_t used_bytes_ = 0;  // of the jobs' memory (kMaxTotalBytes)
  JobStats ended_;
  std::atomic<uint64_t> generation_{1};  // bumped whenever jobs_ changes: threads refresh their cached view
  std::atomic<uint64_t> join_refused_{0}, jobs_joined_{0}, jobs_left_{0}, jobs_expired_{0}, queries_{0},
      queries_refused_{0};
};

}  // namespace smartcoll::sw
