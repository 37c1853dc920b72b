#include "algorithms.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "smartcoll/reduce.h"

namespace smartcoll::algo {

namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

// Engine-thread scratch buffers, kept between calls so steady-state collectives do not allocate.
char* scratch(int slot, size_t bytes) {
  thread_local std::vector<char> buffers[2];
  if (buffers[slot].size() < bytes) buffers[slot].resize(bytes);
  return buffers[slot].data();
}

struct ReduceSpec {
  DataType dtype;
  ReduceOp op;
  int divisor;  // for avg: the world size
};

// A segment to receive: into `dst` directly, or (reduce) into staging and then dst = local op staging.
struct RecvSeg {
  char* dst;
  const char* local;
  size_t len;
  bool reduce;
  bool divide;  // avg: divide by the world size after reducing (the last reduction of this element)
};

// A segment to send from `src` once receive segment `dep` is complete (-1: ready at once).
struct SendSeg {
  const char* src;
  size_t len;
  ptrdiff_t dep;
};

// The pipeline behind every ring and chain algorithm: receive segments from `from` and send segments to `to`,
// all at once, where a send may wait for a receive (and its reduction) to finish. Segment i travels on stream
// i % streams on both ends, so the two sides agree without any header.
void pipeline(Transport& t, int from, const std::vector<RecvSeg>& recvs, int to, const std::vector<SendSeg>& sends,
              const ReduceSpec& spec, size_t segment_bytes) {
  const int streams = t.streams();
  const size_t esize = dtype_size(spec.dtype);
  char* staging = scratch(0, segment_bytes * static_cast<size_t>(streams));
  std::vector<uint8_t> recv_done(recvs.size(), 0);
  struct Cursor {
    size_t next;  // index into the segment list
    size_t done;  // bytes of that segment moved
  };
  std::vector<Cursor> rc(streams), sc(streams);
  for (int s = 0; s < streams; ++s) rc[s] = sc[s] = {static_cast<size_t>(s), 0};
  size_t recvs_left = recvs.size(), sends_left = sends.size();
  Transport::Progress progress(t);

  while (recvs_left + sends_left > 0) {
    bool moved = false;
    for (int s = 0; s < streams; ++s) {
      while (rc[s].next < recvs.size()) {
        const RecvSeg& seg = recvs[rc[s].next];
        char* into = seg.reduce ? staging + segment_bytes * s : seg.dst;
        size_t n = t.try_recv(from, s, into + rc[s].done, seg.len - rc[s].done);
        rc[s].done += n;
        if (rc[s].done < seg.len && n == 0) break;
        if (n) progress.made(), moved = true;
        if (rc[s].done < seg.len) continue;
        if (seg.reduce) reduce(spec.dtype, spec.op, seg.dst, seg.local, into, seg.len / esize);
        if (seg.divide) scale_divide(spec.dtype, seg.dst, seg.len / esize, spec.divisor);
        recv_done[rc[s].next] = 1;
        --recvs_left;
        rc[s] = {rc[s].next + static_cast<size_t>(streams), 0};
      }
      while (sc[s].next < sends.size()) {
        const SendSeg& seg = sends[sc[s].next];
        if (seg.dep >= 0 && !recv_done[static_cast<size_t>(seg.dep)]) break;
        size_t n = t.try_send(to, s, seg.src + sc[s].done, seg.len - sc[s].done);
        sc[s].done += n;
        if (sc[s].done < seg.len && n == 0) break;
        if (n) progress.made(), moved = true;
        if (sc[s].done < seg.len) continue;
        --sends_left;
        sc[s] = {sc[s].next + static_cast<size_t>(streams), 0};
      }
    }
    // A segment finished on one stream may have unblocked a send on a stream already passed: go round again
    // before sleeping, since that send's socket may have no new edge to wake us.
    if (recvs_left + sends_left == 0 || moved) continue;
    bool sendable = false;
    for (int s = 0; s < streams; ++s) {
      if (sc[s].next >= sends.size()) continue;
      ptrdiff_t dep = sends[sc[s].next].dep;
      sendable |= dep < 0 || recv_done[static_cast<size_t>(dep)];
    }
    progress.block([&] {
      std::string what;
      if (recvs_left) what += "receiving from rank " + std::to_string(from);
      if (sends_left && sendable) what += std::string(what.empty() ? "" : " and ") + "sending to rank " + std::to_string(to);
      return "while " + what;
    });
  }
}

// Splits `len` bytes at `base` into segments of at most `segment` bytes (a multiple of the element size).
template <class F>
void for_each_segment(size_t len, size_t segment, F&& f) {
  for (size_t off = 0; off < len; off += segment) f(off, std::min(segment, len - off));
}

size_t aligned_segment(size_t segment_bytes, DataType dt) {
  size_t e = dtype_size(dt);
  return std::max(e, segment_bytes / e * e);
}

// Ring schedule over n chunks: at step k this rank sends chunk send_chunk(k) to rank+1 and receives
// chunk send_chunk(k) - 1 from rank-1. What it receives at step k is what it sends at step k+1, so the
// whole schedule is one pipeline: a segment is forwarded as soon as it has arrived (and been reduced).
struct RingChunks {
  std::vector<size_t> off, len;  // bytes
};

RingChunks split_chunks(size_t count, int n, size_t esize) {
  RingChunks c;
  size_t base = count / n, extra = count % n, pos = 0;
  for (int i = 0; i < n; ++i) {
    size_t elems = base + (static_cast<size_t>(i) < extra ? 1 : 0);
    c.off.push_back(pos * esize);
    c.len.push_back(elems * esize);
    pos += elems;
  }
  return c;
}

// src(k, chunk) gives the send base pointer of chunk data at step k; recv(k, chunk) fills a RecvSeg template
// (dst/local are chunk base pointers; len is set per segment).
template <class Src, class Recv>
void ring(Transport& t, int steps, int first_send_chunk, const RingChunks& chunks, size_t segment,
          const ReduceSpec& spec, Src&& src, Recv&& recv) {
  const int n = t.size(), r = t.rank();
  std::vector<RecvSeg> recvs;
  std::vector<SendSeg> sends;
  size_t prev_step_first_recv = 0;
  for (int k = 0; k < steps; ++k) {
    int sc = mod(first_send_chunk - k, n), rc = mod(first_send_chunk - k - 1, n);
    const char* s = src(k, sc);
    size_t j = 0;
    for_each_segment(chunks.len[sc], segment, [&](size_t off, size_t len) {
      sends.push_back({s + off, len, k == 0 ? -1 : static_cast<ptrdiff_t>(prev_step_first_recv + j++)});
    });
    prev_step_first_recv = recvs.size();
    RecvSeg base = recv(k, rc);
    for_each_segment(chunks.len[rc], segment, [&](size_t off, size_t len) {
      recvs.push_back({base.dst + off, base.local ? base.local + off : nullptr, len, base.reduce, base.divide});
    });
  }
  pipeline(t, mod(r - 1, n), recvs, mod(r + 1, n), sends, spec, segment);
}

}  // namespace

void allreduce_ring(Transport& t, const char* in, char* out, size_t count, DataType dt, ReduceOp op,
                    const Params& p) {
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(dt), segment = aligned_segment(p.segment_bytes, dt);
  RingChunks chunks = split_chunks(count, n, esize);
  // Steps 0..n-2 reduce-scatter (this rank ends owning chunk r+1, fully reduced), steps n-1..2n-3 allgather.
  ring(t, 2 * n - 2, r, chunks, segment, {dt, op, n},
       [&](int k, int c) { return (k == 0 ? in : out) + chunks.off[c]; },
       [&](int k, int c) {
         if (k < n - 1)
           return RecvSeg{out + chunks.off[c], in + chunks.off[c], 0, true, op == ReduceOp::avg && k == n - 2};
         return RecvSeg{out + chunks.off[c], nullptr, 0, false, false};
       });
}

void reduce_scatter_ring(Transport& t, const char* in, char* out, size_t recvcount, DataType dt, ReduceOp op,
                         const Params& p) {
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(dt), segment = aligned_segment(p.segment_bytes, dt);
  RingChunks chunks = split_chunks(recvcount * n, n, esize);
  char* partial = scratch(1, recvcount * n * esize);
  auto dst = [&](int c) { return c == r ? out : partial + chunks.off[c]; };
  // Starting one chunk further back than allreduce makes the last chunk received, fully reduced, chunk r.
  ring(t, n - 1, r - 1, chunks, segment, {dt, op, n},
       [&](int k, int c) { return k == 0 ? in + chunks.off[c] : dst(c); },
       [&](int k, int c) { return RecvSeg{dst(c), in + chunks.off[c], 0, true, op == ReduceOp::avg && k == n - 2}; });
}

void allgather_ring(Transport& t, const char* in, char* out, size_t sendcount, DataType dt, const Params& p) {
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(dt), segment = aligned_segment(p.segment_bytes, dt);
  RingChunks chunks = split_chunks(sendcount * n, n, esize);
  if (out + chunks.off[r] != in) std::memcpy(out + chunks.off[r], in, sendcount * esize);
  ring(t, n - 1, r, chunks, segment, {dt, ReduceOp::sum, n},
       [&](int, int c) { return static_cast<const char*>(out + chunks.off[c]); },
       [&](int, int c) { return RecvSeg{out + chunks.off[c], nullptr, 0, false, false}; });
}

void broadcast_chain(Transport& t, char* buf, size_t count, DataType dt, int root, const Params& p) {
  const int n = t.size(), r = t.rank(), pos = mod(r - root, n);
  const size_t segment = aligned_segment(p.segment_bytes, dt);
  std::vector<RecvSeg> recvs;
  std::vector<SendSeg> sends;
  for_each_segment(count * dtype_size(dt), segment, [&](size_t off, size_t len) {
    if (pos > 0) recvs.push_back({buf + off, nullptr, len, false, false});
    if (pos < n - 1) sends.push_back({buf + off, len, pos > 0 ? static_cast<ptrdiff_t>(sends.size()) : -1});
  });
  pipeline(t, mod(r - 1, n), recvs, mod(r + 1, n), sends, {dt, ReduceOp::sum, n}, segment);
}

void reduce_chain(Transport& t, const char* in, char* out, size_t count, DataType dt, ReduceOp op, int root,
                  const Params& p) {
  // Partial sums flow from the rank farthest from the root (position n-1) down the chain to the root.
  const int n = t.size(), r = t.rank(), pos = mod(r - root, n);
  const size_t bytes = count * dtype_size(dt), segment = aligned_segment(p.segment_bytes, dt);
  const bool receives = pos < n - 1, sends_on = pos > 0;
  char* acc = pos == 0 ? out : scratch(1, bytes);
  std::vector<RecvSeg> recvs;
  std::vector<SendSeg> sends;
  for_each_segment(bytes, segment, [&](size_t off, size_t len) {
    if (receives) recvs.push_back({acc + off, in + off, len, true, op == ReduceOp::avg && pos == 0});
    if (sends_on)
      sends.push_back({(receives ? acc : in) + off, len, receives ? static_cast<ptrdiff_t>(sends.size()) : -1});
  });
  pipeline(t, mod(r + 1, n), recvs, mod(r - 1, n), sends, {dt, op, n}, segment);
}

void allreduce_rhd(Transport& t, const char* in, char* out, size_t count, DataType dt, ReduceOp op) {
  // Recursive halving (reduce-scatter) then recursive doubling (allgather) among the largest power of two
  // p <= n ranks. The first 2*(n-p) ranks pair up first: each even one hands its vector to the odd one and
  // gets the result back at the end.
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(dt), bytes = count * esize;
  if (out != in) std::memcpy(out, in, bytes);
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int extra = n - p;
  char* tmp = scratch(1, bytes);
  auto send_recv = [&](int peer, char* send, size_t send_len, char* recv, size_t recv_len) {
    Transport::Op ops[2] = {{peer, true, send, send_len}, {peer, false, recv, recv_len}};
    t.run(ops);
  };
  const bool folded = r < 2 * extra;
  int vr = r - extra;  // rank among the p participants; -1 for a rank that sits out
  if (folded && r % 2 == 0) {
    send_recv(r + 1, out, bytes, nullptr, 0);
    vr = -1;
  } else if (folded) {
    send_recv(r - 1, nullptr, 0, tmp, bytes);
    reduce(dt, op, out, tmp, out, count);
    vr = r / 2;
  }
  auto real_rank = [&](int v) { return v < extra ? 2 * v + 1 : v + extra; };

  if (vr >= 0) {
    struct Step {
      size_t lo, mid, hi;
      bool lower;
    };
    std::vector<Step> steps;
    size_t lo = 0, hi = count;
    for (int d = p / 2; d >= 1; d /= 2) {
      Step s{lo, lo + (hi - lo) / 2, hi, (vr & d) == 0};
      steps.push_back(s);
      size_t keep_lo = s.lower ? s.lo : s.mid, keep_hi = s.lower ? s.mid : s.hi;
      size_t give_lo = s.lower ? s.mid : s.lo, give_hi = s.lower ? s.hi : s.mid;
      send_recv(real_rank(vr ^ d), out + give_lo * esize, (give_hi - give_lo) * esize, tmp,
                (keep_hi - keep_lo) * esize);
      // The lower partner's operand always goes on the left: a fixed order gives the same bits run to run.
      char* mine = out + keep_lo * esize;
      if (s.lower)
        reduce(dt, op, mine, mine, tmp, keep_hi - keep_lo);
      else
        reduce(dt, op, mine, tmp, mine, keep_hi - keep_lo);
      lo = keep_lo;
      hi = keep_hi;
    }
    if (op == ReduceOp::avg) scale_divide(dt, out + lo * esize, hi - lo, n);
    for (int d = 1; d < p; d *= 2) {
      const Step& s = steps.back();
      size_t other_lo = s.lower ? s.mid : s.lo, other_hi = s.lower ? s.hi : s.mid;
      send_recv(real_rank(vr ^ d), out + lo * esize, (hi - lo) * esize, out + other_lo * esize,
                (other_hi - other_lo) * esize);
      lo = s.lo;
      hi = s.hi;
      steps.pop_back();
    }
  }
  if (folded && r % 2 == 0)
    send_recv(r + 1, nullptr, 0, out, bytes);
  else if (folded)
    send_recv(r - 1, out, bytes, nullptr, 0);
}

void alltoall_direct(Transport& t, const char* in, char* out, size_t count_per_rank, DataType dt) {
  // Every pair exchanges its block at once; with one engine thread and non-blocking sockets this keeps all
  // links busy without the n-1 rounds of a pairwise schedule.
  const int n = t.size(), r = t.rank();
  const size_t blk = count_per_rank * dtype_size(dt);
  if (out != in) std::memcpy(out + r * blk, in + r * blk, blk);
  std::vector<Transport::Op> ops;
  for (int k = 1; k < n; ++k) {
    ops.push_back({mod(r + k, n), true, const_cast<char*>(in) + mod(r + k, n) * blk, blk});
    ops.push_back({mod(r - k, n), false, out + mod(r - k, n) * blk, blk});
  }
  t.run(ops);
}

}  // namespace smartcoll::algo
