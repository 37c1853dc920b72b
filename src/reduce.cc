// Element-wise reduction kernels: a portable scalar path plus AVX2 and AVX-512 paths picked at run time.
//
// The build passes no -march flag, so the SIMD code is compiled per function with __attribute__((target)) and only
// entered after __builtin_cpu_supports says the CPU (and OS) can run it. Every path must produce the same bits, since
// ranks of one job may run on different CPUs and a ring all-reduce mixes their partial results; the rules that make
// that hold are spelled out next to the scalar combine() below, and each SIMD path implements them literally.
#include "smartcoll/reduce.h"

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <string>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#define SMARTCOLL_X86 1
// GCC 12's AVX-512 intrinsics self-initialise an "undefined" operand (__Y = __Y), which -Wmaybe-uninitialized
// reports wherever they are inlined (GCC PR105593). Silence it for the header's own lines only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#define SMARTCOLL_X86 0
#endif

namespace smartcoll {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Scalar conversions. float16 must match F16C's vcvtps2ph/vcvtph2ps bit for bit, because the SIMD paths use those
// instructions and the scalar path (and SIMD tails) use these.

inline float h2f(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    // vcvtph2ps quiets a signalling NaN and keeps the payload.
    bits = sign | 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0u);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    // A half denormal is a normal float: move its leading one to the implicit bit position.
    const int top = 31 - std::countl_zero(mant);  // 0..9
    bits = sign | (static_cast<uint32_t>(top + 103) << 23) | ((mant << (23 - top)) & 0x7fffffu);
  }
  return std::bit_cast<float>(bits);
}

inline uint16_t f2h(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) {
    // vcvtps2ph keeps the top payload bits and sets the quiet bit.
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (abs >= 0x38800000u) {
    // Normal half: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest-even; a carry out of
    // the mantissa correctly bumps the exponent.
    uint32_t h = (abs - 0x38000000u) >> 13;
    const uint32_t rest = abs & 0x1fffu;
    h += (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ? 1u : 0u;
    return static_cast<uint16_t>(sign | h);
  }
  const uint32_t exp = abs >> 23;
  if (exp < 102) return sign;  // below 2^-25: rounds to zero (includes float denormals)
  // Half denormal: value = mant * 2^(exp-150), counted in units of 2^-24 it is mant >> (126 - exp).
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exp;  // 14..24
  uint32_t h = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  h += (rest > half || (rest == half && (h & 1u))) ? 1u : 0u;
  return static_cast<uint16_t>(sign | h);
}

inline float b2f(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

inline uint16_t f2b(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------------------------------------------------------
// Scalar combine, in the float (or double) domain. These are the reference semantics for every SIMD path:
//  * sum/prod: plain IEEE arithmetic, except that when x is NaN the result is quiet(x). x86 returns the first NaN
//    operand, but the compiler may commute an add or multiply, so with two NaNs the payload would depend on
//    register allocation; forcing x's payload makes it deterministic.
//  * min/max: x if x is NaN, else the comparison picks (so a NaN in y propagates because the comparison is false).
inline float quiet(float x) { return std::bit_cast<float>(std::bit_cast<uint32_t>(x) | 0x00400000u); }
inline double quiet(double x) { return std::bit_cast<double>(std::bit_cast<uint64_t>(x) | 0x0008000000000000ull); }

template <ReduceOp Op, class F>
inline F combine(F x, F y) {
  if constexpr (Op == ReduceOp::sum) {
    const F r = x + y;
    return std::isnan(x) ? quiet(x) : r;
  } else if constexpr (Op == ReduceOp::prod) {
    const F r = x * y;
    return std::isnan(x) ? quiet(x) : r;
  } else if constexpr (Op == ReduceOp::min) {
    return (std::isnan(x) || x < y) ? x : y;
  } else {
    return (std::isnan(x) || x > y) ? x : y;
  }
}

template <class F>
inline F divide(F x, F d) {
  const F r = x / d;
  return std::isnan(x) ? quiet(x) : r;
}

// Storage type <-> arithmetic type for the floating dtypes.
struct ScalarF32 {
  using T = float;
  using F = float;
  static F load(T v) { return v; }
  static T store(F v) { return v; }
};
struct ScalarF64 {
  using T = double;
  using F = double;
  static F load(T v) { return v; }
  static T store(F v) { return v; }
};
struct ScalarF16 {
  using T = uint16_t;
  using F = float;
  static F load(T v) { return h2f(v); }
  static T store(F v) { return f2h(v); }
};
struct ScalarBF16 {
  using T = uint16_t;
  using F = float;
  static F load(T v) { return b2f(v); }
  static T store(F v) { return f2b(v); }
};

template <class C, ReduceOp Op>
void scalar_float(void* dv, const void* av, const void* bv, size_t n) {
  using T = typename C::T;
  auto* d = static_cast<T*>(dv);
  const auto* a = static_cast<const T*>(av);
  const auto* b = static_cast<const T*>(bv);
  for (size_t i = 0; i < n; ++i) d[i] = C::store(combine<Op>(C::load(a[i]), C::load(b[i])));
}

template <class C>
void scalar_scale(void* xv, size_t n, typename C::F divisor) {
  auto* x = static_cast<typename C::T*>(xv);
  for (size_t i = 0; i < n; ++i) x[i] = C::store(divide(C::load(x[i]), divisor));
}

// Integer arithmetic goes through the unsigned type so that overflow wraps instead of being undefined.
template <class T, ReduceOp Op>
void scalar_int(void* dv, const void* av, const void* bv, size_t n) {
  using U = std::make_unsigned_t<T>;
  auto* d = static_cast<T*>(dv);
  const auto* a = static_cast<const T*>(av);
  const auto* b = static_cast<const T*>(bv);
  for (size_t i = 0; i < n; ++i) {
    const T x = a[i];
    const T y = b[i];
    if constexpr (Op == ReduceOp::sum) {
      d[i] = static_cast<T>(static_cast<U>(static_cast<U>(x) + static_cast<U>(y)));
    } else if constexpr (Op == ReduceOp::prod) {
      d[i] = static_cast<T>(static_cast<U>(static_cast<U>(x) * static_cast<U>(y)));
    } else if constexpr (Op == ReduceOp::min) {
      d[i] = x < y ? x : y;
    } else {
      d[i] = x > y ? x : y;
    }
  }
}

// Calls fn.template operator()<Op>() with avg folded into sum (avg divides once at the end, via scale_divide).
template <class Fn>
void with_op(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: fn.template operator()<ReduceOp::sum>(); return;
    case ReduceOp::prod: fn.template operator()<ReduceOp::prod>(); return;
    case ReduceOp::min: fn.template operator()<ReduceOp::min>(); return;
    case ReduceOp::max: fn.template operator()<ReduceOp::max>(); return;
  }
  throw InvalidArgument("reduce: unknown reduce op " + std::to_string(static_cast<int>(op)));
}

void reduce_scalar(DataType dtype, ReduceOp op, void* d, const void* a, const void* b, size_t n) {
  with_op(op, [&]<ReduceOp Op>() {
    switch (dtype) {
      case DataType::f32: return scalar_float<ScalarF32, Op>(d, a, b, n);
      case DataType::f64: return scalar_float<ScalarF64, Op>(d, a, b, n);
      case DataType::f16: return scalar_float<ScalarF16, Op>(d, a, b, n);
      case DataType::bf16: return scalar_float<ScalarBF16, Op>(d, a, b, n);
      case DataType::i8: return scalar_int<int8_t, Op>(d, a, b, n);
      case DataType::u8: return scalar_int<uint8_t, Op>(d, a, b, n);
      case DataType::i32: return scalar_int<int32_t, Op>(d, a, b, n);
      case DataType::i64: return scalar_int<int64_t, Op>(d, a, b, n);
    }
    throw InvalidArgument("reduce: unknown dtype " + std::to_string(static_cast<int>(dtype)));
  });
}

#if SMARTCOLL_X86

#define SMARTCOLL_AVX2 __attribute__((target("avx2,f16c")))
#define SMARTCOLL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c")))

// ---------------------------------------------------------------------------------------------------------------
// AVX2 (+F16C). 8 lanes per step; the remainder goes through the scalar code, which gives the same bits.
namespace avx2 {

SMARTCOLL_AVX2 inline __m256 quiet_where_nan(__m256 x, __m256 r) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 qx = _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)));
  return _mm256_blendv_ps(r, qx, nan);
}
SMARTCOLL_AVX2 inline __m256d quiet_where_nan(__m256d x, __m256d r) {
  const __m256d nan = _mm256_cmp_pd(x, x, _CMP_UNORD_Q);
  const __m256d qx = _mm256_or_pd(x, _mm256_castsi256_pd(_mm256_set1_epi64x(0x0008000000000000ll)));
  return _mm256_blendv_pd(r, qx, nan);
}

template <ReduceOp Op>
SMARTCOLL_AVX2 inline __m256 combine(__m256 x, __m256 y) {
  if constexpr (Op == ReduceOp::sum) {
    return quiet_where_nan(x, _mm256_add_ps(x, y));
  } else if constexpr (Op == ReduceOp::prod) {
    return quiet_where_nan(x, _mm256_mul_ps(x, y));
  } else {
    constexpr int pred = Op == ReduceOp::min ? _CMP_LT_OQ : _CMP_GT_OQ;
    const __m256 take_x = _mm256_or_ps(_mm256_cmp_ps(x, y, pred), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_ps(y, x, take_x);
  }
}

template <ReduceOp Op>
SMARTCOLL_AVX2 inline __m256d combine(__m256d x, __m256d y) {
  if constexpr (Op == ReduceOp::sum) {
    return quiet_where_nan(x, _mm256_add_pd(x, y));
  } else if constexpr (Op == ReduceOp::prod) {
    return quiet_where_nan(x, _mm256_mul_pd(x, y));
  } else {
    constexpr int pred = Op == ReduceOp::min ? _CMP_LT_OQ : _CMP_GT_OQ;
    const __m256d take_x = _mm256_or_pd(_mm256_cmp_pd(x, y, pred), _mm256_cmp_pd(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_pd(y, x, take_x);
  }
}

template <ReduceOp Op>
SMARTCOLL_AVX2 inline __m256i combine(__m256i x, __m256i y) {
  if constexpr (Op == ReduceOp::sum) return _mm256_add_epi32(x, y);
  else if constexpr (Op == ReduceOp::prod) return _mm256_mullo_epi32(x, y);
  else if constexpr (Op == ReduceOp::min) return _mm256_min_epi32(x, y);
  else return _mm256_max_epi32(x, y);
}

SMARTCOLL_AVX2 inline __m256 divide(__m256 x, __m256 d) { return quiet_where_nan(x, _mm256_div_ps(x, d)); }
SMARTCOLL_AVX2 inline __m256d divide(__m256d x, __m256d d) { return quiet_where_nan(x, _mm256_div_pd(x, d)); }

struct F32 {
  using T = float;
  using V = __m256;
  using Scalar = ScalarF32;
  static constexpr size_t N = 8;
  SMARTCOLL_AVX2 static V load(const T* p) { return _mm256_loadu_ps(p); }
  SMARTCOLL_AVX2 static void store(T* p, V v) { _mm256_storeu_ps(p, v); }
  SMARTCOLL_AVX2 static V splat(float s) { return _mm256_set1_ps(s); }
};
struct F64 {
  using T = double;
  using V = __m256d;
  using Scalar = ScalarF64;
  static constexpr size_t N = 4;
  SMARTCOLL_AVX2 static V load(const T* p) { return _mm256_loadu_pd(p); }
  SMARTCOLL_AVX2 static void store(T* p, V v) { _mm256_storeu_pd(p, v); }
  SMARTCOLL_AVX2 static V splat(double s) { return _mm256_set1_pd(s); }
};
struct F16 {
  using T = uint16_t;
  using V = __m256;
  using Scalar = ScalarF16;
  static constexpr size_t N = 8;
  SMARTCOLL_AVX2 static V load(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  SMARTCOLL_AVX2 static void store(T* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  SMARTCOLL_AVX2 static V splat(float s) { return _mm256_set1_ps(s); }
};
struct BF16 {
  using T = uint16_t;
  using V = __m256;
  using Scalar = ScalarBF16;
  static constexpr size_t N = 8;
  SMARTCOLL_AVX2 static V load(const T* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  // Same rounding as f2b(), lane-wise; no AVX512_BF16 needed (and vcvtneps2bf16 flushes denormals anyway).
  SMARTCOLL_AVX2 static void store(T* p, V v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan_val = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i out = _mm256_blendv_epi8(rounded, nan_val, nan);
    // Every lane is <= 0xffff, so the unsigned-saturating pack is a plain narrowing.
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  SMARTCOLL_AVX2 static V splat(float s) { return _mm256_set1_ps(s); }
};
struct I32 {
  using T = int32_t;
  using V = __m256i;
  static constexpr size_t N = 8;
  SMARTCOLL_AVX2 static V load(const T* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  SMARTCOLL_AVX2 static void store(T* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
};

template <class C, ReduceOp Op>
SMARTCOLL_AVX2 void binary(typename C::T* d, const typename C::T* a, const typename C::T* b, size_t n) {
  size_t i = 0;
  for (; i + C::N <= n; i += C::N) C::store(d + i, combine<Op>(C::load(a + i), C::load(b + i)));
  if (i == n) return;
  if constexpr (std::is_same_v<C, I32>) {
    scalar_int<int32_t, Op>(d + i, a + i, b + i, n - i);
  } else {
    scalar_float<typename C::Scalar, Op>(d + i, a + i, b + i, n - i);
  }
}

template <class C>
SMARTCOLL_AVX2 void scale(typename C::T* x, size_t n, typename C::Scalar::F divisor) {
  const typename C::V dv = C::splat(divisor);
  size_t i = 0;
  for (; i + C::N <= n; i += C::N) C::store(x + i, divide(C::load(x + i), dv));
  scalar_scale<typename C::Scalar>(x + i, n - i, divisor);
}

}  // namespace avx2

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 (F, BW, VL). 16 lanes per step (8 for f64); the tail uses masked loads and stores, which do not fault on
// the masked-off lanes.
namespace avx512 {

SMARTCOLL_AVX512 inline __m512 quiet_where_nan(__m512 x, __m512 r) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_or_epi32(_mm512_castps_si512(r), nan, _mm512_castps_si512(x),
                                                  _mm512_set1_epi32(0x00400000)));
}
SMARTCOLL_AVX512 inline __m512d quiet_where_nan(__m512d x, __m512d r) {
  const __mmask8 nan = _mm512_cmp_pd_mask(x, x, _CMP_UNORD_Q);
  return _mm512_castsi512_pd(_mm512_mask_or_epi64(_mm512_castpd_si512(r), nan, _mm512_castpd_si512(x),
                                                  _mm512_set1_epi64(0x0008000000000000ll)));
}

template <ReduceOp Op>
SMARTCOLL_AVX512 inline __m512 combine(__m512 x, __m512 y) {
  if constexpr (Op == ReduceOp::sum) {
    return quiet_where_nan(x, _mm512_add_ps(x, y));
  } else if constexpr (Op == ReduceOp::prod) {
    return quiet_where_nan(x, _mm512_mul_ps(x, y));
  } else {
    constexpr int pred = Op == ReduceOp::min ? _CMP_LT_OQ : _CMP_GT_OQ;
    const __mmask16 take_x = _mm512_cmp_ps_mask(x, y, pred) | _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(take_x, y, x);
  }
}

template <ReduceOp Op>
SMARTCOLL_AVX512 inline __m512d combine(__m512d x, __m512d y) {
  if constexpr (Op == ReduceOp::sum) {
    return quiet_where_nan(x, _mm512_add_pd(x, y));
  } else if constexpr (Op == ReduceOp::prod) {
    return quiet_where_nan(x, _mm512_mul_pd(x, y));
  } else {
    constexpr int pred = Op == ReduceOp::min ? _CMP_LT_OQ : _CMP_GT_OQ;
    const __mmask8 take_x = _mm512_cmp_pd_mask(x, y, pred) | _mm512_cmp_pd_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_blend_pd(take_x, y, x);
  }
}

template <ReduceOp Op>
SMARTCOLL_AVX512 inline __m512i combine(__m512i x, __m512i y) {
  if constexpr (Op == ReduceOp::sum) return _mm512_add_epi32(x, y);
  else if constexpr (Op == ReduceOp::prod) return _mm512_mullo_epi32(x, y);
  else if constexpr (Op == ReduceOp::min) return _mm512_min_epi32(x, y);
  else return _mm512_max_epi32(x, y);
}

SMARTCOLL_AVX512 inline __m512 divide(__m512 x, __m512 d) { return quiet_where_nan(x, _mm512_div_ps(x, d)); }
SMARTCOLL_AVX512 inline __m512d divide(__m512d x, __m512d d) { return quiet_where_nan(x, _mm512_div_pd(x, d)); }

struct F32 {
  using T = float;
  using V = __m512;
  using M = __mmask16;
  using Scalar = ScalarF32;
  static constexpr size_t N = 16;
  SMARTCOLL_AVX512 static V load(const T* p) { return _mm512_loadu_ps(p); }
  SMARTCOLL_AVX512 static V load(const T* p, M k) { return _mm512_maskz_loadu_ps(k, p); }
  SMARTCOLL_AVX512 static void store(T* p, V v) { _mm512_storeu_ps(p, v); }
  SMARTCOLL_AVX512 static void store(T* p, V v, M k) { _mm512_mask_storeu_ps(p, k, v); }
  SMARTCOLL_AVX512 static V splat(float s) { return _mm512_set1_ps(s); }
};
struct F64 {
  using T = double;
  using V = __m512d;
  using M = __mmask8;
  using Scalar = ScalarF64;
  static constexpr size_t N = 8;
  SMARTCOLL_AVX512 static V load(const T* p) { return _mm512_loadu_pd(p); }
  SMARTCOLL_AVX512 static V load(const T* p, M k) { return _mm512_maskz_loadu_pd(k, p); }
  SMARTCOLL_AVX512 static void store(T* p, V v) { _mm512_storeu_pd(p, v); }
  SMARTCOLL_AVX512 static void store(T* p, V v, M k) { _mm512_mask_storeu_pd(p, k, v); }
  SMARTCOLL_AVX512 static V splat(double s) { return _mm512_set1_pd(s); }
};
struct F16 {
  using T = uint16_t;
  using V = __m512;
  using M = __mmask16;
  using Scalar = ScalarF16;
  static constexpr size_t N = 16;
  SMARTCOLL_AVX512 static V load(const T* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  SMARTCOLL_AVX512 static V load(const T* p, M k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }
  SMARTCOLL_AVX512 static void store(T* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  SMARTCOLL_AVX512 static void store(T* p, V v, M k) {
    _mm256_mask_storeu_epi16(p, k, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  SMARTCOLL_AVX512 static V splat(float s) { return _mm512_set1_ps(s); }
};
struct BF16 {
  using T = uint16_t;
  using V = __m512;
  using M = __mmask16;
  using Scalar = ScalarBF16;
  static constexpr size_t N = 16;
  SMARTCOLL_AVX512 static V widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  SMARTCOLL_AVX512 static V load(const T* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  SMARTCOLL_AVX512 static V load(const T* p, M k) { return widen(_mm256_maskz_loadu_epi16(k, p)); }
  // Same rounding as f2b(), lane-wise, as 32-bit lanes; the caller narrows them to 16 bits.
  SMARTCOLL_AVX512 static __m512i round(V v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40));
  }
  SMARTCOLL_AVX512 static void store(T* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round(v)));
  }
  SMARTCOLL_AVX512 static void store(T* p, V v, M k) { _mm512_mask_cvtepi32_storeu_epi16(p, k, round(v)); }
  SMARTCOLL_AVX512 static V splat(float s) { return _mm512_set1_ps(s); }
};
struct I32 {
  using T = int32_t;
  using V = __m512i;
  using M = __mmask16;
  static constexpr size_t N = 16;
  SMARTCOLL_AVX512 static V load(const T* p) { return _mm512_loadu_si512(p); }
  SMARTCOLL_AVX512 static V load(const T* p, M k) { return _mm512_maskz_loadu_epi32(k, p); }
  SMARTCOLL_AVX512 static void store(T* p, V v) { _mm512_storeu_si512(p, v); }
  SMARTCOLL_AVX512 static void store(T* p, V v, M k) { _mm512_mask_storeu_epi32(p, k, v); }
};

template <class C>
inline typename C::M tail_mask(size_t left) {
  return static_cast<typename C::M>((1u << left) - 1u);
}

template <class C, ReduceOp Op>
SMARTCOLL_AVX512 void binary(typename C::T* d, const typename C::T* a, const typename C::T* b, size_t n) {
  size_t i = 0;
  for (; i + C::N <= n; i += C::N) C::store(d + i, combine<Op>(C::load(a + i), C::load(b + i)));
  if (i == n) return;
  const auto k = tail_mask<C>(n - i);
  C::store(d + i, combine<Op>(C::load(a + i, k), C::load(b + i, k)), k);
}

template <class C>
SMARTCOLL_AVX512 void scale(typename C::T* x, size_t n, typename C::Scalar::F divisor) {
  const typename C::V dv = C::splat(divisor);
  size_t i = 0;
  for (; i + C::N <= n; i += C::N) C::store(x + i, divide(C::load(x + i), dv));
  if (i == n) return;
  const auto k = tail_mask<C>(n - i);
  C::store(x + i, divide(C::load(x + i, k), dv), k);
}

}  // namespace avx512

// Runs the level's kernel for dtypes it vectorizes; returns false for the others (the caller goes scalar).
template <class L>
bool reduce_simd(DataType dtype, ReduceOp op, void* d, const void* a, const void* b, size_t n) {
  bool done = true;
  with_op(op, [&]<ReduceOp Op>() {
    switch (dtype) {
      case DataType::f32:
        return L::template binary<typename L::F32, Op>(static_cast<float*>(d), static_cast<const float*>(a),
                                                       static_cast<const float*>(b), n);
      case DataType::f64:
        return L::template binary<typename L::F64, Op>(static_cast<double*>(d), static_cast<const double*>(a),
                                                       static_cast<const double*>(b), n);
      case DataType::f16:
        return L::template binary<typename L::F16, Op>(static_cast<uint16_t*>(d), static_cast<const uint16_t*>(a),
                                                       static_cast<const uint16_t*>(b), n);
      case DataType::bf16:
        return L::template binary<typename L::BF16, Op>(
            static_cast<uint16_t*>(d), static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), n);
      case DataType::i32:
        return L::template binary<typename L::I32, Op>(static_cast<int32_t*>(d), static_cast<const int32_t*>(a),
                                                       static_cast<const int32_t*>(b), n);
      default: done = false; return;
    }
  });
  return done;
}

template <class L>
void scale_simd(DataType dtype, void* x, size_t n, double divisor) {
  const auto f = static_cast<float>(divisor);
  switch (dtype) {
    case DataType::f32: return L::template scale<typename L::F32>(static_cast<float*>(x), n, f);
    case DataType::f64: return L::template scale<typename L::F64>(static_cast<double*>(x), n, divisor);
    case DataType::f16: return L::template scale<typename L::F16>(static_cast<uint16_t*>(x), n, f);
    case DataType::bf16: return L::template scale<typename L::BF16>(static_cast<uint16_t*>(x), n, f);
    default: return;
  }
}

// Adapters so reduce_simd/scale_simd can name a level's kernels as L::binary / L::scale.
struct Avx2Level {
  using F32 = avx2::F32;
  using F64 = avx2::F64;
  using F16 = avx2::F16;
  using BF16 = avx2::BF16;
  using I32 = avx2::I32;
  template <class C, ReduceOp Op, class T>
  static void binary(T* d, const T* a, const T* b, size_t n) { avx2::binary<C, Op>(d, a, b, n); }
  template <class C, class T, class F>
  static void scale(T* x, size_t n, F divisor) { avx2::scale<C>(x, n, divisor); }
};
struct Avx512Level {
  using F32 = avx512::F32;
  using F64 = avx512::F64;
  using F16 = avx512::F16;
  using BF16 = avx512::BF16;
  using I32 = avx512::I32;
  template <class C, ReduceOp Op, class T>
  static void binary(T* d, const T* a, const T* b, size_t n) { avx512::binary<C, Op>(d, a, b, n); }
  template <class C, class T, class F>
  static void scale(T* x, size_t n, F divisor) { avx512::scale<C>(x, n, divisor); }
};

#endif  // SMARTCOLL_X86

SimdLevel detect_simd() {
#if SMARTCOLL_X86
  // May run from another translation unit's static initializer, before libgcc's own constructor has filled in the
  // CPU model; __builtin_cpu_init is idempotent.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
    return SimdLevel::avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return SimdLevel::avx2;
#endif
  return SimdLevel::scalar;
}

// Function-local so that the first use from any static initializer still sees it initialised.
std::atomic<SimdLevel>& active_level() {
  static std::atomic<SimdLevel> level{simd_supported()};
  return level;
}

}  // namespace

void reduce(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b, size_t count) {
  if (count == 0) return;
#if SMARTCOLL_X86
  switch (active_level().load(std::memory_order_relaxed)) {
    case SimdLevel::avx512:
      if (reduce_simd<Avx512Level>(dtype, op, dst, a, b, count)) return;
      break;
    case SimdLevel::avx2:
      if (reduce_simd<Avx2Level>(dtype, op, dst, a, b, count)) return;
      break;
    case SimdLevel::scalar: break;
  }
#endif
  reduce_scalar(dtype, op, dst, a, b, count);
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
  const auto f = static_cast<float>(divisor);
#if SMARTCOLL_X86
  switch (active_level().load(std::memory_order_relaxed)) {
    case SimdLevel::avx512: return scale_simd<Avx512Level>(dtype, x, count, divisor);
    case SimdLevel::avx2: return scale_simd<Avx2Level>(dtype, x, count, divisor);
    case SimdLevel::scalar: break;
  }
#endif
  switch (dtype) {
    case DataType::f32: return scalar_scale<ScalarF32>(x, count, f);
    case DataType::f64: return scalar_scale<ScalarF64>(x, count, divisor);
    case DataType::f16: return scalar_scale<ScalarF16>(x, count, f);
    case DataType::bf16: return scalar_scale<ScalarBF16>(x, count, f);
    default: return;
  }
}

SimdLevel simd_supported() {
  static const SimdLevel level = detect_simd();
  return level;
}

SimdLevel simd_active() { return active_level().load(std::memory_order_relaxed); }

void simd_force(SimdLevel level) {
  const SimdLevel best = simd_supported();
  active_level().store(static_cast<int>(level) > static_cast<int>(best) ? best : level, std::memory_order_relaxed);
}

std::string_view simd_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::scalar: return "scalar";
    case SimdLevel::avx2: return "avx2";
    case SimdLevel::avx512: return "avx512";
  }
  return "unknown";
}

float half_to_float(uint16_t h) { return h2f(h); }
uint16_t float_to_half(float f) { return f2h(f); }
float bf16_to_float(uint16_t h) { return b2f(h); }
uint16_t float_to_bf16(float f) { return f2b(f); }

}  // namespace smartcoll
