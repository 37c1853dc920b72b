// Recursive halving (reduce-scatter) then recursive doubling (allgather) among the largest power of two p <= n
// ranks: 2 log2(p) steps, each rank sends about 2x the vector. The first 2(n-p) ranks pair up first: each even
// one hands its vector to the odd one and gets the result back at the end.
#include <vector>

#include "coll/algorithms.h"

namespace smartcoll::coll {

namespace {

// The fold of a non-power-of-two world; returns this rank's index among the p participants (-1: sits out), the
// op after which `start` holds this rank's starting vector, and `start`: `out`, or with `in_place` false the
// input itself where nothing folds into it (recursive doubling reads it there; halving-doubling works on halves
// of `out`, which must hold the input first).
struct Fold {
  int vr, p, extra;
  int32_t ready;
  const char* start;
};

Fold fold_in(Builder& b, const Args& a, bool in_place) {
  const int n = b.cx.size, r = b.cx.rank;
  const size_t esize = dtype_size(b.spec.dtype), bytes = a.count * esize;
  char* out = a.out;
  int32_t ready = out == a.in || !in_place ? -1 : b.copy(0, out, a.in, bytes);
  const char* start = in_place ? out : a.in;
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int extra = n - p;
  if (r < 2 * extra && r % 2 == 0)  // fold_out's receive overwrites `out` once this send has left it
    return {-1, p, extra, b.send(0, r + 1, start, bytes, {ready}), start};
  if (r < 2 * extra) {  // the partner's operand goes on the left: it has the lower rank
    ready = b.recv(0, r - 1, b.scratch(bytes), bytes, {ready}, kReduceFromLeft, out, start, a.count);
    start = out;
  }
  return {r < 2 * extra ? r / 2 : r - extra, p, extra, ready, start};
}

void fold_out(Builder& b, const Args& a, const Fold& f, int32_t last) {
  const int r = b.cx.rank;
  const size_t bytes = a.count * dtype_size(b.spec.dtype);
  if (r >= 2 * f.extra) return;
  if (r % 2 == 0)
    b.recv(0, r + 1, a.out, bytes, {f.ready});
  else
    b.send(0, r - 1, a.out, bytes, {last});
}

int real_rank(const Fold& f, int v) { return v < f.extra ? 2 * v + 1 : v + f.extra; }

}  // namespace

void allreduce_rhd(Builder& b, const Args& a) {
  const size_t esize = dtype_size(b.spec.dtype);
  const Fold f = fold_in(b, a, true);
  int32_t last = f.ready;
  if (f.vr >= 0) {
    struct Half {
      size_t lo, mid, hi;
      bool lower;
    };
    std::vector<Half> halves;
    size_t lo = 0, hi = a.count;
    for (int d = f.p / 2; d >= 1; d /= 2) {
      const Half h{lo, lo + (hi - lo) / 2, hi, (f.vr & d) == 0};
      halves.push_back(h);
      const size_t keep_lo = h.lower ? h.lo : h.mid, keep_hi = h.lower ? h.mid : h.hi;
      const size_t give_lo = h.lower ? h.mid : h.lo, give_hi = h.lower ? h.hi : h.mid;
      const int peer = real_rank(f, f.vr ^ d);
      // Send and receive at once: the received half is reduced into the half this rank keeps, which the send does
      // not read. (Waiting for the send first deadlocks both partners once a half outgrows the socket buffers.)
      b.send(0, peer, a.out + give_lo * esize, (give_hi - give_lo) * esize, {last});
      char* mine = a.out + keep_lo * esize;
      // The lower partner's operand always goes on the left: a fixed order gives the same bits run to run.
      const bool divide = d == 1 && b.spec.op == ReduceOp::avg;
      last = b.recv(0, peer, b.scratch((keep_hi - keep_lo) * esize), (keep_hi - keep_lo) * esize, {last},
                    h.lower ? kReduce : kReduceFromLeft, mine, mine, keep_hi - keep_lo, divide);
      lo = keep_lo;
      hi = keep_hi;
    }
    for (int d = 1; d < f.p; d *= 2) {
      const Half& h = halves.back();
      const size_t other_lo = h.lower ? h.mid : h.lo, other_hi = h.lower ? h.hi : h.mid;
      const int peer = real_rank(f, f.vr ^ d);
      // The other half lands where this rank's halving send at this level read from: the peer sends it only
      // after receiving all of that send, so the buffer is free.
      b.send(0, peer, a.out + lo * esize, (hi - lo) * esize, {last});
      last = b.recv(0, peer, a.out + other_lo * esize, (other_hi - other_lo) * esize, {last});
      lo = h.lo;
      hi = h.hi;
      halves.pop_back();
    }
  }
  fold_out(b, a, f, last);
}

void allreduce_rd(Builder& b, const Args& a) {
  // Recursive doubling: log2(p) steps, each exchanging the whole vector with partner vr ^ d and reducing with
  // the lower partner's operand on the left; every rank computes the same sums in the same order.
  const size_t bytes = a.count * dtype_size(b.spec.dtype);
  const Fold f = fold_in(b, a, false);
  int32_t last = f.ready;
  if (f.vr >= 0) {
    // Each step sends the running sum and reduces the partner's with it into a fresh buffer, so that no receive
    // waits for a send (two partners that both wait for their sends to leave deadlock once the vector outgrows
    // the socket buffers). Only the first send can read `out` (later ones read those buffers): unless it does,
    // the last sum lands in `out` directly, else it is copied there once that send has left.
    const char* sum = f.start;
    int32_t first_send = -1;
    for (int d = 1; d < f.p; d *= 2) {
      const int peer = real_rank(f, f.vr ^ d);
      const bool lower = (f.vr & d) == 0, final = d * 2 >= f.p, divide = final && b.spec.op == ReduceOp::avg;
      const int32_t sent = b.send(0, peer, sum, bytes, {last});
      if (first_send < 0) first_send = sent;
      char* next = final && f.start != a.out ? a.out : b.scratch(bytes);
      last = b.recv(0, peer, b.scratch(bytes), bytes, {last}, lower ? kReduce : kReduceFromLeft, next, sum, a.count,
                    divide);
      sum = next;
    }
    if (sum != a.out) last = b.copy(0, a.out, sum, bytes, {last, first_send});
  }
  fold_out(b, a, f, last);
}

}  // namespace smartcoll::coll
