// Hierarchical broadcast for several ranks per host: a pipelined chain across hosts among the ranks with the root's
// local index, starting at the root's host, and on each host a chain from that rank through the others. Each
// segment goes on as soon as it arrives, through both chains. Each host's link carries the vector once in and once
// out whatever the order of the ranks (a flat chain over interleaved ranks crosses the network at every hop).
#include "coll/algorithms.h"

namespace smartcoll::coll {

void broadcast_hier(Builder& b, const Args& a) {
  const HostGrid grid = host_grid(*b.cx.hosts, b.cx.rank);
  const auto& [at, by_host, k, hosts, i, h] = grid;
  const auto [g0, i0, across, cpos, lpos] = grid.chains(a.root);
  const size_t esize = dtype_size(b.spec.dtype);
  size_t seg = 0;
  for_each_segment(a.count, segment_elems(b.cx.segment_bytes, esize, nullptr), [&](size_t off, size_t len) {
    const int s = static_cast<int>(seg++ % static_cast<size_t>(b.cx.streams));
    char* p = a.out + off * esize;
    const size_t bytes = len * esize;
    int32_t got = -1;
    if (across) {
      if (cpos > 0) got = b.recv(s, grid.rank_at(mod(h - 1, hosts), i0), p, bytes);
      if (cpos < hosts - 1) b.send(s, grid.rank_at(mod(h + 1, hosts), i0), p, bytes, {got});
    } else {
      got = b.recv(s, grid.rank_at(h, mod(i - 1, k)), p, bytes);
    }
    if (lpos < k - 1) b.send(s, grid.rank_at(h, mod(i + 1, k)), p, bytes, {got});
  });
}

}  // namespace smartcoll::coll
