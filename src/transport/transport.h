// The transport interface: reliable, ordered byte channels to peers, `streams` of them per peer, each one owned
// by one engine worker (stream s by worker s mod workers), which alone does its I/O. Channels open lazily, when
// an algorithm first uses them, so a rank holds connections only to the peers it talks to.
//
// Messages carry no framing: both ends of a channel know from the call's schedule, in the same order, how many
// bytes come next (the engine checks that the two ranks made the same call first; see core/engine.h).
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace smartcoll {

class Transport {
 public:
  virtual ~Transport() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int streams() const { return streams_; }

  // Registers channel (peer, s), once connected, and the accepting socket with epoll set epoll_fds[s % size]:
  // the engine worker that owns stream s sleeps on it.
  virtual void attach(std::vector<int> epoll_fds) = 0;
  // True once the channel is connected. Does what connecting takes without waiting for the peer: connects (the
  // higher rank of a pair connects; this is quick on a LAN) or adopts connections the peer made. Throws
  // CommError when the peer cannot be reached within connect_timeout.
  virtual bool connect(int peer, int stream) = 0;
  // Adopts the connections peers have made (the accepting socket is readable); drops strangers.
  virtual void accept_incoming() = 0;
  // True for an accepting socket registered by attach().
  virtual bool listens_on(int fd) const = 0;
  // Non-blocking scatter/gather I/O: bytes moved, 0 when the channel would block. Throws CommError naming the
  // peer (and why it failed, where it said so) when the channel is closed or broken.
  virtual size_t send(int peer, int stream, const iovec* iov, int iovcnt) = 0;
  virtual size_t recv(int peer, int stream, const iovec* iov, int iovcnt) = 0;
  // A descriptor that polls readable/writable with the channel (-1 while not connected).
  virtual int pollable(int peer, int stream) const = 0;
  // Connections this rank holds now (for tests of lazy connection).
  virtual int open_channels() const = 0;
  // Of those, the ones to peers on this host that bypass the network stack (Unix sockets).
  virtual int local_channels() const { return 0; }
  // Tells the peers why this rank fails (through the rendezvous store) and shuts every channel down, so that
  // ranks blocked on this one fail at once with that reason instead of timing out.
  virtual void abort(const std::string& reason) = 0;
  // True once abort() ran: this rank's communicator has failed (loops that do not use the channels stop).
  virtual bool aborted() const { return false; }
  // Why rank `peer` failed, where it said so before (abort(), through the store); empty when it did not.
  virtual std::string peer_failure(int /*peer*/) { return ""; }

  // A whole-buffer send or receive for exchange-style control traffic.
  struct Op {
    int peer;
    bool send;
    char* buf;
    size_t len;
    size_t done = 0;
  };
  // Runs all ops on stream 0 to completion, blocking, failing after `timeout` without progress. For start-up
  // and the same-host path's control messages, when no engine worker uses the channels. Returns false where
  // `until` comes first: the ops keep what they did and a later run() goes on with them. `progress`, where
  // given, is the time of the last progress, kept across such runs (so the timeout counts from it, not from
  // each run's start).
  using Clock = std::chrono::steady_clock;
  bool run(std::span<Op> ops, Clock::time_point until = Clock::time_point::max(),
           Clock::time_point* progress = nullptr);

  std::string context;  // the collective in progress, for error messages
  std::chrono::duration<double> timeout{60};

 protected:
  Transport(int rank, int size, int streams) : rank_(rank), size_(size), streams_(streams) {}

 private:
  bool run_ops(std::span<Op> ops, Clock::time_point until, Clock::time_point* progress);
  int rank_, size_, streams_;
};

// Sends the same `bytes` at `mine` to every peer and receives each peer's into all + peer * bytes (all + rank * bytes
// gets a copy of mine), all at once on stream 0 (Transport::run).
void exchange(Transport& t, const void* mine, void* all, size_t bytes);
// The ops of that exchange (all + rank * bytes already filled), for a caller that runs them in steps.
std::vector<Transport::Op> exchange_ops(Transport& t, const void* mine, void* all, size_t bytes);

}  // namespace smartcoll
