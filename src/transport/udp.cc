#include "transport/udp.h"

#include <arpa/inet.h>
#include <poll.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "smartcoll/types.h"

namespace smartcoll::udp {

std::string to_string(const sockaddr_in& a) {
  char buf[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &a.sin_addr, buf, sizeof buf);
  return std::string(buf) + ":" + std::to_string(ntohs(a.sin_port));
}

uint16_t port_of(const sockaddr_in& a) { return ntohs(a.sin_port); }

net::Fd open(const std::string& host, uint16_t port, int buffer) {
  net::Fd s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!s) throw CommError("cannot create a UDP socket: " + std::string(std::strerror(errno)));
  // The *FORCE options pass net.core.[rw]mem_max where the process may (root); else the plain ones, capped.
  for (auto [force, plain] : {std::pair{SO_SNDBUFFORCE, SO_SNDBUF}, std::pair{SO_RCVBUFFORCE, SO_RCVBUF}})
    if (setsockopt(s.get(), SOL_SOCKET, force, &buffer, sizeof buffer) != 0)
      setsockopt(s.get(), SOL_SOCKET, plain, &buffer, sizeof buffer);
  sockaddr_in sa = net::ipv4_address(host, port);
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
    throw CommError("cannot bind UDP " + host + ":" + std::to_string(port) + ": " + std::strerror(errno));
  return s;
}

SendBatch::SendBatch(size_t capacity) : msgs_(capacity), iov_(2 * capacity), to_(capacity) {}

void SendBatch::add(const sockaddr_in& to, const void* a, size_t alen, const void* b, size_t blen) {
  const size_t i = used_++;
  to_[i] = to;
  iov_[2 * i] = {const_cast<void*>(a), alen};
  iov_[2 * i + 1] = {const_cast<void*>(b), blen};
  msghdr& m = msgs_[i].msg_hdr;
  m = msghdr{};
  m.msg_name = &to_[i];
  m.msg_namelen = sizeof(sockaddr_in);
  m.msg_iov = &iov_[2 * i];
  m.msg_iovlen = blen ? 2 : 1;
}

size_t SendBatch::flush(int fd, int patience_ms) {
  size_t sent = 0, dropped = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(patience_ms);
  while (sent < used_) {
    const int k = ::sendmmsg(fd, &msgs_[sent], static_cast<unsigned>(used_ - sent), 0);
    if (k > 0) {
      sent += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == ENOBUFS) && std::chrono::steady_clock::now() < give_up) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 1);
      continue;
    }
    // Out of patience, or the datagram was refused (ECONNREFUSED from an earlier ICMP, EMSGSIZE, no route):
    // this one is lost, as on a network; the protocol retransmits.
    ++sent;
    ++dropped;
  }
  used_ = 0;
  return dropped;
}

RecvBatch::RecvBatch(size_t capacity, size_t max_len)
    : stride_(max_len + 1), buf_(new uint8_t[capacity * stride_]), msgs_(capacity), iov_(capacity),
      from_(capacity) {
  // Each buffer has one byte more than any valid datagram, so that an oversized one shows as too long.
  for (size_t i = 0; i < capacity; ++i) iov_[i] = {buf_.get() + i * stride_, stride_};
}

size_t RecvBatch::receive(int fd) {
  for (size_t i = 0; i < msgs_.size(); ++i) {
    msghdr& m = msgs_[i].msg_hdr;
    m = msghdr{};
    m.msg_name = &from_[i];
    m.msg_namelen = sizeof(sockaddr_in);
    m.msg_iov = &iov_[i];
    m.msg_iovlen = 1;
  }
  for (;;) {
    const int k = ::recvmmsg(fd, msgs_.data(), static_cast<unsigned>(msgs_.size()), MSG_DONTWAIT, nullptr);
    if (k >= 0) return static_cast<size_t>(k);
    if (errno == EINTR) continue;
    // ECONNREFUSED: an ICMP "port unreachable" for something this socket sent earlier; not an error here.
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNREFUSED) return 0;
    throw CommError("UDP receive failed: " + std::string(std::strerror(errno)));
  }
}

}  // namespace smartcoll::udp
