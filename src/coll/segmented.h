// Segmented views: a list of buffers that the algorithms address as one vector (docs/vectored.md).
//
// A view reserves an address range as long as the list (PROT_NONE: nothing is ever read or written there) and
// hands its start to an algorithm as if it were a buffer. Once the schedule is built, resolve() rewrites every
// send, receive and copy that points into a view so that it points at the list's own buffers instead (a message
// over several of them gathers or scatters its pieces in one system call), and after_receive applies reductions
// piece by piece. No algorithm knows about lists; none copies them into one buffer (only runs of tiny entries are
// staged, before the call builds its views: core/vectored.cc). An algorithm that touched a
// view from a compute (the switch, the codecs' owner mode) would fault on the reserved range rather than read
// stray memory: list calls never choose those (the ring's codec steps, which address views through gather_range
// and write_range, excepted). The same-host path is handed the views' pieces instead (coll/same_host_cma.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/task.h"

namespace smartcoll::coll {

struct Piece {
  char* data;
  size_t bytes;
};

class Segmented {
 public:
  explicit Segmented(std::vector<Piece> pieces);  // empty pieces are dropped
  ~Segmented();
  Segmented(const Segmented&) = delete;
  Segmented& operator=(const Segmented&) = delete;

  char* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  bool contains(const char* p) const { return p >= base_ && p < base_ + bytes_; }
  // The real address of view address p (contains(p)) and how many bytes of its piece follow it.
  std::pair<char*, size_t> locate(const char* p) const;
  const std::vector<Piece>& pieces() const { return pieces_; }

 private:
  std::vector<Piece> pieces_;
  std::vector<size_t> starts_;  // [i]: offset of piece i in the view
  char* base_ = nullptr;
  size_t bytes_ = 0, reserved_ = 0;
};

// The views of one list call. The task keeps them (ReduceSpec::views) for the codec steps, which address them
// as they run: a codec works on whole blocks that may straddle two buffers of the list, so those steps are
// not split but read and write through a staging of one segment (gather_range, write_range).
struct Views {
  std::vector<std::unique_ptr<Segmented>> all;
  // Where runs of tiny list entries were copied to be moved as one piece (core/vectored.cc, the list_stage_bytes
  // knob), and what copies the results back to the entries once the call has succeeded (Task::epilogue).
  std::optional<Scratch> staging;
  std::function<void()> after;
  const Segmented* find(const char* p) const;
};

// Rewrites the ops of `task` that address `views` (see above): a send or receive becomes one message over the
// pieces it spans (Op::pieces: one system call gathers or scatters them), a copy one copy per piece. Reductions
// stay as they are: after_receive applies them piece by piece (for_each_run), or through a staging (codecs).
void resolve(Task& task, const Views& views);

// fn(a', b', offset, n) over the runs of [a, a + bytes) and [b, b + bytes) that are contiguous in both; a' and b'
// are the real addresses (either range may lie in a view; a null one stays null).
template <class F>
void for_each_run(const Views* views, char* a, const char* b, size_t bytes, F&& fn) {
  const Segmented* va = views && a ? views->find(a) : nullptr;
  const Segmented* vb = views && b ? views->find(b) : nullptr;
  for (size_t off = 0; off < bytes;) {
    size_t n = bytes - off;
    char* ra = a ? a + off : nullptr;
    const char* rb = b ? b + off : nullptr;
    if (va) {
      const auto [at, left] = va->locate(a + off);
      ra = at;
      n = std::min(n, left);
    }
    if (vb) {
      const auto [at, left] = vb->locate(b + off);
      rb = at;
      n = std::min(n, left);
    }
    fn(ra, rb, off, n);
    off += n;
  }
}

// [p, p + bytes) as one readable range: p itself where it is not in a view or lies in one piece, else a copy
// of it in `stage`.
const char* gather_range(const Views* views, const char* p, size_t bytes, std::vector<char>& stage);
// Where to write [p, p + bytes): p itself, or `stage`, whose bytes scatter_range then copies to the pieces.
char* write_range(const Views* views, char* p, size_t bytes, std::vector<char>& stage);
void scatter_range(const Views* views, char* p, const char* from, size_t bytes);

// dst = src piece by piece: views of the same length (the size-1 world's list calls).
void copy_view(const Segmented& dst, const Segmented& src);

// `smartcoll bench gather|scatter`: best seconds of `repeat` runs of the gather or scatter kernel
// (kernels/copy.h) between the pieces (base + offsets[k], sizes[k]) and the contiguous `packed` (gather: pieces ->
// packed; scatter: the reverse), of one memcpy of the same bytes between contiguous buffers, and of reading the
// pieces alone (what their placement costs the memory system: a bound on the gather).
struct CopyTimes {
  double segmented, memcpy, read;
};
CopyTimes time_copy_view(char* base, std::span<const uint64_t> offsets, std::span<const uint64_t> sizes,
                         char* packed, bool gather, int repeat);

}  // namespace smartcoll::coll
