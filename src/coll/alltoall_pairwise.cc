// Pairwise alltoall: n-1 rounds; in round k a rank sends its block for rank r+k and receives rank r-k's block,
// and starts round k+1 only once round k's block has arrived and its own has left. Every rank then receives from
// about one peer at a time, where direct's n-1 senders all converge on each receiver at once (incast: on a switch
// port or a shaped link with a short queue they overflow it, and the losses cost TCP retransmission timeouts of
// 200 ms and more). The same bytes as direct, n-1 steps instead of one.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void alltoall_pairwise(Builder& b, const Args& a) {
  const int n = b.cx.size, r = b.cx.rank;
  const size_t blk = a.count * dtype_size(b.spec.dtype);
  const auto block = [blk](auto* base, int rank) { return base + static_cast<size_t>(rank) * blk; };
  b.copy(0, block(a.out, r), block(a.in, r), blk);
  int32_t arrived = -1, sent = -1;
  for (int k = 1; k < n; ++k) {
    const int to = mod(r + k, n), from = mod(r - k, n);
    // After the last round's block arrived and this rank's last block left: one block in flight each way. (A
    // send is done once the socket has its bytes; the receive is what bounds the round.)
    sent = b.send(0, to, block(a.in, to), blk, {arrived, sent});
    arrived = b.recv(0, from, block(a.out, from), blk, {arrived});
  }
}

}  // namespace smartcoll::coll
