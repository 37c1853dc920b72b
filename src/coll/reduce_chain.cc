// Pipelined chain reduce: partial sums flow from the rank farthest from the root (position n-1) down the chain
// to the root, a segment at a time.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void reduce_chain(Builder& b, const Args& a) {
  const int n = b.cx.size, r = b.cx.rank, pos = mod(r - a.root, n);
  const size_t esize = dtype_size(b.spec.dtype), seg = segment_elems(b.cx.segment_bytes, esize, nullptr);
  const bool receives = pos < n - 1, sends_on = pos > 0;
  char* acc = pos == 0 ? a.out : b.scratch(a.count * esize);
  std::vector<char*> staging(static_cast<size_t>(b.cx.streams), nullptr);
  size_t j = 0;
  for_each_segment(a.count, seg, [&](size_t off, size_t len) {
    const int s = static_cast<int>(j++ % static_cast<size_t>(b.cx.streams));
    const size_t at = off * esize;
    int32_t got = -1;
    if (receives) {
      char*& land = staging[static_cast<size_t>(s)];
      if (!land) land = b.scratch(seg * esize);
      got = b.recv(s, mod(r + 1, n), land, len * esize, {}, kReduce, acc + at, a.in + at, len,
                   b.spec.op == ReduceOp::avg && pos == 0);
    }
    if (sends_on) b.send(s, mod(r - 1, n), (receives ? acc : a.in) + at, len * esize, {got});
  });
}

}  // namespace smartcoll::coll
