// The offload daemon (`smartcoll nicd`): one per host, the software form of a smart NIC or DPU. The ranks of a
// host connect to it over a Unix socket and hand it their collectives; it reads their input buffers with
// process_vm_readv, combines them (in rank order), runs the inter-host part with the other hosts' daemons of the
// same job through an inter-host communicator (one member per host, rank = host number, formed through the
// job's rendezvous store under its own keys), and writes the results back with process_vm_writev.
//
// One control thread accepts connections and reads every message; each job has a worker thread that runs its
// calls in order, on the CPUs set aside for the daemon. A rank that leaves without saying bye (it exited or
// crashed) fails its job here and, through the inter-host communicator's abort, on every other host.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/socket.h"

namespace smartcoll::nicd {

struct ServerOptions {
  std::string socket;     // Unix socket path (created mode 0600: the daemon serves its own user only)
  std::vector<int> cpus;  // the daemon's threads and its inter-host engine run here; empty: not pinned
  double timeout = 60;    // seconds a job waits for a local rank's next call once another local rank posted it,
                          // and (at most 10) a new connection for its hello
};

struct ServerStats {
  uint64_t connections = 0;  // accepted
  uint64_t refused = 0;      // connections dropped: another user, a malformed message, a job that does not fit
  uint64_t jobs_formed = 0, jobs_failed = 0, jobs_now = 0;
  uint64_t calls = 0;  // collectives completed (once per job, not per rank)
  uint64_t bytes_read = 0, bytes_written = 0;  // of the ranks' memory
  // Bytes of the ranks' data one job held at most after a call: its window of chunks in flight, the piece a
  // reduction combines in and an alltoall's part of every block, whatever the call's size.
  uint64_t buffer_peak = 0;
};

struct Job;

class Server {
 public:
  // Binds the socket (replacing a stale one nobody listens on); throws CommError when it is in use.
  explicit Server(ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  void start();
  void stop();  // idempotent: fails the jobs still running, ends every thread, removes the socket
  ServerStats stats() const;
  // What happened since the last call (a job formed, failed or ended; a connection refused), for the log.
  std::vector<std::string> take_events();
  const std::string& path() const { return options_.socket; }

 private:
  struct Connection;
  void serve();
  void on_message(Connection& c, std::string_view msg);
  void on_hello(Connection& c, std::string_view msg);
  void drop(int fd, const std::string& why);
  void reap();
  void event(std::string text);

  ServerOptions options_;
  net::Fd listener_;
  std::map<int, std::unique_ptr<Connection>> connections_;  // by fd; the control thread's
  std::map<std::string, std::shared_ptr<Job>> jobs_;        // by "uid/job id"; the control thread's
  std::thread control_;
  std::atomic<bool> stop_{false};
  mutable std::mutex stats_mu_;
  ServerStats stats_;
  std::vector<std::string> events_;
  friend struct Job;
};

}  // namespace smartcoll::nicd
