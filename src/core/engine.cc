#include "core/engine.h"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/agreement.h"
#include "core/frame.h"
#include "core/log.h"
#include "nicd/client.h"

namespace smartcoll {

// ---- scratch memory ----

std::unique_ptr<char[]> BufferPool::take(size_t bytes, size_t& capacity) {
  {
    std::lock_guard lock(mu_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->first >= bytes && (best == free_.end() || it->first < best->first)) best = it;
    if (best != free_.end()) {
      capacity = best->first;
      auto data = std::move(best->second);
      free_.erase(best);
      return data;
    }
  }
  capacity = bytes;
  return std::unique_ptr<char[]>(new char[std::max<size_t>(bytes, 1)]);
}

void BufferPool::give(std::unique_ptr<char[]> data, size_t capacity) {
  constexpr size_t kKeep = 16;  // buffers kept for reuse; a steady stream of calls needs a few per call
  std::lock_guard lock(mu_);
  free_.emplace_back(capacity, std::move(data));
  if (free_.size() > kKeep)
    free_.erase(std::min_element(free_.begin(), free_.end(),
                                 [](const auto& a, const auto& b) { return a.first < b.first; }));
}

Scratch::Scratch(std::shared_ptr<BufferPool> pool, size_t bytes) : pool_(std::move(pool)) {
  data_ = pool_->take(bytes, capacity_);
}

Scratch::~Scratch() {
  if (data_) pool_->give(std::move(data_), capacity_);
}

// ---- requests ----

bool Request::test() { return done_.load(std::memory_order_acquire); }

bool Request::wait(std::optional<std::chrono::duration<double>> timeout) {
  std::optional<Engine::Clock::time_point> deadline;
  if (timeout)
    deadline = Engine::Clock::now() + std::chrono::duration_cast<Engine::Clock::duration>(*timeout);
  if (!done_.load(std::memory_order_acquire)) {
    if (auto engine = engine_.lock())
      engine->wait(*this, deadline);
    else if (auto client = nicd_.lock())
      client->drive(*this, deadline);
  }
  std::unique_lock lock(mu_);
  if (deadline) {
    if (!cv_.wait_until(lock, *deadline, [&] { return done_.load(); })) return false;
  } else {
    cv_.wait(lock, [&] { return done_.load(); });
  }
  if (!error_.empty()) throw CommError(error_);
  return true;
}

void Request::finish(std::string error) {
  {
    std::lock_guard lock(mu_);
    error_ = std::move(error);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

// ---- workers ----

namespace {

struct OpRef {
  Task* task;
  Lane* lane;
  uint32_t index;
  Op& op() const { return lane->ops[index]; }
};

// The ops queued on one channel, in call order; only the head of each direction moves.
struct ChannelQueue {
  int peer = 0, stream = 0;
  std::deque<OpRef> sends, recvs;
  size_t sent = 0, received = 0;  // bytes of the head op moved, its header included
  PieceCursor send_at, recv_at;   // where in the head op's pieces
  Descriptor header{};            // the head receive's header as it arrives
  bool listed = false;
};

constexpr size_t kHeader = sizeof(Descriptor);
// How long after a caller last drove its own call the worker still expects callers to drive the next ones.
constexpr int64_t kCallerModeNs = 20'000'000;
// Work posted this recently, while callers drive their calls, is most likely a call whose caller is between
// posting it and waiting on it (microseconds, unless the scheduler takes its core): the worker's thread leaves it
// to that caller.
constexpr int64_t kPostToWaitNs = 1'000'000;

bool ready(const Lane& lane, const Op& op) {
  for (int32_t d : op.deps)
    if (d >= 0 && !lane.ops[static_cast<size_t>(d)].done) return false;
  return true;
}

std::string describe_waits(const std::vector<ChannelQueue>& chans, const std::vector<int>& active) {
  std::string s;
  for (int i : active) {
    const ChannelQueue& c = chans[static_cast<size_t>(i)];
    if (!c.recvs.empty()) s += std::string(s.empty() ? "" : " and ") + "receiving from rank " + std::to_string(c.peer);
    if (!c.sends.empty() && ready(*c.sends.front().lane, c.sends.front().op()))
      s += std::string(s.empty() ? "" : " and ") + "sending to rank " + std::to_string(c.peer);
  }
  return s.empty() ? "on local work" : "while " + s;
}

}  // namespace

struct Engine::Worker {
  int index = 0;
  std::thread thread;
  std::mutex drive_mu;  // held by whoever progresses this worker
  std::mutex inbox_mu;  // new lanes and timers from other threads
  std::vector<std::pair<Task*, Lane*>> inbox;
  std::vector<std::pair<Clock::time_point, std::function<void()>>> new_timers;
  std::atomic<int> pending{0};  // lanes queued or running here; read without the drive lock
  std::atomic<bool> callers_drive{false};  // the last call was driven by its waiting caller
  std::atomic<int64_t> caller_done_at{0};   // when (Clock ticks)
  std::atomic<int64_t> posted_at{0};        // when a call with a waiting driver was last queued here
  std::atomic<bool> take_now{false};        // work queued here that no caller drives: the thread takes it at once
  std::atomic<bool> sleeping_long{false};   // the thread sleeps until woken (up to a second)
  net::Fd epfd, wakefd;
  bool stop = false;  // under inbox_mu
  // Driver-only state.
  std::vector<ChannelQueue> chans;
  std::vector<int> active;  // indices into chans with queued ops
  std::vector<std::pair<Task*, Lane*>> lanes;
  std::vector<std::pair<Clock::time_point, std::function<void()>>> timers;
  Clock::time_point last_progress = Clock::now();
  const Task* doing = nullptr;  // the task whose op is moving, to name it when that fails
  Clock::time_point until;      // an op that runs alone waits for its peers until then (the driver's deadline)
  bool alone_yielded = false;   // that op stopped at `until` and runs again at once
  Spinner spin{SpinMode::off, 0, false};
};

Engine::Engine(Transport& transport, const Config& config, int rank)
    : transport_(transport), config_(config), rank_(rank),
      failfd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (!failfd_) throw CommError("cannot create the engine's eventfd: " + std::string(std::strerror(errno)));
  std::vector<int> epfds;
  for (int i = 0; i < config.engine_threads; ++i) {
    auto w = std::make_unique<Worker>();
    w->index = i;
    w->spin = Spinner(config.spin, config.spin_us, config.core_per_rank);
    w->epfd = net::Fd(epoll_create1(EPOLL_CLOEXEC));
    w->wakefd = net::Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!w->epfd || !w->wakefd) throw CommError("cannot create the engine's epoll or eventfd: " +
                                                std::string(std::strerror(errno)));
    for (const int fd : {w->wakefd.get(), failfd_.get()}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      if (epoll_ctl(w->epfd.get(), EPOLL_CTL_ADD, fd, &ev) != 0)
        throw CommError("epoll_ctl(engine eventfd) failed: " + std::string(std::strerror(errno)));
    }
    w->chans.resize(static_cast<size_t>(transport.size()) * transport.streams());
    for (int p = 0; p < transport.size(); ++p)
      for (int s = 0; s < transport.streams(); ++s) {
        auto& c = w->chans[static_cast<size_t>(p) * transport.streams() + s];
        c.peer = p;
        c.stream = s;
      }
    epfds.push_back(w->epfd.get());
    workers_.push_back(std::move(w));
  }
  transport.attach(std::move(epfds));
}

Engine::~Engine() { stop(); }

void Engine::start() {
  for (auto& w : workers_) {
    Worker* wp = w.get();
    w->thread = std::thread([this, wp] { worker_main(*wp); });
    if (config_.engine_cpus.empty()) continue;
    const int cpu = config_.engine_cpus[static_cast<size_t>(w->index) % config_.engine_cpus.size()];
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(w->thread.native_handle(), sizeof set, &set) != 0) {
      stop();
      throw InvalidArgument("cannot pin engine worker " + std::to_string(w->index) + " to CPU " +
                            std::to_string(cpu) +
                            " (SMARTCOLL_ENGINE_CPUS): no such CPU or not allowed for this process");
    }
  }
}

void Engine::wake(Worker& w) {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(w.wakefd.get(), &one, sizeof one);
}

void Engine::submit(std::unique_ptr<Task> task) {
  Task* t = task.release();
  std::lock_guard lock(mu_);
  if (stopping_) {
    std::unique_ptr<Task> owned(t);
    throw InvalidArgument("the communicator is closed");
  }
  const bool wait_turn = exclusive_running_ || !held_.empty() || (runs_alone(t) && inflight_ > 0);
  if (wait_turn)
    held_.push_back(t);
  else
    dispatch(t);
}

bool Engine::runs_alone(Task* t) {
  // Every call before this one that runs alone has finished (the switch path's calls change what
  // `lanes_instead` answers only there), so the answer is the same on every rank; the calls in flight run lanes.
  if (t->exclusive && t->lanes_instead && t->lanes_instead()) {
    t->exclusive = nullptr;
    t->req->algo_ = t->lanes_algo;
  }
  t->lanes_instead = nullptr;
  return t->exclusive != nullptr;
}

void Engine::dispatch(Task* t) {
  ++inflight_;
  if (failed_) {
    // Nothing new starts on a failed communicator; the task fails with the first error.
    t->lanes_left = 0;
    std::lock_guard fl(failure_mu_);
    t->req->finish(t->name() + ": the communicator failed earlier (" + failure_ + "); create a new one");
    --inflight_;
    delete t;
    return;
  }
  if (runs_alone(t)) {
    exclusive_running_ = true;
    // The body runs as the single op of a lane on worker 0.
    t->lanes.clear();
    t->computes.clear();
    Lane lane;
    Op op;
    op.kind = Op::Kind::alone;
    lane.ops.push_back(op);
    t->lanes.push_back(std::move(lane));
  }
  if (t->lanes.empty()) {  // nothing to move (world size 1, count 0): done at once
    if (t->epilogue) t->epilogue();
    --inflight_;
    t->req->finish("");
    delete t;
    return;
  }
  t->lanes_left = static_cast<int>(t->lanes.size());
  // Once its last lane is queued, a worker may run the task to the end and delete it: nothing of the task is read
  // after that (its driver and lanes are taken before).
  const bool driven = t->req->driver_ >= 0;
  Lane* const lanes = t->lanes.data();
  const size_t count = t->lanes.size();
  for (size_t k = 0; k < count; ++k) {
    Worker& w = *workers_[static_cast<size_t>(worker_of(lanes[k].stream))];
    {
      std::lock_guard il(w.inbox_mu);
      w.inbox.emplace_back(t, &lanes[k]);
    }
    if (driven) w.posted_at = Clock::now().time_since_epoch().count();
    ++w.pending;
    // While callers drive their own calls, a wake-up would only find the drive lock taken: the worker's thread
    // looks on its own within two milliseconds instead (worker_main), in case this call's caller does not wait.
    if (!driven) {
      w.take_now = true;
      wake(w);
    } else if (!w.callers_drive.load() || w.sleeping_long.load()) {
      wake(w);
    }
  }
}

void Engine::complete(Task* t) {
  std::string error;
  if (failed_) {
    std::lock_guard fl(failure_mu_);
    error = failure_;
  }
  auto req = t->req;
  if (error.empty() && t->epilogue) t->epilogue();
  delete t;  // scratch goes back to the pool before the caller can post the next call
  req->finish(error);
  std::lock_guard lock(mu_);
  --inflight_;
  if (inflight_ == 0) exclusive_running_ = false;
  while (!held_.empty()) {
    Task* next = held_.front();
    if (exclusive_running_ || (runs_alone(next) && inflight_ > 0)) break;
    held_.pop_front();
    dispatch(next);
  }
  if (inflight_ == 0) idle_cv_.notify_all();
}

void Engine::fail(const std::string& error) {
  if (failing_.exchange(true)) {
    // Another thread is failing the communicator: the errors that follow (closed channels) are its echo.
    if (!failed_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return;
  }
  SC_LOG(LogLevel::info, rank_, "") << "failing: " << error;
  transport_.abort(error);
  std::string final_error = error;
  if (explain_failure) final_error = explain_failure(error);
  {
    std::lock_guard fl(failure_mu_);
    failure_ = final_error;
  }
  failed_ = true;
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(failfd_.get(), &one, sizeof one);
  for (auto& w : workers_) wake(*w);
}

bool Engine::progress(Worker& w) {
  bool moved = false;
  // New lanes, in call order.
  std::vector<std::pair<Task*, Lane*>> fresh;
  {
    std::lock_guard il(w.inbox_mu);
    fresh.swap(w.inbox);
    for (auto& t : w.new_timers) w.timers.push_back(std::move(t));
    w.new_timers.clear();
  }
  for (auto [task, lane] : fresh) {
    lane->left = lane->ops.size();
    for (uint32_t i = 0; i < lane->ops.size(); ++i) {
      const Op& op = lane->ops[i];
      if (op.kind == Op::Kind::compute || op.kind == Op::Kind::copy || op.kind == Op::Kind::alone) {
        lane->computes.push_back(i);
        continue;
      }
      const int ci = op.peer * transport_.streams() + lane->stream;
      ChannelQueue& c = w.chans[static_cast<size_t>(ci)];
      (op.kind == Op::Kind::send ? c.sends : c.recvs).push_back({task, lane, i});
      if (!c.listed) {
        c.listed = true;
        w.active.push_back(ci);
      }
    }
    w.lanes.emplace_back(task, lane);
    moved = true;
  }

  if (failed_) {
    // Drop everything queued here; each task fails once all its lanes are dropped.
    for (int ci : w.active) {
      auto& c = w.chans[static_cast<size_t>(ci)];
      c.sends.clear();
      c.recvs.clear();
      c.sent = c.received = 0;
      c.send_at = c.recv_at = {};
      c.listed = false;
    }
    w.active.clear();
    w.doing = nullptr;
    for (auto [task, lane] : w.lanes) {
      --w.pending;
      if (--task->lanes_left == 0) complete(task);
    }
    w.lanes.clear();
    w.timers.clear();  // nothing runs on a failed communicator; a timer left would keep drive() looping
    return moved;
  }

  auto finish_op = [&](const OpRef& ref) {
    ref.op().done = true;
    --ref.lane->left;
    moved = true;
  };

  for (size_t a = 0; a < w.active.size(); ++a) {
    ChannelQueue& c = w.chans[static_cast<size_t>(w.active[a])];
    if (!transport_.connect(c.peer, c.stream)) continue;
    while (!c.recvs.empty()) {
      const OpRef& ref = c.recvs.front();
      Op& op = ref.op();
      if (!ready(*ref.lane, op)) break;
      const size_t hlen = op.header ? kHeader : 0;
      iovec iov[kMaxIov + 1];
      const int n_iov = frame(iov, &c.header, hlen, op, c.received, c.recv_at);
      if (n_iov > 0) {
        w.doing = ref.task;
        const size_t n = transport_.recv(c.peer, c.stream, iov, n_iov);
        if (n == 0) break;
        const bool header_now = c.received < hlen && c.received + n >= hlen;
        c.received += n;
        moved = true;
        if (header_now && !(c.header == ref.task->desc))
          throw Disagreement(*ref.task, c.peer, c.header);
        if (c.received < hlen + op.len) continue;
      }
      w.doing = ref.task;
      const bool worked = op.finish != 0;
      if (worked) ref.lane->after(ref.lane->ctx, op, op.buf);
      c.received = 0;
      c.recv_at = {};
      OpRef done = ref;
      c.recvs.pop_front();
      finish_op(done);
      // What its finish reduced or encoded is what the next sends forward: they go out (the channels after this
      // one in this pass, the others in the next) before this channel's next receive is reduced. Receiving and
      // reducing every segment already here first held a ring's next hop idle: with bfp16 on one engine worker,
      // 8 ranks spent about two thirds of each call waiting.
      if (worked) break;
    }
    while (!c.sends.empty()) {
      const OpRef& ref = c.sends.front();
      Op& op = ref.op();
      if (!ready(*ref.lane, op)) break;
      const size_t hlen = op.header ? kHeader : 0;
      iovec iov[kMaxIov + 1];
      const int n_iov = frame(iov, &ref.task->desc, hlen, op, c.sent, c.send_at);
      if (n_iov > 0) {
        w.doing = ref.task;
        const size_t n = transport_.send(c.peer, c.stream, iov, n_iov);
        if (n == 0) break;
        c.sent += n;
        moved = true;
        if (c.sent < hlen + op.len) continue;
      }
      c.sent = 0;
      c.send_at = {};
      OpRef done = ref;
      c.sends.pop_front();
      finish_op(done);
    }
  }
  std::erase_if(w.active, [&](int ci) {
    ChannelQueue& c = w.chans[static_cast<size_t>(ci)];
    c.listed = !c.sends.empty() || !c.recvs.empty();
    return !c.listed;
  });

  for (size_t i = 0; i < w.lanes.size();) {
    auto [task, lane] = w.lanes[i];
    while (lane->next_compute < lane->computes.size()) {
      Op& op = lane->ops[lane->computes[lane->next_compute]];
      if (!ready(*lane, op)) break;
      w.doing = task;
      if (op.kind == Op::Kind::copy) {
        if (op.len) std::memmove(op.dst, op.local, op.len);
      } else if (op.kind == Op::Kind::alone) {
        // Its waits keep their own no-progress timeout, which names the rank that is late.
        w.last_progress = Clock::now();
        if (!task->exclusive(w.until)) {  // stopped at the driver's deadline: runs again, goes on
          w.alone_yielded = true;
          break;
        }
      } else {
        task->computes[op.compute]();
      }
      ++lane->next_compute;
      op.done = true;
      --lane->left;
      moved = true;
      // A compute readies sends (a segment encoded for the first step): they go out before the next one runs.
      if (op.kind == Op::Kind::compute) break;
    }
    if (lane->left > 0) {
      ++i;
      continue;
    }
    w.lanes[i] = w.lanes.back();
    w.lanes.pop_back();
    --w.pending;
    w.doing = nullptr;
    if (--task->lanes_left == 0) complete(task);
  }

  const auto now = Clock::now();
  for (size_t i = 0; i < w.timers.size();) {
    if (w.timers[i].first > now) {
      ++i;
      continue;
    }
    auto fn = std::move(w.timers[i].second);
    w.timers[i] = std::move(w.timers.back());
    w.timers.pop_back();
    fn();
    moved = true;
  }
  return moved;
}

void Engine::drive(Worker& w, const std::function<bool()>& enough, std::optional<Clock::time_point> deadline) {
  // last_progress is not reset here: a caller that drives in short slices must not postpone the timeout.
  auto spin_since = Clock::now();
  while (!enough()) {
    bool moved = false;
    w.until = deadline ? *deadline : Clock::now() + std::chrono::seconds(1);
    w.alone_yielded = false;
    try {
      moved = progress(w);
    } catch (const Disagreement& d) {
      if (on_disagreement) on_disagreement(d);
      fail((w.doing ? w.doing->name() + ": " : std::string()) + d.what());
      continue;
    } catch (const std::exception& e) {
      fail((w.doing ? w.doing->name() + ": " : std::string()) + e.what());
      continue;  // the next pass drops and fails this worker's tasks
    }
    const auto now = Clock::now();
    if (moved) {
      w.last_progress = spin_since = now;
      continue;
    }
    if (w.lanes.empty() && w.active.empty() && w.pending.load() == 0 && w.timers.empty()) {
      if (!deadline) return;  // the worker's own thread: out of work
    }
    if (deadline && now >= *deadline) return;
    bool connecting = false;
    for (int ci : w.active) connecting |= transport_.pollable(w.chans[static_cast<size_t>(ci)].peer,
                                                              w.chans[static_cast<size_t>(ci)].stream) < 0;
    const double limit = connecting ? std::max(config_.timeout, config_.connect_timeout) : config_.timeout;
    if (!w.lanes.empty() && now - w.last_progress > std::chrono::duration<double>(limit)) {
      fail(w.lanes.front().first->name() + ": no progress for " + std::to_string(limit) + " s " +
           describe_waits(w.chans, w.active) +
           "; is that rank alive and calling the same collective? (SMARTCOLL_TIMEOUT raises the limit)");
      continue;
    }
    if (!w.alone_yielded && w.spin.again(now, spin_since)) continue;
    // Sleep until a channel, the accepting socket or a submission wakes us, or the next deadline.
    auto until = now + std::chrono::seconds(1);
    if (!w.lanes.empty()) until = std::min(until, w.last_progress + std::chrono::duration_cast<Clock::duration>(
                                                                  std::chrono::duration<double>(config_.timeout)));
    for (auto& t : w.timers) until = std::min(until, t.first);
    if (deadline) until = std::min(until, *deadline);
    // An op that runs alone did its own waiting (on the peers' stores, which wake no descriptor here): only a
    // look at the descriptors (submissions, incoming connections) before it runs again.
    const int ms = w.alone_yielded ? 0 : static_cast<int>(std::clamp<int64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(until - now).count() / 1000 + 1, 0, 1000));
    epoll_event events[64];
    const int n = epoll_wait(w.epfd.get(), events, 64, ms);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == w.wakefd.get()) {
        uint64_t count;
        [[maybe_unused]] ssize_t r = ::read(w.wakefd.get(), &count, sizeof count);
      } else if (transport_.listens_on(events[i].data.fd)) {
        try {
          transport_.accept_incoming();
        } catch (const std::exception& e) {
          fail(e.what());
        }
      }
    }
    spin_since = Clock::now();
  }
}

void Engine::worker_main(Worker& w) {
  for (;;) {
    {
      std::lock_guard il(w.inbox_mu);
      if (w.stop && w.pending.load() == 0) return;
    }
    // While callers drive their calls, work just posted here is most likely a call whose caller is about to
    // wait on it: taking it would make that caller sleep and be woken (a thread hand-off per call, and a third
    // busy thread per rank where cores are few). Work older than that is a call posted and not waited on.
    const bool callers = w.callers_drive.load();
    const bool take_now = w.take_now.exchange(false);
    const bool leave_to_callers =
        callers && !take_now && Clock::now().time_since_epoch().count() - w.posted_at.load() < kPostToWaitNs;
    if (w.pending.load() == 0 || leave_to_callers || !w.drive_mu.try_lock()) {
      // Idle, or a waiting caller drives: sleep until a submission (or that caller, leaving work behind) wakes
      // us. With work queued, look again within a millisecond; while callers drive, within two (a call posted
      // then does not wake us: if its caller does not wait on it, the next look takes it).
      int ms = w.pending.load() > 0 ? 1 : 2;
      if (w.pending.load() == 0 && !w.callers_drive.load()) {
        // A long sleep is announced, then checked once more: a call posted meanwhile either sees the
        // announcement and wakes us (dispatch), or is seen here.
        w.sleeping_long = true;
        if (w.pending.load() == 0 && !w.callers_drive.load()) ms = 1000;
      }
      pollfd p{w.wakefd.get(), POLLIN, 0};
      ::poll(&p, 1, ms);
      w.sleeping_long = false;
      // Callers that stopped calling for a while: wake-ups go back to waking this thread (unless a caller
      // finished a call meanwhile and set the mode again).
      const int64_t last = w.caller_done_at.load();
      if (callers && w.pending.load() == 0 && Clock::now().time_since_epoch().count() - last > kCallerModeNs) {
        w.callers_drive = false;
        if (w.caller_done_at.load() != last) w.callers_drive = true;
      }
      uint64_t count;
      [[maybe_unused]] ssize_t r = ::read(w.wakefd.get(), &count, sizeof count);
      continue;
    }
    w.callers_drive = false;
    drive(w, [] { return false; }, std::nullopt);
    w.drive_mu.unlock();
  }
}

bool Engine::wait(Request& req, std::optional<Clock::time_point> deadline) {
  if (req.driver_ < 0) return req.test();
  Worker& w = *workers_[static_cast<size_t>(req.driver_)];
  if (!w.drive_mu.try_lock()) return req.test();  // its thread (or another caller) is driving
  drive(w, [&] { return req.test(); }, deadline);
  if (req.test()) {
    w.caller_done_at = Clock::now().time_since_epoch().count();
    w.callers_drive = true;
  }
  w.drive_mu.unlock();
  if (w.pending.load() > 0) {  // work of other calls is left: hand it to the worker's thread
    w.take_now = true;
    wake(w);
  }
  return req.test();
}

void Engine::stop() {
  {
    std::unique_lock lock(mu_);
    stopping_ = true;
    idle_cv_.wait(lock, [&] { return inflight_ == 0 && held_.empty(); });
  }
  for (auto& w : workers_) {
    {
      std::lock_guard il(w->inbox_mu);
      w->stop = true;
    }
    wake(*w);
  }
  for (auto& w : workers_)
    if (w->thread.joinable()) w->thread.join();
}

double Engine::cpu_seconds() const {
  double total = 0;
  for (const auto& w : workers_) {
    if (!w->thread.joinable()) continue;
    clockid_t clock;
    timespec ts{};
    if (pthread_getcpuclockid(const_cast<std::thread&>(w->thread).native_handle(), &clock) == 0 &&
        clock_gettime(clock, &ts) == 0)
      total += static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  }
  return total;
}

void Engine::at(int w, Clock::time_point when, std::function<void()> fn) {
  Worker& worker = *workers_[static_cast<size_t>(w)];
  {
    std::lock_guard il(worker.inbox_mu);
    worker.new_timers.emplace_back(when, std::move(fn));
  }
  wake(worker);
}

}  // namespace smartcoll
