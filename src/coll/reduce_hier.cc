// Hierarchical reduce for several ranks per host, broadcast_hier in reverse: on each host a pipelined chain sums
// the host's vectors into the rank with the root's local index, and a chain across hosts among those ranks sums
// the host sums into the root, segment by segment. Each host's link carries one vector, whatever the rank order.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void reduce_hier(Builder& b, const Args& a) {
  const HostGrid grid = host_grid(*b.cx.hosts, b.cx.rank);
  const auto& [at, by_host, k, hosts, i, h] = grid;
  // across: sums its host's vectors, then takes part in the chain across hosts.
  const auto [g0, i0, across, cpos, lpos] = grid.chains(a.root);
  const bool root = across && cpos == 0;
  const size_t esize = dtype_size(b.spec.dtype), seg = segment_elems(b.cx.segment_bytes, esize, nullptr);
  // The host's sum so far (every rank but the last of the host's chain receives), then, across, the hosts' sum.
  char* const host_sum = lpos < k - 1 ? b.scratch(a.count * esize) : nullptr;
  char* const all_sum = !across || cpos == hosts - 1 ? nullptr : root ? a.out : b.scratch(a.count * esize);
  // A segment of each chain may be arriving at once: each has its own landing place per stream.
  std::vector<char*> land_host(static_cast<size_t>(b.cx.streams), nullptr), land_across = land_host;
  auto landing = [&](std::vector<char*>& land, int s) {
    char*& p = land[static_cast<size_t>(s)];
    if (!p) p = b.scratch(seg * esize);
    return p;
  };
  const bool avg = b.spec.op == ReduceOp::avg;
  size_t j = 0;
  for_each_segment(a.count, seg, [&](size_t off, size_t len) {
    const int s = static_cast<int>(j++ % static_cast<size_t>(b.cx.streams));
    const size_t o = off * esize, bytes = len * esize;
    int32_t got = -1;
    if (host_sum)
      got = b.recv(s, grid.rank_at(h, mod(i + 1, k)), landing(land_host, s), bytes, {}, kReduce, host_sum + o,
                   a.in + o, len);
    const char* mine = host_sum ? host_sum + o : a.in + o;
    if (!across) {
      b.send(s, grid.rank_at(h, mod(i - 1, k)), mine, bytes, {got});
      return;
    }
    if (all_sum) {
      got = b.recv(s, grid.rank_at(mod(h + 1, hosts), i0), landing(land_across, s), bytes, {got}, kReduce,
                   all_sum + o, mine, len, avg && root);
      mine = all_sum + o;
    }
    if (!root) b.send(s, grid.rank_at(mod(h - 1, hosts), i0), mine, bytes, {got});
  });
}

}  // namespace smartcoll::coll
