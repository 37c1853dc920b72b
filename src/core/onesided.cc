#include "core/onesided.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <random>

#include "core/checks.h"
#include "core/frame.h"
#include "core/log.h"

namespace smartcoll::rma {

namespace {

using Clock = net::Clock;
constexpr auto kHelloDeadline = std::chrono::seconds(5);
constexpr size_t kDiscard = 64 * 1024;  // a refused payload is read and dropped in pieces this large

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// A message's bytes as a list of buffers, and how far they have moved.
struct Cursor {
  std::vector<iovec> segs;
  size_t seg = 0, off = 0;
  bool done() const { return seg == segs.size(); }
  int fill(iovec* iov) {
    int n = 0;
    for (size_t k = seg; k < segs.size() && n < kMaxIov; ++k) {
      const size_t skip = k == seg ? off : 0;
      iov[n++] = {static_cast<char*>(segs[k].iov_base) + skip, segs[k].iov_len - skip};
    }
    return n;
  }
  void advance(size_t n) {
    while (seg < segs.size()) {
      const size_t left = segs[seg].iov_len - off;
      if (n < left) {
        off += n;
        return;
      }
      n -= left;
      ++seg;
      off = 0;
    }
  }
  // Skips empty buffers at the front, so that done() tells whether any byte is still to come.
  void settle() { advance(0); }
};

struct Out {
  std::vector<char> head, body;
  Cursor at;
  std::shared_ptr<Service::Call> call;  // a request: keeps its local buffers' list alive
};

// The local buffers' bytes, one after the other, into `out`; and back.
void from_local(std::span<const LocalPiece> local, char* out) {
  for (const LocalPiece& p : local) {
    if (p.bytes) std::memcpy(out, p.data, p.bytes);
    out += p.bytes;
  }
}

void to_local(const char* in, std::span<const LocalPiece> local) {
  for (const LocalPiece& p : local) {
    if (p.bytes) std::memcpy(p.data, in, p.bytes);
    in += p.bytes;
  }
}

// The pieces as they lie one after the other in the local buffers.
std::vector<RemotePiece> packed(std::span<const RemotePiece> pieces) {
  std::vector<RemotePiece> out;
  uint64_t at = 0;
  for (const RemotePiece& p : pieces) {
    out.push_back({at, p.bytes});
    at += p.bytes;
  }
  return out;
}

std::vector<char> head_bytes(const Header& h, std::span<const RemotePiece> pieces = {}) {
  std::vector<char> b(sizeof h + pieces.size_bytes());
  std::memcpy(b.data(), &h, sizeof h);
  if (!pieces.empty()) std::memcpy(b.data() + sizeof h, pieces.data(), pieces.size_bytes());
  return b;
}

}  // namespace

struct Service::Region {
  Region(uint64_t i, char* b, uint64_t n, DataType d) : id(i), base(b), bytes(n), dtype(d) {}
  const uint64_t id;
  char* const base;
  const uint64_t bytes;
  const DataType dtype;
  std::mutex mu;  // held while copying from or into the buffer
  bool alive = true;
};

struct Service::Call {
  std::string name;  // "getv #3 on rank 0 to rank 1"
  int peer = 0;
  Header head;
  std::vector<RemotePiece> pieces;
  std::vector<LocalPiece> local;
  std::optional<Codec> codec;
  std::vector<char> encoded;  // a put's or accumulate's payload under a codec
  std::shared_ptr<Request> req;
};

struct Service::Conn {
  net::Fd fd;
  int peer = -1;
  bool outgoing = false;  // this rank connected: it initiates on this channel, the peer answers
  bool closed = false;
  Clock::time_point last = Clock::now();
  // The message coming in: its header (stage 0), pieces table (1), payload (2).
  int stage = 0;
  size_t got = 0;
  Header h{};
  std::vector<RemotePiece> pieces;
  Cursor into;
  uint64_t discard = 0;  // refused payload bytes still to drop
  std::vector<char> staging;
  std::string refused;              // target: why the request in hand is refused
  std::optional<Codec> codec;       // target: the codec of the request in hand
  std::shared_ptr<Region> region;   // target: the region it is for
  std::shared_ptr<Call> call;       // initiator: the call the answer in hand is for
  std::deque<Out> out;
  std::map<uint64_t, std::shared_ptr<Call>> waiting;  // initiator: sent or queued, not answered
};

// A connection accepted whose hello has not fully arrived.
struct Service::Accepting {
  net::Fd fd;
  Clock::time_point since;
  Hello hello{};
  size_t got = 0;
};

Service::Service(const Settings& settings, std::shared_ptr<Store> store)
    : s_(settings), store_(std::move(store)), connected_(static_cast<size_t>(settings.size), false),
      last_close_(static_cast<size_t>(settings.size)), to_peer_(static_cast<size_t>(settings.size), nullptr) {
  listener_ = net::listen_on(s_.host.empty() ? "127.0.0.1" : s_.host, 0, 1024);
  net::set_nonblocking(listener_.get(), true);
  epfd_ = net::Fd(epoll_create1(EPOLL_CLOEXEC));
  wakefd_ = net::Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!epfd_ || !wakefd_)
    throw CommError("cannot create the one-sided server's epoll or eventfd: " + std::string(std::strerror(errno)));
  for (int fd : {listener_.get(), wakefd_.get()}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, fd, &ev);
  }
  std::random_device entropy;  // getrandom(2)
  char hex[33];
  for (size_t i = 0; i < sizeof token_; ++i) {
    token_[i] = static_cast<uint8_t>(entropy());
    std::snprintf(hex + 2 * i, 3, "%02x", token_[i]);
  }
  store_->set("rma/" + std::to_string(s_.rank), (s_.host.empty() ? "127.0.0.1" : s_.host) + ":" +
                                                    std::to_string(net::bound_port(listener_.get())) + " " + hex);
  thread_ = std::thread([this] { run(); });
}

Service::~Service() {
  stop_ = true;
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wakefd_.get(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

uint64_t Service::add(void* base, size_t bytes, DataType dtype) {
  require(base || bytes == 0, "register: a null buffer of " + std::to_string(bytes) + " bytes");
  std::lock_guard lock(regions_mu_);
  const uint64_t id = next_region_++;
  regions_[id] = std::make_shared<Region>(id, static_cast<char*>(base), bytes, dtype);
  return id;
}

void Service::remove(uint64_t id) {
  std::shared_ptr<Region> r;
  {
    std::lock_guard lock(regions_mu_);
    auto it = regions_.find(id);
    require(it != regions_.end(), "deregister: region " + std::to_string(id) + (id > 0 && id < next_region_
                                      ? " was deregistered already" : " was never registered on this rank"));
    r = std::move(it->second);
    regions_.erase(it);
  }
  std::lock_guard lock(r->mu);  // a copy in progress finishes first; none starts after
  r->alive = false;
}

std::shared_ptr<Service::Region> Service::find(uint64_t id, std::string& why) {
  std::lock_guard lock(regions_mu_);
  if (auto it = regions_.find(id); it != regions_.end()) return it->second;
  why = id > 0 && id < next_region_ ? "region " + std::to_string(id) + " was deregistered"
                                    : "rank " + std::to_string(s_.rank) + " has no region " + std::to_string(id) +
                                          " (it has registered " + std::to_string(next_region_ - 1) + ")";
  return nullptr;
}

std::shared_ptr<Request> Service::post(Kind kind, const RemoteRegion& region, std::span<const RemotePiece> pieces,
                                       std::span<const LocalPiece> local, ReduceOp op,
                                       const std::optional<Codec>& codec) {
  const std::string what = kind_name(static_cast<uint8_t>(kind));
  require(region.rank >= 0 && region.rank < s_.size, what + ": rank " + std::to_string(region.rank) +
                                                         " is outside the world of size " + std::to_string(s_.size));
  size_t local_bytes = 0;
  for (size_t i = 0; i < local.size(); ++i) {
    require(local[i].data || local[i].bytes == 0,
            what + ": local buffer " + std::to_string(i) + " is null but has " + std::to_string(local[i].bytes) +
                " bytes");
    local_bytes += local[i].bytes;
  }
  check_call(kind, region, pieces, local_bytes, op, codec);
  require(!stop_, "the communicator is closed");
  auto call = std::make_shared<Call>();
  call->peer = region.rank;
  call->head.kind = static_cast<uint8_t>(kind);
  call->head.dtype = static_cast<uint8_t>(region.dtype);
  call->head.op = static_cast<uint8_t>(op);
  call->head.npieces = static_cast<uint32_t>(pieces.size());
  call->head.id = next_call_++;
  call->head.region = region.id;
  set_codec(call->head, codec);
  call->head.payload = kind == Kind::get ? 0 : wire_bytes(pieces, codec);
  call->pieces.assign(pieces.begin(), pieces.end());
  call->local.assign(local.begin(), local.end());
  call->codec = codec;
  if (codec && kind != Kind::get) {
    // The local buffers hold the pieces one after the other: encode each piece from their concatenation.
    std::vector<char> raw(local_bytes);
    from_local(local, raw.data());
    call->encoded.resize(call->head.payload);
    gather(raw.data(), packed(pieces), call->encoded.data(), codec);
  }
  call->name = what + " #" + std::to_string(call->head.id) + " on rank " + std::to_string(s_.rank) + " to rank " +
               std::to_string(region.rank) + " (region " + std::to_string(region.id) + ")";
  call->req = std::make_shared<Request>();
  connect(region.rank);
  {
    std::lock_guard lock(mu_);
    new_calls_.push_back(call);
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wakefd_.get(), &one, sizeof one);
  return call->req;
}

void Service::connect(int peer) {
  std::lock_guard cl(connect_mu_);
  {
    std::lock_guard lock(mu_);
    if (connected_[static_cast<size_t>(peer)]) return;
    // A channel closes when its peer left, stalled or sent garbage: that peer is not tried again.
    const std::string& why = last_close_[static_cast<size_t>(peer)];
    if (!why.empty()) throw CommError(why + "; one-sided calls to rank " + std::to_string(peer) + " fail from now on");
  }
  const auto limit = millis(s_.connect_timeout);
  std::string addr;
  try {
    addr = store_->get("rma/" + std::to_string(peer), limit);
  } catch (const CommError&) {
    throw CommError("rank " + std::to_string(peer) + " serves no one-sided operations: it registered no region " +
                    "within " + std::to_string(limit.count() / 1000) + " s (a target registers its regions " +
                    "before peers call it; SMARTCOLL_CONNECT_TIMEOUT)");
  }
  // "host:port token" (32 hex digits)
  const auto colon = addr.rfind(':'), space = addr.find(' ');
  const long port = colon == std::string::npos ? 0 : std::strtol(addr.c_str() + colon + 1, nullptr, 10);
  const std::string hex = space == std::string::npos ? "" : addr.substr(space + 1);
  if (port <= 0 || port > 65535 || space < colon || hex.size() != 32 ||
      hex.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw CommError("malformed one-sided address '" + addr + "' in the store");
  Hello h{kHelloMagic, static_cast<uint32_t>(s_.rank), static_cast<uint32_t>(s_.size), kVersion, s_.job, {}};
  for (size_t i = 0; i < sizeof h.token; ++i)
    h.token[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  const auto deadline = Clock::now() + limit;
  net::Fd fd = net::connect_to({addr.substr(0, colon), static_cast<uint16_t>(port)}, deadline);
  net::send_all(fd.get(), &h, sizeof h, deadline, "one-sided hello to rank " + std::to_string(peer));
  net::set_nonblocking(fd.get(), true);
  net::set_nodelay(fd.get());
  net::set_buffer_sizes(fd.get(), s_.sockbuf);
  std::lock_guard lock(mu_);
  new_conns_.emplace_back(peer, std::move(fd));
  connected_[static_cast<size_t>(peer)] = true;
}

void Service::take_inbox() {
  std::vector<std::pair<int, net::Fd>> conns;
  std::vector<std::shared_ptr<Call>> calls;
  {
    std::lock_guard lock(mu_);
    conns.swap(new_conns_);
    calls.swap(new_calls_);
  }
  for (auto& [peer, fd] : conns) {
    auto c = std::make_unique<Conn>();
    c->fd = std::move(fd);
    c->peer = peer;
    c->outgoing = true;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    ev.data.fd = c->fd.get();
    epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, c->fd.get(), &ev);
    to_peer_[static_cast<size_t>(peer)] = c.get();
    conns_.push_back(std::move(c));
  }
  for (auto& call : calls) {
    Conn* c = to_peer_[static_cast<size_t>(call->peer)];
    if (!c || stop_) {
      std::string why;
      {
        std::lock_guard lock(mu_);
        why = last_close_[static_cast<size_t>(call->peer)];
      }
      call->req->finish(call->name + ": " + (stop_ ? "the communicator was closed" : why));
      continue;
    }
    Out o;
    o.head = head_bytes(call->head, call->pieces);
    o.at.segs.push_back({o.head.data(), o.head.size()});
    if (!call->encoded.empty())
      o.at.segs.push_back({call->encoded.data(), call->encoded.size()});
    else if (static_cast<Kind>(call->head.kind) != Kind::get)
      for (const LocalPiece& p : call->local) o.at.segs.push_back({p.data, p.bytes});
    o.call = call;
    if (c->waiting.empty()) c->last = Clock::now();  // the answer's clock starts now, not at the last answer
    c->waiting[call->head.id] = call;
    c->out.push_back(std::move(o));
  }
}

void Service::accept_all() {
  for (;;) {
    net::Fd s(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!s) break;
    net::set_nodelay(s.get());
    net::set_buffer_sizes(s.get(), s_.sockbuf);
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    ev.data.fd = s.get();
    epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, s.get(), &ev);
    accepting_.push_back(std::make_unique<Accepting>(Accepting{std::move(s), Clock::now()}));
  }
  const auto now = Clock::now();
  std::erase_if(accepting_, [&](std::unique_ptr<Accepting>& ap) {
    Accepting& a = *ap;
    auto* h = reinterpret_cast<char*>(&a.hello);
    const ssize_t n = ::recv(a.fd.get(), h + a.got, sizeof(Hello) - a.got, MSG_DONTWAIT);
    if (n > 0) a.got += static_cast<size_t>(n);
    const bool broken = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    if (a.got < sizeof(Hello)) {
      if (!broken && now - a.since <= kHelloDeadline) return false;
      SC_LOG(LogLevel::warn, s_.rank, "") << "one-sided: dropped a connection that sent no valid hello";
      return true;
    }
    const std::string why = hello_refusal(a.hello, s_.size, s_.job, token_);
    if (!why.empty()) {
      SC_LOG(LogLevel::warn, s_.rank, "") << "one-sided: refused a connection: " << why;
      return true;
    }
    auto c = std::make_unique<Conn>();
    c->fd = std::move(a.fd);
    c->peer = static_cast<int>(a.hello.rank);
    conns_.push_back(std::move(c));
    return true;
  });
}

void Service::close(Conn& c, const std::string& why) {
  if (c.closed) return;
  c.closed = true;
  c.fd.reset();  // leaves the epoll set with it
  c.out.clear();
  c.region.reset();
  if (!c.outgoing) {
    // An initiator that leaves closes its channel: worth a warning only when what it sent was malformed.
    SC_LOG(why.starts_with("malformed") ? LogLevel::warn : LogLevel::debug, s_.rank, "")
        << "one-sided: closed the channel from rank " << c.peer << ": " << why;
    return;
  }
  to_peer_[static_cast<size_t>(c.peer)] = nullptr;
  {
    std::lock_guard lock(mu_);
    connected_[static_cast<size_t>(c.peer)] = false;
    last_close_[static_cast<size_t>(c.peer)] = why;
  }
  const size_t n = c.waiting.size();
  for (auto& [id, call] : c.waiting)
    call->req->finish(call->name + ": " + why + " (" + std::to_string(n) + " call" + (n == 1 ? "" : "s") +
                      " outstanding)");
  c.waiting.clear();
}

void Service::progress(Conn& c) {
  receive(c);
  if (!c.closed) send(c);
  if (!c.closed && c.outgoing && !c.waiting.empty() &&
      Clock::now() - c.last > std::chrono::duration<double>(s_.timeout))
    close(c, "no answer from rank " + std::to_string(c.peer) + " for " + std::to_string(s_.timeout) +
                 " s; is it alive? (SMARTCOLL_TIMEOUT)");
}

void Service::send(Conn& c) {
  while (!c.out.empty()) {
    Out& o = c.out.front();
    iovec iov[kMaxIov];
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(o.at.fill(iov));
    const ssize_t n = ::sendmsg(c.fd.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        close(c, "the one-sided channel to rank " + std::to_string(c.peer) + " broke while sending: " +
                     std::strerror(errno));
      return;
    }
    c.last = Clock::now();
    o.at.advance(static_cast<size_t>(n));
    if (o.at.done()) c.out.pop_front();
  }
}

void Service::receive(Conn& c) {
  static thread_local char drop[kDiscard];
  const std::string from = "rank " + std::to_string(c.peer);
  for (;;) {
    // Take each finished part of the message first: the next one may need no bytes at all.
    if (c.stage == 0 && c.got == sizeof(Header)) {
      if (std::string why = malformed(c.h, !c.outgoing); !why.empty())
        return close(c, "malformed one-sided message from " + from + ": " + why);
      c.stage = 1;
      c.got = 0;
      if (c.outgoing) {
        auto it = c.waiting.find(c.h.id);
        if (it == c.waiting.end())
          return close(c, "malformed one-sided message from " + from + ": an answer to no outstanding call (id " +
                              std::to_string(c.h.id) + ")");
        c.call = it->second;
        const auto kind = static_cast<Kind>(c.h.kind);
        const auto asked = static_cast<Kind>(c.call->head.kind);
        const uint64_t want = wire_bytes(c.call->pieces, c.call->codec);
        if (kind == Kind::data && (asked != Kind::get || c.h.payload != want))
          return close(c, "malformed one-sided message from " + from + ": data of " + std::to_string(c.h.payload) +
                              " bytes for " + c.call->name);
        if (kind == Kind::done && asked == Kind::get)
          return close(c, "malformed one-sided message from " + from + ": 'done' for " + c.call->name);
        c.into = {};
        if (kind == Kind::data && !c.call->codec) {
          for (const LocalPiece& p : c.call->local) c.into.segs.push_back({p.data, p.bytes});
        } else if (kind != Kind::done) {  // an error's text, or encoded pieces to decode
          c.staging.assign(c.h.payload, 0);
          c.into.segs.push_back({c.staging.data(), c.staging.size()});
        }
        c.into.settle();
        c.stage = 2;
      } else {
        c.pieces.resize(c.h.npieces);
      }
      continue;
    }
    if (c.stage == 1 && c.got == c.pieces.size() * sizeof(RemotePiece)) {
      if (std::string why = malformed_pieces(c.h, c.pieces); !why.empty())
        return close(c, "malformed one-sided message from " + from + ": " + why);
      c.refused.clear();
      c.codec = codec_of(c.h);
      c.region = find(c.h.region, c.refused);
      if (c.region) c.refused = refusal(c.h, c.pieces, {c.region->id, c.region->bytes, c.region->dtype});
      c.into = {};
      c.discard = 0;
      if (!c.refused.empty()) {
        c.discard = c.h.payload;
      } else if (c.h.payload) {
        c.staging.resize(c.h.payload);
        c.into.segs.push_back({c.staging.data(), c.staging.size()});
      }
      c.stage = 2;
      continue;
    }
    if (c.stage == 2 && c.into.done() && c.discard == 0) {
      c.outgoing ? answer(c) : serve(c);
      if (c.closed) return;
      c.stage = 0;
      c.got = 0;
      continue;
    }
    iovec iov[kMaxIov];
    int n_iov = 1;
    if (c.stage == 0)
      iov[0] = {reinterpret_cast<char*>(&c.h) + c.got, sizeof(Header) - c.got};
    else if (c.stage == 1)
      iov[0] = {reinterpret_cast<char*>(c.pieces.data()) + c.got, c.pieces.size() * sizeof(RemotePiece) - c.got};
    else if (c.discard)
      iov[0] = {drop, static_cast<size_t>(std::min<uint64_t>(c.discard, kDiscard))};
    else
      n_iov = c.into.fill(iov);
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(n_iov);
    const ssize_t n = ::recvmsg(c.fd.get(), &m, MSG_DONTWAIT);
    if (n == 0)
      return close(c, "the one-sided channel to " + from + " was closed by that rank (it exited, crashed or " +
                          "closed its communicator)");
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        close(c, "the one-sided channel to " + from + " broke while receiving: " + std::strerror(errno));
      return;
    }
    c.last = Clock::now();
    if (c.stage < 2)
      c.got += static_cast<size_t>(n);
    else if (c.discard)
      c.discard -= static_cast<uint64_t>(n);
    else
      c.into.advance(static_cast<size_t>(n));
  }
}

void Service::serve(Conn& c) {
  Header a;
  a.id = c.h.id;
  Out o;
  std::string why = c.refused;
  if (why.empty()) {
    std::lock_guard lock(c.region->mu);
    if (!c.region->alive) {
      why = "region " + std::to_string(c.region->id) + " was deregistered";
    } else if (static_cast<Kind>(c.h.kind) == Kind::get) {
      o.body.resize(wire_bytes(c.pieces, c.codec));
      gather(c.region->base, c.pieces, o.body.data(), c.codec);
    } else {
      scatter(c.region->base, c.pieces, c.staging.data(), c.h, c.codec);
    }
  }
  if (!why.empty()) {
    o.body.assign(why.begin(), why.begin() + static_cast<ptrdiff_t>(std::min<size_t>(why.size(), kMaxErrorText)));
    a.kind = static_cast<uint8_t>(Kind::error);
  } else {
    a.kind = static_cast<uint8_t>(static_cast<Kind>(c.h.kind) == Kind::get ? Kind::data : Kind::done);
  }
  a.payload = o.body.size();
  o.head = head_bytes(a);
  o.at.segs.push_back({o.head.data(), o.head.size()});
  if (!o.body.empty()) o.at.segs.push_back({o.body.data(), o.body.size()});
  c.out.push_back(std::move(o));
  c.region.reset();
  if (c.staging.capacity() > (size_t{1} << 20)) std::vector<char>().swap(c.staging);
}

void Service::answer(Conn& c) {
  std::shared_ptr<Call> call = std::move(c.call);
  c.waiting.erase(c.h.id);
  if (static_cast<Kind>(c.h.kind) == Kind::error) {
    call->req->finish(call->name + ": rank " + std::to_string(c.peer) + " refused it: " +
                      std::string(c.staging.begin(), c.staging.end()));
  } else {
    if (static_cast<Kind>(c.h.kind) == Kind::data && call->codec) {
      // Decode each piece into the concatenation of the local buffers (the scatter half of the codec's work).
      std::vector<char> raw(wire_bytes(call->pieces, std::nullopt));
      const Header put_like = [&] {
        Header h = call->head;
        h.kind = static_cast<uint8_t>(Kind::put);
        return h;
      }();
      scatter(raw.data(), packed(call->pieces), c.staging.data(), put_like, call->codec);
      to_local(raw.data(), call->local);
    }
    call->req->finish("");
  }
  if (c.waiting.empty()) c.last = Clock::now();
}

void Service::run() {
  while (!stop_) {
    bool waiting = false;
    for (auto& c : conns_) waiting |= !c->waiting.empty();
    epoll_event events[64];
    epoll_wait(epfd_.get(), events, 64, waiting || !accepting_.empty() ? 50 : 1000);
    uint64_t count;
    [[maybe_unused]] ssize_t r = ::read(wakefd_.get(), &count, sizeof count);
    take_inbox();
    accept_all();
    for (auto& c : conns_) {
      try {
        progress(*c);
      } catch (const std::exception& e) {  // a staging buffer the memory cannot hold: that channel goes, not the rank
        close(*c, std::string("the one-sided server dropped the channel: ") + e.what());
      }
    }
    std::erase_if(conns_, [](const std::unique_ptr<Conn>& c) { return c->closed; });
  }
  for (auto& c : conns_) close(*c, "the communicator was closed");
  take_inbox();  // calls posted meanwhile fail, naming the reason
  conns_.clear();
  accepting_.clear();
}

}  // namespace smartcoll::rma
