// In-network aggregation: every rank sends its vector to the aggregation switches in chunks and receives the
// sums (switch/client.h). With a codec, float32 chunks travel encoded and the switch sums them in float32. It drives its own UDP protocol, so it runs alone (a task with `exclusive`).
//
// With switch_fallback=ring, a switch that stops answering does not fail the call: after its switch part, every
// rank tells every other (one byte over TCP) whether it finished. If one did not, the ranks share which chunks
// each one has; a chunk some ranks have goes from the lowest of them to the others, the chunks nobody has (every
// rank still holds its input there, in place or not) are reduced with a ring over TCP, and every later call uses
// the ring at once. With fail, the call fails naming the switch.
#include <cstring>

#include "coll/algorithms.h"
#include "core/log.h"
#include "smartcoll/reduce.h"
#include "switch/client.h"
#include "transport/transport.h"

namespace smartcoll::coll {

namespace {

// A ring allreduce of x (m elements, in place) over the transport's stream 0, step by step: reduce-scatter,
// then allgather. Each part is reduced by one rank and copied by the others, so every rank has the same bits.
void ring_in_place(Transport& t, char* x, size_t m, DataType dt, ReduceOp op) {
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(dt);
  auto begin = [&](int p) { return static_cast<size_t>(p) * (m / n) + std::min<size_t>(p, m % n); };
  auto len = [&](int p) { return begin(p + 1) - begin(p); };
  std::vector<char> tmp(len(0) * esize);
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  for (int k = 0; k < n - 1; ++k) {
    const int s = mod(r - k, n), g = mod(r - k - 1, n);
    Transport::Op ops[] = {{right, true, x + begin(s) * esize, len(s) * esize},
                           {left, false, tmp.data(), len(g) * esize}};
    t.run(ops);
    char* part = x + begin(g) * esize;
    reduce(dt, op == ReduceOp::avg ? ReduceOp::sum : op, part, tmp.data(), part, len(g));
  }
  const int own = mod(r + 1, n);
  if (op == ReduceOp::avg) scale_divide(dt, x + begin(own) * esize, len(own), n);
  for (int k = 0; k < n - 1; ++k) {
    const int s = mod(r + 1 - k, n), g = mod(r - k, n);
    Transport::Op ops[] = {{right, true, x + begin(s) * esize, len(s) * esize},
                           {left, false, x + begin(g) * esize, len(g) * esize}};
    t.run(ops);
  }
}

// Finishes a call the switches did not: done[c] says which chunks this rank has.
void finish_with_ring(Transport& t, const sw::Client& client, const Args& a, DataType dt, ReduceOp op,
                      const Codec* codec, const std::vector<uint8_t>& done) {
  const int n = t.size(), r = t.rank();
  const size_t chunks = done.size(), per = client.chunk_elems(dt, codec), esize = dtype_size(dt);
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
  ring_in_place(t, packed.data(), packed.size() / esize, dt, op);
  size_t off = 0;
  for (size_t c : orphans) {
    std::memcpy(a.out + c * per * esize, packed.data() + off, bytes_of(c));
    off += bytes_of(c);
  }
}

void run(sw::Path& path, Transport& t, const Args& a, DataType dt, ReduceOp op, const Codec* codec) {
  const size_t bytes = a.count * dtype_size(dt);
  if (path.gone) {
    if (a.out != a.in) std::memcpy(a.out, a.in, bytes);
    return ring_in_place(t, a.out, a.count, dt, op);
  }
  std::vector<uint8_t> done(path.client->chunks(a.count, dt, codec), 0);
  std::string failure;
  try {
    path.client->allreduce(a.in, a.out, a.count, dt, op, codec, done);
  } catch (const sw::SwitchGone& e) {
    if (!path.fallback_ring) throw CommError(std::string(e.what()) + " (switch_fallback=fail)");
    failure = e.what();
  }
  if (!path.fallback_ring) return;
  const uint8_t mine = failure.empty() ? 1 : 0;
  std::vector<uint8_t> finished(static_cast<size_t>(t.size()));
  exchange(t, &mine, finished.data(), 1);
  std::string who;
  for (int p = 0; p < t.size(); ++p)
    if (!finished[p]) who += (who.empty() ? "" : ",") + std::to_string(p);
  if (who.empty()) return;
  SC_LOG(LogLevel::warn, t.rank(), "allreduce (switch)")
      << (failure.empty() ? "rank(s) " + who + " lost the switch" : failure)
      << "; every rank finishes this call, and makes every later one, with the ring (switch_fallback=ring)";
  path.gone = true;
  finish_with_ring(t, *path.client, a, dt, op, codec, done);
}

}  // namespace

void allreduce_switch(Builder& b, const Args& a) {
  sw::Path* path = b.cx.sw;
  Transport* t = b.cx.transport;
  const DataType dt = b.spec.dtype;
  const ReduceOp op = b.spec.op;
  const Codec codec = b.spec.codec;  // identity: raw elements
  b.exclusive([path, t, a, dt, op, codec] {
    run(*path, *t, a, dt, op, codec.kind() == CodecKind::identity ? nullptr : &codec);
  });
}

}  // namespace smartcoll::coll
