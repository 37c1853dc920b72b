// The ISA policies every SIMD kernel is written over, once: Scalar (one lane, the reference), Avx2 (8 float lanes)
// and Avx512 (16), and Entry<Isa>, which compiles a kernel for its policy's target.
//
// Kernels are templates over a policy; the arithmetic on lanes uses GCC vector extensions (+, <, ?: lane by lane),
// which also accept plain scalars, so the same expression serves the scalar path. A policy supplies the lane types
// (I: int32, U: uint32, F: float, D: double; W float lanes, WD double lanes) and the operations GCC's generic
// vectors lack: horizontal max, rounding float lanes to int32, narrowing and widening moves, float16 conversions,
// run-time broadcasts, and ordered float comparisons (less), which must be compiled for the target: GCC 12 turns a
// 512-bit one written in a target-less template into scalar code even once it is inlined into an AVX-512 function.
//
// Everything a kernel runs is an always_inline template or one of its policy's functions (compiled for the
// policy's target), and Entry<Isa>::run is the only function that calls it, compiled with the target and flatten.
// So no vector crosses a call between code built for different targets (their calling conventions differ; -O0
// builds call the policy's functions rather than inline them, which is still one target).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/half.h"
#include "kernels/simd.h"

// Always inlined (at every optimization level), so that each kernel, compiled for one SIMD level or with a constant
// parameter, gets its own specialized copy.
#define SMARTCOLL_INLINE inline __attribute__((always_inline))

namespace smartcoll::kernels {

// std::bit_cast for lanes: always inlined, where std::bit_cast of a vector would be a call at -O0.
template <class To, class From>
SMARTCOLL_INLINE To lanes_as(const From& v) {
  return __builtin_bit_cast(To, v);
}

// Unaligned load and store of a whole lane value (a scalar or a vector: one vmovdqu for the latter).
template <class V>
SMARTCOLL_INLINE V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class V>
SMARTCOLL_INLINE void store(void* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// The type of one lane of V (V itself for a scalar), and lanes of the same width holding signed or unsigned
// integers.
template <class V>
struct LaneTraits {
  using Lane = V;
  using Signed = std::make_signed_t<std::conditional_t<sizeof(V) == 8, uint64_t, uint32_t>>;
};
template <class V>
  requires requires(V v) { v[0]; }
struct LaneTraits<V> {
  using Lane = std::remove_cvref_t<decltype(std::declval<V&>()[0])>;
  using Signed = decltype(V{} != V{});  // a comparison gives signed lanes of the operand's width
};
template <class V>
using lane_t = typename LaneTraits<V>::Lane;
template <class V>
struct UnsignedOf {
  using type = std::make_unsigned_t<V>;
};
template <class V>
  requires requires(V v) { v[0]; }
struct UnsignedOf<V> {
  typedef std::make_unsigned_t<lane_t<V>> type __attribute__((vector_size(sizeof(V))));
};
template <class V>
using unsigned_t = typename UnsignedOf<V>::type;

// Every lane set to s, bit for bit (through integers: a float add of zero would turn -0 into +0). Meant for values
// set once per call; kernels broadcast inside loops with Isa::splat.
template <class V>
SMARTCOLL_INLINE V broadcast(lane_t<V> s) {
  using B = typename LaneTraits<V>::Signed;
  return lanes_as<V>(B{} + lanes_as<lane_t<B>>(s));
}

struct Scalar {
  using I = int32_t;
  using U = uint32_t;
  using F = float;
  using D = double;
  static constexpr size_t W = 1;
  static I splat(int32_t v) { return v; }
  template <class V>
  static bool less(V a, V b) {
    return a < b;
  }
  static U load_u16(const void* p) { return load<uint16_t>(p); }
  static void store_u16(void* p, U v) { store(p, static_cast<uint16_t>(v)); }
  static F load_f16(const void* p) { return h2f(load<uint16_t>(p)); }
  static void store_f16(void* p, F v) { store(p, f2h(v)); }
};

// Four int32 lanes: per-block values of four blocks at once (a policy's hmax4), on any target.
typedef int32_t i32x4 __attribute__((vector_size(16)));

// Runs K::run<Isa>(args...) for the policy's target (K::run being an always_inline template).
template <class Isa>
struct Entry;
template <>
struct Entry<Scalar> {
  template <class K, class... A>
  static auto run(A... a) {
    return K::template run<Scalar>(a...);
  }
};

}  // namespace smartcoll::kernels

#if SMARTCOLL_X86

#define SMARTCOLL_AVX2 __attribute__((target("avx2,f16c")))
#define SMARTCOLL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c")))

namespace smartcoll::kernels {

typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef double f64x4 __attribute__((vector_size(32)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef double f64x8 __attribute__((vector_size(64)));

// Narrowing stores keep the low 8 or 16 bits of each lane; narrow_u8 and widen_u8 move W byte lanes to and from
// W / 8 64-bit words in registers. splat() broadcasts a run-time value (GCC 12 builds a generic vector splat of a
// run-time value lane by lane, with one masked broadcast per lane).
struct Avx2 {
  using I = i32x8;
  using U = u32x8;
  using F = f32x8;
  using D = f64x4;
  static constexpr size_t W = 8;
  SMARTCOLL_AVX2 static I splat(int32_t v) { return (I)_mm256_set1_epi32(v); }
  template <class V>
  SMARTCOLL_AVX2 static auto less(V a, V b) {
    return a < b;
  }
  SMARTCOLL_AVX2 static int32_t hmax(I v) {
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xb1));
    return _mm_cvtsi128_si32(m);
  }
  // Lane k: the largest lane of the k-th argument (a transpose of maxima: 11 instructions for four, against 7 for
  // one with hmax).
  SMARTCOLL_AVX2 static i32x4 hmax4(I a, I b, I c, I d) {
    const __m256i ab = _mm256_max_epi32(_mm256_unpacklo_epi32((__m256i)a, (__m256i)b),
                                        _mm256_unpackhi_epi32((__m256i)a, (__m256i)b));  // a b a b per half
    const __m256i cd = _mm256_max_epi32(_mm256_unpacklo_epi32((__m256i)c, (__m256i)d),
                                        _mm256_unpackhi_epi32((__m256i)c, (__m256i)d));
    const __m256i abcd = _mm256_max_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
    return (i32x4)_mm_max_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
  }
  SMARTCOLL_AVX2 static bool any4(i32x4 v) { return !_mm_testz_si128((__m128i)v, (__m128i)v); }
  // min(a, b) for lanes that are never NaN (one instruction, where a < b ? a : b is a compare and a blend).
  SMARTCOLL_AVX2 static F min_number(F a, F b) { return (F)_mm256_min_ps((__m256)a, (__m256)b); }
  // Float lanes to int32, rounded to nearest even whatever the MXCSR's rounding mode.
  SMARTCOLL_AVX2 static I round_even(F v) {
    return (I)_mm256_cvttps_epi32(_mm256_round_ps((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  SMARTCOLL_AVX2 static I load_u8(const uint8_t* p) {
    return (I)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  SMARTCOLL_AVX2 static void narrow_u8(I v, uint64_t* bytes) {
    // Low byte of each lane to the bottom of its 128-bit half, then the two halves' 4 bytes side by side.
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i picked = _mm256_shuffle_epi8((__m256i)v, pick);
    const __m256i joined = _mm256_permutevar8x32_epi32(picked, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    bytes[0] = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm256_castsi256_si128(joined)));
  }
  SMARTCOLL_AVX2 static I widen_u8(const uint64_t* bytes) {
    return (I)_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes[0])));
  }
  SMARTCOLL_AVX2 static void store_u8(uint8_t* p, I v) {
    uint64_t bytes;
    narrow_u8(v, &bytes);
    std::memcpy(p, &bytes, 8);
  }
  // Two vectors of codes 0..255 to 16 bytes: both saturating packs are plain narrowings, and the permutation puts
  // the halves' 4-byte groups in order (one store instead of two narrowings of one vector each).
  SMARTCOLL_AVX2 static void store_u8_pair(uint8_t* p, I a, I b) {
    const __m256i words = _mm256_packus_epi32((__m256i)a, (__m256i)b);  // a0-3 b0-3 | a4-7 b4-7
    const __m256i bytes = _mm256_packus_epi16(words, words);             // a0-3 b0-3 a0-3 b0-3 | a4-7 b4-7 ...
    const __m256i joined = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(joined));
  }
  SMARTCOLL_AVX2 static U load_u16(const void* p) {
    return (U)_mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  SMARTCOLL_AVX2 static void store_u16(void* p, U v) {
    // Lanes hold 0..0xffff, so the unsigned-saturating pack is a plain narrowing.
    _mm_storeu_si128(static_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1)));
  }
  SMARTCOLL_AVX2 static F load_f16(const void* p) {
    return (F)_mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  SMARTCOLL_AVX2 static void store_f16(void* p, F v) {
    _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
  }
};

struct Avx512 {
  using I = i32x16;
  using U = u32x16;
  using F = f32x16;
  using D = f64x8;
  static constexpr size_t W = 16;
  SMARTCOLL_AVX512 static I splat(int32_t v) { return (I)_mm512_set1_epi32(v); }
  template <class V>
  SMARTCOLL_AVX512 static auto less(V a, V b) {
    return a < b;
  }
  SMARTCOLL_AVX512 static int32_t hmax(I v) { return _mm512_reduce_max_epi32((__m512i)v); }
  // Avx2::hmax4's transpose of maxima within each 128-bit lane, then the four lanes folded into one.
  SMARTCOLL_AVX512 static i32x4 hmax4(I a, I b, I c, I d) {
    const __m512i ab = _mm512_max_epi32(_mm512_unpacklo_epi32((__m512i)a, (__m512i)b),
                                        _mm512_unpackhi_epi32((__m512i)a, (__m512i)b));
    const __m512i cd = _mm512_max_epi32(_mm512_unpacklo_epi32((__m512i)c, (__m512i)d),
                                        _mm512_unpackhi_epi32((__m512i)c, (__m512i)d));
    const __m512i abcd = _mm512_max_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    const __m256i half = _mm256_max_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
    return (i32x4)_mm_max_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
  }
  SMARTCOLL_AVX512 static bool any4(i32x4 v) { return !_mm_testz_si128((__m128i)v, (__m128i)v); }
  SMARTCOLL_AVX512 static F min_number(F a, F b) { return (F)_mm512_min_ps((__m512)a, (__m512)b); }
  SMARTCOLL_AVX512 static I round_even(F v) {
    return (I)_mm512_cvt_roundps_epi32((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  SMARTCOLL_AVX512 static I load_u8(const uint8_t* p) {
    return (I)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  SMARTCOLL_AVX512 static void narrow_u8(I v, uint64_t* bytes) {
    const __m128i b = _mm512_cvtepi32_epi8((__m512i)v);
    bytes[0] = static_cast<uint64_t>(_mm_cvtsi128_si64(b));
    bytes[1] = static_cast<uint64_t>(_mm_extract_epi64(b, 1));
  }
  SMARTCOLL_AVX512 static I widen_u8(const uint64_t* bytes) {
    return (I)_mm512_cvtepu8_epi32(_mm_set_epi64x(static_cast<long long>(bytes[1]), static_cast<long long>(bytes[0])));
  }
  SMARTCOLL_AVX512 static void store_u8(uint8_t* p, I v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8((__m512i)v));
  }
  SMARTCOLL_AVX512 static U load_u16(const void* p) {
    return (U)_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  SMARTCOLL_AVX512 static void store_u16(void* p, U v) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)v));
  }
  SMARTCOLL_AVX512 static F load_f16(const void* p) {
    return (F)_mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  SMARTCOLL_AVX512 static void store_f16(void* p, F v) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
  }
};

template <>
struct Entry<Avx2> {
  template <class K, class... A>
  SMARTCOLL_AVX2 __attribute__((flatten)) static auto run(A... a) {
    return K::template run<Avx2>(a...);
  }
};
template <>
struct Entry<Avx512> {
  template <class K, class... A>
  SMARTCOLL_AVX512 __attribute__((flatten)) static auto run(A... a) {
    return K::template run<Avx512>(a...);
  }
};

}  // namespace smartcoll::kernels

#endif  // SMARTCOLL_X86

namespace smartcoll::kernels {

// K::run<Isa>(args...) for the widest policy the active SIMD level allows.
template <class K, class... A>
auto run_active(A... a) {
#if SMARTCOLL_X86
  switch (simd_active()) {
    case SimdLevel::avx512: return Entry<Avx512>::run<K, A...>(a...);
    case SimdLevel::avx2: return Entry<Avx2>::run<K, A...>(a...);
    case SimdLevel::scalar: break;
  }
#endif
  return Entry<Scalar>::run<K, A...>(a...);
}

}  // namespace smartcoll::kernels
