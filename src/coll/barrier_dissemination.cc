// Dissemination barrier: in round k every rank signals rank + 2^k and waits for rank - 2^k; after ceil(log2 n)
// rounds every rank has heard, directly or not, from every other. The signal is the call's descriptor alone.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void barrier_dissemination(Builder& b, const Args&) {
  const int n = b.cx.size, r = b.cx.rank;
  int32_t heard = -1;
  for (int d = 1; d < n; d *= 2) {
    b.send(0, mod(r + d, n), nullptr, 0, {heard});
    heard = b.recv(0, mod(r - d, n), nullptr, 0, {heard});
  }
}

}  // namespace smartcoll::coll
