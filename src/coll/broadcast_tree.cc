// Binomial-tree broadcast over positions relative to the root: position v receives from v minus its lowest set
// bit, then sends to v + 2^k for every 2^k below that bit. log2(n) steps: for small messages.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void broadcast_tree(Builder& b, const Args& a) {
  const int n = b.cx.size, v = mod(b.cx.rank - a.root, n);
  const size_t bytes = a.count * dtype_size(b.spec.dtype);
  int mask = 1;
  while (mask < n && !(v & mask)) mask <<= 1;
  const int32_t got = mask < n ? b.recv(0, mod(v - mask + a.root, n), a.out, bytes) : -1;
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (v + mask < n) b.send(0, mod(v + mask + a.root, n), a.out, bytes, {got});
}

}  // namespace smartcoll::coll
