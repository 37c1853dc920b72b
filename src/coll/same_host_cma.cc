// Same-host collectives: ranks read each other's buffers once with process_vm_readv (transport/cma.h). They
// drive their own control messages, so they run alone (a task with `exclusive`).
#include "coll/algorithms.h"
#include "transport/cma.h"

namespace smartcoll::coll {

void same_host_cma(Builder& b, const Args& a) {
  cma::Local* local = b.cx.cma;
  Transport* t = b.cx.transport;
  const cma::Local::Call call{b.collective(), b.spec.dtype, b.spec.op, a.root, a.count, a.in, a.out};
  const Task* task = &b.task();
  b.exclusive([local, t, call, task] {
    cma::Local::Call numbered = call;  // numbered when submitted, after it was built
    numbered.call = task->seq + 1;
    numbered.desc = &task->desc;
    local->run(*t, numbered);
  });
}

}  // namespace smartcoll::coll
