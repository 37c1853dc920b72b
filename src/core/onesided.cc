#include "core/onesided.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <utility>

#include "core/checks.h"
#include "core/frame.h"
#include "core/log.h"
#include "core/mac.h"
#include "kernels/copy.h"
#include "store/cleanup.h"
#include "transport/cma.h"
#include "transport/shared_memory.h"

namespace smartcoll::rma {

namespace {

constexpr auto kHelloDeadline = std::chrono::seconds(5);
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);
constexpr auto kWarnPeriod = std::chrono::seconds(1);
constexpr size_t kDiscard = 64 * 1024;  // a refused payload is read and dropped in pieces this large

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// A message's bytes as a list of buffers, and how far they have moved.
struct Cursor {
  std::vector<iovec> segs;
  size_t seg = 0, off = 0;
  bool done() const { return seg == segs.size(); }
  bool started() const { return seg != 0 || off != 0; }
  int fill(iovec* iov) {
    int n = 0;
    for (size_t k = seg; k < segs.size() && n < kMaxIov; ++k) {
      const size_t skip = k == seg ? off : 0;
      iov[n++] = {static_cast<char*>(segs[k].iov_base) + skip, segs[k].iov_len - skip};
    }
    return n;
  }
  void advance(size_t n) {
    while (seg < segs.size()) {
      const size_t left = segs[seg].iov_len - off;
      if (n < left) {
        off += n;
        return;
      }
      n -= left;
      ++seg;
      off = 0;
    }
  }
  // Skips empty buffers at the front, so that done() tells whether any byte is still to come.
  void settle() { advance(0); }
};

// Bytes counted against a pool (Service::held_) for as long as this lives.
class Hold {
 public:
  Hold() = default;
  Hold(std::atomic<uint64_t>& pool, uint64_t n) : pool_(&pool), n_(n) { pool += n; }
  Hold(Hold&& o) noexcept : pool_(o.pool_), n_(std::exchange(o.n_, 0)) {}
  Hold& operator=(Hold&& o) noexcept {
    if (this != &o) {
      release();
      pool_ = o.pool_;
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  ~Hold() { release(); }

 private:
  void release() {
    if (pool_ && n_) *pool_ -= n_;
    n_ = 0;
  }
  std::atomic<uint64_t>* pool_ = nullptr;
  uint64_t n_ = 0;
};

// A staging buffer: allocated, not zero-filled (the bytes that fill it come off the wire or from the region).
struct Block {
  std::unique_ptr<char[]> bytes;
  size_t size = 0;
  Hold hold;
  char* data() const { return bytes.get(); }
};

Block make_block(uint64_t n, Hold hold = {}) {
  return {std::make_unique_for_overwrite<char[]>(n), n, std::move(hold)};
}

struct Out {
  std::vector<char> head, text;
  Block body;
  Cursor at;
  uint64_t left = 0;                    // bytes not yet sent
  std::shared_ptr<Service::Call> call;  // a request: keeps its local buffers' list alive
};

// The local buffers' bytes, one after the other, into `out`; and back.
auto local_at(std::span<const LocalPiece> local) {
  return [local](size_t k) { return std::pair<char*, size_t>{static_cast<char*>(local[k].data), local[k].bytes}; };
}

uint64_t total_bytes(std::span<const LocalPiece> local) {
  return sum_bytes(local, UINT64_MAX, [](const LocalPiece& p) { return uint64_t{p.bytes}; }).value_or(0);
}

void from_local(std::span<const LocalPiece> local, char* out) {
  kernels::gather(out, local.size(), local_at(local), total_bytes(local));
}

void to_local(const char* in, std::span<const LocalPiece> local) {
  kernels::scatter(in, local.size(), local_at(local), total_bytes(local));
}

// Bytes of the pieces `from` into the pieces `to`, each taken one after the other (the same bytes in all):
// piece(i) -> {address, bytes}.
template <class From, class To>
void copy_between(size_t nfrom, From from, size_t nto, To to) {
  kernels::PrefetchAhead<From> ahead(from, nfrom, false);
  for (size_t i = 0, j = 0, fi = 0, tj = 0; i < nfrom && j < nto;) {
    const auto [src, slen] = from(i);
    const auto [dst, dlen] = to(j);
    const size_t n = std::min(slen - fi, dlen - tj);
    ahead.advance(n);
    if (n) std::memcpy(dst + tj, src + fi, n);
    fi += n, tj += n;
    if (fi == slen) ++i, fi = 0;
    if (tj == dlen) ++j, tj = 0;
  }
}

// A get (pieces of the region mapped at `base` into the local buffers) or a put (the reverse), copied by this
// thread: the gather or scatter kernel where the local side is one buffer, piece by piece otherwise.
void copy_mapped(char* base, std::span<const RemotePiece> pieces, std::span<const LocalPiece> local, uint64_t bytes,
                 bool put) {
  const auto remote_at = [base, pieces](size_t k) {
    return std::pair<char*, size_t>{base + pieces[k].offset, pieces[k].bytes};
  };
  if (local.size() == 1)
    put ? kernels::scatter(static_cast<const char*>(local[0].data), pieces.size(), remote_at, bytes)
        : kernels::gather(static_cast<char*>(local[0].data), pieces.size(), remote_at, bytes);
  else
    put ? copy_between(local.size(), local_at(local), pieces.size(), remote_at)
        : copy_between(pieces.size(), remote_at, local.size(), local_at(local));
}

// The pieces as they lie one after the other in the local buffers.
std::vector<RemotePiece> packed(std::span<const RemotePiece> pieces) {
  std::vector<RemotePiece> out;
  uint64_t at = 0;
  for (const RemotePiece& p : pieces) {
    out.push_back({at, p.bytes});
    at += p.bytes;
  }
  return out;
}

std::vector<char> head_bytes(const Header& h, std::span<const RemotePiece> pieces = {}) {
  std::vector<char> b(sizeof h + pieces.size_bytes());
  std::memcpy(b.data(), &h, sizeof h);
  if (!pieces.empty()) std::memcpy(b.data() + sizeof h, pieces.data(), pieces.size_bytes());
  return b;
}

// An error answer of id 0: why the target closes the channel. Sent best effort on a channel with no message
// half sent, so that the initiator's error names the cause instead of only "closed by that rank".
void farewell(int fd, const std::string& why) {
  Header h;
  h.kind = static_cast<uint8_t>(Kind::error);
  h.payload = std::min<uint64_t>(why.size(), kMaxErrorText);
  std::vector<char> b = head_bytes(h);
  b.insert(b.end(), why.begin(), why.begin() + static_cast<ptrdiff_t>(h.payload));
  [[maybe_unused]] ssize_t n = ::send(fd, b.data(), b.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

// The farewell at the head of what fd has received, unread ("" where there is none, or not all of it). A Unix
// socket fails a send to a peer that closed at once, while that peer's farewell may wait unread (over TCP that
// send goes through and the farewell is read first).
std::string farewell_waiting(int fd) {
  std::vector<char> b(sizeof(Header) + kMaxErrorText);
  const ssize_t n = ::recv(fd, b.data(), b.size(), MSG_PEEK | MSG_DONTWAIT);
  Header h;
  if (n < static_cast<ssize_t>(sizeof h)) return "";
  std::memcpy(&h, b.data(), sizeof h);
  if (h.magic != kMagic || static_cast<Kind>(h.kind) != Kind::error || h.id != 0 || h.payload > kMaxErrorText ||
      static_cast<uint64_t>(n) < sizeof h + h.payload)
    return "";
  return std::string(b.data() + sizeof h, h.payload);
}

std::string hex_of(const uint8_t* bytes, size_t n) {
  std::string hex;
  char two[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(two, sizeof two, "%02x", bytes[i]);
    hex += two;
  }
  return hex;
}

}  // namespace

struct Service::Region {
  Region(uint64_t i, char* b, uint64_t n, DataType d, std::shared_ptr<cma::SharedMemory> m)
      : id(i), base(b), bytes(n), dtype(d), memory(std::move(m)) {}
  // Its slot's tag is cleared by now (remove, close_directory): a peer that opens the descriptor from here on
  // finds the tag gone after mapping (see onesided.h).
  ~Region() {
    if (memory) memory->close_fd();
  }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  const uint64_t id;
  char* const base;
  const uint64_t bytes;
  const DataType dtype;
  const std::shared_ptr<cma::SharedMemory> memory;  // allocated: its memfd; else null
  std::mutex mu;  // held while copying from or into the buffer
  bool alive = true;
};

// A region's entry in this rank's directory, which peers on this host map (slot id % kSlots). The tag is
// written last on registration and cleared first on deregistration; a peer trusts base and bytes only when the
// tag read the same, and right, before and after it read them (see onesided.h).
struct Service::Slot {
  std::atomic<uint64_t> tag{0}, base{0}, bytes{0};
  std::atomic<uint64_t> shared{0};  // an allocated region's memfd in the owner, plus 1; 0: any other buffer
  std::atomic<uint64_t> dtype{0};   // the region's DataType, plus 1: a direct accumulate must match it
  // The accumulate lock of the region in this slot (of whichever region holds it: a region whose slot was taken
  // keeps using it, so that its accumulates stay exclusive): the holder's rank plus 1, 0 when free.
  std::atomic<uint64_t> accumulating{0};
  // Who has waited for the lock and takes it next (see AccumulateLock::claim), and until when; 0: nobody.
  std::atomic<uint64_t> next{0};
};
namespace {
constexpr size_t kSlots = 1024;
constexpr uint64_t kDirectoryMagic = 0x534d43524d414435;  // "SMCRMAD5"
// What a directory starts with: a peer that mapped the descriptor the store named checks that it is one, and
// this target's (a descriptor closed and reused meanwhile would be something else).
struct DirectoryHeader {
  uint64_t magic, secret, ranks, reserved;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);  // atomics in memory that other processes map
size_t directory_bytes(int n) {
  return sizeof(DirectoryHeader) + kSlots * sizeof(Service::Slot) + static_cast<size_t>(n) * sizeof(uint64_t);
}
}  // namespace

// A directory in shared memory: a header, kSlots slots, then a word per rank of the world: the region that rank
// is writing into directly (0: none).
struct Service::Directory {
  cma::SharedMemory mem;  // unmapped: the peer has no directory, or it could not be mapped
  uint64_t secret = 0;    // of its tags
  std::mutex writing;     // this rank writes into the peer from one thread at a time: it has one word there
  std::mutex maps_mu;
  std::map<uint64_t, std::shared_ptr<cma::SharedMemory>> maps;  // by region id: mapped (null: cannot be)
  DirectoryHeader* header() const { return static_cast<DirectoryHeader*>(mem.base()); }
  Slot* slots() const { return reinterpret_cast<Slot*>(header() + 1); }
  std::atomic<uint64_t>* writers() const { return reinterpret_cast<std::atomic<uint64_t>*>(slots() + kSlots); }
};

namespace {
// A slot's accumulate lock (Slot::accumulating), which the target's server and the peers that accumulate into an
// allocated region directly take around each accumulate, so that they apply one at a time. A holder whose process
// has exited is passed over (its accumulate may have stopped half done: that rank's job has failed anyway).
//
// Fair enough that nobody starves: a taker that has waited past a few quick tries claims the next turn
// (Slot::next: who, and a deadline a little ahead that it renews on every try), and while a live claim of another
// stands, the lock is not taken even when free. Without it, a served accumulate that retries once a millisecond
// lost the lock for hundreds of milliseconds to peers that accumulate back to back (BENCHMARKS.md). A claimant
// that stops trying (it gave up, or its process stopped) holds the others back for kClaimMs at most.
class AccumulateLock {
 public:
  // Who takes it: the lock word it writes (its rank plus 1), and its identity in claims: that, plus kServer for the
  // target's server (whose rank is the region owner's, which may accumulate into its own region directly too); 0
  // for a rank past the claim's field, which makes no claims (no fairness for it, nothing wrong).
  struct Taker {
    uint64_t word, id;
  };
  static Taker taker(int rank, bool server) {
    const uint64_t word = static_cast<uint64_t>(rank) + 1;
    return {word, word <= kRank ? word | (server ? kServer : 0) : 0};
  }
  // One try: 0 when `me` took the lock, else the rank plus 1 of the holder, or of the claimant it stood back for.
  static uint64_t take(Service::Slot& slot, const Taker& me, std::span<const int> pids) {
    const uint64_t claim = slot.next.load();
    if (claim && (claim & kWho) != me.id && now_ms() <= claim >> kWhoBits && !gone(claim & kRank, pids)) {
      const uint64_t holder = slot.accumulating.load();  // read once: a second read may see it released (0)
      return holder ? holder : claim & kRank;
    }
    uint64_t held = 0;
    bool took = slot.accumulating.compare_exchange_strong(held, me.word);
    if (!took && gone(held, pids)) took = slot.accumulating.compare_exchange_strong(held, me.word);
    if (!took) return held ? held : take(slot, me, pids);  // released meanwhile: try again
    withdraw(slot, me);  // the claimed turn, taken
    return 0;
  }
  // After a failed try: claims the next turn unless another's live claim stands, or renews this taker's own.
  static void claim(Service::Slot& slot, const Taker& me, std::span<const int> pids) {
    if (me.id == 0) return;
    uint64_t claim = slot.next.load();
    const uint64_t now = now_ms();
    if (claim && (claim & kWho) != me.id && now <= claim >> kWhoBits && !gone(claim & kRank, pids)) return;
    slot.next.compare_exchange_strong(claim, ((now + kClaimMs) << kWhoBits) | me.id);
  }
  // Withdraws this taker's claim (it took the lock, or gives up), if it still stands.
  static void withdraw(Service::Slot& slot, const Taker& me) {
    uint64_t mine = slot.next.load();
    if (me.id && mine && (mine & kWho) == me.id) slot.next.compare_exchange_strong(mine, 0);
  }
  // What a caller that waited `timeout` says: the holder now (a stopped process keeps it).
  static std::string waited(uint64_t holder, double timeout) {
    return "waited " + log::seconds(timeout) + " for the region's accumulate lock, which rank " +
           std::to_string(holder - 1) + " holds (a stopped process?)";
  }
  // Takes it, waiting at most `timeout` (CommError after it, naming the holder and `what`).
  AccumulateLock(Service::Slot& slot, int rank, std::span<const int> pids, double timeout, const std::string& what)
      : word_(slot.accumulating) {
    const Taker who = taker(rank, false);
    const auto deadline = Clock::now() + millis(timeout);
    for (int looks = 0;; ++looks) {
      const uint64_t holder = take(slot, who, pids);
      if (holder == 0) return;
      if (looks < 100) {  // an accumulate of a few pieces ends within microseconds
        std::this_thread::yield();
        continue;
      }
      claim(slot, who, pids);
      if (Clock::now() > deadline) {
        withdraw(slot, who);
        throw CommError(what + ": " + waited(holder, timeout));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  ~AccumulateLock() { word_.store(0); }
  AccumulateLock(const AccumulateLock&) = delete;
  AccumulateLock& operator=(const AccumulateLock&) = delete;

 private:
  // Slot::next: the deadline (milliseconds of the host's monotonic clock, which every process shares) above
  // kWhoBits; below, the taker: the rank plus 1 (kRank) and kServer.
  static constexpr int kWhoBits = 24;
  static constexpr uint64_t kWho = (uint64_t{1} << kWhoBits) - 1, kServer = uint64_t{1} << (kWhoBits - 1),
                            kRank = kServer - 1;
  // How long a claim stands unless renewed: its claimant tries again every 50 us (a direct accumulate) or every
  // millisecond (the server), so only one that stopped trying lets it lapse; long enough that a claimant kept off
  // its core a while on a loaded host (tests saw 50 ms lapse) keeps its turn.
  static constexpr uint64_t kClaimMs = 250;
  static uint64_t now_ms() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
  }
  // Whether `holder` (a rank plus 1) is no rank of the world or one whose process has exited.
  static bool gone(uint64_t holder, std::span<const int> pids) {
    return holder >= 1 && (holder > pids.size() || cma::process_gone(pids[holder - 1]));
  }
  std::atomic<uint64_t>& word_;
};

// Whether any local buffer shares a byte with [lo, lo + bytes).
bool overlaps(std::span<const LocalPiece> local, uintptr_t lo, uint64_t bytes) {
  return std::any_of(local.begin(), local.end(), [&](const LocalPiece& l) {
    const auto at = reinterpret_cast<uintptr_t>(l.data);
    return l.bytes && at < lo + bytes && lo < at + l.bytes;
  });
}
}  // namespace

struct Service::Call {
  explicit Call(std::atomic<int>& outstanding) : outstanding(outstanding) { outstanding.fetch_add(1); }
  ~Call() { outstanding.fetch_sub(1); }  // a call is dropped once done
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  std::atomic<int>& outstanding;  // Service::outstanding_ of its peer
  std::string name;  // "getv #3 on rank 0 to rank 1"
  int peer = 0;
  Header head;
  std::vector<RemotePiece> pieces;
  std::vector<LocalPiece> local;
  std::optional<Codec> codec;
  std::vector<char> encoded;  // a put's or accumulate's payload under a codec
  bool sent = false;          // the request has left whole: its buffers are no longer read
  std::shared_ptr<Request> req;
};

struct Service::Conn {
  net::Fd fd;
  int peer = -1;
  bool outgoing = false;  // this rank connected: it initiates on this channel, the peer answers
  bool closed = false;
  bool more = false;      // receive() stopped before the socket ran dry
  Clock::time_point last = Clock::now();
  // The message coming in: its header (stage 0), pieces table (1), staging taken (2), payload (3).
  int stage = 0;
  size_t got = 0;
  Header h{};
  std::vector<RemotePiece> pieces;
  Cursor into;
  uint64_t discard = 0;  // refused payload bytes still to drop
  Block staging;         // target: a put's payload or a get's answer; initiator: an error's text, encoded data
  std::string refused;              // target: why the request in hand is refused
  std::optional<Codec> codec;       // target: the codec of the request in hand
  std::shared_ptr<Region> region;   // target: the region it is for
  std::optional<Clock::time_point> lock_wait;  // target: since when the request in hand waits for an accumulate lock
  std::shared_ptr<Call> call;       // initiator: the call the answer in hand is for (null: a farewell)
  std::deque<Out> out;
  uint64_t queued = 0;  // bytes of `out` not yet sent
  std::map<uint64_t, std::shared_ptr<Call>> waiting;  // initiator: sent or queued, not answered
};

// A connection accepted whose hello has not fully arrived.
struct Service::Accepting {
  net::Fd fd;
  Clock::time_point since;
  Hello hello{};
  size_t got = 0;
};

Service::Service(const Settings& settings, std::shared_ptr<Store> store)
    : s_(settings),
      outstanding_(new std::atomic<int>[static_cast<size_t>(settings.size)]()),
      store_(std::move(store)),
      connecting_(new std::mutex[static_cast<size_t>(settings.size)]),
      connected_(static_cast<size_t>(settings.size), false),
      last_close_(static_cast<size_t>(settings.size)), gone_(static_cast<size_t>(settings.size), false),
      to_peer_(static_cast<size_t>(settings.size), nullptr) {
  listener_ = net::listen_on(s_.host.empty() ? "127.0.0.1" : s_.host, 0, 1024);
  net::set_nonblocking(listener_.get(), true);
  if (s_.unix_sockets) {
    try {
      local_listener_ = net::listen_abstract(local_name(s_.rank, net::bound_port(listener_.get())), 1024);
      net::set_nonblocking(local_listener_.get(), true);
    } catch (const CommError& e) {  // initiators on this host then connect over TCP
      SC_LOG(LogLevel::warn, s_.rank, "") << "one-sided: " << e.what() << "; initiators on this host use TCP";
    }
  }
  epfd_ = net::Fd(epoll_create1(EPOLL_CLOEXEC));
  wakefd_ = net::Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!epfd_ || !wakefd_)
    throw CommError("cannot create the one-sided server's epoll or eventfd: " + std::string(std::strerror(errno)));
  for (int fd : {listener_.get(), local_listener_.get(), wakefd_.get()}) {
    if (fd < 0) continue;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, fd, &ev);
  }
  random_bytes(token_);
  directories_.resize(static_cast<size_t>(s_.size));
  if (!s_.pids.empty()) {
    auto own = std::make_unique<Directory>();
    std::string why;
    own->mem = cma::SharedMemory::create("smartcoll-rma", directory_bytes(s_.size), why);
    if (own->mem.mapped()) {
      for (size_t i = 0; i < kSlots; ++i) new (own->slots() + i) Slot{};
      for (int r = 0; r < s_.size; ++r) new (own->writers() + r) std::atomic<uint64_t>(0);
      uint8_t secret[8];
      random_bytes(secret);
      std::memcpy(&own->secret, secret, sizeof own->secret);
      own->secret |= 1;  // never 0, the tag of an empty slot, whatever the id
      *own->header() = {kDirectoryMagic, own->secret, static_cast<uint64_t>(s_.size), 0};
      // Published before the address: a peer that found the address finds the directory.
      store_->set(key(s_.rank) + "/directory", std::to_string(own->mem.fd()) + " " + std::to_string(own->secret));
      own_ = std::move(own);
    } else {
      SC_LOG(LogLevel::warn, s_.rank, "") << "one-sided: " << why << "; peers on this host go through the server";
    }
  }
  store_->set(key(s_.rank), (s_.host.empty() ? "127.0.0.1" : s_.host) + ":" +
                                                    std::to_string(net::bound_port(listener_.get())) + " " +
                                                    hex_of(token_, sizeof token_));
  thread_ = std::thread([this] { run(); });
}

// The name of rank's Unix socket, after the port of its TCP listener (never the token: names are public, in
// /proc/net/unix).
std::string Service::local_name(int rank, int port) const {
  return net::job_socket_name(s_.job, rank, "rma/" + std::to_string(port));
}

std::string Service::key(int rank) const {
  return "rma/" + std::to_string(rank) + "/" + (s_.claims.empty() ? "" : s_.claims.at(static_cast<size_t>(rank)));
}

Service::~Service() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wakefd_.get(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  // Nobody can reach this server any more: its address, token and directory go (the prefix holds them all).
  forget(*store_, key(s_.rank));
  if (!directory_closed_)
    for (const auto& [id, why] : close_directory())
      SC_LOG(LogLevel::error, s_.rank, "") << "one-sided: closing: " << why;
}

std::map<uint64_t, std::string> Service::close_directory() {
  std::map<uint64_t, std::string> stuck;
  if (!own_ || directory_closed_) return stuck;
  directory_closed_ = true;
  for (size_t i = 0; i < kSlots; ++i) own_->slots()[i].tag.store(0);
  for (int p = 0; p < s_.size; ++p) {
    const uint64_t id = own_->writers()[p].load();
    bool registered = false;
    {
      std::lock_guard lock(regions_mu_);
      registered = regions_.count(id) != 0;  // else deregistering it failed already, and said so
    }
    if (id == 0 || !registered || stuck.count(id)) continue;
    try {
      wait_for_writers(id);
    } catch (const CommError& e) {
      stuck[id] = e.what();
    }
  }
  return stuck;
}

void Service::abort(const std::string& why) {
  {
    std::lock_guard lock(mu_);
    if (aborted_.empty()) aborted_ = why;
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wakefd_.get(), &one, sizeof one);
}

uint64_t Service::add(void* base, size_t bytes, DataType dtype, std::shared_ptr<cma::SharedMemory> memory) {
  require(base || bytes == 0, "register: a null buffer of " + std::to_string(bytes) + " bytes");
  std::lock_guard lock(regions_mu_);
  const uint64_t id = next_region_++;
  const uint64_t shared = memory ? static_cast<uint64_t>(memory->fd()) + 1 : 0;
  regions_[id] = std::make_shared<Region>(id, static_cast<char*>(base), bytes, dtype, std::move(memory));
  if (own_) {  // a region registered 1024 ids before, if still registered, is served by the server from now on
    Slot& slot = own_->slots()[id % kSlots];
    slot.tag.store(0);
    slot.base.store(reinterpret_cast<uintptr_t>(base));
    slot.bytes.store(bytes);
    slot.shared.store(shared);
    slot.dtype.store(static_cast<uint64_t>(dtype) + 1);
    slot.tag.store(own_->secret ^ id);
  }
  return id;
}

AllocatedRegion Service::allocate(size_t bytes, DataType dtype) {
  require(bytes > 0, "allocate: 0 bytes (a region of shared memory holds at least 1 byte)");
  std::string why;
  auto memory = std::make_shared<cma::SharedMemory>(cma::SharedMemory::create("smartcoll-region", bytes, why));
  if (!memory->mapped()) throw CommError("allocate: " + why + " (" + std::to_string(bytes) + " bytes)");
  AllocatedRegion r;
  r.data = memory->base();
  r.bytes = bytes;
  r.memory = memory;
  r.id = add(r.data, bytes, dtype, std::move(memory));
  return r;
}

void Service::remove(uint64_t id) {
  std::shared_ptr<Region> r;
  {
    std::lock_guard lock(regions_mu_);
    auto it = regions_.find(id);
    require(it != regions_.end(), "deregister: region " + std::to_string(id) + (id > 0 && id < next_region_
                                      ? " was deregistered already" : " was never registered on this rank"));
    r = std::move(it->second);
    regions_.erase(it);
    if (own_) {  // unless a later region took the slot
      uint64_t tag = own_->secret ^ id;
      own_->slots()[id % kSlots].tag.compare_exchange_strong(tag, 0);
    }
  }
  {
    std::lock_guard lock(r->mu);  // a copy in progress finishes first; none starts after
    r->alive = false;
  }
  wait_for_writers(id);
}

void Service::wait_for_writers(uint64_t id) {
  if (!own_) return;
  const auto deadline = Clock::now() + millis(s_.timeout);
  for (int p = 0; p < s_.size; ++p) {
    const std::atomic<uint64_t>& word = own_->writers()[p];
    for (int looks = 0;; ++looks) {
      const uint64_t writing = word.load();
      if (writing != id) break;
      if (looks < 100) {  // a write of a few pieces ends within microseconds
        std::this_thread::yield();
        continue;
      }
      if (cma::process_gone(s_.pids[static_cast<size_t>(p)])) break;
      if (Clock::now() > deadline)
        throw CommError("deregister: rank " + std::to_string(p) + " (pid " +
                        std::to_string(s_.pids[static_cast<size_t>(p)]) + ") has been writing into region " +
                        std::to_string(writing) + " of rank " + std::to_string(s_.rank) + " for more than " +
                        log::seconds(s_.timeout) + " (a stopped process?): keep the buffer allocated");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

std::shared_ptr<Service::Region> Service::find(uint64_t id, std::string& why) {
  std::lock_guard lock(regions_mu_);
  if (auto it = regions_.find(id); it != regions_.end()) return it->second;
  why = id > 0 && id < next_region_ ? "region " + std::to_string(id) + " was deregistered"
                                    : "rank " + std::to_string(s_.rank) + " has no region " + std::to_string(id) +
                                          " (it has registered " + std::to_string(next_region_ - 1) + ")";
  return nullptr;
}

std::shared_ptr<Request> Service::post(Kind kind, const RemoteRegion& region, std::span<const RemotePiece> pieces,
                                       std::span<const LocalPiece> local, ReduceOp op,
                                       const std::optional<Codec>& requested) {
  const std::string what = kind_name(static_cast<uint8_t>(kind));
  require(region.rank >= 0 && region.rank < s_.size, what + ": rank " + std::to_string(region.rank) +
                                                         " is outside the world of size " + std::to_string(s_.size));
  // The identity codec changes no byte: the call moves raw bytes, on a region of any type.
  const std::optional<Codec> codec =
      requested && requested->kind() == CodecKind::identity ? std::nullopt : requested;
  for (size_t i = 0; i < local.size(); ++i) {
    require(local[i].data || local[i].bytes == 0,
            what + ": local buffer " + std::to_string(i) + " is null but has " + std::to_string(local[i].bytes) +
                " bytes");
  }
  const std::optional<uint64_t> local_bytes =
      sum_bytes(local, kMaxPayload, [](const LocalPiece& p) { return uint64_t{p.bytes}; });
  require(local_bytes.has_value(), what + ": the local buffers add up to more than " + std::to_string(kMaxPayload) +
                                       " bytes; a call moves at most that much: split it");
  check_call(kind, region, pieces, *local_bytes, op, codec);
  if (!codec && !s_.pids.empty() && outstanding_[static_cast<size_t>(region.rank)].load() == 0) {
    connect(region.rank);  // waits for the target's server (and directory), and is there if the server must serve
    if (auto req = copy_directly(kind, region, pieces, local, *local_bytes, op)) return req;
  }
  auto call = std::make_shared<Call>(outstanding_[static_cast<size_t>(region.rank)]);
  call->peer = region.rank;
  call->head.kind = static_cast<uint8_t>(kind);
  call->head.dtype = static_cast<uint8_t>(region.dtype);
  call->head.op = static_cast<uint8_t>(op);
  call->head.npieces = static_cast<uint32_t>(pieces.size());
  call->head.id = next_call_++;
  call->head.region = region.id;
  set_codec(call->head, codec);
  call->head.payload = kind == Kind::get ? 0 : wire_bytes(pieces, codec);
  call->pieces.assign(pieces.begin(), pieces.end());
  call->local.assign(local.begin(), local.end());
  call->codec = codec;
  if (codec && kind != Kind::get) {
    // The local buffers hold the pieces one after the other: encode each piece from their concatenation.
    std::vector<char> raw(*local_bytes);
    from_local(local, raw.data());
    call->encoded.resize(call->head.payload);
    gather(raw.data(), packed(pieces), call->encoded.data(), codec);
  }
  call->name = what + " #" + std::to_string(call->head.id) + " on rank " + std::to_string(s_.rank) + " to rank " +
               std::to_string(region.rank) + " (region " + std::to_string(region.id) + ")";
  call->req = std::make_shared<Request>();
  connect(region.rank);
  {
    // Under the lock that stopping takes: the thread's last take_inbox() sees every call queued before it.
    std::lock_guard lock(mu_);
    if (stop_) throw InvalidArgument("the communicator is closed");
    if (!aborted_.empty()) throw CommError(aborted_);
    new_calls_.push_back(call);
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wakefd_.get(), &one, sizeof one);
  return call->req;
}

Service::Directory* Service::directory(int peer) {
  std::lock_guard lock(directories_mu_);
  std::unique_ptr<Directory>& d = directories_[static_cast<size_t>(peer)];
  if (!d) {
    std::string text;
    try {
      text = store_->check(key(peer) + "/directory").value_or("");
    } catch (const CommError& e) {  // not remembered: a later call looks again
      SC_LOG(LogLevel::debug, s_.rank, "") << "one-sided: rank " << peer << "'s directory: " << e.what();
      return nullptr;
    }
    d = std::make_unique<Directory>();
    char* end = nullptr;
    const long fd = std::strtol(text.c_str(), &end, 10);
    const uint64_t secret = *end == ' ' ? std::strtoull(end + 1, &end, 10) : 0;
    if (*end == '\0' && fd >= 0 && secret) {  // else (none, or malformed): the server serves
      std::string why;
      d->mem = cma::SharedMemory::open(s_.pids[static_cast<size_t>(peer)], static_cast<int>(fd),
                                       directory_bytes(s_.size), "rank " + std::to_string(peer) + "'s one-sided directory",
                                       why);
      d->secret = secret;
      const DirectoryHeader* h = d->mem.mapped() ? d->header() : nullptr;
      if (h && (h->magic != kDirectoryMagic || h->secret != secret || h->ranks != static_cast<uint64_t>(s_.size))) {
        why = "rank " + std::to_string(peer) + "'s descriptor " + std::to_string(fd) +
              " is not its one-sided directory (closed and reused?)";
        d->mem = {};
      }
      if (!d->mem.mapped()) SC_LOG(LogLevel::debug, s_.rank, "") << "one-sided: " << why << "; the server serves";
    }
  }
  return d->mem.mapped() ? d.get() : nullptr;
}

void Service::drop_stale(Directory& d) {
  for (auto it = d.maps.begin(); it != d.maps.end();)
    it = d.slots()[it->first % kSlots].tag.load() == (d.secret ^ it->first) ? std::next(it) : d.maps.erase(it);
}

void Service::drop_stale_mappings() {
  // Never waits: directory() holds the lock across a store lookup, and this thread serves every peer.
  std::unique_lock lock(directories_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;
  for (const auto& d : directories_) {
    if (!d || !d->mem.mapped()) continue;
    std::lock_guard maps(d->maps_mu);
    drop_stale(*d);
  }
}

std::shared_ptr<cma::SharedMemory> Service::mapping(Directory& d, int peer, uint64_t id, int fd, uint64_t bytes) {
  std::lock_guard lock(d.maps_mu);
  drop_stale(d);
  if (const auto it = d.maps.find(id); it != d.maps.end()) return it->second;
  std::string why;
  const std::string what = "rank " + std::to_string(peer) + "'s region " + std::to_string(id);
  auto m = std::make_shared<cma::SharedMemory>(
      cma::SharedMemory::open(s_.pids[static_cast<size_t>(peer)], fd, bytes, what, why));
  // Registered after the descriptor was opened: it was the region's (closed only once the tag is cleared).
  if (m->mapped() && d.slots()[id % kSlots].tag.load() != (d.secret ^ id)) {
    why = what + " was deregistered while it was being mapped";
    m = nullptr;
  }
  if (!m || !m->mapped()) {
    SC_LOG(LogLevel::debug, s_.rank, "") << "one-sided: " << why << "; copied by other means";
    m = nullptr;
  }
  d.maps[id] = m;
  return m;
}

std::shared_ptr<Request> Service::copy_directly(Kind kind, const RemoteRegion& region,
                                                std::span<const RemotePiece> pieces, std::span<const LocalPiece> local,
                                                uint64_t local_bytes, ReduceOp op) {
  Directory* d = directory(region.rank);
  if (!d) return nullptr;
  const bool put = kind != Kind::get;  // writes: a put or an accumulate
  std::unique_lock<std::mutex> writing(d->writing, std::defer_lock);
  std::atomic<uint64_t>& word = d->writers()[s_.rank];
  if (put) {
    writing.lock();
    word.store(region.id);  // before the tag is read: the target's deregistration then waits for this write
  }
  const struct Clear {
    std::atomic<uint64_t>* word;
    ~Clear() {
      if (word) word->store(0);
    }
  } clear{put ? &word : nullptr};
  Slot& slot = d->slots()[region.id % kSlots];
  const uint64_t want = d->secret ^ region.id;
  if (slot.tag.load() != want) return nullptr;
  const uint64_t base = slot.base.load(), bytes = slot.bytes.load(), shared = slot.shared.load(),
                 dtype = slot.dtype.load();
  if (slot.tag.load() != want) return nullptr;  // base, bytes, shared and dtype were this region's
  // An accumulate of another dtype than the region's: the server refuses it, naming both.
  if (kind == Kind::accumulate && dtype != static_cast<uint64_t>(region.dtype) + 1) return nullptr;
  for (const RemotePiece& p : pieces)
    if (p.offset > bytes || p.bytes > bytes - p.offset) return nullptr;  // the server says what is wrong
  const std::shared_ptr<cma::SharedMemory> mapped =
      shared ? mapping(*d, region.rank, region.id, static_cast<int>(shared - 1), bytes) : nullptr;
  // Local buffers that are the region's own memory (the target in this process, or this mapping of it): the
  // server copies such a call in two steps through its staging, so that every byte is read before any is written.
  const bool aliased =
      (mapped && overlaps(local, reinterpret_cast<uintptr_t>(mapped->base()), bytes)) ||
      (s_.pids[static_cast<size_t>(region.rank)] == ::getpid() && overlaps(local, base, bytes));
  if (aliased && kind != Kind::accumulate) return nullptr;
  if (kind == Kind::accumulate) {
    // Read, reduced and written back through process_vm_readv/writev, an accumulate would cost the server's
    // copies again: only a mapped region is reduced into directly, in place. Aliased values are copied first.
    if (!mapped) return nullptr;
    std::vector<char> joined;
    const char* in = local.size() == 1 && !aliased ? static_cast<const char*>(local[0].data) : nullptr;
    if (!in && local_bytes) {
      joined.resize(local_bytes);
      from_local(local, joined.data());
      in = joined.data();
    }
    Header h;
    h.kind = static_cast<uint8_t>(Kind::accumulate);
    h.dtype = static_cast<uint8_t>(region.dtype);
    h.op = static_cast<uint8_t>(op);
    const AccumulateLock lock(slot, s_.rank, s_.pids, s_.timeout,
                              "accumulatev on rank " + std::to_string(s_.rank) + " into region " +
                                  std::to_string(region.id) + " of rank " + std::to_string(region.rank));
    scatter(static_cast<char*>(mapped->base()), pieces, in, h, std::nullopt);
  } else if (mapped) {
    copy_mapped(static_cast<char*>(mapped->base()), pieces, local, local_bytes, put);
  } else {
    // process_vm_readv pins each remote piece's pages, about 1 us a piece here: measured on loopback (16 MiB in
    // pieces), reading directly was 4-6x faster than the server for one piece or 64 KiB pieces, 1.8-2x for 4 KiB
    // pieces, and from 1.2x faster to 1.7x slower for 1 KiB ones, run to run (BENCHMARKS.md, "One-sided getv on
    // one host: reading the target directly").
    constexpr uint64_t kDirectMinPiece = 4096;  // mean bytes per piece
    if (local_bytes < kDirectMinPiece * pieces.size()) return nullptr;
    std::vector<iovec> remote, mine;
    for (const RemotePiece& p : pieces)
      if (p.bytes) remote.push_back({reinterpret_cast<void*>(base + p.offset), p.bytes});
    for (const LocalPiece& l : local)
      if (l.bytes) mine.push_back({l.data, l.bytes});
    const int pid = s_.pids[static_cast<size_t>(region.rank)];
    // A failed copy may have moved part of the bytes: the server's answer, or its put, moves them all again.
    if (!remote.empty() && (put ? cma::write_process(pid, mine, remote) : cma::read_process(pid, mine, remote)) != 0)
      return nullptr;
  }
  // The copy's loads (plain ones, from a mapping) complete before the tag is read again.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (!put && slot.tag.load() != want) return nullptr;  // the region stayed registered throughout the read
  (kind == Kind::get ? direct_gets_ : kind == Kind::put ? direct_puts_ : direct_accumulates_)
      .fetch_add(1, std::memory_order_relaxed);
  auto req = std::make_shared<Request>();
  req->finish("");
  return req;
}

void Service::connect(int peer) {
  auto connected = [&] {
    std::lock_guard lock(mu_);
    if (stop_) throw InvalidArgument("the communicator is closed");
    if (!aborted_.empty()) throw CommError(aborted_);
    if (connected_[static_cast<size_t>(peer)]) return true;
    // A channel closed because its peer left or sent garbage, or refused this rank: that peer is not tried again.
    if (gone_[static_cast<size_t>(peer)])
      throw CommError(last_close_[static_cast<size_t>(peer)] + "; one-sided calls to rank " + std::to_string(peer) +
                      " fail from now on");
    return false;
  };
  if (connected()) return;
  std::lock_guard cl(connecting_[static_cast<size_t>(peer)]);
  if (connected()) return;  // another caller connected meanwhile
  const auto limit = millis(s_.connect_timeout);
  std::string addr;
  try {
    addr = store_->get(key(peer), limit);
  } catch (const StoreTimeout&) {
    throw CommError("rank " + std::to_string(peer) + " serves no one-sided operations: it registered no region " +
                    "within " + std::to_string(limit.count() / 1000) + " s (a target registers its regions " +
                    "before peers call it; SMARTCOLL_CONNECT_TIMEOUT)");
  }
  // "host:port token" (32 hex digits)
  const auto space = addr.find(' ');
  const std::string where = addr.substr(0, space);  // never the token: error texts travel and get logged
  const auto colon = where.rfind(':');
  const long port = colon == std::string::npos ? 0 : std::strtol(where.c_str() + colon + 1, nullptr, 10);
  const std::string hex = space == std::string::npos ? "" : addr.substr(space + 1);
  if (port <= 0 || port > 65535 || hex.size() != 32 || hex.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw CommError("malformed one-sided address of rank " + std::to_string(peer) + " in the store ('" + where +
                    "', then " + std::to_string(hex.size()) + " characters of token)");
  Hello h{kHelloMagic, static_cast<uint32_t>(s_.rank), static_cast<uint32_t>(s_.size), kVersion, s_.job, {}};
  for (size_t i = 0; i < sizeof h.token; ++i)
    h.token[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  const auto deadline = Clock::now() + limit;
  // A target in this network namespace (on this host) is reached over its Unix socket; elsewhere the name is
  // absent and TCP is used.
  net::Fd fd = s_.unix_sockets ? net::connect_abstract(local_name(peer, static_cast<int>(port)), deadline) : net::Fd();
  const bool local = static_cast<bool>(fd);
  if (!local) fd = net::connect_to({where.substr(0, colon), static_cast<uint16_t>(port)}, deadline);
  net::send_all(fd.get(), &h, sizeof h, deadline, "one-sided hello to rank " + std::to_string(peer));
  net::set_nonblocking(fd.get(), true);
  if (!local) net::set_nodelay(fd.get());
  net::set_buffer_sizes(fd.get(), s_.sockbuf);
  std::lock_guard lock(mu_);
  new_conns_.emplace_back(peer, std::move(fd));
  connected_[static_cast<size_t>(peer)] = true;
}

void Service::take_inbox() {
  std::vector<std::pair<int, net::Fd>> conns;
  std::vector<std::shared_ptr<Call>> calls;
  std::string aborted;
  {
    std::lock_guard lock(mu_);
    conns.swap(new_conns_);
    calls.swap(new_calls_);
    aborted = aborted_;
  }
  for (auto& [peer, fd] : conns) {
    auto c = std::make_unique<Conn>();
    c->fd = std::move(fd);
    c->peer = peer;
    c->outgoing = true;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    ev.data.fd = c->fd.get();
    epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, c->fd.get(), &ev);
    to_peer_[static_cast<size_t>(peer)] = c.get();
    conns_.push_back(std::move(c));
  }
  if (!aborted.empty())
    for (auto& c : conns_)
      if (c->outgoing) close(*c, aborted);
  for (auto& call : calls) {
    Conn* c = to_peer_[static_cast<size_t>(call->peer)];
    if (!c || stop_) {
      std::string why;
      {
        std::lock_guard lock(mu_);
        why = last_close_[static_cast<size_t>(call->peer)];
      }
      call->req->finish(call->name + ": " + (stop_ ? "the communicator was closed" : why));
      continue;
    }
    Out o;
    o.head = head_bytes(call->head, call->pieces);
    o.at.segs.push_back({o.head.data(), o.head.size()});
    if (!call->encoded.empty())
      o.at.segs.push_back({call->encoded.data(), call->encoded.size()});
    else if (static_cast<Kind>(call->head.kind) != Kind::get)
      for (const LocalPiece& p : call->local) o.at.segs.push_back({p.data, p.bytes});
    o.left = o.head.size() + call->head.payload;
    o.call = call;
    if (c->waiting.empty()) c->last = Clock::now();  // the answer's clock starts now, not at the last answer
    c->waiting[call->head.id] = call;
    c->queued += o.left;
    c->out.push_back(std::move(o));
  }
}

void Service::warn(const std::string& what) {
  const auto now = Clock::now();
  if (now - last_warn_ < kWarnPeriod) {
    ++unwarned_;
    return;
  }
  SC_LOG(LogLevel::warn, s_.rank, "") << "one-sided: " << what
                                      << (unwarned_ ? " (and " + std::to_string(unwarned_) + " more like it)" : "");
  last_warn_ = now;
  unwarned_ = 0;
}

// The listener is polled only while a connection can be taken: fewer than kMaxPendingHellos wait for their
// hello, and not within the pause after running out of descriptors (accept() would fail at once while the
// pending connection keeps the listener readable: polling it would spin).
void Service::update_listener(Clock::time_point now) {
  const bool want = accepting_.size() < kMaxPendingHellos && now >= accept_resume_;
  if (want == listening_) return;
  epoll_event ev{};
  ev.events = want ? static_cast<uint32_t>(EPOLLIN) : 0u;
  for (int fd : {listener_.get(), local_listener_.get()}) {
    if (fd < 0) continue;
    ev.data.fd = fd;
    epoll_ctl(epfd_.get(), EPOLL_CTL_MOD, fd, &ev);
  }
  listening_ = want;
}

void Service::accept_all(Clock::time_point now, bool connecting) {
  for (const net::Fd* l : {&listener_, &local_listener_}) {
    while (*l && connecting && listening_ && accepting_.size() < kMaxPendingHellos) {
      net::Fd s(::accept4(l->get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!s) {
        const int err = errno;
        if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
        if (err != EAGAIN && err != EWOULDBLOCK) {
          // EMFILE, ENFILE, ENOBUFS, ENOMEM: nothing to accept with until a descriptor or memory is freed.
          accept_resume_ = now + kAcceptBackoff;
          update_listener(now);  // both listeners pause: the other would fail the same way
          warn(std::string("accept failed (") + std::strerror(err) + "): pausing new channels for " +
               std::to_string(kAcceptBackoff.count()) + " ms at a time (raise the open files limit, ulimit -n)");
        }
        break;
      }
      if (l == &listener_) net::set_nodelay(s.get());
      net::set_buffer_sizes(s.get(), s_.sockbuf);
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
      ev.data.fd = s.get();
      epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, s.get(), &ev);
      accepting_.push_back(std::make_unique<Accepting>(Accepting{std::move(s), now}));
    }
  }
  if (!accepting_.empty()) take_hellos(now);
  update_listener(now);
}

void Service::take_hellos(Clock::time_point now) {
  std::erase_if(accepting_, [&](std::unique_ptr<Accepting>& ap) {
    Accepting& a = *ap;
    auto* h = reinterpret_cast<char*>(&a.hello);
    const ssize_t n = ::recv(a.fd.get(), h + a.got, sizeof(Hello) - a.got, MSG_DONTWAIT);
    if (n > 0) a.got += static_cast<size_t>(n);
    const bool broken = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    if (a.got < sizeof(Hello)) {
      if (!broken && now - a.since <= kHelloDeadline) return false;
      warn("dropped a connection that sent no hello within " + std::to_string(kHelloDeadline.count()) + " s");
      return true;
    }
    const std::string why = hello_refusal(a.hello, s_.size, s_.job, token_);
    if (!why.empty()) {
      warn("refused a connection: " + why);
      farewell(a.fd.get(), "rank " + std::to_string(s_.rank) + " refused the one-sided channel: " + why);
      return true;
    }
    const int peer = static_cast<int>(a.hello.rank);
    // One channel per initiator: a new hello from a rank replaces its old channel (it timed out and reconnects).
    for (auto& c : conns_)
      if (!c->outgoing && c->peer == peer) close(*c, "rank " + std::to_string(peer) + " opened a new channel");
    auto c = std::make_unique<Conn>();
    c->fd = std::move(a.fd);
    c->peer = peer;
    c->more = true;  // requests may have come with the hello
    conns_.push_back(std::move(c));
    return true;
  });
}

void Service::close(Conn& c, const std::string& why, bool retry) {
  if (c.closed) return;
  c.closed = true;
  if (!c.outgoing) {
    // A malformed request: say so to the initiator, unless an answer is half sent (the text would corrupt it).
    if (why.starts_with("malformed") && (c.out.empty() || !c.out.front().at.started()))
      farewell(c.fd.get(), "rank " + std::to_string(s_.rank) + " closed the one-sided channel: " + why);
  }
  c.fd.reset();  // leaves the epoll set with it
  c.out.clear();
  c.queued = 0;
  c.region.reset();
  c.staging = {};
  if (!c.outgoing) {
    // An initiator that leaves closes its channel: worth a warning only when what it sent was malformed.
    if (why.starts_with("malformed"))
      warn("closed the channel from rank " + std::to_string(c.peer) + ": " + why);
    else
      SC_LOG(LogLevel::debug, s_.rank, "") << "one-sided: closed the channel from rank " << c.peer << ": " << why;
    return;
  }
  to_peer_[static_cast<size_t>(c.peer)] = nullptr;
  {
    std::lock_guard lock(mu_);
    connected_[static_cast<size_t>(c.peer)] = false;
    last_close_[static_cast<size_t>(c.peer)] = why;
    gone_[static_cast<size_t>(c.peer)] = !retry;
  }
  const size_t n = c.waiting.size();
  for (auto& [id, call] : c.waiting)
    call->req->finish(call->name + ": " + why + " (" + std::to_string(n) + " call" + (n == 1 ? "" : "s") +
                      " outstanding)");
  c.waiting.clear();
}

void Service::progress(Conn& c) {
  send(c);  // first: a channel whose answers drained may be read again
  if (!c.closed) receive(c);
  if (!c.closed) send(c);
  if (c.closed) return;
  const auto idle = Clock::now() - c.last;
  const auto limit = std::chrono::duration<double>(s_.timeout);
  if (idle <= limit) return;
  if (c.outgoing && !c.waiting.empty())
    close(c, "no answer from rank " + std::to_string(c.peer) + " for " + log::seconds(s_.timeout) +
                 "; is it alive? (SMARTCOLL_TIMEOUT)", true);
  else if (!c.outgoing && (c.stage != 0 || c.got != 0 || c.queued != 0))
    close(c, "rank " + std::to_string(c.peer) + (c.queued ? " read no answer" : " sent no more of its request") +
                 " for " + log::seconds(s_.timeout) + " (SMARTCOLL_TIMEOUT)");
}

void Service::send(Conn& c) {
  while (!c.out.empty()) {
    Out& o = c.out.front();
    iovec iov[kMaxIov];
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(o.at.fill(iov));
    const ssize_t n = ::sendmsg(c.fd.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        const std::string error = std::strerror(errno), farewell = farewell_waiting(c.fd.get());
        close(c, !farewell.empty() ? farewell
                                   : "the one-sided channel to rank " + std::to_string(c.peer) +
                                         " broke while sending: " + error);
      }
      return;
    }
    c.last = Clock::now();
    o.at.advance(static_cast<size_t>(n));
    o.left -= static_cast<uint64_t>(n);
    c.queued -= static_cast<uint64_t>(n);
    if (o.at.done()) {
      if (o.call) o.call->sent = true;
      c.out.pop_front();
    }
  }
}

// The header in hand is whole: check it and set up the rest of the message. False: the channel closed.
bool Service::take_header(Conn& c) {
  const std::string from = "rank " + std::to_string(c.peer);
  if (std::string why = malformed(c.h, !c.outgoing); !why.empty())
    return close(c, "malformed one-sided message from " + from + ": " + why), false;
  c.got = 0;
  if (!c.outgoing) {
    c.pieces.resize(c.h.npieces);
    c.stage = 1;
    return true;
  }
  c.into = {};
  c.call = nullptr;
  const auto kind = static_cast<Kind>(c.h.kind);
  if (c.h.id != 0 || kind != Kind::error) {  // id 0: the target's farewell, for no call
    auto it = c.waiting.find(c.h.id);
    if (it == c.waiting.end())
      return close(c, "malformed one-sided message from " + from + ": an answer to no outstanding call (id " +
                          std::to_string(c.h.id) + ")"), false;
    c.call = it->second;
    // Sending a put reads the caller's buffers: an answer before that ends would complete the call while they
    // are still read. A target answers only whole requests, so this one is broken.
    if (!c.call->sent)
      return close(c, "malformed one-sided message from " + from + ": an answer to " + c.call->name +
                          " before its request was sent whole"), false;
    const auto asked = static_cast<Kind>(c.call->head.kind);
    if (kind == Kind::data && (asked != Kind::get || c.h.payload != wire_bytes(c.call->pieces, c.call->codec)))
      return close(c, "malformed one-sided message from " + from + ": data of " + std::to_string(c.h.payload) +
                          " bytes for " + c.call->name), false;
    if (kind == Kind::done && asked == Kind::get)
      return close(c, "malformed one-sided message from " + from + ": 'done' for " + c.call->name), false;
  }
  if (kind == Kind::data && !c.call->codec) {
    for (const LocalPiece& p : c.call->local) c.into.segs.push_back({p.data, p.bytes});
  } else if (kind != Kind::done) {  // an error's text, or encoded pieces to decode
    c.staging = make_block(c.h.payload);
    c.into.segs.push_back({c.staging.data(), c.staging.size});
  }
  c.into.settle();
  c.stage = 3;
  return true;
}

// The target's pieces table is whole: check it against the region, and take the request's staging if the
// target's memory allows (stage 2). False: wait (staging not granted) or the channel closed.
bool Service::take_pieces(Conn& c) {
  if (c.stage == 1) {
    if (std::string why = malformed_pieces(c.h, c.pieces); !why.empty())
      return close(c, "malformed one-sided message from rank " + std::to_string(c.peer) + ": " + why), false;
    c.refused.clear();
    c.codec = codec_of(c.h);
    c.region = find(c.h.region, c.refused);
    if (c.region) c.refused = refusal(c.h, c.pieces, {c.region->id, c.region->bytes, c.region->dtype});
    c.stage = 2;
  }
  c.into = {};
  c.discard = 0;
  const bool get = static_cast<Kind>(c.h.kind) == Kind::get;
  const uint64_t need = !c.refused.empty() ? 0 : get ? wire_bytes(c.pieces, c.codec) : c.h.payload;
  const uint64_t held = held_;
  if (need && held != 0 && need > kMaxHeld - std::min(held, kMaxHeld)) {
    c.last = Clock::now();  // this wait is the target's, not the initiator's
    return false;
  }
  if (!c.refused.empty()) {
    c.discard = c.h.payload;
  } else if (need) {
    c.staging = make_block(need, Hold(held_, need));
    if (!get) c.into.segs.push_back({c.staging.data(), c.staging.size});
  }
  c.stage = 3;
  return true;
}

// A target reads no new request from a channel while its answers queue up (kMaxQueued).
bool Service::paused(const Conn& c) { return !c.outgoing && c.stage == 0 && c.got == 0 && c.queued > kMaxQueued; }

void Service::receive(Conn& c) {
  static thread_local char drop[kDiscard];
  c.more = false;
  for (;;) {
    // Take each finished part of the message first: the next one may need no bytes at all.
    if (paused(c)) return;  // read on once the answers drain
    if (c.stage == 0 && c.got == sizeof(Header) && !take_header(c)) return;
    if ((c.stage == 1 && c.got == c.pieces.size() * sizeof(RemotePiece)) || c.stage == 2) {
      if (!take_pieces(c)) return;
    }
    if (c.stage == 3 && c.into.done() && c.discard == 0) {
      if (c.outgoing)
        answer(c);
      else if (!serve(c))
        return;  // waits for its region's accumulate lock (Conn::lock_wait)
      c.stage = 0;
      c.got = 0;
      c.more = !c.closed;  // one message a pass: the other channels' turn
      return;
    }
    iovec iov[kMaxIov];
    int n_iov = 1;
    if (c.stage == 0)
      iov[0] = {reinterpret_cast<char*>(&c.h) + c.got, sizeof(Header) - c.got};
    else if (c.stage == 1)
      iov[0] = {reinterpret_cast<char*>(c.pieces.data()) + c.got, c.pieces.size() * sizeof(RemotePiece) - c.got};
    else if (c.discard)
      iov[0] = {drop, static_cast<size_t>(std::min<uint64_t>(c.discard, kDiscard))};
    else
      n_iov = c.into.fill(iov);
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(n_iov);
    const ssize_t n = ::recvmsg(c.fd.get(), &m, MSG_DONTWAIT);
    const std::string from = "rank " + std::to_string(c.peer);
    if (n == 0)
      return close(c, "the one-sided channel to " + from + " was closed by that rank (it exited, crashed or " +
                          "closed its communicator)");
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        close(c, "the one-sided channel to " + from + " broke while receiving: " + std::strerror(errno));
      return;
    }
    c.last = Clock::now();
    if (c.stage < 2)
      c.got += static_cast<size_t>(n);
    else if (c.discard)
      c.discard -= static_cast<uint64_t>(n);
    else
      c.into.advance(static_cast<size_t>(n));
  }
}

bool Service::serve(Conn& c) {
  Header a;
  a.id = c.h.id;
  Out o;
  std::string why = c.refused;
  if (why.empty() && static_cast<Kind>(c.h.kind) != Kind::get && net::closed_by_peer(c.fd.get())) {
    // The initiator closed the channel after sending this: it failed the call (its timeout, while this process
    // was stopped or busy) or exited. Applied now, the call could overwrite a later one that succeeded (a put
    // copied directly) or be applied twice by an initiator that tries again.
    close(c, "rank " + std::to_string(c.peer) + " closed the channel before its " + kind_name(c.h.kind) +
                 " was applied: not applied");
    return true;
  }
  if (why.empty()) {
    std::lock_guard lock(c.region->mu);
    if (!c.region->alive) {
      why = "region " + std::to_string(c.region->id) + " was deregistered";
    } else if (static_cast<Kind>(c.h.kind) == Kind::get) {
      gather(c.region->base, c.pieces, c.staging.data(), c.codec);
      o.body = std::move(c.staging);
    } else if (static_cast<Kind>(c.h.kind) == Kind::accumulate && own_ && c.region->memory) {
      // Peers on this host may be accumulating into this allocated region directly: one at a time with them. A
      // few quick tries first (a holder's accumulate of a few pieces ends within microseconds); then a holder
      // keeps this request waiting, not the thread (which serves every channel), and it is tried again on the
      // next passes, for at most half the timeout knob, so that its refusal reaches the initiator before the
      // initiator's own timeout, after which nothing may apply it any more.
      Slot& slot = own_->slots()[c.region->id % kSlots];
      const auto me = AccumulateLock::taker(s_.rank, true);
      uint64_t holder = AccumulateLock::take(slot, me, s_.pids);
      for (int tries = 0; holder != 0 && tries < 20; ++tries) {
        std::this_thread::yield();
        holder = AccumulateLock::take(slot, me, s_.pids);
      }
      const auto now = Clock::now();
      if (holder != 0) {
        if (!c.lock_wait) c.lock_wait = now;
        if (now - *c.lock_wait <= millis(s_.timeout / 2)) {
          AccumulateLock::claim(slot, me, s_.pids);  // the next turn is this request's
          c.last = now;  // the channel is not idle: its request waits
          return false;
        }
        AccumulateLock::withdraw(slot, me);
        why = "accumulatev: " + AccumulateLock::waited(holder, s_.timeout / 2);
      } else {
        const struct Release {
          std::atomic<uint64_t>& word;
          ~Release() { word.store(0); }
        } release{slot.accumulating};
        scatter(c.region->base, c.pieces, c.staging.data(), c.h, c.codec);
      }
    } else {
      scatter(c.region->base, c.pieces, c.staging.data(), c.h, c.codec);
    }
  }
  c.lock_wait.reset();
  c.staging = {};
  c.region.reset();
  if (!why.empty()) {
    o.body = {};
    o.text.assign(why.begin(), why.begin() + static_cast<ptrdiff_t>(std::min<size_t>(why.size(), kMaxErrorText)));
    a.kind = static_cast<uint8_t>(Kind::error);
  } else {
    a.kind = static_cast<uint8_t>(static_cast<Kind>(c.h.kind) == Kind::get ? Kind::data : Kind::done);
  }
  a.payload = o.text.size() + o.body.size;
  o.head = head_bytes(a);
  o.at.segs.push_back({o.head.data(), o.head.size()});
  if (!o.text.empty()) o.at.segs.push_back({o.text.data(), o.text.size()});
  if (o.body.size) o.at.segs.push_back({o.body.data(), o.body.size});
  o.left = o.head.size() + a.payload;
  c.queued += o.left;
  c.out.push_back(std::move(o));
  return true;
}

void Service::answer(Conn& c) {
  const std::string text(c.staging.data(), c.staging.data() + c.staging.size);
  if (!c.call)  // the target's farewell: it closes the channel, and says why
    return close(c, text.empty() ? "rank " + std::to_string(c.peer) + " closed the one-sided channel" : text);
  std::shared_ptr<Call> call = std::move(c.call);
  c.waiting.erase(c.h.id);
  std::string error;
  if (static_cast<Kind>(c.h.kind) == Kind::error) {
    error = call->name + ": rank " + std::to_string(c.peer) + " refused it: " + text;
  } else {
    if (static_cast<Kind>(c.h.kind) == Kind::data && call->codec) {
      // Decode each piece into the concatenation of the local buffers (the scatter half of the codec's work).
      std::vector<char> raw(wire_bytes(call->pieces, std::nullopt));
      const Header put_like = [&] {
        Header h = call->head;
        h.kind = static_cast<uint8_t>(Kind::put);
        return h;
      }();
      scatter(raw.data(), packed(call->pieces), c.staging.data(), put_like, call->codec);
      to_local(raw.data(), call->local);
    }
  }
  // The call is dropped (no longer outstanding_) before its caller learns it is done: the caller's next call to
  // this peer may then be copied directly.
  const std::shared_ptr<Request> req = call->req;
  call.reset();
  req->finish(error);
  c.staging = {};
  if (c.waiting.empty()) c.last = Clock::now();
}

void Service::run() {
  while (!stop_) {
    // busy: a channel has bytes it may read now; waiting: a clock runs (an answer, a hello, a message half
    // read, answers unread, staging not granted, the listener's pause).
    bool busy = false, waiting = !accepting_.empty() || !listening_, locked_out = false;
    for (auto& c : conns_) {
      busy |= c->more && !paused(*c);
      waiting |= !c->waiting.empty() || c->stage != 0 || c->got != 0 || c->queued != 0;
      locked_out |= c->lock_wait.has_value();
    }
    epoll_event events[64];
    const int n = epoll_wait(epfd_.get(), events, 64, busy ? 0 : locked_out ? 1 : waiting ? 50 : 1000);
    // Only what woke: a pass per message when busy, so no system call that has nothing to do.
    bool woken = false, connecting = false;
    for (int i = 0; i < n; ++i) {
      woken |= events[i].data.fd == wakefd_.get();
      connecting |= events[i].data.fd == listener_.get() || events[i].data.fd == local_listener_.get();
    }
    if (woken) {
      uint64_t count;
      [[maybe_unused]] ssize_t r = ::read(wakefd_.get(), &count, sizeof count);
      take_inbox();
    }
    accept_all(Clock::now(), connecting);
    for (auto& c : conns_) {
      try {
        progress(*c);
      } catch (const std::exception& e) {  // a staging buffer the memory cannot hold: that channel goes, not the rank
        close(*c, std::string("the one-sided server dropped the channel: ") + e.what());
      }
    }
    std::erase_if(conns_, [](const std::unique_ptr<Conn>& c) { return c->closed; });
    if (const auto now = Clock::now(); now - swept_ >= std::chrono::seconds(1)) {
      drop_stale_mappings();
      swept_ = now;
    }
  }
  for (auto& c : conns_) close(*c, "the communicator was closed");
  take_inbox();  // calls posted meanwhile fail, naming the reason
  conns_.clear();
  accepting_.clear();
}

}  // namespace smartcoll::rma
