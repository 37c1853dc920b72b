#include "transport/tcp.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "core/log.h"
#include "smartcoll/types.h"

namespace smartcoll {

namespace {

constexpr auto kHelloDeadline = std::chrono::seconds(5);
// A peer that refuses connections this long at the address it published has closed its listener.
constexpr auto kRefusedFor = std::chrono::seconds(2);

std::string listen_host(const Config& c, const std::string& route_hint) {
  if (!c.addr.empty()) return net::resolve_ipv4(c.addr);
  if (!c.ifname.empty()) return net::interface_address(c.ifname);
  return route_hint.empty() ? "127.0.0.1" : net::local_address_towards(route_hint);
}

net::Endpoint parse_endpoint(const std::string& s) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos) throw CommError("malformed address '" + s + "' in the rendezvous store");
  const long port = std::strtol(s.c_str() + colon + 1, nullptr, 10);
  if (port <= 0 || port > 65535) throw CommError("malformed port in address '" + s + "' in the rendezvous store");
  return {s.substr(0, colon), static_cast<uint16_t>(port)};
}

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

}  // namespace

uint64_t job_fingerprint(const std::string& job_id) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a: it identifies a job, it does not authenticate one
  for (unsigned char c : job_id) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

std::string hello_refusal(const Hello& h, int rank, int size, int streams, uint64_t job) {
  if (h.magic != kHelloMagic) return "not a smartcoll hello, or another version (magic " + std::to_string(h.magic) + ")";
  if (h.job != job) return "it belongs to another job (a different job id)";
  if (h.size != static_cast<uint32_t>(size))
    return "it has world size " + std::to_string(h.size) + ", this job " + std::to_string(size) +
           ": ranks disagree on WORLD_SIZE";
  if (h.rank <= static_cast<uint32_t>(rank) || h.rank >= static_cast<uint32_t>(size))
    return "rank " + std::to_string(h.rank) + " may not connect to rank " + std::to_string(rank);
  if (h.stream >= static_cast<uint32_t>(streams))
    return "stream " + std::to_string(h.stream) + " of " + std::to_string(streams);
  return "";
}

struct TcpTransport::Pending {
  net::Fd fd;
  bool local;  // came through the Unix socket
  net::Clock::time_point since;
  Hello hello{};
  size_t got = 0;
};

TcpTransport::TcpTransport(int rank, int size, std::shared_ptr<Store> store, const Config& config,
                           const std::string& route_hint, const std::string& claim)
    : Transport(rank, size, config.streams), store_(std::move(store)), config_(config), job_(job_fingerprint(config.job_id)),
      chans_(new Channel[static_cast<size_t>(size) * config.streams]), addrs_(size), local_peer_(new std::atomic<bool>[static_cast<size_t>(size)]{}) {
  timeout = std::chrono::duration<double>(config.timeout);
  if (size == 1) return;
  net::raise_descriptor_limit();
  const std::string host = listen_host(config, route_hint);
  listener_ = net::listen_on(host, 0, 4096);
  net::set_nonblocking(listener_.get(), true);
  addrs_[rank] = host + ":" + std::to_string(net::bound_port(listener_.get()));
  if (config.unix_sockets && !claim.empty()) {
    try {
      local_listener_ = net::listen_abstract(net::job_socket_name(job_, rank, claim), 4096);
      net::set_nonblocking(local_listener_.get(), true);
    } catch (const CommError& e) {  // peers on this host then connect over TCP, as they do to other hosts
      SC_LOG(LogLevel::warn, rank, "") << e.what() << "; peers on this host connect over TCP";
    }
  }
  store_->set("addr/" + std::to_string(rank) + "/" + claim, addrs_[rank]);
}

TcpTransport::~TcpTransport() = default;

void TcpTransport::watch(int stream, int fd) {
  // Edge-triggered: the owner tries its I/O until it would block before it sleeps, so no edge is missed.
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  ev.data.fd = fd;
  if (epoll_ctl(epfds_[static_cast<size_t>(stream) % epfds_.size()], EPOLL_CTL_ADD, fd, &ev) != 0)
    throw CommError("epoll_ctl(channel) failed: " + std::string(std::strerror(errno)));
}

void TcpTransport::attach(std::vector<int> epoll_fds) {
  std::lock_guard lock(mu_);
  epfds_ = std::move(epoll_fds);
  // Channels opened before the engine existed (the same-host probe at start-up) join their owner's set too:
  // otherwise their owner would only notice their data when its sleep times out.
  for (int p = 0; p < size(); ++p)
    for (int s = 0; s < streams(); ++s)
      if (chan(p, s).fd.load() >= 0) watch(s, chan(p, s).fd.load());
  for (const net::Fd* l : {&listener_, &local_listener_}) {
    if (!*l) continue;
    for (int ep : epfds_) {
      // Level-triggered: whichever worker wakes first accepts; the others find nothing left.
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = l->get();
      if (epoll_ctl(ep, EPOLL_CTL_ADD, l->get(), &ev) != 0)
        throw CommError("epoll_ctl(listener) failed: " + std::string(std::strerror(errno)));
    }
  }
}

int TcpTransport::open_channels() const {
  int n = 0;
  for (int i = 0; i < size() * streams(); ++i) n += chans_[i].fd.load() >= 0;
  return n;
}

void TcpTransport::install(int peer, int stream, net::Fd fd, bool local) {
  net::set_nonblocking(fd.get(), true);
  net::set_buffer_sizes(fd.get(), config_.sockbuf);
  Channel& c = chan(peer, stream);
  if (!epfds_.empty()) watch(stream, fd.get());
  c.fd = fd.get();
  c.owned = std::move(fd);
  local_peer_[static_cast<size_t>(peer)] = local;
  local_channels_ += local;
  SC_LOG(LogLevel::debug, rank(), "") << "connected to rank " << peer << " stream " << stream
                                      << (local ? " (Unix socket)" : "");
}

void TcpTransport::adopt_pending() {
  for (const net::Fd* l : {&listener_, &local_listener_}) {
    const bool local = l == &local_listener_;
    while (*l) {
      net::Fd s(::accept4(l->get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!s) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
          SC_LOG(LogLevel::warn, rank(), "") << "accept failed: " << std::strerror(errno);
        break;
      }
      if (!local) net::set_nodelay(s.get());
      pending_.push_back(std::make_unique<Pending>(Pending{std::move(s), local, net::Clock::now()}));
    }
  }
  // A stranger (a port scanner, a health check) or a silent connection is dropped, never fatal.
  const auto now = net::Clock::now();
  std::erase_if(pending_, [&](std::unique_ptr<Pending>& p) {
    auto* h = reinterpret_cast<char*>(&p->hello);
    ssize_t n = ::recv(p->fd.get(), h + p->got, sizeof(Hello) - p->got, MSG_DONTWAIT);
    if (n > 0) p->got += static_cast<size_t>(n);
    const bool broken = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    if (p->got < sizeof(Hello)) {
      if (broken || now - p->since > kHelloDeadline) {
        SC_LOG(LogLevel::warn, rank(), "") << "dropped a connection that sent no valid hello";
        return true;
      }
      return false;
    }
    const Hello& hello = p->hello;
    std::string refusal = hello_refusal(hello, rank(), size(), streams(), job_);
    if (refusal.empty() && chan(static_cast<int>(hello.rank), static_cast<int>(hello.stream)).fd.load() >= 0)
      refusal = "rank " + std::to_string(hello.rank) + " stream " + std::to_string(hello.stream) + " is connected already";
    if (!refusal.empty()) {
      SC_LOG(LogLevel::warn, rank(), "") << "refused a connection: " << refusal;
      return true;
    }
    install(static_cast<int>(hello.rank), static_cast<int>(hello.stream), std::move(p->fd), p->local);
    return true;
  });
}

void TcpTransport::accept_incoming() {
  std::lock_guard lock(mu_);
  if (!listener_) return;
  if (aborted_)
    turn_away();
  else
    adopt_pending();
}

void TcpTransport::turn_away() {
  // A peer whose connection waits in a backlog sees it close at once, and reads why in the store, instead of
  // waiting for data until its timeout.
  for (const net::Fd* l : {&listener_, &local_listener_})
    while (*l && net::Fd(::accept4(l->get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK))) {
    }
  pending_.clear();
}

std::string TcpTransport::failed_meanwhile(int peer, net::Clock::time_point& last) {
  // Not at the first look (a connection normally comes within milliseconds: thousands of channels opening at
  // start-up ask rank 0's store nothing), then every 500 ms.
  const auto now = net::Clock::now();
  if (last == net::Clock::time_point{}) last = now;
  if (now - last < std::chrono::milliseconds(500)) return "";
  last = now;
  try {
    if (auto why = store_->peek("failed/" + std::to_string(peer)))
      return "rank " + std::to_string(peer) + " failed: " + *why;
  } catch (const std::exception&) {  // the store is gone: the timeout decides
  }
  return "";
}

void TcpTransport::say_hello(int fd, int peer, int stream, net::Clock::time_point deadline) const {
  const Hello h{kHelloMagic, static_cast<uint32_t>(rank()), static_cast<uint32_t>(stream),
                static_cast<uint32_t>(size()), job_};
  net::send_all(fd, &h, sizeof h, deadline, "hello to rank " + std::to_string(peer));
}

net::Fd TcpTransport::connect_local(int peer, int stream) {
  // Only after start-up, which names the claim (so the process) each peer's socket belongs to. Another peer's
  // name is absent from this network namespace: connect fails at once and TCP is used.
  if (!local_listener_ || claims_.empty()) return {};
  const auto deadline = net::Clock::now() + millis(config_.connect_timeout);
  const std::string name = net::job_socket_name(job_, peer, claims_.at(static_cast<size_t>(peer)));
  net::Fd s = net::connect_abstract(name, deadline);
  if (s) say_hello(s.get(), peer, stream, deadline);
  return s;
}

bool TcpTransport::connect(int peer, int stream) {
  Channel& c = chan(peer, stream);
  if (c.fd.load() >= 0) return true;
  const auto limit = millis(config_.connect_timeout);
  if (peer > rank()) {
    // A peer that failed before it connected (an abort, a call that failed there) never will: said at once. Not
    // under mu_, and never waiting for the store (another thread may be in a long get there).
    if (std::string why = failed_meanwhile(peer, c.looked); !why.empty())
      throw CommError("rank " + std::to_string(peer) + " did not connect to rank " + std::to_string(rank()) + ": " +
                      why);
    std::lock_guard lock(mu_);
    if (aborted_) throw CommError("the communicator was aborted");
    adopt_pending();
    if (c.fd.load() >= 0) return true;
    const auto now = net::Clock::now();
    if (c.waiting_since == net::Clock::time_point{}) c.waiting_since = now;
    if (now - c.waiting_since > limit) {
      const std::string why = peer_failure(peer);
      throw CommError("rank " + std::to_string(peer) + " did not connect to rank " +
                      std::to_string(rank()) + " within " + std::to_string(limit.count() / 1000) + " s" +
                      (why.empty() ? ": is it running, with the same WORLD_SIZE and MASTER_ADDR? "
                                     "(SMARTCOLL_CONNECT_TIMEOUT)"
                                   : "; it failed: " + why));
    }
    return false;
  }
  // This rank connects. Without holding mu_ while it waits for the peer: abort() takes it, and must not wait.
  // (A channel is connected by the one worker that owns its stream.)
  if (aborted_) throw CommError("the communicator was aborted");
  auto installed = [&](net::Fd s, bool local) {
    std::lock_guard lock(mu_);
    if (aborted_) throw CommError("the communicator was aborted");
    install(peer, stream, std::move(s), local);
    return true;
  };
  if (net::Fd s = connect_local(peer, stream)) return installed(std::move(s), true);
  std::string addr;
  {
    std::lock_guard lock(mu_);
    addr = addrs_[peer];
  }
  if (addr.empty()) {
    addr = store_->get(
        "addr/" + std::to_string(peer) + "/" + (claims_.empty() ? "" : claims_.at(static_cast<size_t>(peer))), limit);
    std::lock_guard lock(mu_);
    addrs_[peer] = addr;
  }
  const auto deadline = net::Clock::now() + limit;
  // The peer published its address after it began to listen: refusals for a while mean that it closed its
  // listener since, so it exited, crashed or closed its communicator. The store says why where it left a reason.
  net::Clock::time_point looked{}, refused_since{};
  net::Fd s = net::connect_to(parse_endpoint(addr), deadline, [&](int err) -> std::string {
    if (aborted_) return "the communicator was aborted";
    if (std::string why = failed_meanwhile(peer, looked); !why.empty()) return why;
    const auto now = net::Clock::now();
    if (err != ECONNREFUSED) refused_since = {};
    else if (refused_since == net::Clock::time_point{}) refused_since = now;
    else if (now - refused_since > kRefusedFor)
      return "rank " + std::to_string(peer) + " has refused connections for " +
             std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kRefusedFor).count()) +
             " s though it listened there: it exited, crashed or closed its communicator (see its output)";
    return "";
  });
  say_hello(s.get(), peer, stream, deadline);
  return installed(std::move(s), false);
}

std::string TcpTransport::peer_failure(int peer) {
  try {
    return store_->get("failed/" + std::to_string(peer), std::chrono::milliseconds(300));
  } catch (const std::exception&) {  // it left no reason, or the store went down with it
    return "";
  }
}

void TcpTransport::fail_peer(int peer, const std::string& what) {
  const std::string why = peer_failure(peer);
  std::string where = "Unix socket on this host";
  if (!local_peer_[static_cast<size_t>(peer)].load()) {
    std::lock_guard lock(mu_);  // another worker may be writing it (its first connect to that peer)
    where = addrs_[peer];
  }
  throw CommError("connection to rank " + std::to_string(peer) + (where.empty() ? "" : " (" + where + ")") + " " +
                  what +
                  (why.empty() ? "; that rank exited, crashed or failed (see its output)"
                               : "; rank " + std::to_string(peer) + " failed: " + why));
}

size_t TcpTransport::send(int peer, int stream, const iovec* iov, int iovcnt) {
  msghdr m{};
  m.msg_iov = const_cast<iovec*>(iov);
  m.msg_iovlen = static_cast<size_t>(iovcnt);
  for (;;) {
    const ssize_t n = ::sendmsg(pollable(peer, stream), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return static_cast<size_t>(n);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    fail_peer(peer, std::string("broke while sending: ") + std::strerror(errno));
  }
}

size_t TcpTransport::recv(int peer, int stream, const iovec* iov, int iovcnt) {
  const int fd = pollable(peer, stream);
  if (fd < 0) fail_peer(peer, "is not connected");  // poll would skip it and report nothing, for ever
  // A rank that polls for a message calls this in a loop. recvmsg takes the socket's lock each time, the same
  // lock the kernel takes to deliver into the socket on another core: the two contend, and in a virtual
  // machine a contended kernel lock can stop the vCPU until the holder wakes it (tens of microseconds on a
  // small message's path). poll reads the receive queue without that lock, so it looks first (one more system
  // call per receive: nothing against a large message's copy).
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 0) == 0) return 0;
  msghdr m{};
  m.msg_iov = const_cast<iovec*>(iov);
  m.msg_iovlen = static_cast<size_t>(iovcnt);
  for (;;) {
    const ssize_t n = ::recvmsg(fd, &m, MSG_DONTWAIT);
    if (n > 0) return static_cast<size_t>(n);
    if (n == 0) fail_peer(peer, "was closed");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    fail_peer(peer, std::string("broke while receiving: ") + std::strerror(errno));
  }
}

void TcpTransport::abort(const std::string& reason) {
  if (aborted_.exchange(true)) return;
  try {
    store_->set("failed/" + std::to_string(rank()), reason);
  } catch (const std::exception&) {  // the store is gone too: peers still see the connections close
  }
  std::lock_guard lock(mu_);
  for (int i = 0; i < size() * streams(); ++i)
    if (chans_[i].fd.load() >= 0) ::shutdown(chans_[i].fd.load(), SHUT_RDWR);
  // Stops listening (the descriptors stay valid in the workers' epoll sets): a peer that connects later is
  // refused, and its connect gives up once it reads this rank's reason in the store.
  for (const net::Fd* l : {&listener_, &local_listener_})
    if (*l) ::shutdown(l->get(), SHUT_RDWR);
  turn_away();
}

}  // namespace smartcoll
