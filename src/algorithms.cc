#include "algorithms.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "smartcoll/codec.h"
#include "smartcoll/reduce.h"

namespace smartcoll::algo {

namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

// Engine-thread scratch buffers, kept between calls so steady-state collectives do not allocate.
char* scratch(int slot, size_t bytes) {
  thread_local std::vector<char> buffers[3];
  if (buffers[slot].size() < bytes) buffers[slot].resize(bytes);
  return buffers[slot].data();
}

struct ReduceSpec {
  DataType dtype;
  ReduceOp op;
  int divisor;           // for avg: the world size
  const Codec* codec;    // null: elements travel as they are
};

// What happens to a segment once all its wire bytes have arrived.
enum class Finish : uint8_t {
  none,                 // it landed where it belongs
  reduce,               // dst = local op received
  codec_reduce_encode,  // enc = encode(local + decode(received)): a partial sum forwarded to the next hop
  codec_reduce,         // dst = local + decode(received)
  codec_reduce_share,   // dst = decode(enc = encode(local + decode(received))): the final sum every rank gets
  codec_decode,         // dst = decode(received)
};

struct RecvSeg {
  char* land;  // where the wire bytes go; null: the stream's staging buffer
  size_t wire_len;
  Finish finish;
  bool divide;  // avg: divide by the world size after the last reduction of these elements
  char* dst;
  const char* local;
  uint8_t* enc;
  size_t elems;
};

// A segment to send from `src` once receive segment `dep` is complete (-1: ready at once).
struct SendSeg {
  const char* src;
  size_t len;
  ptrdiff_t dep;
};

void finish_segment(const ReduceSpec& spec, const RecvSeg& seg, const char* data) {
  const auto* wire = reinterpret_cast<const uint8_t*>(data);
  auto* dst = reinterpret_cast<float*>(seg.dst);
  auto* local = reinterpret_cast<const float*>(seg.local);
  switch (seg.finish) {
    case Finish::none: break;
    case Finish::reduce: reduce(spec.dtype, spec.op, seg.dst, seg.local, data, seg.elems); break;
    case Finish::codec_reduce_encode: spec.codec->decode_add_encode(wire, seg.elems, local, seg.enc, nullptr); break;
    case Finish::codec_reduce:
    case Finish::codec_reduce_share: spec.codec->decode_add(wire, seg.elems, local, dst); break;
    case Finish::codec_decode: spec.codec->decode(wire, seg.elems, dst); break;
  }
  if (seg.divide) scale_divide(spec.dtype, seg.dst, seg.elems, spec.divisor);
  if (seg.finish == Finish::codec_reduce_share) {
    spec.codec->encode(dst, seg.elems, seg.enc);
    spec.codec->decode(seg.enc, seg.elems, dst);
  }
}

// The pipeline behind every ring and chain algorithm: receive segments from `from` and send segments to `to`,
// all at once, where a send may wait for a receive (and its reduction) to finish. Segment i travels on stream
// i % streams on both ends, so the two sides agree without any header.
void pipeline(Transport& t, int from, const std::vector<RecvSeg>& recvs, int to, const std::vector<SendSeg>& sends,
              const ReduceSpec& spec) {
  const int streams = t.streams();
  size_t staging_bytes = 0;
  for (const RecvSeg& seg : recvs) staging_bytes = std::max(staging_bytes, seg.wire_len);
  char* staging = scratch(0, staging_bytes * static_cast<size_t>(streams));
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
        char* into = seg.land ? seg.land : staging + staging_bytes * s;
        size_t n = t.try_recv(from, s, into + rc[s].done, seg.wire_len - rc[s].done);
        rc[s].done += n;
        if (rc[s].done < seg.wire_len && n == 0) break;
        if (n) progress.made(), moved = true;
        if (rc[s].done < seg.wire_len) continue;
        finish_segment(spec, seg, into);
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
      if (sends_left && sendable)
        what += std::string(what.empty() ? "" : " and ") + "sending to rank " + std::to_string(to);
      return "while " + what;
    });
  }
}

// Element ranges [off, off + len) of consecutive pieces of at most `piece` elements.
template <class F>
void for_each_segment(size_t len, size_t piece, F&& f) {
  for (size_t off = 0; off < len; off += piece) f(off, std::min(piece, len - off));
}

// One chunk per rank, in elements, and where each chunk sits on the wire. With a codec every chunk is
// encoded on its own (a sequence of whole blocks, only its last one partial), so wire offsets add up
// encoded sizes; chunks of a vector are split at block boundaries so that only the vector's last block is
// partial.
struct Chunks {
  std::vector<size_t> off, len, wire_off, wire_len;
};

Chunks make_chunks(std::vector<size_t> lens, size_t esize, const Codec* codec) {
  Chunks c;
  size_t pos = 0, wire = 0;
  for (size_t len : lens) {
    size_t wlen = codec ? codec->encoded_size(len) : len * esize;
    c.off.push_back(pos);
    c.len.push_back(len);
    c.wire_off.push_back(wire);
    c.wire_len.push_back(wlen);
    pos += len;
    wire += wlen;
  }
  return c;
}

Chunks split_vector(size_t count, int n, size_t esize, const Codec* codec) {
  const size_t unit = codec ? codec->block_elems() : 1, units = (count + unit - 1) / unit;
  std::vector<size_t> lens;
  size_t pos = 0;
  for (int i = 0; i < n; ++i) {
    size_t elems = std::min(count - pos, (units / n + (static_cast<size_t>(i) < units % n ? 1 : 0)) * unit);
    lens.push_back(elems);
    pos += elems;
  }
  return make_chunks(std::move(lens), esize, codec);
}

Chunks equal_blocks(size_t per_rank, int n, size_t esize, const Codec* codec) {
  return make_chunks(std::vector<size_t>(static_cast<size_t>(n), per_rank), esize, codec);
}

size_t segment_elems(size_t segment_bytes, size_t esize, const Codec* codec) {
  const size_t unit = codec ? codec->block_elems() : 1;
  return std::max(unit, segment_bytes / esize / unit * unit);
}

enum class Step : uint8_t { reduce, last_reduce, gather };

// Buffers of a ring: `in` is this rank's input (the local operand of reductions), acc[c] where chunk c's
// reduced or gathered elements go, enc the encoded vector (codec only; chunk c at wire_off[c]).
struct RingBuffers {
  const char* in;
  std::vector<char*> acc;
  uint8_t* enc;
  bool share_final;  // the last reduction is encoded once and decoded by every rank (allreduce)
  bool pre_encoded;  // enc already holds the chunk sent first
};

// Ring schedule: at step k this rank sends chunk first-k to rank+1 and receives chunk first-k-1 from rank-1.
// What it receives at step k is what it sends at step k+1, so the whole schedule is one pipeline: a segment is
// forwarded as soon as it has arrived (and been reduced).
template <class KindOf>
void ring(Transport& t, int steps, int first, KindOf&& kind_of, const Chunks& ch, size_t seg_elems,
          const ReduceSpec& spec, const RingBuffers& b) {
  const int n = t.size(), r = t.rank();
  const size_t esize = dtype_size(spec.dtype);
  const Codec* codec = spec.codec;
  auto wire_of = [&](size_t elems) { return codec ? codec->encoded_size(elems) : elems * esize; };
  std::vector<RecvSeg> recvs;
  std::vector<SendSeg> sends;
  size_t prev_first_recv = 0;
  for (int k = 0; k < steps; ++k) {
    const int sc = mod(first - k, n), rc = mod(first - k - 1, n);
    const Step kind = kind_of(k);
    const char* src;
    if (codec) {
      src = reinterpret_cast<const char*>(b.enc) + ch.wire_off[sc];
      if (k == 0 && !b.pre_encoded) {
        const char* values = kind == Step::gather ? b.acc[sc] : b.in + ch.off[sc] * esize;
        codec->encode(reinterpret_cast<const float*>(values), ch.len[sc], b.enc + ch.wire_off[sc]);
      }
    } else {
      src = k == 0 && kind != Step::gather ? b.in + ch.off[sc] * esize : b.acc[sc];
    }
    size_t j = 0;
    for_each_segment(ch.len[sc], seg_elems, [&](size_t off, size_t len) {
      sends.push_back({src + wire_of(off), wire_of(len), k == 0 ? -1 : static_cast<ptrdiff_t>(prev_first_recv + j++)});
    });
    prev_first_recv = recvs.size();
    for_each_segment(ch.len[rc], seg_elems, [&](size_t off, size_t len) {
      const char* local = kind == Step::gather ? nullptr : b.in + (ch.off[rc] + off) * esize;
      RecvSeg seg{nullptr, wire_of(len), Finish::none, false, b.acc[rc] + off * esize, local,
                  codec ? b.enc + ch.wire_off[rc] + wire_of(off) : nullptr, len};
      if (kind == Step::gather) {
        seg.land = codec ? reinterpret_cast<char*>(seg.enc) : seg.dst;
        seg.finish = codec ? Finish::codec_decode : Finish::none;
      } else {
        seg.divide = kind == Step::last_reduce && spec.op == ReduceOp::avg;
        if (!codec)
          seg.finish = Finish::reduce;
        else if (kind == Step::reduce)
          seg.finish = Finish::codec_reduce_encode;
        else
          seg.finish = b.share_final ? Finish::codec_reduce_share : Finish::codec_reduce;
      }
      recvs.push_back(seg);
    });
  }
  pipeline(t, mod(r - 1, n), recvs, mod(r + 1, n), sends, spec);
}

std::vector<char*> chunk_pointers(char* base, const Chunks& ch, size_t esize) {
  std::vector<char*> p;
  for (size_t off : ch.off) p.push_back(base + off * esize);
  return p;
}

// The owner step of the codec modes where each contribution is encoded exactly once: every rank sends chunk c
// of its encoded vector (enc_in, laid out by ch) straight to rank c, all n-1 transfers at once; rank r decodes
// the n contributions of its chunk and sums them in rank order in float32 into `mine` (avg divides once).
void owner_reduce(Transport& t, const Chunks& ch, const uint8_t* enc_in, float* mine, const ReduceSpec& spec) {
  const int n = t.size(), r = t.rank();
  const Codec& codec = *spec.codec;
  const size_t wlen = ch.wire_len[r];
  auto* contributions = reinterpret_cast<uint8_t*>(scratch(2, wlen * n));  // one encoded copy per rank
  std::vector<Transport::Op> ops;
  for (int k = 1; k < n; ++k) {
    const int to = mod(r + k, n), from = mod(r - k, n);
    ops.push_back({to, true, const_cast<char*>(reinterpret_cast<const char*>(enc_in)) + ch.wire_off[to],
                   ch.wire_len[to]});
    ops.push_back({from, false, reinterpret_cast<char*>(contributions) + wlen * from, wlen});
  }
  std::memcpy(contributions + wlen * r, enc_in + ch.wire_off[r], wlen);
  t.run(ops);
  codec.decode(contributions, ch.len[r], mine);
  for (int i = 1; i < n; ++i) codec.decode_add(contributions + wlen * i, ch.len[r], mine, mine);
  if (spec.op == ReduceOp::avg) scale_divide(DataType::f32, mine, ch.len[r], n);
}

// Encodes every chunk of `in` on its own (chunk c at wire_off[c]) into a scratch buffer.
uint8_t* encode_chunks(const Codec& codec, const Chunks& ch, const char* in) {
  auto* enc = reinterpret_cast<uint8_t*>(scratch(1, ch.wire_off.back() + ch.wire_len.back()));
  for (size_t c = 0; c < ch.off.size(); ++c)
    codec.encode(reinterpret_cast<const float*>(in) + ch.off[c], ch.len[c], enc + ch.wire_off[c]);
  return enc;
}

// Allreduce with a codec where each contribution is encoded once (owner_reduce), then the owner encodes the sum
// once and the ring allgathers the encoded sums. Same bytes on the wire as the hop ring, but two quantizations
// per element whatever the world size, instead of one per hop.
void allreduce_codec_owner(Transport& t, const char* in, char* out, size_t count, const ReduceSpec& spec,
                           const Params& p) {
  const int n = t.size(), r = t.rank();
  const Codec& codec = *spec.codec;
  Chunks ch = split_vector(count, n, 4, &codec);
  uint8_t* enc = encode_chunks(codec, ch, in);
  auto* mine = reinterpret_cast<float*>(out) + ch.off[r];
  owner_reduce(t, ch, enc, mine, spec);
  // Every other rank's chunk in `enc` has been sent and is overwritten by the allgather; chunk r takes the sum.
  codec.encode(mine, ch.len[r], enc + ch.wire_off[r]);
  codec.decode(enc + ch.wire_off[r], ch.len[r], mine);
  ring(t, n - 1, r, [](int) { return Step::gather; }, ch, segment_elems(p.segment_bytes, 4, &codec), spec,
       {in, chunk_pointers(out, ch, 4), enc, false, true});
}

const Codec* wire_codec(const Params& p) { return p.codec && p.codec->kind() != CodecKind::identity ? p.codec : nullptr; }

}  // namespace

void allreduce_ring(Transport& t, const char* in, char* out, size_t count, DataType dt, ReduceOp op,
                    const Params& p) {
  const int n = t.size(), r = t.rank();
  const Codec* codec = wire_codec(p);
  const ReduceSpec spec{dt, op, n, codec};
  if (codec && p.codec_owner) return allreduce_codec_owner(t, in, out, count, spec, p);
  const size_t esize = dtype_size(dt);
  Chunks ch = split_vector(count, n, esize, codec);
  uint8_t* enc = codec ? reinterpret_cast<uint8_t*>(scratch(1, ch.wire_off.back() + ch.wire_len.back())) : nullptr;
  // Steps 0..n-2 reduce-scatter (this rank ends owning chunk r+1, fully reduced), steps n-1..2n-3 allgather.
  ring(t, 2 * n - 2, r,
       [n](int k) { return k < n - 2 ? Step::reduce : k == n - 2 ? Step::last_reduce : Step::gather; }, ch,
       segment_elems(p.segment_bytes, esize, codec), spec, {in, chunk_pointers(out, ch, esize), enc, true, false});
}

void reduce_scatter_ring(Transport& t, const char* in, char* out, size_t recvcount, DataType dt, ReduceOp op,
                         const Params& p) {
  const int n = t.size(), r = t.rank();
  const Codec* codec = wire_codec(p);
  const size_t esize = dtype_size(dt);
  Chunks ch = equal_blocks(recvcount, n, esize, codec);
  if (codec && p.codec_owner)
    return owner_reduce(t, ch, encode_chunks(*codec, ch, in), reinterpret_cast<float*>(out), {dt, op, n, codec});
  std::vector<char*> acc = chunk_pointers(scratch(2, recvcount * n * esize), ch, esize);
  acc[r] = out;
  uint8_t* enc = codec ? reinterpret_cast<uint8_t*>(scratch(1, ch.wire_off.back() + ch.wire_len.back())) : nullptr;
  // Starting one chunk further back than allreduce makes the last chunk received, fully reduced, chunk r.
  ring(t, n - 1, r - 1, [n](int k) { return k < n - 2 ? Step::reduce : Step::last_reduce; }, ch,
       segment_elems(p.segment_bytes, esize, codec), {dt, op, n, codec}, {in, acc, enc, false, false});
}

void allgather_ring(Transport& t, const char* in, char* out, size_t sendcount, DataType dt, const Params& p) {
  const int n = t.size(), r = t.rank();
  const Codec* codec = wire_codec(p);
  const size_t esize = dtype_size(dt);
  Chunks ch = equal_blocks(sendcount, n, esize, codec);
  std::vector<char*> acc = chunk_pointers(out, ch, esize);
  if (acc[r] != in) std::memcpy(acc[r], in, sendcount * esize);
  uint8_t* enc = nullptr;
  if (codec) {
    // This rank's block is encoded once and decoded back, so that it holds the same values as every other rank.
    enc = reinterpret_cast<uint8_t*>(scratch(1, ch.wire_off.back() + ch.wire_len.back()));
    codec->encode(reinterpret_cast<const float*>(acc[r]), sendcount, enc + ch.wire_off[r]);
    codec->decode(enc + ch.wire_off[r], sendcount, reinterpret_cast<float*>(acc[r]));
  }
  ring(t, n - 1, r, [](int) { return Step::gather; }, ch, segment_elems(p.segment_bytes, esize, codec),
       {dt, ReduceOp::sum, n, codec}, {in, acc, enc, false, true});
}

void broadcast_chain(Transport& t, char* buf, size_t count, DataType dt, int root, const Params& p) {
  const int n = t.size(), r = t.rank(), pos = mod(r - root, n);
  const size_t esize = dtype_size(dt);
  std::vector<RecvSeg> recvs;
  std::vector<SendSeg> sends;
  for_each_segment(count, segment_elems(p.segment_bytes, esize, nullptr), [&](size_t off, size_t len) {
    char* at = buf + off * esize;
    if (pos > 0) recvs.push_back({at, len * esize, Finish::none, false, at, nullptr, nullptr, len});
    if (pos < n - 1) sends.push_back({at, len * esize, pos > 0 ? static_cast<ptrdiff_t>(sends.size()) : -1});
  });
  pipeline(t, mod(r - 1, n), recvs, mod(r + 1, n), sends, {dt, ReduceOp::sum, n, nullptr});
}

void broadcast_tree(Transport& t, char* buf, size_t count, DataType dt, int root) {
  // Binomial tree over positions relative to the root: position v receives from v minus its lowest set bit,
  // then sends to v + 2^k for every 2^k below that bit (all children at once).
  const int n = t.size(), v = mod(t.rank() - root, n);
  const size_t bytes = count * dtype_size(dt);
  int mask = 1;
  while (mask < n && !(v & mask)) mask <<= 1;
  if (mask < n) {
    Transport::Op from_parent{mod(v - mask + root, n), false, buf, bytes};
    t.run({&from_parent, 1});
  }
  std::vector<Transport::Op> to_children;
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (v + mask < n) to_children.push_back({mod(v + mask + root, n), true, buf, bytes});
  t.run(to_children);
}

void reduce_chain(Transport& t, const char* in, char* out, size_t count, DataType dt, ReduceOp op, int root,
                  const Params& p) {
  // Partial sums flow from the rank farthest from the root (position n-1) down the chain to the root.
  const int n = t.size(), r = t.rank(), pos = mod(r - root, n);
  const size_t esize = dtype_size(dt);
  const bool receives = pos < n - 1, sends_on = pos > 0;
  char* acc = pos == 0 ? out : scratch(2, count * esize);
  std::vector<RecvSeg> recvs;
  std::vector<SendSeg> sends;
  for_each_segment(count, segment_elems(p.segment_bytes, esize, nullptr), [&](size_t off, size_t len) {
    const size_t at = off * esize;
    if (receives)
      recvs.push_back({nullptr, len * esize, Finish::reduce, op == ReduceOp::avg && pos == 0, acc + at, in + at,
                       nullptr, len});
    if (sends_on)
      sends.push_back({(receives ? acc : in) + at, len * esize, receives ? static_cast<ptrdiff_t>(sends.size()) : -1});
  });
  pipeline(t, mod(r + 1, n), recvs, mod(r - 1, n), sends, {dt, op, n, nullptr});
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
