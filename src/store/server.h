// The TCP store's server: one thread running one epoll loop over non-blocking sockets, so that no client can
// hold up another (a client that stops reading only stops being served itself). Clients are known by an id
// that is never reused, so a pending get is answered to the client that asked or to no one.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "smartcoll/store.h"
#include "store/protocol.h"
#include "transport/socket.h"

namespace smartcoll::store {

class Server {
 public:
  Server(net::Fd listener, std::string secret, const StoreLimits& limits);
  // Serves on for up to kLinger while other ranks are still connected: a rank that fails reads the others'
  // reports from the store after rank 0 may already be closing.
  ~Server();
  StoreServerStats stats() const;

  static constexpr auto kLinger = std::chrono::seconds(3);
  // How long accept() pauses after running out of descriptors: long enough not to spin, short enough that a
  // rank connecting once some are free is served without noticing.
  static constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

 private:
  struct Client;
  using Time = net::Clock::time_point;

  void run();
  void accept_clients(Time now);
  void update_listener(Time now);
  void on_event(Client& c, uint32_t events, Time now);
  void on_proof(Client& c, std::string_view& bytes);
  void serve(Client& c);
  void execute(Client& c, Request& r);
  void reply(Client& c, std::optional<std::string_view> value);  // nullopt: a check of a key not there
  void send_bytes(Client& c, const std::string& bytes);
  void flush(Client& c, Time now);
  void update_events(Client& c);
  void account(Client& c);
  void drop(Client& c, const std::string& why, std::atomic<uint64_t>* counter);
  void sweep(Time now);

  net::Fd listener_;
  net::Fd epoll_;
  net::Fd wake_;  // eventfd: the destructor's nudge
  const std::string secret_;
  const StoreLimits limits_;
  std::atomic<bool> stop_{false};

  // Owned by the loop thread.
  std::unordered_map<uint64_t, std::unique_ptr<Client>> clients_;
  uint64_t next_id_ = 2;  // 0 and 1 tag the listener's and the wake-up's events
  std::map<std::string, std::string> values_;
  std::multimap<std::string, uint64_t> waiting_;  // key -> ids of clients whose get waits for it
  std::vector<uint64_t> woken_;                    // clients whose get was answered: serve their next requests
  std::vector<uint64_t> dropped_;                  // clients closed in this loop iteration, erased at its end
  size_t buffered_ = 0;                            // sum of every client's accounted bytes
  bool listening_ = true;
  Time accept_resume_{};
  Time next_sweep_{};
  Time last_backoff_log_{};
  std::vector<char> read_buf_;

  struct Counters {
    std::atomic<uint64_t> loop_iterations{0}, accepted{0}, clients{0}, bad_requests{0}, refused{0}, timed_out{0},
        over_buffer{0}, accept_backoffs{0}, keys{0};
  } stats_;

  std::thread thread_;
};

}  // namespace smartcoll::store
