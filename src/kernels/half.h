// float16 and bfloat16 <-> float32, the one definition every path uses.
//
// float16: scalar code here, F16C's vcvtps2ph/vcvtph2ps in the SIMD policies (isa.h); these functions match those
// instructions bit for bit, NaN payloads included, since scalar code also finishes what a SIMD kernel leaves over.
// bfloat16: one formula on the float's bits, written over a lane type (uint32_t or a vector of them), so scalar and
// SIMD code run the same expression. Both round to nearest, ties to even.
#pragma once

#include <bit>
#include <cstdint>

#include "kernels/simd.h"

namespace smartcoll::kernels {

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

// bfloat16 bits (in the low 16 bits of each lane) from float bits: nearest-even on the bits; a NaN keeps its top
// payload bits and is made quiet (rounding could carry a NaN into infinity). No AVX512_BF16 needed, and
// vcvtneps2bf16 would flush denormals anyway.
template <class U>
inline __attribute__((always_inline)) U bf16_bits(const U& u) {
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const U nan = (u >> 16) | 0x40u;
  return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

inline float b2f(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }
inline uint16_t f2b(float f) { return static_cast<uint16_t>(bf16_bits(std::bit_cast<uint32_t>(f))); }

}  // namespace smartcoll::kernels
