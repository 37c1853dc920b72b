// The aggregation switch (`smartcoll switch`): the Aggregator's state served on UDP by `threads` threads,
// thread t on port base + t with the slots s of every job where s mod threads == t, so that threads share no
// data on the packet path. A janitor on thread 0 frees the slots of jobs that went silent.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "switch/aggregator.h"
#include "transport/socket.h"

namespace smartcoll::sw {

// Faults the switch injects for tests: each received and each sent datagram is dropped with probability `drop`,
// doubled with `dup`; a received one is held back behind the next with `reorder`.
struct Faults {
  double drop = 0, dup = 0, reorder = 0;
  uint64_t seed = 1;
};

struct SwitchOptions {
  std::string host = "0.0.0.0";
  uint16_t port = 0;  // 0: the first run of `threads` free ports found
  int threads = 1;
  uint32_t slots = 4096;     // slots of all jobs together
  double job_timeout = 60;   // seconds without a valid datagram after which a job's slots are freed
  bool full_auth = false;    // refuse jobs that do not authenticate payloads
  bool offload = true;       // UDP segmentation offload (GSO, GRO; transport/udp.h)
  Faults faults;
};

class Switch {
 public:
  // Binds the sockets; throws CommError (a port in use) or InvalidArgument (bad options).
  explicit Switch(const SwitchOptions& options);
  ~Switch();
  Switch(const Switch&) = delete;
  Switch& operator=(const Switch&) = delete;

  void start();
  void stop();  // idempotent; returns once every thread has ended (within about 100 ms)
  uint16_t port() const { return port_; }
  const SwitchOptions& options() const { return options_; }
  SwitchStats stats() const;
  // Ids of jobs freed for silence since the last call (for the log).
  std::vector<uint64_t> take_expired();

 private:
  struct IoCounters;
  void serve(int t);
  SwitchOptions options_;
  std::unique_ptr<IoCounters[]> io_;  // one per thread
  Aggregator agg_;
  std::vector<net::Fd> sockets_;
  uint16_t port_ = 0;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::mutex expired_mu_;
  std::vector<uint64_t> expired_;
};

}  // namespace smartcoll::sw
