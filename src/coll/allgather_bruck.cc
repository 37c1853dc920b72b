// Bruck allgather: ceil(log2 n) steps instead of the ring's n-1. Blocks are gathered in an order rotated by this
// rank's index (block i of the scratch vector is rank r+i's); at step k with d = 2^k a rank sends its first
// min(d, n-d) blocks to rank r-d and receives as many from rank r+d after them; a last local copy rotates the
// blocks into place. Each rank sends about (n-1) blocks in all, in log2(n) messages: for small blocks.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void allgather_bruck(Builder& b, const Args& a) {
  const int n = b.cx.size, r = b.cx.rank;
  const size_t blk = a.count * dtype_size(b.spec.dtype);
  char* tmp = b.scratch(blk * static_cast<size_t>(n));
  int32_t last = b.copy(0, tmp, a.in, blk);
  int32_t got = last;
  for (int d = 1; d < n; d *= 2) {
    const size_t blocks = static_cast<size_t>(std::min(d, n - d));
    last = b.send(0, mod(r - d, n), tmp, blocks * blk, {got});
    // After the previous receive (the rotation below waits for the last one only) and this step's send.
    got = b.recv(0, mod(r + d, n), tmp + static_cast<size_t>(d) * blk, blocks * blk, {got, last});
  }
  for (int i = 0; i < n; ++i)
    b.copy(0, a.out + static_cast<size_t>(mod(r + i, n)) * blk, tmp + static_cast<size_t>(i) * blk, blk, {got});
}

}  // namespace smartcoll::coll
