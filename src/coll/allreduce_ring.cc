// Ring allreduce: a reduce-scatter ring and an allgather ring as one pipeline (2(n-1) steps, each rank sends
// 2(n-1)/n of the vector). With a codec, either every hop re-encodes its partial sum (hop mode), or every
// contribution is encoded once and summed in float32 by its chunk's owner (owner mode).
#include <cstring>

#include "coll/algorithms.h"
#include "smartcoll/reduce.h"

namespace smartcoll::coll {

OwnerSteps owner_reduce(Builder& b, const Chunks& ch, const char* in, uint8_t* enc, float* mine, bool share) {
  const int n = b.cx.size, r = b.cx.rank;
  const Codec& codec = b.spec.codec;
  const size_t wlen = ch.wire_len[static_cast<size_t>(r)], len = ch.len[static_cast<size_t>(r)];
  auto* contributions = reinterpret_cast<uint8_t*>(b.scratch(wlen * static_cast<size_t>(n)));
  uint8_t* own = enc + ch.wire_off[static_cast<size_t>(r)];
  const int32_t encoded = b.compute(0, [ch, &codec, enc, in, contributions, own, wlen, r] {
    for (size_t c = 0; c < ch.off.size(); ++c)
      codec.encode(reinterpret_cast<const float*>(in) + ch.off[c], ch.len[c], enc + ch.wire_off[c]);
    std::memcpy(contributions + wlen * static_cast<size_t>(r), own, wlen);
  });
  std::vector<int32_t> sends, recvs;
  for (int k = 1; k < n; ++k) {
    const int to = mod(r + k, n), from = mod(r - k, n);
    sends.push_back(b.send(0, to, reinterpret_cast<char*>(enc) + ch.wire_off[static_cast<size_t>(to)],
                           ch.wire_len[static_cast<size_t>(to)], {encoded}));
    recvs.push_back(b.recv(0, from, reinterpret_cast<char*>(contributions) + wlen * static_cast<size_t>(from), wlen));
  }
  const bool avg = b.spec.op == ReduceOp::avg;
  const int32_t summed = b.compute(0, [&codec, contributions, wlen, n, len, mine, avg, own, share] {
    codec.decode(contributions, len, mine);
    for (int i = 1; i < n; ++i) codec.decode_add(contributions + wlen * static_cast<size_t>(i), len, mine, mine);
    if (avg) scale_divide(DataType::f32, mine, len, n);
    if (!share) return;
    codec.encode(mine, len, own);  // the sum every rank gets: encoded once here, decoded everywhere
    codec.decode(own, len, mine);
  }, {b.join(0, recvs), encoded});
  return {summed, b.join(0, sends)};
}

void allreduce_ring(Builder& b, const Args& a) {
  const int n = b.cx.size, r = b.cx.rank;
  const Codec* codec = b.spec.wire();
  const size_t esize = dtype_size(b.spec.dtype);
  const Chunks ch = split_vector(a.count, n, esize, codec);
  auto* enc = codec ? reinterpret_cast<uint8_t*>(b.scratch(ch.wire_total())) : nullptr;
  if (codec && b.cx.codec_owner) {
    const OwnerSteps owner = owner_reduce(b, ch, a.in, enc, reinterpret_cast<float*>(a.out) + ch.off[r], true);
    // The allgather overwrites the other ranks' chunks of enc: only once they have been sent.
    ring(b, n - 1, r, [](int) { return Step::gather; }, ch, {a.in, chunk_pointers(a.out, ch, 4), enc, false, true},
         1, b.join(0, {owner.summed, owner.sent}));
    return;
  }
  // Steps 0..n-2 reduce-scatter (this rank ends owning chunk r+1, fully reduced), steps n-1..2n-3 allgather.
  ring(b, 2 * n - 2, r,
       [n](int k) { return k < n - 2 ? Step::reduce : k == n - 2 ? Step::last_reduce : Step::gather; }, ch,
       {a.in, chunk_pointers(a.out, ch, esize), enc, true, false});
}

}  // namespace smartcoll::coll
