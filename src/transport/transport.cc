#include "transport/transport.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "smartcoll/types.h"

namespace smartcoll {

bool Transport::run(std::span<Op> ops, Clock::time_point until, Clock::time_point* progress) {
  try {
    return run_ops(ops, until, progress);
  } catch (const CommError& e) {
    if (context.empty()) throw;
    throw CommError(context + ": " + e.what());
  }
}

bool Transport::run_ops(std::span<Op> ops, Clock::time_point until, Clock::time_point* progress) {
  Clock::time_point own = Clock::now();
  Clock::time_point& last = progress ? *progress : own;
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
    if (!pending) return true;
    const auto now = Clock::now();
    if (moved) {
      last = now;
      continue;
    }
    if (now >= until) return false;
    if (!unconnected && now - last > timeout) {  // connect() bounds the wait for a connection
      std::string who;
      for (const Op& op : ops)
        if (op.done < op.len)
          who += std::string(who.empty() ? "" : ", ") + (op.send ? "sending to rank " : "receiving from rank ") +
                 std::to_string(op.peer);
      throw CommError("no progress for " + std::to_string(timeout.count()) + " s while " + who +
                      "; is that rank alive and calling the same collective? (SMARTCOLL_TIMEOUT raises the limit)");
    }
    // Channels still being connected have nothing to poll on: look again soon.
    int wait_ms = unconnected ? 1 : 100;
    if (until != Clock::time_point::max())
      wait_ms = static_cast<int>(std::clamp<int64_t>(
          std::chrono::ceil<std::chrono::milliseconds>(until - now).count(), 0, wait_ms));
    if (::poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR)
      throw CommError("poll failed: " + std::string(std::strerror(errno)));
  }
}

std::vector<Transport::Op> exchange_ops(Transport& t, const void* mine, void* all, size_t bytes) {
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
  return ops;
}

void exchange(Transport& t, const void* mine, void* all, size_t bytes) {
  std::vector<Transport::Op> ops = exchange_ops(t, mine, all, bytes);
  t.run(ops);
}

}  // namespace smartcoll
