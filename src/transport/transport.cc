#include "transport/transport.h"

#include <poll.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "smartcoll/types.h"

namespace smartcoll {

void Transport::run(std::span<Op> ops) {
  try {
    run_ops(ops);
  } catch (const CommError& e) {
    if (context.empty()) throw;
    throw CommError(context + ": " + e.what());
  }
}

void Transport::run_ops(std::span<Op> ops) {
  using Clock = std::chrono::steady_clock;
  auto last = Clock::now();
  for (;;) {
    bool pending = false, moved = false, unconnected = false;
    std::vector<pollfd> fds;
    for (Op& op : ops) {
      if (op.done == op.len) continue;
      pending = true;
      if (!connect(op.peer, 0)) {
        unconnected = true;
        continue;
      }
      for (;;) {
        iovec v{op.buf + op.done, op.len - op.done};
        const size_t n = op.send ? send(op.peer, 0, &v, 1) : recv(op.peer, 0, &v, 1);
        if (n == 0) break;
        op.done += n;
        moved = true;
        if (op.done == op.len) break;
      }
      if (op.done < op.len)
        fds.push_back({pollable(op.peer, 0), static_cast<short>(op.send ? POLLOUT : POLLIN), 0});
    }
    if (!pending) return;
    if (moved) {
      last = Clock::now();
      continue;
    }
    if (!unconnected && Clock::now() - last > timeout) {  // connect() bounds the wait for a connection
      std::string who;
      for (const Op& op : ops)
        if (op.done < op.len)
          who += std::string(who.empty() ? "" : ", ") + (op.send ? "sending to rank " : "receiving from rank ") +
                 std::to_string(op.peer);
      throw CommError("no progress for " + std::to_string(timeout.count()) + " s while " + who +
                      "; is that rank alive and calling the same collective? (SMARTCOLL_TIMEOUT raises the limit)");
    }
    // Channels still being connected have nothing to poll on: look again soon.
    if (::poll(fds.data(), fds.size(), unconnected ? 1 : 100) < 0 && errno != EINTR)
      throw CommError("poll failed: " + std::string(std::strerror(errno)));
  }
}

void exchange(Transport& t, const void* mine, void* all, size_t bytes) {
  const int n = t.size(), r = t.rank();
  auto* base = static_cast<char*>(all);
  std::memcpy(base + static_cast<size_t>(r) * bytes, mine, bytes);
  std::vector<Transport::Op> ops;
  ops.reserve(2 * static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    ops.push_back({p, true, const_cast<char*>(static_cast<const char*>(mine)), bytes});
    ops.push_back({p, false, base + static_cast<size_t>(p) * bytes, bytes});
  }
  t.run(ops);
}

}  // namespace smartcoll
