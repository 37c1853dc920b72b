// UDP datagrams for the switch protocol (switch/protocol.h): bound sockets with large buffers, and batches that
// move many datagrams per system call (sendmmsg, recvmmsg), shared by the switch and its workers.
//
// With offload on, the batches also let the kernel cut and join datagrams (Linux UDP segmentation offload):
// datagrams of one flush to the same address and of the same length go as one message with a UDP_SEGMENT
// control message (one pass through the stack for up to 64 of them), and a socket with UDP_GRO may receive
// several datagrams of one sender joined in one buffer, which RecvBatch cuts again at the segment size the
// kernel reports. Both fall back to one datagram at a time where the kernel refuses (no UDP_GRO, a segment
// larger than the route's MTU): the datagrams on the wire are the same either way.
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
// Asks the kernel to join received datagrams (UDP_GRO); false where it refuses.
bool enable_gro(int fd);
std::string to_string(const sockaddr_in& a);
uint16_t port_of(const sockaddr_in& a);

// Datagrams queued to go out together. Each is one or two pieces (a header and a payload elsewhere) that must
// stay valid until flush().
class SendBatch {
 public:
  // offload: send runs of equal datagrams to one address with UDP_SEGMENT.
  explicit SendBatch(size_t capacity = 64, bool offload = false);
  bool full() const { return used_ == to_.size(); }
  size_t size() const { return used_; }
  bool offload() const { return offload_; }
  // System calls and kernel messages of every flush so far, and the segmented messages the kernel refused.
  struct Counts {
    uint64_t calls = 0, messages = 0, datagrams = 0, refused = 0;
  };
  const Counts& counts() const { return counts_; }
  void add(const sockaddr_in& to, const void* a, size_t alen, const void* b = nullptr, size_t blen = 0);
  // Sends everything queued, waiting at most about `patience_ms` in all for room in the socket's buffer;
  // returns how many datagrams could not be sent (dropped, as a network would).
  size_t flush(int fd, int patience_ms = 20);

 private:
  struct Datagram {
    uint32_t first_iov, iovs, len;
  };
  void build(size_t from);  // the kernel messages for datagrams order_[from..]
  std::vector<iovec> iov_;       // each datagram's pieces, by datagram
  std::vector<sockaddr_in> to_;  // by datagram
  std::vector<Datagram> dgrams_;
  std::vector<uint32_t> order_;  // datagrams grouped by address (offload), each group in the order added
  std::vector<mmsghdr> msgs_;    // the kernel messages of the flush
  std::vector<iovec> msg_iov_;
  std::vector<uint32_t> msg_first_;  // per message: its first position in order_, and its datagram count
  std::vector<uint32_t> msg_count_;
  std::vector<uint16_t> msg_seg_;    // per message: its UDP_SEGMENT size (0: a single datagram)
  std::vector<uint8_t> cmsg_;        // per message: the control message buffer
  size_t used_ = 0, messages_ = 0;
  bool offload_, probed_ = false;
  size_t max_segment_ = SIZE_MAX;  // segments the kernel refused above this size go one by one
  Counts counts_;
};

// Buffers for up to `capacity` kernel messages of up to `max_len` bytes each (64 KiB each with offload, where a
// message may hold several datagrams joined by the kernel).
class RecvBatch {
 public:
  RecvBatch(size_t capacity, size_t max_len, bool offload = false);
  // Receives what is waiting without blocking; returns how many datagrams (0: none). Throws CommError on an
  // error other than "nothing waiting".
  size_t receive(int fd);
  const uint8_t* data(size_t i) const { return views_[i].data; }
  // A datagram longer than max_len shows longer than max_len (cut short at one byte more without offload), so
  // that it fails to parse.
  size_t len(size_t i) const { return views_[i].len; }
  const sockaddr_in& from(size_t i) const { return from_[views_[i].msg]; }
  uint64_t joined() const { return joined_; }  // received messages that held more than one datagram

 private:
  struct View {
    const uint8_t* data;
    size_t len;
    size_t msg;
  };
  size_t stride_;
  std::unique_ptr<uint8_t[]> buf_;
  std::vector<mmsghdr> msgs_;
  std::vector<iovec> iov_;
  std::vector<sockaddr_in> from_;
  std::vector<uint8_t> cmsg_;
  std::vector<View> views_;
  bool offload_;
  uint64_t joined_ = 0;
};

}  // namespace smartcoll::udp
