// Tests for the element-wise reduction kernels: values against independent references, exact bits of the float16
// and bfloat16 converters, and bit-identical output across every SIMD level the CPU supports.
#include "smartcoll/reduce.h"

#include <gtest/gtest.h>

#include "simd_levels.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TEST_X86 1
#else
#define TEST_X86 0
#endif

namespace smartcoll {
namespace {

using Bytes = std::vector<uint8_t>;

constexpr size_t kCounts[] = {0, 1, 7, 31, 33, 1000, 4099};

using test_support::LevelGuard;
using test_support::supported_levels;

uint32_t f32_bits(float f) { return std::bit_cast<uint32_t>(f); }
float f32_from(uint32_t b) { return std::bit_cast<float>(b); }

template <class T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

// One element as text: raw bits plus the value, for failure messages.
std::string show(DataType t, const uint8_t* p) {
  char buf[96];
  switch (t) {
    case DataType::f32:
      std::snprintf(buf, sizeof buf, "0x%08x (%.9g)", get<uint32_t>(p), static_cast<double>(get<float>(p)));
      break;
    case DataType::f64:
      std::snprintf(buf, sizeof buf, "0x%016llx (%.17g)", static_cast<unsigned long long>(get<uint64_t>(p)),
                    get<double>(p));
      break;
    case DataType::f16:
      std::snprintf(buf, sizeof buf, "0x%04x (%.9g)", get<uint16_t>(p),
                    static_cast<double>(half_to_float(get<uint16_t>(p))));
      break;
    case DataType::bf16:
      std::snprintf(buf, sizeof buf, "0x%04x (%.9g)", get<uint16_t>(p),
                    static_cast<double>(bf16_to_float(get<uint16_t>(p))));
      break;
    case DataType::i8: std::snprintf(buf, sizeof buf, "%d", get<int8_t>(p)); break;
    case DataType::u8: std::snprintf(buf, sizeof buf, "%u", get<uint8_t>(p)); break;
    case DataType::i32: std::snprintf(buf, sizeof buf, "%d", get<int32_t>(p)); break;
    case DataType::i64: std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(get<int64_t>(p))); break;
  }
  return buf;
}

bool is_nan_elem(DataType t, const uint8_t* p) {
  switch (t) {
    case DataType::f32: return std::isnan(get<float>(p));
    case DataType::f64: return std::isnan(get<double>(p));
    case DataType::f16: return std::isnan(half_to_float(get<uint16_t>(p)));
    case DataType::bf16: return std::isnan(bf16_to_float(get<uint16_t>(p)));
    default: return false;
  }
}

// Empty when equal; otherwise names the first differing element. With nan_equal, any two NaNs count as equal
// (for references that do not model NaN payloads).
std::string first_mismatch(DataType t, const Bytes& got, const Bytes& want, size_t count, const Bytes* a = nullptr,
                           const Bytes* b = nullptr, bool nan_equal = false) {
  const size_t sz = dtype_size(t);
  for (size_t i = 0; i < count; ++i) {
    const uint8_t* g = got.data() + i * sz;
    const uint8_t* w = want.data() + i * sz;
    if (std::memcmp(g, w, sz) == 0) continue;
    if (nan_equal && is_nan_elem(t, g) && is_nan_elem(t, w)) continue;
    std::string msg = "first mismatch at index " + std::to_string(i) + " of " + std::to_string(count) +
                      ": got " + show(t, g) + ", want " + show(t, w);
    if (a && b) msg += "; inputs a=" + show(t, a->data() + i * sz) + " b=" + show(t, b->data() + i * sz);
    return msg;
  }
  return {};
}

std::string label(SimdLevel level, DataType t, ReduceOp op, size_t count) {
  return std::string(simd_name(level)) + " " + std::string(dtype_name(t)) + " " + std::string(op_name(op)) +
         " count=" + std::to_string(count);
}

// Random element bits. With specials, about a quarter are NaN (random sign, payload, quiet bit), Inf, signed zero
// or denormal; the rest are normal numbers, mostly of moderate magnitude so sums mix operands of similar scale.
class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}

  void fill(DataType t, Bytes& buf, size_t count, bool specials) {
    buf.assign(count * dtype_size(t), 0);
    for (size_t i = 0; i < count; ++i) {
      uint8_t* p = buf.data() + i * dtype_size(t);
      switch (t) {
        case DataType::f32: put(p, static_cast<uint32_t>(floating(32, 8, 23, specials))); break;
        case DataType::f64: put(p, floating(64, 11, 52, specials)); break;
        case DataType::f16: put(p, static_cast<uint16_t>(floating(16, 5, 10, specials))); break;
        case DataType::bf16: put(p, static_cast<uint16_t>(floating(16, 8, 7, specials))); break;
        default: {
          const uint64_t r = rng_();
          // Small magnitudes now and then so min/max and prod see ties and non-wrapping results too.
          const uint64_t v = (r & 3) == 0 ? (r >> 8) % 5 : r >> 8 | (r << 56);
          std::memcpy(p, &v, dtype_size(t));
        }
      }
    }
  }

 private:
  uint64_t floating(int width, int exp_bits, int mant_bits, bool specials) {
    const uint64_t sign = (rng_() & 1) << (width - 1);
    const uint64_t exp_max = (1ull << exp_bits) - 1;
    const uint64_t mant_mask = (1ull << mant_bits) - 1;
    const uint64_t mant = rng_() & mant_mask;
    const unsigned kind = static_cast<unsigned>(rng_() % 16);
    if (specials) {
      if (kind < 2) return sign | (exp_max << mant_bits) | (mant ? mant : 1);  // NaN
      if (kind == 2) return sign | (exp_max << mant_bits);                     // Inf
      if (kind == 3) return sign;                                              // signed zero
      if (kind == 4) return sign | (mant ? mant : 1);                          // denormal
    }
    uint64_t exp;
    if (kind == 5) {
      exp = 1 + rng_() % (exp_max - 1);  // anywhere in the normal range
    } else {
      const uint64_t bias = exp_max / 2;
      const uint64_t spread = exp_bits <= 5 ? 4 : 10;
      exp = bias - spread + rng_() % (2 * spread + 1);
    }
    return sign | (exp << mant_bits) | mant;
  }

  std::mt19937_64 rng_;
};

// ---------------------------------------------------------------------------------------------------------------
// Reference: f32 in double, f64 in double, f16/bf16 widened to float and rounded back by the scalar converters,
// integers exactly (in __int128) and then wrapped to the type.

template <class F>
F ref_float_op(ReduceOp op, F x, F y) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return x + y;
    case ReduceOp::prod: return x * y;
    case ReduceOp::min: return std::isnan(x) ? x : (x < y ? x : y);
    case ReduceOp::max: return std::isnan(x) ? x : (x > y ? x : y);
  }
  return x;
}

template <class T>
T ref_int_op(ReduceOp op, T x, T y) {
  const __int128 a = x;
  const __int128 b = y;
  __int128 r = 0;
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: r = a + b; break;
    case ReduceOp::prod: r = a * b; break;
    case ReduceOp::min: r = a < b ? a : b; break;
    case ReduceOp::max: r = a > b ? a : b; break;
  }
  return static_cast<T>(static_cast<std::make_unsigned_t<T>>(static_cast<unsigned __int128>(r)));
}

void reference(DataType t, ReduceOp op, const uint8_t* a, const uint8_t* b, uint8_t* out) {
  switch (t) {
    case DataType::f32:
      put(out, static_cast<float>(ref_float_op<double>(op, get<float>(a), get<float>(b))));
      break;
    case DataType::f64: put(out, ref_float_op<double>(op, get<double>(a), get<double>(b))); break;
    case DataType::f16:
      put(out, float_to_half(
                   ref_float_op<float>(op, half_to_float(get<uint16_t>(a)), half_to_float(get<uint16_t>(b)))));
      break;
    case DataType::bf16:
      put(out, float_to_bf16(
                   ref_float_op<float>(op, bf16_to_float(get<uint16_t>(a)), bf16_to_float(get<uint16_t>(b)))));
      break;
    case DataType::i8: put(out, ref_int_op<int8_t>(op, get<int8_t>(a), get<int8_t>(b))); break;
    case DataType::u8: put(out, ref_int_op<uint8_t>(op, get<uint8_t>(a), get<uint8_t>(b))); break;
    case DataType::i32: put(out, ref_int_op<int32_t>(op, get<int32_t>(a), get<int32_t>(b))); break;
    case DataType::i64: put(out, ref_int_op<int64_t>(op, get<int64_t>(a), get<int64_t>(b))); break;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Converters.

TEST(ReduceConvert, HalfKnownBits) {
  struct Case {
    uint32_t f;
    uint16_t h;
  };
  const Case cases[] = {
      {0x3f800000, 0x3c00},  // 1.0
      {0xc0000000, 0xc000},  // -2.0
      {0x477fe000, 0x7bff},  // 65504, largest half
      {0x477fefff, 0x7bff},  // just below 65520 rounds down
      {0x477ff000, 0x7c00},  // 65520: the tie rounds to even, which is Inf
      {0x7f800000, 0x7c00},  // Inf
      {0xff800000, 0xfc00},  // -Inf
      {0x7f7fffff, 0x7c00},  // FLT_MAX overflows
      {0x33800000, 0x0001},  // 2^-24, smallest denormal
      {0x33000000, 0x0000},  // 2^-25: tie between 0 and 2^-24 goes to 0
      {0x33000001, 0x0001},  // just above the tie
      {0x33c00000, 0x0002},  // 1.5 * 2^-24: tie between 1 and 2 units goes to 2
      {0x34200000, 0x0002},  // 2.5 * 2^-24: tie between 2 and 3 units goes to 2
      {0x387fc000, 0x03ff},  // largest denormal
      {0x387fe000, 0x0400},  // tie between largest denormal and smallest normal goes to the (even) normal
      {0x38800000, 0x0400},  // 2^-14, smallest normal
      {0x00000001, 0x0000},  // float denormal
      {0x80000001, 0x8000},
      {0x80000000, 0x8000},  // -0.0
      {0x3f801000, 0x3c00},  // 1 + 2^-11: tie between 1.0 and 1 + 2^-10 goes to 1.0
      {0x3f803000, 0x3c02},  // 1 + 3 * 2^-11: tie goes up to the even 1 + 2^-9
      {0x3f801001, 0x3c01},  // just above a tie
      {0x7fc00000, 0x7e00},  // quiet NaN
      {0x7f800001, 0x7e00},  // signalling NaN gets the quiet bit
      {0xff812345, 0xfe09},  // payload's top bits and sign are kept
  };
  for (const Case& c : cases) {
    EXPECT_EQ(float_to_half(f32_from(c.f)), c.h) << std::hex << "float bits 0x" << c.f;
  }
  EXPECT_EQ(f32_bits(half_to_float(0x3c00)), 0x3f800000u);
  EXPECT_EQ(f32_bits(half_to_float(0xc000)), 0xc0000000u);
  EXPECT_EQ(f32_bits(half_to_float(0x7bff)), 0x477fe000u);
  EXPECT_EQ(f32_bits(half_to_float(0x7c00)), 0x7f800000u);
  EXPECT_EQ(f32_bits(half_to_float(0x0001)), 0x33800000u);
  EXPECT_EQ(f32_bits(half_to_float(0x8000)), 0x80000000u);
  EXPECT_EQ(f32_bits(half_to_float(0x7e00)), 0x7fc00000u);
  EXPECT_EQ(f32_bits(half_to_float(0x7d00)), 0x7fe00000u);  // signalling NaN widens quiet, as F16C does
}

TEST(ReduceConvert, HalfAllValues) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint32_t exp = (h >> 10) & 0x1f;
    const uint32_t mant = h & 0x3ff;
    const float f = half_to_float(static_cast<uint16_t>(h));
    if (exp == 0x1f && mant != 0) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_EQ(float_to_half(f), h | 0x200) << std::hex << h;
      continue;
    }
    const double mag = exp == 0x1f ? INFINITY
                       : exp == 0  ? std::ldexp(static_cast<double>(mant), -24)
                                   : std::ldexp(static_cast<double>(mant | 0x400), static_cast<int>(exp) - 25);
    const double want = (h & 0x8000) ? -mag : mag;
    ASSERT_EQ(f32_bits(f), f32_bits(static_cast<float>(want))) << std::hex << h;
    ASSERT_EQ(float_to_half(f), h) << std::hex << h;
  }
}

// Every midpoint between adjacent finite halves must round to the even one; a float ulp either side must not.
TEST(ReduceConvert, HalfTiesToEven) {
  for (uint32_t sign : {0u, 0x8000u}) {
    for (uint32_t h = 0; h < 0x7bff; ++h) {
      const double lo = half_to_float(static_cast<uint16_t>(h | sign));
      const double hi = half_to_float(static_cast<uint16_t>((h + 1) | sign));
      const float mid = static_cast<float>((lo + hi) / 2);
      ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2) << "midpoint not exact in float";
      const uint32_t even = (h & 1) ? h + 1 : h;
      ASSERT_EQ(float_to_half(mid), even | sign) << std::hex << "between 0x" << h << " and 0x" << h + 1;
      const float toward_lo = std::nextafter(mid, static_cast<float>(lo));
      const float toward_hi = std::nextafter(mid, static_cast<float>(hi));
      ASSERT_EQ(float_to_half(toward_lo), h | sign) << std::hex << h;
      ASSERT_EQ(float_to_half(toward_hi), (h + 1) | sign) << std::hex << h;
    }
  }
}

#if TEST_X86
__attribute__((target("avx2,f16c"))) uint16_t f16c_to_half(float f) {
  return static_cast<uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0));
}
__attribute__((target("avx2,f16c"))) float f16c_to_float(uint16_t h) {
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

// The scalar converters must agree with the hardware ones the SIMD paths use. All 65536 halves, and a sample of
// floats that covers every exponent with random mantissas (an exhaustive run over 2^32 floats also agreed).
TEST(ReduceConvert, HalfMatchesF16C) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("f16c") || !__builtin_cpu_supports("avx2")) GTEST_SKIP() << "no F16C";
  for (uint32_t h = 0; h < 0x10000; ++h) {
    ASSERT_EQ(f32_bits(half_to_float(static_cast<uint16_t>(h))), f32_bits(f16c_to_float(static_cast<uint16_t>(h))))
        << std::hex << "half 0x" << h;
  }
  std::mt19937 rng(7);
  for (uint64_t hi = 0; hi < (1u << 9); ++hi) {  // sign and exponent
    for (int k = 0; k < 4096; ++k) {
      uint32_t mant = rng() & 0x7fffff;
      if (k < 64) mant = (mant & ~0x1fffu) | (k < 32 ? 0x1000u : 0u);  // exact ties and exact halves
      const float f = f32_from(static_cast<uint32_t>(hi << 23) | mant);
      ASSERT_EQ(float_to_half(f), f16c_to_half(f)) << std::hex << "float bits 0x" << f32_bits(f);
    }
  }
}
#endif

TEST(ReduceConvert, Bf16KnownBits) {
  struct Case {
    uint32_t f;
    uint16_t h;
  };
  const Case cases[] = {
      {0x3f800000, 0x3f80},  // 1.0
      {0xc0000000, 0xc000},  // -2.0
      {0x3f808000, 0x3f80},  // tie between 0x3f80 and 0x3f81 goes to the even 0x3f80
      {0x3f818000, 0x3f82},  // tie between 0x3f81 and 0x3f82 goes to the even 0x3f82
      {0x3f808001, 0x3f81},  // just above a tie
      {0x3f807fff, 0x3f80},  // just below a tie
      {0x7f7f7fff, 0x7f7f},  // largest finite stays finite
      {0x7f7fffff, 0x7f80},  // FLT_MAX rounds up to Inf
      {0x7f800000, 0x7f80},  // Inf
      {0xff800000, 0xff80},  // -Inf
      {0x80000000, 0x8000},  // -0.0
      {0x00010000, 0x0001},  // smallest bf16 denormal
      {0x00008000, 0x0000},  // tie between 0 and the smallest denormal goes to 0
      {0x00018000, 0x0002},  // tie between 1 and 2 units goes to 2
      {0x7fc00000, 0x7fc0},  // quiet NaN
      {0x7f800001, 0x7fc0},  // signalling NaN with a payload only in the dropped bits stays a NaN
      {0xff812345, 0xffc1},  // sign and top payload bits kept, quiet bit set
  };
  for (const Case& c : cases) {
    EXPECT_EQ(float_to_bf16(f32_from(c.f)), c.h) << std::hex << "float bits 0x" << c.f;
  }
  for (uint32_t h = 0; h < 0x10000; ++h) {
    ASSERT_EQ(f32_bits(bf16_to_float(static_cast<uint16_t>(h))), h << 16) << std::hex << h;
  }
}

TEST(ReduceConvert, Bf16TiesToEven) {
  for (uint32_t sign : {0u, 0x8000u}) {
    for (uint32_t h = 0; h < 0x7f80; ++h) {
      const uint32_t base = (h | sign) << 16;
      const uint32_t even = (h & 1) ? h + 1 : h;
      ASSERT_EQ(float_to_bf16(f32_from(base | 0x8000)), even | sign) << std::hex << h;
      ASSERT_EQ(float_to_bf16(f32_from(base | 0x7fff)), h | sign) << std::hex << h;
      ASSERT_EQ(float_to_bf16(f32_from(base | 0x8001)), (h + 1) | sign) << std::hex << h;
      ASSERT_EQ(float_to_bf16(f32_from(base)), h | sign) << std::hex << h;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Kernels.

TEST(ReduceSimd, LevelSelection) {
  LevelGuard guard;
  EXPECT_EQ(simd_name(SimdLevel::scalar), "scalar");
  EXPECT_EQ(simd_name(SimdLevel::avx2), "avx2");
  EXPECT_EQ(simd_name(SimdLevel::avx512), "avx512");
  for (SimdLevel l : supported_levels()) {
    simd_force(l);
    EXPECT_EQ(simd_active(), l);
  }
  simd_force(SimdLevel::avx512);
  EXPECT_EQ(simd_active(), simd_supported()) << "simd_force must clamp to the supported level";
  std::printf("SIMD supported: %s\n", std::string(simd_name(simd_supported())).c_str());
}

TEST(ReduceKernel, MatchesReference) {
  LevelGuard guard;
  Gen gen(1);
  constexpr size_t kGuardBytes = 64;
  for (SimdLevel level : supported_levels()) {
    simd_force(level);
    for (DataType t : kAllDataTypes) {
      const size_t sz = dtype_size(t);
      for (ReduceOp op : kAllReduceOps) {
        for (size_t count : kCounts) {
          Bytes a, b;
          gen.fill(t, a, count, false);
          gen.fill(t, b, count, false);
          Bytes want(count * sz);
          for (size_t i = 0; i < count; ++i) reference(t, op, a.data() + i * sz, b.data() + i * sz, &want[i * sz]);
          // Trailing guard bytes catch a kernel that writes past count.
          Bytes got(count * sz + kGuardBytes, 0xab);
          reduce(t, op, got.data(), a.data(), b.data(), count);
          const std::string err = first_mismatch(t, got, want, count, &a, &b, /*nan_equal=*/true);
          ASSERT_TRUE(err.empty()) << label(level, t, op, count) << ": " << err;
          for (size_t i = count * sz; i < got.size(); ++i) {
            ASSERT_EQ(got[i], 0xab) << label(level, t, op, count) << ": wrote past the end at byte " << i;
          }
        }
      }
    }
  }
}

// The point of the SIMD design: whatever the level, the bits are those of the scalar path, NaN payloads included.
TEST(ReduceSimd, LevelsBitIdenticalToScalar) {
  LevelGuard guard;
  Gen gen(2);
  const size_t counts[] = {1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 1000, 4099, 65537};
  for (DataType t : kAllDataTypes) {
    for (ReduceOp op : kAllReduceOps) {
      for (size_t count : counts) {
        Bytes a, b;
        gen.fill(t, a, count, true);
        gen.fill(t, b, count, true);
        Bytes want(count * dtype_size(t));
        simd_force(SimdLevel::scalar);
        reduce(t, op, want.data(), a.data(), b.data(), count);
        for (SimdLevel level : supported_levels()) {
          if (level == SimdLevel::scalar) continue;
          simd_force(level);
          Bytes got(count * dtype_size(t));
          reduce(t, op, got.data(), a.data(), b.data(), count);
          if (std::memcmp(got.data(), want.data(), got.size()) != 0) {
            FAIL() << label(level, t, op, count) << " differs from scalar: "
                   << first_mismatch(t, got, want, count, &a, &b);
          }
        }
      }
    }
  }
}

TEST(ReduceKernel, InPlaceAliasing) {
  LevelGuard guard;
  Gen gen(3);
  for (SimdLevel level : supported_levels()) {
    simd_force(level);
    for (DataType t : kAllDataTypes) {
      for (ReduceOp op : kAllReduceOps) {
        for (size_t count : {size_t{33}, size_t{4099}}) {
          Bytes a, b;
          gen.fill(t, a, count, true);
          gen.fill(t, b, count, true);
          Bytes want(a.size());
          reduce(t, op, want.data(), a.data(), b.data(), count);

          Bytes d = a;
          reduce(t, op, d.data(), d.data(), b.data(), count);
          std::string err = first_mismatch(t, d, want, count, &a, &b);
          ASSERT_TRUE(err.empty()) << label(level, t, op, count) << " dst == a: " << err;

          d = b;
          reduce(t, op, d.data(), a.data(), d.data(), count);
          err = first_mismatch(t, d, want, count, &a, &b);
          ASSERT_TRUE(err.empty()) << label(level, t, op, count) << " dst == b: " << err;

          Bytes self_want(a.size());
          reduce(t, op, self_want.data(), a.data(), a.data(), count);
          d = a;
          reduce(t, op, d.data(), d.data(), d.data(), count);
          err = first_mismatch(t, d, self_want, count, &a, &a);
          ASSERT_TRUE(err.empty()) << label(level, t, op, count) << " dst == a == b: " << err;
        }
      }
    }
  }
}

// NaN rules, with exact bits: arithmetic gives a's payload (quieted) when a is NaN, else b's; min/max return a when
// a is NaN and otherwise whatever the comparison picks, so a NaN in b comes through too.
TEST(ReduceKernel, NanAndSignedZeroRules) {
  LevelGuard guard;
  struct Case {
    uint32_t a, b, sum, min, max;
  };
  const uint32_t one = 0x3f800000;
  const Case cases[] = {
      {0x7fc12345, one, 0x7fc12345, 0x7fc12345, 0x7fc12345},  // quiet NaN in a
      {0x7f812345, one, 0x7fc12345, 0x7f812345, 0x7f812345},  // signalling NaN in a: min/max return it as is
      {one, 0xff812345, 0xffc12345, 0xff812345, 0xff812345},  // NaN in b propagates
      {0x7fc00001, 0xffc00002, 0x7fc00001, 0x7fc00001, 0x7fc00001},  // two NaNs: a wins
      {0xffc00003, 0x7f800005, 0xffc00003, 0xffc00003, 0xffc00003},
      {0x80000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000},  // -0 vs +0: not less, not greater: b
      {0x00000000, 0x80000000, 0x00000000, 0x80000000, 0x80000000},
      {0x7f800000, one, 0x7f800000, one, 0x7f800000},
  };
  constexpr size_t kCases = std::size(cases);
  constexpr size_t count = 67;  // several full vectors plus a tail, at every level
  std::vector<float> a(count), b(count), out(count);
  for (size_t i = 0; i < count; ++i) {
    a[i] = f32_from(cases[i % kCases].a);
    b[i] = f32_from(cases[i % kCases].b);
  }
  for (SimdLevel level : supported_levels()) {
    simd_force(level);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::min, ReduceOp::max}) {
      reduce(DataType::f32, op, out.data(), a.data(), b.data(), count);
      for (size_t i = 0; i < count; ++i) {
        const Case& c = cases[i % kCases];
        const uint32_t want = op == ReduceOp::sum ? c.sum : op == ReduceOp::min ? c.min : c.max;
        ASSERT_EQ(f32_bits(out[i]), want) << std::hex << simd_name(level) << " " << op_name(op) << " index " << i
                                          << " a=0x" << c.a << " b=0x" << c.b;
      }
    }
  }

  // Inf - Inf makes a NaN (its payload is the CPU's default NaN; only NaN-ness is portable).
  const float inf = std::numeric_limits<float>::infinity();
  float x = inf, y = -inf, r = 0;
  reduce(DataType::f32, ReduceOp::sum, &r, &x, &y, 1);
  EXPECT_TRUE(std::isnan(r));

  // float16 and bfloat16 round through float, so a NaN that survives min/max comes back quieted.
  for (SimdLevel level : supported_levels()) {
    simd_force(level);
    const uint16_t h_one = 0x3c00;
    std::vector<uint16_t> ha(count, 0x7d01), hb(count, h_one), hout(count);
    reduce(DataType::f16, ReduceOp::min, hout.data(), ha.data(), hb.data(), count);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(hout[i], 0x7f01) << simd_name(level) << " f16 index " << i;
    reduce(DataType::f16, ReduceOp::sum, hout.data(), hb.data(), ha.data(), count);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(hout[i], 0x7f01) << simd_name(level) << " f16 index " << i;

    const uint16_t b_one = 0x3f80;
    std::vector<uint16_t> ba(count, b_one), bb(count, 0xff81), bout(count);
    reduce(DataType::bf16, ReduceOp::max, bout.data(), ba.data(), bb.data(), count);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(bout[i], 0xffc1) << simd_name(level) << " bf16 index " << i;
  }
}

TEST(ReduceKernel, IntegersWrapAround) {
  LevelGuard guard;
  for (SimdLevel level : supported_levels()) {
    simd_force(level);
    int8_t i8a[] = {127, -128, 100}, i8b[] = {1, -1, 3}, i8o[3];
    reduce(DataType::i8, ReduceOp::sum, i8o, i8a, i8b, 3);
    EXPECT_EQ(i8o[0], -128);
    EXPECT_EQ(i8o[1], 127);
    reduce(DataType::i8, ReduceOp::prod, i8o, i8a, i8b, 3);
    EXPECT_EQ(i8o[2], 44);  // 300 mod 256

    uint8_t u8a[] = {255, 16}, u8b[] = {1, 16}, u8o[2];
    reduce(DataType::u8, ReduceOp::sum, u8o, u8a, u8b, 2);
    EXPECT_EQ(u8o[0], 0);
    reduce(DataType::u8, ReduceOp::prod, u8o, u8a, u8b, 2);
    EXPECT_EQ(u8o[1], 0);

    std::vector<int32_t> i32a(37, std::numeric_limits<int32_t>::max()), i32b(37, 1), i32o(37);
    reduce(DataType::i32, ReduceOp::sum, i32o.data(), i32a.data(), i32b.data(), 37);
    for (int32_t v : i32o) ASSERT_EQ(v, std::numeric_limits<int32_t>::min()) << simd_name(level);
    std::fill(i32a.begin(), i32a.end(), 65536);
    reduce(DataType::i32, ReduceOp::prod, i32o.data(), i32a.data(), i32a.data(), 37);
    for (int32_t v : i32o) ASSERT_EQ(v, 0) << simd_name(level);

    int64_t i64a = std::numeric_limits<int64_t>::max(), i64b = 1, i64o = 0;
    reduce(DataType::i64, ReduceOp::sum, &i64o, &i64a, &i64b, 1);
    EXPECT_EQ(i64o, std::numeric_limits<int64_t>::min());
  }
}

// ---------------------------------------------------------------------------------------------------------------
// scale_divide.

void scale_reference(DataType t, uint8_t* p, double divisor) {
  const auto fd = static_cast<float>(divisor);
  switch (t) {
    case DataType::f32: put(p, get<float>(p) / fd); break;
    case DataType::f64: put(p, get<double>(p) / divisor); break;
    case DataType::f16: put(p, float_to_half(half_to_float(get<uint16_t>(p)) / fd)); break;
    case DataType::bf16: put(p, float_to_bf16(bf16_to_float(get<uint16_t>(p)) / fd)); break;
    default: break;
  }
}

TEST(ReduceScale, MatchesReferenceAndScalar) {
  LevelGuard guard;
  Gen gen(4);
  const double divisors[] = {3.0, 0.1, -7.5, 1e-30, 1e30, 0.0};
  for (DataType t : {DataType::f32, DataType::f64, DataType::f16, DataType::bf16}) {
    for (double divisor : divisors) {
      for (size_t count : kCounts) {
        Bytes finite;
        gen.fill(t, finite, count, false);
        Bytes want = finite;
        for (size_t i = 0; i < count; ++i) scale_reference(t, want.data() + i * dtype_size(t), divisor);

        Bytes special;
        gen.fill(t, special, count, true);
        Bytes scalar_out = special;
        simd_force(SimdLevel::scalar);
        scale_divide(t, scalar_out.data(), count, divisor);

        for (SimdLevel level : supported_levels()) {
          simd_force(level);
          const std::string what = std::string(simd_name(level)) + " " + std::string(dtype_name(t)) +
                                   " divisor=" + std::to_string(divisor) + " count=" + std::to_string(count);
          Bytes got = finite;
          scale_divide(t, got.data(), count, divisor);
          std::string err = first_mismatch(t, got, want, count, &finite, &finite, /*nan_equal=*/true);
          ASSERT_TRUE(err.empty()) << what << ": " << err;

          got = special;
          scale_divide(t, got.data(), count, divisor);
          err = first_mismatch(t, got, scalar_out, count, &special, &special);
          ASSERT_TRUE(err.empty()) << what << " differs from scalar: " << err;
        }
      }
    }
  }
}

TEST(ReduceScale, AverageOfSums) {
  // avg combines as sum; dividing by the rank count afterwards gives the mean.
  std::vector<float> a = {1, 2, 3, 4.5f}, b = {3, 4, 5, -4.5f}, out(4);
  reduce(DataType::f32, ReduceOp::avg, out.data(), a.data(), b.data(), 4);
  scale_divide(DataType::f32, out.data(), 4, 2.0);
  EXPECT_EQ(out, (std::vector<float>{2, 3, 4, 0}));
}

TEST(ReduceScale, RejectsIntegerTypes) {
  int64_t x[4] = {};
  for (DataType t : {DataType::i8, DataType::u8, DataType::i32, DataType::i64}) {
    try {
      scale_divide(t, x, 1, 2.0);
      ADD_FAILURE() << "scale_divide accepted " << dtype_name(t);
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(dtype_name(t)), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace smartcoll
