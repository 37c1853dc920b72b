#include "transport/cma_control.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <utility>
#include <vector>

#include "core/agreement.h"
#include "smartcoll/comm.h"
#include "smartcoll/types.h"

namespace smartcoll::cma {

Descriptor as_descriptor(const Addresses& a) {
  // Codes out of range stay so: describe() names such a descriptor as corrupted.
  Descriptor d = make_descriptor(static_cast<Collective>(a.coll), static_cast<DataType>(a.dtype),
                                 static_cast<ReduceOp>(a.op), a.through_segment ? Algorithm::shm : Algorithm::cma,
                                 static_cast<int>(a.root), a.count, Codec::parse("identity"), false);
  if (a.layout) set_list_layout(d, a.layout);
  if (a.magic != kAddrMagic) d.magic = 0;
  return d;
}

namespace {

// ---- over TCP ----

class TcpControl final : public Control {
 public:
  explicit TcpControl(Transport& t) : t_(t) {}
  void publish(const Addresses& mine) override {
    mine_ = mine;
    ops_.clear();
    progress_ = Transport::Clock::now();
  }
  // The exchange stops at `until` and goes on at the next collect() (into the same `all`): the engine runs
  // nothing else on the channels meanwhile, as this call runs alone.
  bool collect(Addresses* all, uint64_t /*call*/, std::chrono::steady_clock::time_point until) override {
    if (ops_.empty()) ops_ = smartcoll::exchange_ops(t_, &mine_, all, sizeof(Addresses));
    return t_.run(ops_, until, &progress_);
  }
  void barrier(uint8_t phase, bool /*wait: every rank exchanges its phase*/) override {
    const int n = t_.size(), r = t_.rank();
    std::vector<uint8_t> got(static_cast<size_t>(n), 0);
    smartcoll::exchange(t_, &phase, got.data(), 1);
    for (int p = 0; p < n; ++p)
      if (p != r && got[static_cast<size_t>(p)] != phase)
        throw CommError("cma: rank " + std::to_string(p) + " is out of step (barrier " +
                        std::to_string(got[static_cast<size_t>(p)]) + ", expected " + std::to_string(phase) + ")");
  }
  const char* kind() const override { return "tcp"; }

 private:
  Transport& t_;
  Addresses mine_{};
  std::vector<Transport::Op> ops_;  // this call's exchange, under way
  Transport::Clock::time_point progress_;
};

// ---- over shared memory ----

constexpr uint64_t kSegmentMagic = 0x534d43434d415334;  // "SMCCMAS4": a data area after the slots

struct alignas(64) Header {
  uint64_t magic;
  uint64_t token;  // rank 0's, announced in its setup message: a mapping of anything else is refused
  uint32_t n;
  std::atomic<uint32_t> bell;     // bumped by every publication; futex word of the waiters
  std::atomic<uint32_t> waiters;  // ranks asleep (or about to sleep) on the bell
  uint64_t data_bytes;            // room per rank and call in the data area (Control::data_bytes)
};

// A call this rank made on another path (Control::elsewhere), a seqlock: `call` is 0 while the words change.
struct OtherCall {
  std::atomic<uint64_t> call;  // the communicator's call number (from 1)
  std::atomic<uint64_t> words[kCallBytes / 8];
};
// Places for the latest calls on other paths, by call number: a rank may post this many calls beyond the one a
// peer waits for before its word is overwritten (then that peer times out, as without it).
constexpr uint64_t kOtherCalls = 8;

// Written by its rank only. Call k goes to call[k % 2]: a rank reaches call k + 2 only after every peer has
// published call k + 1, which each does after reading call k, so a slot is never overwritten while a peer may
// read it (a rank that does not wait at the end of a call may publish the next one before its peers have read
// this one).
struct alignas(64) Slot {
  std::atomic<uint64_t> published;  // number of this rank's latest call whose `call` is final (from 1)
  std::atomic<uint64_t> arrived;    // number of barriers this rank has reached (from 1)
  std::atomic<uint32_t> gone;       // 1: this rank failed or closed its communicator
  Addresses call[2];
  OtherCall other[kOtherCalls];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(Slot) == 512, "docs/same-host.md gives the slot's size");

// The data area follows the slots: two places per rank (call k in place k % 2, as the slot's descriptors), each
// a whole number of cache lines so that no two ranks write one line.
size_t data_room(size_t data_bytes) { return (data_bytes + 63) / 64 * 64; }

size_t segment_bytes(int n, size_t data_bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE)), un = static_cast<size_t>(n);
  const size_t bytes = sizeof(Header) + un * sizeof(Slot) + un * 2 * data_room(data_bytes);
  return (bytes + page - 1) / page * page;
}

// Spinning long only pays when every rank can have a core: where ranks share cores, a spinning rank takes the core
// from the peer it waits for (sched_yield does not hand it over under CFS), and spinning 100 ms made 64 KiB-1 MiB
// calls 1.5-3.4x slower than sleeping at once (4 ranks on 2 cores). A short spin there still catches a peer that
// is about to arrive without a futex sleep and wake-up: 30-100 us took small calls through the segment from
// 30 us to 10-19 us, with 1-16 MiB calls unchanged (BENCHMARKS.md, "Small calls through the same-host segment").
constexpr double kSharedCoresSpinUs = 50;
double spin_for(int n, double spin_us) {
  cpu_set_t set;
  const int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  return cpus >= n ? spin_us : std::min(spin_us, kSharedCoresSpinUs);
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the waiters are other processes (or other mappings of the same memfd).
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

class ShmControl final : public Control {
 public:
  using Clock = std::chrono::steady_clock;

  ShmControl(Segment segment, Transport& t, double spin_us, std::function<std::string(int)> exited)
      : t_(t),
        segment_(std::move(segment)),
        header_(static_cast<Header*>(segment_.base())),
        slots_(reinterpret_cast<Slot*>(header_ + 1)),
        data_(reinterpret_cast<char*>(slots_ + t.size())),
        room_(data_room(segment_.data_bytes())),
        rank_(t.rank()),
        n_(t.size()),
        timeout_(t.timeout),
        spin_(std::chrono::duration<double, std::micro>(spin_for(t.size(), spin_us))),
        exited_(std::move(exited)) {}

  ~ShmControl() override { leave(); }

  void publish(const Addresses& mine) override {
    // A rank that left publishes nothing more: a peer's next call would match it and use what it holds.
    if (left()) throw CommError(left_text("publishing its call #" + std::to_string(calls_ + 1)));
    const uint64_t k = ++calls_;
    slots_[rank_].call[k % 2] = mine;
    published_at_ = Clock::now();
    arrive(&Slot::published, k);
  }

  bool collect(Addresses* all, uint64_t call, Clock::time_point until) override {
    const uint64_t k = calls_;
    if (!wait(&Slot::published, k, "its call #", " on this path", call, published_at_, until)) return false;
    for (int p = 0; p < n_; ++p) all[p] = slots_[p].call[k % 2];
    return true;
  }

  void elsewhere(uint64_t call, const void* desc) override {
    OtherCall& o = slots_[rank_].other[call % kOtherCalls];
    uint64_t words[kCallBytes / 8];
    std::memcpy(words, desc, kCallBytes);
    o.call.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    for (size_t i = 0; i < std::size(words); ++i) o.words[i].store(words[i], std::memory_order_relaxed);
    o.call.store(call, std::memory_order_release);
  }

  void barrier(uint8_t /*phase: the calls were compared, so every rank passes the same barriers*/,
               bool wait_for_all) override {
    const uint64_t k = ++barriers_;
    arrive(&Slot::arrived, k);
    if (wait_for_all) wait(&Slot::arrived, k, "barrier #", "", 0, Clock::now(), Clock::time_point::max());
  }

  void leave() override {
    if (slots_[rank_].gone.exchange(1) == 0) ring();
  }

  const char* kind() const override { return "shm"; }

  size_t data_bytes() const override { return segment_.data_bytes(); }
  char* next_data() override { return place(rank_, calls_ + 1); }
  const char* data(int p) const override { return place(p, calls_); }
  char* own_data() override { return place(rank_, calls_); }

 private:

  using Counter = std::atomic<uint64_t> Slot::*;

  char* place(int p, uint64_t call) const {
    return data_ + (static_cast<size_t>(p) * 2 + call % 2) * room_;
  }

  void ring() {
    header_->bell.fetch_add(1);
    if (header_->waiters.load() > 0) futex(&header_->bell, FUTEX_WAKE, INT_MAX, nullptr);
  }

  bool all_reached(Counter counter, uint64_t k) const {
    for (int p = 0; p < n_; ++p)
      if ((slots_[p].*counter).load() < k) return false;
    return true;
  }

  // Counts this rank in; only the store that completes the set rings, so that sleepers wake once per wait
  // instead of once per arrival. The stores and loads are sequentially consistent: of two ranks arriving last at
  // once, at least one sees the other's store.
  void arrive(Counter counter, uint64_t k) {
    (slots_[rank_].*counter).store(k);
    if (all_reached(counter, k)) ring();
  }

  // Throws OtherPath if rank p left word that it made call number `call` on another path.
  void check_elsewhere(int p, uint64_t call) const {
    const OtherCall& o = slots_[p].other[call % kOtherCalls];
    if (call == 0 || o.call.load(std::memory_order_acquire) != call) return;
    uint64_t words[kCallBytes / 8];
    for (size_t i = 0; i < std::size(words); ++i) words[i] = o.words[i].load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (o.call.load(std::memory_order_relaxed) != call) return;  // overwritten meanwhile: a later call's
    std::array<unsigned char, kCallBytes> desc;
    std::memcpy(desc.data(), words, kCallBytes);
    throw OtherPath(p, desc);
  }

  // Returns true once every rank's `counter` is at least k (acquire: their stores before it are visible), false
  // at `until` if that comes first; throws after the timeout, counted from `start`. `call`: the communicator's
  // number of the call being published (0: none), whose peers may have made it elsewhere.
  bool wait(Counter counter, uint64_t k, const char* what, const char* suffix, uint64_t call, Clock::time_point start,
            Clock::time_point until) {
    auto missing = [&] {
      std::vector<int> m;
      for (int p = 0; p < n_; ++p)
        if ((slots_[p].*counter).load(std::memory_order_acquire) < k) m.push_back(p);
      return m;
    };
    auto all_there = [&] { return all_reached(counter, k); };
    auto waited_for = [&] { return what + std::to_string(k) + suffix; };
    if (all_there()) return true;
    const auto spin_start = Clock::now();
    while (Clock::now() - spin_start < spin_ && Clock::now() < until) {
      sched_yield();  // ranks that share cores: let the peer this rank waits for run
      if (all_there()) return true;
    }
    for (;;) {
      const uint32_t bell = header_->bell.load();
      if (all_there()) return true;
      // abort() from another thread leaves (and rings): waiting for the peers' calls ends now, not at the timeout.
      // Barriers wait on: past them the peers may still read this rank's buffers, which its caller reuses once
      // the call has failed.
      if (counter == &Slot::published && left()) throw CommError(left_text("waiting for " + waited_for()));
      for (int p : missing()) {
        check_elsewhere(p, call);  // first: a peer that went elsewhere may have closed since
        // Gone, and still not there: a peer that arrived, finished the call (a call through the segment, or a
        // barrier it need not wait at) and closed since missing() looked is not missing. It arrived before it
        // left, and before its process exited: looked at after either, its count is conclusive.
        if (slots_[p].gone.load() && (slots_[p].*counter).load() < k) {
          const std::string why = t_.peer_failure(p);
          throw CommError("cma: rank " + std::to_string(p) + (why.empty() ? " failed or closed its communicator" : " failed") +
                          " before getting to " + waited_for() + " (this rank: " + std::to_string(rank_) + ")" +
                          (why.empty() ? "" : ": " + why));
        }
        if (std::string why = exited_(p); !why.empty() && (slots_[p].*counter).load() < k) throw CommError(why);
      }
      if (Clock::now() - start > timeout_) {
        std::string who;
        for (int p : missing()) who += (who.empty() ? "rank " : ", rank ") + std::to_string(p);
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%g", timeout_.count());
        throw CommError("cma: no progress for " + std::string(seconds) + " s: " + who +
                        " has not got to " + waited_for() + "; is that rank alive (not stopped) and calling the same "
                        "collective? (SMARTCOLL_TIMEOUT raises the limit)");
      }
      const auto now = Clock::now();
      if (now >= until) return false;
      // The last arrival bumps the bell after its store, and ring() wakes sleepers when it sees waiters: an
      // arrival after `bell` was read makes the futex wait return at once.
      header_->waiters.fetch_add(1);
      if (!all_there()) {
        // Slices of 10 ms at most: checks for dead peers and the timeout in between.
        const auto ns = std::clamp<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(until - now).count(),
                                            1, 10'000'000);
        const timespec slice{0, static_cast<long>(ns)};
        futex(&header_->bell, FUTEX_WAIT, bell, &slice);
      }
      header_->waiters.fetch_sub(1);
    }
  }

  // This rank failed, aborted or closed its communicator (abort() from another thread included).
  bool left() const { return slots_[rank_].gone.load() || t_.aborted(); }
  std::string left_text(const std::string& doing) const {
    return "cma: this rank (" + std::to_string(rank_) + ") aborted or closed its communicator " + doing;
  }

  Transport& t_;
  Segment segment_;
  Header* header_;
  Slot* slots_;
  char* data_;
  const size_t room_;
  const int rank_, n_;
  const std::chrono::duration<double> timeout_;
  const std::chrono::duration<double> spin_;
  std::function<std::string(int)> exited_;
  uint64_t calls_ = 0, barriers_ = 0;
  Clock::time_point published_at_{};
};

}  // namespace

std::unique_ptr<Control> tcp_control(Transport& t) { return std::make_unique<TcpControl>(t); }

std::unique_ptr<Control> shm_control(Segment segment, Transport& t, double spin_us,
                                     std::function<std::string(int)> exited) {
  return std::make_unique<ShmControl>(std::move(segment), t, spin_us, std::move(exited));
}

// ---- the segment ----

Segment Segment::create(int n, size_t data_bytes, uint64_t token, std::string& error) {
  Segment s;
  s.mem_ = SharedMemory::create("smartcoll-cma", segment_bytes(n, data_bytes), error);
  if (!s.mem_.mapped()) return s;
  auto* h = new (s.mem_.base()) Header{};
  h->magic = kSegmentMagic;
  h->token = token;
  h->n = static_cast<uint32_t>(n);
  h->data_bytes = data_bytes;
  auto* slots = reinterpret_cast<Slot*>(h + 1);
  for (int p = 0; p < n; ++p) new (slots + p) Slot{};
  s.data_bytes_ = data_bytes;
  return s;
}

Segment Segment::open(int pid, int fd, int n, size_t data_bytes, uint64_t token, std::string& error) {
  Segment s;
  SharedMemory mem = SharedMemory::open(pid, fd, segment_bytes(n, data_bytes), "rank 0's control segment", error);
  if (!mem.mapped()) return s;
  const auto* h = static_cast<const Header*>(mem.base());
  if (h->magic != kSegmentMagic || h->token != token || h->n != static_cast<uint32_t>(n) ||
      h->data_bytes != data_bytes) {
    error = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd) +
            " is not rank 0's control segment (a recycled descriptor?)";
    return s;
  }
  s.mem_ = std::move(mem);
  s.data_bytes_ = data_bytes;
  return s;
}

}  // namespace smartcoll::cma
