#include "switch/server.h"

#include <poll.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "transport/udp.h"

namespace smartcoll::sw {

namespace {

// A small fast generator for fault injection (xorshift64*): reproducible from the seed.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9e3779b97f4a7c15ULL + 1) {}
  double next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return static_cast<double>((s * 0x2545f4914f6cdd1dULL) >> 11) * 0x1.0p-53;
  }
};

// The thread's outgoing datagrams: results point into their slot (stable until the next flush); small replies
// are copied into the outbox. Sent faults apply here.
class BatchOutbox : public Outbox {
 public:
  BatchOutbox(int fd, const Faults& f, Rng& rng, bool offload)
      : fd_(fd), faults_(f), rng_(rng), batch_(kCapacity, offload), copies_(kCapacity) {}
  void send(const sockaddr_in& to, const uint8_t* data, size_t len, bool stable) override {
    if (faults_.drop > 0 && rng_.next() < faults_.drop) return;
    const int times = faults_.dup > 0 && rng_.next() < faults_.dup ? 2 : 1;
    for (int i = 0; i < times; ++i) {
      if (batch_.full()) flush();
      const uint8_t* p = data;
      if (!stable) {
        auto& copy = copies_[batch_.size()];
        copy.assign(data, data + len);
        p = copy.data();
      }
      batch_.add(to, p, len);
    }
  }
  void flush() { batch_.flush(fd_); }
  const udp::SendBatch::Counts& counts() const { return batch_.counts(); }

 private:
  // Room for a receive batch's results to several workers: with offload, those to one worker leave together.
  static constexpr size_t kCapacity = 256;
  int fd_;
  const Faults& faults_;
  Rng& rng_;
  udp::SendBatch batch_;
  std::vector<std::vector<uint8_t>> copies_;
};

}  // namespace

struct alignas(64) Switch::IoCounters {
  std::atomic<uint64_t> send_calls{0}, messages_out{0}, datagrams_out{0}, offload_refused{0}, joined_in{0};
};

namespace {
// Checked before anything is sized by them (each thread's aggregator holds buffers of its own).
const SwitchOptions& checked(const SwitchOptions& options) {
  if (options.threads < 1 || options.threads > 256)
    throw InvalidArgument("switch threads must be between 1 and 256, got " + std::to_string(options.threads));
  if (options.slots < 1) throw InvalidArgument("switch slots must be at least 1");
  return options;
}
}  // namespace

Switch::Switch(const SwitchOptions& options)
    : options_(checked(options)),
      io_(std::make_unique<IoCounters[]>(static_cast<size_t>(options.threads))),
      agg_(options.threads, options.slots, options.full_auth) {
  // Thread t serves port base + t: workers find a slot's port from the base and the thread count.
  for (int attempt = 0; sockets_.empty(); ++attempt) {
    try {
      net::Fd first = udp::open(options.host, options.port);
      sockaddr_in bound{};
      socklen_t len = sizeof bound;
      getsockname(first.get(), reinterpret_cast<sockaddr*>(&bound), &len);
      const uint16_t base = udp::port_of(bound);
      std::vector<net::Fd> socks;
      socks.push_back(std::move(first));
      for (int t = 1; t < options.threads; ++t) {
        if (base + t > 65535) throw CommError("no room for " + std::to_string(options.threads) + " ports above " +
                                              std::to_string(base));
        socks.push_back(udp::open(options.host, static_cast<uint16_t>(base + t)));
      }
      sockets_ = std::move(socks);
      port_ = base;
    } catch (const CommError& e) {
      // With port 0 another process may hold one of the ports above the free one: draw again.
      if (options.port != 0 || attempt >= 20) {
        const bool address = std::string_view(e.what()).find("Cannot assign requested address") != std::string::npos;
        throw CommError(std::string(e.what()) + (address ? " (" + options.host + " is not an address of this host; "
                                                           "choose one it has, or 0.0.0.0, for --listen)"
                                                         : " (the switch needs ports " + std::to_string(options.port) +
                                                               ".." + std::to_string(options.port + options.threads - 1) +
                                                               "; choose another --listen port)"));
      }
    }
  }
}

Switch::~Switch() { stop(); }

void Switch::start() {
  stop_ = false;
  for (int t = 0; t < options_.threads; ++t) threads_.emplace_back([this, t] { serve(t); });
}

void Switch::stop() {
  stop_ = true;
  for (auto& th : threads_) th.join();
  threads_.clear();
}

SwitchStats Switch::stats() const {
  SwitchStats s = agg_.stats(Clock::now());
  for (int t = 0; t < options_.threads; ++t) {
    const IoCounters& c = io_[static_cast<size_t>(t)];
    s.send_calls += c.send_calls.load(std::memory_order_relaxed);
    s.messages_out += c.messages_out.load(std::memory_order_relaxed);
    s.datagrams_out += c.datagrams_out.load(std::memory_order_relaxed);
    s.offload_refused += c.offload_refused.load(std::memory_order_relaxed);
    s.joined_in += c.joined_in.load(std::memory_order_relaxed);
  }
  return s;
}

std::vector<uint64_t> Switch::take_expired() {
  std::lock_guard lock(expired_mu_);
  return std::exchange(expired_, {});
}

void Switch::serve(int t) {
  const int fd = sockets_[static_cast<size_t>(t)].get();
  const Faults& f = options_.faults;
  Rng rng(f.seed + static_cast<uint64_t>(t));
  if (options_.offload) udp::enable_gro(fd);  // refused: datagrams simply come one by one
  udp::RecvBatch in(32, kMaxDatagram, options_.offload);
  BatchOutbox out(fd, f, rng, options_.offload);
  IoCounters& io = io_[static_cast<size_t>(t)];
  const auto idle = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.job_timeout));
  auto next_sweep = Clock::now();
  std::vector<uint8_t> held;  // a datagram held back for reordering
  sockaddr_in held_from{};
  while (!stop_.load(std::memory_order_relaxed)) {
    pollfd p{fd, POLLIN, 0};
    // Wake up at least every 100 ms: to stop, and for thread 0 to free silent jobs.
    if (::poll(&p, 1, 100) < 0 && errno != EINTR) break;
    auto now = Clock::now();
    // Drain what is waiting, a batch at a time, flushing each batch's answers before the next.
    for (int round = 0; round < 64; ++round) {
      const size_t n = in.receive(fd);
      now = Clock::now();
      for (size_t i = 0; i < n; ++i) {
        const uint8_t* data = in.data(i);
        const size_t len = in.len(i);
        if (f.drop > 0 && rng.next() < f.drop) continue;
        if (f.reorder > 0 && held.empty() && rng.next() < f.reorder) {
          held.assign(data, data + len);
          held_from = in.from(i);
          continue;
        }
        const int times = f.dup > 0 && rng.next() < f.dup ? 2 : 1;
        for (int k = 0; k < times; ++k) agg_.handle(t, data, len, in.from(i), out, now);
        if (!held.empty()) {  // the held datagram goes in after the one that overtook it
          agg_.handle(t, held.data(), held.size(), held_from, out, now);
          held.clear();
        }
      }
      if (n == 0 && !held.empty()) {  // nothing came to overtake it: let it in
        agg_.handle(t, held.data(), held.size(), held_from, out, now);
        held.clear();
      }
      out.flush();
      if (n == 0) break;
    }
    const udp::SendBatch::Counts& sent = out.counts();
    io.send_calls.store(sent.calls, std::memory_order_relaxed);
    io.messages_out.store(sent.messages, std::memory_order_relaxed);
    io.datagrams_out.store(sent.datagrams, std::memory_order_relaxed);
    io.offload_refused.store(sent.refused, std::memory_order_relaxed);
    io.joined_in.store(in.joined(), std::memory_order_relaxed);
    if (t == 0 && now >= next_sweep) {
      next_sweep = now + std::chrono::milliseconds(250);
      std::vector<uint64_t> gone = agg_.expire(now, idle);
      if (!gone.empty()) {
        std::lock_guard lock(expired_mu_);
        expired_.insert(expired_.end(), gone.begin(), gone.end());
      }
    }
  }
}

}  // namespace smartcoll::sw
