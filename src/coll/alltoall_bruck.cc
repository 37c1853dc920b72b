// Bruck alltoall: ceil(log2 n) steps instead of direct's n-1 messages per rank, for small blocks where the
// per-message cost dominates. The blocks are first rotated so that slot i holds the block for rank r+i; at step k
// (d = 2^k) a rank packs the slots whose index has bit k set, sends them to rank r+d and puts what rank r-d sends
// into the same slots: a block moves by the binary digits of its slot, so after the last step slot i holds what
// rank r-i sent to r. A last copy rotates the slots into place. Each rank sends sum(popcount(i), i < n) blocks,
// about n/2 log2(n), in log2(n) messages.
#include <cstring>

#include "coll/algorithms.h"

namespace smartcoll::coll {

void alltoall_bruck(Builder& b, const Args& a) {
  const int n = b.cx.size, r = b.cx.rank;
  const size_t blk = a.count * dtype_size(b.spec.dtype);
  const size_t most = static_cast<size_t>(n) / 2 * blk;  // at most n/2 slots have a given bit set (i < n)
  char* slots = b.scratch(blk * static_cast<size_t>(n));
  char* packed = b.scratch(most);
  char* arrived = b.scratch(most);
  const char* in = a.in;
  char* out = a.out;
  int32_t last = b.compute(0, [=] {
    for (int i = 0; i < n; ++i) std::memcpy(slots + static_cast<size_t>(i) * blk, in + static_cast<size_t>(mod(r + i, n)) * blk, blk);
  });
  for (int d = 1; d < n; d *= 2) {
    // Copies the slots with bit d to or from `buf`, in slot order (the sender's order is the receiver's).
    const auto move = [=](char* buf, bool pack) {
      size_t at = 0;
      for (int i = d; i < n; ++i) {
        if (!(i & d)) continue;
        char* slot = slots + static_cast<size_t>(i) * blk;
        pack ? std::memcpy(buf + at, slot, blk) : std::memcpy(slot, buf + at, blk);
        at += blk;
      }
    };
    size_t bytes = 0;
    for (int i = d; i < n; ++i) bytes += (i & d) ? blk : 0;
    const int32_t ready = b.compute(0, [=] { move(packed, true); }, {last});
    const int32_t sent = b.send(0, mod(r + d, n), packed, bytes, {ready});
    const int32_t got = b.recv(0, mod(r - d, n), arrived, bytes, {ready});
    // After the send too: the next step packs into the same buffer.
    last = b.compute(0, [=] { move(arrived, false); }, {got, sent});
  }
  b.compute(0, [=] {
    for (int i = 0; i < n; ++i) std::memcpy(out + static_cast<size_t>(mod(r - i, n)) * blk, slots + static_cast<size_t>(i) * blk, blk);
  }, {last});
}

}  // namespace smartcoll::coll
