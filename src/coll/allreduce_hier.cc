// Hierarchical allreduce for several ranks per host: a reduce-scatter ring among the ranks of each host (local
// rank i ends with chunk i summed over its host), an allreduce ring of chunk i among the i-th ranks of every host,
// and an allgather ring on each host. Each host sends 2(H-1)/H of the vector across the network in all, spread
// over its k ranks, whatever k is: inter-host traffic does not grow with ranks per host.
//
// A large vector goes in pieces, each through the three rings, so that the host's rings of one piece run while
// another piece crosses the network: every piece's reduce-scatter is queued on the host's connections before any
// allgather, so the network waits only for the first piece's and the last piece's allgather waits for nothing
// else (the phases, one after the other, left each host's link idle while its ranks reduced and copied).
#include "coll/algorithms.h"

#include <algorithm>

namespace smartcoll::coll {

int allreduce_hier_pieces(size_t bytes) {
  // At least 2 MiB each (chunks of 256 KiB, a segment, cross the network on 4 hosts x 2 ranks), at most 8:
  // measured against 4 MiB pieces, 0.95-0.98x the time from 4 to 16 MiB on 4 hosts x 2 ranks at 1 Gbit/s.
  constexpr size_t kPieceBytes = size_t{2} << 20;
  return static_cast<int>(std::clamp<size_t>(bytes / kPieceBytes, 1, 8));
}

void allreduce_hier(Builder& b, const Args& a) {
  const HostGrid grid = host_grid(*b.cx.hosts, b.cx.rank);
  const auto& [at, by_host, k, hosts, i, h] = grid;
  const size_t esize = dtype_size(b.spec.dtype);
  const int pieces = allreduce_hier_pieces(a.count * esize);
  auto join = [&](std::initializer_list<const std::vector<int32_t>*> parts) {
    std::vector<int32_t> ops;
    for (const auto* p : parts) ops.insert(ops.end(), p->begin(), p->end());
    return b.join(0, ops);
  };
  struct Piece {
    const char* in;
    char* out;
    Chunks local;
    std::vector<char*> chunk;  // where each local chunk's result goes
    RingOps scatter, shared;
  };
  std::vector<Piece> piece(static_cast<size_t>(pieces));
  // 1. On this host, every piece: chunk i summed into its place in out. Every step is a plain reduce: avg
  // divides once, in step 2.
  for (int p = 0; p < pieces; ++p) {
    Piece& x = piece[static_cast<size_t>(p)];
    const size_t begin = part_begin(a.count, pieces, p), len = part_begin(a.count, pieces, p + 1) - begin;
    x.in = a.in + begin * esize;
    x.out = a.out + begin * esize;
    x.local = split_vector(len, k, esize, nullptr);
    x.chunk = chunk_pointers(x.out, x.local, esize);
    x.scatter = ring(b, k - 1, i - 1, [](int) { return Step::reduce; }, x.local, {x.in, x.chunk, nullptr, false, false},
                     1, -1, at.local);
  }
  // 2. Across hosts, each piece once its host sum is in: chunk i of every host, reduced and shared in place
  // (the chunk is both operand and result).
  for (Piece& x : piece) {
    char* mine = x.chunk[static_cast<size_t>(i)];
    const Chunks across = split_vector(x.local.len[static_cast<size_t>(i)], hosts, esize, nullptr);
    x.shared = ring(
        b, 2 * hosts - 2, h,
        [hosts](int s) { return s < hosts - 2 ? Step::reduce : s == hosts - 2 ? Step::last_reduce : Step::gather; },
        across, {mine, chunk_pointers(mine, across, esize), nullptr, true, false}, 1,
        join({&x.scatter.sends, &x.scatter.recvs}), at.cross);
  }
  // 3. On this host, each piece once it is back: every chunk from its local owner.
  for (Piece& x : piece)
    ring(b, k - 1, i, [](int) { return Step::gather; }, x.local, {x.out, x.chunk, nullptr, false, true}, 1,
         join({&x.shared.sends, &x.shared.recvs}), at.local);
}

}  // namespace smartcoll::coll
