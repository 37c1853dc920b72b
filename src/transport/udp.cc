#include "transport/udp.h"

#include <arpa/inet.h>
#include <netinet/udp.h>
#include <poll.h>

#include <algorithm>
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

namespace {

// One kernel message carries at most 64 segments (UDP_MAX_SEGMENTS on older kernels) and one IPv4 UDP payload.
constexpr size_t kMaxSegments = 64;
constexpr size_t kMaxUdpPayload = 65507;
constexpr size_t kSegCmsg = CMSG_SPACE(sizeof(uint16_t));  // UDP_SEGMENT carries a u16
constexpr size_t kGroCmsg = CMSG_SPACE(sizeof(int));       // UDP_GRO reports an int

bool same_address(const sockaddr_in& a, const sockaddr_in& b) {
  return a.sin_addr.s_addr == b.sin_addr.s_addr && a.sin_port == b.sin_port;
}

// The errors with which a kernel refuses a segmented send it cannot do (a segment above the route's MTU, a
// device without checksum offload, no UDP_SEGMENT at all): the same datagrams then go one by one.
bool refused_offload(int err) { return err == EINVAL || err == EIO || err == EMSGSIZE || err == EOPNOTSUPP; }

}  // namespace

bool enable_gro(int fd) {
  const int on = 1;
  return setsockopt(fd, SOL_UDP, UDP_GRO, &on, sizeof on) == 0;
}

SendBatch::SendBatch(size_t capacity, bool offload)
    : iov_(2 * capacity), to_(capacity), dgrams_(capacity), order_(capacity), msgs_(capacity),
      msg_iov_(2 * capacity), msg_first_(capacity), msg_count_(capacity), msg_seg_(capacity),
      cmsg_(capacity * kSegCmsg), offload_(offload) {}

void SendBatch::add(const sockaddr_in& to, const void* a, size_t alen, const void* b, size_t blen) {
  const size_t i = used_++;
  to_[i] = to;
  iov_[2 * i] = {const_cast<void*>(a), alen};
  iov_[2 * i + 1] = {const_cast<void*>(b), blen};
  dgrams_[i] = {static_cast<uint32_t>(2 * i), blen ? 2u : 1u, static_cast<uint32_t>(alen + blen)};
}

void SendBatch::build(size_t from) {
  size_t m = 0, iovs = 0;
  for (size_t p = from; p < used_; ++m) {
    const Datagram& first = dgrams_[order_[p]];
    const sockaddr_in& to = to_[order_[p]];
    // A run of datagrams to one address, all as long as the first but the last (which may be shorter).
    size_t count = 1, total = first.len;
    if (offload_ && first.len <= max_segment_) {
      while (p + count < used_ && count < kMaxSegments) {
        const uint32_t next = order_[p + count];
        const uint32_t len = dgrams_[next].len;
        if (!same_address(to_[next], to) || len > first.len || total + len > kMaxUdpPayload) break;
        ++count;
        total += len;
        if (len < first.len) break;
      }
    }
    msghdr& h = msgs_[m].msg_hdr;
    h = msghdr{};
    h.msg_name = const_cast<sockaddr_in*>(&to);
    h.msg_namelen = sizeof(sockaddr_in);
    h.msg_iov = &msg_iov_[iovs];
    for (size_t q = p; q < p + count; ++q) {
      const Datagram& d = dgrams_[order_[q]];
      for (uint32_t v = 0; v < d.iovs; ++v) msg_iov_[iovs++] = iov_[d.first_iov + v];
    }
    h.msg_iovlen = static_cast<size_t>(&msg_iov_[iovs] - h.msg_iov);
    msg_first_[m] = static_cast<uint32_t>(p);
    msg_count_[m] = static_cast<uint32_t>(count);
    msg_seg_[m] = count > 1 ? static_cast<uint16_t>(first.len) : 0;
    if (count > 1) {
      h.msg_control = &cmsg_[m * kSegCmsg];
      h.msg_controllen = kSegCmsg;
      cmsghdr* c = CMSG_FIRSTHDR(&h);
      c->cmsg_level = SOL_UDP;
      c->cmsg_type = UDP_SEGMENT;
      c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
      const uint16_t seg = msg_seg_[m];
      std::memcpy(CMSG_DATA(c), &seg, sizeof seg);
    }
    p += count;
  }
  messages_ = m;
}

size_t SendBatch::flush(int fd, int patience_ms) {
  if (used_ == 0) return 0;
  if (offload_ && !probed_) {
    // A kernel without UDP_SEGMENT (before 4.18) would ignore the control message and send one big datagram.
    probed_ = true;
    int seg = 0;
    socklen_t len = sizeof seg;
    if (getsockopt(fd, SOL_UDP, UDP_SEGMENT, &seg, &len) != 0) offload_ = false;
  }
  for (size_t i = 0; i < used_; ++i) order_[i] = static_cast<uint32_t>(i);
  if (offload_) {
    // Group by address, keeping the order within each group (the switch's results alternate between workers).
    std::stable_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(used_), [&](uint32_t a, uint32_t b) {
      const sockaddr_in &x = to_[a], &y = to_[b];
      return x.sin_addr.s_addr != y.sin_addr.s_addr ? x.sin_addr.s_addr < y.sin_addr.s_addr : x.sin_port < y.sin_port;
    });
  }
  build(0);
  size_t m = 0, dropped = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(patience_ms);
  while (m < messages_) {
    const int k = ::sendmmsg(fd, &msgs_[m], static_cast<unsigned>(messages_ - m), 0);
    ++counts_.calls;
    if (k > 0) {
      for (size_t i = m; i < m + static_cast<size_t>(k); ++i) counts_.datagrams += msg_count_[i];
      counts_.messages += static_cast<uint64_t>(k);
      m += static_cast<size_t>(k);
      continue;
    }
    const int err = errno;
    if (k < 0 && err == EINTR) continue;
    if (k < 0 && msg_seg_[m] && refused_offload(err)) {
      // Never again segments this long on this batch; the rest goes again from this message on.
      ++counts_.refused;
      max_segment_ = msg_seg_[m] - 1u;
      build(msg_first_[m]);
      m = 0;
      continue;
    }
    if (k < 0 && (err == EAGAIN || err == ENOBUFS) && std::chrono::steady_clock::now() < give_up) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 1);
      continue;
    }
    // Out of patience, or the datagram was refused (ECONNREFUSED from an earlier ICMP, EMSGSIZE, no route):
    // this one is lost, as on a network; the protocol retransmits.
    dropped += msg_count_[m];
    ++m;
  }
  used_ = 0;
  return dropped;
}

RecvBatch::RecvBatch(size_t capacity, size_t max_len, bool offload)
    : stride_(offload ? 65536 : max_len + 1), buf_(new uint8_t[capacity * stride_]), msgs_(capacity),
      iov_(capacity), from_(capacity), cmsg_(offload ? capacity * kGroCmsg : 0), offload_(offload) {
  // Without offload each buffer has one byte more than any valid datagram, so that an oversized one shows as too
  // long; with it, a buffer holds the largest UDP datagram there is.
  for (size_t i = 0; i < capacity; ++i) iov_[i] = {buf_.get() + i * stride_, stride_};
  views_.reserve(capacity * (offload ? kMaxSegments : 1));
}

size_t RecvBatch::receive(int fd) {
  for (size_t i = 0; i < msgs_.size(); ++i) {
    msghdr& m = msgs_[i].msg_hdr;
    m = msghdr{};
    m.msg_name = &from_[i];
    m.msg_namelen = sizeof(sockaddr_in);
    m.msg_iov = &iov_[i];
    m.msg_iovlen = 1;
    if (offload_) {
      m.msg_control = &cmsg_[i * kGroCmsg];
      m.msg_controllen = kGroCmsg;
    }
  }
  views_.clear();
  int k;
  for (;;) {
    k = ::recvmmsg(fd, msgs_.data(), static_cast<unsigned>(msgs_.size()), MSG_DONTWAIT, nullptr);
    if (k >= 0) break;
    if (errno == EINTR) continue;
    // ECONNREFUSED: an ICMP "port unreachable" for something this socket sent earlier; not an error here.
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNREFUSED) return 0;
    throw CommError("UDP receive failed: " + std::string(std::strerror(errno)));
  }
  for (size_t i = 0; i < static_cast<size_t>(k); ++i) {
    const uint8_t* data = buf_.get() + i * stride_;
    const size_t len = msgs_[i].msg_len;
    size_t seg = len;
    msghdr& m = msgs_[i].msg_hdr;
    for (cmsghdr* c = offload_ ? CMSG_FIRSTHDR(&m) : nullptr; c; c = CMSG_NXTHDR(&m, c)) {
      int gro = 0;
      if (c->cmsg_level != SOL_UDP || c->cmsg_type != UDP_GRO) continue;
      std::memcpy(&gro, CMSG_DATA(c), sizeof gro);
      if (gro > 0 && static_cast<size_t>(gro) < len) seg = static_cast<size_t>(gro);
    }
    if (seg < len) ++joined_;
    // Datagrams joined by the kernel are all `seg` bytes long but the last, which may be shorter.
    for (size_t off = 0; off < len || len == 0; off += seg) {
      views_.push_back({data + off, std::min(seg, len - off), i});
      if (len == 0) break;
    }
  }
  return views_.size();
}

}  // namespace smartcoll::udp
