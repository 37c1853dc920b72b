// Ring reduce-scatter: n-1 steps, starting one chunk further back than allreduce so that the chunk received
// last, fully reduced, is this rank's. With a codec in owner mode: the owner exchange of allreduce_ring.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void reduce_scatter_ring(Builder& b, const Args& a) {
  const int n = b.cx.size, r = b.cx.rank;
  const Codec* codec = b.spec.wire();
  const size_t esize = dtype_size(b.spec.dtype);
  const Chunks ch = equal_blocks(a.count, n, esize, codec);
  auto* enc = codec ? reinterpret_cast<uint8_t*>(b.scratch(ch.wire_total())) : nullptr;
  if (codec && b.cx.codec_owner) {
    owner_reduce(b, ch, a.in, enc, reinterpret_cast<float*>(a.out), false);
    return;
  }
  std::vector<char*> acc = chunk_pointers(b.scratch(a.count * static_cast<size_t>(n) * esize), ch, esize);
  acc[static_cast<size_t>(r)] = a.out;
  ring(b, n - 1, r - 1, [n](int k) { return k < n - 2 ? Step::reduce : Step::last_reduce; }, ch,
       {a.in, acc, enc, false, false});
}

}  // namespace smartcoll::coll
