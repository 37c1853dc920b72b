// Pipelined chain broadcast: segments flow root -> root+1 -> ... ; each rank forwards a segment as soon as it
// has it, so for large messages the time approaches bytes / link rate whatever the world size.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void broadcast_chain(Builder& b, const Args& a) {
  const int n = b.cx.size, r = b.cx.rank, pos = mod(r - a.root, n);
  const size_t esize = dtype_size(b.spec.dtype);
  size_t j = 0;
  for_each_segment(a.count, segment_elems(b.cx.segment_bytes, esize, nullptr), [&](size_t off, size_t len) {
    const int s = static_cast<int>(j++ % static_cast<size_t>(b.cx.streams));
    char* at = a.out + off * esize;
    const int32_t got = pos > 0 ? b.recv(s, mod(r - 1, n), at, len * esize) : -1;
    if (pos < n - 1) b.send(s, mod(r + 1, n), at, len * esize, {got});
  });
}

}  // namespace smartcoll::coll
