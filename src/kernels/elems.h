// How each dtype's elements sit in an ISA policy's registers (isa.h), for kernels that load and store arrays of
// them: reductions, and the fp16/bf16 codecs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/half.h"
#include "kernels/isa.h"
#include "smartcoll/types.h"

namespace smartcoll::kernels {

// A dtype's elements in an Isa's registers: storage type T, arithmetic lanes V (float for float16 and bfloat16,
// which are rounded back once per store), N elements per step. Dtypes with no vector form use one scalar lane at
// every level.
template <class T_, class V_>
struct Plain {
  using T = T_;
  using V = V_;
  static constexpr size_t N = sizeof(V) / sizeof(T);
  SMARTCOLL_INLINE static V load(const T* p) { return kernels::load<V>(p); }
  SMARTCOLL_INLINE static void store(T* p, const V& v) { kernels::store(p, v); }
};

template <class Isa, DataType D>
struct Elems;
template <class Isa>
struct Elems<Isa, DataType::f32> : Plain<float, typename Isa::F> {};
template <class Isa>
struct Elems<Isa, DataType::f64> : Plain<double, typename Isa::D> {};
template <class Isa>
struct Elems<Isa, DataType::i32> : Plain<int32_t, typename Isa::I> {};
template <class Isa>
struct Elems<Isa, DataType::i64> : Plain<int64_t, int64_t> {};
template <class Isa>
struct Elems<Isa, DataType::i8> : Plain<int8_t, int8_t> {};
template <class Isa>
struct Elems<Isa, DataType::u8> : Plain<uint8_t, uint8_t> {};
template <class Isa>
struct Elems<Isa, DataType::f16> {
  using T = uint16_t;
  using V = typename Isa::F;
  static constexpr size_t N = Isa::W;
  SMARTCOLL_INLINE static V load(const T* p) { return Isa::load_f16(p); }
  SMARTCOLL_INLINE static void store(T* p, const V& v) { Isa::store_f16(p, v); }
};
template <class Isa>
struct Elems<Isa, DataType::bf16> {
  using T = uint16_t;
  using V = typename Isa::F;
  static constexpr size_t N = Isa::W;
  SMARTCOLL_INLINE static V load(const T* p) { return lanes_as<V>(Isa::load_u16(p) << 16); }
  SMARTCOLL_INLINE static void store(T* p, const V& v) { Isa::store_u16(p, bf16_bits(lanes_as<typename Isa::U>(v))); }
};

// dst[i] = src[i] converted from dtype From to dtype To (the same arithmetic lanes: f32, f16 and bf16), whole steps at
// the policy's width and the rest through the scalar policy.
template <DataType From, DataType To>
struct Convert {
  template <class Isa>
  SMARTCOLL_INLINE static void run(void* dv, const void* sv, size_t n) {
    using S = Elems<Isa, From>;
    using D = Elems<Isa, To>;
    static_assert(S::N == D::N);
    auto* d = static_cast<typename D::T*>(dv);
    const auto* s = static_cast<const typename S::T*>(sv);
    size_t i = 0;
    for (; i + S::N <= n; i += S::N) D::store(d + i, S::load(s + i));
    if constexpr (S::N > 1) {
      if (i < n) run<Scalar>(d + i, s + i, n - i);
    }
  }
};

}  // namespace smartcoll::kernels
