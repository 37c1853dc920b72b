#include "transport.h"

#include <sys/epoll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "smartcoll/types.h"

namespace smartcoll {

namespace {

constexpr uint32_t kHelloMagic = 0x53434c31;  // "SCL1"

struct Hello {
  uint32_t magic, rank, stream, size;
};

std::string listen_host(const Options& o, const std::string& route_hint) {
  if (!o.str("addr").empty()) return net::resolve_ipv4(o.str("addr"));
  if (!o.str("ifname").empty()) return net::interface_address(o.str("ifname"));
  return route_hint.empty() ? "127.0.0.1" : net::local_address_towards(route_hint);
}

net::Endpoint parse_endpoint(const std::string& s) {
  auto colon = s.rfind(':');
  if (colon == std::string::npos) throw CommError("malformed address '" + s + "' in the rendezvous store");
  return {s.substr(0, colon), static_cast<uint16_t>(std::stoi(s.substr(colon + 1)))};
}

}  // namespace

Transport::Transport(int rank, int size, Store& store, const Options& o, const std::string& route_hint)
    : rank_(rank), size_(size), streams_(static_cast<int>(o.integer("streams"))),
      timeout_(o.real("timeout")), fds_(static_cast<size_t>(size) * static_cast<size_t>(streams_)),
      addrs_(size) {
  auto wait_limit = std::chrono::milliseconds(static_cast<int64_t>(o.real("connect_timeout") * 1000));
  auto deadline = net::Clock::now() + wait_limit;
  if (size == 1) return;

  const std::string host = listen_host(o, route_hint);
  net::Fd listener = net::listen_on(host, 0, 4096);
  addrs_[rank] = host + ":" + std::to_string(net::bound_port(listener.get()));
  store.set("addr/" + std::to_string(rank), addrs_[rank]);

  for (int peer = 0; peer < rank; ++peer) {
    addrs_[peer] = store.get("addr/" + std::to_string(peer), wait_limit);
    for (int s = 0; s < streams_; ++s) {
      net::Fd c = net::connect_to(parse_endpoint(addrs_[peer]), deadline);
      Hello h{kHelloMagic, static_cast<uint32_t>(rank), static_cast<uint32_t>(s), static_cast<uint32_t>(size)};
      net::send_all(c.get(), &h, sizeof h, deadline, "hello to rank " + std::to_string(peer));
      fds_[peer * streams_ + s] = std::move(c);
    }
  }
  for (int pending = (size - 1 - rank) * streams_; pending > 0; --pending) {
    net::Fd c;
    try {
      c = net::accept_from(listener.get(), deadline);
    } catch (const CommError&) {
      std::string missing;
      for (int peer = rank + 1; peer < size; ++peer)
        if (!fds_[peer * streams_]) missing += (missing.empty() ? "" : ", ") + std::to_string(peer);
      throw CommError("rank " + std::to_string(rank) + " timed out after " + std::to_string(wait_limit.count() / 1000) +
                      " s waiting for rank(s) " + missing + " of " + std::to_string(size) +
                      " to connect: are they running, with the same WORLD_SIZE and MASTER_ADDR? "
                      "(SMARTCOLL_CONNECT_TIMEOUT)");
    }
    Hello h{};
    net::recv_all(c.get(), &h, sizeof h, deadline, "hello from a connecting peer");
    if (h.magic != kHelloMagic || h.size != static_cast<uint32_t>(size) || h.rank <= static_cast<uint32_t>(rank) ||
        h.rank >= static_cast<uint32_t>(size) || h.stream >= static_cast<uint32_t>(streams_) ||
        fds_[h.rank * streams_ + h.stream])
      throw CommError("rank " + std::to_string(rank) + " got an invalid hello (world size " +
                      std::to_string(h.size) + ", rank " + std::to_string(h.rank) + ", stream " +
                      std::to_string(h.stream) +
                      "): ranks disagree on WORLD_SIZE or SMARTCOLL_STREAMS, or another job uses this port");
    fds_[h.rank * streams_ + h.stream] = std::move(c);
  }
  for (int peer = rank + 1; peer < size; ++peer) addrs_[peer] = store.get("addr/" + std::to_string(peer), wait_limit);

  epoll_ = net::Fd(epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) throw CommError("epoll_create1 failed: " + std::string(std::strerror(errno)));
  for (auto& f : fds_) {
    if (!f) continue;
    net::set_nonblocking(f.get(), true);
    net::set_buffer_sizes(f.get(), static_cast<int>(o.integer("sockbuf")));
    // Edge-triggered: every caller tries its I/O until EAGAIN before it blocks, so no edge is missed.
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    ev.data.fd = f.get();
    epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, f.get(), &ev);
  }
}

Transport::~Transport() = default;

void Transport::fail_peer(int peer, const std::string& what) {
  throw CommError(context + ": connection to rank " + std::to_string(peer) + " (" + addrs_[peer] + ") " + what +
                  "; that rank exited, crashed or failed (see its output)");
}

size_t Transport::try_send(int peer, int stream, const void* buf, size_t len) {
  if (len == 0) return 0;
  for (;;) {
    ssize_t n = ::send(fd(peer, stream), buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return static_cast<size_t>(n);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    fail_peer(peer, std::string("broke while sending: ") + std::strerror(errno));
  }
}

size_t Transport::try_recv(int peer, int stream, void* buf, size_t len) {
  if (len == 0) return 0;
  for (;;) {
    ssize_t n = ::recv(fd(peer, stream), buf, len, MSG_DONTWAIT);
    if (n > 0) return static_cast<size_t>(n);
    if (n == 0) fail_peer(peer, "was closed");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    fail_peer(peer, std::string("broke while receiving: ") + std::strerror(errno));
  }
}

bool Transport::wait_ready(net::Clock::time_point deadline) {
  epoll_event events[64];
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - net::Clock::now()).count();
    if (left <= 0) return false;
    int n = epoll_wait(epoll_.get(), events, 64, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) throw CommError("epoll_wait failed: " + std::string(std::strerror(errno)));
  }
}

void Transport::fail_timeout(const std::string& waiting_for) {
  throw CommError(context + ": no progress for " + std::to_string(timeout_.count()) + " s " + waiting_for +
                  "; is that rank alive and calling the same collective? (SMARTCOLL_TIMEOUT raises the limit)");
}

void Transport::run(std::span<Op> ops) {
  Progress progress(*this);
  for (;;) {
    bool pending = false;
    for (Op& op : ops) {
      while (op.done < op.len) {
        size_t n = op.send ? try_send(op.peer, 0, op.buf + op.done, op.len - op.done)
                           : try_recv(op.peer, 0, op.buf + op.done, op.len - op.done);
        if (n == 0) break;
        op.done += n;
        progress.made();
      }
      pending |= op.done < op.len;
    }
    if (!pending) return;
    progress.block([&] {
      std::string who;
      for (const Op& op : ops)
        if (op.done < op.len)
          who += std::string(who.empty() ? "" : ", ") + (op.send ? "sending to rank " : "receiving from rank ") +
                 std::to_string(op.peer);
      return "while " + who;
    });
  }
}

void Transport::abort() {
  for (auto& f : fds_)
    if (f) ::shutdown(f.get(), SHUT_RDWR);
}

}  // namespace smartcoll
