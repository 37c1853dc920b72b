#include "nicd/client.h"

#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

namespace smartcoll::nicd {

namespace {

using Clock = std::chrono::steady_clock;

void send_message(int fd, const std::string& msg) {
  while (::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL) < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK)  // SO_SNDTIMEO ran out
      throw CommError("the daemon read nothing for the timeout: it is stopped or hung");
    if (errno == EPIPE || errno == ECONNRESET)
      throw CommError(std::string(std::strerror(errno)) + " (the daemon exited or crashed)");
    if (errno != EINTR) throw CommError(std::strerror(errno));
  }
}

std::string seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", s);
  return text;
}

}  // namespace

void check_supported(Collective coll, const Codec& codec) {
  if (codec.kind() != CodecKind::identity && coll != Collective::allreduce)
    throw InvalidArgument("engine=nicd compresses only allreduce between hosts; " +
                          std::string(collective_name(coll)) + " with codec '" + codec.name() +
                          "' is not supported there: pass no codec, or use engine=inprocess");
}

std::string Client::where() const {
  return "the nicd daemon" + (daemon_pid_ ? " (pid " + std::to_string(daemon_pid_) + ")" : std::string()) +
         " at " + path_;
}

Client::Client(const std::string& path, const Hello& hello, const Spinner& spin)
    : path_(path), timeout_(hello.timeout), spin_(spin), pid_(::getpid()) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path)
    throw InvalidArgument("nicd_socket '" + path + "': a Unix socket path needs 1 to " +
                          std::to_string(sizeof addr.sun_path - 1) + " bytes");
  std::memcpy(addr.sun_path, path.data(), path.size());
  // The launcher starts the daemon before the ranks; a little patience covers a daemon that is still binding.
  const auto deadline = Clock::now() + std::chrono::duration<double>(std::min(hello.connect_timeout, 10.0));
  for (;;) {
    fd_ = net::Fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!fd_) throw CommError(std::string("cannot make a Unix socket: ") + std::strerror(errno));
    if (::connect(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) break;
    const int err = errno;
    if ((err != ENOENT && err != ECONNREFUSED && err != EAGAIN) || Clock::now() >= deadline)
      throw CommError("engine=nicd: cannot connect to the nicd daemon at " + path + ": " + std::strerror(err) +
                      " (start one per host with `smartcoll nicd --socket " + path +
                      "`, or launch with `smartcoll run --nicd`)");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    throw CommError("engine=nicd: cannot read the credentials of the process at " + path + ": " + std::strerror(errno));
  // The hello carries the job's store secret, and the daemon's answers decide what this rank takes as results:
  // only a daemon of this rank's own user may have them.
  if (cred.uid != ::geteuid())
    throw CommError("engine=nicd: the process at " + path + " (pid " + std::to_string(cred.pid) + ") runs as uid " +
                    std::to_string(cred.uid) + ", not this rank's uid " + std::to_string(::geteuid()) +
                    ": start your own daemon (smartcoll nicd) and point nicd_socket at it");
  daemon_pid_ = cred.pid;
  // A daemon that stops reading must not block a post forever (the reader, which fails calls on silence, needs
  // the lock a blocked post would hold).
  const double limit = std::max(hello.timeout, 0.001);
  timeval tv{static_cast<time_t>(limit), static_cast<suseconds_t>((limit - static_cast<time_t>(limit)) * 1e6)};
  ::setsockopt(fd_.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  // Under Yama ptrace_scope=1 only ancestors may read a process unless it names its reader: the daemon, by the
  // pid the kernel reports for the socket's other end (never one a message claims).
  std::ifstream scope("/proc/sys/kernel/yama/ptrace_scope");
  int yama = 0;
  if (scope >> yama && yama == 1 && daemon_pid_ > 0) ::prctl(PR_SET_PTRACER, daemon_pid_, 0, 0, 0);
  try {
    send_message(fd_.get(), encode(hello));
  } catch (const CommError& e) {
    throw CommError("engine=nicd: cannot introduce rank " + std::to_string(hello.rank) + " to " + where() + ": " +
                    e.what());
  }
  // The daemon answers once every local rank has connected and the daemons of every host have met (each within
  // connect_timeout); a little more lets its answer arrive.
  const auto ready_by = Clock::now() + std::chrono::duration<double>(hello.connect_timeout + 5);
  std::string buf(kMaxMessage, '\0');
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(ready_by - Clock::now()).count();
    pollfd p{fd_.get(), POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) == 0)
      throw CommError("engine=nicd: " + where() + " did not form job '" + hello.job_id + "' within " +
                      seconds(hello.connect_timeout + 5) + " s");
    const ssize_t n = ::recv(fd_.get(), buf.data(), buf.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw CommError("engine=nicd: " + where() + " closed the connection before the job was formed");
    try {
      const std::string_view msg(buf.data(), static_cast<size_t>(n));
      if (type_of(msg) == Type::heartbeat) continue;
      const Ready ready = decode_ready(msg);
      if (!ready.error.empty()) throw CommError("engine=nicd: " + where() + ": " + ready.error);
      break;
    } catch (const ProtocolError& e) {
      throw CommError("engine=nicd: " + where() + " sent a malformed answer: " + e.what);
    }
  }
  heard_ = Clock::now();
  reader_ = std::thread([this] { read_loop(); });
}

Client::~Client() { close(); }

void Client::close() {
  std::call_once(closed_, [this] { close_once(); });
}

void Client::close_once() {
  // Calls still running finish first, as the in-process engine's close lets them: the daemon may write into
  // their buffers until it answers. Each ends: the daemon's own timeouts bound its calls, and the reader fails
  // them when the daemon goes away or falls silent.
  std::vector<std::shared_ptr<Request>> running;
  {
    std::lock_guard lock(mu_);
    for (auto& [seq, call] : pending_) running.push_back(call.req);
  }
  for (auto& req : running) {
    try {
      req->wait();
    } catch (const CommError&) {  // its error belongs to whoever waits on it
    }
  }
  {
    std::lock_guard lock(mu_);
    if (broken_.empty()) {
      try {
        send_message(fd_.get(), encode(Type::bye));
      } catch (const CommError&) {  // the daemon is gone: nothing to say bye to
      }
    }
    fail_all("the communicator is closed");
  }
  stop_ = true;
  ::shutdown(fd_.get(), SHUT_RDWR);
  if (reader_.joinable()) reader_.join();
}

void Client::fail_all(const std::string& why) {
  if (broken_.empty()) broken_ = why;
  for (auto& [seq, call] : pending_) {
    call.req->finish(why);
    if (call.keep) unanswered_.push_back(std::move(call.keep));
  }
  pending_.clear();
}

std::shared_ptr<Request> Client::post(const Post& p, std::shared_ptr<const void> keep) {
  auto req = std::make_shared<Request>();
  std::lock_guard lock(mu_);
  if (!broken_.empty()) {
    req->finish(broken_);
    return req;
  }
  pending_[p.seq] = {req, std::move(keep)};
  req->nicd_ = weak_from_this();
  try {
    send_message(fd_.get(), encode(p));
  } catch (const CommError& e) {
    fail_all("engine=nicd: cannot post call #" + std::to_string(p.seq) + " to " + where() + ": " + e.what());
  }
  return req;
}

void Client::abort(const std::string& reason) {
  std::lock_guard lock(mu_);
  if (!broken_.empty()) return;
  broken_ = reason;  // later calls fail at once
  try {
    // The daemon fails the job and answers the pending calls once it no longer touches their buffers.
    send_message(fd_.get(), encode(Abort{reason}));
  } catch (const CommError&) {  // the daemon is gone: nothing touches the buffers any more
    fail_all(reason);
  }
}

bool Client::take_messages(Clock::time_point now, uint64_t& answers) {
  for (;;) {
    const ssize_t n = ::recv(fd_.get(), inbox_.data(), inbox_.size(), MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n <= 0) {
      if (!stop_) fail_all("engine=nicd: " + where() + " closed its connection: the daemon exited or crashed");
      return false;
    }
    heard_ = now;
    try {
      const std::string_view msg(inbox_.data(), static_cast<size_t>(n));
      if (type_of(msg) == Type::done) {
        const Done done = decode_done(msg);
        auto it = pending_.find(done.seq);
        if (it == pending_.end()) throw ProtocolError{"an answer to call #" + std::to_string(done.seq) +
                                                      ", which this rank has not posted"};
        it->second.req->finish(done.error);
        pending_.erase(it);
        ++answers;
      } else if (type_of(msg) != Type::heartbeat) {
        throw ProtocolError{"an unexpected message of type " + std::to_string(static_cast<int>(type_of(msg)))};
      }
    } catch (const ProtocolError& e) {
      fail_all("engine=nicd: " + where() + " sent a malformed message: " + e.what);
      return false;
    }
  }
}

void Client::drive(Request& req, std::optional<Clock::time_point> deadline) {
  // A forked child shares the parent's socket: it must not take the parent's answers.
  if (::getpid() != pid_) return;
  std::unique_lock driving(drive_mu_, std::try_to_lock);
  if (!driving.owns_lock()) return;
  const auto since = Clock::now();
  for (;;) {
    {
      std::lock_guard lock(mu_);
      uint64_t answers = 0;
      const bool open = broken_.empty() && take_messages(Clock::now(), answers);
      driven_.fetch_add(answers, std::memory_order_relaxed);
      if (!open) return;
    }
    const auto now = Clock::now();
    if (req.done_.load(std::memory_order_acquire) || (deadline && now >= *deadline) || !spin_.again(now, since))
      return;
  }
}

void Client::read_loop() {
  while (!stop_) {
    pollfd p{fd_.get(), POLLIN, 0};
    const int k = ::poll(&p, 1, 100);
    // While a caller drives it reads every answer that arrives: wait until it stops rather than race it for each
    // one (on few cores this thread, woken by the kernel, would otherwise take nearly all of them).
    std::unique_lock driving(drive_mu_, std::defer_lock);
    if (k > 0) driving.lock();
    const auto now = Clock::now();
    std::lock_guard lock(mu_);
    // A caller that drives may have taken what woke this thread: then there is nothing to read.
    uint64_t answers = 0;
    if (k > 0 && !take_messages(now, answers)) return;
    if (!pending_.empty() && now - heard_ > std::chrono::duration<double>(timeout_)) {
      fail_all("engine=nicd: " + where() + " sent nothing for " + seconds(timeout_) +
               " s while calls were pending: the daemon is stopped or hung (SMARTCOLL_TIMEOUT)");
      // Once the daemon notices the connection's end it fails the job, and its worker stops before its next read
      // or write of a rank's memory (a daemon that stays hung never touches them again either).
      ::shutdown(fd_.get(), SHUT_RDWR);
      return;
    }
  }
}

}  // namespace smartcoll::nicd
