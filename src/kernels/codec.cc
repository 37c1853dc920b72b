// Wire codecs: identity, fp16, bf16, block floating point (BFP) and the OCP Microscaling (MX) v1.0 formats.
//
// BFP and MX are one algorithm over a parameterized element format (ElemFormat): a block's shared exponent s is
// floor(log2(max |x|)) - emax_elem, clamped to the scale field's range; each element is x / 2^s rounded to nearest,
// ties to even, on the element's grid and saturated at the element's largest finite code. The rounding works on
// the float's integer bits, so it is exact and independent of the floating-point environment.
//
// The per-element arithmetic is written once, as templates over a lane type that is either int32_t (the scalar
// path) or a GCC vector of int32 lanes (the AVX2 and AVX-512 paths), so every path evaluates the same formulas and
// gives the same bits. The SIMD block loops are written once too, over an ISA policy (isa.h: loads, stores,
// horizontal max), and entered through Entry<Isa> after simd_active() says the CPU has the level.
#include "smartcoll/codec.h"

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/combine.h"
#include "kernels/elems.h"
#include "kernels/isa.h"
#include "smartcoll/reduce.h"
#include "smartcoll/types.h"

namespace smartcoll {

static_assert(std::endian::native == std::endian::little, "the wire formats are little-endian; so is this code");

namespace {

using namespace kernels;

constexpr uint32_t kQuietNaN = 0x7fc00000u;

// 2^e as a float, for -149 <= e <= 127 (exact; below -126 it is a float denormal).
constexpr float pow2f(int e) {
  return e >= -126 ? std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23)
                   : std::bit_cast<float>(0x00400000u >> (-127 - e));
}

// ---------------------------------------------------------------------------------------------------------------
// Element formats. A code is `bits` wide: sign-magnitude (sign on top) or two's complement. Its magnitude is a
// small float with `ebits` exponent bits (bias `bias`) and `mbits` fraction bits; ebits == 0 makes it fixed point
// (MXINT8 and BFP elements: value = magnitude * 2^(1 - bias - mbits)).
struct ElemFormat {
  int bits;
  int ebits;
  int mbits;
  int bias;
  int emax;          // exponent of the largest normal value: the MX spec's emax_elem
  int32_t max_code;  // largest finite magnitude code; rounding beyond it saturates here
  int32_t inf_mag;   // magnitude code of infinity, 0 when the format has none
  int32_t nan_mag;   // magnitude codes >= this are NaN (1 << bits when the format has none)
  bool twos_complement;

  bool operator==(const ElemFormat&) const = default;
};

constexpr ElemFormat kE4M3{8, 4, 3, 7, 8, 0x7e, 0, 0x7f, false};   // 0x7f is NaN, no infinity; max 448
constexpr ElemFormat kE5M2{8, 5, 2, 15, 15, 0x7b, 0x7c, 0x7d, false};  // IEEE-like specials; max 57344
constexpr ElemFormat kE3M2{6, 3, 2, 3, 4, 0x1f, 0, 1 << 6, false};  // max 28
constexpr ElemFormat kE2M3{6, 2, 3, 1, 2, 0x1f, 0, 1 << 6, false};  // max 7.5
constexpr ElemFormat kE2M1{4, 2, 1, 1, 2, 0x7, 0, 1 << 4, false};   // max 6
constexpr ElemFormat kInt8{8, 0, 6, 1, 0, 127, 0, 1 << 8, true};    // int8 * 2^-6; -128 is decoded, never produced

// A BFP element: sign and `mant` magnitude bits, value = magnitude * 2^(s - (mant - 1)), so a block's largest
// element has its leading one in the top magnitude bit.
constexpr ElemFormat bfp_element(int mant) {
  return ElemFormat{1 + mant, 0, mant - 1, 1, 0, (1 << mant) - 1, 0, 1 << (1 + mant), false};
}
constexpr ElemFormat kBfp8 = bfp_element(7);  // bfp16's element, the one BFP element with SIMD kernels

constexpr size_t kMxBlockElems = 32;
constexpr size_t kBfp16BlockElems = 16;

// A block format: the element format, the block length and the shared exponent field (stored in a whole byte; its
// low `scale_bits` bits hold s + scale_bias, the all-ones field marks a block that held a NaN or an infinity).
struct BlockLayout {
  ElemFormat elem;
  size_t block;
  int scale_bias;
  int s_min, s_max;
  int nan_field;

  BlockLayout(const ElemFormat& e, size_t block_elems, int scale_bits)
      : elem(e),
        block(block_elems),
        scale_bias((1 << (scale_bits - 1)) - 1),
        s_min(-scale_bias),
        s_max((1 << scale_bits) - 2 - scale_bias),
        nan_field((1 << scale_bits) - 1) {}

  size_t bytes(size_t n) const { return 1 + (n * static_cast<size_t>(elem.bits) + 7) / 8; }  // block of n <= block
  size_t full_bytes() const { return bytes(block); }

  // Shared exponent for a block whose largest magnitude has float bits `amax` (finite): the float's exponent field
  // gives floor(log2(amax)) for a normal value. A zero or denormal maximum (field 0) gives -127 - emax, below
  // s_min (>= -127) just like the true floor(log2) would be, so the clamp makes them agree.
  int scale_for(int32_t amax) const { return std::clamp((amax >> 23) - 127 - elem.emax, s_min, s_max); }
};

// ---------------------------------------------------------------------------------------------------------------
// Lane arithmetic. I is int32_t or a GCC vector of int32 lanes, F the matching float type; with a vector type the
// comparisons and ?: work lane by lane. Every formula here is what all SIMD levels compute.

// For constants (folded); kernels broadcast run-time values with Isa::splat.
template <class I>
SMARTCOLL_INLINE I splat(int32_t v) {
  return I{} + v;
}
template <class T>
SMARTCOLL_INLINE T vmax(const T& a, const T& b) {
  return a > b ? a : b;
}
template <class T>
SMARTCOLL_INLINE T vmin(const T& a, const T& b) {
  return a < b ? a : b;
}

// int32 lanes to float lanes (exact below 2^24), and the unsigned lane type.
template <class I>
SMARTCOLL_INLINE auto to_float(const I& v) {
  if constexpr (std::is_same_v<I, int32_t>) {
    return static_cast<float>(v);
  } else {
    typedef float F __attribute__((vector_size(sizeof(I))));
    return __builtin_convertvector(v, F);
  }
}

// Magnitude code of |x| (float bits `a`, finite) in a block with shared exponent s, where C = s + 127 - e.bias:
// x / 2^s has element biased exponent eb = ex - C. Subtracting C from the float's exponent field makes the bits
// those of x / 2^s with the element's bias; an element subnormal (eb <= 0) instead gets exponent 1, keeping the
// leading one at bit 23, and d = 1 - eb more bits of right shift. Then one round-to-nearest-even right shift by
// 23 - mbits + d leaves the element's exponent and fraction bits in place, a carry out of the fraction bumping the
// exponent as it should, and values past the largest finite code saturate. The rebased bits are unsigned: a scale
// clamped from above (BFP with fewer than 8 exponent bits) can leave eb far beyond the element's range.
//
// A float denormal has no leading one. While C >= 0 it can only become an element subnormal, where treating it as
// exponent 1 without the leading one is exact. C < 0 (kTinyScale) happens only in blocks scaled by about 2^-127,
// where a denormal can become an element normal: there it is first normalized, its exponent going to zero or
// below (an int -> float conversion of its bits finds the leading one exactly; a zero ends up far below every
// element and rounds to 0).
template <bool kTinyScale, class I>
SMARTCOLL_INLINE I quantize_magnitude(const I& a, const I& C, const ElemFormat& e) {
  using U = kernels::unsigned_t<I>;
  I bits = a, ex;
  if constexpr (kTinyScale) {
    const I normalized = lanes_as<I>(to_float(a)) - (149 << 23);
    bits = (a >> 23) == 0 ? normalized : a;
    ex = bits >> 23;
  } else {
    ex = vmax(a >> 23, splat<I>(1));
  }
  const I d = vmax(C + 1 - ex, I{});
  const U base = (U)bits - ((U)C << 23) + ((U)d << 23);
  const U k = (U)vmin(d + (23 - e.mbits), splat<I>(31));
  const U one = (U)splat<I>(1);
  const U mag = (base + ((one << (k - 1)) - 1) + ((base >> k) & 1)) >> k;
  return (I)vmin(mag, (U)splat<I>(e.max_code));
}

// The code of magnitude code mag with the sign of the float whose bits are u; and the element code of that float.
template <class I>
SMARTCOLL_INLINE I signed_code(const I& mag, const I& u, const ElemFormat& e) {
  const I neg = u >> 31;  // 0 or -1
  if (e.twos_complement) return ((mag ^ neg) - neg) & ((1 << e.bits) - 1);
  return mag | (neg & (1 << (e.bits - 1)));
}
template <bool kTinyScale, class I>
SMARTCOLL_INLINE I element_code(const I& u, const I& C, const ElemFormat& e) {
  return signed_code(quantize_magnitude<kTinyScale>(u & 0x7fffffff, C, e), u, e);
}

// Float value of element code c times scale (2^s). The element's magnitude is first made a float without ever
// handling a float denormal (slow on many CPUs): fixed-point magnitudes convert from int exactly; for a float
// element the code's exponent and fraction are placed in a float's bits and the exponent rebiased, and a subnormal
// element (exponent field 0) is given exponent field 1 and then has 2^emin subtracted, leaving exactly
// fraction * 2^emin. The final product is exact as well: elements have at most 16 significant bits and the
// smallest one, times 2^-127, is still a multiple of 2^-149.
template <class I, class F>
SMARTCOLL_INLINE F element_value(const I& c, const F& scale, const ElemFormat& e) {
  const int up = 32 - e.bits;
  I neg, mag;
  if (e.twos_complement) {
    const I wide = (c << up) >> up;
    neg = wide >> 31;
    mag = (wide ^ neg) - neg;
  } else {
    neg = (c << up) >> 31;
    mag = c & ((1 << (e.bits - 1)) - 1);
  }
  F v;
  if (e.ebits == 0) {
    v = to_float(mag) * pow2f(1 - e.bias - e.mbits);
  } else {
    const I placed = mag << (23 - e.mbits);
    const I normal = placed + ((127 - e.bias) << 23);
    const I subnormal = lanes_as<I>(lanes_as<F>(placed + ((128 - e.bias) << 23)) - pow2f(1 - e.bias));
    v = lanes_as<F>((mag >> e.mbits) == 0 ? subnormal : normal);
  }
  v = v * scale;
  const I sign = neg & static_cast<int32_t>(0x80000000u);
  I r = lanes_as<I>(v) | sign;
  if (e.inf_mag != 0) r = mag == e.inf_mag ? (sign | 0x7f800000) : r;
  if (e.nan_mag < (1 << (e.bits - 1))) r = mag >= e.nan_mag ? (sign | static_cast<int32_t>(kQuietNaN)) : r;
  return lanes_as<F>(r);
}

// ---------------------------------------------------------------------------------------------------------------
// Packing. Elements are a little-endian bit stream: element i of a block occupies bits [i * bits, (i + 1) * bits)
// of the bytes after the scale byte, bit j being bit (j % 8) of byte j / 8.

class BitWriter {
 public:
  explicit BitWriter(uint8_t* p) : p_(p) {}
  void put(uint32_t v, int bits) {
    acc_ |= static_cast<uint64_t>(v) << n_;
    n_ += bits;
    for (; n_ >= 8; n_ -= 8, acc_ >>= 8) *p_++ = static_cast<uint8_t>(acc_);
  }
  void flush() {
    if (n_ > 0) *p_++ = static_cast<uint8_t>(acc_);
    acc_ = 0;
    n_ = 0;
  }

 private:
  uint8_t* p_;
  uint64_t acc_ = 0;
  int n_ = 0;
};

class BitReader {
 public:
  explicit BitReader(const uint8_t* p) : p_(p) {}
  uint32_t get(int bits) {
    for (; n_ < bits; n_ += 8) acc_ |= static_cast<uint64_t>(*p_++) << n_;
    const auto v = static_cast<uint32_t>(acc_ & ((1u << bits) - 1));
    acc_ >>= bits;
    n_ -= bits;
    return v;
  }

 private:
  const uint8_t* p_;
  uint64_t acc_ = 0;
  int n_ = 0;
};

// Eight codes of kBits (4 or 6) bits: from the low 8 * kBits bits of the stream to one byte each, and back. Each
// step halves the field width, moving the upper half of every field up (or down) into its own slot.
template <int kBits>
SMARTCOLL_INLINE uint64_t spread_codes(uint64_t x) {
  static_assert(kBits == 4 || kBits == 6);
  if constexpr (kBits == 4) {
    x = (x | x << 16) & 0x0000ffff0000ffffull;
    x = (x | x << 8) & 0x00ff00ff00ff00ffull;
    return (x | x << 4) & 0x0f0f0f0f0f0f0f0full;
  } else {
    x = (x & 0xffffffull) | (x & 0xffffff000000ull) << 8;
    x = (x & 0x00000fff00000fffull) | (x & 0x00fff00000fff000ull) << 4;
    return (x & 0x003f003f003f003full) | (x & 0x0fc00fc00fc00fc0ull) << 2;
  }
}

template <int kBits>
SMARTCOLL_INLINE uint64_t gather_codes(uint64_t x) {
  static_assert(kBits == 4 || kBits == 6);
  if constexpr (kBits == 4) {
    x = (x | x >> 4) & 0x00ff00ff00ff00ffull;
    x = (x | x >> 8) & 0x0000ffff0000ffffull;
    return (x | x >> 16) & 0xffffffffull;
  } else {
    x = (x & 0x003f003f003f003full) | (x & 0x3f003f003f003f00ull) >> 2;
    x = (x & 0x00000fff00000fffull) | (x & 0x0fff00000fff0000ull) >> 4;
    return (x & 0xffffffull) | (x & 0xffffff00000000ull) >> 8;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Scalar blocks: any element width. `e` is l.elem, passed separately so that the per-format instantiations below
// see it as a compile-time constant.

inline int32_t float_bits(float f) { return std::bit_cast<int32_t>(f); }

SMARTCOLL_INLINE void encode_block_scalar(const BlockLayout& l, const ElemFormat& e, const float* x, size_t n,
                                          uint8_t* out) {
  int32_t amax = 0;
  for (size_t i = 0; i < n; ++i) amax = std::max(amax, float_bits(x[i]) & 0x7fffffff);
  if (amax >= 0x7f800000) {
    out[0] = static_cast<uint8_t>(l.nan_field);
    std::memset(out + 1, 0, l.bytes(n) - 1);
    return;
  }
  const int s = l.scale_for(amax);
  out[0] = static_cast<uint8_t>(s + l.scale_bias);
  const int32_t C = s + 127 - e.bias;
  BitWriter w(out + 1);
  for (size_t i = 0; i < n; ++i) {
    const int32_t u = float_bits(x[i]);
    const int32_t code = C < 0 ? element_code<true>(u, C, e) : element_code<false>(u, C, e);
    w.put(static_cast<uint32_t>(code), e.bits);
  }
  w.flush();
}

SMARTCOLL_INLINE void decode_block_scalar(const BlockLayout& l, const ElemFormat& e, const uint8_t* in, size_t n,
                                          float* out) {
  // Fields above the all-ones one (stray high bits when scale_bits < 8) are invalid: decoded as NaN too.
  if (in[0] >= l.nan_field) {
    std::fill_n(out, n, std::bit_cast<float>(kQuietNaN));
    return;
  }
  const float scale = pow2f(in[0] - l.scale_bias);
  BitReader r(in + 1);
  for (size_t i = 0; i < n; ++i) out[i] = element_value(static_cast<int32_t>(r.get(e.bits)), scale, e);
}

// Whole blocks (the caller encodes a partial last block with encode_block_scalar).
using BlockEncodeFn = void (*)(const BlockLayout&, const float*, size_t nblocks, uint8_t*);
using BlockDecodeFn = void (*)(const BlockLayout&, const uint8_t*, size_t nblocks, float*);
// Fused forms (null where a layout has none; the callers then run the steps one by one): encode that also writes
// decode(out) to `back`, and decode whose values are added to `addend` (reduce()'s float32 sum) on the way out.
using BlockEncodeBackFn = void (*)(const BlockLayout&, const float*, size_t nblocks, uint8_t*, float* back);
using BlockDecodeAddFn = void (*)(const BlockLayout&, const uint8_t*, size_t nblocks, const float* addend, float*);
struct BlockKernels {
  BlockEncodeFn encode;
  BlockDecodeFn decode;
  BlockEncodeBackFn encode_back = nullptr;
  BlockDecodeAddFn decode_add = nullptr;
};

// The scalar kernels, for the preset element formats (E) and for any other (l.elem at run time).
template <ElemFormat E>
void encode_blocks_preset(const BlockLayout& l, const float* x, size_t nblocks, uint8_t* out) {
  for (size_t b = 0; b < nblocks; ++b) encode_block_scalar(l, E, x + b * l.block, l.block, out + b * l.full_bytes());
}
template <ElemFormat E>
void decode_blocks_preset(const BlockLayout& l, const uint8_t* in, size_t nblocks, float* out) {
  for (size_t b = 0; b < nblocks; ++b) decode_block_scalar(l, E, in + b * l.full_bytes(), l.block, out + b * l.block);
}
void encode_blocks_any(const BlockLayout& l, const float* x, size_t nblocks, uint8_t* out) {
  for (size_t b = 0; b < nblocks; ++b) {
    encode_block_scalar(l, l.elem, x + b * l.block, l.block, out + b * l.full_bytes());
  }
}
void decode_blocks_any(const BlockLayout& l, const uint8_t* in, size_t nblocks, float* out) {
  for (size_t b = 0; b < nblocks; ++b) {
    decode_block_scalar(l, l.elem, in + b * l.full_bytes(), l.block, out + b * l.block);
  }
}
template <ElemFormat E>
constexpr BlockKernels kScalarBlocks{encode_blocks_preset<E>, decode_blocks_preset<E>};
constexpr BlockKernels kAnyBlocks{encode_blocks_any, decode_blocks_any};

// Calls fn.template operator()<E>() for the preset element format equal to e; returns null for any other.
template <class Fn>
const BlockKernels* with_preset(const ElemFormat& e, Fn&& fn) {
  if (e == kE4M3) return fn.template operator()<kE4M3>();
  if (e == kE5M2) return fn.template operator()<kE5M2>();
  if (e == kE3M2) return fn.template operator()<kE3M2>();
  if (e == kE2M3) return fn.template operator()<kE2M3>();
  if (e == kE2M1) return fn.template operator()<kE2M1>();
  if (e == kInt8) return fn.template operator()<kInt8>();
  if (e == kBfp8) return fn.template operator()<kBfp8>();
  return nullptr;
}

// ---------------------------------------------------------------------------------------------------------------
// SIMD kernels.

// W element codes to W * bits / 8 bytes of the stream and back (whole bytes: W is 8 or 16, bits 4, 6 or 8). The
// sub-byte codes go through 64-bit words of eight, never through a narrow store followed by a wide load (which
// stalls store-to-load forwarding).
template <class Isa, int kBits>
SMARTCOLL_INLINE void store_codes(uint8_t* p, const typename Isa::I& codes) {
  if constexpr (kBits == 8) {
    Isa::store_u8(p, codes);
  } else {
    uint64_t words[Isa::W / 8];
    Isa::narrow_u8(codes, words);
    for (size_t g = 0; g < Isa::W / 8; ++g) {
      const uint64_t packed = gather_codes<kBits>(words[g]);
      const auto low = static_cast<uint32_t>(packed);
      const auto high = static_cast<uint16_t>(packed >> 32);
      std::memcpy(p + kBits * g, &low, 4);
      std::memcpy(p + kBits * g + 4, &high, kBits - 4);
    }
  }
}

template <class Isa, int kBits>
SMARTCOLL_INLINE typename Isa::I load_codes(const uint8_t* p) {
  if constexpr (kBits == 8) {
    return Isa::load_u8(p);
  } else {
    uint64_t words[Isa::W / 8];
    for (size_t g = 0; g < Isa::W / 8; ++g) {
      // Two loads of the 4 + (kBits - 4) bytes, so the compiler cannot assemble the word through the stack.
      uint32_t low;
      uint16_t high = 0;
      std::memcpy(&low, p + kBits * g, 4);
      std::memcpy(&high, p + kBits * g + 4, kBits - 4);
      words[g] = spread_codes<kBits>(low | static_cast<uint64_t>(high) << 32);
    }
    return Isa::widen_u8(words);
  }
}

// The elements of one block (C as in quantize_magnitude).
template <class Isa, ElemFormat E, bool kTinyScale>
SMARTCOLL_INLINE void quantize_block(const float* x, size_t block, const typename Isa::I& C, uint8_t* out) {
  for (size_t i = 0; i < block; i += Isa::W) {
    store_codes<Isa, E.bits>(out + i * E.bits / 8, element_code<kTinyScale>(load<typename Isa::I>(x + i), C, E));
  }
}

// The fixed-point elements' codes (BFP and MXINT8: ebits == 0) the fast way, for blocks with C >= fixed_min_c<E>:
// |x| * 2^(mbits + 126 - C), capped at max_code, rounded to nearest even. They are element_code's bits: the
// scaling by a power of two is exact (the product is at most ~2^(mbits+1); one below 2^-126, which a float
// denormal would round, is below 1/2 and gives 0 either way), the cap only moves values that would round to
// max_code + 1 or beyond and saturate, and the rounding is element_code's. About 3x fewer operations than the
// integer steps; the SIMD tests compare every level against the scalar reference.
template <ElemFormat E>
constexpr int32_t fixed_min_c = E.mbits - 1;  // so that the factor 2^(mbits + 126 - C) is at most 2^127

// With kBack, back[i] also receives the code's value as decoding gives it (element_value, the same steps).
// `factor` holds 2^(mbits + 126 - C) in every lane, `scale` 2^s (used with kBack only).
template <class Isa, ElemFormat E, bool kBack>
SMARTCOLL_INLINE void quantize_block_fixed(const float* x, size_t block, const typename Isa::F& factor, uint8_t* out,
                                           float* back, const typename Isa::F& scale) {
  using I = typename Isa::I;
  using F = typename Isa::F;
  const F cap = lanes_as<F>(Isa::splat(std::bit_cast<int32_t>(static_cast<float>(E.max_code))));
  auto code_at = [&](size_t i) __attribute__((always_inline)) {
    const I u = load<I>(x + i);
    const F scaled = lanes_as<F>(u & 0x7fffffff) * factor;  // never NaN: the block's largest magnitude is finite
    const I code = signed_code(Isa::round_even(Isa::min_number(scaled, cap)), u, E);
    if constexpr (kBack) store(back + i, element_value(code, scale, E));
    return code;
  };
  if constexpr (E.bits == 8 && requires { Isa::store_u8_pair; }) {
    if (block % (2 * Isa::W) == 0) {
      for (size_t i = 0; i < block; i += 2 * Isa::W) Isa::store_u8_pair(out + i, code_at(i), code_at(i + Isa::W));
      return;
    }
  }
  for (size_t i = 0; i < block; i += Isa::W) store_codes<Isa, E.bits>(out + i * E.bits / 8, code_at(i));
}

// One block's values from its codes (in: the block's scale byte), added to addend's when kAdd.
template <class Isa, ElemFormat E, bool kAdd>
SMARTCOLL_INLINE void decode_block(const BlockLayout& l, size_t block, const uint8_t* in, const float* addend,
                                   float* out) {
  using F = typename Isa::F;
  auto finish = [&](size_t i, const F& v) __attribute__((always_inline)) {
    if constexpr (kAdd) {
      store(out + i, combine<Isa, ReduceOp::sum>(load<F>(addend + i), v));
    } else {
      store(out + i, v);
    }
  };
  if (in[0] >= l.nan_field) {
    const F nan = lanes_as<F>(Isa::splat(static_cast<int32_t>(kQuietNaN)));
    for (size_t i = 0; i < block; i += Isa::W) finish(i, nan);
    return;
  }
  const F scale = lanes_as<F>(Isa::splat(std::bit_cast<int32_t>(pow2f(in[0] - l.scale_bias))));
  for (size_t i = 0; i < block; i += Isa::W) {
    finish(i, element_value(load_codes<Isa, E.bits>(in + 1 + i * E.bits / 8), scale, E));
  }
}

// Whole blocks, block a multiple of W: the same steps as encode_block_scalar / decode_block_scalar. kBlock is the
// block length when it is known at compile time (the presets' 16 and 32: the loops over a block then unroll and
// every constant stays in a register), 0 to take it from the layout.
template <ElemFormat E, size_t kBlock, bool kBack>
struct EncodeBlocks {
  template <class Isa>
  SMARTCOLL_INLINE static void run(const BlockLayout& layout, const float* x, size_t nblocks, uint8_t* out,
                                   float* back) {
    using I = typename Isa::I;
    using F = typename Isa::F;
    constexpr size_t W = Isa::W;
    const BlockLayout l = layout;  // a local copy: the byte stores below cannot alias it
    const size_t block = kBlock != 0 ? kBlock : l.block;
    const size_t stride = l.full_bytes();
    auto magnitudes_max = [&](const float* xb) __attribute__((always_inline)) {
      I m = load<I>(xb) & 0x7fffffff;
      for (size_t i = W; i < block; i += W) m = vmax(m, load<I>(xb + i) & 0x7fffffff);
      return m;
    };
    auto splat_float = [](float f) __attribute__((always_inline)) {
      return lanes_as<F>(Isa::splat(std::bit_cast<int32_t>(f)));
    };
    // Block b on its own: the scale from its largest magnitude, then the fixed-point codes where they apply.
    auto one = [&](size_t b) __attribute__((always_inline)) {
      const float* xb = x + b * block;
      uint8_t* ob = out + b * stride;
      float* const bb = kBack ? back + b * block : nullptr;
      const int32_t amax = Isa::hmax(magnitudes_max(xb));
      if (amax >= 0x7f800000) {
        ob[0] = static_cast<uint8_t>(l.nan_field);
        std::memset(ob + 1, 0, stride - 1);
        if constexpr (kBack) decode_block<Isa, E, false>(l, block, ob, nullptr, bb);
        return;
      }
      const int s = l.scale_for(amax);
      ob[0] = static_cast<uint8_t>(s + l.scale_bias);
      const int32_t c = s + 127 - E.bias;
      if constexpr (E.ebits == 0) {
        // A block of zeros gives every element magnitude 0 at any factor: it takes the fast path too.
        if (c >= fixed_min_c<E> || amax == 0) {
          const int32_t cf = std::max(c, fixed_min_c<E>);
          quantize_block_fixed<Isa, E, kBack>(xb, block, splat_float(pow2f(E.mbits + 126 - cf)), ob + 1, bb,
                                              splat_float(pow2f(s)));
          return;
        }
      }
      if (c < 0) {
        quantize_block<Isa, E, true>(xb, block, Isa::splat(c), ob + 1);
      } else {
        quantize_block<Isa, E, false>(xb, block, Isa::splat(c), ob + 1);
      }
      if constexpr (kBack) decode_block<Isa, E, false>(l, block, ob, nullptr, bb);
    };
    size_t b = 0;
    if constexpr (E.ebits == 0 && kBlock != 0 && requires { Isa::hmax4; }) {
      // Four blocks at a time: their maxima, scales and factors in one vector each. Where one of them is not
      // finite or needs the general path, the four go one by one.
      for (; b + 4 <= nblocks; b += 4) {
        const float* xb = x + b * block;
        const i32x4 amax = Isa::hmax4(magnitudes_max(xb), magnitudes_max(xb + block),
                                      magnitudes_max(xb + 2 * block), magnitudes_max(xb + 3 * block));
        const i32x4 s = vmin(vmax((amax >> 23) - (127 + E.emax), i32x4{} + l.s_min), i32x4{} + l.s_max);
        const i32x4 c = s + (127 - E.bias);
        const i32x4 general = (amax >= 0x7f800000) | ((c < fixed_min_c<E>) & (amax != 0));
        if (Isa::any4(general)) {
          for (size_t k = 0; k < 4; ++k) one(b + k);
          continue;
        }
        // pow2f's normal range suffices: s >= fixed_min_c - 127 + bias >= -126 here, except in blocks of zeros,
        // whose products are zeros whatever the scale.
        const i32x4 factor = (vmax(c, i32x4{} + fixed_min_c<E>) * -1 + (E.mbits + 126 + 127)) << 23;
        const i32x4 scale = (s + 127) << 23;
        for (size_t k = 0; k < 4; ++k) {
          uint8_t* ob = out + (b + k) * stride;
          ob[0] = static_cast<uint8_t>(s[k] + l.scale_bias);
          quantize_block_fixed<Isa, E, kBack>(xb + k * block, block, lanes_as<F>(Isa::splat(factor[k])), ob + 1,
                                              kBack ? back + (b + k) * block : nullptr,
                                              lanes_as<F>(Isa::splat(scale[k])));
        }
      }
    }
    for (; b < nblocks; ++b) one(b);
  }
  template <class Isa>
  SMARTCOLL_INLINE static void run(const BlockLayout& layout, const float* x, size_t nblocks, uint8_t* out) {
    run<Isa>(layout, x, nblocks, out, nullptr);
  }
};

template <ElemFormat E, size_t kBlock, bool kAdd>
struct DecodeBlocks {
  template <class Isa>
  SMARTCOLL_INLINE static void run(const BlockLayout& layout, const uint8_t* in, size_t nblocks, const float* addend,
                                   float* out) {
    const BlockLayout l = layout;
    const size_t block = kBlock != 0 ? kBlock : l.block;
    const size_t stride = l.full_bytes();
    for (size_t b = 0; b < nblocks; ++b, in += stride, out += block) {
      decode_block<Isa, E, kAdd>(l, block, in, kAdd ? addend + b * block : nullptr, out);
    }
  }
  template <class Isa>
  SMARTCOLL_INLINE static void run(const BlockLayout& layout, const uint8_t* in, size_t nblocks, float* out) {
    run<Isa>(layout, in, nblocks, nullptr, out);
  }
};

#if SMARTCOLL_X86
template <class Isa, ElemFormat E, size_t kBlock>
constexpr BlockKernels kSimdBlocks{
    Entry<Isa>::template run<EncodeBlocks<E, kBlock, false>, const BlockLayout&, const float*, size_t, uint8_t*>,
    Entry<Isa>::template run<DecodeBlocks<E, kBlock, false>, const BlockLayout&, const uint8_t*, size_t, float*>,
    Entry<Isa>::template run<EncodeBlocks<E, kBlock, true>, const BlockLayout&, const float*, size_t, uint8_t*,
                             float*>,
    Entry<Isa>::template run<DecodeBlocks<E, kBlock, true>, const BlockLayout&, const uint8_t*, size_t,
                             const float*, float*>};

// Isa's kernels for element format E and this block length (a multiple of Isa::W).
template <class Isa, ElemFormat E>
const BlockKernels* simd_blocks(size_t block) {
  if (block == kMxBlockElems) return &kSimdBlocks<Isa, E, kMxBlockElems>;
  if (block == kBfp16BlockElems) return &kSimdBlocks<Isa, E, kBfp16BlockElems>;
  return &kSimdBlocks<Isa, E, 0>;
}
#endif  // SMARTCOLL_X86

// The kernels for this layout at the active SIMD level. Vectorized: every preset element format (all MX formats
// and 7-bit-mantissa BFP) in blocks a multiple of the width (16 for AVX-512, 8 for AVX2; narrower blocks fall back
// to AVX2, then to scalar). Other BFP parameters are scalar.
const BlockKernels& block_kernels(const BlockLayout& l) {
  const SimdLevel level = simd_active();
  const BlockKernels* k = with_preset(l.elem, [&]<ElemFormat E>() -> const BlockKernels* {
#if SMARTCOLL_X86
    if (level == SimdLevel::avx512 && l.block % Avx512::W == 0) return simd_blocks<Avx512, E>(l.block);
    if (level != SimdLevel::scalar && l.block % Avx2::W == 0) return simd_blocks<Avx2, E>(l.block);
#endif
    return &kScalarBlocks<E>;
  });
  (void)level;
  return k != nullptr ? *k : kAnyBlocks;
}

// ---------------------------------------------------------------------------------------------------------------
// Whole calls.

void encode_blocks(const BlockLayout& l, const float* x, size_t count, uint8_t* out) {
  const size_t full = count / l.block;
  block_kernels(l).encode(l, x, full, out);
  if (const size_t rest = count - full * l.block; rest > 0) {
    encode_block_scalar(l, l.elem, x + full * l.block, rest, out + full * l.full_bytes());
  }
}

void decode_blocks(const BlockLayout& l, const uint8_t* in, size_t count, float* out) {
  const size_t full = count / l.block;
  block_kernels(l).decode(l, in, full, out);
  if (const size_t rest = count - full * l.block; rest > 0) {
    decode_block_scalar(l, l.elem, in + full * l.full_bytes(), rest, out + full * l.block);
  }
}

// identity, fp16 and bf16: element by element, at the active SIMD level (elems.h).
void encode_elems(CodecKind kind, const float* x, size_t count, uint8_t* out) {
  if (kind == CodecKind::identity) return static_cast<void>(std::memcpy(out, x, count * sizeof(float)));
  if (kind == CodecKind::fp16) return run_active<Convert<DataType::f32, DataType::f16>>(out, x, count);
  run_active<Convert<DataType::f32, DataType::bf16>>(out, x, count);
}

void decode_elems(CodecKind kind, const uint8_t* in, size_t count, float* out) {
  if (kind == CodecKind::identity) return static_cast<void>(std::memcpy(out, in, count * sizeof(float)));
  if (kind == CodecKind::fp16) return run_active<Convert<DataType::f16, DataType::f32>>(out, in, count);
  run_active<Convert<DataType::bf16, DataType::f32>>(out, in, count);
}

struct MxPreset {
  std::string_view name;
  CodecKind kind;
  ElemFormat elem;
};
constexpr MxPreset kMxPresets[] = {
    {"mxint8", CodecKind::mxint8, kInt8},          {"mxfp8_e4m3", CodecKind::mxfp8_e4m3, kE4M3},
    {"mxfp8_e5m2", CodecKind::mxfp8_e5m2, kE5M2},  {"mxfp6_e3m2", CodecKind::mxfp6_e3m2, kE3M2},
    {"mxfp6_e2m3", CodecKind::mxfp6_e2m3, kE2M3},  {"mxfp4_e2m1", CodecKind::mxfp4_e2m1, kE2M1},
};
constexpr int kMxScaleBits = 8;  // E8M0
constexpr int kBfp16Mant = 7, kBfp16Exp = 8;
constexpr int kMaxBfpBlock = 4096;

bool is_block_kind(CodecKind k) { return k != CodecKind::identity && k != CodecKind::fp16 && k != CodecKind::bf16; }

BlockLayout layout_of(const Codec& c) {
  if (c.kind() == CodecKind::bfp) {
    return BlockLayout(bfp_element(c.mant_bits()), static_cast<size_t>(c.block()), c.exp_bits());
  }
  for (const MxPreset& p : kMxPresets)
    if (p.kind == c.kind()) return BlockLayout(p.elem, kMxBlockElems, kMxScaleBits);
  throw InvalidArgument("codec: " + c.name() + " is not a block format");
}

std::string valid_names() {
  return "identity (or none), fp16, bf16, bfp16, bfp:block=B,mant=M,exp=E (1 <= B <= 4096, 1 <= M <= 15, "
         "1 <= E <= 8), mxint8, mxfp8_e4m3, mxfp8_e5m2, mxfp6_e3m2, mxfp6_e2m3, mxfp4_e2m1";
}

[[noreturn]] void bad_name(std::string_view name, std::string_view why) {
  throw InvalidArgument("codec '" + std::string(name) + "': " + std::string(why) + "; valid codecs: " + valid_names());
}

// Elements per chunk of the fused calls: a multiple of the block, small enough that the decoded chunk stays in L1.
constexpr size_t kChunkFloats = 4096;
size_t chunk_elems(size_t block) { return std::max<size_t>(1, 2048 / block) * block; }

}  // namespace

Codec Codec::parse(std::string_view name) {
  Codec c;
  if (name == "identity" || name == "none") return c;
  if (name == "fp16" || name == "bf16") {
    c.kind_ = name == "fp16" ? CodecKind::fp16 : CodecKind::bf16;
    c.mant_bits_ = name == "fp16" ? 10 : 7;
    c.exp_bits_ = name == "fp16" ? 5 : 8;
    return c;
  }
  for (const MxPreset& p : kMxPresets) {
    if (name == p.name) {
      c.kind_ = p.kind;
      c.block_ = static_cast<int>(kMxBlockElems);
      c.exp_bits_ = p.elem.ebits;
      c.mant_bits_ = p.elem.twos_complement ? p.elem.bits - 1 : p.elem.mbits;
      return c;
    }
  }
  constexpr std::string_view kBfpPrefix = "bfp:";
  if (name != "bfp16" && !name.starts_with(kBfpPrefix)) bad_name(name, "unknown codec");
  c.kind_ = CodecKind::bfp;
  c.block_ = static_cast<int>(kBfp16BlockElems);
  c.mant_bits_ = kBfp16Mant;
  c.exp_bits_ = kBfp16Exp;
  if (name == "bfp16") return c;

  struct Param {
    std::string_view key;
    int* value;
    int lo, hi;
    bool seen;
  };
  Param params[] = {{"block", &c.block_, 1, kMaxBfpBlock, false},
                    {"mant", &c.mant_bits_, 1, 15, false},
                    {"exp", &c.exp_bits_, 1, 8, false}};
  std::string_view rest = name.substr(kBfpPrefix.size());
  // Every comma is followed by an item: "bfp:block=16," is refused, not read as "bfp:block=16".
  for (bool more = !rest.empty(); more;) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    more = comma != std::string_view::npos;
    rest = more ? rest.substr(comma + 1) : std::string_view{};
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) bad_name(name, "expected key=value, got '" + std::string(item) + "'");
    const std::string_view key = item.substr(0, eq), text = item.substr(eq + 1);
    Param* p = std::find_if(std::begin(params), std::end(params), [&](const Param& q) { return q.key == key; });
    if (p == std::end(params)) bad_name(name, "unknown bfp parameter '" + std::string(key) + "' (block, mant, exp)");
    if (p->seen) bad_name(name, "bfp parameter '" + std::string(key) + "' given twice");
    int v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc{} || end != text.data() + text.size() || text.empty() || v < p->lo || v > p->hi) {
      bad_name(name, "bfp " + std::string(key) + " must be an integer in [" + std::to_string(p->lo) + ", " +
                         std::to_string(p->hi) + "], got '" + std::string(text) + "'");
    }
    *p->value = v;
    p->seen = true;
  }
  return c;
}

std::vector<std::string> Codec::names() {
  std::vector<std::string> out{"identity", "fp16", "bf16", "bfp16"};
  for (const MxPreset& p : kMxPresets) out.emplace_back(p.name);
  return out;
}

std::string Codec::name() const {
  switch (kind_) {
    case CodecKind::identity: return "identity";
    case CodecKind::fp16: return "fp16";
    case CodecKind::bf16: return "bf16";
    case CodecKind::bfp:
      if (block_ == static_cast<int>(kBfp16BlockElems) && mant_bits_ == kBfp16Mant && exp_bits_ == kBfp16Exp) {
        return "bfp16";
      }
      return "bfp:block=" + std::to_string(block_) + ",mant=" + std::to_string(mant_bits_) +
             ",exp=" + std::to_string(exp_bits_);
    default: break;
  }
  for (const MxPreset& p : kMxPresets)
    if (p.kind == kind_) return std::string(p.name);
  return "unknown";
}

size_t Codec::block_elems() const { return is_block_kind(kind_) ? static_cast<size_t>(block_) : 1; }

size_t Codec::encoded_size(size_t count) const {
  switch (kind_) {
    case CodecKind::identity: return count * 4;
    case CodecKind::fp16:
    case CodecKind::bf16: return count * 2;
    default: break;
  }
  const BlockLayout l = layout_of(*this);
  const size_t rest = count % l.block;
  return count / l.block * l.full_bytes() + (rest > 0 ? l.bytes(rest) : 0);
}

double Codec::ratio() const {
  const size_t block = block_elems();
  return 4.0 * static_cast<double>(block) / static_cast<double>(encoded_size(block));
}

ErrorBound Codec::error_bound() const {
  switch (kind_) {
    case CodecKind::identity: return {};
    // Half an ulp of the nearest-even rounding; below the normal range, half the smallest denormal.
    case CodecKind::fp16: return {std::ldexp(1.0, -11), std::ldexp(1.0, -25), 65520.0, false};
    case CodecKind::bf16:  // values from 2^128 - 2^119 on round to infinity
      return {std::ldexp(1.0, -8), std::ldexp(1.0, -134), std::ldexp(1.0, 128) - std::ldexp(1.0, 119), false};
    default: break;
  }
  // max|x| in [2^(s+emax), 2^(s+emax+1)). Rounding costs at most half the top binade's step, 2^-(mbits+1) of that;
  // saturation at the largest element value vmax costs less than 2^(s+emax+1) - vmax * 2^s. When s sits at s_min
  // the block can be arbitrarily small and only the absolute half-step bounds the error.
  const BlockLayout l = layout_of(*this);
  const double vmax = element_value(l.elem.max_code, 1.0f, l.elem);
  const double rel = std::max(std::ldexp(1.0, -(l.elem.mbits + 1)), 1.0 - vmax / std::ldexp(1.0, l.elem.emax + 1));
  const double abs = std::ldexp(1.0, l.s_min + l.elem.emax - l.elem.mbits - 1);
  const int top = l.s_max + l.elem.emax + 1;  // beyond 2^top the scale field saturates
  return {rel, abs, top >= 128 ? std::numeric_limits<double>::infinity() : std::ldexp(1.0, top), true};
}

void Codec::encode(const float* in, size_t count, uint8_t* out) const {
  if (count == 0) return;
  if (is_block_kind(kind_)) return encode_blocks(layout_of(*this), in, count, out);
  encode_elems(kind_, in, count, out);
}

void Codec::encode(const float* in, size_t count, uint8_t* out, float* decoded) const {
  if (decoded == nullptr) return encode(in, count, out);
  size_t done = 0;
  if (is_block_kind(kind_)) {
    const BlockLayout l = layout_of(*this);
    if (const BlockKernels& k = block_kernels(l); k.encode_back != nullptr) {
      done = count / l.block * l.block;
      k.encode_back(l, in, done / l.block, out, decoded);
    }
  }
  encode(in + done, count - done, out + encoded_size(done));
  decode(out + encoded_size(done), count - done, decoded + done);
}

void Codec::decode(const uint8_t* in, size_t count, float* out) const {
  if (count == 0) return;
  if (is_block_kind(kind_)) return decode_blocks(layout_of(*this), in, count, out);
  decode_elems(kind_, in, count, out);
}

// The fused calls run the unfused kernels chunk by chunk through an L1-resident buffer, so they give exactly the
// unfused bits (the add is reduce()'s float32 sum) while touching main memory once per operand.
void Codec::decode_add(const uint8_t* in, size_t count, const float* addend, float* out) const {
  size_t i = 0;
  if (is_block_kind(kind_)) {
    const BlockLayout l = layout_of(*this);
    if (const BlockKernels& k = block_kernels(l); k.decode_add != nullptr) {
      i = count / l.block * l.block;
      k.decode_add(l, in, i / l.block, addend, out);
    }
  }
  const size_t chunk = chunk_elems(block_elems());
  std::array<float, kChunkFloats> decoded;
  for (; i < count; i += chunk) {
    const size_t n = std::min(chunk, count - i);
    decode(in + encoded_size(i), n, decoded.data());
    reduce(DataType::f32, ReduceOp::sum, out + i, addend + i, decoded.data(), n);
  }
}

void Codec::feedback_step(float* x, float* residual, size_t count) const {
  const size_t chunk = chunk_elems(block_elems());
  std::array<float, kChunkFloats> decoded;
  std::array<uint8_t, 4 * kChunkFloats> encoded;  // no format takes more than 4 bytes per element
  for (size_t i = 0; i < count; i += chunk) {
    const size_t n = std::min(chunk, count - i);
    float* xs = x + i;
    float* rs = residual + i;
    reduce(DataType::f32, ReduceOp::sum, xs, xs, rs, n);
    encode(xs, n, encoded.data(), decoded.data());
    // Written on the bits (an all-ones exponent is inf or NaN) so that the loop vectorizes.
    for (size_t k = 0; k < n; ++k) {
      const float r = xs[k] - decoded[k];
      rs[k] = (std::bit_cast<uint32_t>(r) & 0x7f800000u) == 0x7f800000u ? 0.0f : r;
    }
  }
}

void Codec::decode_add_encode(const uint8_t* in, size_t count, const float* addend, uint8_t* out, float* sum) const {
  const size_t chunk = chunk_elems(block_elems());
  std::array<float, kChunkFloats> scratch;
  for (size_t i = 0; i < count; i += chunk) {
    const size_t n = std::min(chunk, count - i);
    const size_t offset = encoded_size(i);
    float* s = sum != nullptr ? sum + i : scratch.data();
    decode_add(in + offset, n, addend + i, s);  // reads the chunk's codes before encode overwrites them in place
    encode(s, n, out + offset);
  }
}

}  // namespace smartcoll
