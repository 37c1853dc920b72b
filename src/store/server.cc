#include "store/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "core/log.h"
#include "smartcoll/types.h"

namespace smartcoll::store {

namespace {

constexpr uint64_t kListenerId = 0;
constexpr uint64_t kWakeId = 1;
constexpr size_t kReadChunk = 64 * 1024;
// A client's next request waits while this much of its replies is unsent: a client that never reads costs the
// server at most one reply beyond it.
constexpr size_t kOutputHighWater = 64 * 1024;
constexpr auto kSweepPeriod = std::chrono::milliseconds(50);
constexpr auto kBackoffLogPeriod = std::chrono::seconds(10);
constexpr int kAcceptsPerWakeup = 64;

std::string peer_name(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return "unknown peer";
  char ip[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof ip);
  return std::string(ip) + ":" + std::to_string(ntohs(sa.sin_port));
}

void log_drop(const std::string& peer, const std::string& why, LogLevel level) {
  SC_LOG(level, 0, "store server") << "dropped client " << peer << ": " << why;
}

}  // namespace

struct Server::Client {
  Client(uint64_t id_, net::Fd fd_, const StoreLimits& limits, Time now)
      : id(id_), fd(std::move(fd_)), peer(peer_name(fd.get())), parser(limits.max_key, limits.max_value),
        connected(now), last_progress(now) {}
  size_t unsent() const { return out.size() - out_sent; }
  // Its requests wait: for the answer to its get (replies go out in request order), or for it to read replies.
  bool stalled() const { return waiting || unsent() > kOutputHighWater; }

  const uint64_t id;
  net::Fd fd;
  const std::string peer;
  bool authenticated = false;
  std::array<uint8_t, kNonceSize> nonce{};
  std::string proof;  // the handshake answer, as it arrives
  RequestParser parser;
  std::string out;
  size_t out_sent = 0;
  bool waiting = false;
  std::string waiting_for;
  size_t accounted = 0;  // this client's share of buffered_
  uint32_t events = 0;   // the epoll interest registered
  Time connected, last_progress;
};

Server::Server(net::Fd listener, std::string secret, const StoreLimits& limits)
    : listener_(std::move(listener)), epoll_(::epoll_create1(EPOLL_CLOEXEC)),
      wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)), secret_(std::move(secret)), limits_(limits),
      read_buf_(kReadChunk) {
  if (!epoll_ || !wake_) throw CommError(std::string("store server: epoll/eventfd failed: ") + std::strerror(errno));
  net::set_nonblocking(listener_.get(), true);
  epoll_event ev{EPOLLIN, {.u64 = kListenerId}};
  epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, listener_.get(), &ev);
  ev = {EPOLLIN, {.u64 = kWakeId}};
  epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &ev);
  thread_ = std::thread([this] { run(); });
}

Server::~Server() {
  stop_ = true;
  const uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_.get(), &one, sizeof one);
  thread_.join();
}

StoreServerStats Server::stats() const {
  return {stats_.loop_iterations, stats_.accepted,  stats_.clients,     stats_.bad_requests,
          stats_.refused,         stats_.timed_out, stats_.over_buffer, stats_.accept_backoffs, stats_.keys};
}

void Server::run() {
  std::optional<Time> closing;
  epoll_event events[64];
  for (;;) {
    Time now = net::Clock::now();
    if (stop_) {
      if (!closing) closing = now + kLinger;
      if (clients_.empty() || now > *closing) break;
    }
    update_listener(now);
    const int n = ::epoll_wait(epoll_.get(), events, std::size(events), stop_ ? 50 : 100);
    ++stats_.loop_iterations;
    now = net::Clock::now();
    for (int i = 0; i < n; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == kListenerId) {
        accept_clients(now);
      } else if (id == kWakeId) {
        uint64_t count;
        [[maybe_unused]] auto r = ::read(wake_.get(), &count, sizeof count);
      } else if (auto it = clients_.find(id); it != clients_.end() && it->second->fd) {
        on_event(*it->second, events[i].events, now);
      }
    }
    // Serving a woken client can answer (wake) others in turn; each pass takes the list as it stands.
    while (!woken_.empty()) {
      std::vector<uint64_t> woken;
      woken.swap(woken_);
      for (uint64_t id : woken)
        if (auto it = clients_.find(id); it != clients_.end() && it->second->fd) serve(*it->second);
    }
    if (now >= next_sweep_) {
      sweep(now);
      next_sweep_ = now + kSweepPeriod;
    }
    for (uint64_t id : dropped_) clients_.erase(id);
    dropped_.clear();
    stats_.clients = clients_.size();
  }
}

// The listener is polled only while a client can be taken: below the client limit, and not within the pause
// after running out of descriptors (accept() would fail at once, and the pending connection keep the listener
// readable: polling it would spin).
void Server::update_listener(Time now) {
  const bool want = clients_.size() < limits_.max_clients && now >= accept_resume_;
  if (want == listening_) return;
  epoll_event ev{want ? static_cast<uint32_t>(EPOLLIN) : 0u, {.u64 = kListenerId}};
  epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listener_.get(), &ev);
  listening_ = want;
}

void Server::accept_clients(Time now) {
  for (int i = 0; i < kAcceptsPerWakeup && clients_.size() < limits_.max_clients; ++i) {
    net::Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
      // EMFILE, ENFILE, ENOBUFS, ENOMEM: nothing to accept with until a descriptor or memory is freed.
      accept_resume_ = now + kAcceptBackoff;
      ++stats_.accept_backoffs;
      if (now - last_backoff_log_ >= kBackoffLogPeriod) {
        last_backoff_log_ = now;
        SC_LOG(LogLevel::warn, 0, "store server")
            << "accept failed (" << std::strerror(err) << "): pausing new connections for "
            << kAcceptBackoff.count() << " ms at a time until it succeeds (raise the open files limit, ulimit -n)";
      }
      return;
    }
    net::set_nodelay(fd.get());
    const uint64_t id = next_id_++;
    auto client = std::make_unique<Client>(id, std::move(fd), limits_, now);
    Client& c = *client;
    clients_.emplace(id, std::move(client));
    ++stats_.accepted;
    if (secret_.empty()) {
      c.authenticated = true;
      c.out.assign(1, static_cast<char>(kGreetingOpen));
    } else {
      random_bytes(c.nonce);
      c.out.assign(1, static_cast<char>(kGreetingSecret));
      c.out.append(reinterpret_cast<const char*>(c.nonce.data()), c.nonce.size());
    }
    epoll_event ev{0, {.u64 = id}};
    epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, c.fd.get(), &ev);
    flush(c, now);
    if (!c.fd) continue;
    account(c);
    update_events(c);
  }
}

void Server::on_event(Client& c, uint32_t events, Time now) {
  if (events & EPOLLOUT) {
    flush(c, now);
    if (!c.fd) return;
    serve(c);  // requests held back for its replies may go on
    if (!c.fd) return;
  }
  if (!(events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))) return;
  if (c.stalled()) {
    // Not reading from it. A hang-up (a client that waits for a reply does not half-close) ends it; input waits
    // in the kernel until the client's replies are out.
    if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))
      drop(c, "closed the connection with requests outstanding", nullptr);
    else
      update_events(c);
    return;
  }
  const ssize_t n = ::recv(c.fd.get(), read_buf_.data(), read_buf_.size(), MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n <= 0) {
    drop(c, n == 0 ? "closed the connection" : std::strerror(errno), nullptr);
    return;
  }
  c.last_progress = now;
  if (buffered_ + static_cast<size_t>(n) > limits_.max_buffered) {
    drop(c, "the server's buffers are full (" + std::to_string(limits_.max_buffered) + " bytes)", &stats_.over_buffer);
    return;
  }
  std::string_view bytes(read_buf_.data(), static_cast<size_t>(n));
  if (!c.authenticated) {
    on_proof(c, bytes);
    if (!c.fd) return;
  }
  c.parser.feed(bytes);
  serve(c);
}

// Takes the handshake answer off the front of `bytes`; whatever follows it is requests.
void Server::on_proof(Client& c, std::string_view& bytes) {
  const size_t take = std::min(bytes.size(), kProofSize - c.proof.size());
  c.proof.append(bytes.substr(0, take));
  bytes.remove_prefix(take);
  if (c.proof.size() < kProofSize) return;
  const Digest expected = handshake_proof(secret_, c.nonce);
  const std::span<const uint8_t> got(reinterpret_cast<const uint8_t*>(c.proof.data()), c.proof.size());
  if (!equal_constant_time(got, expected)) {
    // Best effort: the client learns it was refused rather than finding the connection closed.
    const char refused = static_cast<char>(kRefused);
    [[maybe_unused]] auto n = ::send(c.fd.get(), &refused, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    drop(c, "wrong proof of the shared secret (is SMARTCOLL_SECRET the same on every rank?)", &stats_.refused);
    return;
  }
  c.authenticated = true;
  c.out += static_cast<char>(kAccepted);
}

// Runs the client's complete requests while it can take their replies, then sends what the kernel accepts.
void Server::serve(Client& c) {
  Time now = net::Clock::now();
  while (c.fd && !c.waiting) {
    if (c.unsent() > kOutputHighWater) {
      flush(c, now);
      if (!c.fd || c.unsent() > kOutputHighWater) break;
    }
    std::optional<Request> r = c.parser.next();
    if (!r) {
      if (!c.parser.error().empty()) drop(c, "bad request: " + c.parser.error(), &stats_.bad_requests);
      break;
    }
    execute(c, *r);
  }
  if (!c.fd) return;
  flush(c, now);
  if (!c.fd) return;
  account(c);
  if (buffered_ > limits_.max_buffered) {
    drop(c, "the server's buffers are full (" + std::to_string(limits_.max_buffered) + " bytes)", &stats_.over_buffer);
    return;
  }
  update_events(c);
}

void Server::execute(Client& c, Request& r) {
  if (r.op == Op::erase) {  // every key that begins with r.key
    uint32_t erased = 0;
    for (auto it = values_.lower_bound(r.key); it != values_.end() && it->first.starts_with(r.key); ++erased)
      it = values_.erase(it);
    stats_.keys = values_.size();
    send_bytes(c, encode_count(erased));
    return;
  }
  if (r.op == Op::get || r.op == Op::check) {
    if (auto it = values_.find(r.key); it != values_.end()) {
      reply(c, it->second);
    } else if (r.op == Op::check) {
      reply(c, std::nullopt);
    } else {
      c.waiting = true;
      c.waiting_for = r.key;
      waiting_.emplace(std::move(r.key), c.id);
    }
    return;
  }
  const std::string& value = values_.insert_or_assign(r.key, std::move(r.value)).first->second;
  stats_.keys = values_.size();
  auto [lo, hi] = waiting_.equal_range(r.key);
  for (auto it = lo; it != hi; ++it) {
    auto found = clients_.find(it->second);
    if (found == clients_.end() || !found->second->fd) continue;
    Client& w = *found->second;
    w.waiting = false;
    reply(w, value);
    woken_.push_back(w.id);
  }
  waiting_.erase(lo, hi);
}

void Server::reply(Client& c, std::optional<std::string_view> value) { send_bytes(c, encode_reply(value)); }

void Server::send_bytes(Client& c, const std::string& bytes) {
  if (c.out_sent == c.out.size()) {
    c.out.clear();
    c.out_sent = 0;
  }
  c.out += bytes;
}

void Server::flush(Client& c, Time now) {
  while (c.unsent() > 0) {
    const ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_sent, c.unsent(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.out_sent += static_cast<size_t>(n);
      c.last_progress = now;
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      break;
    } else {
      drop(c, std::string("sending failed: ") + std::strerror(errno), nullptr);
      return;
    }
  }
  if (c.out_sent == c.out.size()) {
    c.out.clear();
    c.out_sent = 0;
  }
}

// Level-triggered interest: input while the client's requests may run, output while replies are unsent, and
// always the peer's hang-up, so that a stalled client that leaves is noticed.
void Server::update_events(Client& c) {
  uint32_t want = EPOLLRDHUP;
  if (!c.stalled()) want |= EPOLLIN;
  if (c.unsent() > 0) want |= EPOLLOUT;
  if (want == c.events) return;
  epoll_event ev{want, {.u64 = c.id}};
  epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
  c.events = want;
}

void Server::account(Client& c) {
  const size_t now_held = c.fd ? c.parser.buffered() + c.proof.size() + c.unsent() : 0;
  buffered_ = buffered_ - c.accounted + now_held;
  c.accounted = now_held;
}

// Closes the connection (which also takes it out of epoll) and forgets its pending get; the Client object is
// erased at the end of the loop iteration, as events for it may still be in hand.
void Server::drop(Client& c, const std::string& why, std::atomic<uint64_t>* counter) {
  if (counter) ++*counter;
  // Rejected clients are worth a warning, idle ones a note; clients that leave are routine.
  const LogLevel level = !counter ? LogLevel::debug : counter == &stats_.timed_out ? LogLevel::info : LogLevel::warn;
  log_drop(c.peer, why, level);
  if (c.waiting) {
    auto [lo, hi] = waiting_.equal_range(c.waiting_for);
    for (auto it = lo; it != hi; ++it)
      if (it->second == c.id) {
        waiting_.erase(it);
        break;
      }
    c.waiting = false;
  }
  c.fd.reset();
  account(c);
  dropped_.push_back(c.id);
}

void Server::sweep(Time now) {
  for (auto& [id, client] : clients_) {
    Client& c = *client;
    if (!c.fd) continue;
    if (!c.authenticated && now - c.connected > limits_.handshake_timeout)
      drop(c, "no answer to the secret handshake in time", &stats_.timed_out);
    else if (c.authenticated && !c.waiting && now - c.last_progress > limits_.idle_timeout)
      drop(c, "idle", &stats_.timed_out);
  }
}

}  // namespace smartcoll::store
