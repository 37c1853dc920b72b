// Same-host collectives: ranks read each other's buffers once with process_vm_readv, or put small calls' data
// through the shared control segment (transport/cma.h). They drive their own control messages, so they run
// alone (a task with `exclusive`).
#include <vector>

#include "coll/algorithms.h"
#include "coll/segmented.h"
#include "transport/cma.h"

namespace smartcoll::coll {

namespace {
void same_host(Builder& b, const Args& a, bool through_segment) {
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
  cma::Local::Call call{b.collective(), b.spec.dtype, b.spec.op, a.root, a.count, a.in, a.out};
  call.through_segment = through_segment;
  const Task* task = &b.task();
  b.exclusive_until([local, t, call, task, ins = pieces(a.in), outs = pieces(a.out),
                     layout = b.compared_layout()](std::chrono::steady_clock::time_point until) {
    cma::Local::Call c = call;
    c.in_list = ins;
    c.out_list = outs;
    c.layout = layout;
    c.call = task->seq + 1;  // numbered when submitted, after it was built
    c.desc = &task->desc;
    return local->run(*t, c, until);
  });
}
}  // namespace

void same_host_cma(Builder& b, const Args& a) { same_host(b, a, false); }
void same_host_shm(Builder& b, const Args& a) { same_host(b, a, true); }

}  // namespace smartcoll::coll
