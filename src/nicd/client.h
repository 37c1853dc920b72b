// A rank's side of engine=nicd: the connection to the host's offload daemon (`smartcoll nicd`). The rank only
// posts its calls (what to run and where its buffers are) and waits; the daemon reads the buffers with
// process_vm_readv, runs the collective with the other local ranks and the other hosts' daemons, writes the
// results with process_vm_writev and says "done". A reader thread completes the requests, or the caller waiting on
// one while it polls (drive).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/spin.h"
#include "nicd/protocol.h"
#include "smartcoll/comm.h"
#include "transport/socket.h"

namespace smartcoll::nicd {

// Throws InvalidArgument naming what engine=nicd runs when it cannot run `coll` with `codec`.
void check_supported(Collective coll, const Codec& codec);

class Client : public std::enable_shared_from_this<Client> {
 public:
  // Connects to the daemon at `path`, introduces this rank and waits until the daemon has formed the job (all
  // local ranks connected, the other hosts' daemons joined). Throws CommError naming the socket and the cause.
  // `spin`: how a caller that waits on a call polls for the answer itself (drive).
  Client(const std::string& path, const Hello& hello, const Spinner& spin);
  ~Client();  // close()
  // Waits for the calls still running, says bye (a normal leave, not a failure) and closes the connection; later
  // calls fail at once. The communicator's close calls it even while another thread still holds the client (a
  // caller inside drive), so that no call runs after close returns. Once only.
  void close();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Posts call number `seq`; the request completes when the daemon says so, or fails when the daemon goes away
  // or stays silent for the timeout. `keep` (a list call's views, which its tables are in) lives until the
  // daemon has answered, or with the client where it never did.
  std::shared_ptr<Request> post(const Post& p, std::shared_ptr<const void> keep = nullptr);
  // Tells the daemon, which fails the job on every rank and answers this rank's pending calls with the reason
  // (once it no longer touches their buffers); later calls fail at once.
  void abort(const std::string& reason);
  int daemon_pid() const { return daemon_pid_; }
  // Request::wait's part: while the spinner polls, the waiting caller reads the daemon's answers itself, so that
  // an answer that comes meanwhile completes `req` with no hand-off from the reader thread; then (or when another
  // caller drives) it returns and the caller sleeps on the request. One caller drives at a time.
  void drive(Request& req, std::optional<std::chrono::steady_clock::time_point> deadline);
  uint64_t driven_answers() const { return driven_.load(std::memory_order_relaxed); }

 private:
  void close_once();
  void read_loop();
  // Reads and applies every message the socket holds; false once the connection is broken (mu_ held). Counts
  // the answers in `answers`.
  bool take_messages(std::chrono::steady_clock::time_point now, uint64_t& answers);
  void fail_all(const std::string& why);  // mu_ held
  std::string where() const;

  std::string path_;
  net::Fd fd_;
  int daemon_pid_ = 0;
  double timeout_ = 60;
  std::mutex mu_;
  struct Pending {
    std::shared_ptr<Request> req;
    std::shared_ptr<const void> keep;
  };
  std::map<uint64_t, Pending> pending_;
  // What calls that failed without the daemon's answer kept: a daemon that was only slow may still read them.
  std::vector<std::shared_ptr<const void>> unanswered_;
  std::string broken_;  // why the daemon cannot be used any more; empty while it can
  std::chrono::steady_clock::time_point heard_;  // when the daemon last sent anything
  std::atomic<bool> stop_{false};
  std::thread reader_;
  std::string inbox_ = std::string(kMaxMessage, '\0');  // take_messages' buffer (mu_)
  std::mutex drive_mu_;  // the caller that drives, or the reader thread while it reads
  Spinner spin_;         // its polling state (drive_mu_)
  pid_t pid_;            // the process that connected
  std::once_flag closed_;
  std::atomic<uint64_t> driven_{0};  // answers a driving caller took
};

}  // namespace smartcoll::nicd
