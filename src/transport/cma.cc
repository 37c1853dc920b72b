#include "transport/cma.h"

#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>

#include "core/agreement.h"
#include "core/log.h"
#include "smartcoll/reduce.h"

namespace smartcoll::cma {

static_assert(sizeof(Descriptor) == kCallBytes);

namespace {

constexpr uint32_t kHelloMagic = 0x434d4132;    // "CMA2": with the control segment
constexpr uint32_t kVerdictMagic = 0x434d4157;  // "CMAW": with the segment flag

struct Hello {
  uint32_t magic;
  int32_t pid;
  uint64_t token_addr;  // address of an 8-byte token in the sender's memory
  uint64_t token;       // its value
  int32_t segment_fd;   // rank 0: its descriptor of the control segment (-1: none); others: -1
  uint32_t pad;
  uint64_t segment_token;  // rank 0: the token stamped in the segment
  char identity[216];   // host identity, NUL-terminated; empty when it could not be read
};
static_assert(sizeof(Hello) == 256);

struct Verdict {
  uint32_t magic;
  uint32_t ok;
  uint32_t shm;      // 1: this rank has mapped the control segment
  char reason[244];  // NUL-terminated
};
static_assert(sizeof(Verdict) == 256);

std::string first_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) return "";
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r' || line.back() == ' ')) line.pop_back();
  return line;
}

template <size_t N>
void copy_cstr(char (&dst)[N], const std::string& s) {
  size_t len = std::min(s.size(), N - 1);
  std::memcpy(dst, s.data(), len);
  dst[len] = '\0';
}

template <size_t N>
std::string from_cstr(const char (&src)[N]) {
  return std::string(src, strnlen(src, N));
}

std::string prefix(const Transport& t) { return t.context.empty() ? "cma" : t.context + " (cma)"; }

std::string access_hint(int err) {
  if (err != EPERM && err != EACCES) return "";
  std::string scope = first_line("/proc/sys/kernel/yama/ptrace_scope");
  return " (ptrace access denied: different user, a non-dumpable process, a seccomp filter" +
         (scope.empty() ? std::string() : ", or kernel.yama.ptrace_scope=" + scope) + ")";
}

int open_pidfd(int pid) {
#ifdef SYS_pidfd_open
  long fd = syscall(SYS_pidfd_open, pid, 0);
  return fd < 0 ? -1 : static_cast<int>(fd);
#else
  (void)pid;
  return -1;
#endif
}

uint64_t random_token() {
  uint64_t x = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
               (static_cast<uint64_t>(getpid()) << 40);
  try {
    std::random_device rd;
    x ^= rd() | (static_cast<uint64_t>(rd()) << 32);
  } catch (const std::exception&) {  // no entropy source: the clock and pid still make a mix-up unlikely
  }
  return x | 1;
}

// Restores the transport's context (used in error messages) when setup ends.
struct ContextGuard {
  Transport& t;
  std::string saved;
  ContextGuard(Transport& t, std::string now) : t(t), saved(std::move(t.context)) { t.context = std::move(now); }
  ~ContextGuard() { t.context = std::move(saved); }
};

}  // namespace

// Which kernel and namespaces this process runs in: two processes may read each other's memory by pid only when
// these all match (same boot of the same machine, same pid namespace so that pids mean the same process).
std::string host_identity(std::string& error) {
  std::string boot = first_line("/proc/sys/kernel/random/boot_id");
  if (boot.empty()) {
    error = "cannot read /proc/sys/kernel/random/boot_id";
    return "";
  }
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) {
    error = std::string("gethostname failed: ") + std::strerror(errno);
    return "";
  }
  std::string id = "host=" + std::string(host) + " boot_id=" + boot;
  for (const char* ns : {"net", "pid"}) {
    struct stat st {};
    std::string path = std::string("/proc/self/ns/") + ns;
    if (stat(path.c_str(), &st) != 0) {
      error = "cannot stat " + path + ": " + std::strerror(errno);
      return "";
    }
    id += std::string(" ") + ns + "ns=" + std::to_string(st.st_ino);
  }
  return id;
}


Local::Local(Transport& t, bool shm, double spin_us) : pids_(t.size(), 0), pidfds_(t.size(), -1) {
  const int n = t.size(), r = t.rank();
  pids_[r] = static_cast<int>(getpid());
  if (n == 1) {
    usable_ = true;
    return;
  }
  // Yama ptrace_scope=1 only lets ancestors read a process unless it names a tracer (one pid, or any: peers are
  // several). Only then, and only while the path may be used: it widens who may ptrace this process to every
  // process of this user (as under scope 0) until the probe finds the path unusable or the communicator closes.
  widened_ = first_line("/proc/sys/kernel/yama/ptrace_scope") == "1" &&
             prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0;
  ContextGuard guard(t, "cma setup on rank " + std::to_string(r));

  std::string reason;
  const std::string identity = host_identity(reason);
  token_ = random_token();
  Hello mine{};
  mine.magic = kHelloMagic;
  mine.pid = pids_[r];
  mine.token_addr = reinterpret_cast<uintptr_t>(&token_);
  mine.token = token_;
  copy_cstr(mine.identity, identity);
  // Rank 0's control segment; the others map it once their probe of rank 0 has shown that it is who it says.
  Segment segment;
  std::string no_segment = shm ? "" : "cma=tcp";
  const uint64_t segment_token = random_token();
  if (shm && r == 0) segment = Segment::create(n, segment_token, no_segment);
  mine.segment_fd = segment.fd();
  mine.segment_token = segment_token;
  std::vector<Hello> hellos(n);
  exchange(t, &mine, hellos.data(), sizeof(Hello));

  for (int p = 0; p < n && reason.empty(); ++p) {
    if (p == r) continue;
    const Hello& h = hellos[p];
    std::string theirs = from_cstr(h.identity);
    if (h.magic != kHelloMagic)
      reason = "rank " + std::to_string(p) + " sent a foreign setup message (a different smartcoll version?)";
    else if (theirs.empty())
      reason = "rank " + std::to_string(p) + " could not read its host identity";
    else if (theirs != identity)
      reason = "rank " + std::to_string(p) + " is on another host or in other namespaces (" + theirs +
               "; this rank: " + identity + ")";
    else
      pids_[p] = h.pid;
  }
  // Probe: read every peer's token. Peers keep their token alive until the verdicts are exchanged below, which
  // happens only after every rank has finished probing.
  for (int p = 0; p < n && reason.empty(); ++p) {
    if (p == r) continue;
    if (pids_[p] != pids_[r]) pidfds_[p] = open_pidfd(pids_[p]);
    uint64_t got = 0;
    iovec local{&got, sizeof got};
    iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(hellos[p].token_addr)), sizeof got};
    ssize_t k = process_vm_readv(pids_[p], &local, 1, &remote, 1, 0);
    if (k < 0) {
      int err = errno;
      reason = "process_vm_readv of rank " + std::to_string(p) + " (pid " + std::to_string(pids_[p]) +
               ") failed: " + std::strerror(err) + access_hint(err);
    } else if (k != static_cast<ssize_t>(sizeof got) || got != hellos[p].token) {
      reason = "process_vm_readv of rank " + std::to_string(p) + " (pid " + std::to_string(pids_[p]) +
               ") read the wrong bytes (is the pid that of another process?)";
    }
  }

  if (shm && r != 0 && reason.empty()) {
    if (hellos[0].segment_fd >= 0)
      segment = Segment::open(pids_[0], hellos[0].segment_fd, n, hellos[0].segment_token, no_segment);
    else if (no_segment.empty())
      no_segment = "rank 0 has no control segment";
  }

  Verdict v{};
  v.magic = kVerdictMagic;
  v.ok = reason.empty() ? 1 : 0;
  v.shm = segment.mapped() ? 1 : 0;
  copy_cstr(v.reason, reason);
  std::vector<Verdict> verdicts(n);
  exchange(t, &v, verdicts.data(), sizeof(Verdict));
  usable_ = true;
  for (int p = 0; p < n && usable_; ++p) {
    if (verdicts[p].magic == kVerdictMagic && verdicts[p].ok == 1) continue;
    usable_ = false;
    why_not_ = "rank " + std::to_string(p) + ": " +
               (verdicts[p].magic == kVerdictMagic ? from_cstr(verdicts[p].reason) : "foreign setup message");
  }
  if (!usable_) {
    for (int& fd : pidfds_)
      if (fd >= 0) close(fd), fd = -1;
    narrow();
    return;
  }
  staging_.resize(2 * kPieceBytes + 64);
  // Every rank has mapped the segment (or given up on it) by now: rank 0's descriptor is no longer needed.
  segment.close_fd();
  bool all_mapped = true;
  for (int p = 0; p < n; ++p) all_mapped &= verdicts[p].shm == 1;
  if (all_mapped) {
    control_ = shm_control(std::move(segment), t, spin_us, [this, &t] { check_alive(t); });
  } else {
    control_ = tcp_control(t);
    SC_LOG(r == 0 ? LogLevel::info : LogLevel::debug, r, "")
        << "cma: control messages go over TCP: "
        << (no_segment.empty() ? "a rank could not map the control segment" : no_segment);
  }
}

Local::~Local() {
  control_.reset();  // peers still waiting on this rank fail at once
  for (int fd : pidfds_)
    if (fd >= 0) close(fd);
  narrow();
}

void Local::narrow() {
  if (widened_) prctl(PR_SET_PTRACER, 0, 0, 0, 0);  // back to Yama's default: ancestors only
  widened_ = false;
}

void Local::read_peer(Transport& t, int peer, void* local, uint64_t remote, size_t len) {
  auto* dst = static_cast<char*>(local);
  while (len > 0) {
    const size_t step = std::min<size_t>(len, size_t{1} << 30);  // the kernel caps one call near 2 GiB
    iovec l{dst, step};
    iovec rm{reinterpret_cast<void*>(static_cast<uintptr_t>(remote)), step};
    ssize_t k = process_vm_readv(pids_[peer], &l, 1, &rm, 1, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      int err = k < 0 ? errno : 0;
      std::string what = err == ESRCH  ? "; that rank exited, crashed or failed (see its output)"
                         : err == EFAULT ? "; its buffer is unmapped: did that rank fail or free the buffer?"
                                         : access_hint(err);
      throw CommError(prefix(t) + ": reading the memory of rank " + std::to_string(peer) + " (pid " +
                      std::to_string(pids_[peer]) + ") failed: " + (err ? std::strerror(err) : "short read") +
                      what);
    }
    dst += k;
    remote += static_cast<uint64_t>(k);
    len -= static_cast<size_t>(k);
  }
}

void Local::check_alive(Transport& t) {
  std::vector<pollfd> fds;
  std::vector<int> ranks;
  for (int p = 0; p < static_cast<int>(pidfds_.size()); ++p)
    if (pidfds_[p] >= 0) fds.push_back({pidfds_[p], POLLIN, 0}), ranks.push_back(p);
  if (fds.empty()) return;
  int k = poll(fds.data(), fds.size(), 0);
  if (k <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i)
    if (fds[i].revents & (POLLIN | POLLHUP | POLLERR))
      throw CommError(prefix(t) + ": rank " + std::to_string(ranks[i]) + " (pid " + std::to_string(pids_[ranks[i]]) +
                      ") exited during the call; that rank crashed or failed (see its output)");
}

void Local::reduce_from_all(Transport& t, const std::vector<Addresses>& addrs, const Call& c, size_t from,
                            size_t len, char* dst) {
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(c.dt), piece = kPieceBytes / esize;
  char* s0 = staging_.data() + (64 - reinterpret_cast<uintptr_t>(staging_.data()) % 64) % 64;
  char* s1 = s0 + kPieceBytes;
  // x_0 op x_1 op ... accumulates in staging (s0); the last step writes dst. This rank's own input is read in
  // place; where dst is this rank's own input (allreduce in place), dst is written only by the last step of each
  // piece, which reads that same piece (exact aliasing, allowed by reduce()).
  for (size_t off = 0; off < len; off += piece) {
    const size_t k = std::min(piece, len - off), at = (from + off) * esize;
    auto fetch = [&](int p, char* buf) -> const char* {
      if (p == r) return c.in + at;
      read_peer(t, p, buf, addrs[p].in + at, k * esize);
      return buf;
    };
    const char* acc = fetch(0, s0);
    for (int p = 1; p < n; ++p) {
      const char* x = fetch(p, s1);
      char* into = p == n - 1 ? dst + off * esize : s0;
      reduce(c.dt, c.op, into, acc, x, k);
      acc = into;
    }
    if (c.op == ReduceOp::avg) scale_divide(c.dt, dst + off * esize, k, n);
  }
}

void Local::run(Transport& t, const Call& c) {
  if (!usable_) throw InvalidArgument("cma: cross-memory attach is not usable here: " + why_not_);
  try {
    run_call(t, c);
  } catch (...) {
    leave();  // peers waiting on this rank fail now, not after the timeout
    throw;
  }
}

void Local::run_call(Transport& t, const Call& c) {
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(c.dt), block = c.count * esize;
  const bool reduces = c.coll == Collective::allreduce || c.coll == Collective::reduce_scatter ||
                       c.coll == Collective::reduce;
  if (reduces && c.op == ReduceOp::avg && !is_floating(c.dt))
    throw InvalidArgument("op 'avg' needs a floating-point dtype, got " + std::string(dtype_name(c.dt)));
  if (n == 1) {  // every collective of one rank is a copy (or nothing, in place and for broadcast)
    if (c.in && c.out && c.out != c.in && block) std::memcpy(c.out, c.in, block);
    return;
  }
  // Chunk q of a whole vector (the same split as the ring) is reduced by rank q.
  auto chunk_begin = [&](int q) {
    const size_t base = c.count / n, extra = c.count % n, uq = static_cast<size_t>(q);
    return uq * base + std::min(uq, extra);
  };
  auto chunk_len = [&](int q) { return chunk_begin(q + 1) - chunk_begin(q); };
  // reduce: a non-root reduces its chunk here, where the root reads it.
  std::vector<char> chunk(c.coll == Collective::reduce && r != c.root ? chunk_len(r) * esize : 0);
  char* out = c.coll == Collective::reduce && r != c.root ? chunk.data() : c.out;

  // Addresses, and the call, so that a mismatch fails cleanly instead of reading past a peer's buffer.
  const Addresses mine{kAddrMagic, static_cast<uint8_t>(c.coll), static_cast<uint8_t>(c.dt),
                       static_cast<uint8_t>(reduces ? c.op : ReduceOp::sum), 0, c.root, c.count,
                       reinterpret_cast<uintptr_t>(c.in), reinterpret_cast<uintptr_t>(out)};
  std::vector<Addresses> addrs(n);
  try {
    control_->exchange(mine, addrs.data(), c.call);
  } catch (const OtherPath& e) {
    // `auto` chose by each rank's own arguments: the peer's call took a TCP algorithm (or moved nothing).
    Descriptor theirs, own;
    std::memcpy(&theirs, e.desc.data(), sizeof theirs);
    if (c.desc) std::memcpy(&own, c.desc, sizeof own);
    throw CommError(prefix(t) + ": ranks disagree: rank " + std::to_string(e.peer) + " called " +
                    smartcoll::describe(theirs) + ", this rank (" + std::to_string(r) + ") " +
                    (c.desc ? smartcoll::describe(own) : describe(mine)) + " on the same-host path");
  }
  for (int p = 0; p < n; ++p) {
    const Addresses& a = addrs[p];
    if (a.magic != kAddrMagic || a.coll != mine.coll || a.dtype != mine.dtype || a.op != mine.op ||
        a.root != mine.root || a.count != mine.count)
      throw CommError(prefix(t) + ": ranks disagree: rank " + std::to_string(p) + " called " +
                      (a.magic == kAddrMagic ? describe(a) : "something else (a corrupted message)") +
                      ", this rank (" + std::to_string(r) + ") " + describe(mine));
  }
  // A call of no elements reads nothing, but still passes the closing barrier that keeps the calls in step.
  switch (c.count == 0 ? Collective::barrier : c.coll) {
    case Collective::allreduce:
      reduce_from_all(t, addrs, c, chunk_begin(r), chunk_len(r), out + chunk_begin(r) * esize);
      check_alive(t);
      // Every chunk is final in its owner's out, and nobody reads any in any more: out may now be overwritten
      // (in place, out[chunk p] of this rank is in[chunk p], which rank p was reading until this barrier).
      control_->barrier(1);
      for (int k = 1; k < n; ++k) {
        const int p = (r + k) % n;
        const size_t b = chunk_begin(p) * esize;
        if (chunk_len(p)) read_peer(t, p, out + b, addrs[p].out + b, chunk_len(p) * esize);
      }
      break;
    case Collective::reduce_scatter:
      reduce_from_all(t, addrs, c, static_cast<size_t>(r) * c.count, c.count, out);
      break;
    case Collective::reduce:
      reduce_from_all(t, addrs, c, chunk_begin(r), chunk_len(r),
                      r == c.root ? out + chunk_begin(r) * esize : chunk.data());
      check_alive(t);
      control_->barrier(1);  // every chunk is reduced: the root gathers them
      if (r == c.root)
        for (int p = 0; p < n; ++p)
          if (p != r && chunk_len(p))
            read_peer(t, p, out + chunk_begin(p) * esize, addrs[p].out, chunk_len(p) * esize);
      break;
    case Collective::allgather:
    case Collective::alltoall: {
      // allgather: block p of out is rank p's input; alltoall: it is block r of rank p's input.
      const size_t at = c.coll == Collective::alltoall ? static_cast<size_t>(r) * block : 0;
      for (int k = 1; k < n; ++k) {
        const int p = (r + k) % n;
        read_peer(t, p, out + static_cast<size_t>(p) * block, addrs[p].in + at, block);
      }
      char* own = out + static_cast<size_t>(r) * block;
      if (own != c.in + at) std::memcpy(own, c.in + at, block);  // in-place allgather: already there
      break;
    }
    case Collective::broadcast:
      if (r != c.root) read_peer(t, c.root, out, addrs[static_cast<size_t>(c.root)].out, block);
      break;
    case Collective::barrier:
    case Collective::alltoallv:  // not on this path (coll/table.cc)
      break;
  }
  check_alive(t);
  // No rank returns (and lets its caller touch its buffers) while a peer may still be reading them. In a
  // broadcast only the root's buffer is read: the others go on to their next call at once.
  control_->barrier(2, c.coll != Collective::broadcast || r == c.root);
}

}  // namespace smartcoll::cma
