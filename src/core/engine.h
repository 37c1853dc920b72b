// The progress engine: a pool of workers that run tasks (core/task.h) as post/progress state machines.
//
// Worker w owns streams s with s mod workers == w, their channels and the lanes of every task on them. Whoever
// holds a worker's drive lock progresses it: normally the worker's own thread, but a caller waiting on a call
// that runs on one worker takes the lock itself when the worker is idle, so a small collective makes its system
// calls on the caller's thread with no hand-off in between. A worker out of work polls for spin_us where the spin
// knob lets it (core/spin.h), then sleeps in epoll on its channels, the accepting socket and a wake-up eventfd.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <thread>
#include <vector>

#include "core/config.h"
#include "core/task.h"
#include "smartcoll/comm.h"
#include "transport/socket.h"
#include "transport/transport.h"

namespace smartcoll {

// Reuses large scratch buffers between calls: a fresh allocation of a few MiB costs its page faults every call.
class BufferPool {
 public:
  std::unique_ptr<char[]> take(size_t bytes, size_t& capacity);
  void give(std::unique_ptr<char[]> data, size_t capacity);

 private:
  std::mutex mu_;
  std::vector<std::pair<size_t, std::unique_ptr<char[]>>> free_;
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  using Clock = std::chrono::steady_clock;

  Engine(Transport& transport, const Config& config, int rank);
  ~Engine();
  // Starts the workers (pinned as engine_cpus says); throws InvalidArgument for a CPU that cannot be used.
  void start();

  // Queues a task in call order; tasks with `exclusive` wait until nothing else is in flight and hold later ones.
  void submit(std::unique_ptr<Task> task);
  // Request::wait: drives the task's worker when it is idle, else sleeps until the task finishes or the deadline.
  bool wait(Request& req, std::optional<Clock::time_point> deadline);
  // Lets every queued task finish (or fail), then joins the workers.
  void stop();

  const std::shared_ptr<BufferPool>& pool() const { return pool_; }
  int workers() const { return static_cast<int>(workers_.size()); }
  int worker_of(int stream) const { return stream % workers(); }
  double cpu_seconds() const;
  // Fails every pending and later call with `reason` and tells the peers (through the transport), as the first
  // error of a call would.
  void abort(const std::string& reason) { fail(reason); }

  // Runs fn on worker w's driver at `when` (the engine's timers, for retransmission and the like).
  void at(int w, Clock::time_point when, std::function<void()> fn);

  // Turns the first error into the one every call reports (the communicator completes a disagreement report
  // from the other ranks' descriptors); runs after the peers have been told.
  std::function<std::string(const std::string&)> explain_failure;
  // Called with the disagreement this rank found, before the communicator fails (to publish both calls).
  std::function<void(const struct Disagreement&)> on_disagreement;

 private:
  struct Worker;
  void dispatch(Task* task);  // mu_ held
  // Whether `task` must wait until no other call is in flight (mu_ held). Asked once no call that runs alone is
  // in flight or held before it: a call whose `lanes_instead` says so then becomes a call like any other.
  static bool runs_alone(Task* task);
  void complete(Task* task);
  void fail(const std::string& error);
  void drive(Worker& w, const std::function<bool()>& enough, std::optional<Clock::time_point> deadline);
  bool progress(Worker& w);
  void worker_main(Worker& w);
  void wake(Worker& w);

  Transport& transport_;
  Config config_;
  int rank_;
  std::shared_ptr<BufferPool> pool_ = std::make_shared<BufferPool>();
  std::vector<std::unique_ptr<Worker>> workers_;

  std::mutex mu_;  // the queue of tasks in call order
  std::deque<Task*> held_;
  int inflight_ = 0;
  bool exclusive_running_ = false;
  bool stopping_ = false;
  std::condition_variable idle_cv_;

  std::atomic<bool> failing_{false}, failed_{false};
  // Written once by fail() and never read: it stays readable in every worker's epoll set, so a driver's sleep
  // ends at once after a failure. (A worker's wake descriptor is read by whoever wakes first: a caller driving
  // that worker could sleep on after the worker's own thread took fail()'s wake-up.)
  net::Fd failfd_;
  std::mutex failure_mu_;
  std::string failure_;
};

}  // namespace smartcoll
