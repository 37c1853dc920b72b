#include "switch/aggregator.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "smartcoll/reduce.h"

namespace smartcoll::sw {

namespace {

constexpr uint64_t kIdle = UINT64_MAX;
constexpr size_t kDrops = static_cast<size_t>(Drop::kCount);

using Counter = std::atomic<uint64_t>;
// Every counter has one writer (the thread that owns the slot); readers (stats) may see it a little late.
void bump(Counter& c, uint64_t n = 1) { c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed); }
uint64_t read(const Counter& c) { return c.load(std::memory_order_relaxed); }

int64_t ticks(Clock::time_point t) { return t.time_since_epoch().count(); }

// 16 bytes compared without an early exit.
bool same_key(const SipKey& a, const SipKey& b) { return ((a.k0 ^ b.k0) | (a.k1 ^ b.k1)) == 0; }

struct alignas(64) JobCounters {
  Counter contributions{0}, bytes_in{0}, results{0}, bytes_out{0}, resent{0}, duplicates{0}, retransmits{0},
      busy{0};
  std::array<Counter, kDrops> drops{};
};

}  // namespace

std::string_view drop_name(Drop d) {
  constexpr std::string_view names[] = {"bad_mac", "bad_field", "mismatch", "stale", "early"};
  return names[static_cast<int>(d)];
}

void JobStats::add(const JobStats& o) {
  contributions += o.contributions;
  bytes_in += o.bytes_in;
  results += o.results;
  bytes_out += o.bytes_out;
  resent += o.resent;
  duplicates += o.duplicates;
  retransmits += o.retransmits;
  for (size_t d = 0; d < drops.size(); ++d) drops[d] += o.drops[d];
}

struct Aggregator::Slot {
  uint64_t seq = kIdle;         // the chunk being summed
  uint64_t result_seq = kIdle;  // the chunk whose result `result` holds: the shadow copy
  uint32_t call = 0;
  uint16_t count = 0, arrived = 0, first_rank = 0;
  uint8_t codec = 0;  // the header's codec byte: kEncoded when the contributions are encoded
  uint8_t share = 0;  // the contributions' kShare flags: which ranks get the data (gets_data)
  int owner = -1;     // the rank that sent kOwner (reduce_scatter, allgather)
  uint8_t result_share = 0;  // share and owner of the chunk whose result `result` holds
  int result_owner = -1;
  uint32_t result_call = 0;
  DataType dtype = DataType::f32;
  ReduceOp op = ReduceOp::sum;
  bool poisoned = false;  // workers sent different calls to this chunk: it never completes
  uint8_t* contrib = nullptr;  // world x max_payload: each worker's contribution, by rank
  uint8_t* result = nullptr;   // the result datagram (header and payload)
  size_t result_len = 0;
  std::vector<uint8_t> in;          // per rank: its contribution is here
  std::vector<sockaddr_in> from;    // per rank: where its result goes
};

struct Aggregator::Job {
  uint64_t id = 0;
  SipKey key;
  uint16_t world = 0;
  uint32_t window = 0, max_payload = 0;
  bool full_auth = false;
  Codec codec;  // of its encoded chunks
  std::vector<Slot> slots;
  std::unique_ptr<uint8_t[]> memory;
  std::unique_ptr<JobCounters[]> counters;  // one per thread
  std::atomic<int64_t> last_active{0};
  std::vector<uint8_t> joined, left;  // under mu_: per rank
  int joined_count = 0, left_count = 0;
};

struct alignas(64) Aggregator::Thread {
  uint64_t generation = 0;
  std::unordered_map<uint64_t, std::shared_ptr<Job>> jobs;  // this thread's view of jobs_
  std::array<Counter, kRejectReasons> malformed{};
  Counter datagrams{0}, unknown{0};
  uint8_t reply[kHeaderBytes + 256];
  std::vector<float> sum;  // an encoded chunk's float32 sum (at most 65535 elements)
  std::vector<uint8_t> answer;  // a stats answer
  Clock::time_point next_query{};  // answers are rationed: a flood of queries cannot keep the thread busy
};

Aggregator::Aggregator(int threads, uint32_t slot_budget, bool require_full_auth)
    : threads_(threads), budget_(slot_budget), require_full_(require_full_auth) {
  for (int t = 0; t < threads; ++t) {
    per_thread_.push_back(std::make_unique<Thread>());
    per_thread_.back()->sum.resize(UINT16_MAX);
  }
}

Aggregator::~Aggregator() = default;

std::shared_ptr<Aggregator::Job> Aggregator::lookup(int t, uint64_t id) {
  Thread& th = *per_thread_[static_cast<size_t>(t)];
  const uint64_t gen = generation_.load(std::memory_order_acquire);
  if (gen != th.generation) {  // the table changed: copy it (rare: joins, leaves, expiry)
    std::lock_guard lock(mu_);
    th.jobs.clear();
    for (const auto& [jid, job] : jobs_) th.jobs.emplace(jid, job);
    th.generation = generation_.load(std::memory_order_relaxed);
  }
  auto it = th.jobs.find(id);
  return it == th.jobs.end() ? nullptr : it->second;
}

void Aggregator::handle(int t, const uint8_t* data, size_t len, const sockaddr_in& from, Outbox& out,
                        Clock::time_point now) {
  Thread& th = *per_thread_[static_cast<size_t>(t)];
  bump(th.datagrams);
  const Parsed p = parse(data, len);
  if (!p.ok()) {
    bump(th.malformed[static_cast<size_t>(p.why)]);
    return;
  }
  switch (p.pkt.h.type) {
    case Type::join: return join(t, p.pkt, data, from, out, now);
    case Type::leave: return leave(t, p.pkt, data);
    case Type::contribution: return contribute(t, p.pkt, data, from, out, now);
    case Type::query: return answer_query(t, p.pkt, data, from, out, now);
    default: bump(th.malformed[static_cast<size_t>(Reject::bad_type)]);  // a switch's own kind of datagram
  }
}

void Aggregator::reply(int t, const Job& job, Type type, const Header& about, const void* body, size_t len,
                       const sockaddr_in& to, Outbox& out) {
  uint8_t* buf = per_thread_[static_cast<size_t>(t)]->reply;
  Header h = about;
  h.type = type;
  h.flags = job.full_auth ? kFullAuth : 0;
  h.count = 0;
  h.codec = 0;  // a reply without elements carries none (a worker refuses pending and error replies that say one)
  if (len) std::memcpy(buf + kHeaderBytes, body, len);
  write_header(h, job.key, buf + kHeaderBytes, len, buf);
  out.send(to, buf, kHeaderBytes + len, false);
}

namespace {

void append(std::string& out, const char* fmt, auto... values) {
  char buf[160];
  const int n = std::snprintf(buf, sizeof buf, fmt, values...);
  out.append(buf, static_cast<size_t>(std::clamp(n, 0, static_cast<int>(sizeof buf) - 1)));
}

std::string job_json(const JobStats& j) {
  std::string out;
  append(out, "{\"job\":\"%016llx\",\"world\":%d,\"window\":%u,\"busy_slots\":%u,\"full_auth\":%s,",
         static_cast<unsigned long long>(j.job), j.world, j.window, j.busy_slots, j.full_auth ? "true" : "false");
  append(out, "\"contributions\":%llu,\"bytes_in\":%llu,\"results\":%llu,\"bytes_out\":%llu,",
         static_cast<unsigned long long>(j.contributions), static_cast<unsigned long long>(j.bytes_in),
         static_cast<unsigned long long>(j.results), static_cast<unsigned long long>(j.bytes_out));
  append(out, "\"resent\":%llu,\"duplicates\":%llu,\"retransmits\":%llu,\"idle_s\":%.3f,\"drops\":{",
         static_cast<unsigned long long>(j.resent), static_cast<unsigned long long>(j.duplicates),
         static_cast<unsigned long long>(j.retransmits), j.idle_s);
  for (size_t d = 0; d < j.drops.size(); ++d)
    append(out, "%s\"%s\":%llu", d ? "," : "", std::string(drop_name(static_cast<Drop>(d))).c_str(),
           static_cast<unsigned long long>(j.drops[d]));
  out += "}}";
  return out;
}

}  // namespace

std::string stats_json(const SwitchStats& s, size_t room) {
  uint64_t malformed = 0;
  for (uint64_t m : s.malformed) malformed += m;
  std::string out;
  append(out, "{\"version\":%d,\"threads\":%d,\"slots_total\":%u,\"slots_free\":%u,\"datagrams_in\":%llu,",
         kVersion, s.threads, s.slots_total, s.slots_free, static_cast<unsigned long long>(s.datagrams_in));
  append(out, "\"malformed\":%llu,\"unknown_job\":%llu,\"join_refused\":%llu,\"jobs_joined\":%llu,",
         static_cast<unsigned long long>(malformed), static_cast<unsigned long long>(s.unknown_job),
         static_cast<unsigned long long>(s.join_refused), static_cast<unsigned long long>(s.jobs_joined));
  append(out, "\"jobs_left\":%llu,\"jobs_expired\":%llu,\"queries\":%llu,\"ended\":",
         static_cast<unsigned long long>(s.jobs_left), static_cast<unsigned long long>(s.jobs_expired),
         static_cast<unsigned long long>(s.queries));
  out += job_json(s.ended);
  out += ",\"jobs\":[";
  const std::string tail_ok = "],\"truncated\":false}", tail_cut = "],\"truncated\":true}";
  bool cut = false;
  for (size_t i = 0; i < s.jobs.size() && !cut; ++i) {
    const std::string j = (i ? "," : "") + job_json(s.jobs[i]);
    if (out.size() + j.size() + tail_ok.size() > room)
      cut = true;
    else
      out += j;
  }
  out += cut ? tail_cut : tail_ok;
  return out.size() <= room ? out : std::string();
}

void Aggregator::answer_query(int t, const Packet& p, const uint8_t* raw, const sockaddr_in& from, Outbox& out,
                              Clock::time_point now) {
  // The answer is never longer than the query, so that a forged source address gains no amplification; at
  // most one answer per thread every 10 ms.
  Thread& th = *per_thread_[static_cast<size_t>(t)];
  const bool due = now >= th.next_query;
  const std::string body = due && authentic(p, raw, kOpenKey, false) ? stats_json(stats(now), p.payload_len) : "";
  if (body.empty()) {
    queries_refused_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  th.next_query = now + std::chrono::milliseconds(10);
  queries_.fetch_add(1, std::memory_order_relaxed);
  std::vector<uint8_t>& buf = th.answer;
  buf.resize(kHeaderBytes + body.size());
  std::memcpy(buf.data() + kHeaderBytes, body.data(), body.size());
  Header h = p.h;
  h.type = Type::stats;
  h.flags = kFullAuth;
  h.rank = kAllRanks;
  write_header(h, kOpenKey, buf.data() + kHeaderBytes, body.size(), buf.data());
  out.send(from, buf.data(), buf.size(), false);
}

void Aggregator::join(int t, const Packet& p, const uint8_t* raw, const sockaddr_in& from, Outbox& out,
                      Clock::time_point now) {
  JoinBody body;
  std::memcpy(&body, p.payload, sizeof body);
  const SipKey key = SipKey::from_bytes(body.key);
  const bool full = body.full_auth != 0;
  Codec codec;
  const bool known_codec = get_codec(body, codec);
  // The secret is in the datagram, so its MAC only proves integrity; what binds the job is the first join.
  if (!authentic(p, raw, key, full)) {
    join_refused_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  Job answer_as;  // for refusals: the job the worker asked for, to MAC the answer with its key
  answer_as.key = key;
  answer_as.full_auth = full;
  JoinedBody ans{static_cast<uint32_t>(JoinStatus::ok), static_cast<uint32_t>(threads_), body.window, 0};
  std::shared_ptr<Job> job;
  {
    std::lock_guard lock(mu_);
    ans.free_slots = budget_ - used_slots_;
    auto it = jobs_.find(p.h.job);
    if (it != jobs_.end()) {
      job = it->second;
      if (!same_key(job->key, key)) {
        // Another secret for a job id in use: a stranger (or a stale job). Never answered, never joined.
        join_refused_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      if (job->world != p.h.world || job->window != body.window || job->max_payload != body.max_payload ||
          job->full_auth != full || !known_codec || !(job->codec == codec)) {
        ans.status = static_cast<uint32_t>(JoinStatus::conflict);
      } else {
        if (job->left[p.h.rank]) {
          job->left[p.h.rank] = 0;
          --job->left_count;
        }
        if (!job->joined[p.h.rank]) {
          job->joined[p.h.rank] = 1;
          ++job->joined_count;
        }
        job->last_active.store(ticks(now), std::memory_order_relaxed);  // a keepalive: the job lives on
      }
    } else {
      const size_t bytes = size_t{body.window} * (p.h.world + 1u) * body.max_payload;
      if (body.window == 0 || body.window > kMaxWindow || body.max_payload < 8 || body.max_payload > kMaxPayload ||
          body.max_payload % 8 || bytes > kMaxJobBytes || !known_codec)
        ans.status = static_cast<uint32_t>(JoinStatus::too_large);
      else if (require_full_ && !full)
        ans.status = static_cast<uint32_t>(JoinStatus::needs_full_auth);
      else if (body.window > budget_ - used_slots_ || bytes > kMaxTotalBytes - used_bytes_)
        ans.status = static_cast<uint32_t>(JoinStatus::no_room);
      if (ans.status == static_cast<uint32_t>(JoinStatus::ok)) {
        job = std::make_shared<Job>();
        job->id = p.h.job;
        job->key = key;
        job->world = p.h.world;
        job->window = body.window;
        job->max_payload = body.max_payload;
        job->full_auth = full;
        job->codec = codec;
        job->left.assign(job->world, 0);
        job->joined.assign(job->world, 0);
        job->joined[p.h.rank] = 1;
        job->joined_count = 1;
        job->counters = std::make_unique<JobCounters[]>(static_cast<size_t>(threads_));
        const size_t per_slot = size_t{job->world} * job->max_payload + kHeaderBytes + job->max_payload;
        job->memory.reset(new uint8_t[per_slot * job->window]);  // untouched pages cost nothing until used
        job->slots.resize(job->window);
        for (uint32_t s = 0; s < job->window; ++s) {
          Slot& slot = job->slots[s];
          slot.contrib = job->memory.get() + per_slot * s;
          slot.result = slot.contrib + size_t{job->world} * job->max_payload;
          slot.in.assign(job->world, 0);
          slot.from.assign(job->world, sockaddr_in{});
        }
        job->last_active.store(ticks(now), std::memory_order_relaxed);
        jobs_.emplace(job->id, job);
        used_slots_ += job->window;
        used_bytes_ += bytes;
        ans.free_slots = budget_ - used_slots_;
        jobs_joined_.fetch_add(1, std::memory_order_relaxed);
        generation_.fetch_add(1, std::memory_order_release);
      }
    }
  }
  if (ans.status != static_cast<uint32_t>(JoinStatus::ok)) join_refused_.fetch_add(1, std::memory_order_relaxed);
  Header about = p.h;
  about.call = kFeatures;
  reply(t, job ? *job : answer_as, Type::joined, about, &ans, sizeof ans, from, out);
}

void Aggregator::leave(int t, const Packet& p, const uint8_t* raw) {
  std::shared_ptr<Job> job = lookup(t, p.h.job);
  // Workers send each leave three times: the copies after the last rank's first one find the job gone. A leave
  // can do nothing to a job that does not exist, so it is not counted as traffic of an unknown job.
  if (!job) return;
  if (!authentic(p, raw, job->key, job->full_auth) || p.h.world != job->world) {
    bump(job->counters[t].drops[static_cast<size_t>(Drop::bad_mac)]);
    return;
  }
  std::lock_guard lock(mu_);
  if (job->left[p.h.rank] || !job->joined[p.h.rank]) return;
  job->left[p.h.rank] = 1;
  if (++job->left_count < job->joined_count) return;
  // Every worker that joined is done (all of them, or those that got in before a probe or a start-up failed
  // elsewhere): the slots go back to the pool. Threads still holding the job keep its memory alive
  // until they next refresh their view.
  if (jobs_.erase(job->id)) {
    retire(*job);
    jobs_left_.fetch_add(1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
}

void Aggregator::contribute(int t, const Packet& p, const uint8_t* raw, const sockaddr_in& from, Outbox& out,
                            Clock::time_point now) {
  const Header& h = p.h;
  std::shared_ptr<Job> job = lookup(t, h.job);
  if (!job) {
    bump(per_thread_[static_cast<size_t>(t)]->unknown);
    return;
  }
  JobCounters& c = job->counters[t];
  auto drop = [&](Drop why) { bump(c.drops[static_cast<size_t>(why)]); };
  if (!authentic(p, raw, job->key, job->full_auth)) return drop(Drop::bad_mac);
  // An encoded chunk must be one the job's codec makes (identity: the job sends none).
  const bool bad_codec = h.codec == kEncoded && job->codec.kind() == CodecKind::identity;
  if (h.world != job->world || h.slot >= job->window || h.slot % threads_ != static_cast<uint32_t>(t) ||
      h.seq % job->window != h.slot || p.payload_len > job->max_payload || bad_codec ||
      p.payload_len != payload_bytes(h, job->codec))
    return drop(Drop::bad_field);
  job->last_active.store(ticks(now), std::memory_order_relaxed);
  if (h.flags & kRetransmit) bump(c.retransmits);
  Slot& s = job->slots[h.slot];

  if (h.seq == s.result_seq) {  // its result went out already and was lost on the way: send it again
    bump(c.resent);
    if (!gets_data(s.result_share, s.result_owner, h.rank)) return send_done(t, *job, s, h.rank, from, out);
    bump(c.bytes_out, s.result_len);
    out.send(from, s.result, s.result_len, true);
    return;
  }
  if (s.seq == kIdle) {
    if (s.result_seq != kIdle && h.seq < s.result_seq) return drop(Drop::stale);
    s.seq = h.seq;
    s.call = h.call;
    s.count = h.count;
    s.dtype = h.dtype;
    s.op = h.op;
    s.codec = h.codec;
    s.share = h.flags & kShare;
    s.owner = -1;
    s.arrived = 0;
    s.first_rank = h.rank;
    s.poisoned = false;
    std::fill(s.in.begin(), s.in.end(), 0);
    bump(c.busy);
  } else if (h.seq != s.seq) {
    return drop(h.seq < s.seq ? Drop::stale : Drop::early);
  }
  const bool second_owner = (h.flags & kOwner) && s.owner >= 0 && s.owner != h.rank;
  if (s.poisoned || h.call != s.call || h.count != s.count || h.dtype != s.dtype || h.op != s.op ||
      h.codec != s.codec || (h.flags & kShare) != s.share || second_owner) {
    // Workers disagree on the call. Nothing of this chunk is ever summed; each of them is told.
    s.poisoned = true;
    drop(Drop::mismatch);
    const ErrorBody e{static_cast<uint32_t>(ErrorCause::mismatch), s.first_rank, 0};
    return reply(t, *job, Type::error, h, &e, sizeof e, from, out);
  }
  if (s.in[h.rank]) {  // already here: its worker has not had the result yet, which is still waiting for others
    bump(c.duplicates);
    uint8_t bitmap[(kMaxWorld + 7) / 8] = {};
    for (int r = 0; r < job->world; ++r)
      if (s.in[r]) bitmap[r / 8] |= static_cast<uint8_t>(1u << (r % 8));
    s.from[h.rank] = from;
    return reply(t, *job, Type::pending, h, bitmap, (job->world + 7u) / 8u, from, out);
  }
  std::memcpy(s.contrib + size_t{h.rank} * job->max_payload, p.payload, p.payload_len);
  s.in[h.rank] = 1;
  s.from[h.rank] = from;
  if (h.flags & kOwner) s.owner = h.rank;
  bump(c.contributions);
  bump(c.bytes_in, p.payload_len);
  if (++s.arrived < job->world) return;
  if (s.share && s.owner < 0) {
    // Every rank is in and none owns the chunk: they disagree on the call. Told on their next copy.
    s.poisoned = true;
    return drop(Drop::mismatch);
  }

  // Everyone is in: sum in rank order into the result datagram, which stays as the shadow copy. Overwriting the
  // previous shadow is safe: every worker has sent this chunk, so every worker had the previous result.
  uint8_t* res = s.result + kHeaderBytes;
  // (An allgather chunk's last contribution may be an empty one: the length comes from the slot.)
  const size_t bytes = s.codec == kEncoded ? p.payload_len : s.count * dtype_size(s.dtype);
  auto contribution = [&](int r) { return s.contrib + size_t{static_cast<unsigned>(r)} * job->max_payload; };
  if (s.codec == kEncoded) {
    // Decoded and summed in float32, encoded once: every worker decodes the same bits, and the rounding of the
    // result happens once whatever the number of workers.
    float* sum = per_thread_[static_cast<size_t>(t)]->sum.data();
    job->codec.decode(contribution(0), s.count, sum);
    for (int r = 1; r < job->world; ++r) job->codec.decode_add(contribution(r), s.count, sum, sum);
    job->codec.encode(sum, s.count, res);
  } else if (s.share == kGather) {  // the owner's data, for the others
    std::memcpy(res, contribution(s.owner), bytes);
  } else {
    std::memcpy(res, contribution(0), bytes);
    for (int r = 1; r < job->world; ++r) reduce(s.dtype, s.op, res, res, contribution(r), s.count);
  }
  Header rh = h;
  rh.type = Type::result;
  rh.flags = job->full_auth ? kFullAuth : 0;
  rh.rank = s.share == kScatter ? static_cast<uint16_t>(s.owner) : kAllRanks;
  write_header(rh, job->key, res, bytes, s.result);
  s.result_len = kHeaderBytes + bytes;
  s.result_seq = s.seq;
  s.result_share = s.share;
  s.result_owner = s.owner;
  s.result_call = s.call;
  s.seq = kIdle;
  bump(c.busy, UINT64_MAX);  // -1
  bump(c.results);
  for (int r = 0; r < job->world; ++r) {
    if (!gets_data(s.share, s.owner, r)) {
      send_done(t, *job, s, r, s.from[r], out);
      continue;
    }
    bump(c.bytes_out, s.result_len);
    out.send(s.from[r], s.result, s.result_len, true);
  }
}

void Aggregator::send_done(int t, const Job& job, const Slot& s, int rank, const sockaddr_in& to, Outbox& out) {
  Header h;
  h.job = job.id;
  h.seq = s.result_seq;
  h.slot = static_cast<uint32_t>(s.result_seq % job.window);
  h.call = s.result_call;
  h.rank = static_cast<uint16_t>(rank);
  h.world = job.world;
  bump(job.counters[t].bytes_out, kHeaderBytes);
  reply(t, job, Type::done, h, nullptr, 0, to, out);
}

std::vector<uint64_t> Aggregator::expire(Clock::time_point now, Clock::duration idle) {
  std::vector<uint64_t> gone;
  std::lock_guard lock(mu_);
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    const Job& job = *it->second;
    if (ticks(now) - job.last_active.load(std::memory_order_relaxed) > idle.count()) {
      gone.push_back(job.id);
      retire(job);
      it = jobs_.erase(it);
    } else {
      ++it;
    }
  }
  if (!gone.empty()) {
    jobs_expired_.fetch_add(gone.size(), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  return gone;
}

JobStats Aggregator::snapshot(const Job& job, Clock::time_point now) const {
  JobStats j;
  j.job = job.id;
  j.world = job.world;
  j.window = job.window;
  j.full_auth = job.full_auth;
  j.idle_s = std::chrono::duration<double>(Clock::duration(ticks(now) - job.last_active.load())).count();
  for (int t = 0; t < threads_; ++t) {
    const JobCounters& c = job.counters[t];
    j.contributions += read(c.contributions);
    j.bytes_in += read(c.bytes_in);
    j.results += read(c.results);
    j.bytes_out += read(c.bytes_out);
    j.resent += read(c.resent);
    j.duplicates += read(c.duplicates);
    j.retransmits += read(c.retransmits);
    j.busy_slots += static_cast<uint32_t>(read(c.busy));
    for (size_t d = 0; d < kDrops; ++d) j.drops[d] += read(c.drops[d]);
  }
  return j;
}

void Aggregator::retire(const Job& job) {
  used_slots_ -= job.window;
  used_bytes_ -= size_t{job.window} * (job.world + 1u) * job.max_payload;
  ended_.add(snapshot(job, Clock::now()));
}

SwitchStats Aggregator::stats(Clock::time_point now) const {
  SwitchStats s;
  s.threads = threads_;
  for (const auto& th : per_thread_) {
    s.datagrams_in += read(th->datagrams);
    s.unknown_job += read(th->unknown);
    for (size_t i = 0; i < s.malformed.size(); ++i) s.malformed[i] += read(th->malformed[i]);
  }
  s.join_refused = join_refused_.load();
  s.jobs_joined = jobs_joined_.load();
  s.jobs_left = jobs_left_.load();
  s.jobs_expired = jobs_expired_.load();
  s.queries = queries_.load();
  s.queries_refused = queries_refused_.load();
  std::lock_guard lock(mu_);
  s.slots_total = budget_;
  s.slots_free = budget_ - used_slots_;
  s.ended = ended_;
  for (const auto& [id, job] : jobs_) s.jobs.push_back(snapshot(*job, now));
  return s;
}

}  // namespace smartcoll::sw
