// One-sided vectored operations on registered regions (docs/vectored.md, "One-sided operations").
//
// A rank registers any writable contiguous buffer as a region: it gets an id, numbered 1, 2, 3, ... in this
// rank's order of registration, never reused. A peer names it by (rank, id) and reads pieces of it (getv),
// writes pieces into it (putv) or reduces pieces into it (accumulatev), while the owner's application makes no
// call: its one-sided server thread serves the requests as they arrive. Offsets and sizes are in bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

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

// A region in memory that the communicator allocated (Communicator::allocate_region): shared memory that peers
// of the same host map, so that their getv and putv on it are plain copies in their own process, for pieces of
// any size; elsewhere it is served as any region. `data` (`bytes`, zeroed, page-aligned) stays valid while
// `memory` or a copy of it lives, after deregistration too.
struct AllocatedRegion {
  uint64_t id = 0;
  void* data = nullptr;
  size_t bytes = 0;
  std::shared_ptr<void> memory;
};

}  // namespace smartcoll
