// Direct alltoallv: like alltoall_direct, every pair exchanges its block at once, but blocks have their own
// counts and displacements. Each block is preceded by its count (8 bytes), which the receiver compares with its
// own recvcounts before the block is read: counts that do not agree pairwise fail the call on the rank that sees
// them (and, through the failure, on every rank) instead of mixing bytes of the next call.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void alltoallv_direct(Builder& b, const Args& a) {
  const int n = b.cx.size, r = b.cx.rank;
  const Displacements& v = *a.displs;
  const size_t esize = dtype_size(b.spec.dtype);
  const size_t me = static_cast<size_t>(r), peers = static_cast<size_t>(n);
  b.copy(0, a.out + v.rdispls[me] * esize, a.in + v.sdispls[me] * esize, v.sendcounts[me] * esize);
  auto* counts = reinterpret_cast<uint64_t*>(b.scratch(sizeof(uint64_t) * peers * 2));
  for (int k = 1; k < n; ++k) {
    const size_t to = static_cast<size_t>(mod(r + k, n)), from = static_cast<size_t>(mod(r - k, n));
    counts[to] = v.sendcounts[to];
    b.send(0, static_cast<int>(to), reinterpret_cast<char*>(&counts[to]), sizeof(uint64_t));
    b.recv(0, static_cast<int>(from), reinterpret_cast<char*>(&counts[peers + from]), sizeof(uint64_t), {},
           kCheckCount, nullptr, nullptr, v.recvcounts[from]);
    b.send(0, static_cast<int>(to), a.in + v.sdispls[to] * esize, v.sendcounts[to] * esize);
    b.recv(0, static_cast<int>(from), a.out + v.rdispls[from] * esize, v.recvcounts[from] * esize);
  }
}

}  // namespace smartcoll::coll
