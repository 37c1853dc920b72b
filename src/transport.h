// TCP transport: a full mesh of connections (`streams` per peer), progressed with non-blocking I/O and epoll
// from one thread, the engine's. Sends go straight from the caller's buffers (no staging copy).
#pragma once

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "smartcoll/knobs.h"
#include "smartcoll/store.h"
#include "socket.h"

namespace smartcoll {

class Transport {
 public:
  // Rendezvous: listen, publish "host:port" under "<prefix>addr/<rank>", connect to every peer.
  // route_hint: a host (MASTER_ADDR) whose route picks the listening address when no addr or ifname is set.
  Transport(int rank, int size, Store& store, const Options& options, const std::string& route_hint);
  ~Transport();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int streams() const { return streams_; }
  const std::string& address_of(int peer) const { return addrs_[peer]; }

  // Non-blocking attempts: bytes moved (0 when the socket would block). Throw CommError naming the peer
  // when the connection is closed or broken.
  size_t try_send(int peer, int stream, const void* buf, size_t len);
  size_t try_recv(int peer, int stream, void* buf, size_t len);

  // Tracks progress for the no-progress timeout; block() waits for socket readiness or throws naming
  // what `waiting_for` describes once `timeout` has passed with no progress.
  class Progress {
   public:
    explicit Progress(Transport& t) : t_(t), last_(net::Clock::now()) {}
    void made() { last_ = net::Clock::now(); }
    template <class Describe>
    void block(Describe&& waiting_for) {
      auto limit = std::chrono::duration_cast<net::Clock::duration>(t_.timeout_);
      if (!t_.wait_ready(last_ + limit)) t_.fail_timeout(waiting_for());
    }

   private:
    Transport& t_;
    net::Clock::time_point last_;
  };

  // A whole-buffer send or receive, for exchange-style algorithms.
  struct Op {
    int peer;
    bool send;
    char* buf;
    size_t len;
    size_t done = 0;
  };
  // Runs all ops to completion concurrently on stream 0.
  void run(std::span<Op> ops);

  // Shuts every connection down so that peers blocked on this rank fail at once instead of timing out.
  void abort();

  std::string context;  // name of the collective in progress, for error messages

 private:
  bool wait_ready(net::Clock::time_point deadline);
  [[noreturn]] void fail_timeout(const std::string& waiting_for);
  [[noreturn]] void fail_peer(int peer, const std::string& what);
  int fd(int peer, int stream) const { return fds_[peer * streams_ + stream].get(); }

  int rank_, size_;
  int streams_;
  std::chrono::duration<double> timeout_;
  std::vector<net::Fd> fds_;  // [peer * streams + stream]; empty for self
  std::vector<std::string> addrs_;
  net::Fd epoll_;
};

}  // namespace smartcoll
