// One-sided vectored operations on registered regions (docs/vectored.md, "One-sided operations").
//
// A rank registers any writable contiguous buffer as a region: it gets an id, numbered 1, 2, 3, ... in this
// rank's order of registration, never reused. A peer names it by (rank, id) and reads pieces of it (getv),
// writes pieces into it (putv) or reduces pieces into it (accumulatev), while the owner's application makes no
// call: its one-sided server thread serves the requests as they arrive. Offsets and sizes are in bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "smartcoll/types.h"

namespace smartcoll {

// A region of rank `rank`, as its owner registered it (learned through an exchange, or by convention).
struct RemoteRegion {
  int rank = -1;
  uint64_t id = 0;
  uint64_t bytes = 0;
  DataType dtype = DataType::u8;
};

// bytes at byte offset `offset` of a region.
struct RemotePiece {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// A local buffer of a one-sided call: the remote pieces, in order, fill (or come from) the local buffers taken
// one after the other.
struct LocalPiece {
  void* data = nullptr;
  size_t bytes = 0;
};

}  // namespace smartcoll
