// The list forms of the collectives and alltoallv (docs/vectored.md). A list call checks its lists, lays them out
// as segmented views (coll/segmented.h) and runs the ordinary algorithms on the views through submit(): one call,
// one descriptor, one pipeline, every buffer read and written in place.
#include <algorithm>
#include <cstring>
#include <optional>

#include "coll/algorithms.h"
#include "coll/segmented.h"
#include "coll/table.h"
#include "core/checks.h"
#include "core/config.h"
#include "core/engine.h"
#include "kernels/copy.h"
#include "smartcoll/comm.h"

namespace smartcoll {

namespace {

using Pieces = std::vector<std::pair<const void*, size_t>>;  // (address, bytes), in view order

// What every rank must agree on besides the total count: the list's counts (FNV-1a, never 0).
uint32_t layout_digest(Collective coll, std::span<const size_t> counts) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 0x100000001b3ull;
  };
  mix(static_cast<uint64_t>(coll));
  mix(counts.size());
  for (size_t c : counts) mix(c);
  return static_cast<uint32_t>(h ^ (h >> 32)) | 1u;
}

size_t check_list(Collective coll, std::span<const void* const> bufs, std::span<const size_t> counts,
                  const char* what) {
  const std::string_view name = collective_name(coll);
  require(bufs.size() == counts.size(), [&] {
    return std::string(name) + ": " + std::to_string(bufs.size()) + " " + what + " buffers but " +
           std::to_string(counts.size()) + " counts; pass one count per buffer";
  });
  size_t total = 0;
  for (size_t i = 0; i < bufs.size(); ++i) {
    require(bufs[i] || counts[i] == 0, [&] {
      return std::string(name) + ": " + what + " buffer " + std::to_string(i) + " is null but has " +
             std::to_string(counts[i]) + " elements";
    });
    total += counts[i];
  }
  return total;
}

std::span<const void* const> as_const(std::span<void* const> s) {
  return {const_cast<const void* const*>(s.data()), s.size()};
}

// The list as one vector: entry i after entry i-1.
Pieces concat(std::span<const void* const> bufs, std::span<const size_t> counts, size_t esize) {
  Pieces p;
  p.reserve(bufs.size());
  for (size_t i = 0; i < bufs.size(); ++i) p.emplace_back(bufs[i], counts[i] * esize);
  return p;
}

// Lists of size blocks each (reduce_scatter's inputs, allgather's outputs) as the one vector the collective takes:
// rank j's block is block j of every entry, in list order.
Pieces by_rank(std::span<const void* const> bufs, std::span<const size_t> counts, size_t esize, int size) {
  Pieces p;
  p.reserve(bufs.size() * static_cast<size_t>(size));
  for (int j = 0; j < size; ++j)
    for (size_t i = 0; i < bufs.size(); ++i)
      p.emplace_back(static_cast<const char*>(bufs[i]) + static_cast<size_t>(j) * counts[i] * esize,
                     counts[i] * esize);
  return p;
}

std::unique_ptr<coll::Segmented> view(const Pieces& pieces) {
  std::vector<coll::Piece> v;
  v.reserve(pieces.size());
  for (const auto& [at, bytes] : pieces) v.push_back({static_cast<char*>(const_cast<void*>(at)), bytes});
  return std::make_unique<coll::Segmented>(std::move(v));
}

// The codec of a list call: as for one buffer, but only where every step of the ring reaches the list through a
// segment's staging (coll/segmented.h): codec_mode hop. The codec knob does not apply in owner mode.
Codec list_codec(Collective coll, const Codec& chosen, bool requested, bool owner) {
  if (chosen.kind() == CodecKind::identity || !owner) return chosen;
  require(!requested, std::string(collective_name(coll)) + ": a list call takes a codec in codec_mode hop only "
                                                           "(this communicator has codec_mode=owner)");
  return Codec();
}

// Staging (the list_stage_bytes knob). Each piece of a list costs every path a fixed amount of work (an iovec, a
// reduction call, a page pinned by each process_vm_readv that reads it), which for an entry of a few hundred
// bytes costs more than copying it twice at memory speed. So every run of two or more consecutive pieces of fewer
// than `small` bytes each is copied into one staging piece before the call, and the results back after it.
struct Run {
  size_t first, count;  // pieces [first, first + count)
  size_t at, bytes;     // where they lie in the staging buffer
};

std::vector<Run> small_runs(const Pieces& p, size_t small, size_t& staged) {
  std::vector<Run> runs;
  for (size_t i = 0; i < p.size();) {
    size_t j = i, bytes = 0, filled = 0;  // empty entries join a run but do not make one: they cost no piece
    for (; j < p.size() && p[j].second < small; ++j) bytes += p[j].second, filled += p[j].second > 0;
    if (filled >= 2) runs.push_back({i, j - i, staged, bytes}), staged += bytes;
    i = j > i ? j : i + 1;
  }
  return runs;
}

// The pieces with each run replaced by its staging piece.
Pieces restaged(const Pieces& p, std::span<const Run> runs, const char* base) {
  Pieces out;
  size_t i = 0;
  for (const Run& r : runs) {
    out.insert(out.end(), p.begin() + static_cast<ptrdiff_t>(i), p.begin() + static_cast<ptrdiff_t>(r.first));
    out.emplace_back(base + r.at, r.bytes);
    i = r.first + r.count;
  }
  out.insert(out.end(), p.begin() + static_cast<ptrdiff_t>(i), p.end());
  return out;
}

// Copies each run between its pieces and its place in the staging buffer (gather: pieces to staging).
void copy_runs(const Pieces& p, std::span<const Run> runs, char* base, bool gather) {
  for (const Run& r : runs) {
    auto piece = [&](size_t k) {
      const auto& [at, bytes] = p[r.first + k];
      return std::pair<char*, size_t>{static_cast<char*>(const_cast<void*>(at)), bytes};
    };
    gather ? kernels::gather(base + r.at, r.count, piece, r.bytes)
           : kernels::scatter(base + r.at, r.count, piece, r.bytes);
  }
}

// Blocks that a call cannot run with: an output block overlapping an input block or another output block
// (inputs may share memory: they are only read). Both lists are walked once, sorted by address; the answer names
// the lowest-addressed such pair ("input 1 overlaps output 0", "outputs 0 and 2 overlap"), empty if none.
std::string overlapping_blocks(const Pieces& ins, const Pieces& outs, std::span<const size_t> in_names = {}) {
  struct Range {
    uintptr_t begin, end;
    size_t index;
    bool output;
  };
  std::vector<Range> all;
  for (const auto* list : {&ins, &outs})
    for (size_t i = 0; i < list->size(); ++i)
      if (const auto& [at, bytes] = (*list)[i]; bytes)
        all.push_back({reinterpret_cast<uintptr_t>(at), reinterpret_cast<uintptr_t>(at) + bytes,
                       list == &ins && !in_names.empty() ? in_names[i] : i, list == &outs});
  std::sort(all.begin(), all.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  // The range reaching furthest so far of each kind: one that starts before its end overlaps it.
  std::optional<Range> reach[2];
  for (const Range& r : all) {
    if (const auto& out = reach[1]; out && r.begin < out->end)
      return r.output ? "outputs " + std::to_string(std::min(out->index, r.index)) + " and " +
                            std::to_string(std::max(out->index, r.index)) + " overlap"
                      : "input " + std::to_string(r.index) + " overlaps output " + std::to_string(out->index);
    if (const auto& in = reach[0]; r.output && in && r.begin < in->end)
      return "input " + std::to_string(in->index) + " overlaps output " + std::to_string(r.index);
    if (auto& mine = reach[r.output]; !mine || r.end > mine->end) mine = r;
  }
  return "";
}


// The entries of a list call that it cannot run with (InvalidArgument naming them): in place (allreduce,
// broadcast), two entries that share memory; else an output sharing memory with an input or another output. In
// place, an output may be this rank's block of its own input (reduce_scatter: the rings read that block only to
// reduce it into itself), and an input this rank's block of its own output (allgather).
void check_list_memory(Collective coll, std::span<const void* const> ins, std::span<void* const> outs,
                       std::span<const size_t> counts, size_t esize, int size, int rank) {
  const size_t n = static_cast<size_t>(size), mine = static_cast<size_t>(rank);
  Pieces in, out;
  std::vector<size_t> names;  // of the pieces of `in`: their entries
  for (size_t i = 0; i < outs.size(); ++i) {
    const size_t bytes = counts[i] * esize;
    const auto* o = static_cast<const char*>(outs[i]);
    out.emplace_back(o, coll == Collective::allgather ? n * bytes : bytes);
    if (ins.empty()) continue;
    const auto* x = static_cast<const char*>(ins[i]);
    if (coll == Collective::allgather) {
      if (x != o + mine * bytes) in.emplace_back(x, bytes), names.push_back(i);
    } else if (o == x + mine * bytes) {  // reduce_scatter in place: the input around the output
      in.emplace_back(x, mine * bytes), names.push_back(i);
      in.emplace_back(o + bytes, (n - mine - 1) * bytes), names.push_back(i);
    } else {
      in.emplace_back(x, n * bytes), names.push_back(i);
    }
  }
  if (const std::string clash = overlapping_blocks(in, out, names); !clash.empty())
    throw InvalidArgument(std::string(collective_name(coll)) + ": the list's " +
                          (ins.empty() ? "entries " + clash.substr(clash.find(' ') + 1) : clash) +
                          " in memory; every " + (ins.empty() ? "entry" : "output") +
                          " needs memory of its own" + (ins.empty() ? "" : ", apart from the inputs"));
}
}  // namespace

std::shared_ptr<Request> Communicator::submit_list(Call call, const Pieces& in, const Pieces& out) {
  check_usable();
  if (call.algo == Algorithm::switch_)
    throw InvalidArgument(std::string(collective_name(call.coll)) + ": list calls do not take the aggregation "
                          "switch; algo 'switch' takes one buffer");
  Algorithm requested = call.algo;
  if (requested == Algorithm::automatic && call.coll == Collective::allreduce) {
    requested = parse_algorithm(config_->algo, call.coll);
    if (requested == Algorithm::switch_) requested = Algorithm::automatic;
  }
  // The same-host path reads a list's pieces where they are (transport/cma.h): auto picks it as for one buffer
  // of the same bytes.
  coll::Query q = query(call.count * dtype_size(call.dt), call.codec.kind() != CodecKind::identity);
  q.switch_set = false;
  call.algo = size_ == 1 ? Algorithm::local
                         : coll::choose(call.coll, q, requested, config_->rhd_max_bytes, config_->profile.get());
  auto views = std::make_shared<coll::Views>();
  if (size_ == 1 || call.count == 0) {
    views->all.push_back(view(out));
    if (!in.empty()) coll::copy_view(*views->all.front(), *view(in));
    return submit(call, nullptr, nullptr);
  }
  // In place (in empty), out's runs are both gathered and scattered back; else in's are gathered, out's scattered.
  size_t staged = 0;
  // The daemon is handed the pieces as they are: a threshold of 0 stages nothing.
  const size_t small = nicd_ ? 0 : config_->list_stage_bytes;
  const std::vector<Run> in_runs = in.empty() ? std::vector<Run>{} : small_runs(in, small, staged);
  const std::vector<Run> out_runs = small_runs(out, small, staged);
  if (staged == 0) {
    views->all.push_back(view(out));
    if (!in.empty()) views->all.push_back(view(in));
  } else {
    char* base = views->staging.emplace(engine_->pool(), staged).data();
    copy_runs(in.empty() ? out : in, in.empty() ? out_runs : in_runs, base, true);
    views->all.push_back(view(restaged(out, out_runs, base)));
    if (!in.empty()) views->all.push_back(view(restaged(in, in_runs, base)));
    if (!out_runs.empty()) views->after = [out, out_runs, base] { copy_runs(out, out_runs, base, false); };
  }
  const coll::Segmented &out_view = *views->all.front(), &in_view = *views->all.back();
  auto req = submit(call, in_view.base(), out_view.base(), std::move(views));
  staged_bytes_.fetch_add(staged, std::memory_order_relaxed);
  return req;
}

std::shared_ptr<Request> Communicator::allreduce(std::span<void* const> bufs, std::span<const size_t> counts,
                                                 DataType dt, ReduceOp op, Algorithm algo,
                                                 std::optional<Codec> codec) {
  check_op(dt, op);
  const size_t total = check_list(Collective::allreduce, as_const(bufs), counts, "list");
  check_list_memory(Collective::allreduce, {}, bufs, counts, dtype_size(dt), size_, rank_);
  const Codec wire = list_codec(Collective::allreduce, choose_codec(Collective::allreduce, dt, op, codec),
                                codec.has_value(), config_->codec_owner);
  return submit_list({Collective::allreduce, dt, op, algo, -1, total, wire,
                      layout_digest(Collective::allreduce, counts)},
                     {}, concat(as_const(bufs), counts, dtype_size(dt)));
}

std::shared_ptr<Request> Communicator::broadcast(std::span<void* const> bufs, std::span<const size_t> counts,
                                                 DataType dt, int root, Algorithm algo) {
  check_root(root, size_);
  const size_t total = check_list(Collective::broadcast, as_const(bufs), counts, "list");
  check_list_memory(Collective::broadcast, {}, bufs, counts, dtype_size(dt), size_, rank_);
  return submit_list({Collective::broadcast, dt, ReduceOp::sum, algo, root, total, {},
                      layout_digest(Collective::broadcast, counts)},
                     {}, concat(as_const(bufs), counts, dtype_size(dt)));
}

std::shared_ptr<Request> Communicator::reduce_scatter(std::span<const void* const> ins, std::span<void* const> outs,
                                                      std::span<const size_t> counts, DataType dt, ReduceOp op,
                                                      Algorithm algo, std::optional<Codec> codec) {
  check_op(dt, op);
  check_list(Collective::reduce_scatter, ins, counts, "input");
  const size_t total = check_list(Collective::reduce_scatter, as_const(outs), counts, "output");
  const size_t esize = dtype_size(dt);
  check_list_memory(Collective::reduce_scatter, ins, outs, counts, esize, size_, rank_);
  const Codec wire = list_codec(Collective::reduce_scatter, choose_codec(Collective::reduce_scatter, dt, op, codec),
                                codec.has_value(), config_->codec_owner);
  return submit_list({Collective::reduce_scatter, dt, op, algo, -1, total, wire,
                      layout_digest(Collective::reduce_scatter, counts)},
                     by_rank(ins, counts, esize, size_), concat(as_const(outs), counts, esize));
}

std::shared_ptr<Request> Communicator::allgather(std::span<const void* const> ins, std::span<void* const> outs,
                                                 std::span<const size_t> counts, DataType dt, Algorithm algo) {
  check_list(Collective::allgather, ins, counts, "input");
  const size_t total = check_list(Collective::allgather, as_const(outs), counts, "output");
  const size_t esize = dtype_size(dt);
  check_list_memory(Collective::allgather, ins, outs, counts, esize, size_, rank_);
  return submit_list({Collective::allgather, dt, ReduceOp::sum, algo, -1, total, {},
                      layout_digest(Collective::allgather, counts)},
                     concat(ins, counts, esize), by_rank(as_const(outs), counts, esize, size_));
}

namespace {

// The checks both forms of alltoallv make of their counts (one per rank each; what a rank sends itself is what
// it expects from itself).
void check_alltoallv_counts(std::initializer_list<std::pair<const char*, std::span<const size_t>>> lists, size_t n,
                            size_t me, std::span<const size_t> sendcounts, std::span<const size_t> recvcounts) {
  for (const auto& [what, s] : lists)
    require(s.size() == n, std::string("alltoallv: ") + what + " has " + std::to_string(s.size()) +
                               " entries; it needs one per rank (" + std::to_string(n) + ")");
  require(sendcounts[me] == recvcounts[me],
          "alltoallv: this rank sends itself " + std::to_string(sendcounts[me]) + " elements but expects " +
              std::to_string(recvcounts[me]) + " (sendcounts[rank] must equal recvcounts[rank])");
}

std::vector<size_t> packed(std::span<const size_t> counts) {
  std::vector<size_t> displs(counts.size());
  for (size_t j = 1; j < counts.size(); ++j) displs[j] = displs[j - 1] + counts[j - 1];
  return displs;
}

}  // namespace

std::shared_ptr<Request> Communicator::alltoallv(std::span<const void* const> ins, std::span<const size_t> sendcounts,
                                                 std::span<void* const> outs, std::span<const size_t> recvcounts,
                                                 DataType dt) {
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_), esize = dtype_size(dt);
  require(ins.size() == n && outs.size() == n,
          "alltoallv: " + std::to_string(ins.size()) + " input and " + std::to_string(outs.size()) +
              " output buffers; the list form takes one of each per rank (" + std::to_string(n) + ")");
  check_alltoallv_counts({{"sendcounts", sendcounts}, {"recvcounts", recvcounts}}, n, me, sendcounts, recvcounts);
  check_list(Collective::alltoallv, ins, sendcounts, "input");
  check_list(Collective::alltoallv, as_const(outs), recvcounts, "output");
  const Pieces in = concat(ins, sendcounts, esize), out = concat(as_const(outs), recvcounts, esize);
  if (const std::string clash = overlapping_blocks(in, out); !clash.empty())
    throw InvalidArgument("alltoallv: " + clash + "; every output needs memory of its own, apart from the inputs");
  const std::vector<size_t> sdispls = packed(sendcounts), rdispls = packed(recvcounts);
  const coll::Displacements displs{sendcounts, sdispls, recvcounts, rdispls};
  // count: the world size, as for one buffer (the counts are checked pair by pair as the blocks arrive).
  return submit_list({Collective::alltoallv, dt, ReduceOp::sum, Algorithm::automatic, -1, n, {}, 0, &displs}, in,
                     out);
}

std::shared_ptr<Request> Communicator::alltoallv(const void* in, std::span<const size_t> sendcounts,
                                                 std::span<const size_t> sdispls, void* out,
                                                 std::span<const size_t> recvcounts, std::span<const size_t> rdispls,
                                                 DataType dt) {
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_);
  check_alltoallv_counts({{"sendcounts", sendcounts}, {"sdispls", sdispls}, {"recvcounts", recvcounts},
                          {"rdispls", rdispls}}, n, me, sendcounts, recvcounts);
  size_t moved = 0;
  for (size_t j = 0; j < n; ++j) moved += sendcounts[j] + recvcounts[j];
  require(moved == 0 || (in && out), "alltoallv: a null buffer with elements to move");
  require(!moved || in != out, "alltoallv cannot run in place: pass a separate output buffer");
  if (moved) {  // blocks by rank, as the list form sees them
    const size_t esize = dtype_size(dt);
    Pieces in_blocks, out_blocks;
    for (size_t j = 0; j < n; ++j) {
      in_blocks.emplace_back(static_cast<const char*>(in) + sdispls[j] * esize, sendcounts[j] * esize);
      out_blocks.emplace_back(static_cast<const char*>(out) + rdispls[j] * esize, recvcounts[j] * esize);
    }
    if (const std::string clash = overlapping_blocks(in_blocks, out_blocks); !clash.empty())
      throw InvalidArgument("alltoallv: " + clash + " (the blocks by rank of in and out, from the counts and "
                            "displacements); every receive block needs memory of its own, apart from the send blocks");
  }
  check_usable();
  if (size_ == 1) {
    const size_t esize = dtype_size(dt);
    if (sendcounts[0])
      std::memmove(static_cast<char*>(out) + rdispls[0] * esize, static_cast<const char*>(in) + sdispls[0] * esize,
                   sendcounts[0] * esize);
    return submit({Collective::alltoallv, dt, ReduceOp::sum, Algorithm::local, -1, 0, {}}, nullptr, nullptr);
  }
  const coll::Displacements displs{sendcounts, sdispls, recvcounts, rdispls};
  const Algorithm chosen = choose(Collective::alltoallv, 0, dt);
  // count: the world size, the same on every rank (the counts themselves are checked pair by pair).
  return submit({Collective::alltoallv, dt, ReduceOp::sum, chosen, -1, n, {}, 0, &displs}, in, out);
}

}  // namespace smartcoll
