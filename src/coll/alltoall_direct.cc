// Direct alltoall: every pair exchanges its block at once (n-1 sends and receives in flight), which keeps all
// links busy without the n-1 rounds of a pairwise schedule.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void alltoall_direct(Builder& b, const Args& a) {
  const int n = b.cx.size, r = b.cx.rank;
  const size_t blk = a.count * dtype_size(b.spec.dtype);
  char* out = a.out;
  const char* in = a.in;
  b.copy(0, out + static_cast<size_t>(r) * blk, in + static_cast<size_t>(r) * blk, blk);
  for (int k = 1; k < n; ++k) {
    const int to = mod(r + k, n), from = mod(r - k, n);
    b.send(0, to, in + static_cast<size_t>(to) * blk, blk);
    b.recv(0, from, out + static_cast<size_t>(from) * blk, blk);
  }
}

}  // namespace smartcoll::coll
