// UDP datagrams for the switch protocol (switch/protocol.h): bound sockets with large buffers, and batches that
// move many datagrams per system call (sendmmsg, recvmmsg), shared by the switch and its workers.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/socket.h"

namespace smartcoll::udp {

// host: dotted IPv4 ("0.0.0.0": every interface); port 0: any free one. Non-blocking, with buffers of `buffer`
// bytes each way where the system allows. Throws CommError saying what failed.
net::Fd open(const std::string& host, uint16_t port, int buffer = 8 << 20);
std::string to_string(const sockaddr_in& a);
uint16_t port_of(const sockaddr_in& a);

// Datagrams queued to go out together. Each is one or two pieces (a header and a payload elsewhere) that must
// stay valid until flush().
class SendBatch {
 public:
  explicit SendBatch(size_t capacity = 64);
  bool full() const { return used_ == msgs_.size(); }
  size_t size() const { return used_; }
  void add(const sockaddr_in& to, const void* a, size_t alen, const void* b = nullptr, size_t blen = 0);
  // Sends everything queued, waiting at most about `patience_ms` in all for room in the socket's buffer;
  // returns how many datagrams could not be sent (dropped, as a network would).
  size_t flush(int fd, int patience_ms = 20);

 private:
  std::vector<mmsghdr> msgs_;
  std::vector<iovec> iov_;
  std::vector<sockaddr_in> to_;
  size_t used_ = 0;
};

// Buffers for up to `capacity` datagrams of up to `max_len` bytes each.
class RecvBatch {
 public:
  RecvBatch(size_t capacity, size_t max_len);
  // Receives what is waiting without blocking; returns how many datagrams (0: none). Throws CommError on an
  // error other than "nothing waiting".
  size_t receive(int fd);
  const uint8_t* data(size_t i) const { return buf_.get() + i * stride_; }
  // A datagram longer than max_len shows as max_len + 1 bytes (cut short), so that it fails to parse.
  size_t len(size_t i) const { return msgs_[i].msg_len; }
  const sockaddr_in& from(size_t i) const { return from_[i]; }

 private:
  size_t stride_;
  std::unique_ptr<uint8_t[]> buf_;
  std::vector<mmsghdr> msgs_;
  std::vector<iovec> iov_;
  std::vector<sockaddr_in> from_;
};

}  // namespace smartcoll::udp
