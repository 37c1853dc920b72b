// Hierarchical allreduce for several ranks per host: a reduce-scatter ring among the ranks of each host (local
// rank i ends with chunk i summed over its host), an allreduce ring of chunk i among the i-th ranks of every host,
// and an allgather ring on each host. Each host sends 2(H-1)/H of the vector across the network in all, spread
// over its k ranks, whatever k is: inter-host traffic does not grow with ranks per host.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void allreduce_hier(Builder& b, const Args& a) {
  const HostGrid grid = host_grid(*b.cx.hosts, b.cx.rank);
  const auto& [at, by_host, k, hosts, i, h] = grid;
  const size_t esize = dtype_size(b.spec.dtype);
  const Chunks local = split_vector(a.count, k, esize, nullptr);
  const std::vector<char*> out = chunk_pointers(a.out, local, esize);
  auto join = [&](std::initializer_list<const std::vector<int32_t>*> parts) {
    std::vector<int32_t> ops;
    for (const auto* p : parts) ops.insert(ops.end(), p->begin(), p->end());
    return b.join(0, ops);
  };
  // 1. On this host: chunk i summed into out[i]. Every step is a plain reduce: avg divides once, in step 2.
  const RingOps scatter = ring(b, k - 1, i - 1, [](int) { return Step::reduce; }, local,
                               {a.in, out, nullptr, false, false}, 1, -1, at.local);
  // 2. Across hosts: chunk i of every host, reduced and shared in place (out[i] is both operand and result).
  char* mine = out[static_cast<size_t>(i)];
  const Chunks across = split_vector(local.len[static_cast<size_t>(i)], hosts, esize, nullptr);
  const RingOps shared = ring(
      b, 2 * hosts - 2, h,
      [hosts](int s) { return s < hosts - 2 ? Step::reduce : s == hosts - 2 ? Step::last_reduce : Step::gather; },
      across, {mine, chunk_pointers(mine, across, esize), nullptr, true, false}, 1,
      join({&scatter.sends, &scatter.recvs}), at.cross);
  // 3. On this host: every chunk from its local owner.
  ring(b, k - 1, i, [](int) { return Step::gather; }, local, {a.out, out, nullptr, false, true}, 1,
       join({&shared.sends, &shared.recvs}), at.local);
}

}  // namespace smartcoll::coll
