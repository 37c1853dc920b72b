// The algorithms, one per file, each a function that builds a call's schedule (coll/schedule.h). They are
// listed with what they support and what they cost in coll/table.h, which is what selects among them.
#pragma once

#include <span>

#include "coll/schedule.h"

namespace smartcoll::coll {

// A call's buffers. Pointers may alias (in == out) wherever the collective allows in-place use.
// alltoallv's per-rank blocks, in elements.
struct Displacements {
  std::span<const size_t> sendcounts, sdispls, recvcounts, rdispls;
};

struct Args {
  const char* in;
  char* out;
  size_t count;  // elements, as the collective takes them (per rank for reduce_scatter, allgather, alltoall)
  int root;
  const Displacements* displs = nullptr;  // alltoallv
};

void allreduce_ring(Builder& b, const Args& a);
// Several ranks per host: reduce-scatter per host, allreduce across hosts, allgather per host (Context::hosts).
void allreduce_hier(Builder& b, const Args& a);
// How many pieces allreduce_hier cuts a vector of `bytes` into (each goes through its three steps; the cost
// model overlaps the host's copies of all but the first and the last).
int allreduce_hier_pieces(size_t bytes);
// Owner exchange of the compressed modes: each contribution encoded once (into enc, laid out by ch), sent to its
// chunk's owner, summed there in float32 in rank order into `mine` (and, with share, encoded once into enc and
// decoded back so that every rank ends with the same values). All on stream 0.
struct OwnerSteps {
  int32_t summed, sent;
};
OwnerSteps owner_reduce(Builder& b, const Chunks& ch, const char* in, uint8_t* enc, float* mine, bool share);
void allreduce_rhd(Builder& b, const Args& a);
void allreduce_rd(Builder& b, const Args& a);
// Every collective among ranks of one host, by single-copy reads (transport/cma.h), or for small calls with the
// data through the shared control segment (same_host_shm).
void same_host_cma(Builder& b, const Args& a);
void same_host_shm(Builder& b, const Args& a);
void allreduce_switch(Builder& b, const Args& a);
// Several ranks per host: reduce-scatter on each host, chunk i through the switches among the i-th ranks of every
// host, allgather on each host. A host's link carries the vector once each way, whatever its ranks.
void allreduce_switch_hier(Builder& b, const Args& a);
// Through the switches too: each rank gets its own block's sums; each rank's block is forwarded to the others.
void reduce_scatter_switch(Builder& b, const Args& a);
void allgather_switch(Builder& b, const Args& a);
void reduce_scatter_ring(Builder& b, const Args& a);
// Several ranks per host: rings on each host and across hosts, so that a host's link carries k(H-1) blocks.
void reduce_scatter_hier(Builder& b, const Args& a);
void allgather_ring(Builder& b, const Args& a);
void allgather_hier(Builder& b, const Args& a);
void allgather_bruck(Builder& b, const Args& a);
void broadcast_chain(Builder& b, const Args& a);
void broadcast_tree(Builder& b, const Args& a);
// Several ranks per host: a chain across hosts, then a chain on each host, segment by segment.
void broadcast_hier(Builder& b, const Args& a);
void reduce_chain(Builder& b, const Args& a);
void reduce_tree(Builder& b, const Args& a);
// Several ranks per host: a chain on each host, then a chain across hosts, segment by segment.
void reduce_hier(Builder& b, const Args& a);
void alltoall_direct(Builder& b, const Args& a);
void alltoall_bruck(Builder& b, const Args& a);
// n-1 rounds, one peer each way per round: no incast at a receiver.
void alltoall_pairwise(Builder& b, const Args& a);
// Every pair at once, each block preceded by its count, which the receiver checks against its own.
void alltoallv_direct(Builder& b, const Args& a);
void barrier_dissemination(Builder& b, const Args& a);

}  // namespace smartcoll::coll
