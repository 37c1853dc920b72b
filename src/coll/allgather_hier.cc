// Hierarchical allgather for several ranks per host: a ring across hosts among the ranks of each local index (local
// rank i ends with the block of every host's i-th rank), then, per host, a ring on each host that hands those
// blocks to its other ranks. A host's link carries the k(H-1) blocks its k ranks must receive from the other H-1
// hosts, whatever the order of the ranks: a flat ring over ranks interleaved across hosts crosses every link with
// each block. The rings on a host start with the blocks of this host, then take the others' in the order the ring
// across hosts delivers them.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void allgather_hier(Builder& b, const Args& a) {
  const HostGrid grid = host_grid(*b.cx.hosts, b.cx.rank);
  const auto& [at, by_host, k, hosts, i, h] = grid;
  const size_t esize = dtype_size(b.spec.dtype), bytes = a.count * esize;
  auto block = [&](int rank) { return a.out + static_cast<size_t>(rank) * bytes; };
  char* mine = block(b.cx.rank);
  if (mine != a.in) b.copy(0, mine, a.in, bytes);
  // This rank's block is sent from the input, in both rings.
  char* const own = const_cast<char*>(a.in);
  // 1. Across hosts: the blocks of the ranks with local index i.
  std::vector<char*> across(static_cast<size_t>(hosts));
  for (int g = 0; g < hosts; ++g) across[static_cast<size_t>(g)] = g == h ? own : block(at.cross.members[g]);
  const RingOps ring_across = ring(b, hosts - 1, h, [](int) { return Step::gather; },
                                   equal_blocks(a.count, hosts, esize, nullptr), {a.in, across, nullptr, false, true},
                                   1, -1, at.cross);
  // 2. On this host, one ring per host g: local rank j holds the block of g's j-th rank.
  const Chunks local = equal_blocks(a.count, k, esize, nullptr);
  for (int step = 0; step < hosts; ++step) {
    const int g = mod(h - step, hosts);  // this host's blocks first, then in the order they arrive
    std::vector<char*> acc(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j) acc[static_cast<size_t>(j)] = block(grid.rank_at(g, j));
    if (g == h) acc[static_cast<size_t>(i)] = own;
    const int32_t ready = g == h ? -1 : b.join(0, ring_across.received(g, h, hosts));
    ring(b, k - 1, i, [](int) { return Step::gather; }, local, {a.in, acc, nullptr, false, true}, 1, ready, at.local);
  }
}

}  // namespace smartcoll::coll
