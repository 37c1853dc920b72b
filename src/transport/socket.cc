#include "transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "smartcoll/types.h"

namespace smartcoll::net {

namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)); }

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left > 1000000 ? 1000000 : left);
}

// Waits for `events` on fd; false on deadline.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) throw CommError("poll failed: " + errno_text(errno));
  }
}

sockaddr_un abstract_address(const std::string& name, socklen_t& len) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof sa.sun_path) throw InvalidArgument("Unix socket name '" + name + "' is too long");
  std::memcpy(sa.sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: the abstract namespace
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return sa;
}

}  // namespace

sockaddr_in ipv4_address(const std::string& host, uint16_t port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1)
    throw InvalidArgument("'" + host + "' is not an IPv4 address");
  return sa;
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.release();
  }
  return *this;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string interface_address(const std::string& ifname) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) throw CommError("getifaddrs failed: " + errno_text(errno));
  std::string found, names;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    names += std::string(names.empty() ? "" : ", ") + i->ifa_name;
    if (ifname == i->ifa_name && found.empty()) {
      char buf[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
      found = buf;
    }
  }
  freeifaddrs(list);
  if (found.empty())
    throw InvalidArgument("interface '" + ifname + "' has no IPv4 address (SMARTCOLL_IFNAME); interfaces with one: " +
                          names);
  return found;
}

std::string resolve_ipv4(const std::string& host) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) throw InvalidArgument("cannot resolve host '" + host + "': " + gai_strerror(rc));
  char buf[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr, buf, sizeof buf);
  freeaddrinfo(res);
  return buf;
}

std::string local_address_towards(const std::string& remote_host) {
  Fd s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!s) throw CommError("socket failed: " + errno_text(errno));
  sockaddr_in sa = ipv4_address(resolve_ipv4(remote_host), 9);
  // connect() on a datagram socket only picks the route and source address; nothing is sent.
  if (::connect(s.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
    throw CommError("no route to " + remote_host + ": " + errno_text(errno) +
                    "; set SMARTCOLL_IFNAME or SMARTCOLL_ADDR");
  sockaddr_in local{};
  socklen_t len = sizeof local;
  getsockname(s.get(), reinterpret_cast<sockaddr*>(&local), &len);
  char buf[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &local.sin_addr, buf, sizeof buf);
  return buf;
}

Fd listen_on(const std::string& host, uint16_t port, int backlog) {
  Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s) throw CommError("socket failed: " + errno_text(errno));
  int one = 1;
  setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa = ipv4_address(host, port);
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
    throw CommError("cannot listen on " + host + ":" + std::to_string(port) + ": " + errno_text(errno));
  if (::listen(s.get(), backlog) != 0) throw CommError("listen failed: " + errno_text(errno));
  return s;
}

uint16_t bound_port(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  return ntohs(sa.sin_port);
}

Fd connect_to(const Endpoint& ep, Clock::time_point deadline, const std::function<std::string(int)>& give_up) {
  sockaddr_in sa = ipv4_address(ep.host, ep.port);
  std::string last_error = "deadline passed before the first attempt";
  auto pause = std::chrono::milliseconds(5);
  do {
    Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s) throw CommError("socket failed: " + errno_text(errno));
    set_nonblocking(s.get(), true);
    int rc = ::connect(s.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa);
    if (rc != 0 && errno == EINPROGRESS) {
      if (wait_fd(s.get(), POLLOUT, deadline)) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      set_nonblocking(s.get(), false);
      set_nodelay(s.get());
      return s;
    }
    const int err = errno;
    last_error = errno_text(err);
    if (give_up)
      if (std::string why = give_up(err); !why.empty())
        throw CommError("cannot connect to " + ep.str() + " (" + last_error + "): " + why);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(200));
  } while (Clock::now() < deadline);
  throw CommError("cannot connect to " + ep.str() + ": " + last_error +
                  " (is the peer running and reachable? raise SMARTCOLL_CONNECT_TIMEOUT if it starts late)");
}

Fd accept_from(int listen_fd, Clock::time_point deadline) {
  if (!wait_fd(listen_fd, POLLIN, deadline))
    throw CommError("timed out waiting for peers to connect (SMARTCOLL_CONNECT_TIMEOUT)");
  Fd s(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC));
  if (!s) throw CommError("accept failed: " + errno_text(errno));
  set_nodelay(s.get());
  return s;
}

void send_all(int fd, const void* buf, size_t len, Clock::time_point deadline, const std::string& what) {
  auto* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!wait_fd(fd, POLLOUT, deadline)) throw TimedOut("timed out sending " + what);
    } else {
      throw CommError("sending " + what + " failed: " + errno_text(errno));
    }
  }
}

void recv_all(int fd, void* buf, size_t len, Clock::time_point deadline, const std::string& what) {
  auto* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
    } else if (n == 0) {
      throw CommError("connection closed while receiving " + what);
    } else if (errno == EAGAIN || errno == EINTR) {
      if (!wait_fd(fd, POLLIN, deadline)) throw TimedOut("timed out receiving " + what);
    } else {
      throw CommError("receiving " + what + " failed: " + errno_text(errno));
    }
  }
}

void raise_descriptor_limit() {
  // Not the hard limit itself: in containers it can be 2^30, and programs that walk every descriptor up to the
  // limit (children that close them all) would crawl.
  static constexpr rlim_t kDescriptorLimit = 65536;
  static std::once_flag once;
  std::call_once(once, [] {
    rlimit r{};
    if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return;
    const rlim_t want = r.rlim_max == RLIM_INFINITY ? kDescriptorLimit : std::min(r.rlim_max, kDescriptorLimit);
    if (r.rlim_cur >= want) return;
    r.rlim_cur = want;
    ::setrlimit(RLIMIT_NOFILE, &r);  // failure leaves the old limit: EMFILE then names the cause where it hits
  });
}

std::string job_socket_name(uint64_t job, int rank, const std::string& what) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(job));
  return "smartcoll/" + std::string(hex) + "/" + std::to_string(rank) + "/" + what;
}

Fd listen_abstract(const std::string& name, int backlog) {
  Fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s) throw CommError("socket(AF_UNIX) failed: " + errno_text(errno));
  socklen_t len = 0;
  const sockaddr_un sa = abstract_address(name, len);
  if (::bind(s.get(), reinterpret_cast<const sockaddr*>(&sa), len) != 0)
    throw CommError("cannot bind the Unix socket @" + name + ": " + errno_text(errno));
  if (::listen(s.get(), backlog) != 0) throw CommError("listen(AF_UNIX) failed: " + errno_text(errno));
  return s;
}

Fd connect_abstract(const std::string& name, Clock::time_point deadline) {
  socklen_t len = 0;
  const sockaddr_un sa = abstract_address(name, len);
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    Fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!s) throw CommError("socket(AF_UNIX) failed: " + errno_text(errno));
    if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&sa), len) == 0) {
      set_nonblocking(s.get(), false);
      return s;
    }
    if (errno == ECONNREFUSED || errno == ENOENT) return Fd();
    // A Unix socket connects at once or not at all: EAGAIN means the listener's backlog is full.
    if ((errno != EAGAIN && errno != EINTR) || Clock::now() >= deadline)
      throw CommError("cannot connect to the Unix socket @" + name + ": " + errno_text(errno));
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

bool closed_by_peer(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

void set_nonblocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void set_buffer_sizes(int fd, int bytes) {
  if (bytes <= 0) return;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

}  // namespace smartcoll::net
