#include "coll/segmented.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "coll/schedule.h"
#include "kernels/copy.h"
#include "smartcoll/types.h"

namespace smartcoll::coll {

Segmented::Segmented(std::vector<Piece> pieces) {
  for (const Piece& p : pieces) {
    if (p.bytes == 0) continue;
    starts_.push_back(bytes_);
    pieces_.push_back(p);
    bytes_ += p.bytes;
  }
  // Reserved, never mapped: addresses no buffer of this process can have, whatever the algorithm adds to them.
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  reserved_ = std::max<size_t>(page, (bytes_ + page - 1) / page * page);
  void* at = ::mmap(nullptr, reserved_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (at == MAP_FAILED)
    throw InvalidArgument("cannot reserve " + std::to_string(reserved_) + " bytes of address space for a list of " +
                          std::to_string(pieces_.size()) + " buffers: " + std::strerror(errno));
  base_ = static_cast<char*>(at);
}

Segmented::~Segmented() { ::munmap(base_, reserved_); }

std::pair<char*, size_t> Segmented::locate(const char* p) const {
  const size_t off = static_cast<size_t>(p - base_);
  const size_t i = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), off) - starts_.begin()) - 1;
  const size_t in = off - starts_[i];
  return {pieces_[i].data + in, pieces_[i].bytes - in};
}

void copy_view(const Segmented& dst, const Segmented& src) {
  // Both lists walked once, in step: every copy is the overlap of the current piece of each.
  const std::vector<Piece>&d = dst.pieces(), &s = src.pieces();
  size_t i = 0, j = 0, di = 0, sj = 0;  // current pieces and the bytes of each already copied
  while (i < d.size() && j < s.size()) {
    const size_t n = std::min(d[i].bytes - di, s[j].bytes - sj);
    std::memmove(d[i].data + di, s[j].data + sj, n);
    if ((di += n) == d[i].bytes) ++i, di = 0;
    if ((sj += n) == s[j].bytes) ++j, sj = 0;
  }
}

namespace {

// The sum of the pieces' 8-byte words, read with the kernels' prefetching: what reading the pieces alone costs.
template <class PieceAt>
uint64_t read_pieces(size_t n, PieceAt piece) {
  kernels::PrefetchAhead<PieceAt> ahead(piece, n, false);
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto [p, len] = piece(i);
    ahead.advance(len);
    for (size_t o = 0; o + 8 <= len; o += 8) {
      uint64_t w;
      std::memcpy(&w, p + o, 8);
      sum += w;
    }
  }
  return sum;
}

}  // namespace

CopyTimes time_copy_view(char* base, std::span<const uint64_t> offsets, std::span<const uint64_t> sizes,
                         char* packed, bool gather, int repeat) {
  size_t total = 0;
  for (const uint64_t s : sizes) total += s;
  const auto piece = [&](size_t k) { return std::pair<char*, size_t>{base + offsets[k], sizes[k]}; };
  std::vector<char> twin(total);  // memcpy's destination: packed stays as the gather left it
  auto best = [repeat](const auto& fn) {
    double best_s = 1e30;
    fn();  // warm-up: page faults and caches
    for (int r = 0; r < repeat; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      best_s = std::min(best_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best_s;
  };
  CopyTimes t;
  t.segmented = best([&] {
    gather ? kernels::gather(packed, offsets.size(), piece, total) : kernels::scatter(packed, offsets.size(), piece, total);
  });
  t.memcpy = best([&] { std::memcpy(twin.data(), packed, total); });
  volatile uint64_t sink = 0;  // keeps the sum, so that the reads are not optimized away
  t.read = best([&] { sink = sink + read_pieces(offsets.size(), piece); });
  return t;
}

const Segmented* Views::find(const char* p) const {
  for (const auto& v : all)
    if (v->contains(p)) return v.get();
  return nullptr;
}

const char* gather_range(const Views* views, const char* p, size_t bytes, std::vector<char>& stage) {
  const Segmented* v = views && p && bytes ? views->find(p) : nullptr;
  if (!v) return p;
  if (const auto [at, left] = v->locate(p); left >= bytes) return at;
  stage.resize(bytes);
  for_each_run(views, stage.data(), p, bytes, [](char* to, const char* from, size_t, size_t n) {
    std::memcpy(to, from, n);
  });
  return stage.data();
}

char* write_range(const Views* views, char* p, size_t bytes, std::vector<char>& stage) {
  const Segmented* v = views && p && bytes ? views->find(p) : nullptr;
  if (!v) return p;
  if (const auto [at, left] = v->locate(p); left >= bytes) return at;
  stage.resize(bytes);
  return stage.data();
}

void scatter_range(const Views* views, char* p, const char* from, size_t bytes) {
  const Segmented* v = views && p && bytes ? views->find(p) : nullptr;
  if (!v || from == v->locate(p).first) return;  // written in place
  for_each_run(views, p, from, bytes, [](char* to, const char* src, size_t, size_t n) { std::memcpy(to, src, n); });
}

void resolve(Task& task, const Views& views) {
  for (Lane& lane : task.lanes) {
    std::vector<Op> ops;
    ops.reserve(lane.ops.size());
    std::vector<int32_t> last(lane.ops.size(), -1);  // old index -> index of its last part
    for (size_t i = 0; i < lane.ops.size(); ++i) {
      Op op = lane.ops[i];
      for (int32_t& d : op.deps)
        if (d >= 0) d = last[static_cast<size_t>(d)];
      const bool moves = op.kind == Op::Kind::send || op.kind == Op::Kind::recv;
      if (op.kind == Op::Kind::copy && (views.find(op.dst) || views.find(op.local))) {
        // One copy per run that is contiguous on both sides, each after the op's dependencies.
        for_each_run(&views, op.dst, op.local, op.len, [&](char* to, const char* from, size_t, size_t n) {
          Op part = op;
          part.dst = to;
          part.local = from;
          part.len = n;
          ops.push_back(part);
        });
        if (op.len == 0) ops.push_back(op);  // the engine copies nothing
      } else if (moves && views.find(op.buf)) {
        if (op.finish != kNone || !views.find(op.buf)->contains(op.buf + (op.len ? op.len - 1 : 0)))
          throw InvalidArgument(task.name() + ": an algorithm receives into a list call's buffers and reduces there, "
                                "or runs past their end: list calls cannot use it");
        std::vector<iovec> pieces;
        for_each_run(&views, op.buf, nullptr, op.len, [&](char* at, const char*, size_t, size_t n) {
          pieces.push_back({at, n});
        });
        op.buf = pieces.empty() ? nullptr : static_cast<char*>(pieces.front().iov_base);
        if (pieces.size() > 1) {
          task.piece_lists.push_back(std::move(pieces));
          op.pieces = task.piece_lists.back().data();
          op.npieces = static_cast<uint32_t>(task.piece_lists.back().size());
          op.buf = nullptr;
        }
        ops.push_back(op);
      } else {
        ops.push_back(op);
      }
      last[i] = static_cast<int32_t>(ops.size() - 1);
    }
    lane.ops = std::move(ops);
  }
}

}  // namespace smartcoll::coll
