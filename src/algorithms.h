// Collective algorithms over a Transport. Each runs on the engine thread, in the same order on every rank.
// docs/algorithms.md gives each one's steps and bytes on the wire.
#pragma once

#include <cstddef>

#include "smartcoll/codec.h"
#include "smartcoll/types.h"
#include "transport.h"

namespace smartcoll::algo {

struct Params {
  size_t segment_bytes;          // pipeline unit of ring and chain algorithms
  const Codec* codec = nullptr;  // ring collectives on float32 sum/avg: wire representation (null: raw)
  bool codec_owner = false;      // allreduce, reduce_scatter: encode each contribution once (owner_reduce)
};

// Pointers may alias (in == out) wherever the collective's Python form allows in-place use.
void allreduce_ring(Transport& t, const char* in, char* out, size_t count, DataType dt, ReduceOp op, const Params& p);
void allreduce_rhd(Transport& t, const char* in, char* out, size_t count, DataType dt, ReduceOp op);
void reduce_scatter_ring(Transport& t, const char* in, char* out, size_t recvcount, DataType dt, ReduceOp op,
                         const Params& p);
void allgather_ring(Transport& t, const char* in, char* out, size_t sendcount, DataType dt, const Params& p);
void broadcast_chain(Transport& t, char* buf, size_t count, DataType dt, int root, const Params& p);
void broadcast_tree(Transport& t, char* buf, size_t count, DataType dt, int root);
void reduce_chain(Transport& t, const char* in, char* out, size_t count, DataType dt, ReduceOp op, int root,
                  const Params& p);
void alltoall_direct(Transport& t, const char* in, char* out, size_t count_per_rank, DataType dt);

}  // namespace smartcoll::algo
