#include "nicd/server.h"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <optional>
#include <span>
#include <sstream>
#include <tuple>
#include <utility>

#include "nicd/protocol.h"
#include "smartcoll/comm.h"
#include "smartcoll/reduce.h"
#include "smartcoll/store.h"
#include "transport/cma.h"

namespace smartcoll::nicd {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kHeartbeat = std::chrono::milliseconds(500);
// Calls one rank may have posted that its job has not run yet (its other local ranks have not posted them): a
// client that posts without end is refused before the daemon's memory grows with it.
constexpr size_t kMaxQueuedPosts = 65536;
// A rank sends its hello as soon as it connects; a connection silent this long (or the daemon's --timeout, if
// shorter) is not a rank, and would only hold one of the daemon's descriptors.
constexpr double kHelloDeadline = 10;
constexpr size_t kPieceBytes = 1 << 20;  // the local reduction reads and combines this much at a time
constexpr size_t kChunkBytes = 4 << 20;  // allreduce and broadcast go between hosts in chunks of this much
// Chunks in flight at once: what the daemon holds for a reduction or a broadcast, whatever the call's size.
constexpr size_t kWindowChunks = 4;
// The smallest part of a block that allgather and alltoall move at once: with many hosts and ranks, a part sized
// to fill one chunk would shrink to bytes, and each part costs one call among the daemons and a system call per
// rank. The window then holds more than four chunks (4 x 2 x hosts x widest^2 x 64 KiB for alltoall), still
// less than the whole call would.
constexpr size_t kMinPartBytes = 64 << 10;

void pin(const std::vector<int>& cpus) {
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

// One message to a rank, holding the daemon's threads up for at most kSendWait (the control thread serves every job;
// a worker sends under its job's lock, which the control thread takes too). A rank whose socket stays full that
// long has stopped reading its answers (a stopped process, or no rank at all): its connection is shut down, which
// the control thread sees as the rank leaving, so its job fails and the others go on; later sends to it fail at
// once. A live rank's reader drains a burst of answers (a failed job answers every queued call) well within it.
constexpr int kSendWaitMs = 100;
bool send_to(int fd, const std::string& msg) {
  if (fd < 0) return false;
  const auto sent = [&] {
    return ::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT) == static_cast<ssize_t>(msg.size());
  };
  if (sent()) return true;
  pollfd p{fd, POLLOUT, 0};
  if (errno == EAGAIN && ::poll(&p, 1, kSendWaitMs) == 1 && (p.revents & POLLOUT) && sent()) return true;
  ::shutdown(fd, SHUT_RDWR);
  return false;
}

// A buffer size from counts the ranks posted: throws rather than wrap (a wrapped size would under-allocate and a
// transfer into it would run past its end).
size_t bytes_of(std::initializer_list<size_t> factors) {
  size_t total = 1;
  for (size_t f : factors)
    if (__builtin_mul_overflow(total, f, &total)) throw CommError("the call is too large for the daemon's buffers");
  return total;
}

// A call's scratch buffer of `bytes`, its old contents dropped: grown to exactly that much (a vector's own growth
// may double it, past the bound docs/nicd.md gives for what a job holds).
void fit(std::vector<char>& buffer, size_t bytes) {
  if (bytes > buffer.capacity()) {
    std::vector<char>().swap(buffer);
    buffer.reserve(bytes);
  }
  buffer.resize(bytes);
}

int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);
  return fd < 0 ? -1 : static_cast<int>(fd);
#else
  (void)pid;
  return -1;
#endif
}

std::string seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", s);
  return text;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string describe(const Post& p) {
  return std::string(collective_name(static_cast<Collective>(p.coll))) + " #" + std::to_string(p.seq) +
         "(count=" + std::to_string(p.count) + ", " + std::string(dtype_name(static_cast<DataType>(p.dtype))) +
         ", op=" + std::string(op_name(static_cast<ReduceOp>(p.op))) + ", root=" + std::to_string(p.root) +
         ", codec=" + p.codec + (p.layout ? ", a list of layout " + std::to_string(p.layout) : std::string()) + ")";
}

}  // namespace

// One local rank of a job, as the daemon knows it.
struct Slot {
  int fd = -1;  // -1: not connected (yet, or any more)
  pid_t pid = 0;
  int pidfd = -1;
  bool joined = false, left = false, bye = false, ready_sent = false;
  std::deque<Post> posts;
  ~Slot() {
    if (pidfd >= 0) ::close(pidfd);
  }
};

// A list call's view in a rank: [base, base + pieces.bytes()) stands for the pieces one after the other.
struct List {
  uint64_t base = 0;
  cma::Vector pieces;
};

// A rank taking part in the call being run, and its post.
struct Member {
  int rank;
  pid_t pid;
  int pidfd;
  Post post;
  std::vector<List> lists;  // a list call's views of its input and output (one where they are the same)
  std::vector<uint64_t> blocks;  // alltoallv: Post::blocks, read
};

struct Job {
  Job(Server& server, std::string key, Hello first, std::vector<int> cpus, double post_timeout);
  void fail(const std::string& why);  // mu held
  void answer_running(const std::string& error);  // mu held
  void run();
  void form();
  bool next_call(std::vector<Member>& members);
  void execute(std::vector<Member>& ms);
  // Reads the tables a call names in the rank's memory: a list call's pieces (Post::in_table, out_table) into
  // m.lists, alltoallv's blocks (Post::blocks) into m.blocks.
  void read_tables(Member& m);
  // `remote` as it lies in the rank's memory: a range in one of a list call's views becomes the pieces it covers.
  std::vector<iovec> real_ranges(const Member& m, std::span<const iovec> remote) const;
  void transfer(bool write, const Member& m, uint64_t remote, char* local, size_t len);
  // The same for many ranges at once (one system call per IOV_MAX of them): `remote` and `local` hold the same
  // bytes, cut alike or not.
  void transferv(bool write, const Member& m, std::span<const iovec> remote, std::span<const iovec> local);
  // into = elements [from, from + count) of every local rank's input, combined in rank order.
  void local_reduce(const std::vector<Member>& ms, const Post& p, size_t from, size_t count, char* into);
  // A call's `count` units in chunks of `chunk`, at most kWindowChunks in flight, each with a slot of
  // `slot_bytes`: start(from, k, slot) fills the chunk's slot and returns the daemons' call on it (null: none),
  // finish(from, k, slot) runs once that call is done.
  void windowed(size_t count, size_t chunk, size_t slot_bytes,
                const std::function<std::shared_ptr<Request>(size_t, size_t, char*)>& start,
                const std::function<void(size_t, size_t, char*)>& finish);
  // The allreduce of every rank's input, chunk by chunk: done(from, count, sum) is told of each as it is final.
  void allreduce(const std::vector<Member>& ms, const Post& p, size_t count,
                 const std::function<void(size_t, size_t, char*)>& done);
  void alltoall(const std::vector<Member>& ms, const Post& p);
  // agreed: every host knows the blocks' sizes already (alltoall's equal blocks): none are exchanged.
  void alltoallv(const std::vector<Member>& ms, const Post& p, bool agreed = false);
  size_t widest_host() const;
  std::string name() const { return "job '" + hello.job_id + "'"; }

  Server& server;
  const std::string key;
  const Hello hello;  // the first rank's: every later one must name the same world, layout and store
  const std::vector<int> cpus;
  const double post_timeout;
  int host = 0, host_count = 0;
  std::vector<std::vector<int>> members;  // [host]: its ranks, ascending
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, Slot> slots;  // the ranks of this host
  std::string failed;
  std::atomic<bool> stopping{false};  // failed is set: the call being run stops before its next transfer
  // The front post of every slot is being run: only the worker answers it, once it no longer touches the ranks'
  // memory (a rank may free a buffer as soon as its call is answered).
  bool running = false;
  std::unique_ptr<Communicator> inter;  // among the daemons of the job's hosts; null with one host
  std::vector<char> stage, window;  // a piece of one rank's input; the chunks in flight
  std::vector<char> spread;         // alltoall: one rank's part of every block
  std::thread worker;
  std::atomic<bool> finished{false};
  Clock::time_point created = Clock::now();
};

Job::Job(Server& s, std::string k, Hello first, std::vector<int> c, double t)
    : server(s), key(std::move(k)), hello(std::move(first)), cpus(std::move(c)), post_timeout(t) {
  host = hello.hosts[static_cast<size_t>(hello.rank)];
  host_count = *std::max_element(hello.hosts.begin(), hello.hosts.end()) + 1;
  members.resize(static_cast<size_t>(host_count));
  for (int r = 0; r < hello.size; ++r) members[static_cast<size_t>(hello.hosts[static_cast<size_t>(r)])].push_back(r);
  for (int r : members[static_cast<size_t>(host)]) slots[r];
}

void Job::fail(const std::string& why) {
  if (!failed.empty()) return;
  failed = why;
  stopping = true;
  for (auto& [rank, s] : slots) {
    if (!s.ready_sent) send_to(s.fd, encode(Ready{why}));
    s.ready_sent = true;
    const size_t keep = running && !s.posts.empty() ? 1 : 0;
    for (size_t i = keep; i < s.posts.size(); ++i) send_to(s.fd, encode(Done{s.posts[i].seq, why}));
    s.posts.resize(keep);
  }
  if (inter) inter->abort(why);  // the other hosts' daemons fail the job too
  cv.notify_all();
  {
    std::lock_guard lock(server.stats_mu_);
    ++server.stats_.jobs_failed;
  }
  server.event(name() + " failed: " + why);
}

void Job::answer_running(const std::string& error) {
  running = false;
  for (auto& [rank, s] : slots) {
    if (s.posts.empty()) continue;
    send_to(s.fd, encode(Done{s.posts.front().seq, error}));
    s.posts.pop_front();
  }
}

void Job::transfer(bool write, const Member& m, uint64_t remote, char* local, size_t len) {
  const iovec r{reinterpret_cast<void*>(static_cast<uintptr_t>(remote)), len}, l{local, len};
  transferv(write, m, {&r, 1}, {&l, 1});
}

std::vector<iovec> Job::real_ranges(const Member& m, std::span<const iovec> remote) const {
  std::vector<iovec> out;
  for (const iovec& r : remote) {
    const uint64_t at = reinterpret_cast<uintptr_t>(r.iov_base);
    if (r.iov_len == 0) continue;
    const auto l = std::find_if(m.lists.begin(), m.lists.end(),
                                [&](const List& v) { return at >= v.base && at - v.base < v.pieces.bytes(); });
    if (l == m.lists.end() || r.iov_len > l->pieces.bytes() - (at - l->base))
      throw CommError("rank " + std::to_string(m.rank) + "'s " + describe(m.post) + " reaches " +
                      std::to_string(r.iov_len) + " bytes at an address outside its lists of buffers (lists of " +
                      "other counts than its peers'?)");
    const std::vector<iovec> pieces = l->pieces.iov(at - l->base, r.iov_len);
    out.insert(out.end(), pieces.begin(), pieces.end());
  }
  return out;
}

void Job::read_tables(Member& m) {
  const Post& p = m.post;
  if (static_cast<Collective>(p.coll) == Collective::alltoallv) {
    m.blocks.resize(bytes_of({4, static_cast<size_t>(hello.size)}));
    transfer(false, m, p.blocks, reinterpret_cast<char*>(m.blocks.data()), m.blocks.size() * sizeof(uint64_t));
    // Offsets and sizes beyond any memory would overflow the parts' arithmetic; a rank's table is not trusted.
    constexpr uint64_t kMaxBlockBytes = uint64_t{1} << 48;
    for (size_t i = 0; i < m.blocks.size(); ++i)
      if (m.blocks[i] > kMaxBlockBytes)
        throw CommError("rank " + std::to_string(m.rank) + "'s table of blocks for " + describe(p) + " gives " +
                        std::string(i % 2 ? "a block of " : "an offset of ") + std::to_string(m.blocks[i]) +
                        " bytes for rank " + std::to_string(i / 4) + " (at most 2^48)");
  }
  std::vector<List> lists;  // m's transfers map nothing until they are all read: the tables lie outside them
  for (const auto& [view, table, count] : {std::tuple{p.in, p.in_table, p.in_pieces},
                                           std::tuple{p.out, p.out_table, p.out_pieces}}) {
    if (count == 0 || std::any_of(lists.begin(), lists.end(), [&](const List& l) { return l.base == view; }))
      continue;
    std::vector<cma::Extent> pieces(count);  // a table's entry: address u64, bytes u64
    transfer(false, m, table, reinterpret_cast<char*>(pieces.data()), count * sizeof(cma::Extent));
    uint64_t bytes = 0;
    for (const cma::Extent& piece : pieces)
      if (__builtin_add_overflow(bytes, piece.bytes, &bytes))
        throw CommError("rank " + std::to_string(m.rank) + "'s list for " + describe(p) + " adds up past 2^64 bytes");
    lists.push_back({view, cma::Vector(pieces)});
  }
  m.lists = std::move(lists);
}

void Job::transferv(bool write, const Member& m, std::span<const iovec> given, std::span<const iovec> local) {
  if (stopping) throw CommError("the job failed");  // the reason is the job's, already given
  const std::vector<iovec> mapped = m.lists.empty() ? std::vector<iovec>{} : real_ranges(m, given);
  const std::span<const iovec> remote = m.lists.empty() ? given : std::span<const iovec>(mapped);
  if (m.pidfd >= 0) {
    // A pid is only reused after its process is gone; a gone process is never read or written.
    pollfd p{m.pidfd, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0)
      throw CommError("rank " + std::to_string(m.rank) + " (pid " + std::to_string(m.pid) + ") exited during " +
                      describe(m.post));
  }
  size_t total = 0;
  for (const iovec& v : local) total += v.iov_len;
  const int err = total == 0 ? 0 : write ? cma::write_process(m.pid, local, remote) : cma::read_process(m.pid, local, remote);
  if (err != 0) {
    const std::string hint = err == ESRCH    ? ": the rank exited"
                             : err == EFAULT ? ": the buffer is not mapped there (freed, or too small)"
                             : err == EPERM  ? ": permission denied (another user, or Yama ptrace_scope)"
                                             : "";
    throw CommError(std::string(write ? "writing the result into" : "reading the input of") + " rank " +
                    std::to_string(m.rank) + " (pid " + std::to_string(m.pid) + ") for " + describe(m.post) +
                    " failed: " + (err > 0 ? std::strerror(err) : "short transfer") + hint);
  }
  std::lock_guard lock(server.stats_mu_);
  (write ? server.stats_.bytes_written : server.stats_.bytes_read) += total;
}

void Job::form() {
  {
    std::unique_lock lock(mu);
    const auto deadline = created + std::chrono::duration<double>(hello.connect_timeout);
    auto all_joined = [&] {
      return std::all_of(slots.begin(), slots.end(), [](const auto& s) { return s.second.joined; });
    };
    while (failed.empty() && !all_joined()) {
      if (cv.wait_until(lock, deadline) == std::cv_status::timeout && !all_joined()) {
        std::vector<int> missing;
        for (const auto& [rank, s] : slots)
          if (!s.joined) missing.push_back(rank);
        fail(ranks_text(missing) + " of " + name() + " did not connect to the nicd daemon of host " +
             std::to_string(host) + " within " + seconds(hello.connect_timeout) +
             " s (are they running, with engine=nicd and the same nicd_socket?)");
      }
    }
    if (!failed.empty()) return;
  }
  if (host_count > 1) {
    if (hello.store.empty())
      throw CommError("engine=nicd across hosts needs a rendezvous store the daemons can reach (env:// or tcp://, "
                      "or file:// on a shared file system); this job's store is private to its processes");
    // The ranks' knobs that must match shape the daemons' exchange too; the daemons' own keys live under the
    // job's id with a suffix, so they never meet the ranks' keys.
    std::map<std::string, std::string> opts;
    std::istringstream settings(hello.settings);
    for (std::string item; settings >> item;)
      if (const size_t eq = item.find('='); eq != std::string::npos) opts[item.substr(0, eq)] = item.substr(eq + 1);
    opts["engine"] = "inprocess";
    opts["job_id"] = hello.job_id + ".nicd";
    opts["host"] = "nicd-host-" + std::to_string(host);
    opts["timeout"] = seconds(hello.timeout);
    opts["connect_timeout"] = seconds(hello.connect_timeout);
    std::string list;
    for (int c : cpus) list += (list.empty() ? "" : ",") + std::to_string(c);
    opts["engine_cpus"] = list;
    if (!cpus.empty()) opts["engine_threads"] = std::to_string(std::min<size_t>(cpus.size(), 4));
    auto store = open_store(hello.store, std::chrono::milliseconds(static_cast<int64_t>(hello.connect_timeout * 1e3)));
    auto comm = std::make_unique<Communicator>(host, host_count, std::move(store), Options::resolve(opts),
                                               hello.route_hint);
    std::lock_guard lock(mu);
    if (!failed.empty()) {
      comm->abort(failed);  // the job failed while the daemons met: the others learn it now
      return;
    }
    inter = std::move(comm);
  }
  std::lock_guard lock(mu);
  for (auto& [rank, s] : slots) {
    send_to(s.fd, encode(Ready{}));
    s.ready_sent = true;
  }
  {
    std::lock_guard stats(server.stats_mu_);
    ++server.stats_.jobs_formed;
  }
  server.event(name() + " formed: " + ranks_text(members[static_cast<size_t>(host)]) + " of " +
               std::to_string(hello.size) + " on host " + std::to_string(host) + " of " + std::to_string(host_count));
}

// Waits until every local rank has posted its next call; false when the job is over (failed, or every rank left).
bool Job::next_call(std::vector<Member>& ms) {
  std::unique_lock lock(mu);
  std::optional<Clock::time_point> since;  // when the first local rank posted this call
  for (;;) {
    if (!failed.empty()) return false;
    std::vector<int> posted, missing, closed;
    for (const auto& [rank, s] : slots) {
      (s.posts.empty() ? missing : posted).push_back(rank);
      if (s.left) closed.push_back(rank);
    }
    if (closed.size() == slots.size()) return false;
    if (missing.empty()) break;
    if (!posted.empty()) {
      const Post& first = slots[posted[0]].posts.front();
      if (!closed.empty()) {
        fail(ranks_text(closed) + " closed the communicator while " + ranks_text(posted) + " posted " +
             describe(first));
        return false;
      }
      if (!since) since = Clock::now();
      if (Clock::now() - *since > std::chrono::duration<double>(post_timeout)) {
        fail(ranks_text(missing) + " did not post " + describe(first) + " within " + seconds(post_timeout) +
             " s of " + ranks_text(posted) + " (SMARTCOLL_TIMEOUT)");
        return false;
      }
    }
    cv.wait_for(lock, std::chrono::milliseconds(100));
  }
  ms.clear();
  for (const auto& [rank, s] : slots) ms.push_back({rank, s.pid, s.pidfd, s.posts.front(), {}, {}});
  running = true;
  return true;
}

// Waits for a call of the daemons' communicator; its errors name ranks there, which are host numbers.
static void wait_between_hosts(const std::shared_ptr<Request>& req) {
  try {
    req->wait();
  } catch (const CommError& e) {
    throw CommError(std::string("between the hosts' nicd daemons (ranks there are host numbers): ") + e.what());
  }
}

// Piece by piece, so that what was just read is combined while it is in cache.
void Job::local_reduce(const std::vector<Member>& ms, const Post& p, size_t from, size_t count, char* into) {
  const auto dt = static_cast<DataType>(p.dtype);
  const auto op = static_cast<ReduceOp>(p.op);
  const size_t esize = dtype_size(dt), piece = kPieceBytes / esize;
  stage.resize(kPieceBytes);
  for (size_t at = 0; at < count; at += piece) {
    const size_t k = std::min(piece, count - at);
    char* acc = into + at * esize;
    transfer(false, ms[0], ms[0].post.in + (from + at) * esize, acc, k * esize);
    for (size_t i = 1; i < ms.size(); ++i) {
      transfer(false, ms[i], ms[i].post.in + (from + at) * esize, stage.data(), k * esize);
      reduce(dt, op, acc, acc, stage.data(), k);
    }
  }
}

void Job::windowed(size_t count, size_t chunk, size_t slot_bytes,
                   const std::function<std::shared_ptr<Request>(size_t, size_t, char*)>& start,
                   const std::function<void(size_t, size_t, char*)>& finish) {
  fit(window, std::min((count + chunk - 1) / chunk, kWindowChunks) * slot_bytes);
  // A chunk's slot is reused only once its call is done and finished: the daemons' engine carries up to
  // kWindowChunks chunks between hosts while the next is read here. A chunk is written back only after every
  // rank's input for its elements was read, so a call in place never overwrites input still to be read.
  std::deque<std::pair<size_t, std::shared_ptr<Request>>> inflight;  // (first element, the daemons' call)
  auto slot = [&](size_t at) { return window.data() + (at / chunk % kWindowChunks) * slot_bytes; };
  auto finish_oldest = [&] {
    const auto [at, req] = inflight.front();
    if (req) wait_between_hosts(req);
    inflight.pop_front();
    finish(at, std::min(chunk, count - at), slot(at));
  };
  try {
    for (size_t at = 0; at < count; at += chunk) {
      if (inflight.size() == kWindowChunks) finish_oldest();
      inflight.emplace_back(at, start(at, std::min(chunk, count - at), slot(at)));
    }
    while (!inflight.empty()) finish_oldest();
  } catch (const std::exception& e) {
    // No chunk may still be in flight when its slot goes: fail the others and let them finish first.
    if (inter) inter->abort(e.what());
    for (const auto& [at, req] : inflight) {
      try {
        if (req) req->wait();
      } catch (const CommError&) {  // the first error is the one reported
      }
    }
    throw;
  }
}

void Job::allreduce(const std::vector<Member>& ms, const Post& p, size_t count,
                    const std::function<void(size_t, size_t, char*)>& done) {
  const auto dt = static_cast<DataType>(p.dtype);
  const auto op = static_cast<ReduceOp>(p.op);
  const size_t esize = dtype_size(dt);
  const Codec codec = Codec::parse(p.codec);
  // avg combines as sum everywhere and divides once, by the whole world, as the in-process engine does.
  const size_t chunk = kChunkBytes / esize;
  windowed(
      count, chunk, chunk * esize,
      [&](size_t at, size_t k, char* slot) -> std::shared_ptr<Request> {
        local_reduce(ms, p, at, k, slot);
        if (!inter) return nullptr;
        return inter->allreduce(slot, slot, k, dt, op == ReduceOp::avg ? ReduceOp::sum : op, Algorithm::automatic,
                                codec);
      },
      [&](size_t at, size_t k, char* sum) {
        if (op == ReduceOp::avg) scale_divide(dt, sum, k, hello.size);
        done(at, k, sum);
      });
}

size_t Job::widest_host() const {
  size_t widest = 0;
  for (const auto& h : members) widest = std::max(widest, h.size());
  return widest;
}

// Rank s's input is n blocks, block d for rank d; rank d's output is n blocks, block s from rank s. The call runs
// in parts: bytes [lo, lo + len) of every block at a time, through the window of chunks. A part between two ranks
// of this host goes straight from the source's input (read once) into the destination's output. Between hosts
// the daemons exchange, per part, one alltoall whose segment from host g to host h holds the part of the block
// of every pair (a rank of g, a rank of h), widest x widest parts (hosts of different sizes take alltoallv, which
// sends no padding); the next parts are read and sent while earlier ones are between hosts.
void Job::alltoall(const std::vector<Member>& ms, const Post& p) {
  const size_t n = static_cast<size_t>(hello.size), block = p.count * dtype_size(static_cast<DataType>(p.dtype));
  if (block == 0) return;
  // Checked with the host count: a slot holds a send and a receive segment per host.
  const size_t hosts = static_cast<size_t>(host_count), widest = widest_host();
  const size_t pairs = bytes_of({hosts, widest, widest});
  // A part's send and receive segments together (on one host, what one rank's part spreads to: n pieces) are
  // about one chunk, so the window holds what it holds for a reduction.
  const size_t part = std::min(block, std::max(kMinPartBytes, kChunkBytes / (inter ? 2 * pairs : n)));
  fit(spread, n * part);
  auto out_at = [&](const Member& m, int source, size_t lo) {
    return m.post.out + static_cast<uint64_t>(source) * block + lo;
  };
  windowed(
      block, part, inter ? 2 * pairs * part : 0,
      [&](size_t lo, size_t len, char* slot) -> std::shared_ptr<Request> {
        auto at = [&](size_t h, size_t from, size_t to) { return slot + ((h * widest + from) * widest + to) * len; };
        std::vector<iovec> remote(n);
        for (size_t j = 0; j < ms.size(); ++j) {
          for (size_t d = 0; d < n; ++d)
            remote[d] = {reinterpret_cast<void*>(static_cast<uintptr_t>(ms[j].post.in + d * block + lo)), len};
          const iovec local{spread.data(), n * len};
          transferv(false, ms[j], remote, {&local, 1});
          for (const Member& to : ms)
            transfer(true, to, out_at(to, ms[j].rank, lo), spread.data() + static_cast<size_t>(to.rank) * len, len);
          for (size_t h = 0; inter && h < members.size(); ++h) {
            if (h == static_cast<size_t>(host)) continue;
            for (size_t k = 0; k < members[h].size(); ++k)
              std::memcpy(at(h, j, k), spread.data() + static_cast<size_t>(members[h][k]) * len, len);
          }
        }
        if (!inter) return nullptr;
        return inter->alltoall(slot, slot + pairs * len, widest * widest * len, DataType::u8);
      },
      [&](size_t lo, size_t len, char* slot) {
        // [source host][its rank j][this host's rank k], after the send segments
        char* recv = slot + pairs * len;
        for (size_t k = 0; inter && k < ms.size(); ++k) {
          std::vector<iovec> remote, local;
          for (size_t h = 0; h < members.size(); ++h) {
            if (h == static_cast<size_t>(host)) continue;
            for (size_t j = 0; j < members[h].size(); ++j) {
              remote.push_back({reinterpret_cast<void*>(static_cast<uintptr_t>(out_at(ms[k], members[h][j], lo))), len});
              local.push_back({recv + ((h * widest + j) * widest + k) * len, len});
            }
          }
          transferv(true, ms[k], remote, local);
        }
      });
}

// alltoallv, as alltoall in parts: bytes [lo, lo + len) of every pair's block at a time (a block no longer than lo
// moves nothing in that part), through the window. A part's segment from host g to host h holds, for each rank j
// of g and then each rank k of h, the part of j's block for k: the blocks' sizes tell both sides where each lies.
// First the daemons exchange the sizes of the blocks between their hosts, so that each checks them against what
// its ranks expect (a mismatch fails the call, naming the pair), and agree on the largest block, whose parts set
// how many calls among the daemons the call takes (unless the sizes are agreed already).
void Job::alltoallv(const std::vector<Member>& ms, const Post& p, bool agreed) {
  const size_t n = static_cast<size_t>(hello.size), me = static_cast<size_t>(host);
  const size_t hosts = static_cast<size_t>(host_count), widest = widest_host();
  const size_t pairs = bytes_of({hosts, widest, widest});
  const auto& here = members[me];  // ms[j] is rank here[j]
  auto sent = [&](size_t j, size_t to) { return ms[j].blocks[4 * to + 1]; };
  auto expected = [&](size_t k, size_t from) { return ms[k].blocks[4 * from + 3]; };
  // [host g][its rank j][this host's rank k]: the size of j's block for k, as g's daemon has it
  std::vector<uint64_t> out_sizes(pairs, 0), in_sizes(pairs, 0);
  for (size_t h = 0; h < hosts; ++h)
    for (size_t j = 0; h != me && j < ms.size(); ++j)
      for (size_t k = 0; k < members[h].size(); ++k)
        out_sizes[(h * widest + j) * widest + k] = sent(j, static_cast<size_t>(members[h][k]));
  if (inter && !agreed)
    wait_between_hosts(inter->alltoall(out_sizes.data(), in_sizes.data(), widest * widest, DataType::i64));
  for (size_t h = 0; agreed && h < hosts; ++h)  // what each rank here expects is what is sent
    for (size_t j = 0; h != me && j < members[h].size(); ++j)
      for (size_t k = 0; k < ms.size(); ++k)
        in_sizes[(h * widest + j) * widest + k] = expected(k, static_cast<size_t>(members[h][j]));
  for (size_t h = 0; h < hosts; ++h)
    for (size_t k = 0; k < ms.size(); ++k)
      for (size_t j = 0; j < members[h].size(); ++j) {
        const size_t from = static_cast<size_t>(members[h][j]);
        if (h == me) in_sizes[(h * widest + j) * widest + k] = sent(j, static_cast<size_t>(here[k]));
        if (const uint64_t got = in_sizes[(h * widest + j) * widest + k]; got != expected(k, from)) {
          const size_t esize = dtype_size(static_cast<DataType>(p.dtype));
          throw CommError("alltoallv: rank " + std::to_string(from) + " sends rank " + std::to_string(here[k]) + " " +
                          std::to_string(got / esize) + " elements but rank " + std::to_string(here[k]) +
                          " expects " + std::to_string(expected(k, from) / esize) + " (sendcounts[" +
                          std::to_string(here[k]) + "] of rank " + std::to_string(from) + " must equal recvcounts[" +
                          std::to_string(from) + "] of rank " + std::to_string(here[k]) + ")");
        }
      }
  uint64_t largest = 0;
  for (size_t j = 0; j < ms.size(); ++j)
    for (size_t d = 0; d < n; ++d) largest = std::max({largest, sent(j, d), expected(j, d)});
  if (inter && !agreed)
    wait_between_hosts(inter->allreduce(&largest, &largest, 1, DataType::i64, ReduceOp::max));
  if (largest == 0) return;
  const size_t part = std::min<size_t>(largest, std::max(kMinPartBytes, kChunkBytes / (inter ? 2 * pairs : n)));
  fit(spread, n * part);
  auto cut = [](uint64_t bytes, size_t lo, size_t len) { return bytes > lo ? std::min<size_t>(len, bytes - lo) : 0; };
  auto piece = [](uint64_t address, size_t bytes) {
    return iovec{reinterpret_cast<void*>(static_cast<uintptr_t>(address)), bytes};
  };
  // Each host's segment of a part, where it starts in the slot's send or receive half and its bytes.
  auto segments = [&](size_t lo, size_t len, bool receive, std::vector<size_t>& count, std::vector<size_t>& displ) {
    count.assign(hosts, 0);
    displ.assign(hosts, 0);
    for (size_t h = 0, total = 0; h < hosts; total += count[h], ++h) {
      displ[h] = total;
      for (size_t x = 0; h != me && x < pairs / hosts; ++x)
        count[h] += cut((receive ? in_sizes : out_sizes)[h * widest * widest + x], lo, len);
    }
  };
  windowed(
      largest, part, inter ? 2 * pairs * part : 0,
      [&](size_t lo, size_t len, char* slot) -> std::shared_ptr<Request> {
        std::vector<size_t> scount, sdispl, rcount, rdispl;
        segments(lo, len, false, scount, sdispl);
        segments(lo, len, true, rcount, rdispl);
        std::vector<size_t> fill = sdispl;  // where the next part for each host goes
        for (size_t j = 0; j < ms.size(); ++j) {
          std::vector<iovec> remote, local;
          for (size_t d = 0; d < n; ++d)
            if (const size_t c = cut(sent(j, d), lo, len)) {
              remote.push_back(piece(ms[j].post.in + ms[j].blocks[4 * d] + lo, c));
              local.push_back({spread.data() + d * len, c});
            }
          transferv(false, ms[j], remote, local);
          for (const Member& to : ms)
            if (const size_t c = cut(sent(j, static_cast<size_t>(to.rank)), lo, len))
              transfer(true, to, to.post.out + to.blocks[4 * static_cast<size_t>(ms[j].rank) + 2] + lo,
                       spread.data() + static_cast<size_t>(to.rank) * len, c);
          for (size_t h = 0; inter && h < hosts; ++h)
            for (size_t k = 0; h != me && k < members[h].size(); ++k) {
              const size_t d = static_cast<size_t>(members[h][k]), c = cut(sent(j, d), lo, len);
              std::memcpy(slot + fill[h], spread.data() + d * len, c);
              fill[h] += c;
            }
        }
        if (!inter) return nullptr;
        return inter->alltoallv(slot, scount, sdispl, slot + pairs * len, rcount, rdispl, DataType::u8);
      },
      [&](size_t lo, size_t len, char* slot) {
        std::vector<size_t> rcount, rdispl;
        segments(lo, len, true, rcount, rdispl);
        std::vector<std::vector<iovec>> remote(ms.size()), local(ms.size());
        for (size_t g = 0; inter && g < hosts; ++g) {
          size_t from = pairs * len + rdispl[g];
          for (size_t j = 0; g != me && j < members[g].size(); ++j)
            for (size_t k = 0; k < ms.size(); ++k)
              if (const size_t c = cut(in_sizes[(g * widest + j) * widest + k], lo, len)) {
                remote[k].push_back(piece(ms[k].post.out + ms[k].blocks[4 * static_cast<size_t>(members[g][j]) + 2] + lo, c));
                local[k].push_back({slot + from, c});
                from += c;
              }
        }
        for (size_t k = 0; k < ms.size(); ++k)
          if (!remote[k].empty()) transferv(true, ms[k], remote[k], local[k]);
      });
}

void Job::execute(std::vector<Member>& ms) {
  const Post& p = ms[0].post;
  for (const Member& m : ms) {
    const Post& q = m.post;
    if (q.seq != p.seq || q.coll != p.coll || q.dtype != p.dtype || q.op != p.op || q.root != p.root ||
        q.count != p.count || q.codec != p.codec || q.layout != p.layout)
      throw CommError("ranks disagree: rank " + std::to_string(ms[0].rank) + " called " + describe(p) + ", rank " +
                      std::to_string(m.rank) + " called " + describe(q));
  }
  for (Member& m : ms) read_tables(m);
  const auto coll = static_cast<Collective>(p.coll);
  if ((coll == Collective::broadcast || coll == Collective::reduce) && (p.root < 0 || p.root >= hello.size))
    throw CommError("rank " + std::to_string(ms[0].rank) + " called " + describe(p) + ": root " +
                    std::to_string(p.root) + " is not a rank of this job of " + std::to_string(hello.size));
  const size_t esize = dtype_size(static_cast<DataType>(p.dtype)), n = static_cast<size_t>(hello.size);
  const size_t block = static_cast<size_t>(p.count) * esize;
  switch (coll) {
    case Collective::allreduce:
      allreduce(ms, p, p.count, [&](size_t at, size_t k, char* sum) {
        for (const Member& m : ms) transfer(true, m, m.post.out + at * esize, sum, k * esize);
      });
      break;
    case Collective::reduce_scatter:  // the whole vector reduced; each rank gets the part of a chunk in its block
      allreduce(ms, p, n * p.count, [&](size_t at, size_t k, char* sum) {
        for (const Member& m : ms) {
          const size_t first = static_cast<size_t>(m.rank) * p.count;
          const size_t lo = std::max(at, first), hi = std::min(at + k, first + p.count);
          if (lo < hi)
            transfer(true, m, m.post.out + (lo - first) * esize, sum + (lo - at) * esize,
                     (hi - lo) * esize);
        }
      });
      break;
    case Collective::reduce:
      allreduce(ms, p, p.count, [&](size_t at, size_t k, char* sum) {
        for (const Member& m : ms)
          if (m.rank == p.root) transfer(true, m, m.post.out + at * esize, sum, k * esize);
      });
      break;
    case Collective::broadcast: {
      const int root_host = hello.hosts[static_cast<size_t>(p.root)];
      const auto dt = static_cast<DataType>(p.dtype);
      const size_t chunk = kChunkBytes / esize;
      windowed(
          p.count, chunk, chunk * esize,
          [&](size_t at, size_t k, char* slot) -> std::shared_ptr<Request> {
            for (const Member& m : ms)
              if (m.rank == p.root) transfer(false, m, m.post.out + at * esize, slot, k * esize);
            return inter ? inter->broadcast(slot, k, dt, root_host) : nullptr;
          },
          [&](size_t at, size_t k, char* slot) {
            for (const Member& m : ms)
              if (m.rank != p.root) transfer(true, m, m.post.out + at * esize, slot, k * esize);
          });
      break;
    }
    case Collective::allgather: {
      // In parts, bytes [lo, lo + len) of every block at a time, through the window: each host contributes its
      // ranks' parts in rank order, padded to the largest host; the daemons gather these, and every part goes
      // to its rank's place in every local rank's output. A part's slot (every host's parts, then this host's
      // contribution) is about one chunk.
      const size_t widest = widest_host(), hosts = static_cast<size_t>(host_count);
      const size_t part = std::min(block, std::max(kMinPartBytes, kChunkBytes / bytes_of({hosts + 1, widest})));
      windowed(
          block, part, bytes_of({hosts + 1, widest, part}),
          [&](size_t lo, size_t len, char* slot) -> std::shared_ptr<Request> {
            char* mine = slot + static_cast<size_t>(host) * widest * len;
            for (size_t j = 0; j < ms.size(); ++j) transfer(false, ms[j], ms[j].post.in + lo, mine + j * len, len);
            if (!inter) return nullptr;
            char* contribution = slot + hosts * widest * len;
            std::memcpy(contribution, mine, widest * len);
            return inter->allgather(contribution, slot, widest * len, DataType::u8, Codec());
          },
          [&](size_t lo, size_t len, char* slot) {
            std::vector<iovec> remote, local;
            for (size_t h = 0; h < members.size(); ++h)
              for (size_t j = 0; j < members[h].size(); ++j) {
                remote.push_back({nullptr, len});
                local.push_back({slot + (h * widest + j) * len, len});
              }
            for (const Member& m : ms) {
              size_t i = 0;
              for (size_t h = 0; h < members.size(); ++h)
                for (size_t j = 0; j < members[h].size(); ++j)
                  remote[i++].iov_base = reinterpret_cast<void*>(
                      static_cast<uintptr_t>(m.post.out + static_cast<uint64_t>(members[h][j]) * block + lo));
              transferv(true, m, remote, local);
            }
          });
      break;
    }
    case Collective::barrier:
      if (inter) wait_between_hosts(inter->barrier());
      break;
    case Collective::alltoall:
      if (std::any_of(members.begin(), members.end(), [&](const auto& h) { return h.size() != widest_host(); })) {
        // Hosts of different sizes: as alltoallv of equal blocks, whose segments between hosts carry only the
        // blocks of their pairs of ranks (alltoall's pad every host to the widest).
        for (Member& m : ms) {
          m.blocks.clear();
          for (size_t d = 0; d < n; ++d) m.blocks.insert(m.blocks.end(), {d * block, block, d * block, block});
        }
        alltoallv(ms, p, /*agreed=*/true);
      } else {
        alltoall(ms, p);
      }
      break;
    case Collective::alltoallv:
      alltoallv(ms, p);
      break;
  }
}

void Job::run() {
  pin(cpus);
  try {
    form();
    std::vector<Member> ms;
    while (next_call(ms)) {
      execute(ms);
      std::lock_guard lock(mu);
      answer_running(failed);
      if (!failed.empty()) break;
      std::lock_guard stats(server.stats_mu_);
      ++server.stats_.calls;
      server.stats_.buffer_peak = std::max<uint64_t>(server.stats_.buffer_peak,
                                                     stage.capacity() + window.capacity() + spread.capacity());
    }
  } catch (const std::exception& e) {
    std::lock_guard lock(mu);
    if (running && !failed.empty()) answer_running(failed);
    running = false;
    fail(e.what());  // answers every post, the ones that were running too, unless the job had failed already
  }
  std::unique_ptr<Communicator> done;
  {
    std::lock_guard lock(mu);
    done = std::move(inter);
  }
  done.reset();  // closes the daemons' connections
  finished = true;
}

// ---- the control thread ----

struct Server::Connection {
  net::Fd fd;
  pid_t pid = 0;
  uid_t uid = 0;
  Clock::time_point since = Clock::now();  // accepted
  std::shared_ptr<Job> job;
  int rank = -1;
};

Server::Server(ServerOptions options) : options_(std::move(options)) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string& path = options_.socket;
  if (path.empty() || path.size() >= sizeof addr.sun_path)
    throw InvalidArgument("--socket '" + path + "': a Unix socket path needs 1 to " +
                          std::to_string(sizeof addr.sun_path - 1) + " bytes");
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (!(options_.timeout > 0)) throw InvalidArgument("--timeout must be positive");
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ::sched_getaffinity(0, sizeof allowed, &allowed);
  for (int c : options_.cpus)
    if (c < 0 || c >= CPU_SETSIZE || !CPU_ISSET(c, &allowed))
      throw InvalidArgument("--cpus: CPU " + std::to_string(c) + " does not exist or is not one this process may "
                            "use");
  listener_ = net::Fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!listener_) throw CommError(std::string("cannot make a Unix socket: ") + std::strerror(errno));
  auto* sa = reinterpret_cast<sockaddr*>(&addr);
  if (::bind(listener_.get(), sa, sizeof addr) != 0) {
    if (errno != EADDRINUSE) throw CommError("cannot bind " + path + ": " + std::strerror(errno));
    // A socket file left by a daemon that died: replace it, unless a daemon still answers there, or it is not a
    // socket at all (never delete a user's file).
    net::Fd probe(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (::connect(probe.get(), sa, sizeof addr) == 0)
      throw CommError("another nicd daemon listens on " + path + " (stop it, or give this one another --socket)");
    struct stat st{};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode))
      throw CommError(path + " exists and is not a socket: give the daemon another --socket");
    ::unlink(path.c_str());
    if (::bind(listener_.get(), sa, sizeof addr) != 0)
      throw CommError("cannot bind " + path + ": " + std::strerror(errno));
  }
  // Who may connect: the daemon's own user only (SO_PEERCRED is checked too). A root daemon serving every user
  // would read and write other users' memory with root's rights, where the kernel's ptrace checks (a process
  // that became setuid, a pid reused) no longer stand between a forged post and someone else's process.
  ::chmod(path.c_str(), 0600);
  if (::listen(listener_.get(), 256) != 0) throw CommError("cannot listen on " + path + ": " + std::strerror(errno));
}

Server::~Server() { stop(); }

void Server::start() {
  control_ = std::thread([this] { serve(); });
}

void Server::stop() {
  stop_ = true;
  if (control_.joinable()) control_.join();
  if (listener_) {
    listener_.reset();
    ::unlink(options_.socket.c_str());
  }
}

ServerStats Server::stats() const {
  std::lock_guard lock(stats_mu_);
  return stats_;
}

std::vector<std::string> Server::take_events() {
  std::lock_guard lock(stats_mu_);
  return std::exchange(events_, {});
}

void Server::event(std::string text) {
  std::lock_guard lock(stats_mu_);
  if (events_.size() < 10000) events_.push_back(std::move(text));
}

void Server::drop(int fd, const std::string& why) {
  auto it = connections_.find(fd);
  if (it == connections_.end()) return;
  Connection& c = *it->second;
  if (c.job) {
    std::lock_guard lock(c.job->mu);
    Slot& s = c.job->slots[c.rank];
    s.fd = -1;
    s.left = true;
    if (!s.bye)
      c.job->fail(why.empty() ? "rank " + std::to_string(c.rank) +
                                    " left the job: its connection to the nicd daemon closed (the process exited "
                                    "or crashed)"
                              : why);
    c.job->cv.notify_all();
  } else if (!why.empty()) {
    {
      // Counted before the answer goes out, so whoever reads the answer also sees the count.
      std::lock_guard lock(stats_mu_);
      ++stats_.refused;
    }
    event("refused pid " + std::to_string(c.pid) + ": " + why);
    send_to(fd, encode(Ready{why}));
  }
  connections_.erase(it);
}

void Server::on_hello(Connection& c, std::string_view msg) {
  Hello h = decode_hello(msg);
  const std::string key = std::to_string(c.uid) + "/" + h.job_id;
  auto it = jobs_.find(key);
  if (it == jobs_.end()) {
    std::vector<bool> seen(static_cast<size_t>(*std::max_element(h.hosts.begin(), h.hosts.end())) + 1);
    for (int g : h.hosts) seen[static_cast<size_t>(g)] = true;
    if (const auto gap = std::find(seen.begin(), seen.end(), false); gap != seen.end())
      throw ProtocolError{"a host layout without host " + std::to_string(gap - seen.begin())};
    auto job = std::make_shared<Job>(*this, key, h, options_.cpus, std::min(options_.timeout, h.timeout));
    it = jobs_.emplace(key, job).first;
    job->worker = std::thread([job] { job->run(); });
    std::lock_guard lock(stats_mu_);
    stats_.jobs_now = jobs_.size();
  }
  Job& job = *it->second;
  const Hello& first = job.hello;
  if (h.size != first.size || h.hosts != first.hosts || h.store != first.store || h.settings != first.settings)
    throw ProtocolError{"rank " + std::to_string(h.rank) + " describes " + job.name() +
                        " differently from rank " + std::to_string(first.rank) +
                        " (world size, host layout, store or settings)"};
  if (h.hosts[static_cast<size_t>(h.rank)] != job.host)
    throw ProtocolError{"rank " + std::to_string(h.rank) + " is on host " +
                        std::to_string(h.hosts[static_cast<size_t>(h.rank)]) + " of the layout, rank " +
                        std::to_string(first.rank) + " on host " + std::to_string(job.host) +
                        ": every rank of one host must use that host's daemon (nicd_socket)"};
  std::lock_guard lock(job.mu);
  Slot& s = job.slots[h.rank];
  if (s.joined)
    throw ProtocolError{"rank " + std::to_string(h.rank) + " of " + job.name() + " is already connected (pid " +
                        std::to_string(s.pid) + ")"};
  s.joined = true;
  s.fd = c.fd.get();
  s.pid = c.pid;
  s.pidfd = open_pidfd(c.pid);
  c.job = it->second;
  c.rank = h.rank;
  if (!job.failed.empty()) {
    send_to(s.fd, encode(Ready{job.failed}));
    s.ready_sent = true;
  }
  job.cv.notify_all();
}

void Server::on_message(Connection& c, std::string_view msg) {
  const Type type = type_of(msg);
  if (type == Type::hello) {
    if (c.job) throw ProtocolError{"a second hello"};
    on_hello(c, msg);
    return;
  }
  if (!c.job) throw ProtocolError{"a message before the hello"};
  Job& job = *c.job;
  std::lock_guard lock(job.mu);
  Slot& s = job.slots[c.rank];
  switch (type) {
    case Type::post: {
      const Post p = decode_post(msg);
      if (!s.posts.empty() && p.seq <= s.posts.back().seq)
        throw ProtocolError{"call #" + std::to_string(p.seq) + " posted after #" + std::to_string(s.posts.back().seq)};
      if (s.posts.size() >= kMaxQueuedPosts)
        throw ProtocolError{std::to_string(kMaxQueuedPosts) + " calls posted and not yet run (the other local ranks "
                            "have not posted them): no more are queued"};
      if (!job.failed.empty()) {
        send_to(s.fd, encode(Done{p.seq, job.failed}));
      } else {
        s.posts.push_back(p);
        job.cv.notify_all();
      }
      return;
    }
    case Type::abort:
      job.fail(decode_abort(msg).reason);
      return;
    case Type::bye:
      s.bye = true;
      job.cv.notify_all();
      return;
    default:
      throw ProtocolError{"an unexpected message of type " + std::to_string(static_cast<int>(type))};
  }
}

void Server::reap() {
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Job& job = *it->second;
    bool connected = false;
    {
      std::lock_guard lock(job.mu);
      for (const auto& [rank, s] : job.slots) connected = connected || s.fd >= 0;
    }
    if (!job.finished || connected) {
      ++it;
      continue;
    }
    job.worker.join();
    event(job.name() + " ended");
    it = jobs_.erase(it);
    std::lock_guard lock(stats_mu_);
    stats_.jobs_now = jobs_.size();
  }
}

void Server::serve() {
  pin(options_.cpus);
  std::string buf(kMaxMessage, '\0');
  auto beat = Clock::now();
  const double hello_deadline = std::min(kHelloDeadline, options_.timeout);
  while (!stop_) {
    std::vector<pollfd> fds{{listener_.get(), POLLIN, 0}};
    for (const auto& [fd, c] : connections_) fds.push_back({fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), 100) < 0 && errno != EINTR) break;
    if (fds[0].revents & POLLIN) {
      net::Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      // Out of descriptors: the waiting connection keeps the listener readable, so back off instead of spinning.
      if (!fd && (errno == EMFILE || errno == ENFILE)) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ucred cred{};
      socklen_t len = sizeof cred;
      if (fd && ::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
        auto c = std::make_unique<Connection>();
        c->pid = cred.pid;
        c->uid = cred.uid;
        const int raw = fd.get();
        c->fd = std::move(fd);
        connections_[raw] = std::move(c);
        {
          std::lock_guard lock(stats_mu_);
          ++stats_.connections;
        }
        if (cred.uid != ::geteuid())
          drop(raw, "uid " + std::to_string(cred.uid) + " may not use the nicd daemon of uid " +
                        std::to_string(::geteuid()));
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      const int fd = fds[i].fd;
      const ssize_t n = ::recv(fd, buf.data(), buf.size(), MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) {
        drop(fd, "");
        continue;
      }
      Connection& c = *connections_.at(fd);
      try {
        on_message(c, std::string_view(buf.data(), static_cast<size_t>(n)));
      } catch (const ProtocolError& e) {
        drop(fd, (c.rank >= 0 ? "rank " + std::to_string(c.rank) : "pid " + std::to_string(c.pid)) +
                     " sent the nicd daemon a bad message: " + e.what);
      } catch (const std::exception& e) {
        drop(fd, e.what());
      }
    }
    if (Clock::now() - beat >= kHeartbeat) {
      beat = Clock::now();
      std::vector<int> silent;  // connected but never said hello: each holds a descriptor of this daemon
      for (const auto& [fd, c] : connections_)
        if (c->job)
          send_to(fd, encode(Type::heartbeat));
        else if (std::chrono::duration<double>(beat - c->since).count() > hello_deadline)
          silent.push_back(fd);
      for (int fd : silent) drop(fd, "no hello within " + seconds(hello_deadline) + " s of connecting");
    }
    reap();
  }
  for (auto& [key, job] : jobs_) {
    std::lock_guard lock(job->mu);
    job->fail("the nicd daemon is stopping");
  }
  for (auto& [key, job] : jobs_) {
    {
      std::lock_guard lock(job->mu);
      for (auto& [rank, s] : job->slots) s.left = true;
      job->cv.notify_all();
    }
    job->worker.join();
  }
  jobs_.clear();
  connections_.clear();
}

}  // namespace smartcoll::nicd
