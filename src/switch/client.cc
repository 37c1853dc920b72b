#include "switch/client.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <sstream>

#include "core/log.h"
#include "smartcoll/reduce.h"

namespace smartcoll::sw {

namespace {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

// One chunk in a slot, waiting for its result.
struct Flight {
  bool busy = false;
  uint64_t seq = 0;
  size_t chunk = 0;
  Clock::time_point sent;
  int tries = 0;
  uint64_t completed_at_send = 0;  // the switch's finished chunks when this one was (last) sent
  bool acked = false;              // the switch said it has this contribution (`pending`)
  uint64_t sent_no = 0;            // its place in the order of sends to its switch thread (last send)
  uint8_t header[kHeaderBytes];
};

// The workers a bitmap lacks, named by `ranks` where given (ClientSettings::ranks).
std::string ranks_missing(const std::vector<uint8_t>& bitmap, int world, const std::vector<int>& ranks) {
  std::string out;
  for (int r = 0; r < world; ++r)
    if (!(bitmap[r / 8] & (1u << (r % 8))))
      out += (out.empty() ? "" : ",") + std::to_string(ranks.empty() ? r : ranks[static_cast<size_t>(r)]);
  return out;
}

}  // namespace

struct Client::Remote {
  net::Endpoint ep;
  sockaddr_in addr{};
  uint32_t threads = 1;
  // A join went to it: it gets a leave, also when it did not answer (the join may have arrived, and its answer
  // been lost) or a later switch failed the join; a leave of a rank the switch does not know changes nothing.
  bool asked = false;
  bool owned = false;  // it takes chunks owned by one rank (reduce_scatter, allgather): kFeatureOwned
  uint64_t next_seq = 0;  // the next chunk number of the job on this switch
  double srtt = 0, rttvar = 0;  // smoothed round trip and its variation, seconds (0: no sample yet)
  std::vector<Flight> flights;  // by slot
  std::vector<uint8_t> waiting;  // the last `pending` bitmap of this call: who the switch has heard from
  bool pending = false;          // a `pending` came during this call
  uint64_t completed = 0;        // chunks of this call finished on this switch
  Clock::time_point last_result;  // when the last of them came
  // Per switch thread: datagrams of chunks sent to it, ever, and the latest sent_no whose result came. A thread
  // handles its datagrams in order, and every rank sends in the same order, so its results come back in order
  // unless something was lost.
  std::vector<uint64_t> sends, newest_done;
};

std::vector<net::Endpoint> parse_switches(const std::string& text) {
  std::vector<net::Endpoint> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    const auto colon = item.rfind(':');
    char* end = nullptr;
    const long port = colon == std::string::npos ? 0 : std::strtol(item.c_str() + colon + 1, &end, 10);
    if (colon == std::string::npos || colon == 0 || *end != '\0' || port < 1 || port > 65535)
      throw InvalidArgument("option 'switch' (SMARTCOLL_SWITCH): '" + item +
                            "' is not host:port; expected e.g. 10.0.0.1:7000 or 10.0.0.1:7000,10.0.0.2:7000");
    out.push_back({net::resolve_ipv4(item.substr(0, colon)), static_cast<uint16_t>(port)});
  }
  return out;
}

Client::Client(int rank, int world, ClientSettings settings, const SipKey& key, uint64_t job)
    : rank_(rank), world_(world), settings_(std::move(settings)), key_(key), job_(job),
      batch_(settings_.offload ? 256 : 64, settings_.offload), inbox_(32, kMaxDatagram, settings_.offload) {
  if (world > static_cast<int>(kMaxWorld))
    throw InvalidArgument("the switch takes at most " + std::to_string(kMaxWorld) + " ranks, the world has " +
                          std::to_string(world));
  fd_ = udp::open("0.0.0.0", 0);
  if (settings_.offload) udp::enable_gro(fd_.get());  // refused: datagrams simply come one by one
  for (const net::Endpoint& ep : settings_.switches) {
    Remote r;
    r.ep = ep;
    r.addr = net::ipv4_address(ep.host, ep.port);
    r.flights.resize(settings_.window);
    r.waiting.assign((world + 7) / 8, 0);
    remotes_.push_back(std::move(r));
  }
}

Client::~Client() { leave(); }

std::string Client::name(size_t j) const { return "switch " + remotes_[j].ep.str(); }

int Client::switch_of(const sockaddr_in& from) const {
  for (size_t j = 0; j < remotes_.size(); ++j) {
    const Remote& r = remotes_[j];
    const uint16_t port = udp::port_of(from), base = r.ep.port;
    if (from.sin_addr.s_addr == r.addr.sin_addr.s_addr && port >= base && port < base + r.threads)
      return static_cast<int>(j);
  }
  return -1;
}

Header Client::header(Type type) const {
  Header h;
  h.type = type;
  h.flags = settings_.full_auth ? kFullAuth : 0;
  h.job = job_;
  h.rank = static_cast<uint16_t>(rank_);
  h.world = static_cast<uint16_t>(world_);
  return h;
}

void Client::join() {
  const auto patience = std::chrono::duration_cast<Clock::duration>(Seconds(settings_.switch_timeout));
  JoinBody body{};
  key_.to_bytes(body.key);
  body.window = settings_.window;
  body.max_payload = settings_.packet;
  body.full_auth = settings_.full_auth;
  put_codec(body, settings_.codec);
  join_datagram_.assign(kHeaderBytes + sizeof body, 0);
  uint8_t* datagram = join_datagram_.data();
  std::memcpy(datagram + kHeaderBytes, &body, sizeof body);
  write_header(header(Type::join), key_, datagram + kHeaderBytes, sizeof body, datagram);
  for (size_t j = 0; j < remotes_.size(); ++j) {
    Remote& r = remotes_[j];
    const auto give_up = Clock::now() + patience;
    r.asked = true;
    bool answered = false;
    while (!answered) {
      const auto now = Clock::now();
      if (now >= give_up)
        throw SwitchGone(name(j) + " did not answer within " + log::seconds(settings_.switch_timeout) +
                         " (SMARTCOLL_SWITCH_TIMEOUT): is `smartcoll switch --listen " + r.ep.str() +
                         "` running and reachable from this host?");
      batch_.add(r.addr, datagram, join_datagram_.size());
      batch_.flush(fd_.get());
      pollfd p{fd_.get(), POLLIN, 0};
      ::poll(&p, 1, 100);  // join again every 100 ms until answered
      const size_t n = inbox_.receive(fd_.get());
      for (size_t i = 0; i < n && !answered; ++i) {
        if (inbox_.from(i).sin_addr.s_addr != r.addr.sin_addr.s_addr || udp::port_of(inbox_.from(i)) != r.ep.port)
          continue;
        const Parsed got = parse(inbox_.data(i), inbox_.len(i));
        if (!got.ok() || got.pkt.h.type != Type::joined || got.pkt.h.job != job_ ||
            !authentic(got.pkt, inbox_.data(i), key_, settings_.full_auth))
          continue;
        JoinedBody ans;
        std::memcpy(&ans, got.pkt.payload, sizeof ans);
        const std::string how = " (SMARTCOLL_SWITCH_SLOTS=" + std::to_string(settings_.window) +
                                ", SMARTCOLL_SWITCH_PACKET=" + std::to_string(settings_.packet) + ")";
        switch (static_cast<JoinStatus>(ans.status)) {
          case JoinStatus::ok: break;
          case JoinStatus::no_room:
            throw CommError(name(j) + " has no room for this job: it asks " + std::to_string(settings_.window) +
                            " slots, " + std::to_string(ans.free_slots) + " are free; ask fewer" + how +
                            " or give the switch more (--slots)");
          case JoinStatus::needs_full_auth:
            throw CommError(name(j) + " requires payload authentication: set SMARTCOLL_SWITCH_AUTH=full");
          case JoinStatus::too_large:
            throw CommError(name(j) + " refuses a window this large" + how);
          default:
            throw CommError(name(j) + " already has this job with other settings: every rank must use the same "
                            "switch settings");
        }
        if (ans.threads < 1 || ans.threads > 256 || ans.window != settings_.window)
          throw CommError(name(j) + " answered the join with impossible values (threads " +
                          std::to_string(ans.threads) + "); is it a compatible smartcoll switch?");
        r.threads = ans.threads;
        r.owned = (got.pkt.h.call & kFeatureOwned) != 0;
        r.sends.assign(r.threads, 0);
        r.newest_done.assign(r.threads, 0);
        answered = true;
      }
    }
  }
  if (settings_.keepalive > 0 && !keeper_.joinable()) {
    last_heard_ = Clock::now();
    keeper_ = std::thread([this] { keep_alive(); });
  }
}

void Client::keep_alive() {
  const auto every = std::chrono::duration_cast<Clock::duration>(Seconds(settings_.keepalive));
  std::unique_lock lock(keep_mu_);
  while (!keep_stop_ && (!settings_.job_alive || settings_.job_alive->load())) {
    const auto due = last_heard_ + every;
    if (in_call_ || Clock::now() < due) {
      keep_cv_.wait_until(lock, in_call_ ? Clock::now() + every : due);
      continue;
    }
    if (settings_.job_alive && !settings_.job_alive->load()) break;
    // A join of a job the switch holds refreshes it and changes nothing else. Its answer waits in the socket
    // for the next call, which skips it. A failed send is left to that call to find (the switch gone).
    for (const Remote& r : remotes_) {
      if (!r.asked) continue;
      if (::sendto(fd_.get(), join_datagram_.data(), join_datagram_.size(), MSG_DONTWAIT,
                   reinterpret_cast<const sockaddr*>(&r.addr), sizeof r.addr) < 0)
        SC_LOG(LogLevel::debug, rank_, "switch") << "keepalive to " << r.ep.str()
                                                 << " not sent: " << std::strerror(errno);
    }
    last_heard_ = Clock::now();
  }
}

void Client::stop_keeper() {
  {
    std::lock_guard lock(keep_mu_);
    keep_stop_ = true;
  }
  keep_cv_.notify_all();
  if (keeper_.joinable()) keeper_.join();
}

void Client::leave() {
  stop_keeper();  // a join after the leave would take the rank back in
  for (Remote& r : remotes_) {
    if (!r.asked) continue;
    r.asked = false;
    const Header h = header(Type::leave);
    uint8_t datagram[kHeaderBytes];
    write_header(h, key_, nullptr, 0, datagram);
    // Nothing acknowledges a leave: three copies make a lost one unlikely to keep the job's slots until the
    // switch's job timeout (a second copy of a leave changes nothing there).
    for (int copy = 0; copy < 3; ++copy) batch_.add(r.addr, datagram, sizeof datagram);
    batch_.flush(fd_.get(), 0);
  }
}

size_t Client::chunk_elems(DataType dt, const Codec* codec) const {
  if (!codec) return settings_.packet / dtype_size(dt);
  // Whole blocks, as many as fit the packet and the header's 16-bit count.
  const size_t block = codec->block_elems(), block_bytes = codec->encoded_size(block);
  // The switch drops a payload longer than the packet: a block that cannot fit would be retransmitted until the
  // switch timeout instead of failing.
  if (block_bytes > settings_.packet)
    throw InvalidArgument("codec '" + codec->name() + "' with algo=switch: one encoded block is " +
                          std::to_string(block_bytes) + " bytes, more than switch_packet=" +
                          std::to_string(settings_.packet) + ": raise switch_packet or use smaller blocks");
  return std::min(settings_.packet / block_bytes, UINT16_MAX / block) * block;
}

void Client::run(const Call& call_args, std::vector<uint8_t>& done, const std::function<std::string()>& peers_lost) {
  {
    std::lock_guard lock(keep_mu_);
    in_call_ = true;
  }
  struct Heard {  // the call's end, however it ends, is when the switches last heard from this rank
    Client& c;
    ~Heard() {
      std::lock_guard lock(c.keep_mu_);
      c.in_call_ = false;
      c.last_heard_ = Clock::now();
    }
  } heard{*this};
  const char* in = call_args.in;
  char* out = call_args.out;
  const size_t count = call_args.count;
  const DataType dt = call_args.dt;
  const ReduceOp op = call_args.op;
  const Codec* codec = call_args.codec;
  const uint8_t share = call_args.share;
  if (codec && share) throw InvalidArgument("reduce_scatter and allgather with algo=switch take no codec; use ring");
  for (size_t j = 0; j < remotes_.size() && share; ++j)
    if (!remotes_[j].owned)
      throw CommError(name(j) + " predates reduce_scatter and allgather through the switch (its join answer does "
                      "not offer owned chunks): upgrade it, or use algo=ring for these");
  if (codec && !(*codec == settings_.codec))
    throw InvalidArgument("codec '" + codec->name() + "' with algo=switch: the job joined its switches with codec '" +
                          settings_.codec.name() + "' (SMARTCOLL_CODEC); a call may use that one or none");
  const size_t esize = dtype_size(dt), per = chunk_elems(dt, codec), total = chunks(call_args),
               per_block = chunks_per_block(call_args), k = remotes_.size();
  // Chunk c is piece c % per_block of block c / per_block: its offset in the block, its length, and where its
  // data comes from and goes (null: this rank sends an empty one, or gets `done` instead of data).
  auto block_of = [&](size_t c) { return static_cast<int>(c / per_block); };
  auto offset = [&](size_t c) { return (c % per_block) * per; };
  auto length = [&](size_t c) { return std::min(per, count - offset(c)); };
  auto source = [&](size_t c) -> const char* {
    if (share == kScatter) return in + (block_of(c) * count + offset(c)) * esize;
    if (share == kGather && block_of(c) != rank_) return nullptr;
    return in + offset(c) * esize;
  };
  auto target = [&](size_t c) -> char* {
    if (!gets_data(share, block_of(c), rank_)) return nullptr;
    return out + ((share == kGather ? block_of(c) * count : 0) + offset(c)) * esize;
  };
  // Encoded once: chunk c is bytes [c, c + 1) x encoded_size(per) (whole blocks encode alike in pieces).
  const size_t enc_per = codec ? codec->encoded_size(per) : 0;
  if (codec) {
    encoded_.resize(codec->encoded_size(count));
    codec->encode(reinterpret_cast<const float*>(in), count, encoded_.data());
  }
  const uint32_t call = call_digest(calls_++, count, dt, op, share);
  const ReduceOp wire_op = op == ReduceOp::avg ? ReduceOp::sum : op;  // avg: the sum, divided here
  const uint32_t window = settings_.window;
  const auto now0 = Clock::now();
  const auto silence = std::chrono::duration_cast<Clock::duration>(Seconds(settings_.switch_timeout));
  const auto stall = std::chrono::duration_cast<Clock::duration>(Seconds(settings_.timeout));
  // Chunk c is the i-th chunk for switch c mod k, with number next_seq + i there.
  std::vector<size_t> next(k);  // the next chunk each switch gets
  std::vector<uint64_t> base(k);
  // A switch's silence counts from the first datagram sent to it after its last answer, or after this loop last
  // stalled (the rank was descheduled: what it sends on resuming must have time to be answered).
  constexpr auto kNever = Clock::time_point::max();
  std::vector<Clock::time_point> asked(k, kNever);
  const auto stalled = std::max<Clock::duration>(silence / 4, std::chrono::milliseconds(200));
  for (size_t j = 0; j < k; ++j) {
    next[j] = j;
    base[j] = remotes_[j].next_seq;
    remotes_[j].pending = false;
    remotes_[j].completed = 0;
    remotes_[j].last_result = now0;
  }
  size_t left = total;
  auto last_result = now0;

  // Queues chunk f.chunk for its slot's port (thread); a retry carries the retransmit flag.
  auto post = [&](Remote& r, Flight& f) {
    const size_t len = length(f.chunk);
    Header h = header(Type::contribution);
    if (f.tries) h.flags |= kRetransmit;
    h.flags |= share | (share && block_of(f.chunk) == rank_ ? kOwner : 0);
    h.dtype = dt;
    h.seq = f.seq;
    h.slot = static_cast<uint32_t>(f.seq % window);
    f.sent_no = ++r.sends[h.slot % r.threads];
    h.call = call;
    h.count = static_cast<uint16_t>(len);
    h.op = wire_op;
    h.codec = codec ? kEncoded : 0;
    const void* payload = codec ? static_cast<const void*>(encoded_.data() + f.chunk * enc_per) : source(f.chunk);
    const size_t bytes = codec ? codec->encoded_size(len) : payload ? len * esize : 0;
    write_header(h, key_, payload, bytes, f.header);
    auto& first = asked[static_cast<size_t>(&r - remotes_.data())];
    first = std::min(first, f.sent);
    sockaddr_in to = r.addr;
    to.sin_port = htons(static_cast<uint16_t>(r.ep.port + h.slot % r.threads));
    if (batch_.full()) batch_.flush(fd_.get());
    batch_.add(to, f.header, kHeaderBytes, payload, bytes);
  };
  const double max_rto = std::min(0.25, settings_.switch_timeout / 4);
  auto rto = [&](const Remote& r, const Flight& f) {
    // A chunk the switch has acknowledged waits for slower ranks: it is only asked about now and then, to be
    // told again or to get a result that was lost. Otherwise TCP's estimate (RFC 6298: srtt + 4 rttvar),
    // doubled per retry: at least 40 ms, so that a rank descheduled for a moment (all others then wait for
    // it) does not make every chunk in flight go twice; at most a quarter of switch_timeout, so that a live
    // switch answers well before it could look silent.
    if (f.acked) return max_rto;
    const double base_s = r.srtt > 0 ? r.srtt + 4 * r.rttvar : 0.05;
    return std::clamp(base_s * static_cast<double>(1u << std::min(f.tries, 6)), std::min(0.04, max_rto), max_rto);
  };

  // One datagram from the network: a result, or news of a chunk still waiting.
  auto take = [&](size_t i, Clock::time_point now) {
    const int j = switch_of(inbox_.from(i));
    if (j < 0) return;  // not from a switch of this job: ignored
    const Parsed got = parse(inbox_.data(i), inbox_.len(i));
    if (!got.ok() || got.pkt.h.job != job_ || !authentic(got.pkt, inbox_.data(i), key_, settings_.full_auth))
      return;
    Remote& r = remotes_[static_cast<size_t>(j)];
    asked[static_cast<size_t>(j)] = kNever;
    const Header& h = got.pkt.h;
    if (h.slot >= window) return;
    Flight& f = r.flights[h.slot];
    if (!f.busy || f.seq != h.seq) return;  // an answer to a chunk already done (a duplicate)
    if (h.type == Type::error) {
      ErrorBody e;
      std::memcpy(&e, got.pkt.payload, sizeof e);
      throw CommError(name(static_cast<size_t>(j)) + " received another call from rank " +
                      std::to_string(e.first_rank) + " for the same chunk: ranks disagree on this allreduce "
                      "(count, dtype or op), or call collectives in different orders");
    }
    if (h.type == Type::pending) {
      std::memcpy(r.waiting.data(), got.pkt.payload, r.waiting.size());
      r.pending = true;
      f.acked = true;
      return;
    }
    char* dst = target(f.chunk);
    if (h.type == Type::done) {
      if (dst || h.call != call) return;  // cannot be ours: this rank waits for data
    } else {
      const size_t len = length(f.chunk);
      if (h.type != Type::result || !dst || h.count != len || h.dtype != dt || h.call != call ||
          h.codec != (codec ? kEncoded : 0) || got.pkt.payload_len != payload_bytes(h, settings_.codec))
        return;  // cannot be ours: never used
      if (codec)
        codec->decode(got.pkt.payload, len, reinterpret_cast<float*>(dst));
      else
        std::memcpy(dst, got.pkt.payload, len * esize);
      if (op == ReduceOp::avg) scale_divide(dt, dst, len, world_);
    }
    if (f.tries == 0) {  // Karn: only first transmissions time the round trip
      const double sample = Seconds(now - f.sent).count();
      if (r.srtt == 0) {
        r.srtt = sample;
        r.rttvar = sample / 2;
      } else {
        r.rttvar = 0.75 * r.rttvar + 0.25 * std::abs(r.srtt - sample);
        r.srtt = 0.875 * r.srtt + 0.125 * sample;
      }
    }
    uint64_t& newest = r.newest_done[h.slot % r.threads];
    newest = std::max(newest, f.sent_no);
    f.busy = false;
    done[f.chunk] = 1;
    --left;
    ++r.completed;
    r.last_result = last_result = now;
  };

  double wait_s = 0.05;
  // Asking costs a round trip to the store: only once no result has come for half of switch_timeout (a rank
  // that lost the switch says so after a whole one), then less and less often, at most switch_timeout / 2 apart.
  Clock::time_point next_ask{};
  Clock::duration ask_gap{};
  auto last_turn = now0;
  while (left > 0) {
    auto now = Clock::now();
    // New chunks, into the slots that are free, in order per switch.
    for (size_t j = 0; j < k; ++j) {
      Remote& r = remotes_[j];
      while (next[j] < total) {
        const uint64_t seq = base[j] + next[j] / k;
        Flight& f = r.flights[seq % window];
        if (f.busy) break;
        f = Flight{true, seq, next[j], now, 0, r.completed, false, 0, {}};
        post(r, f);
        next[j] += k;
      }
    }
    batch_.flush(fd_.get());
    // Wait for answers (at most until a retransmission is due), then take everything that is waiting, so that no
    // chunk whose result has already arrived looks overdue.
    pollfd p{fd_.get(), POLLIN, 0};
    ::poll(&p, 1, std::max(1, static_cast<int>(wait_s * 1000)));
    for (int round = 0; round < 256; ++round) {
      const size_t n = inbox_.receive(fd_.get());
      if (n == 0) break;
      now = Clock::now();
      for (size_t i = 0; i < n; ++i) take(i, now);
    }
    now = Clock::now();
    if (now - last_turn > stalled) std::fill(asked.begin(), asked.end(), kNever);
    last_turn = now;
    // Chunks whose result is overdue go again: when the switch has sent nothing for a while (the chunk or its
    // result may be lost), or when more chunks of this switch finished since it was sent than there are slots,
    // so that some sent after it finished before it (it was lost while others went through). Without waiting
    // for the timeout (fast retransmit, as TCP's on duplicate acks): when the results of `slack` chunks sent
    // after it to the same switch thread came back first, it or its result was lost.
    constexpr uint64_t slack = 8;
    wait_s = 0.05;
    for (size_t j = 0; j < k; ++j) {
      Remote& r = remotes_[j];
      for (Flight& f : r.flights) {
        if (!f.busy) continue;
        const double timeout_s = rto(r, f);
        const double due = timeout_s - Seconds(now - f.sent).count();
        const bool overtaken = r.completed - f.completed_at_send > window + 8;
        const bool passed = !f.acked && r.newest_done[f.seq % window % r.threads] > f.sent_no + slack;
        if (passed || (due <= 0 && (overtaken || Seconds(now - r.last_result).count() >= timeout_s))) {
          ++f.tries;
          f.sent = now;
          f.completed_at_send = r.completed;
          post(r, f);
          wait_s = std::min(wait_s, rto(r, f));
        } else {
          wait_s = std::min(wait_s, std::max(due, 0.001));
        }
      }
    }
    batch_.flush(fd_.get());
    for (size_t j = 0; j < k; ++j) {
      const bool busy = std::any_of(remotes_[j].flights.begin(), remotes_[j].flights.end(),
                                    [](const Flight& f) { return f.busy; });
      if (busy && asked[j] != kNever && now - asked[j] > silence)
        throw SwitchGone(name(j) + " stopped answering: nothing for " + log::seconds(settings_.switch_timeout) +
                         " (SMARTCOLL_SWITCH_TIMEOUT) while chunks were waiting for their results");
    }
    if (peers_lost && now - last_result >= silence / 2 && now >= next_ask) {
      ask_gap = next_ask < last_result ? silence / 8 : std::min(ask_gap * 2, silence / 2);  // a result: afresh
      next_ask = now + ask_gap;
      if (std::string who = peers_lost(); !who.empty()) throw PeerLostSwitch(who);
    }
    if (now - last_result > stall) {
      std::string who;
      for (size_t j = 0; j < k; ++j) {
        const std::string missing = ranks_missing(remotes_[j].waiting, world_, settings_.ranks);
        if (remotes_[j].pending && !missing.empty()) who += "; " + name(j) + " still waits for rank(s) " + missing;
      }
      throw CommError("allreduce through the switch made no progress for " + log::seconds(settings_.timeout) + (who.empty() ? "" : who) +
                      ": a rank died, stalled or did not make this call (SMARTCOLL_TIMEOUT)");
    }
  }
  for (size_t j = 0; j < k; ++j) remotes_[j].next_seq = base[j] + (total > j ? (total - j + k - 1) / k : 0);
}

}  // namespace smartcoll::sw
