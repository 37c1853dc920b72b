// Binomial-tree reduce (the broadcast tree run backwards): position v adds the partial results of its children
// v + 2^k, smallest k first, then sends to its parent. log2(n) steps: for small messages. Children's operands go
// on the right in a fixed order, so the root's result is the same from run to run.
#include "coll/algorithms.h"
#include "smartcoll/reduce.h"

namespace smartcoll::coll {

void reduce_tree(Builder& b, const Args& a) {
  const int n = b.cx.size, v = mod(b.cx.rank - a.root, n);
  const size_t esize = dtype_size(b.spec.dtype), bytes = a.count * esize;
  int low = 1;
  while (low < n && !(v & low)) low <<= 1;
  char* acc = v == 0 ? a.out : b.scratch(bytes);
  int32_t last = acc == a.in ? -1 : b.copy(0, acc, a.in, bytes);
  std::vector<int> children;
  for (int mask = 1; mask < low && mask < n; mask <<= 1)
    if (v + mask < n) children.push_back(v + mask);
  for (size_t i = 0; i < children.size(); ++i) {
    const bool divide = b.spec.op == ReduceOp::avg && v == 0 && i + 1 == children.size();
    last = b.recv(0, mod(children[i] + a.root, n), b.scratch(bytes), bytes, {last}, kReduce, acc, acc, a.count,
                  divide);
  }
  if (v != 0) b.send(0, mod(v - low + a.root, n), acc, bytes, {last});
}

}  // namespace smartcoll::coll
