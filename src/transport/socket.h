// Thin POSIX TCP helpers shared by the rendezvous store and the data transport.
#pragma once

#include <netinet/in.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "smartcoll/types.h"

namespace smartcoll::net {

// send_all or recv_all reached its deadline (any other failure of theirs is a plain CommError).
class TimedOut : public CommError {
 public:
  using CommError::CommError;
};

using Clock = std::chrono::steady_clock;

// Owns one file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() { int f = fd_; fd_ = -1; return f; }
  void reset();
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

struct Endpoint {
  std::string host;  // dotted IPv4
  uint16_t port = 0;
  std::string str() const { return host + ":" + std::to_string(port); }
};

// The IPv4 address of an interface; throws naming the interface and listing the ones that exist.
std::string interface_address(const std::string& ifname);
// The local address the kernel would use to reach `remote` (no packet is sent).
std::string local_address_towards(const std::string& remote_host);
// Resolves a host name or dotted address to dotted IPv4.
std::string resolve_ipv4(const std::string& host);
// host (dotted IPv4) and port as a socket address; throws InvalidArgument for a bad address.
sockaddr_in ipv4_address(const std::string& host, uint16_t port);

Fd listen_on(const std::string& host, uint16_t port, int backlog);  // port 0: any free port
uint16_t bound_port(int fd);
// Connects, retrying refused connections until the deadline (the listener may not be up yet).
// Tries again (a peer not listening yet refuses) until `deadline`, or until `give_up`, asked with the errno of
// each failed try, returns a reason: then throws CommError with it.
Fd connect_to(const Endpoint& ep, Clock::time_point deadline, const std::function<std::string(int)>& give_up = {});
Fd accept_from(int listen_fd, Clock::time_point deadline);
// The abstract name of a job's Unix socket: "smartcoll/<job fingerprint, hex>/<rank>/<what>".
std::string job_socket_name(uint64_t job, int rank, const std::string& what);
// A Unix-domain stream socket listening on `name` in the abstract namespace (no file; the name vanishes with the
// socket), which the network namespace scopes: only processes in this one can reach it.
Fd listen_abstract(const std::string& name, int backlog);
// Connects to the abstract socket `name`; an empty Fd where nobody listens there (the peer is in another network
// namespace), retrying while its backlog is full until the deadline.
Fd connect_abstract(const std::string& name, Clock::time_point deadline);

// Blocking full transfers with a deadline, for setup traffic only (the data path uses non-blocking I/O).
void send_all(int fd, const void* buf, size_t len, Clock::time_point deadline, const std::string& what);
void recv_all(int fd, void* buf, size_t len, Clock::time_point deadline, const std::string& what);

// Raises this process's soft limit on open descriptors to 65536 (or the hard limit, if lower), once; a higher
// soft limit is left alone. A rank may hold a connection to every peer (alltoall) and more streams to its ring
// neighbours: a few hundred peers pass the common soft limit of 1024.
void raise_descriptor_limit();

// Whether the other end of a stream has closed it (what it sent before may still be unread here).
bool closed_by_peer(int fd);
void set_nonblocking(int fd, bool on);
void set_nodelay(int fd);
void set_buffer_sizes(int fd, int bytes);

}  // namespace smartcoll::net
