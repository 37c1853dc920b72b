// TCP transport: `streams` connections per peer pair, opened when first used (the higher rank connects to the
// lower one's listening socket and says who it is in a hello), non-blocking, progressed by epoll. Sends go
// straight from the caller's buffers. A peer in the same network namespace (on the same host) is reached over a
// Unix-domain stream socket instead where it can be (the unix_sockets knob): the same bytes and hello, without
// the TCP/IP stack.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>

#include "core/config.h"
#include "smartcoll/store.h"
#include "transport/socket.h"
#include "transport/transport.h"

namespace smartcoll {

// The first bytes a connecting rank sends, in host byte order (one job runs one build).
inline constexpr uint32_t kHelloMagic = 0x53434c34;  // "SCL4"
struct Hello {
  uint32_t magic, rank, stream, size;
  uint64_t job;  // job_fingerprint(job id)
};
uint64_t job_fingerprint(const std::string& job_id);
// Why the accepting rank `rank` refuses `h` ("" to accept); every field is range-checked before it is used.
std::string hello_refusal(const Hello& h, int rank, int size, int streams, uint64_t job);

class TcpTransport final : public Transport {
 public:
  // Listens and publishes "host:port" (see claim); connects to nobody yet. route_hint: a host
  // (MASTER_ADDR) whose route picks the listening address when neither addr nor ifname is set.
  // `claim`: this process's nonce for its rank; the address goes under "addr/<rank>/<claim>".
  TcpTransport(int rank, int size, std::shared_ptr<Store> store, const Config& config,
               const std::string& route_hint, const std::string& claim = "");
  // The claim rank 0 accepted for each rank (start-up): peers' addresses are looked up under these alone.
  void accept_claims(std::vector<std::string> claims) { claims_ = std::move(claims); }
  const std::vector<std::string>& claims() const { return claims_; }
  ~TcpTransport() override;

  void attach(std::vector<int> epoll_fds) override;
  bool connect(int peer, int stream) override;
  void accept_incoming() override;
  bool listens_on(int fd) const override { return fd >= 0 && (fd == listener_.get() || fd == local_listener_.get()); }
  size_t send(int peer, int stream, const iovec* iov, int iovcnt) override;
  size_t recv(int peer, int stream, const iovec* iov, int iovcnt) override;
  int pollable(int peer, int stream) const override { return chan(peer, stream).fd.load(); }
  int open_channels() const override;
  int local_channels() const override { return local_channels_.load(); }
  // The host this rank listens on ("" when it listens nowhere: a world of one).
  std::string host() const { return addrs_[rank()].substr(0, addrs_[rank()].rfind(':')); }
  void abort(const std::string& reason) override;
  bool aborted() const override { return aborted_; }

 private:
  struct Channel {
    std::atomic<int> fd{-1};
    net::Fd owned;
    net::Clock::time_point waiting_since{};  // accepting side: when this rank first needed it
    net::Clock::time_point looked{};         // accepting side: when this rank last looked for the peer's failure
  };
  struct Pending;  // an accepted connection whose hello has not fully arrived

  Channel& chan(int peer, int stream) { return chans_[static_cast<size_t>(peer) * streams() + stream]; }
  const Channel& chan(int peer, int stream) const { return chans_[static_cast<size_t>(peer) * streams() + stream]; }
  void install(int peer, int stream, net::Fd fd, bool local);  // mu_ held
  net::Fd connect_local(int peer, int stream);                 // empty where it cannot be reached
  void say_hello(int fd, int peer, int stream, net::Clock::time_point deadline) const;
  void watch(int stream, int fd);                   // mu_ held: into the owner's epoll set
  void adopt_pending();                             // mu_ held
  void turn_away();                                 // mu_ held: closes what waits to be accepted
  std::string peer_failure(int peer) override;
  // "rank P failed: why" once P left a reason in the store (abort, a failed call), else ""; asks the store
  // (without waiting behind another thread's request) 500 ms after the first call for `last`, then every 500 ms.
  std::string failed_meanwhile(int peer, net::Clock::time_point& last);
  [[noreturn]] void fail_peer(int peer, const std::string& what);

  std::shared_ptr<Store> store_;
  Config config_;
  uint64_t job_;
  mutable std::mutex mu_;  // connection set-up; I/O on a connected channel needs no lock
  std::unique_ptr<Channel[]> chans_;
  std::vector<std::string> addrs_;
  std::vector<std::string> claims_;
  net::Fd listener_;
  net::Fd local_listener_;        // the Unix socket (unix_sockets=auto); none where it could not be made
  std::unique_ptr<std::atomic<bool>[]> local_peer_;  // [peer]: a channel to it is a Unix socket
  std::atomic<int> local_channels_{0};
  std::vector<int> epfds_;
  std::vector<std::unique_ptr<Pending>> pending_;
  std::atomic<bool> aborted_{false};
};

}  // namespace smartcoll
