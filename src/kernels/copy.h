// Gather and scatter of many pieces by one core: COPA's inline gather (pieces -> one contiguous buffer) and
// lookaside scatter (the reverse), as the one-sided server runs them (a getv's pieces into its answer, a putv's
// message into the pieces, the codec paths' packing, list calls' runs of tiny entries into one staging piece
// and back) and `smartcoll bench gather|scatter` measures them. Every other piece of a list collective is
// copied by nothing but the kernel: it goes to sendmsg/recvmsg as an iovec.
//
// A loop of memcpy calls loses to one memcpy of the same bytes for two reasons this file removes:
// - Reads of pieces at scattered addresses: the hardware prefetchers follow streams, not lists, so each piece
//   starts with a cache miss. The pieces kPrefetchBytes ahead of the copy are prefetched in software, so that
//   several misses are in flight at once.
// - Writes that allocate: a plain store of a line that is not cached first reads it (a read for ownership). Copies
//   of more bytes than the cache holds use streaming stores, which write whole lines without reading them, as
//   memcpy does for large copies. Smaller copies keep plain stores: their destination is read again soon (sent,
//   reduced) and should stay in the cache.
// Measured per piece size and placement in BENCHMARKS.md ("gather and scatter kernels").
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>

namespace smartcoll::kernels {

// How far ahead of the copy the sources of later pieces are prefetched: enough misses in flight to cover the
// memory latency (4-8 KiB measured best between 32 B and 4 KiB pieces; fewer bytes stall, more evict).
inline constexpr size_t kPrefetchBytes = 6 * 1024;

// Copies of at least this many bytes in all use streaming stores: more than a core's share of the last-level
// cache on current servers (2-4 MiB). Not read from sysconf: its L3 size is per package, or in a virtual machine
// the host's sum over every chip (384 MiB on a 2-core guest here).
inline constexpr size_t kStreamBytes = size_t{8} << 20;

// n bytes from s to d with streaming stores (plain stores for the unaligned head and the tail). Call
// stream_fence() after the last one, before anyone else may read d.
void copy_streaming(char* d, const char* s, size_t n);
void stream_fence();

// Prefetches the pieces ahead of a copy: piece(i) -> {address, bytes} for i in [0, n). Positions count bytes of
// the pieces one after the other.
template <class PieceAt>
class PrefetchAhead {
 public:
  PrefetchAhead(PieceAt piece, size_t n, bool write) : piece_(piece), n_(n), write_(write) {}
  // The copy is about to move the next `bytes`: prefetch up to kPrefetchBytes past them. Bytes the copy has
  // reached before they were prefetched (a piece longer than the window) are skipped, never prefetched late.
  void advance(size_t bytes) {
    copied_ += bytes;
    while (i_ < n_ && issued_ < copied_ + kPrefetchBytes) {
      const auto [p, len] = piece_(i_);
      if (off_ < len) {  // len > 0: p is an address
        const size_t step = std::min<size_t>(64, len - off_);
        if (issued_ >= copied_) write_ ? __builtin_prefetch(p + off_, 1, 3) : __builtin_prefetch(p + off_, 0, 3);
        else if (const size_t behind = std::min(copied_ - issued_, len - off_); behind > step) {
          off_ += behind, issued_ += behind;  // jump over the copied part of a long piece at once
          continue;
        }
        off_ += step, issued_ += step;
      }
      if (off_ >= len) ++i_, off_ = 0;
    }
  }

 private:
  PieceAt piece_;
  size_t n_, i_ = 0, off_ = 0, issued_ = 0, copied_ = 0;
  bool write_;
};

// dst = the n pieces one after the other; piece(i) -> {const char*, bytes}; total = their bytes.
template <class PieceAt>
void gather(char* dst, size_t n, PieceAt piece, size_t total) {
  const bool stream = total >= kStreamBytes;
  PrefetchAhead<PieceAt> ahead(piece, n, false);
  for (size_t i = 0; i < n; ++i) {
    const auto [src, len] = piece(i);
    ahead.advance(len);
    if (len == 0) continue;  // an empty piece may have no address
    stream ? copy_streaming(dst, src, len) : static_cast<void>(__builtin_memcpy(dst, src, len));
    dst += len;
  }
  if (stream) stream_fence();
}

// The n pieces = src's bytes one after the other; piece(i) -> {char*, bytes}; total = their bytes.
template <class PieceAt>
void scatter(const char* src, size_t n, PieceAt piece, size_t total) {
  const bool stream = total >= kStreamBytes;
  PrefetchAhead<PieceAt> ahead(piece, stream ? 0 : n, true);  // streaming stores need no line in the cache
  for (size_t i = 0; i < n; ++i) {
    const auto [dst, len] = piece(i);
    ahead.advance(len);
    if (len == 0) continue;
    stream ? copy_streaming(dst, src, len) : static_cast<void>(__builtin_memcpy(dst, src, len));
    src += len;
  }
  if (stream) stream_fence();
}

}  // namespace smartcoll::kernels
