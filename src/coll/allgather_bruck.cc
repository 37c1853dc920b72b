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
  int32_t got = b.copy(0, tmp, a.in, blk);
  for (int d = 1; d < n; d *= 2) {
    const size_t blocks = static_cast<size_t>(std::min(d, n - d));
    b.send(0, mod(r - d, n), tmp, blocks * blk, {got});
    // After the previous receive only, not this step's send: the two touch different blocks (blocks <= d), and
    // ranks that all wait for their sends to leave before receiving deadlock once a message outgrows the socket
    // buffers (a model profile may pick Bruck for large calls).
    got = b.recv(0, mod(r + d, n), tmp + static_cast<size_t>(d) * blk, blocks * blk, {got});
  }
  for (int i = 0; i < n; ++i)
    b.copy(0, a.out + static_cast<size_t>(mod(r + i, n)) * blk, tmp + static_cast<size_t>(i) * blk, blk, {got});
}

}  // namespace smartcoll::coll
