// Element-wise reduction kernels, written once over an ISA policy (isa.h) and run at the active SIMD level.
//
// Every level must produce the same bits, since ranks of one job may run on different CPUs and a ring all-reduce
// mixes their partial results. The rules that make that hold are spelled out next to combine() below; the scalar
// policy and the SIMD ones evaluate the very same expressions, lane by lane.
#include "smartcoll/reduce.h"

#include <iterator>
#include <string>

#include "kernels/combine.h"
#include "kernels/elems.h"

namespace smartcoll {
namespace kernels {
namespace {

// Whole steps at the policy's width; the rest through the scalar policy, which gives the same bits.
template <DataType D, ReduceOp Op>
struct Binary {
  template <class Isa>
  SMARTCOLL_INLINE static void run(void* dv, const void* av, const void* bv, size_t n) {
    using E = Elems<Isa, D>;
    auto* d = static_cast<typename E::T*>(dv);
    const auto* a = static_cast<const typename E::T*>(av);
    const auto* b = static_cast<const typename E::T*>(bv);
    size_t i = 0;
    for (; i + E::N <= n; i += E::N) E::store(d + i, combine<Isa, Op>(E::load(a + i), E::load(b + i)));
    if constexpr (E::N > 1) {
      if (i < n) run<Scalar>(d + i, a + i, b + i, n - i);
    }
  }
};

template <DataType D>
struct Scale {
  template <class Isa>
  SMARTCOLL_INLINE static void run(void* xv, size_t n, double divisor) {
    using E = Elems<Isa, D>;
    using V = typename E::V;
    auto* x = static_cast<typename E::T*>(xv);
    const V dv = broadcast<V>(static_cast<lane_t<V>>(divisor));
    size_t i = 0;
    for (; i + E::N <= n; i += E::N) {
      const V v = E::load(x + i);
      E::store(x + i, nan_or(v, v / dv));
    }
    if constexpr (E::N > 1) {
      if (i < n) run<Scalar>(x + i, n - i, divisor);
    }
  }
};

// Calls fn.template operator()<Op>() with avg folded into sum (avg divides once at the end, via scale_divide).
template <class Fn>
void with_op(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return fn.template operator()<ReduceOp::sum>();
    case ReduceOp::prod: return fn.template operator()<ReduceOp::prod>();
    case ReduceOp::min: return fn.template operator()<ReduceOp::min>();
    case ReduceOp::max: return fn.template operator()<ReduceOp::max>();
  }
  throw InvalidArgument("reduce: unknown reduce op " + std::to_string(static_cast<int>(op)));
}

template <class Fn>
void with_dtype(DataType dtype, Fn&& fn) {
  switch (dtype) {
    case DataType::f32: return fn.template operator()<DataType::f32>();
    case DataType::f64: return fn.template operator()<DataType::f64>();
    case DataType::f16: return fn.template operator()<DataType::f16>();
    case DataType::bf16: return fn.template operator()<DataType::bf16>();
    case DataType::i8: return fn.template operator()<DataType::i8>();
    case DataType::u8: return fn.template operator()<DataType::u8>();
    case DataType::i32: return fn.template operator()<DataType::i32>();
    case DataType::i64: return fn.template operator()<DataType::i64>();
  }
  throw InvalidArgument("reduce: unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

}  // namespace
}  // namespace kernels

void reduce(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b, size_t count) {
  if (count == 0) return;
  kernels::with_op(op, [&]<ReduceOp Op>() {
    kernels::with_dtype(dtype, [&]<DataType D>() { kernels::run_active<kernels::Binary<D, Op>>(dst, a, b, count); });
  });
}

void scale_divide(DataType dtype, void* x, size_t count, double divisor) {
  if (static_cast<size_t>(dtype) >= std::size(kAllDataTypes)) {
    throw InvalidArgument("scale_divide: unknown dtype " + std::to_string(static_cast<int>(dtype)));
  }
  if (!is_floating(dtype)) {
    throw InvalidArgument("scale_divide: dtype " + std::string(dtype_name(dtype)) +
                          " is not a floating type; avg is only defined for floating types");
  }
  if (count == 0) return;
  kernels::with_dtype(dtype, [&]<DataType D>() {
    if constexpr (!std::is_integral_v<kernels::lane_t<typename kernels::Elems<kernels::Scalar, D>::V>>) {
      kernels::run_active<kernels::Scale<D>>(x, count, divisor);
    }
  });
}

float half_to_float(uint16_t h) { return kernels::h2f(h); }
uint16_t float_to_half(float f) { return kernels::f2h(f); }
float bf16_to_float(uint16_t h) { return kernels::b2f(h); }
uint16_t float_to_bf16(float f) { return kernels::f2b(f); }

}  // namespace smartcoll
