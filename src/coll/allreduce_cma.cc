// Same-host allreduce: ranks read each other's buffers once with process_vm_readv (transport/cma.h). It drives
// its own control messages, so it runs alone (a task with `exclusive`).
#include "coll/algorithms.h"
#include "transport/cma.h"

namespace smartcoll::coll {

void allreduce_cma(Builder& b, const Args& a) {
  cma::Local* local = b.cx.cma;
  Transport* t = b.cx.transport;
  const DataType dt = b.spec.dtype;
  const ReduceOp op = b.spec.op;
  b.exclusive([local, t, a, dt, op] { local->allreduce(*t, a.in, a.out, a.count, dt, op); });
}

}  // namespace smartcoll::coll
