// Same-host collectives: ranks read each other's buffers once with process_vm_readv (transport/cma.h). They
// drive their own control messages, so they run alone (a task with `exclusive`).
#include <vector>

#include "coll/algorithms.h"
#include "coll/segmented.h"
#include "transport/cma.h"

namespace smartcoll::coll {

void same_host_cma(Builder& b, const Args& a) {
  cma::Local* local = b.cx.cma;
  Transport* t = b.cx.transport;
  // A list call's buffer is a view (coll/segmented.h), an address range nothing may touch: the call gets the
  // view's pieces instead, which it reads and writes where they are (and publishes as a table for its peers).
  auto pieces = [&b](const char* p) {
    std::vector<cma::Extent> list;
    if (const Segmented* v = b.spec.views && p ? b.spec.views->find(p) : nullptr)
      for (const Piece& piece : v->pieces()) list.push_back({reinterpret_cast<uintptr_t>(piece.data), piece.bytes});
    return list;
  };
  const cma::Local::Call call{b.collective(), b.spec.dtype, b.spec.op, a.root, a.count, a.in, a.out};
  const Task* task = &b.task();
  b.exclusive([local, t, call, task, ins = pieces(a.in), outs = pieces(a.out), layout = b.compared_layout()] {
    cma::Local::Call c = call;
    c.in_list = ins;
    c.out_list = outs;
    c.layout = layout;
    c.call = task->seq + 1;  // numbered when submitted, after it was built
    c.desc = &task->desc;
    local->run(*t, c);
  });
}

}  // namespace smartcoll::coll
