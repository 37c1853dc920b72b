// In-network aggregation: every rank sends its vector to the aggregation switches in chunks and receives the
// sums (switch/client.h). With a codec, float32 chunks travel encoded and the switch sums them in float32. It
// drives its own UDP protocol, so it runs alone (a task with `exclusive`). reduce_scatter and allgather go the
// same way with each chunk owned by one rank's block: the switch sends a block's sums to its owner alone, or
// forwards the owner's block to the others (sw::kScatter, sw::kGather).
//
// With switch_fallback=ring, a switch that stops answering does not fail the call: after its switch part, every
// rank tells every other (one byte over TCP) whether it finished. If one did not, the ranks share which chunks
// each one has; a chunk some ranks have goes from the lowest of them to the others, the chunks nobody has (every
// rank still holds its input there, in place or not) are reduced with a ring over TCP (reduce_scatter and
// allgather: the whole call again over TCP, from the inputs). Later calls run the ring's own pipelined schedule,
// built next to the switch part, until every rank probes the switches again, at a call number all agree on
// (switch_retry). A rank that loses its own path to a
// live switch says so in the store, so that the others stop waiting for it. With fail, the call fails naming
// the switch, or the rank that lost it.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <utility>

#include "coll/algorithms.h"
#include "core/log.h"
#include "smartcoll/reduce.h"
#include "store/cleanup.h"
#include "switch/client.h"
#include "transport/transport.h"

namespace smartcoll::coll {

namespace {


// The ranks a ring over the transport's stream 0 runs over (Group: empty members, the whole world), so that the
// same rings serve the world and the hierarchical allreduce's hosts and columns.
struct Ring {
  Transport& t;
  const Group& g;
  int size() const { return g.members.empty() ? t.size() : static_cast<int>(g.members.size()); }
  int pos() const { return g.members.empty() ? t.rank() : g.pos; }
  int peer(int p) const { return g.members.empty() ? mod(p, t.size()) : g.members[static_cast<size_t>(mod(p, size()))]; }
};
const Group kWorld;

// The allgather half of a ring: member r starts with part own(r) of x (m elements of esize bytes), where
// own(r + 1) = own(r) + 1; after n - 1 steps every member has every part.
void ring_pass(const Ring& ring, char* x, size_t m, size_t esize, int own) {
  const int n = ring.size(), r = ring.pos();
  auto at = [&](int p) { return x + part_begin(m, n, p) * esize; };
  auto bytes = [&](int p) { return (part_begin(m, n, p + 1) - part_begin(m, n, p)) * esize; };
  for (int k = 0; k < n - 1; ++k) {
    const int s = mod(own - k, n), g = mod(own - k - 1, n);
    Transport::Op ops[] = {{ring.peer(r + 1), true, at(s), bytes(s)}, {ring.peer(r - 1), false, at(g), bytes(g)}};
    ring.t.run(ops);
  }
}

// The reduce-scatter half of a ring, step by step, in place: afterwards member r holds part own(r) = r + shift + 1
// of x (m elements) reduced over every member (avg divided by `divisor`), in ring order. Returns own(r).
int ring_reduce(const Ring& ring, char* x, size_t m, DataType dt, ReduceOp op, int shift, int divisor) {
  const int n = ring.size(), r = ring.pos();
  const size_t esize = dtype_size(dt);
  auto begin = [&](int p) { return part_begin(m, n, p); };
  auto len = [&](int p) { return begin(p + 1) - begin(p); };
  std::vector<char> tmp(len(0) * esize);
  for (int k = 0; k < n - 1; ++k) {
    const int s = mod(r + shift - k, n), g = mod(r + shift - k - 1, n);
    Transport::Op ops[] = {{ring.peer(r + 1), true, x + begin(s) * esize, len(s) * esize},
                           {ring.peer(r - 1), false, tmp.data(), len(g) * esize}};
    ring.t.run(ops);
    char* part = x + begin(g) * esize;
    reduce(dt, op == ReduceOp::avg ? ReduceOp::sum : op, part, tmp.data(), part, len(g));
  }
  const int own = mod(r + shift + 1, n);
  if (op == ReduceOp::avg) scale_divide(dt, x + begin(own) * esize, len(own), divisor);
  return own;
}

// A ring allreduce of x (m elements, in place): reduce-scatter, then allgather. Each part is reduced by one member
// and copied by the others, so every member has the same bits.
void ring_in_place(const Ring& ring, char* x, size_t m, DataType dt, ReduceOp op) {
  ring_pass(ring, x, m, dtype_size(dt), ring_reduce(ring, x, m, dt, op, 0, ring.size()));
}

// The whole call over TCP, from the inputs (which the switch part never writes): allreduce; reduce_scatter as
// the ring's reduce-scatter half over a copy of every block, ending with each rank's own; allgather as the
// ring's passes of blocks (this rank's own block is already in place).
void ring_call(Transport& t, const sw::Call& c) {
  const size_t esize = dtype_size(c.dt), n = static_cast<size_t>(t.size()), block = c.count * esize;
  if (c.share == sw::kScatter) {
    std::vector<char> all(c.in, c.in + n * block);
    const int own = ring_reduce({t, kWorld}, all.data(), n * c.count, c.dt, c.op, -1, t.size());
    std::memcpy(c.out, all.data() + static_cast<size_t>(own) * block, block);
  } else if (c.share == sw::kGather) {
    ring_pass({t, kWorld}, c.out, n * c.count, esize, t.rank());
  } else {
    if (c.out != c.in) std::memcpy(c.out, c.in, block);
    ring_in_place({t, kWorld}, c.out, c.count, c.dt, c.op);
  }
}

// Finishes a call the switches did not: done[c] says which chunks this rank has.
void finish_with_ring(Transport& t, const sw::Client& client, const sw::Call& a, const std::vector<uint8_t>& done) {
  const int n = t.size(), r = t.rank();
  const DataType dt = a.dt;
  const size_t chunks = done.size(), per = client.chunk_elems(dt, a.codec), esize = dtype_size(dt);
  auto bytes_of = [&](size_t c) { return (std::min(per, a.count - c * per)) * esize; };
  std::vector<uint8_t> all(chunks * static_cast<size_t>(n));
  exchange(t, done.data(), all.data(), chunks);
  auto has = [&](int p, size_t c) { return all[static_cast<size_t>(p) * chunks + c] != 0; };

  // Chunks some ranks have: the lowest of them sends each to the others, one message per pair of ranks.
  std::vector<std::vector<char>> to(n), from(n);
  std::vector<size_t> orphans;  // chunks nobody has
  for (size_t c = 0; c < chunks; ++c) {
    int holder = -1;
    for (int p = 0; p < n && holder < 0; ++p)
      if (has(p, c)) holder = p;
    if (holder < 0) {
      orphans.push_back(c);
      continue;
    }
    for (int p = 0; p < n; ++p) {
      if (has(p, c)) continue;
      if (holder == r) to[p].insert(to[p].end(), a.out + c * per * esize, a.out + c * per * esize + bytes_of(c));
      if (p == r) from[holder].resize(from[holder].size() + bytes_of(c));
    }
  }
  std::vector<Transport::Op> ops;
  for (int p = 0; p < n; ++p) {
    if (!to[p].empty()) ops.push_back({p, true, to[p].data(), to[p].size()});
    if (!from[p].empty()) ops.push_back({p, false, from[p].data(), from[p].size()});
  }
  t.run(ops);
  std::vector<size_t> used(n, 0);
  for (size_t c = 0; c < chunks; ++c) {
    if (done[c]) continue;
    for (int p = 0; p < n; ++p) {
      if (!has(p, c)) continue;
      std::memcpy(a.out + c * per * esize, from[p].data() + used[p], bytes_of(c));
      used[p] += bytes_of(c);
      break;
    }
  }

  // The rest: every rank's input is intact there. Packed, reduced around the ring, unpacked.
  if (orphans.empty()) return;
  std::vector<char> packed;
  for (size_t c : orphans) packed.insert(packed.end(), a.in + c * per * esize, a.in + c * per * esize + bytes_of(c));
  ring_in_place({t, kWorld}, packed.data(), packed.size() / esize, dt, a.op);
  size_t off = 0;
  for (size_t c : orphans) {
    std::memcpy(a.out + c * per * esize, packed.data() + off, bytes_of(c));
    off += bytes_of(c);
  }
}

// Every rank joins a fresh job on the switches; they are used again only if every rank could join.
void probe(sw::Path& path, Transport& t, const char* what) {
  std::string why;
  std::unique_ptr<sw::Client> fresh;
  try {
    fresh = path.make_client(++path.epoch);
    fresh->join();
  } catch (const CommError& e) {
    why = e.what();
  }
  const uint8_t mine = why.empty() ? 1 : 0;
  std::vector<uint8_t> joined(static_cast<size_t>(t.size()));
  exchange(t, &mine, joined.data(), 1);
  // Every rank is past every call of the job this rank said it lost: nobody reads that word any more.
  if (!path.lost_key.empty()) forget(*path.store, std::exchange(path.lost_key, ""));
  if (std::all_of(joined.begin(), joined.end(), [](uint8_t j) { return j == 1; })) {
    path.client = std::move(fresh);  // the old client leaves the old job
    path.column.reset();               // the next hierarchical call joins its column afresh
    path.gone = false;
    SC_LOG(LogLevel::warn, t.rank(), what) << "every rank reached the switch again (probe at call " << path.calls
                                           << "): calls with algo=switch use it again";
    return;
  }
  path.schedule_probe();
  SC_LOG(LogLevel::info, t.rank(), what) << "probe at call " << path.calls << ": the switch is still unusable"
                                         << (why.empty() ? "" : " here (" + why + ")") << "; next probe at call "
                                         << path.next_probe;
}

// What became of a call through the switches: why this rank could not finish it (empty: it did), and which
// ranks did not (empty: every rank finished, or switch_fallback=fail, where a failure throws instead).
struct Outcome {
  std::string failure, who;
};

// Runs `a` through `client` (the job's, or this rank's column's): returns why this rank could not finish it
// (empty: it did). With switch_fallback=fail that throws instead.
std::string run_through(sw::Path& path, sw::Client& client, Transport& t, const sw::Call& a,
                        std::vector<uint8_t>& done) {
  const uint64_t call = path.calls;  // counted when the call started (through_switch)
  std::string failure;
  // A rank that loses its own path to a live switch says so in the store: the others, whom the switch keeps
  // answering while it waits for that rank, stop waiting and fall back (or fail) with it. The key names the job
  // (fresh per communicator and per probe) and holds the call it was lost in: a rank that already finished
  // that call (the lost rank's contributions were in) sees it in its next one. A rank whose communicator failed
  // stops too.
  char job[17];
  std::snprintf(job, sizeof job, "%016llx", static_cast<unsigned long long>(path.client->job()));
  const std::string lost = std::string("switch/lost/") + job;
  auto peers_lost = [&]() -> std::string {
    if (t.aborted()) return "this rank's communicator failed while it waited for the switch";
    std::string said;
    try {
      said = path.store->check(lost).value_or("");
    } catch (const CommError&) {  // the store is gone (its rank failed): the switch's silence tells
      return "";
    }
    const size_t space = said.find(' ');
    return space != std::string::npos && std::strtoull(said.c_str(), nullptr, 10) <= call ? said.substr(space + 1)
                                                                                             : "";
  };
  try {
    // An empty call (a column's chunk of a vector shorter than the ranks per host) sends nothing, alike on every
    // rank of the column, but still says it finished below.
    if (a.count > 0) client.run(a, done, path.store ? std::function<std::string()>(peers_lost) : nullptr);
  } catch (const sw::SwitchGone& e) {
    failure = e.what();
    if (path.store && !dynamic_cast<const sw::PeerLostSwitch*>(&e)) {
      try {  // best effort: a store that is gone (its rank failed first) must not hide this failure
        path.store->set(lost, std::to_string(call) + " rank " + std::to_string(t.rank()) + " lost the switch: " +
                                  failure);
        path.lost_key = lost;
      } catch (const CommError&) {
      }
    }
    if (!path.fallback_ring) throw CommError(failure + " (switch_fallback=fail)");
  }
  return failure;
}

// Every rank tells every other (one byte over TCP) whether it succeeded (`failure` empty); `who` lists those
// that did not.
Outcome tell_all(Transport& t, const std::string& failure) {
  const uint8_t mine = failure.empty() ? 1 : 0;
  std::vector<uint8_t> ok(static_cast<size_t>(t.size()));
  exchange(t, &mine, ok.data(), 1);
  Outcome o{failure, ""};
  for (int p = 0; p < t.size(); ++p)
    if (!ok[static_cast<size_t>(p)]) o.who += (o.who.empty() ? "" : ",") + std::to_string(p);
  return o;
}

// With switch_fallback=ring, whether every rank finished its part through the switches.
Outcome agree(sw::Path& path, Transport& t, const std::string& failure) {
  if (!path.fallback_ring) return {failure, ""};
  Outcome o = tell_all(t, failure);
  if (o.who.empty()) path.backoff = 0;  // a call through the switches: the next fallback waits `retry` calls again
  return o;
}

// Every rank agreed that a call did not finish through the switches: this call and the later ones go to TCP.
void fall_back(sw::Path& path, Transport& t, const Outcome& o, const char* what) {
  path.fall_back();
  SC_LOG(LogLevel::warn, t.rank(), what)
      << (o.failure.empty() ? "rank(s) " + o.who + " lost the switch" : o.failure)
      << "; every rank finishes this call, and makes the later ones, with the ring (switch_fallback=ring)"
      << (path.retry ? " until every rank probes the switch again at call " + std::to_string(path.next_probe) : "");
}

void run(sw::Path& path, Transport& t, const sw::Call& a, const char* what) {
  if (path.gone) probe(path, t, what);  // the ring's lanes ran instead until the probe's call
  if (path.gone) return ring_call(t, a);
  std::vector<uint8_t> done(path.client->chunks(a), 0);
  const Outcome o = agree(path, t, run_through(path, *path.client, t, a, done));
  if (o.who.empty()) return;
  fall_back(path, t, o, what);
  if (a.share) return ring_call(t, a);  // every rank still has its input: the switch wrote outputs alone
  finish_with_ring(t, *path.client, a, done);
}

// This rank's column client, joined at the first hierarchical call after start-up or a probe. Every rank says
// whether it could join; false (after falling back, or throwing with switch_fallback=fail) when one could not.
bool join_column(sw::Path& path, Transport& t, const HostGrid& grid, const char* what) {
  std::string why;
  try {
    path.column = path.make_column(path.epoch, grid.i, grid.at.cross.members, grid.h);
    path.column->join();
  } catch (const CommError& e) {
    why = e.what();
  }
  const Outcome o = tell_all(t, why);
  if (o.who.empty()) return true;
  if (!path.fallback_ring)
    throw CommError("rank(s) " + o.who + " could not join the switch for the hierarchical allreduce" +
                    (why.empty() ? "" : " (" + why + ")") + " (switch_fallback=fail)");
  fall_back(path, t, o, what);
  return false;
}

// The hierarchical allreduce through the switches. The vector is cut into pieces; in each, chunk i (of k) belongs
// to the host's i-th rank. A helper thread runs the host's phases over the transport's stream 0 while this one
// sends chunks through the switches, so that they overlap: a reduce-scatter ring on the host (piece p's chunk i
// summed over the host), then, once that piece's chunk is back from the switches (summed among the i-th ranks of
// every host, a job of H workers), an allgather ring on the host. Each does the same pieces in the same order on
// every rank, whatever the switches did, so the host's rings never mismatch; the transport is used by one thread
// at a time (the switch part does not touch it). If the switches fail anywhere (every rank learns it afterwards),
// each piece's chunk is summed again by a ring across hosts over TCP from the host sums (which nothing else
// writes) and gathered on the host again. avg: sums all the way, divided by n once, by the chunk's rank.
void run_hier(sw::Path& path, Transport& t, const HostGrid& grid, const sw::Call& a, const char* what) {
  if (path.gone) probe(path, t, what);
  bool through = !path.gone && (path.column || join_column(path, t, grid, what));
  const size_t esize = dtype_size(a.dt);
  const ReduceOp op = a.op == ReduceOp::avg ? ReduceOp::sum : a.op;
  const Ring local{t, grid.at.local}, cross{t, grid.at.cross};
  std::vector<char> host_sums(a.in, a.in + a.count * esize);
  // Pieces of at least 2 MiB, at most 8: enough to overlap the phases, few round trips through the switches.
  constexpr size_t kPieceBytes = size_t{2} << 20;
  const int pieces = static_cast<int>(std::clamp<size_t>(a.count * esize / kPieceBytes, 1, 8));
  struct Piece {
    size_t begin, len;  // the piece, in elements of the vector
    size_t first, mine;  // this rank's chunk of it: [first, first + mine)
  };
  std::vector<Piece> piece(static_cast<size_t>(pieces));
  for (int p = 0; p < pieces; ++p) {
    Piece& x = piece[static_cast<size_t>(p)];
    x.begin = part_begin(a.count, pieces, p);
    x.len = part_begin(a.count, pieces, p + 1) - x.begin;
    x.first = x.begin + part_begin(x.len, grid.k, grid.i);
    x.mine = x.begin + part_begin(x.len, grid.k, grid.i + 1) - x.first;
  }
  auto gather_on_host = [&](const Piece& x) { ring_pass(local, a.out + x.begin * esize, x.len, esize, grid.i); };
  auto sum_on_host = [&](const Piece& x) {
    const int own = ring_reduce(local, host_sums.data() + x.begin * esize, x.len, a.dt, op, -1, 1);
    if (own != grid.i) throw std::logic_error("the host's reduce-scatter ended on another chunk");
  };

  if (!through) {  // the switches are unusable: one piece after the other, every phase over TCP
    for (const Piece& x : piece) sum_on_host(x);
  } else {
    std::mutex mu;
    std::condition_variable cv;
    int summed = 0, returned = 0;  // pieces summed on the host (helper), back from the switches (this thread)
    std::exception_ptr helper_error;
    std::thread helper([&] {
      auto mark = [&](int& counter, int value) {
        std::lock_guard lock(mu);
        counter = value;
        cv.notify_all();
      };
      try {
        for (int p = 0; p <= pieces; ++p) {
          if (p < pieces) sum_on_host(piece[static_cast<size_t>(p)]);
          mark(summed, std::min(p + 1, pieces));
          if (p == 0) continue;
          std::unique_lock lock(mu);
          cv.wait(lock, [&] { return returned >= p; });
          lock.unlock();
          gather_on_host(piece[static_cast<size_t>(p - 1)]);  // garbage where the switches failed: redone below
        }
      } catch (...) {
        helper_error = std::current_exception();
        mark(summed, pieces);
      }
    });
    std::string failure;
    std::exception_ptr error;
    try {
      for (int p = 0; p < pieces; ++p) {
        {
          std::unique_lock lock(mu);
          cv.wait(lock, [&] { return summed > p; });
        }
        const Piece& x = piece[static_cast<size_t>(p)];
        if (failure.empty() && !helper_error) {
          const sw::Call column{host_sums.data() + x.first * esize, a.out + x.first * esize, x.mine, a.dt, op,
                                a.codec, 0};
          std::vector<uint8_t> done(path.column->chunks(column), 0);
          failure = run_through(path, *path.column, t, column, done);
          if (failure.empty() && a.op == ReduceOp::avg) scale_divide(a.dt, a.out + x.first * esize, x.mine, t.size());
        }
        std::lock_guard lock(mu);
        returned = p + 1;
        cv.notify_all();
      }
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard lock(mu);
      returned = pieces;
      cv.notify_all();
    }
    helper.join();
    if (helper_error) std::rethrow_exception(helper_error);
    if (error) std::rethrow_exception(error);
    const Outcome o = agree(path, t, failure);
    if (o.who.empty()) return;
    fall_back(path, t, o, what);
  }
  for (const Piece& x : piece) {
    char* mine = a.out + x.first * esize;
    std::memcpy(mine, host_sums.data() + x.first * esize, x.mine * esize);
    ring_in_place(cross, mine, x.mine, a.dt, op);
    if (a.op == ReduceOp::avg) scale_divide(a.dt, mine, x.mine, t.size());
    gather_on_host(x);
  }
}

// `lanes` (of algorithm `lanes_algo`): the schedule the call runs instead, pipelined, while the switches are
// unusable and no probe is due. Decided when the call starts, after every earlier call has finished (the switch
// part runs alone), so alike on every rank. `hier`: the allreduce goes hierarchical (run_hier).
void through_switch(Builder& b, const Args& a, uint8_t share, const char* what, void (*lanes)(Builder&, const Args&),
                    Algorithm lanes_algo = Algorithm::ring, bool hier = false) {
  sw::Path* path = b.cx.sw;
  lanes(b, a);
  auto lanes_instead = [path] { return ++path->calls, path->gone && path->calls < path->next_probe; };
  Transport* t = b.cx.transport;
  const DataType dt = b.spec.dtype;
  const ReduceOp op = share == sw::kGather ? ReduceOp::sum : b.spec.op;
  const Codec codec = b.spec.codec;  // identity: raw elements
  std::optional<HostGrid> grid;
  if (hier) grid = host_grid(*b.cx.hosts, b.cx.rank);
  b.exclusive([path, t, a, dt, op, codec, share, what, grid] {
    sw::Call c{a.in, a.out, a.count, dt, op, codec.kind() == CodecKind::identity ? nullptr : &codec, share};
    std::vector<char> input;
    const size_t block = a.count * dtype_size(dt), n = static_cast<size_t>(t->size());
    if (share == sw::kScatter && a.out + block > a.in && a.in + n * block > a.out) {
      // In place: results land where inputs may still have to be sent again (a lost datagram).
      input.assign(a.in, a.in + n * block);
      c.in = input.data();
    }
    if (share == sw::kGather) {
      // This rank's own block goes in place first (the switch or the ring brings the others), and is sent from
      // there: in place, `in` may be another rank's block of `out`, which that rank's results overwrite.
      char* mine = a.out + static_cast<size_t>(t->rank()) * block;
      if (mine != a.in) std::memmove(mine, a.in, block);
      c.in = mine;
    }
    if (grid) return run_hier(*path, *t, *grid, c, what);
    run(*path, *t, c, what);
  }, lanes_instead, lanes_algo);
}

}  // namespace

void allreduce_switch(Builder& b, const Args& a) { through_switch(b, a, 0, "allreduce (switch)", allreduce_ring); }
void reduce_scatter_switch(Builder& b, const Args& a) {
  through_switch(b, a, sw::kScatter, "reduce_scatter (switch)", reduce_scatter_ring);
}
void allgather_switch(Builder& b, const Args& a) {
  through_switch(b, a, sw::kGather, "allgather (switch)", allgather_ring);
}
void allreduce_switch_hier(Builder& b, const Args& a) {
  // Where the switches are unusable, hier's lanes; with a codec (which hier does not take), the ring's.
  if (b.spec.codec.kind() == CodecKind::identity)
    return through_switch(b, a, 0, "allreduce (switch_hier)", allreduce_hier, Algorithm::hier, true);
  through_switch(b, a, 0, "allreduce (switch_hier)", allreduce_ring, Algorithm::ring, true);
}

}  // namespace smartcoll::coll
