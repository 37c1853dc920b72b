// The switch protocol: SipHash, the parser, the MAC, the aggregator's slots on a channel that loses, duplicates
// and reorders datagrams, and jobs kept apart.
#include <gtest/gtest.h>
#include <poll.h>

#include <cstring>
#include <atomic>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <limits>
#include <map>
#include <cmath>
#include <random>
#include <type_traits>

#include "core/siphash.h"
#include "ranks.h"
#include "smartcoll/codec.h"
#include "smartcoll/comm.h"
#include "smartcoll/onesided.h"
#include "smartcoll/reduce.h"
#include "smartcoll/store.h"
#include "switch/aggregator.h"
#include "switch/protocol.h"
#include "switch/query.h"
#include "switch/server.h"
#include "transport/udp.h"
#include "../fuzz/switch_fuzz.h"

namespace smartcoll::sw {
namespace {

// ---- SipHash-2-4: the reference vectors (key 00..0f, message 00..n-1) ----

TEST(SipHash, ReferenceVectors) {
  uint8_t kb[16], msg[64];
  for (int i = 0; i < 16; ++i) kb[i] = static_cast<uint8_t>(i);
  for (int i = 0; i < 64; ++i) msg[i] = static_cast<uint8_t>(i);
  const SipKey key = SipKey::from_bytes(kb);
  EXPECT_EQ(key.k0, 0x0706050403020100ULL);
  const std::map<size_t, uint64_t> expect = {
      {0, 0x726fdb47dd0e0e31ULL},  {1, 0x74f839c593dc67fdULL},  {2, 0x0d6c8009d9a94f5aULL},
      {3, 0x85676696d7fb7e2dULL},  {4, 0xcf2794e0277187b7ULL},  {5, 0x18765564cd99a68dULL},
      {6, 0xcbc9466e58fee3ceULL},  {7, 0xab0200f58b01d137ULL},  {8, 0x93f5f5799a932462ULL},
      {9, 0x9e0082df0ba9e4b0ULL},  {10, 0x7a5dbbc594ddb9f3ULL}, {11, 0xf4b32f46226bada7ULL},
      {12, 0x751e8fbc860ee5fbULL}, {13, 0x14ea5627c0843d90ULL}, {14, 0xf723ca908e7af2eeULL},
      {15, 0xa129ca6149be45e5ULL},  // the paper's worked example (Appendix A)
      {16, 0x3f2acc7f57c29bdbULL}, {17, 0x699ae9f52cbe4794ULL}, {32, 0x7127512f72f27cceULL},
      {47, 0xd06c98cd5c0975ebULL},
  };
  for (const auto& [len, want] : expect) EXPECT_EQ(siphash24(key, msg, len), want) << "length " << len;
}

TEST(SipHash, PiecesGiveTheSameValueAsTheWhole) {
  uint8_t msg[64];
  for (int i = 0; i < 64; ++i) msg[i] = static_cast<uint8_t>(i * 37 + 1);
  const SipKey key{0x1234, 0x5678};
  for (size_t len : {0, 7, 8, 9, 40, 63, 64}) {
    const uint64_t whole = siphash24(key, msg, len);
    for (size_t a = 0; a <= len; ++a)
      for (size_t b = a; b <= len; b += 3) {
        SipHasher h(key);
        h.update(msg, a);
        h.update(msg + a, b - a);
        h.update(msg + b, len - b);
        ASSERT_EQ(h.finish(), whole) << len << " split at " << a << "," << b;
      }
  }
}

// ---- the parser and the MAC ----

const SipKey kKey{0x0123456789abcdefULL, 0xfedcba9876543210ULL};

std::vector<uint8_t> datagram(Header h, const std::vector<uint8_t>& payload, const SipKey& key = kKey) {
  std::vector<uint8_t> d(kHeaderBytes + payload.size());
  std::copy(payload.begin(), payload.end(), d.begin() + kHeaderBytes);
  write_header(h, key, d.data() + kHeaderBytes, payload.size(), d.data());
  return d;
}

Header contribution(uint16_t rank, uint16_t world, uint64_t seq, uint32_t window, uint16_t count,
                    DataType dt = DataType::f32) {
  Header h;
  h.type = Type::contribution;
  h.dtype = dt;
  h.job = 42;
  h.seq = seq;
  h.slot = static_cast<uint32_t>(seq % window);
  h.call = 7;
  h.rank = rank;
  h.world = world;
  h.count = count;
  return h;
}

TEST(SwitchProtocol, RoundTripsEveryField) {
  Header h = contribution(3, 5, 123456789012ULL, 16, 4, DataType::i64);
  h.flags = kRetransmit;
  h.op = ReduceOp::max;
  const auto d = datagram(h, std::vector<uint8_t>(32, 9));
  const Parsed p = parse(d.data(), d.size());
  ASSERT_TRUE(p.ok()) << reject_name(p.why);
  EXPECT_EQ(p.pkt.h.type, Type::contribution);
  EXPECT_EQ(p.pkt.h.flags, kRetransmit);
  EXPECT_EQ(p.pkt.h.dtype, DataType::i64);
  EXPECT_EQ(p.pkt.h.job, 42u);
  EXPECT_EQ(p.pkt.h.seq, 123456789012ULL);
  EXPECT_EQ(p.pkt.h.slot, 123456789012ULL % 16);
  EXPECT_EQ(p.pkt.h.rank, 3);
  EXPECT_EQ(p.pkt.h.world, 5);
  EXPECT_EQ(p.pkt.h.count, 4);
  EXPECT_EQ(p.pkt.h.op, ReduceOp::max);
  EXPECT_EQ(p.pkt.payload_len, 32u);
  EXPECT_TRUE(authentic(p.pkt, d.data(), kKey, false));
}

TEST(SwitchProtocol, RejectsEachBadFieldForItsReason) {
  const auto good = datagram(contribution(1, 4, 9, 8, 2), std::vector<uint8_t>(8, 1));
  auto with = [&](size_t at, uint8_t value) {
    auto d = good;
    d[at] = value;
    return parse(d.data(), d.size()).why;
  };
  EXPECT_EQ(parse(good.data(), kHeaderBytes - 1).why, Reject::short_datagram);
  EXPECT_EQ(parse(nullptr, 0).why, Reject::short_datagram);
  EXPECT_EQ(with(0, 'X'), Reject::bad_magic);
  EXPECT_EQ(with(4, 1), Reject::bad_version);  // version 1 had no encoded payloads
  EXPECT_EQ(with(4, 3), Reject::bad_version);
  EXPECT_EQ(with(5, 0), Reject::bad_type);
  EXPECT_EQ(with(5, 11), Reject::bad_type);
  EXPECT_EQ(with(6, 0x80), Reject::bad_flags);
  EXPECT_EQ(with(6, kScatter | kGather), Reject::bad_flags);  // one kind of owned chunk at a time
  EXPECT_EQ(with(6, kOwner), Reject::bad_flags);               // an owner of a chunk nobody owns
  EXPECT_EQ(with(6, kScatter | kOwner), Reject::none);
  EXPECT_EQ(with(6, kGather | kOwner), Reject::none);         // the owner's allgather chunk carries its data
  EXPECT_EQ(with(6, kGather), Reject::bad_length);            // the others' carry none
  {
    const auto empty = datagram(contribution(1, 4, 9, 8, 2), {});
    auto gather = empty;
    gather[6] = kGather;
    EXPECT_EQ(parse(gather.data(), gather.size()).why, Reject::none);
    EXPECT_EQ(parse(gather.data(), gather.size()).pkt.payload_len, 0u);
    gather[39] = kEncoded;
    EXPECT_EQ(parse(gather.data(), gather.size()).why, Reject::bad_codec);  // owned chunks travel raw
    Header done = contribution(1, 4, 9, 8, 0);
    done.type = Type::done;
    auto d = datagram(done, {});
    EXPECT_TRUE(parse(d.data(), d.size()).ok());
    d = datagram(done, std::vector<uint8_t>(8));
    EXPECT_EQ(parse(d.data(), d.size()).why, Reject::bad_length);  // a done carries nothing
  }
  EXPECT_EQ(with(7, 8), Reject::bad_dtype);
  EXPECT_EQ(with(38, static_cast<uint8_t>(ReduceOp::avg)), Reject::bad_op);  // avg never travels
  EXPECT_EQ(with(39, 2), Reject::bad_codec);
  EXPECT_EQ(with(39, kEncoded), Reject::none);  // float32 sum: its length is the job's codec's to check
  {
    auto enc = good;
    enc[39] = kEncoded;
    enc[7] = static_cast<uint8_t>(DataType::i32);
    EXPECT_EQ(parse(enc.data(), enc.size()).why, Reject::bad_codec);  // only float32 sums travel encoded
    enc[7] = static_cast<uint8_t>(DataType::f32);
    enc[38] = static_cast<uint8_t>(ReduceOp::max);
    EXPECT_EQ(parse(enc.data(), enc.size()).why, Reject::bad_codec);
  }
  EXPECT_EQ(with(34, 0), Reject::bad_world);  // world 0 (low byte; high byte is 0)
  EXPECT_EQ(with(32, 4), Reject::bad_rank);   // rank 4 of 4
  EXPECT_EQ(with(27, 0xff), Reject::bad_slot);
  EXPECT_EQ(with(36, 0), Reject::bad_count);
  EXPECT_EQ(with(36, 3), Reject::bad_length);  // 3 floats announced, 2 carried
  EXPECT_EQ(parse(good.data(), good.size() - 1).why, Reject::bad_length);
  auto longer = good;
  longer.push_back(0);
  EXPECT_EQ(parse(longer.data(), longer.size()).why, Reject::bad_length);
  // A result may go to every rank; a contribution must come from one.
  Header r = contribution(0, 4, 9, 8, 2);
  r.type = Type::result;
  r.rank = kAllRanks;
  auto res = datagram(r, std::vector<uint8_t>(8));
  EXPECT_TRUE(parse(res.data(), res.size()).ok());
  r.type = Type::contribution;
  res = datagram(r, std::vector<uint8_t>(8));
  EXPECT_EQ(parse(res.data(), res.size()).why, Reject::bad_rank);
}

TEST(SwitchProtocol, EveryPrefixAndRandomBytesAreSafe) {
  const auto good = datagram(contribution(1, 4, 9, 8, 16), std::vector<uint8_t>(64, 3));
  for (size_t len = 0; len < good.size(); ++len) EXPECT_FALSE(parse(good.data(), len).ok()) << len;
  std::mt19937_64 rng(5);
  std::vector<uint8_t> buf(kMaxDatagram + 1);
  for (int i = 0; i < 20000; ++i) {
    const size_t len = i % 1000 == 0 ? buf.size() - rng() % 64 : rng() % (i % 2 ? 128 : 2048);
    for (size_t k = 0; k < len; ++k) buf[k] = static_cast<uint8_t>(rng());
    if (i % 3 == 0 && len >= kHeaderBytes) std::memcpy(buf.data(), good.data(), 8);  // get past magic/version
    fuzz_switch_packet(buf.data(), len);
  }
  // Single-byte mutations of a valid datagram, fed to the fuzz target (parse + an aggregator with a job).
  for (size_t at = 0; at < good.size(); ++at)
    for (int v : {0, 1, 0x7f, 0xff}) {
      auto d = good;
      d[at] = static_cast<uint8_t>(v);
      fuzz_switch_packet(d.data(), d.size());
    }
}

TEST(SwitchProtocol, MacCoversTheHeaderAndWithFullAuthThePayload) {
  Header h = contribution(0, 2, 1, 4, 2);
  const auto header_only = datagram(h, std::vector<uint8_t>(8, 5));
  h.flags = kFullAuth;
  const auto full = datagram(h, std::vector<uint8_t>(8, 5));
  auto ok = [](std::vector<uint8_t> d, const SipKey& key, bool need_full) {
    const Parsed p = parse(d.data(), d.size());
    return p.ok() && authentic(p.pkt, d.data(), key, need_full);
  };
  EXPECT_TRUE(ok(header_only, kKey, false));
  EXPECT_FALSE(ok(header_only, kKey, true));  // a job with full authentication refuses header-only MACs
  EXPECT_FALSE(ok(header_only, SipKey{1, 2}, false));
  EXPECT_TRUE(ok(full, kKey, true));
  for (size_t at : {8u, 16u, 24u, 28u, 32u, 36u}) {  // any header field changed: the MAC no longer fits
    auto d = header_only;
    d[at] ^= 1;
    EXPECT_FALSE(ok(d, kKey, false)) << at;
  }
  auto tampered = header_only;
  tampered.back() ^= 1;
  EXPECT_TRUE(ok(tampered, kKey, false));  // header-only: the payload is not covered
  tampered = full;
  tampered.back() ^= 1;
  EXPECT_FALSE(ok(tampered, kKey, true));
}

// ---- the aggregator on an in-process channel ----

sockaddr_in addr_of(int who) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(1000 + who));
  return a;
}
int who_of(const sockaddr_in& a) { return ntohs(a.sin_port) - 1000; }

// Datagrams in flight between workers and a switch: each may be lost, doubled or overtaken.
struct Channel : Outbox {
  struct Datagram {
    int peer;  // the worker it comes from or goes to
    std::vector<uint8_t> bytes;
  };
  std::deque<Datagram> to_switch, to_workers;
  std::mt19937_64 rng{11};
  double drop = 0, dup = 0, reorder = 0;
  bool chance(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(rng) < p; }
  void put(std::deque<Datagram>& q, int peer, const uint8_t* d, size_t len) {
    if (chance(drop)) return;
    for (int i = chance(dup) ? 2 : 1; i > 0; --i) {
      Datagram g{peer, std::vector<uint8_t>(d, d + len)};
      if (!q.empty() && chance(reorder))
        q.insert(q.begin() + static_cast<long>(rng() % q.size()), std::move(g));
      else
        q.push_back(std::move(g));
    }
  }
  void send(const sockaddr_in& to, const uint8_t* data, size_t len, bool) override {
    put(to_workers, who_of(to), data, len);
  }
};

// A worker of the protocol, as simple as can be: one chunk per slot, sent again every `rto` steps until its
// result arrives.
struct SimWorker {
  int rank, world;
  uint32_t window;
  uint64_t job;
  SipKey key;
  size_t per;  // floats per chunk
  std::vector<float> in, out;
  std::vector<uint8_t> done;
  struct Flight {
    bool busy = false;
    size_t chunk = 0;
    int age = 0;
  };
  std::vector<Flight> flights;
  size_t next = 0, left = 0;
  uint32_t call = 1;

  void start(std::vector<float> data) {
    in = std::move(data);
    out.assign(in.size(), 0);
    const size_t chunks = (in.size() + per - 1) / per;
    done.assign(chunks, 0);
    flights.assign(window, {});
    next = 0;
    left = chunks;
  }
  void post(Channel& ch, size_t chunk, bool again) {
    const size_t off = chunk * per, len = std::min(per, in.size() - off);
    Header h = contribution(static_cast<uint16_t>(rank), static_cast<uint16_t>(world), chunk, window,
                           static_cast<uint16_t>(len));
    h.job = job;
    h.call = call;
    h.flags = again ? kRetransmit : 0;
    std::vector<uint8_t> payload(len * 4);
    std::memcpy(payload.data(), in.data() + off, payload.size());
    const auto d = datagram(h, payload, key);
    ch.put(ch.to_switch, static_cast<int>(job) * 100 + rank, d.data(), d.size());
  }
  void step(Channel& ch, int rto) {
    while (next < done.size() && !flights[next % window].busy) {
      flights[next % window] = {true, next, 0};
      post(ch, next++, false);
    }
    for (Flight& f : flights)
      if (f.busy && ++f.age % rto == 0) post(ch, f.chunk, true);
  }
  void receive(const std::vector<uint8_t>& d) {
    const Parsed p = parse(d.data(), d.size());
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE(authentic(p.pkt, d.data(), key, false));
    if (p.pkt.h.type != Type::result) return;
    Flight& f = flights[p.pkt.h.slot];
    if (!f.busy || f.chunk != p.pkt.h.seq) return;
    std::memcpy(out.data() + f.chunk * per, p.pkt.payload, p.pkt.payload_len);
    f.busy = false;
    done[f.chunk] = 1;
    --left;
  }
};

std::vector<uint8_t> join_datagram(uint64_t job, const SipKey& key, uint16_t rank, uint16_t world, uint32_t window,
                                   uint32_t max_payload) {
  JoinBody body{};
  key.to_bytes(body.key);
  body.window = window;
  body.max_payload = max_payload;
  Header h;
  h.type = Type::join;
  h.job = job;
  h.rank = rank;
  h.world = world;
  std::vector<uint8_t> payload(sizeof body);
  std::memcpy(payload.data(), &body, sizeof body);
  return datagram(h, payload, key);
}

JoinStatus joined_status(const std::deque<Channel::Datagram>& q, const SipKey& key) {
  for (const auto& g : q) {
    const Parsed p = parse(g.bytes.data(), g.bytes.size());
    if (p.ok() && p.pkt.h.type == Type::joined && authentic(p.pkt, g.bytes.data(), key, false)) {
      JoinedBody b;
      std::memcpy(&b, p.pkt.payload, sizeof b);
      return static_cast<JoinStatus>(b.status);
    }
  }
  return static_cast<JoinStatus>(99);
}

// Runs one allreduce of `count` floats for every worker to the end (bounded steps); returns the stats.
SwitchStats run_jobs(Aggregator& agg, Channel& ch, std::vector<SimWorker*> workers, int rto = 3) {
  const auto now = Clock::now();
  for (int step = 0; step < 200000; ++step) {
    bool all_done = true;
    for (SimWorker* w : workers) {
      all_done &= w->left == 0;
      w->step(ch, rto);
    }
    if (all_done) break;
    // Deliver a few datagrams each way per step, as a network with some capacity would.
    for (int k = 0; k < 8 && !ch.to_switch.empty(); ++k) {
      auto g = std::move(ch.to_switch.front());
      ch.to_switch.pop_front();
      const Parsed p = parse(g.bytes.data(), g.bytes.size());
      const int t = p.ok() ? static_cast<int>(p.pkt.h.slot % agg.threads()) : 0;
      agg.handle(t, g.bytes.data(), g.bytes.size(), addr_of(g.peer), ch, now);
    }
    for (int k = 0; k < 16 && !ch.to_workers.empty(); ++k) {
      auto g = std::move(ch.to_workers.front());
      ch.to_workers.pop_front();
      for (SimWorker* w : workers)
        if (w->rank == g.peer % 100 && w->job == static_cast<uint64_t>(g.peer / 100)) w->receive(g.bytes);
    }
  }
  for (SimWorker* w : workers) EXPECT_EQ(w->left, 0u) << "worker " << w->rank << " of job " << w->job;
  return agg.stats(now);
}

// Workers of one job, joined. Worker r of job j talks from address 100 * j + r.
std::vector<SimWorker> make_job(Aggregator& agg, Channel& ch, uint64_t job, const SipKey& key, int world,
                                uint32_t window, size_t per) {
  std::vector<SimWorker> ws;
  for (int r = 0; r < world; ++r) {
    ws.push_back(SimWorker{r, world, window, job, key, per, {}, {}, {}, {}});
    const auto d = join_datagram(job, key, static_cast<uint16_t>(r), static_cast<uint16_t>(world), window,
                                 static_cast<uint32_t>(per * 4));
    agg.handle(0, d.data(), d.size(), addr_of(static_cast<int>(job) * 100 + r), ch, Clock::now());
  }
  EXPECT_EQ(joined_status(ch.to_workers, key), JoinStatus::ok);
  ch.to_workers.clear();
  return ws;
}

std::vector<float> inputs(int rank, size_t count) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = std::ldexp(static_cast<float>((rank * 131 + i * 7) % 1000) - 500.f, -7);
  return v;
}

// The rank-order sum: x0 + x1 + ... + x(n-1), element by element, with the library's kernel.
std::vector<float> rank_order_sum(int world, size_t count) {
  std::vector<float> acc = inputs(0, count);
  for (int r = 1; r < world; ++r) {
    const auto x = inputs(r, count);
    reduce(DataType::f32, ReduceOp::sum, acc.data(), acc.data(), x.data(), count);
  }
  return acc;
}

void expect_rank_order_sums(const std::vector<SimWorker>& ws, size_t count) {
  const auto expect = rank_order_sum(static_cast<int>(ws.size()), count);
  for (const SimWorker& w : ws)
    ASSERT_EQ(std::memcmp(w.out.data(), expect.data(), count * 4), 0) << "worker " << w.rank;
}

TEST(SwitchAggregator, SumsInRankOrderOnAPerfectChannel) {
  for (int threads : {1, 3}) {
    Aggregator agg(threads, 256, false);
    Channel ch;
    auto ws = make_job(agg, ch, 1, kKey, 4, 8, 16);
    for (SimWorker& w : ws) w.start(inputs(w.rank, 1000));
    std::vector<SimWorker*> ptrs;
    for (SimWorker& w : ws) ptrs.push_back(&w);
    const SwitchStats s = run_jobs(agg, ch, ptrs, 1000000);
    expect_rank_order_sums(ws, 1000);
    ASSERT_EQ(s.jobs.size(), 1u);
    EXPECT_EQ(s.jobs[0].results, (1000 + 15) / 16u);
    EXPECT_EQ(s.jobs[0].busy_slots, 0u);
    EXPECT_EQ(s.jobs[0].resent + s.jobs[0].duplicates, 0u);
  }
}

TEST(SwitchAggregator, LossDuplicationAndReorderingChangeNothing) {
  Aggregator agg(2, 256, false);
  Channel ch;
  ch.drop = 0.05;
  ch.dup = 0.05;
  ch.reorder = 0.2;
  auto ws = make_job(agg, ch, 1, kKey, 3, 4, 8);
  for (SimWorker& w : ws) w.start(inputs(w.rank, 2001));
  std::vector<SimWorker*> ptrs;
  for (SimWorker& w : ws) ptrs.push_back(&w);
  const SwitchStats s = run_jobs(agg, ch, ptrs, 4);
  expect_rank_order_sums(ws, 2001);
  ASSERT_EQ(s.jobs.size(), 1u);
  EXPECT_GT(s.jobs[0].resent, 0u);      // lost results came again from the shadow copies
  EXPECT_GT(s.jobs[0].duplicates, 0u);  // copies of contributions were not summed twice
  EXPECT_EQ(s.jobs[0].results, (2001 + 7) / 8u);  // every chunk summed exactly once
}

TEST(SwitchAggregator, TwoJobsStayApartAndForgeriesAreCounted) {
  Aggregator agg(1, 64, false);
  Channel ch;
  const SipKey other_key{77, 88};
  auto a = make_job(agg, ch, 1, kKey, 2, 4, 8);
  auto b = make_job(agg, ch, 2, other_key, 3, 4, 8);
  for (SimWorker& w : a) w.start(inputs(w.rank, 100));
  for (SimWorker& w : b) w.start(inputs(w.rank, 100));
  // A stranger who knows job 1's id but not its secret, and one who sends job 2's chunk with job 1's key.
  Header h = contribution(0, 2, 0, 4, 8);
  h.job = 1;
  const auto forged = datagram(h, std::vector<uint8_t>(32, 0xff), SipKey{1, 1});
  agg.handle(0, forged.data(), forged.size(), addr_of(999), ch, Clock::now());
  h.job = 2;
  h.world = 3;
  auto cross = datagram(h, std::vector<uint8_t>(32, 0xff), kKey);
  agg.handle(0, cross.data(), cross.size(), addr_of(998), ch, Clock::now());
  h.job = 3;  // no such job
  auto unknown = datagram(h, std::vector<uint8_t>(32, 0xff), kKey);
  agg.handle(0, unknown.data(), unknown.size(), addr_of(997), ch, Clock::now());
  // The same job id with another secret (trust on first use): refused, not answered.
  const auto hijack = join_datagram(1, SipKey{5, 5}, 0, 2, 4, 32);
  agg.handle(0, hijack.data(), hijack.size(), addr_of(996), ch, Clock::now());
  EXPECT_TRUE(ch.to_workers.empty());

  std::vector<SimWorker*> ptrs;
  for (SimWorker& w : a) ptrs.push_back(&w);
  for (SimWorker& w : b) ptrs.push_back(&w);
  const SwitchStats s = run_jobs(agg, ch, ptrs);
  expect_rank_order_sums(a, 100);
  expect_rank_order_sums(b, 100);
  ASSERT_EQ(s.jobs.size(), 2u);
  EXPECT_EQ(s.jobs[0].drops[static_cast<size_t>(Drop::bad_mac)], 1u);  // job 1: the forgery
  EXPECT_EQ(s.jobs[1].drops[static_cast<size_t>(Drop::bad_mac)], 1u);  // job 2: the cross-job datagram
  EXPECT_EQ(s.unknown_job, 1u);
  EXPECT_EQ(s.join_refused, 1u);
  EXPECT_EQ(s.slots_free, 64u - 8u);
}

TEST(SwitchAggregator, MismatchedCallsAreNeverSummed) {
  Aggregator agg(1, 64, false);
  Channel ch;
  auto ws = make_job(agg, ch, 1, kKey, 2, 4, 8);
  Header h = contribution(0, 2, 0, 4, 8);
  h.job = 1;
  auto d = datagram(h, std::vector<uint8_t>(32, 1));
  agg.handle(0, d.data(), d.size(), addr_of(100), ch, Clock::now());
  h.rank = 1;
  h.count = 4;  // another count: another call
  d = datagram(h, std::vector<uint8_t>(16, 1));
  agg.handle(0, d.data(), d.size(), addr_of(101), ch, Clock::now());
  ASSERT_EQ(ch.to_workers.size(), 1u);
  const auto& g = ch.to_workers.front().bytes;
  const Parsed p = parse(g.data(), g.size());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p.pkt.h.type, Type::error);
  EXPECT_EQ(agg.stats(Clock::now()).jobs[0].results, 0u);
  EXPECT_EQ(agg.stats(Clock::now()).jobs[0].drops[static_cast<size_t>(Drop::mismatch)], 1u);
}

TEST(SwitchAggregator, SlotsComeBackWhenAJobLeavesOrGoesSilent) {
  Aggregator agg(1, 16, false);
  Channel ch;
  make_job(agg, ch, 1, kKey, 2, 8, 8);
  make_job(agg, ch, 2, kKey, 2, 8, 8);
  // No room for a third job of 8 slots: refused with the reason.
  auto d = join_datagram(3, kKey, 0, 2, 8, 32);
  agg.handle(0, d.data(), d.size(), addr_of(300), ch, Clock::now());
  EXPECT_EQ(joined_status(ch.to_workers, kKey), JoinStatus::no_room);
  ch.to_workers.clear();
  // Job 1's ranks leave: its slots go back at once.
  for (uint16_t r = 0; r < 2; ++r) {
    Header h;
    h.type = Type::leave;
    h.job = 1;
    h.rank = r;
    h.world = 2;
    const auto leave = datagram(h, {});
    agg.handle(0, leave.data(), leave.size(), addr_of(100 + r), ch, Clock::now());
  }
  EXPECT_EQ(agg.stats(Clock::now()).slots_free, 8u);
  // Job 2 goes silent: expiry frees it.
  EXPECT_TRUE(agg.expire(Clock::now(), std::chrono::hours(1)).empty());
  const auto gone = agg.expire(Clock::now() + std::chrono::seconds(2), std::chrono::seconds(1));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0], 2u);
  const SwitchStats s = agg.stats(Clock::now());
  EXPECT_EQ(s.slots_free, 16u);
  EXPECT_EQ(s.jobs_left, 1u);
  EXPECT_EQ(s.jobs_expired, 1u);
}

TEST(SwitchAggregator, RefusesJobsWithoutPayloadAuthenticationWhenAskedTo) {
  Aggregator agg(1, 16, true);
  Channel ch;
  auto d = join_datagram(1, kKey, 0, 2, 4, 32);
  agg.handle(0, d.data(), d.size(), addr_of(100), ch, Clock::now());
  EXPECT_EQ(joined_status(ch.to_workers, kKey), JoinStatus::needs_full_auth);
}


// ---- UDP batches: segmentation offload (GSO/GRO) and its fallback deliver the same datagrams ----

namespace offload {

struct Sent {
  uint16_t to;  // which receiver
  std::vector<uint8_t> bytes;
};

// Runs of equal lengths (each ending with a shorter one) to two receivers, interleaved as the switch's results are.
std::vector<Sent> traffic() {
  std::vector<Sent> out;
  uint8_t next = 0;
  for (size_t len : {1456u, 1456u, 1456u, 1000u, 9000u, 9000u, 48u, 1456u, 30000u, 30000u, 30000u, 17u}) {
    for (uint16_t to : {0, 1}) {
      Sent s{to, std::vector<uint8_t>(len)};
      for (auto& b : s.bytes) b = next++;
      out.push_back(std::move(s));
    }
  }
  for (int i = 0; i < 100; ++i) out.push_back({0, std::vector<uint8_t>(1456, static_cast<uint8_t>(i))});
  return out;
}

// Sends traffic() in one flush and returns, per receiver, the datagrams in the order they came.
std::vector<std::vector<std::vector<uint8_t>>> deliver(bool offload, bool refuse, udp::SendBatch::Counts& counts,
                                                       uint64_t& joined) {
  net::Fd tx = udp::open("127.0.0.1", 0);
  if (refuse) {  // a socket without UDP checksums: the kernel refuses every segmented send (EINVAL)
    const int on = 1;
    setsockopt(tx.get(), SOL_SOCKET, SO_NO_CHECK, &on, sizeof on);
  }
  std::vector<net::Fd> rx;
  std::vector<sockaddr_in> addr;
  for (int i = 0; i < 2; ++i) {
    rx.push_back(udp::open("127.0.0.1", 0));
    if (offload) udp::enable_gro(rx.back().get());
    sockaddr_in a{};
    socklen_t len = sizeof a;
    getsockname(rx.back().get(), reinterpret_cast<sockaddr*>(&a), &len);
    addr.push_back(a);
  }
  const std::vector<Sent> sent = traffic();
  udp::SendBatch batch(sent.size(), offload);
  for (const Sent& s : sent) {
    // Two pieces, as a worker's header and payload: the kernel joins them into one datagram.
    const size_t head = std::min<size_t>(s.bytes.size(), 48);
    batch.add(addr[s.to], s.bytes.data(), head, s.bytes.data() + head, s.bytes.size() - head);
  }
  EXPECT_EQ(batch.flush(tx.get()), 0u);
  counts = batch.counts();
  std::vector<std::vector<std::vector<uint8_t>>> got(2);
  joined = 0;
  for (int i = 0; i < 2; ++i) {
    udp::RecvBatch in(8, kMaxDatagram, offload);
    for (int idle = 0; idle < 20;) {
      const size_t n = in.receive(rx[i].get());
      if (n == 0) {
        ++idle;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        continue;
      }
      for (size_t k = 0; k < n; ++k) got[i].emplace_back(in.data(k), in.data(k) + in.len(k));
    }
    joined += in.joined();
  }
  return got;
}

}  // namespace offload

TEST(SwitchUdp, OffloadAndItsFallbackDeliverTheSameDatagrams) {
  std::vector<std::vector<std::vector<uint8_t>>> expect(2);
  for (const offload::Sent& s : offload::traffic()) expect[s.to].push_back(s.bytes);
  udp::SendBatch::Counts plain, gso, refused;
  uint64_t joined_plain = 0, joined_gso = 0, joined_refused = 0;
  EXPECT_EQ(offload::deliver(false, false, plain, joined_plain), expect);
  EXPECT_EQ(offload::deliver(true, false, gso, joined_gso), expect);
  EXPECT_EQ(offload::deliver(true, true, refused, joined_refused), expect);
  const uint64_t n = expect[0].size() + expect[1].size();
  EXPECT_EQ(plain.messages, n);
  EXPECT_EQ(plain.datagrams, n);
  EXPECT_EQ(joined_plain, 0u);
  // Offload: runs to one address leave as one message each, and the receiver gets them joined.
  EXPECT_EQ(gso.datagrams, n);
  EXPECT_LT(gso.messages, n / 3) << "runs of equal datagrams should leave in few messages";
  EXPECT_EQ(gso.refused, 0u);
  EXPECT_GT(joined_gso, 0u);
  // The kernel refuses segmented sends here: the batch notices and sends the same datagrams one by one.
  EXPECT_GT(refused.refused, 0u);
  EXPECT_EQ(refused.datagrams, n);
}

// ---- allreduce through a switch on loopback: ranks as threads, a switch in this process ----

namespace e2e {

struct Running {
  std::unique_ptr<Switch> sw;
  explicit Running(SwitchOptions o = {}) {
    o.host = "127.0.0.1";
    sw = std::make_unique<Switch>(o);
    sw->start();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(sw->port()); }
  // Leaves are datagrams: the switch handles them a moment after the communicators close.
  SwitchStats stats_after_leaves(uint64_t left) const {
    SwitchStats s = sw->stats();
    for (int i = 0; i < 200 && s.jobs_left < left; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      s = sw->stats();
    }
    return s;
  }
};

Options switch_options(const std::string& address, std::map<std::string, std::string> extra = {}) {
  extra.emplace("switch", address);
  extra.emplace("switch_timeout", "0.5");
  extra.emplace("cma", "off");
  return harness::test_options(extra);
}

// Small integers: every sum is exact in every dtype, so results can be compared with the ring's exactly.
template <class T>
std::vector<T> values(int rank, size_t count) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<T>(static_cast<int>((rank * 31 + i * 17) % 41) - 20);
  return v;
}

template <class T>
void compare_with_ring(Communicator& comm, DataType dt, ReduceOp op, size_t count) {
  const auto in = values<T>(comm.rank(), count);
  std::vector<T> via_switch(count), via_ring(count);
  comm.allreduce(in.data(), via_switch.data(), count, dt, op, Algorithm::switch_)->wait();
  comm.allreduce(in.data(), via_ring.data(), count, dt, op, Algorithm::ring)->wait();
  ASSERT_EQ(std::memcmp(via_switch.data(), via_ring.data(), count * sizeof(T)), 0)
      << dtype_name(dt) << " " << op_name(op) << " rank " << comm.rank();
}

}  // namespace e2e

// ---- reduce_scatter and allgather through the switch ----

namespace e2e {

// reduce_scatter: every rank's own block of the sums, against the ring's.
template <class T>
void scatter_against_ring(Communicator& comm, DataType dt, ReduceOp op, size_t count) {
  const auto in = values<T>(comm.rank() + 1, count * static_cast<size_t>(comm.size()));
  std::vector<T> via_switch(count), via_ring(count);
  comm.reduce_scatter(in.data(), via_switch.data(), count, dt, op, std::nullopt, Algorithm::switch_)->wait();
  comm.reduce_scatter(in.data(), via_ring.data(), count, dt, op, std::nullopt, Algorithm::ring)->wait();
  ASSERT_EQ(std::memcmp(via_switch.data(), via_ring.data(), count * sizeof(T)), 0)
      << "reduce_scatter " << dtype_name(dt) << " " << op_name(op) << " " << count << " rank " << comm.rank();
}

// allgather: every rank's block, bit for bit (here -0.0 and NaN payloads too, which a sum of zero-padded
// vectors would not keep).
template <class T>
void gather_against_ring(Communicator& comm, DataType dt, size_t count) {
  auto in = values<T>(comm.rank(), count);
  if constexpr (std::is_floating_point_v<T>) {
    in[0] = comm.rank() % 2 ? std::numeric_limits<T>::quiet_NaN() : T(-0.0);
  }
  const size_t n = static_cast<size_t>(comm.size());
  std::vector<T> via_switch(count * n), via_ring(count * n);
  comm.allgather(in.data(), via_switch.data(), count, dt, std::nullopt, Algorithm::switch_)->wait();
  comm.allgather(in.data(), via_ring.data(), count, dt, std::nullopt, Algorithm::ring)->wait();
  ASSERT_EQ(std::memcmp(via_switch.data(), via_ring.data(), count * n * sizeof(T)), 0)
      << "allgather " << dtype_name(dt) << " " << count << " rank " << comm.rank();
}

// A switch on a given port of 127.0.0.1 (where one stopped), started.
std::unique_ptr<Switch> started_on(uint16_t port) {
  SwitchOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  auto sw = std::make_unique<Switch>(o);
  sw->start();
  return sw;
}

void scatter_gather_matrix(Communicator& comm, std::initializer_list<size_t> counts) {
  for (size_t count : counts) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::min, ReduceOp::max}) {
      scatter_against_ring<float>(comm, DataType::f32, op, count);
      scatter_against_ring<double>(comm, DataType::f64, op, count);
      scatter_against_ring<int32_t>(comm, DataType::i32, op, count);
      scatter_against_ring<int64_t>(comm, DataType::i64, op, count);
    }
    scatter_against_ring<float>(comm, DataType::f32, ReduceOp::avg, count);
    gather_against_ring<float>(comm, DataType::f32, count);
    gather_against_ring<double>(comm, DataType::f64, count);
    gather_against_ring<int32_t>(comm, DataType::i32, count);
    gather_against_ring<int64_t>(comm, DataType::i64, count);
  }
}

}  // namespace e2e

TEST(SwitchAllreduce, EveryDtypeAndOpMatchesTheRing) {
  e2e::Running sw;
  harness::run_ranks(3, [&](Communicator& comm) {
    for (size_t count : {1, 1000, 100003}) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::min, ReduceOp::max}) {
        e2e::compare_with_ring<float>(comm, DataType::f32, op, count);
        e2e::compare_with_ring<double>(comm, DataType::f64, op, count);
        e2e::compare_with_ring<int32_t>(comm, DataType::i32, op, count);
        e2e::compare_with_ring<int64_t>(comm, DataType::i64, op, count);
      }
      e2e::compare_with_ring<float>(comm, DataType::f32, ReduceOp::avg, count);
      e2e::compare_with_ring<double>(comm, DataType::f64, ReduceOp::avg, count);
    }
    // In place, large; auto picks the switch for 3 ranks above rhd_max_bytes (the built-in cost model).
    auto x = e2e::values<float>(comm.rank(), 200000);
    auto expect = x;
    comm.allreduce(expect.data(), expect.data(), x.size(), DataType::f32, ReduceOp::sum, Algorithm::ring)->wait();
    ASSERT_EQ(comm.choose(Collective::allreduce, x.size(), DataType::f32), Algorithm::switch_);
    ASSERT_EQ(comm.choose(Collective::allreduce, 1000, DataType::f32), Algorithm::rd);
    comm.allreduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum, Algorithm::switch_)->wait();
    ASSERT_EQ(x, expect);
  }, e2e::switch_options(sw.address()));
  const SwitchStats s = sw.stats_after_leaves(1);
  EXPECT_EQ(s.jobs.size(), 0u);  // every rank left when its communicator closed
  EXPECT_EQ(s.jobs_left, 1u);
}

TEST(SwitchAllreduce, WithoutOffloadGivesTheSameBits) {
  SwitchOptions o;
  o.offload = false;
  e2e::Running sw(o);
  harness::run_ranks(3, [&](Communicator& comm) {
    e2e::compare_with_ring<float>(comm, DataType::f32, ReduceOp::sum, 100003);
    e2e::compare_with_ring<double>(comm, DataType::f64, ReduceOp::max, 30001);
  }, e2e::switch_options(sw.address(), {{"switch_offload", "off"}}));
  const SwitchStats s = sw.sw->stats();
  EXPECT_GT(s.datagrams_out, 0u);
  EXPECT_EQ(s.messages_out, s.datagrams_out);  // one datagram per message
  EXPECT_EQ(s.joined_in, 0u);
}

TEST(SwitchAllreduce, OffloadJoinsDatagramsBothWays) {
  e2e::Running sw;
  harness::run_ranks(3, [&](Communicator& comm) {
    e2e::compare_with_ring<float>(comm, DataType::f32, ReduceOp::sum, 300000);
  }, e2e::switch_options(sw.address()));
  const SwitchStats s = sw.sw->stats();
  EXPECT_LT(s.messages_out * 2, s.datagrams_out) << "results to one worker should leave together";
  EXPECT_GT(s.joined_in, 0u) << "the kernel should join a worker's contributions (UDP_GRO)";
  EXPECT_EQ(s.offload_refused, 0u);
}

namespace e2e {

// Values spread over several orders of magnitude, different on every rank.
std::vector<float> spread(int rank, size_t count) {
  std::mt19937 gen(1234 + rank);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = u(gen) * std::ldexp(1.0f, static_cast<int>(i / 64 % 12) - 6);
  return v;
}

// Every rank's result of one allreduce (float32 sum) through a switch with `codec`.
std::vector<std::vector<float>> codec_run(const SwitchOptions& o, int world, size_t count,
                                          std::map<std::string, std::string> extra) {
  Running sw(o);
  std::vector<std::vector<float>> got(static_cast<size_t>(world));
  harness::run_ranks(world, [&](Communicator& comm) {
    const auto x = spread(comm.rank(), count);
    std::vector<float> y(count);
    comm.allreduce(x.data(), y.data(), count, DataType::f32, ReduceOp::sum, Algorithm::switch_)->wait();
    got[static_cast<size_t>(comm.rank())] = y;
  }, switch_options(sw.address(), extra));
  return got;
}

}  // namespace e2e

TEST(SwitchAllreduce, CodecChunksAreSummedInFloat32AtTheSwitch) {
  constexpr int kWorld = 4;
  constexpr size_t kCount = 50003;  // a partial last block and a partial last chunk
  const std::map<std::string, std::string> knobs{{"codec", "bfp16"}, {"switch_packet", "4096"},
                                                 {"switch_slots", "32"}};
  const auto got = e2e::codec_run({}, kWorld, kCount, knobs);
  // One encoded result for everyone: the same bits on every rank.
  for (int r = 1; r < kWorld; ++r) ASSERT_EQ(std::memcmp(got[r].data(), got[0].data(), kCount * 4), 0) << r;
  // Against the float64 sum: each input rounded once (bound relative to its block's largest magnitude), the
  // float32 sum, and the result rounded once (relative to the sum's block), whatever the number of ranks.
  const Codec codec = Codec::parse("bfp16");
  const ErrorBound eb = codec.error_bound();
  const size_t block = codec.block_elems();
  std::vector<std::vector<float>> x;
  for (int r = 0; r < kWorld; ++r) x.push_back(e2e::spread(r, kCount));
  std::vector<double> exact(kCount, 0.0);
  for (size_t i = 0; i < kCount; ++i)
    for (int r = 0; r < kWorld; ++r) exact[i] += x[r][i];
  double worst = 0;
  for (size_t b0 = 0; b0 < kCount; b0 += block) {
    const size_t b1 = std::min(kCount, b0 + block);
    double inputs = 0, abs_sum = 0, sum_max = 0;
    for (int r = 0; r < kWorld; ++r) {
      double m = 0;
      for (size_t i = b0; i < b1; ++i) m = std::max(m, std::abs(double{x[r][i]}));
      inputs += eb.rel * m + eb.abs;
      abs_sum += m;
    }
    for (size_t i = b0; i < b1; ++i) sum_max = std::max(sum_max, std::abs(exact[i]));
    const double bound = inputs + kWorld * 0x1p-24 * (abs_sum + inputs) + eb.rel * (sum_max + inputs) + eb.abs;
    for (size_t i = b0; i < b1; ++i) {
      const double err = std::abs(double{got[0][i]} - exact[i]);
      ASSERT_LE(err, bound) << "element " << i;
      worst = std::max(worst, err / bound);
    }
  }
  EXPECT_GT(worst, 0.01);  // the codec did round: the bound is not vacuous
  // Loss, duplication and reordering change no bit.
  SwitchOptions faulty;
  faulty.threads = 2;
  faulty.faults = {0.02, 0.02, 0.05, 5};
  const auto again = e2e::codec_run(faulty, kWorld, kCount, knobs);
  for (int r = 0; r < kWorld; ++r) ASSERT_EQ(std::memcmp(again[r].data(), got[0].data(), kCount * 4), 0) << r;
}

TEST(SwitchAllreduce, ACallWithAnotherCodecThanTheJobsIsRefused) {
  e2e::Running sw;
  harness::run_ranks(2, [&](Communicator& comm) {
    // Without a codec (identity) a job joined with bfp16 sums raw floats.
    std::vector<float> x(1000, 1.0f);
    comm.allreduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum, Algorithm::switch_,
                   Codec())->wait();
    EXPECT_EQ(x[999], 2.0f);
    try {
      comm.allreduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum, Algorithm::switch_,
                     Codec::parse("fp16"))->wait();
      ADD_FAILURE() << "a call with codec fp16 went through a job joined with bfp16";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("joined its switches with codec 'bfp16'"), std::string::npos) << e.what();
    }
  }, e2e::switch_options(sw.address(), {{"codec", "bfp16"}}));
}

// With a codec too, the switch's answers without results (pending: it waits for slower ranks; error: the ranks
// disagree) reach the workers: a rank late by 4 switch timeouts causes no fallback, and calls that disagree fail on
// every rank. Those answers once kept the job's codec in their header, which workers refuse for answers without
// elements: a late rank made the others give up on the switch, and disagreeing calls were summed anyway.
TEST(SwitchAllreduce, WithACodecSlowRanksAndDisagreementsAreAnsweredAsWithout) {
  e2e::Running sw;
  harness::run_ranks(2, [&](Communicator& comm) {
    std::vector<float> x(50000, 1.0f);
    comm.allreduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum, Algorithm::switch_)->wait();
    if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(2));
    std::fill(x.begin(), x.end(), 1.0f);
    comm.allreduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum, Algorithm::switch_)->wait();
    EXPECT_EQ(x[0], 2.0f);
    std::vector<float> y(64, 1.0f);
    try {
      comm.allreduce(y.data(), y.data(), y.size(), DataType::f32, comm.rank() ? ReduceOp::avg : ReduceOp::sum,
                     Algorithm::switch_)->wait();
      ADD_FAILURE() << "rank " << comm.rank() << ": a sum and an avg were reduced together";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("ranks disagree"), std::string::npos) << e.what();
    }
  }, e2e::switch_options(sw.address(), {{"codec", "bfp16"}, {"switch_fallback", "fail"}}));
}

TEST(SwitchStatsQuery, AnswersWithTheJobsCountersWithoutTheSecret) {
  e2e::Running sw;
  const uint16_t port = sw.sw->port();
  harness::run_ranks(3, [&](Communicator& comm) {
    e2e::compare_with_ring<float>(comm, DataType::f32, ReduceOp::sum, 100000);
    comm.barrier()->wait();
    if (comm.rank() == 0) {  // while the job is there: its counters, by anyone who can reach the switch
      const std::string json = query_stats("127.0.0.1", port, 2.0);
      const SwitchStats s = sw.sw->stats();
      ASSERT_EQ(s.jobs.size(), 1u);
      char id[17];
      std::snprintf(id, sizeof id, "%016llx", static_cast<unsigned long long>(s.jobs[0].job));
      EXPECT_NE(json.find("\"job\":\"" + std::string(id) + "\",\"world\":3"), std::string::npos) << json;
      EXPECT_NE(json.find("\"results\":" + std::to_string(s.jobs[0].results)), std::string::npos) << json;
      EXPECT_GT(s.jobs[0].results, 0u);
      EXPECT_NE(json.find("\"truncated\":false}"), std::string::npos) << json;
      EXPECT_EQ(json.find("key"), std::string::npos);
    }
    comm.barrier()->wait();
  }, e2e::switch_options(sw.address()));
  // A query with less room than the answer needs is not answered (no amplification); a forged MAC neither.
  net::Fd fd = udp::open("127.0.0.1", 0);
  const sockaddr_in to = net::ipv4_address("127.0.0.1", port);
  Header h;
  h.type = Type::query;
  h.world = 1;
  std::vector<uint8_t> small(kHeaderBytes + 64, 0), forged(kHeaderBytes + 4096, 0);
  write_header(h, kOpenKey, small.data() + kHeaderBytes, 64, small.data());
  write_header(h, SipKey{1, 2}, forged.data() + kHeaderBytes, 4096, forged.data());
  for (const auto* d : {&small, &forged})
    ASSERT_EQ(::sendto(fd.get(), d->data(), d->size(), 0, reinterpret_cast<const sockaddr*>(&to), sizeof to),
              static_cast<ssize_t>(d->size()));
  SwitchStats s = sw.sw->stats();
  for (int i = 0; i < 200 && s.queries_refused < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    s = sw.sw->stats();
  }
  EXPECT_EQ(s.queries_refused, 2u);
  EXPECT_EQ(s.queries, 1u);
  EXPECT_THROW(query_stats("127.0.0.1", 9, 0.3), CommError);  // nobody there: a clear error in time
}

TEST(SwitchStatsQuery, AnAnswerNeverExceedsItsRoom) {
  SwitchStats s;
  s.jobs.resize(50);
  for (size_t i = 0; i < s.jobs.size(); ++i) s.jobs[i].job = i + 1;
  const std::string all = stats_json(s, kMaxPayload);
  EXPECT_NE(all.find("\"truncated\":false"), std::string::npos);
  const std::string some = stats_json(s, all.size() / 2);
  EXPECT_LE(some.size(), all.size() / 2);
  EXPECT_NE(some.find("\"truncated\":true"), std::string::npos);
  EXPECT_EQ(stats_json(s, 100), "");  // not even the switch's own counters fit
}

TEST(SwitchAllreduce, SurvivesLossDuplicationAndReordering) {
  SwitchOptions o;
  o.threads = 2;
  o.faults = {0.01, 0.01, 0.05, 3};
  e2e::Running sw(o);
  harness::run_ranks(4, [&](Communicator& comm) {
    for (int i = 0; i < 3; ++i) e2e::compare_with_ring<float>(comm, DataType::f32, ReduceOp::sum, 300000);
    e2e::compare_with_ring<int64_t>(comm, DataType::i64, ReduceOp::sum, 100000);
    // Owned chunks too: a lost result or done is sent again from the shadow, to the rank it was for.
    e2e::scatter_against_ring<int32_t>(comm, DataType::i32, ReduceOp::sum, 60000);
    e2e::gather_against_ring<float>(comm, DataType::f32, 60000);
    comm.barrier()->wait();
    if (comm.rank() == 0) {  // before anyone leaves: the faults made work for the protocol
      const SwitchStats s = sw.sw->stats();
      ASSERT_EQ(s.jobs.size(), 1u);
      EXPECT_GT(s.jobs[0].retransmits, 0u);
    }
    comm.barrier()->wait();
  }, e2e::switch_options(sw.address(), {{"switch_packet", "4096"}, {"switch_slots", "32"}}));
  EXPECT_EQ(sw.stats_after_leaves(1).jobs_left, 1u);
}

TEST(SwitchAllreduce, FallsBackToTheRingWhenTheSwitchGoes) {
  // The call that finds the switch gone is an allreduce, a reduce_scatter or an allgather (each finishes from
  // what it has); the calls after it go straight to the ring.
  for (int first = 0; first < 3; ++first) {
    e2e::Running sw;
    harness::run_ranks(3, [&](Communicator& comm) {
      e2e::compare_with_ring<float>(comm, DataType::f32, ReduceOp::sum, 50000);
      comm.barrier()->wait();
      if (comm.rank() == 0) sw.sw->stop();
      comm.barrier()->wait();
      for (int i = 0; i < 3; ++i) {
        if ((first + i) % 3 == 1) {
          e2e::scatter_against_ring<int64_t>(comm, DataType::i64, ReduceOp::sum, 30001);
        } else if ((first + i) % 3 == 2) {
          e2e::gather_against_ring<double>(comm, DataType::f64, 30001);
        } else {
          auto x = e2e::values<int32_t>(comm.rank(), 70001);
          std::vector<int32_t> expect(x.size());
          comm.allreduce(x.data(), expect.data(), x.size(), DataType::i32, ReduceOp::sum, Algorithm::ring)->wait();
          comm.allreduce(x.data(), x.data(), x.size(), DataType::i32, ReduceOp::sum, Algorithm::switch_)->wait();
          ASSERT_EQ(x, expect) << "call " << i;
        }
      }
    }, e2e::switch_options(sw.address()));
  }
}

TEST(SwitchAllreduce, AfterAFallbackCallsGiveTheRingsBits) {
  // Sums that round: only the same schedule as algo=ring (its segments and reduction order) gives its bits.
  e2e::Running sw;
  harness::run_ranks(3, [&](Communicator& comm) {
    comm.barrier()->wait();
    if (comm.rank() == 0) sw.sw->stop();
    comm.barrier()->wait();
    e2e::compare_with_ring<int32_t>(comm, DataType::i32, ReduceOp::sum, 5000);  // falls back
    std::mt19937 rng(static_cast<unsigned>(comm.rank()) + 7);
    std::uniform_real_distribution<float> u(-1, 1);
    const size_t count = 3 * 100003;
    std::vector<float> x(count), a(count), b(count);
    for (float& v : x) v = u(rng) * 1e3f;
    comm.allreduce(x.data(), a.data(), count, DataType::f32, ReduceOp::sum, Algorithm::switch_)->wait();
    comm.allreduce(x.data(), b.data(), count, DataType::f32, ReduceOp::sum, Algorithm::ring)->wait();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), count * 4), 0) << "allreduce";
    comm.reduce_scatter(x.data(), a.data(), count / 3, DataType::f32, ReduceOp::sum, std::nullopt,
                        Algorithm::switch_)->wait();
    comm.reduce_scatter(x.data(), b.data(), count / 3, DataType::f32, ReduceOp::sum, std::nullopt,
                        Algorithm::ring)->wait();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), count / 3 * 4), 0) << "reduce_scatter";
  }, e2e::switch_options(sw.address()));
}

TEST(SwitchAllreduce, FailModeNamesTheSwitchWithinItsTimeout) {
  e2e::Running sw;
  const std::string address = sw.address();
  harness::run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, std::move(store), e2e::switch_options(address, {{"switch_fallback", "fail"}}));
    comm.barrier()->wait();
    if (r == 0) sw.sw->stop();
    comm.barrier()->wait();
    std::vector<float> x(10000, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.allreduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum, Algorithm::switch_)->wait();
      ADD_FAILURE() << "rank " << r << ": the call succeeded without a switch";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("switch " + address), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("switch_fallback=fail"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  });
}

TEST(SwitchAllreduce, NoSwitchAtStartUpFallsBackOrFails) {
  // A port nobody serves: joining times out.
  const std::string nobody = "127.0.0.1:9";
  harness::run_ranks(2, [&](Communicator& comm) {
    std::vector<double> x(5000, comm.rank() + 1.0);
    comm.allreduce(x.data(), x.data(), x.size(), DataType::f64, ReduceOp::sum, Algorithm::switch_)->wait();
    ASSERT_EQ(x[4999], 3.0);
  }, e2e::switch_options(nobody, {{"switch_timeout", "0.2"}}));
  harness::run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    EXPECT_THROW(Communicator(r, 2, std::move(store),
                              e2e::switch_options(nobody, {{"switch_timeout", "0.2"}, {"switch_fallback", "fail"}})),
                 CommError);
  });
}

TEST(SwitchScatterGather, EveryDtypeAndOpMatchesTheRing) {
  e2e::Running sw;
  harness::run_ranks(3, [&](Communicator& comm) {
    e2e::scatter_gather_matrix(comm, {1, 1000, 30001});
    // In place: reduce_scatter's output over its input's first block, allgather's input as its own block.
    const size_t count = 20000, n = 3;
    auto x = e2e::values<int32_t>(comm.rank(), count * n), expect = x;
    comm.reduce_scatter(expect.data(), expect.data(), count, DataType::i32, ReduceOp::sum, std::nullopt,
                        Algorithm::ring)->wait();
    comm.reduce_scatter(x.data(), x.data(), count, DataType::i32, ReduceOp::sum, std::nullopt,
                        Algorithm::switch_)->wait();
    ASSERT_EQ(std::memcmp(x.data(), expect.data(), count * 4), 0);
    auto g = e2e::values<int32_t>(comm.rank(), count * n), gexpect = g;
    int32_t* mine = g.data() + comm.rank() * count;
    comm.allgather(mine, g.data(), count, DataType::i32, std::nullopt, Algorithm::switch_)->wait();
    comm.allgather(gexpect.data() + comm.rank() * count, gexpect.data(), count, DataType::i32, std::nullopt,
                   Algorithm::ring)->wait();
    ASSERT_EQ(g, gexpect);
    ASSERT_THROW(comm.allgather(mine, g.data(), count, DataType::f32, Codec::parse("bfp16"), Algorithm::switch_),
                 InvalidArgument);
  }, e2e::switch_options(sw.address()));
  const SwitchStats s = sw.stats_after_leaves(1);
  EXPECT_EQ(s.jobs_left, 1u);
  EXPECT_EQ(s.ended.drops[static_cast<size_t>(Drop::mismatch)], 0u);
}

TEST(SwitchScatterGather, OnlyTheOwnerGetsABlocksSumsAndOnlyTheOwnerSendsItsBlock) {
  e2e::Running sw;
  const size_t count = 1408 / 4 * 10;  // 10 whole chunks per block
  harness::run_ranks(4, [&](Communicator& comm) {
    e2e::scatter_against_ring<float>(comm, DataType::f32, ReduceOp::sum, count);
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      const SwitchStats s = sw.sw->stats();
      ASSERT_EQ(s.jobs.size(), 1u);
      // 4 blocks of 10 chunks, each from 4 ranks; each chunk's sums (1408 + 48 bytes) to its owner, a 48-byte
      // done to the 3 others.
      EXPECT_EQ(s.jobs[0].contributions, 4u * 40u);
      EXPECT_EQ(s.jobs[0].bytes_in, 4u * 4u * count * 4u);
      const uint64_t once = 40u * (1456u + 3u * 48u);
      EXPECT_GE(s.jobs[0].bytes_out, once);
      EXPECT_LE(s.jobs[0].bytes_out, once + 1456u * s.jobs[0].resent);
    }
    comm.barrier()->wait();
    e2e::gather_against_ring<float>(comm, DataType::f32, count);
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      const SwitchStats s = sw.sw->stats();
      // allgather: 40 chunks more, each with data from its owner alone: 4 x 1408 x 10 more bytes in.
      EXPECT_EQ(s.jobs[0].bytes_in, 4u * 4u * count * 4u + 4u * count * 4u);
    }
    comm.barrier()->wait();
  }, e2e::switch_options(sw.address()));
}

TEST(SwitchRetry, AfterAFallbackEveryRankProbesTheSwitchAtTheSameCall) {
  auto sw = std::make_unique<e2e::Running>();
  const uint16_t port = sw->sw->port();
  const std::string address = sw->address();
  std::unique_ptr<Switch> second;
  harness::run_ranks(3, [&](Communicator& comm) {
    auto call = [&](int i) { e2e::compare_with_ring<int32_t>(comm, DataType::i32, ReduceOp::sum, 20000 + i); };
    call(1);  // through the switch
    comm.barrier()->wait();
    if (comm.rank() == 0) sw.reset();  // its sockets closed: the port is free again
    comm.barrier()->wait();
    call(2);  // falls back; the next probe is at call 2 + 2
    call(3);
    call(4);  // probes: the switch is still down (a join times out), so the next probe is at call 4 + 4
    comm.barrier()->wait();
    if (comm.rank() == 0) second = e2e::started_on(port);
    comm.barrier()->wait();
    for (int i = 5; i < 8; ++i) call(i);  // on the ring: nobody asks the new switch
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      EXPECT_EQ(second->stats().jobs_joined, 0u);
    }
    comm.barrier()->wait();
    call(8);  // probes: every rank joins a fresh job, and this call goes through the switch again
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      const SwitchStats s = second->stats();
      EXPECT_EQ(s.jobs_joined, 1u);
      ASSERT_EQ(s.jobs.size(), 1u);
      EXPECT_EQ(s.jobs[0].results, (20008u * 4 + 1407) / 1408);  // this call's chunks, once each
    }
    comm.barrier()->wait();
  }, e2e::switch_options(address, {{"switch_retry", "2"}}));
  second->stop();
}

// auto picks the switch where the cost model says so (3 ranks, above rhd_max_bytes); after a fallback it runs the
// ring, without waiting for the calls in flight, until a probe gets every rank in again (switch_retry). Every rank
// makes the same choice for every call.
TEST(SwitchRetry, AutoRunsTheRingWhileTheSwitchIsGoneAndTheSwitchAgainAfterAProbe) {
  auto sw = std::make_unique<e2e::Running>();
  const uint16_t port = sw->sw->port();
  const std::string address = sw->address();
  std::unique_ptr<Switch> second;
  const size_t count = size_t{1} << 17;  // 512 KiB of int32
  std::vector<int32_t> expect(count, 0);
  for (int r = 0; r < 3; ++r) {
    const auto v = e2e::values<int32_t>(r, count);
    for (size_t i = 0; i < count; ++i) expect[i] += v[i];
  }
  std::vector<std::vector<Algorithm>> ran(3);
  harness::run_ranks(3, [&](Communicator& comm) {
    // `k` calls posted at once (each may start while the others run), then waited for.
    auto calls = [&](int k) {
      std::vector<std::vector<int32_t>> xs(static_cast<size_t>(k), e2e::values<int32_t>(comm.rank(), count));
      std::vector<std::shared_ptr<Request>> reqs;
      for (auto& x : xs) reqs.push_back(comm.allreduce(x.data(), x.data(), count, DataType::i32, ReduceOp::sum));
      for (size_t i = 0; i < reqs.size(); ++i) {
        reqs[i]->wait();
        ran[comm.rank()].push_back(reqs[i]->algorithm());
        ASSERT_EQ(xs[i], expect) << "call " << ran[comm.rank()].size();
      }
    };
    calls(1);  // 1: through the switch
    comm.barrier()->wait();
    if (comm.rank() == 0) sw.reset();
    comm.barrier()->wait();
    calls(1);  // 2: through the switch, which falls back; the next probe is at call 2 + 2
    calls(1);  // 3: the ring
    calls(1);  // 4: probes (the switch is still down), then the ring inside it; the next probe is at call 4 + 4
    comm.barrier()->wait();
    if (comm.rank() == 0) second = e2e::started_on(port);
    comm.barrier()->wait();
    calls(3);  // 5-7: the ring, all three in flight at once
    calls(2);  // 8: probes, every rank gets in, through the switch; 9: through the switch
    comm.barrier()->wait();
  }, e2e::switch_options(address, {{"switch_retry", "2"}}));
  second->stop();
  const auto S = Algorithm::switch_, R = Algorithm::ring;
  const std::vector<Algorithm> want = {S, S, R, S, R, R, R, S, S};
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(ran[r].size(), want.size()) << "rank " << r;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_EQ(algorithm_name(ran[r][i]), algorithm_name(want[i])) << "rank " << r << ", call " << i + 1;
  }
}

// A job that used one-sided calls and fell back from its switch leaves no key in its rendezvous store: each rank
// deletes its one-sided address when its server closes, a rank that said it lost the switch deletes that word at
// the next probe, rank 0 deletes the job id it drew once every rank read it, and the last rank to close deletes
// the rest.
TEST(StoreCleanup, AJobWithOneSidedCallsAndAFallbackLeavesNoKeys) {
  e2e::Running sw;
  TcpStore server("127.0.0.1", 0, true, std::chrono::seconds(10));
  const int n = 3;
  std::vector<uint64_t> keys;  // rank 0 reads the server's count at each step
  auto count_keys = [&](Communicator& comm) {
    comm.barrier()->wait();
    if (comm.rank() == 0) keys.push_back(server.server_stats().keys);
    comm.barrier()->wait();
  };
  harness::run_threads(n, [&](int r, std::shared_ptr<Store>) {
    auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), false, std::chrono::seconds(10));
    Communicator comm(r, n, store, e2e::switch_options(sw.address(), {{"switch_retry", "1"}}));
    std::vector<uint8_t> mine(64, static_cast<uint8_t>(r)), got(16);
    comm.register_region(mine.data(), mine.size(), DataType::u8);
    comm.barrier()->wait();
    const RemotePiece piece{8, 16};
    const LocalPiece into{got.data(), got.size()};
    comm.getv({(r + 1) % n, 1, 64, DataType::u8}, {&piece, 1}, {&into, 1})->wait();
    EXPECT_EQ(got, std::vector<uint8_t>(16, static_cast<uint8_t>((r + 1) % n)));
    auto x = e2e::values<int32_t>(r, 5000);
    comm.allreduce(x.data(), x.data(), x.size(), DataType::i32, ReduceOp::sum, Algorithm::switch_)->wait();
    count_keys(comm);  // [0]: the job's keys, one-sided addresses included
    if (r == 0) sw.sw->stop();
    comm.barrier()->wait();
    comm.allreduce(x.data(), x.data(), x.size(), DataType::i32, ReduceOp::sum, Algorithm::switch_)->wait();
    count_keys(comm);  // [1]: and the word that the switch was lost (every rank found it silent)
    comm.allreduce(x.data(), x.data(), x.size(), DataType::i32, ReduceOp::sum, Algorithm::switch_)->wait();
    count_keys(comm);  // [2]: this call probed: the word is gone
    comm.close();
  });
  ASSERT_EQ(keys.size(), 3u);
  EXPECT_GE(keys[0], static_cast<uint64_t>(3 * n));  // at least the settings, addresses and one-sided addresses
  EXPECT_EQ(keys[1], keys[0] + 1);
  EXPECT_EQ(keys[2], keys[0]);
  EXPECT_EQ(server.server_stats().keys, 0u);
}

TEST(SwitchRetry, NeverProbesWithRetryZero) {
  auto sw = std::make_unique<e2e::Running>();
  const uint16_t port = sw->sw->port();
  std::unique_ptr<Switch> second;
  harness::run_ranks(2, [&](Communicator& comm) {
    comm.barrier()->wait();
    if (comm.rank() == 0) sw.reset();  // its sockets closed: the port is free again
    comm.barrier()->wait();
    e2e::compare_with_ring<int32_t>(comm, DataType::i32, ReduceOp::sum, 5000);  // falls back
    comm.barrier()->wait();
    if (comm.rank() == 0) second = e2e::started_on(port);  // back on the same port: only a probe finds it
    comm.barrier()->wait();
    for (int i = 0; i < 8; ++i) e2e::compare_with_ring<int32_t>(comm, DataType::i32, ReduceOp::sum, 5000);
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      EXPECT_EQ(second->stats().datagrams_in, 0u);
    }
    comm.barrier()->wait();  // nobody closes (and sends its leave) before rank 0 has looked
  }, e2e::switch_options(sw->address(), {{"switch_retry", "0"}}));
  second->stop();
}

// A switch from before owned chunks, or one whose data ports are blocked: it answers every join as a switch
// did before (no features in the answer) and never answers a contribution. Counts the jobs joined.
struct JoinOnlySwitch {
  net::Fd fd = udp::open("127.0.0.1", 0);
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::set<uint64_t> jobs;
  std::thread loop{[this] {
    udp::RecvBatch in(16, kMaxDatagram);
    uint8_t answer[kHeaderBytes + sizeof(JoinedBody)];
    while (!stop) {
      pollfd p{fd.get(), POLLIN, 0};
      ::poll(&p, 1, 20);
      for (size_t i = 0, n = in.receive(fd.get()); i < n; ++i) {
        const Parsed got = parse(in.data(i), in.len(i));
        if (!got.ok() || got.pkt.h.type != Type::join) continue;
        JoinBody body;
        std::memcpy(&body, got.pkt.payload, sizeof body);
        Header h = got.pkt.h;
        h.type = Type::joined;
        const JoinedBody ans{0, 1, body.window, 0};
        std::memcpy(answer + kHeaderBytes, &ans, sizeof ans);
        write_header(h, SipKey::from_bytes(body.key), &ans, sizeof ans, answer);
        ::sendto(fd.get(), answer, sizeof answer, 0, reinterpret_cast<const sockaddr*>(&in.from(i)),
                 sizeof(sockaddr_in));
        std::lock_guard lock(mu);
        jobs.insert(h.job);
      }
    }
  }};
  ~JoinOnlySwitch() {
    stop = true;
    loop.join();
  }
  std::string address() const {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
    return "127.0.0.1:" + std::to_string(udp::port_of(a));
  }
  size_t joined() {
    std::lock_guard lock(mu);
    return jobs.size();
  }
};

// Between the ranks and a switch of one thread: forwards both ways, each rank through a socket of its own, and
// once `cut` holds drops what the switch sends to rank `victim` (its path lost after its contributions went in).
struct Relay {
  net::Fd front = udp::open("127.0.0.1", 0);
  sockaddr_in to_switch;
  int victim;
  std::atomic<bool> cut{false}, stop{false};
  std::vector<std::pair<sockaddr_in, net::Fd>> backs;  // per rank's address: its socket towards the switch
  std::thread loop;
  Relay(uint16_t switch_port, int victim_rank)
      : to_switch(net::ipv4_address("127.0.0.1", switch_port)), victim(victim_rank), loop([this] { run(); }) {}
  ~Relay() {
    stop = true;
    loop.join();
  }
  std::string address() const {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    getsockname(front.get(), reinterpret_cast<sockaddr*>(&a), &len);
    return "127.0.0.1:" + std::to_string(udp::port_of(a));
  }
  void run() {
    std::map<size_t, int> rank_of;  // back socket -> the rank it carries (from its datagrams' rank field)
    uint8_t buf[kMaxDatagram];
    while (!stop) {
      std::vector<pollfd> fds{{front.get(), POLLIN, 0}};
      for (auto& b : backs) fds.push_back({b.second.get(), POLLIN, 0});
      ::poll(fds.data(), fds.size(), 20);
      sockaddr_in from{};
      socklen_t flen = sizeof from;
      for (ssize_t n; (n = ::recvfrom(front.get(), buf, sizeof buf, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&from),
                                      &flen)) > 0; flen = sizeof from) {
        size_t i = 0;
        while (i < backs.size() && (backs[i].first.sin_port != from.sin_port)) ++i;
        if (i == backs.size()) backs.emplace_back(from, udp::open("127.0.0.1", 0));
        const Parsed got = parse(buf, static_cast<size_t>(n));
        if (got.ok()) rank_of[i] = got.pkt.h.rank;
        ::sendto(backs[i].second.get(), buf, static_cast<size_t>(n), 0, reinterpret_cast<const sockaddr*>(&to_switch),
                 sizeof to_switch);
      }
      for (size_t i = 0; i < backs.size(); ++i) {
        for (ssize_t n; (n = ::recv(backs[i].second.get(), buf, sizeof buf, MSG_DONTWAIT)) > 0;) {
          if (cut && rank_of.count(i) && rank_of[i] == victim) continue;
          ::sendto(front.get(), buf, static_cast<size_t>(n), 0, reinterpret_cast<const sockaddr*>(&backs[i].first),
                   sizeof(sockaddr_in));
        }
      }
    }
  }
};

TEST(SwitchAllreduce, FailModeARankThatLostItsResultsFailsEveryRankInTheNextCall) {
  e2e::Running sw;
  Relay relay(sw.sw->port(), 2);
  harness::run_threads(3, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 3, std::move(store),
                      e2e::switch_options(relay.address(), {{"switch_fallback", "fail"}, {"timeout", "20"}}));
    e2e::compare_with_ring<int32_t>(comm, DataType::i32, ReduceOp::sum, 3000);
    comm.barrier()->wait();
    if (r == 0) relay.cut = true;
    comm.barrier()->wait();
    // Call 2: every contribution goes in and ranks 0 and 1 get their results; rank 2's never come, so it fails
    // after switch_timeout. Ranks 0 and 1 wait for rank 2 in call 3 and learn it from the store.
    const auto start = std::chrono::steady_clock::now();
    std::vector<int32_t> x(3000, 1);
    try {
      for (int call = 2; call <= 3; ++call)
        comm.allreduce(x.data(), x.data(), x.size(), DataType::i32, ReduceOp::sum, Algorithm::switch_)->wait();
      ADD_FAILURE() << "rank " << r << ": every call succeeded";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find(r < 2 ? "rank 2 lost the switch" : "stopped answering"),
                std::string::npos) << "rank " << r << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("switch_fallback=fail"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4)) << "rank " << r;  // not `timeout`
  });
}

TEST(SwitchRetry, ARankThatCannotJoinLeavesNoSlotsHeld) {
  e2e::Running sw;
  Relay relay(sw.sw->port(), 2);
  relay.cut = true;  // rank 2 never hears the switch: its joins time out, ranks 0 and 1 get in
  auto freed = [&](uint64_t joined) {
    SwitchStats s = sw.sw->stats();
    for (int i = 0; i < 200 && (s.jobs_left < joined || !s.jobs.empty()); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      s = sw.sw->stats();
    }
    EXPECT_EQ(s.jobs_joined, joined);
    EXPECT_EQ(s.jobs_left, joined);  // left by the ranks that joined, not expired
    EXPECT_TRUE(s.jobs.empty());
    EXPECT_EQ(s.slots_free, s.slots_total);
  };
  harness::run_ranks(3, [&](Communicator& comm) {
    comm.barrier()->wait();
    if (comm.rank() == 0) freed(1);  // the start-up's job, while every communicator is open
    comm.barrier()->wait();
    e2e::compare_with_ring<int32_t>(comm, DataType::i32, ReduceOp::sum, 3000);  // probes at call 1: fails
    comm.barrier()->wait();
    if (comm.rank() == 0) freed(2);  // the probe's job too
    comm.barrier()->wait();
  }, e2e::switch_options(relay.address(), {{"switch_retry", "1"}}));
}

TEST(SwitchRetry, AJoinThatSucceedsDoesNotResetTheBackoffWhileNoCallGoesThrough) {
  JoinOnlySwitch sw;
  harness::run_ranks(3, [&](Communicator& comm) {
    // Call 1 falls back (next probe at 2); each probe joins, its call falls back, and the wait doubles: probes
    // at calls 2, 4 and 8. Were a successful join to reset the wait, every call would probe and stall.
    for (int i = 0; i < 8; ++i) e2e::compare_with_ring<int32_t>(comm, DataType::i32, ReduceOp::sum, 3000);
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      EXPECT_EQ(sw.joined(), 4u);  // at start-up, and the probes at calls 2, 4 and 8
    }
    comm.barrier()->wait();
  }, e2e::switch_options(sw.address(), {{"switch_retry", "1"}, {"switch_timeout", "0.3"}}));
}

TEST(SwitchScatterGather, ASwitchWithoutOwnedChunksIsRefusedByName) {
  JoinOnlySwitch sw;
  harness::run_ranks(2, [&](Communicator& comm) {
    std::vector<int32_t> x(2000), y(1000);
    try {
      comm.reduce_scatter(x.data(), y.data(), 1000, DataType::i32, ReduceOp::sum, std::nullopt,
                          Algorithm::switch_)->wait();
      ADD_FAILURE() << "reduce_scatter through a switch without owned chunks succeeded";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("switch " + sw.address() + " predates reduce_scatter"), std::string::npos)
          << e.what();
    }
  }, e2e::switch_options(sw.address()));
}

}  // namespace
}  // namespace smartcoll::sw
