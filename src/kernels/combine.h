// The element-wise combination every reduction applies, written once: reduce()'s kernels and the codecs' fused
// decode-and-add both use it, so that a fused call gives the bits of the unfused steps.
#pragma once

#include <type_traits>

#include "kernels/isa.h"
#include "smartcoll/reduce.h"

namespace smartcoll::kernels {

// x with the quiet bit set where x is NaN, r elsewhere. x86 returns the first NaN operand of an add or multiply,
// but the compiler may commute one, so with two NaNs the payload would depend on register allocation; forcing x's
// payload makes it deterministic.
template <class V>
SMARTCOLL_INLINE V nan_or(const V& x, const V& r) {
  using B = typename LaneTraits<V>::Signed;
  constexpr lane_t<B> quiet_bit = sizeof(lane_t<V>) == 4 ? 0x00400000 : 0x0008000000000000ll;
  return x != x ? lanes_as<V>(lanes_as<B>(x) | quiet_bit) : r;
}

// The reference semantics, for float, double and integer lanes (scalars or vectors):
//  * floating sum/prod: plain IEEE arithmetic (no contraction: the build passes -ffp-contract=off), except that
//    when x is NaN the result is quiet(x).
//  * floating min/max: x if x is NaN, else the comparison picks (so a NaN in y propagates: the comparison is false).
//  * integer sum/prod wrap around: they are done on the unsigned type, where overflow is defined.
template <class Isa, ReduceOp Op, class V>
SMARTCOLL_INLINE V combine(const V& x, const V& y) {
  if constexpr (std::is_integral_v<lane_t<V>>) {
    // C casts: a value conversion for scalars, a reinterpretation for vectors; (U) again after the operation
    // because narrow unsigned scalars are promoted to int.
    using U = unsigned_t<V>;
    if constexpr (Op == ReduceOp::sum) return (V)(U)((U)x + (U)y);
    if constexpr (Op == ReduceOp::prod) return (V)(U)((U)x * (U)y);
    if constexpr (Op == ReduceOp::min) return x < y ? x : y;
    if constexpr (Op == ReduceOp::max) return x > y ? x : y;
  } else {
    if constexpr (Op == ReduceOp::sum) return nan_or(x, x + y);
    if constexpr (Op == ReduceOp::prod) return nan_or(x, x * y);
    if constexpr (Op == ReduceOp::min) return ((x != x) | Isa::less(x, y)) ? x : y;
    if constexpr (Op == ReduceOp::max) return ((x != x) | Isa::less(y, x)) ? x : y;
  }
}

}  // namespace smartcoll::kernels
