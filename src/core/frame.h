// The iovecs of the next system call of a message: the call's header, then the op's bytes, which are one buffer
// or a list of pieces (Op::pieces, the buffers of a list call).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>

#include "core/task.h"

namespace smartcoll {

// iovecs per system call of an op in pieces
inline constexpr int kMaxIov = 64;

// Where the last system call of an op in pieces stopped: the piece and the body bytes before it, so that a message
// of many pieces is walked once, not from its start at every partial send.
struct PieceCursor {
  uint32_t piece = 0;
  size_t before = 0;
};

// The rest of a message after `done` of its bytes: the call's header (hlen bytes at `header`), then the op's; at
// most kMaxIov + 1 iovecs. `at` moves forward with `done` (reset it for the next op).
inline int frame(iovec* iov, const Descriptor* header, size_t hlen, const Op& op, size_t done, PieceCursor& at) {
  int n = 0;
  if (done < hlen) iov[n++] = {const_cast<char*>(reinterpret_cast<const char*>(header)) + done, hlen - done};
  const size_t body = done > hlen ? done - hlen : 0;
  if (!op.pieces) {
    if (op.len > body) iov[n++] = {op.buf + body, op.len - body};
    return n;
  }
  while (at.piece < op.npieces && body >= at.before + op.pieces[at.piece].iov_len)
    at.before += op.pieces[at.piece++].iov_len;
  for (uint32_t k = at.piece; k < op.npieces && n < kMaxIov; ++k) {
    const size_t skip = k == at.piece ? body - at.before : 0;
    iov[n++] = {static_cast<char*>(op.pieces[k].iov_base) + skip, op.pieces[k].iov_len - skip};
  }
  return n;
}

}  // namespace smartcoll
