#include "transport/cma.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <utility>

#include "core/agreement.h"
#include "core/log.h"
#include "smartcoll/reduce.h"

namespace smartcoll::cma {

static_assert(sizeof(Descriptor) == kCallBytes);

namespace {

constexpr uint32_t kHelloMagic = 0x434d4134;    // "CMA4": the control segment with its data area
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

#ifdef IOV_MAX
constexpr size_t kIovMax = IOV_MAX;
#else
constexpr size_t kIovMax = 1024;
#endif

uint64_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// What a side publishes: a list of several pieces by its table, else the one buffer itself.
std::pair<uint64_t, uint32_t> published(std::span<const Extent> list, const void* buffer) {
  if (list.size() > 1) return {address(list.data()), static_cast<uint32_t>(list.size())};
  return {list.empty() ? address(buffer) : list.front().at, 0};
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


Local::Local(Transport& t, bool shm, double spin_us, size_t data_bytes)
    : pids_(t.size(), 0), pidfds_(t.size(), -1) {
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
  if (shm && r == 0) segment = Segment::create(n, data_bytes, segment_token, no_segment);
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
      segment = Segment::open(pids_[0], hellos[0].segment_fd, n, data_bytes, hellos[0].segment_token, no_segment);
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
    control_ = shm_control(std::move(segment), t, spin_us, [this, &t](int p) { return exited(t, p); });
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

// The call's sides as vectors: this rank's own, and its peers', whose piece tables are read when first needed.
struct Local::Sides {
  Local& local;
  Transport& t;
  std::vector<Addresses> addrs;
  std::vector<uint64_t> in_bytes, out_bytes;  // [rank]: the bytes of its input and output in this call
  Vector in, out;                             // this rank's
  std::vector<std::optional<Vector>> peer_in, peer_out;

  const Vector& of(int p, bool output) {
    if (p == t.rank()) return output ? out : in;
    std::optional<Vector>& v = (output ? peer_out : peer_in)[static_cast<size_t>(p)];
    if (v) return *v;
    const Addresses& a = addrs[static_cast<size_t>(p)];
    const uint64_t at = output ? a.out : a.in, want = (output ? out_bytes : in_bytes)[static_cast<size_t>(p)];
    const uint32_t pieces = output ? a.out_pieces : a.in_pieces;
    if (pieces == 0) return v.emplace(at, want);
    std::string wrong;
    if (pieces > want) {  // every piece holds a byte at least
      wrong = std::to_string(pieces) + " pieces";
    } else {
      std::vector<Extent> table(pieces);
      const iovec mine{table.data(), pieces * sizeof(Extent)};
      const iovec theirs{reinterpret_cast<void*>(static_cast<uintptr_t>(at)), mine.iov_len};
      local.read_peer(t, p, {&mine, 1}, {&theirs, 1});
      if (v.emplace(table).bytes() != want)
        wrong = std::to_string(v->bytes()) + " bytes in " + std::to_string(pieces) + " pieces";
    }
    if (!wrong.empty())
      throw CommError(prefix(t) + ": rank " + std::to_string(p) + "'s list for " + describe(as_descriptor(a)) + " holds " + wrong +
                      " where the call takes " + std::to_string(want) + " bytes (a corrupted piece table?)");
    return *v;
  }
};

namespace {
int transfer(int pid, std::span<const iovec> local, std::span<const iovec> remote, bool write) {
  // Each side's position: the iovec it is at and the bytes of that one already read. One call reads as much as
  // both batches hold; a short read (the kernel's cap, a piece it could not reach) resumes where it stopped.
  size_t li = 0, ri = 0, lskip = 0, rskip = 0;
  std::vector<iovec> lb, rb;
  auto batch = [](std::span<const iovec> v, size_t i, size_t skip, std::vector<iovec>& out) {
    const auto first = v.begin() + static_cast<ptrdiff_t>(i);
    out.assign(first, first + static_cast<ptrdiff_t>(std::min(v.size() - i, kIovMax)));
    out.front().iov_base = static_cast<char*>(out.front().iov_base) + skip;
    out.front().iov_len -= skip;
  };
  auto advance = [](std::span<const iovec> v, size_t& i, size_t& skip, size_t n) {
    for (skip += n; i < v.size() && skip >= v[i].iov_len; ++i) skip -= v[i].iov_len;
  };
  while (li < local.size() && ri < remote.size()) {
    batch(local, li, lskip, lb);
    batch(remote, ri, rskip, rb);
    ssize_t k = write ? process_vm_writev(pid, lb.data(), lb.size(), rb.data(), rb.size(), 0)
                      : process_vm_readv(pid, lb.data(), lb.size(), rb.data(), rb.size(), 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return k < 0 ? errno : -1;
    advance(local, li, lskip, static_cast<size_t>(k));
    advance(remote, ri, rskip, static_cast<size_t>(k));
  }
  return 0;
}
}  // namespace

int read_process(int pid, std::span<const iovec> local, std::span<const iovec> remote) {
  return transfer(pid, local, remote, false);
}

int write_process(int pid, std::span<const iovec> local, std::span<const iovec> remote) {
  return transfer(pid, local, remote, true);
}

bool process_gone(int pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  // A zombie still answers kill(pid, 0) but runs no more; a leader thread that exited while others run shows as
  // one too, so only a zombie with no other thread is gone. Whatever cannot be read is taken as alive.
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  bool zombie = false;
  long threads = -1;
  while (std::getline(status, line)) {
    if (line.rfind("State:", 0) == 0) zombie = line.find_first_of("ZX", 6) != std::string::npos;
    if (line.rfind("Threads:", 0) == 0) threads = std::strtol(line.c_str() + 8, nullptr, 10);
  }
  return zombie && threads == 1;
}

void Local::read_peer(Transport& t, int peer, std::span<const iovec> local, std::span<const iovec> remote) {
  const int err = read_process(pids_[peer], local, remote);
  if (err == 0) return;
  std::string what = err == ESRCH  ? "; that rank exited, crashed or failed (see its output)"
                     : err == EFAULT ? "; its buffer is unmapped: did that rank fail or free the buffer?"
                     : err > 0       ? access_hint(err)
                                     : "";
  throw CommError(prefix(t) + ": reading the memory of rank " + std::to_string(peer) + " (pid " +
                  std::to_string(pids_[peer]) + ") failed: " + (err > 0 ? std::strerror(err) : "short read") + what);
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
    if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) throw CommError(exited_text(t, ranks[i]));
}

std::string Local::exited(Transport& t, int p) const {
  if (p < 0 || p >= static_cast<int>(pidfds_.size()) || pidfds_[p] < 0) return "";
  pollfd fd{pidfds_[p], POLLIN, 0};
  return poll(&fd, 1, 0) > 0 && (fd.revents & (POLLIN | POLLHUP | POLLERR)) ? exited_text(t, p) : "";
}

std::string Local::exited_text(Transport& t, int p) const {
  return prefix(t) + ": rank " + std::to_string(p) + " (pid " + std::to_string(pids_[p]) +
         ") exited during the call; that rank crashed or failed (see its output)";
}

void Local::reduce_from_all(Transport& t, Sides& s, const Call& c, size_t from, size_t len, uint64_t dst_off) {
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(c.dt), piece = kPieceBytes / esize;
  char* s0 = staging_.data() + (64 - reinterpret_cast<uintptr_t>(staging_.data()) % 64) % 64;
  char* s1 = s0 + kPieceBytes;
  // x_0 op x_1 op ... accumulates in staging (s0); the last step writes dst, run by run where dst is a list (its
  // pieces hold whole elements). Peers' pieces are read into staging. This rank's own input is read where it lies:
  // in one place where one of its buffers holds the piece, else run by run across its buffers (an operand of
  // nullptr below), never copied first. A piece that would straddle two buffers ends at the first one's end where
  // that leaves a large piece; a piece over small buffers stays whole, so that each peer's part of it is one read
  // (this rank's small buffers are then reduced one run each). Where dst is this
  // rank's own input (in place), dst is written only by the last step of each piece, which reads that same piece
  // (exact aliasing, allowed by reduce()) or staging.
  for (size_t off = 0, k = 0; off < len; off += k) {
    const size_t at = (from + off) * esize;
    const auto [in, in_left] = s.in.locate(at);
    k = std::min(piece, len - off);
    if (in_left < k * esize && in_left >= kPieceBytes / 4) k = in_left / esize;
    const bool in_place = in_left >= k * esize;
    auto fetch = [&](int p, char* buf) -> const char* {
      if (p == r) return in_place ? in : nullptr;
      const iovec into{buf, k * esize};
      read_peer(t, p, {&into, 1}, s.of(p, false).iov(at, k * esize));
      return buf;
    };
    // dst[0, m) = a op b over bytes [pos, pos + m) of the piece.
    auto combine = [&](char* dst, const char* a, const char* b, uint64_t pos, uint64_t m) {
      if (a && b) return reduce(c.dt, c.op, dst, a + pos, b + pos, m / esize);
      s.in.runs(at + pos, m, [&](const char* mine, uint64_t q, uint64_t bytes) {
        reduce(c.dt, c.op, dst + q, a ? a + pos + q : mine, b ? b + pos + q : mine, bytes / esize);
      });
    };
    const char* acc = fetch(0, s0);
    for (int p = 1; p < n - 1; ++p) {
      combine(s0, acc, fetch(p, s1), 0, k * esize);
      acc = s0;
    }
    const char* x = fetch(n - 1, s1);
    s.out.runs(dst_off + off * esize, k * esize, [&](char* dst, uint64_t pos, uint64_t m) {
      combine(dst, acc, x, pos, m);
      if (c.op == ReduceOp::avg) scale_divide(c.dt, dst, m / esize, n);
    });
  }
}

namespace {
bool reduces(Collective c) {
  return c == Collective::allreduce || c == Collective::reduce_scatter || c == Collective::reduce;
}
// Checks what the reads cannot: true where the call is a copy (or nothing) because this is the only rank.
bool only_rank(const Local::Call& c, int n) {
  if (reduces(c.coll) && c.op == ReduceOp::avg && !is_floating(c.dt))
    throw InvalidArgument("op 'avg' needs a floating-point dtype, got " + std::string(dtype_name(c.dt)));
  if (n > 1) return false;
  const size_t block = c.count * dtype_size(c.dt);
  if (c.in && c.out && c.out != c.in && block) std::memcpy(c.out, c.in, block);
  return true;
}
// Chunk q of a whole vector of `count` (the same split as the ring) is reduced by rank q of n.
size_t chunk_begin(size_t count, int n, int q) {
  const size_t un = static_cast<size_t>(n), base = count / un, extra = count % un, uq = static_cast<size_t>(q);
  return uq * base + std::min(uq, extra);
}
size_t chunk_len(size_t count, int n, int q) { return chunk_begin(count, n, q + 1) - chunk_begin(count, n, q); }
bool split_reduction(size_t block, int n) { return n >= 2 && block >= kSplitReductionBytes; }
}  // namespace

bool Local::run(Transport& t, const Call& c, std::chrono::steady_clock::time_point until) {
  if (!usable_) throw InvalidArgument("cma: cross-memory attach is not usable here: " + why_not_);
  bool shared = published_;  // peers may have seen this call
  try {
    if (!published_) {
      calls_.fetch_add(1, std::memory_order_relaxed);
      if (only_rank(c, t.size())) return true;
      const Addresses& mine = c.through_segment ? into_segment(t, c) : addresses(t, c);
      shared = true;
      control_->publish(mine);
      published_ = true;
    }
    if (!agree(t, c, until)) return false;
    published_ = false;
    if (c.through_segment)
      from_segment(t, c);
    else
      run_reads(t, c);
    return true;
  } catch (const InvalidArgument&) {
    // Refused before anything was published (the call does not fit, avg of integers): no peer saw this call,
    // and the path stays usable for the next one. Refused later (a list that does not hold what the call
    // takes), peers wait on this rank: it leaves, as for any other error.
    published_ = false;
    if (shared) leave();
    throw;
  } catch (...) {
    published_ = false;
    leave();  // peers waiting on this rank fail now, not after the timeout
    throw;
  }
}

bool Local::agree(Transport& t, const Call& c, std::chrono::steady_clock::time_point until) {
  const int n = t.size(), r = t.rank();
  all_.resize(static_cast<size_t>(n));
  const Addresses& mine = published_call_;
  try {
    if (!control_->collect(all_.data(), c.call, until)) return false;
  } catch (const OtherPath& e) {
    // `auto` chose by each rank's own arguments: the peer's call took a TCP algorithm (or moved nothing).
    Descriptor theirs, own;
    std::memcpy(&theirs, e.desc.data(), sizeof theirs);
    if (c.desc) std::memcpy(&own, c.desc, sizeof own);
    throw CommError(prefix(t) + ": ranks disagree: rank " + std::to_string(e.peer) + " called " +
                    smartcoll::describe(theirs) + ", this rank (" + std::to_string(r) + ") " +
                    smartcoll::describe(c.desc ? own : as_descriptor(mine)) + " on the same-host path");
  }
  for (int p = 0; p < n; ++p) {
    const Addresses& a = all_[static_cast<size_t>(p)];
    if (a.magic == kAddrMagic && a.coll == mine.coll && a.dtype == mine.dtype && a.op == mine.op &&
        a.root == mine.root && a.count == mine.count && a.layout == mine.layout &&
        a.through_segment == mine.through_segment)
      continue;
    // Numbered calls say so in the communicator's words, which it turns into the report of every rank's call.
    // Both addresses belong to this call (the segment pairs calls by number).
    Descriptor theirs = as_descriptor(a), own = as_descriptor(mine);
    theirs.call = own.call = static_cast<uint16_t>(c.call - 1);
    if (c.call) throw CommError(prefix(t) + ": " + disagreement_text(c.call - 1, r, own, p, theirs));
    throw CommError(prefix(t) + ": ranks disagree: rank " + std::to_string(p) + " called " +
                    smartcoll::describe(theirs) + ", this rank (" + std::to_string(r) + ") " +
                    smartcoll::describe(own));
  }
  return true;
}

size_t Local::segment_need(const Call& c, int rank, int n) {
  const size_t block = c.count * dtype_size(c.dt);
  switch (c.coll) {
    case Collective::reduce_scatter:
    case Collective::alltoall: return static_cast<size_t>(n) * block;
    case Collective::broadcast: return rank == c.root ? block : 0;
    case Collective::barrier:
    case Collective::alltoallv: return 0;
    default: return block;
  }
}

namespace {
// Through the segment, a side is the call's buffer or its list of pieces: `bytes` in all.
Vector side(std::span<const Extent> list, const void* buffer, size_t bytes) {
  return list.empty() ? Vector(address(buffer), bytes) : Vector(list);
}
size_t out_bytes(const Local::Call& c, int n) {
  const size_t block = c.count * dtype_size(c.dt);
  return c.coll == Collective::allgather || c.coll == Collective::alltoall ? static_cast<size_t>(n) * block : block;
}
// Through the segment, the bytes [lo, hi) of rank r's input that no peer reads, which it leaves out of its place:
// alltoall's block r (copied from the input, a list's pieces too); reduce_scatter's block r and, in chunks, an
// allreduce's or reduce's chunk r, reduced from the input where it is one buffer that the output does not
// overlap (in place, the reduction would overwrite it before rank order reaches it; a reduce's non-root writes
// none).
std::pair<size_t, size_t> own_part(const Local::Call& c, int n, int r) {
  const size_t esize = dtype_size(c.dt), block = c.count * esize, un = static_cast<size_t>(n);
  const size_t ur = static_cast<size_t>(r);
  if (c.coll == Collective::alltoall) return {ur * block, (ur + 1) * block};
  const size_t in_bytes = c.coll == Collective::reduce_scatter ? un * block : block;
  // A reduce's non-root writes no output: only its input matters.
  const bool writes_out = !(c.coll == Collective::reduce && r != c.root);
  const bool apart = c.in_list.empty() && c.in &&
                     (!writes_out || (c.out_list.empty() && c.out &&
                                      (c.out + out_bytes(c, n) <= c.in || c.out >= c.in + in_bytes)));
  if (!apart || c.count == 0) return {0, 0};
  if (c.coll == Collective::reduce_scatter) return {ur * block, (ur + 1) * block};
  if ((c.coll == Collective::allreduce || c.coll == Collective::reduce) && split_reduction(block, n))
    return {chunk_begin(c.count, n, r) * esize, chunk_begin(c.count, n, r + 1) * esize};
  return {0, 0};
}
}  // namespace

const Addresses& Local::into_segment(Transport& t, const Call& c) {
  const int n = t.size(), r = t.rank();
  const size_t need = segment_need(c, r, n);
  if (need > control_->data_bytes())
    throw InvalidArgument(prefix(t) + ": " + std::string(collective_name(c.coll)) + " puts " + std::to_string(need) +
                          " bytes per rank through the control segment, which has room for " +
                          std::to_string(control_->data_bytes()) + " (the shm_bytes knob); use algo=cma");
  // Broadcast's buffer is `out` (the root's input); the others' inputs are the whole `in`.
  const Vector source = c.coll == Collective::broadcast ? side(c.out_list, c.out, need) : side(c.in_list, c.in, need);
  char* place = control_->next_data();
  auto put = [&](uint64_t from, uint64_t len) {
    source.runs(from, len, [at = place + from](const char* p, uint64_t pos, uint64_t m) { std::memcpy(at + pos, p, m); });
  };
  // The part only this rank reads stays out of the place: it takes it from its input (from_segment).
  const auto [lo, hi] = own_part(c, n, r);
  put(0, lo);
  put(hi, need - hi);
  published_call_ = {kAddrMagic, static_cast<uint8_t>(c.coll), static_cast<uint8_t>(c.dt),
                     static_cast<uint8_t>(reduces(c.coll) ? c.op : ReduceOp::sum), 0, c.root, c.count,
                     0, 0, 0, 0, c.layout, 1};
  return published_call_;
}

void Local::from_segment(Transport& t, const Call& c) {
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(c.dt), block = c.count * esize;
  const Vector out = side(c.out_list, c.out, out_bytes(c, n));
  // Rank r's own part of its input is read where it is (a single buffer: own_part).
  const auto [lo, hi] = own_part(c, n, r);
  auto data = [&](int p, size_t at) -> const char* {
    return p == r && at >= lo && at < hi && c.coll != Collective::alltoall ? c.in + at : control_->data(p) + at;
  };
  // out[to, to + len) = data(0)[from...] op data(1)[from...] op ... in rank order, as the reads reduce.
  auto reduce_to = [&](char* dst, size_t from, size_t bytes) {
    const size_t k = bytes / esize;
    reduce(c.dt, c.op, dst, data(0, from), data(1, from), k);
    for (int p = 2; p < n; ++p) reduce(c.dt, c.op, dst, dst, data(p, from), k);
    if (c.op == ReduceOp::avg) scale_divide(c.dt, dst, k, n);
  };
  auto reduce_into = [&](size_t from, size_t to, size_t len) {
    out.runs(to, len, [&](char* dst, uint64_t pos, uint64_t m) { reduce_to(dst, from + pos, m); });
  };
  auto copy_into = [&](int p, size_t from, size_t to, size_t len) {
    out.runs(to, len, [&](char* dst, uint64_t pos, uint64_t m) { std::memcpy(dst, data(p, from + pos), m); });
  };
  const bool root_only = c.coll == Collective::reduce;
  if ((c.coll == Collective::allreduce || root_only) && c.count > 0 && split_reduction(block, n)) {
    // Rank q reduces chunk q of every rank's vector (the ring's split) and leaves the result in place of chunk q
    // of its own data, which no peer reads (each reads only its own chunk of the others'); after a barrier every
    // rank (reduce: the root) copies the chunks out. Each element is reduced once, in rank order, as the whole
    // vector's reduction would: the same bits.
    const size_t from = chunk_begin(c.count, n, r) * esize, len = chunk_len(c.count, n, r) * esize;
    char* own = control_->own_data() + from;
    if (root_only && r != c.root && hi > lo) {
      reduce_to(own, from, len);  // its chunk of the input is read from the input: the place is no operand
    } else if (root_only && r != c.root) {
      // A non-root's out is not its result: reduce into scratch (in place would overwrite this rank's own chunk
      // of the input before rank order reaches it).
      reduce_chunk_.resize(len);
      reduce_to(reduce_chunk_.data(), from, len);
      std::memcpy(own, reduce_chunk_.data(), len);
    } else {
      reduce_into(from, from, len);
      if (!root_only) out.runs(from, len, [own](const char* src, uint64_t pos, uint64_t m) { std::memcpy(own + pos, src, m); });
    }
    control_->barrier(1, !root_only || r == c.root);
    if (!root_only || r == c.root)
      for (int k = 1; k < n; ++k) {
        const int p = (r + k) % n;
        const size_t at = chunk_begin(c.count, n, p) * esize;
        copy_into(p, at, at, chunk_len(c.count, n, p) * esize);
      }
    return;
  }
  switch (c.count == 0 ? Collective::barrier : c.coll) {
    case Collective::allreduce: reduce_into(0, 0, block); break;
    case Collective::reduce:
      if (r == c.root) reduce_into(0, 0, block);
      break;
    case Collective::reduce_scatter: reduce_into(static_cast<size_t>(r) * block, 0, block); break;
    case Collective::allgather:
    case Collective::alltoall: {
      const size_t at = c.coll == Collective::alltoall ? static_cast<size_t>(r) * block : 0;
      for (int p = 0; p < n; ++p)
        if (p != r || c.coll == Collective::allgather) copy_into(p, at, static_cast<size_t>(p) * block, block);
      if (c.coll == Collective::alltoall) {  // this rank's own block, not copied into its place
        const Vector in = side(c.in_list, c.in, static_cast<size_t>(n) * block);
        out.runs(at, block, [&](char* dst, uint64_t pos, uint64_t m) {
          in.runs(at + pos, m, [dst](const char* from, uint64_t q, uint64_t k) { std::memcpy(dst + q, from, k); });
        });
      }
      break;
    }
    case Collective::broadcast:
      if (r != c.root) copy_into(c.root, 0, 0, block);
      break;
    case Collective::barrier:
    case Collective::alltoallv: break;
  }
}

const Addresses& Local::addresses(Transport& t, const Call& c) {
  const int n = t.size(), r = t.rank();
  // reduce: a non-root reduces its chunk into reduce_chunk_, where the root reads it.
  const bool reduce_chunk = c.coll == Collective::reduce && r != c.root;
  if (reduce_chunk) reduce_chunk_.resize(chunk_len(c.count, n, r) * dtype_size(c.dt));
  const auto [in_at, in_pieces] = published(c.in_list, c.in);
  const auto [out_at, out_pieces] = reduce_chunk ? std::pair{address(reduce_chunk_.data()), uint32_t{0}}
                                                 : published(c.out_list, c.out);
  published_call_ = {kAddrMagic, static_cast<uint8_t>(c.coll), static_cast<uint8_t>(c.dt),
                     static_cast<uint8_t>(reduces(c.coll) ? c.op : ReduceOp::sum), 0, c.root, c.count,
                     in_at, out_at, in_pieces, out_pieces, c.layout, 0};
  return published_call_;
}

void Local::run_reads(Transport& t, const Call& c) {
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(c.dt), block = c.count * esize, un = static_cast<size_t>(n),
               ur = static_cast<size_t>(r);
  auto chunk_begin = [&](int q) { return cma::chunk_begin(c.count, n, q); };
  auto chunk_len = [&](int q) { return cma::chunk_len(c.count, n, q); };
  const bool reduce_chunk = c.coll == Collective::reduce && r != c.root;
  char* out = reduce_chunk ? reduce_chunk_.data() : c.out;
  const std::span<const Extent> out_list = reduce_chunk ? std::span<const Extent>() : c.out_list;
  const Addresses& mine = published_call_;
  Sides s{*this, t, all_, {}, {}, {}, {}, std::vector<std::optional<Vector>>(un),
          std::vector<std::optional<Vector>>(un)};
  // Every rank's sides: a whole vector, rank j's block of n, or (reduce) a non-root's chunk.
  const bool n_in = c.coll == Collective::reduce_scatter || c.coll == Collective::alltoall;
  const bool n_out = c.coll == Collective::allgather || c.coll == Collective::alltoall;
  for (int p = 0; p < n; ++p) {
    s.in_bytes.push_back(n_in ? un * block : block);
    s.out_bytes.push_back(c.coll == Collective::reduce && p != c.root ? chunk_len(p) * esize
                          : n_out                                     ? un * block
                                                                      : block);
  }
  s.in = c.in_list.empty() ? Vector(address(c.in), s.in_bytes[ur]) : Vector(c.in_list);
  s.out = out_list.empty() ? Vector(address(out), s.out_bytes[ur]) : Vector(out_list);
  // A side given as a list must hold what the call takes (peers check its table alike).
  for (const auto& [list, v, want] :
       {std::tuple{c.in_list, &s.in, s.in_bytes[ur]}, {out_list, &s.out, s.out_bytes[ur]}})
    if (!list.empty() && v->bytes() != want)
      throw InvalidArgument(prefix(t) + ": a list of " + std::to_string(v->bytes()) + " bytes where " +
                            describe(as_descriptor(mine)) + " takes " + std::to_string(want));
  // Reads of rank p's side range [from, from + len) into this rank's side range [to, to + len).
  auto read = [&](int p, bool their_out, uint64_t from, uint64_t to, uint64_t len) {
    if (len) read_peer(t, p, s.out.iov(to, len), s.of(p, their_out).iov(from, len));
  };
  // A call of no elements reads nothing, but still passes the closing barrier that keeps the calls in step.
  switch (c.count == 0 ? Collective::barrier : c.coll) {
    case Collective::allreduce:
      reduce_from_all(t, s, c, chunk_begin(r), chunk_len(r), chunk_begin(r) * esize);
      check_alive(t);
      // Every chunk is final in its owner's out, and nobody reads any in any more: out may now be overwritten
      // (in place, out[chunk p] of this rank is in[chunk p], which rank p was reading until this barrier).
      control_->barrier(1);
      for (int k = 1; k < n; ++k) {
        const int p = (r + k) % n;
        read(p, true, chunk_begin(p) * esize, chunk_begin(p) * esize, chunk_len(p) * esize);
      }
      break;
    case Collective::reduce_scatter:
      reduce_from_all(t, s, c, static_cast<size_t>(r) * c.count, c.count, 0);
      break;
    case Collective::reduce:
      reduce_from_all(t, s, c, chunk_begin(r), chunk_len(r), r == c.root ? chunk_begin(r) * esize : 0);
      check_alive(t);
      control_->barrier(1);  // every chunk is reduced: the root gathers them
      if (r == c.root)
        for (int p = 0; p < n; ++p)
          if (p != r) read(p, true, 0, chunk_begin(p) * esize, chunk_len(p) * esize);
      break;
    case Collective::allgather:
    case Collective::alltoall: {
      // allgather: block p of out is rank p's input; alltoall: it is block r of rank p's input.
      const size_t at = c.coll == Collective::alltoall ? static_cast<size_t>(r) * block : 0;
      for (int k = 1; k < n; ++k) {
        const int p = (r + k) % n;
        read(p, false, at, static_cast<size_t>(p) * block, block);
      }
      // This rank's own block; in-place allgather: already there.
      s.out.runs(static_cast<size_t>(r) * block, block, [&](char* to, uint64_t pos, uint64_t m) {
        s.in.runs(at + pos, m, [to](const char* from, uint64_t q, uint64_t k) {
          if (to + q != from) std::memcpy(to + q, from, k);
        });
      });
      break;
    }
    case Collective::broadcast:
      if (r != c.root) read(c.root, true, 0, 0, block);
      break;
    case Collective::barrier:
    case Collective::alltoallv:  // not on this path (coll/table.cc)
      break;
  }
  // The ranks read from are alive (their pids not recycled). In a broadcast that is the root alone: the other
  // non-roots may be done and gone.
  if (c.coll != Collective::broadcast)
    check_alive(t);
  else if (std::string why = exited(t, c.root); !why.empty())
    throw CommError(why);
  // No rank returns (and lets its caller touch its buffers) while a peer may still be reading them. In a
  // broadcast only the root's buffer is read: the others go on to their next call at once.
  control_->barrier(2, c.coll != Collective::broadcast || r == c.root);
}

}  // namespace smartcoll::cma
