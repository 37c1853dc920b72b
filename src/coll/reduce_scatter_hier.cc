// Hierarchical reduce-scatter for several ranks per host, allgather_hier in reverse: per host g, a reduce-scatter
// ring on each host sums the blocks of g's ranks over this host's ranks (local rank i ends with the host's sum of
// the block of g's i-th rank), then a reduce-scatter ring across hosts among the ranks of each local index sums
// those host sums, so that each rank ends with its own block. A host's link carries k(H-1) blocks whatever the
// order of the ranks. The rings on a host run in the order the ring across hosts takes their sums.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void reduce_scatter_hier(Builder& b, const Args& a) {
  const HostGrid grid = host_grid(*b.cx.hosts, b.cx.rank);
  const auto& [at, by_host, k, hosts, i, h] = grid;
  const size_t esize = dtype_size(b.spec.dtype), bytes = a.count * esize;
  // sums[g]: this host's sum of the block of g's i-th rank. Each ring on the host reduces the chunks it passes on
  // into slots of its own (k blocks per host); slot i of host g is sums[g].
  char* const slots = b.scratch(static_cast<size_t>(hosts) * static_cast<size_t>(k) * bytes);
  auto slot = [&](int g, int j) { return slots + (static_cast<size_t>(g) * static_cast<size_t>(k) + static_cast<size_t>(j)) * bytes; };
  // 1. On this host, one ring per host g, over the blocks of g's ranks in the input. Plain reduces: avg divides
  // once, in step 2. summed[g]: once done, sums[g] holds its final value.
  std::vector<int32_t> summed(static_cast<size_t>(hosts), -1);
  for (int step = 1; step <= hosts; ++step) {
    const int g = mod(h - step, hosts);  // the order in which step 2 sends (h - 1 first) and adds them
    Chunks chunks = equal_blocks(a.count, k, esize, nullptr);
    std::vector<char*> acc(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j) {
      chunks.off[static_cast<size_t>(j)] = static_cast<size_t>(grid.rank_at(g, j)) * a.count;
      acc[static_cast<size_t>(j)] = slot(g, j);
    }
    const RingOps on_host = ring(b, k - 1, i - 1, [](int) { return Step::reduce; }, chunks,
                                 {a.in, acc, nullptr, false, false}, 1, -1, at.local);
    summed[static_cast<size_t>(g)] = b.join(0, on_host.received(i, i - 1, k));
  }
  // 2. Across hosts: chunk g is sums[g], reduced in place on its way to its owner, g's i-th rank: this rank. Step
  // s sends what it received at step s - 1 (sums[h - 1] first) and adds sums[h - 2 - s] to what it receives.
  Chunks chunks = equal_blocks(a.count, hosts, esize, nullptr);
  std::vector<char*> acc(static_cast<size_t>(hosts));
  for (int g = 0; g < hosts; ++g) {
    chunks.off[static_cast<size_t>(g)] =
        (static_cast<size_t>(g) * static_cast<size_t>(k) + static_cast<size_t>(i)) * a.count;
    acc[static_cast<size_t>(g)] = g == h ? a.out : slot(g, i);
  }
  std::vector<int32_t> step_ready(static_cast<size_t>(hosts - 1));
  for (int s = 0; s < hosts - 1; ++s) step_ready[static_cast<size_t>(s)] = summed[static_cast<size_t>(mod(h - 2 - s, hosts))];
  ring(b, hosts - 1, h - 1, [hosts](int s) { return s < hosts - 2 ? Step::reduce : Step::last_reduce; }, chunks,
       {slots, acc, nullptr, false, false}, 1, summed[static_cast<size_t>(mod(h - 1, hosts))], at.cross, step_ready);
}

}  // namespace smartcoll::coll
