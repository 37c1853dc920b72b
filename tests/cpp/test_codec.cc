// Tests for the wire codecs: names and sizes, a few hand-worked encodings, special values, the error bound, and the
// properties the collectives rely on: SIMD == scalar bit for bit, pieces == whole, fused == unfused.
// (Bit-exactness against an independent reference quantizer is in tests/python/test_codec.py.)
#include "smartcoll/codec.h"

#include <gtest/gtest.h>

#include "simd_levels.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "smartcoll/reduce.h"
#include "smartcoll/types.h"

namespace smartcoll {
namespace {

using Bytes = std::vector<uint8_t>;
using Floats = std::vector<float>;

using test_support::LevelGuard;
using test_support::supported_levels;

// Every preset plus BFP variants that exercise other element widths, exponent widths and block lengths (including
// ones that are and are not a multiple of the SIMD widths).
std::vector<Codec> all_codecs() {
  std::vector<Codec> out;
  for (const std::string& n : Codec::names()) out.push_back(Codec::parse(n));
  for (const char* n : {"bfp:block=32,mant=7,exp=8", "bfp:block=8,mant=7,exp=8", "bfp:block=16,mant=7,exp=5",
                        "bfp:block=13,mant=3,exp=8", "bfp:block=64,mant=15,exp=8", "bfp:block=5,mant=1,exp=1",
                        "bfp:block=48,mant=7,exp=3"}) {
    out.push_back(Codec::parse(n));
  }
  return out;
}

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }
float from_bits(uint32_t b) { return std::bit_cast<float>(b); }

// Gradient-like data over many magnitudes, with special values sprinkled in when `specials` is set.
Floats random_data(size_t n, uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> scale_exp(-40, 40);
  std::uniform_int_distribution<int> pick(0, 199);
  Floats x(n);
  float block_scale = 1.0f;
  for (size_t i = 0; i < n; ++i) {
    if (i % 16 == 0) block_scale = std::ldexp(1.0f, scale_exp(rng));
    x[i] = normal(rng) * block_scale;
    if (!specials) continue;
    switch (pick(rng)) {
      case 0: x[i] = std::numeric_limits<float>::quiet_NaN(); break;
      case 1: x[i] = -std::numeric_limits<float>::infinity(); break;
      case 2: x[i] = std::numeric_limits<float>::infinity(); break;
      case 3: x[i] = -0.0f; break;
      case 4: x[i] = std::numeric_limits<float>::denorm_min() * static_cast<float>(1 + pick(rng)); break;
      case 5: x[i] = std::numeric_limits<float>::max(); break;
      case 6: x[i] = from_bits(0x7f800001u); break;  // signalling NaN
      case 7: x[i] = 0.0f; break;
      default: break;
    }
  }
  return x;
}

Bytes encode(const Codec& c, const Floats& x) {
  Bytes out(c.encoded_size(x.size()));
  c.encode(x.data(), x.size(), out.data());
  return out;
}

Floats decode(const Codec& c, const Bytes& in, size_t count) {
  Floats out(count);
  c.decode(in.data(), count, out.data());
  return out;
}

std::vector<uint32_t> float_bits(const Floats& x) {
  std::vector<uint32_t> b(x.size());
  std::transform(x.begin(), x.end(), b.begin(), bits);
  return b;
}

std::vector<size_t> interesting_counts(const Codec& c) {
  const size_t b = c.block_elems();
  std::vector<size_t> counts{0, 1, 2, 3, 7, b - 1, b, b + 1, 2 * b + 3, 1000, 4099};
  counts.erase(std::remove(counts.begin(), counts.end(), size_t{0}), counts.end());
  counts.push_back(0);
  return counts;
}

TEST(CodecNames, PresetsRoundTrip) {
  for (const std::string& n : Codec::names()) {
    const Codec c = Codec::parse(n);
    EXPECT_EQ(c.name(), n);
    EXPECT_EQ(Codec::parse(c.name()), c);
  }
  EXPECT_EQ(Codec::parse("none"), Codec::parse("identity"));
}

TEST(CodecNames, BfpParameters) {
  const Codec c = Codec::parse("bfp:mant=5,block=64");
  EXPECT_EQ(c.kind(), CodecKind::bfp);
  EXPECT_EQ(c.block(), 64);
  EXPECT_EQ(c.mant_bits(), 5);
  EXPECT_EQ(c.exp_bits(), 8);
  EXPECT_EQ(c.name(), "bfp:block=64,mant=5,exp=8");
  EXPECT_EQ(Codec::parse(c.name()), c);
  EXPECT_EQ(Codec::parse("bfp:block=16,mant=7,exp=8").name(), "bfp16");
  EXPECT_EQ(Codec::parse("bfp:"), Codec::parse("bfp16"));
}

TEST(CodecNames, ElementBits) {
  EXPECT_EQ(Codec::parse("mxfp8_e4m3").exp_bits(), 4);
  EXPECT_EQ(Codec::parse("mxfp8_e4m3").mant_bits(), 3);
  EXPECT_EQ(Codec::parse("mxfp4_e2m1").mant_bits(), 1);
  EXPECT_EQ(Codec::parse("mxint8").exp_bits(), 0);
  EXPECT_EQ(Codec::parse("mxint8").mant_bits(), 7);
  EXPECT_EQ(Codec::parse("mxint8").block(), 32);
}

TEST(CodecNames, RejectsBadNames) {
  for (const char* n : {"", "bfp", "mxfp8", "bfp:block=0", "bfp:block=4097", "bfp:mant=16", "bfp:exp=9",
                        "bfp:mant=0", "bfp:block=16,block=16", "bfp:size=3", "bfp:block", "bfp:block=1x",
                        "bfp:block=", "bfp:block=-1", "FP16", "bfp:block=16,", "bfp:,block=16",
                        "bfp:block=16,,mant=7"}) {
    EXPECT_THROW(Codec::parse(n), InvalidArgument) << n;
  }
  try {
    Codec::parse("zstd");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("mxfp4_e2m1"), std::string::npos) << e.what();
  }
}

TEST(CodecFeedback, StepIsAddEncodeDecodeSubtractInFloat32) {
  // x += r; r = x - decode(encode(x)), non-finite r stored as 0: against those steps on the whole buffer, at sizes
  // on both sides of the step's pieces, with values beyond fp16's range and non-finite ones.
  std::mt19937 gen(3);
  std::normal_distribution<float> dist(0.0f, 100.0f);
  for (const char* name : {"bfp16", "mxfp8_e4m3", "fp16", "bfp:block=7,mant=5,exp=6"})
    for (size_t n : {size_t{1}, size_t{2047}, size_t{2048}, size_t{5000}}) {
      const Codec c = Codec::parse(name);
      std::vector<float> x(n), r(n);
      for (size_t i = 0; i < n; ++i) x[i] = dist(gen), r[i] = dist(gen) / 1000;
      x[n / 2] = n > 2 ? std::numeric_limits<float>::infinity() : x[n / 2];
      if (n > 3) x[n / 3] = 1e30f;
      std::vector<float> want_x(x), want_r(n), decoded(n);
      for (size_t i = 0; i < n; ++i) want_x[i] += r[i];
      std::vector<uint8_t> enc(c.encoded_size(n));
      c.encode(want_x.data(), n, enc.data());
      c.decode(enc.data(), n, decoded.data());
      for (size_t i = 0; i < n; ++i) {
        want_r[i] = want_x[i] - decoded[i];
        if (!std::isfinite(want_r[i])) want_r[i] = 0;
      }
      c.feedback_step(x.data(), r.data(), n);
      EXPECT_EQ(std::memcmp(x.data(), want_x.data(), n * 4), 0) << name << " n=" << n;
      EXPECT_EQ(std::memcmp(r.data(), want_r.data(), n * 4), 0) << name << " n=" << n;
    }
}

TEST(CodecSizes, ExactBytes) {
  struct Case {
    const char* name;
    size_t count;
    size_t bytes;
  };
  const Case cases[] = {
      {"identity", 5, 20},       {"fp16", 5, 10},          {"bf16", 0, 0},           {"bfp16", 16, 17},
      {"bfp16", 17, 19},         {"bfp16", 1, 2},          {"bfp16", 32, 34},        {"mxint8", 32, 33},
      {"mxfp8_e4m3", 33, 35},    {"mxfp8_e5m2", 31, 32},   {"mxfp6_e3m2", 32, 25},   {"mxfp6_e2m3", 1, 2},
      {"mxfp6_e2m3", 3, 4},      {"mxfp6_e2m3", 4, 4},     {"mxfp6_e2m3", 5, 5},     {"mxfp4_e2m1", 32, 17},
      {"mxfp4_e2m1", 3, 3},      {"mxfp4_e2m1", 64, 34},   {"bfp:block=13,mant=3,exp=8", 13, 8},
      {"bfp:block=64,mant=15,exp=8", 64, 129},             {"bfp:block=5,mant=1,exp=1", 7, 5},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Codec::parse(c.name).encoded_size(c.count), c.bytes) << c.name << " " << c.count;
  }
}

TEST(CodecSizes, Ratios) {
  EXPECT_DOUBLE_EQ(Codec::parse("identity").ratio(), 1.0);
  EXPECT_DOUBLE_EQ(Codec::parse("bf16").ratio(), 2.0);
  EXPECT_DOUBLE_EQ(Codec::parse("bfp16").ratio(), 64.0 / 17.0);
  EXPECT_DOUBLE_EQ(Codec::parse("mxfp8_e4m3").ratio(), 128.0 / 33.0);
  EXPECT_DOUBLE_EQ(Codec::parse("mxfp6_e2m3").ratio(), 128.0 / 25.0);
  EXPECT_DOUBLE_EQ(Codec::parse("mxfp4_e2m1").ratio(), 128.0 / 17.0);
}

TEST(CodecSizes, SizeIsSumOfBlocks) {
  for (const Codec& c : all_codecs()) {
    const size_t b = c.block_elems();
    for (size_t n : interesting_counts(c)) {
      const size_t full = n / b;
      EXPECT_EQ(c.encoded_size(n), full * c.encoded_size(b) + c.encoded_size(n - full * b)) << c.name() << " " << n;
    }
  }
}

// Hand-worked encodings, one per element family.
TEST(CodecKnownValues, Bfp16) {
  Floats x(16, 0.0f);
  x[0] = 1.0f;     // block max: shared exponent 127 (2^0), magnitude 1.0 * 64
  x[1] = -0.5f;    // sign | 32
  x[2] = 0.1f;     // 0.1 * 64 = 6.4 -> 6
  x[3] = 1.9999f;  // 127.99 -> 128 saturates at 127
  x[4] = -0.0f;
  x[5] = 3.0f / 128;  // 1.5 -> ties to even: 2
  x[6] = 5.0f / 128;  // 2.5 -> ties to even: 2
  const Bytes e = encode(Codec::parse("bfp16"), x);
  ASSERT_EQ(e.size(), 17u);
  EXPECT_EQ(e[0], 127);
  EXPECT_EQ(e[1], 0x40);
  EXPECT_EQ(e[2], 0x80 | 32);
  EXPECT_EQ(e[3], 6);
  EXPECT_EQ(e[4], 127);
  EXPECT_EQ(e[5], 0x80);
  EXPECT_EQ(e[6], 2);
  EXPECT_EQ(e[7], 2);
  const Floats d = decode(Codec::parse("bfp16"), e, 16);
  EXPECT_EQ(d[1], -0.5f);
  EXPECT_EQ(d[3], 127.0f / 64);
  EXPECT_EQ(bits(d[4]), 0x80000000u);
}

TEST(CodecKnownValues, MxFp8E4M3) {
  Floats x(32, 0.0f);
  x[0] = 1.0f;  // max: scale 2^(0 - 8), element 256 = E4M3 exponent 15, mantissa 0
  x[1] = -std::ldexp(3.0f, -17);  // 3 * 2^-9 in element units: subnormal 0b0000'011
  x[2] = 1.96875f;      // 504 saturates at 448 (0x7e), never the NaN code 0x7f
  const Codec c = Codec::parse("mxfp8_e4m3");
  const Bytes e = encode(c, x);
  ASSERT_EQ(e.size(), 33u);
  EXPECT_EQ(e[0], 127 - 8);
  EXPECT_EQ(e[1], 0x78);
  EXPECT_EQ(e[2], 0x80 | 0x03);
  EXPECT_EQ(e[3], 0x7e);
  const Floats d = decode(c, e, 32);
  EXPECT_EQ(d[0], 1.0f);
  EXPECT_EQ(d[1], -std::ldexp(3.0f, -17));
  EXPECT_EQ(d[2], 1.75f);
}

TEST(CodecKnownValues, MxInt8AndE5M2AndFp4) {
  Floats x(32, 0.0f);
  x[0] = 1.5f;
  x[1] = -1.0f;
  x[2] = 1.0f / 128;  // 0.5 in units of 2^-6: ties to even, 0
  x[3] = 3.0f / 128;  // 1.5 -> 2
  const Bytes i8 = encode(Codec::parse("mxint8"), x);
  EXPECT_EQ(i8[0], 127);
  EXPECT_EQ(i8[1], 96);
  EXPECT_EQ(i8[2], 0xc0);  // -64 in two's complement
  EXPECT_EQ(i8[3], 0);
  EXPECT_EQ(i8[4], 2);

  const Bytes e5 = encode(Codec::parse("mxfp8_e5m2"), x);
  EXPECT_EQ(e5[0], 127 - 15);
  EXPECT_EQ(e5[1], (30 << 2) | 2);  // 1.5 * 2^15: exponent 30, mantissa 0b10

  const Bytes f4 = encode(Codec::parse("mxfp4_e2m1"), x);
  EXPECT_EQ(f4[0], 127 - 2);
  // 1.5 * 4 = 6 = E2M1 0b0111 (element 0, low nibble); -4 = 0b1110 (element 1, high nibble).
  EXPECT_EQ(f4[1], 0x07 | (0x0e << 4));
  ASSERT_EQ(f4.size(), 17u);
}

TEST(CodecSpecials, NonFiniteBlockDecodesToNaN) {
  for (const Codec& c : all_codecs()) {
    if (c.block_elems() == 1) continue;
    for (float special : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
      Floats x(c.block_elems() + 3, 1.0f);
      x[1] = special;
      const Bytes e = encode(c, x);
      EXPECT_EQ(e[0], c.kind() == CodecKind::bfp ? (1 << c.exp_bits()) - 1 : 0xff) << c.name();
      EXPECT_TRUE(std::all_of(e.begin() + 1, e.begin() + static_cast<long>(c.encoded_size(c.block_elems())),
                              [](uint8_t b) { return b == 0; }))
          << c.name();
      const Floats d = decode(c, e, x.size());
      for (size_t i = 0; i < c.block_elems(); ++i) EXPECT_EQ(bits(d[i]), 0x7fc00000u) << c.name();
      for (size_t i = c.block_elems(); i < x.size(); ++i) EXPECT_EQ(d[i], 1.0f) << c.name();  // next block intact
    }
  }
}

TEST(CodecSpecials, ElementwiseKeepSpecials) {
  for (const char* n : {"identity", "fp16", "bf16"}) {
    const Codec c = Codec::parse(n);
    const Floats x{std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), -0.0f,
                   std::numeric_limits<float>::quiet_NaN()};
    const Floats d = decode(c, encode(c, x), x.size());
    EXPECT_EQ(d[0], x[0]);
    EXPECT_EQ(d[1], x[1]);
    EXPECT_EQ(bits(d[2]), 0x80000000u);
    EXPECT_TRUE(std::isnan(d[3]));
  }
}

TEST(CodecSpecials, DecodesForeignElementSpecials) {
  // An encoder may legally send E5M2 infinities and NaNs and the E4M3 NaN with a finite scale.
  Bytes e5(33, 0);
  e5[0] = 127;
  e5[1] = 0x7c;
  e5[2] = 0xfc;
  e5[3] = 0x7d;
  const Floats d5 = decode(Codec::parse("mxfp8_e5m2"), e5, 32);
  EXPECT_EQ(d5[0], std::numeric_limits<float>::infinity());
  EXPECT_EQ(d5[1], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(d5[2]));
  Bytes e4(33, 0);
  e4[0] = 127;
  e4[1] = 0xff;
  e4[2] = 0x7e;
  const Floats d4 = decode(Codec::parse("mxfp8_e4m3"), e4, 32);
  EXPECT_EQ(bits(d4[0]), 0xffc00000u);
  EXPECT_EQ(d4[1], 448.0f);
  Bytes i8(33, 0);
  i8[0] = 127;
  i8[1] = 0x80;  // -128: decoded, though this encoder saturates symmetrically at +-127
  EXPECT_EQ(decode(Codec::parse("mxint8"), i8, 32)[0], -2.0f);
}

TEST(CodecSpecials, TinyAndZeroBlocks) {
  for (const Codec& c : all_codecs()) {
    if (c.block_elems() == 1) continue;
    const size_t b = c.block_elems();
    Floats zeros(b, 0.0f);
    zeros[0] = -0.0f;
    const Bytes e = encode(c, zeros);
    const Floats d = decode(c, e, b);
    for (size_t i = 1; i < b; ++i) EXPECT_EQ(bits(d[i]), 0u) << c.name();
    const uint32_t negative_zero = c.kind() == CodecKind::mxint8 ? 0u : 0x80000000u;  // int8 has no -0
    EXPECT_EQ(bits(d[0]), negative_zero) << c.name();
    Floats tiny(b, std::numeric_limits<float>::denorm_min());
    const ErrorBound eb = c.error_bound();
    const Floats dt = decode(c, encode(c, tiny), b);
    for (float v : dt) EXPECT_LE(std::fabs(static_cast<double>(v) - tiny[0]), eb.abs) << c.name();
  }
}

TEST(CodecErrorBound, RoundTripWithinBound) {
  for (const Codec& c : all_codecs()) {
    const ErrorBound eb = c.error_bound();
    const size_t b = c.block_elems();
    for (uint32_t seed = 1; seed <= 3; ++seed) {
      const Floats x = random_data(4096 + 5, seed, false);
      const Floats d = decode(c, encode(c, x), x.size());
      for (size_t start = 0; start < x.size(); start += b) {
        const size_t end = std::min(x.size(), start + b);
        double block_max = 0;
        for (size_t i = start; i < end; ++i) block_max = std::max(block_max, std::fabs(static_cast<double>(x[i])));
        if (block_max >= eb.limit) continue;
        for (size_t i = start; i < end; ++i) {
          const double ref = eb.per_block ? block_max : std::fabs(static_cast<double>(x[i]));
          const double err = std::fabs(static_cast<double>(d[i]) - x[i]);
          ASSERT_LE(err, eb.rel * ref + eb.abs) << c.name() << " x=" << x[i] << " got " << d[i];
        }
      }
    }
  }
}

TEST(CodecErrorBound, PresetValues) {
  EXPECT_EQ(Codec::parse("bfp16").error_bound().rel, 1.0 / 128);
  EXPECT_EQ(Codec::parse("mxint8").error_bound().rel, 1.0 / 128);
  EXPECT_EQ(Codec::parse("mxfp8_e4m3").error_bound().rel, 1.0 / 8);
  EXPECT_EQ(Codec::parse("mxfp8_e5m2").error_bound().rel, 1.0 / 8);
  EXPECT_EQ(Codec::parse("mxfp6_e3m2").error_bound().rel, 1.0 / 8);
  EXPECT_EQ(Codec::parse("mxfp6_e2m3").error_bound().rel, 1.0 / 16);
  EXPECT_EQ(Codec::parse("mxfp4_e2m1").error_bound().rel, 1.0 / 4);
  EXPECT_EQ(Codec::parse("fp16").error_bound().limit, 65520.0);
  EXPECT_TRUE(Codec::parse("mxfp8_e4m3").error_bound().per_block);
  EXPECT_FALSE(Codec::parse("bf16").error_bound().per_block);
}

TEST(CodecSimd, EveryLevelGivesScalarBits) {
  LevelGuard guard;
  for (const Codec& c : all_codecs()) {
    for (size_t n : interesting_counts(c)) {
      const Floats x = random_data(n, static_cast<uint32_t>(n) + 17, true);
      simd_force(SimdLevel::scalar);
      const Bytes want = encode(c, x);
      const auto want_dec = float_bits(decode(c, want, n));
      for (SimdLevel level : supported_levels()) {
        simd_force(level);
        EXPECT_EQ(encode(c, x), want) << c.name() << " n=" << n << " " << simd_name(level);
        EXPECT_EQ(float_bits(decode(c, want, n)), want_dec) << c.name() << " n=" << n << " " << simd_name(level);
      }
    }
  }
}

// Blocks at every shared exponent whose elements sit on rounding ties, a float ulp either side of them, at the top
// code and just past it (saturation), next to zeros and float denormals: the SIMD levels' fixed-point fast path must
// round exactly as the scalar reference at every scale, including the scales where it hands over to the integer
// steps.
TEST(CodecSimd, TiesAndSaturationAtEveryScale) {
  LevelGuard guard;
  for (const char* name : {"bfp16", "mxint8", "bfp:block=32,mant=7,exp=8"}) {
    const Codec c = Codec::parse(name);
    const int block = static_cast<int>(c.block_elems());
    Floats x;
    for (int top = -149; top <= 127; ++top) {  // the block's largest element: 2^top
      const float unit = std::ldexp(1.0f, top - 6);  // one step of a 7-bit magnitude at that scale
      for (int i = 0; i < block; ++i) {
        const float tie = (static_cast<float>(i * 7 % 127) + 0.5f) * unit;
        float v = i == 0   ? std::ldexp(1.0f, top)
                  : i == 1 ? 127.5f * unit  // rounds up to 128: saturates at 127
                  : i == 2 ? std::numeric_limits<float>::denorm_min() * 3
                  : i == 3 ? 0.0f
                  : i % 3 == 0 ? std::nextafter(tie, 0.0f)
                  : i % 3 == 1 ? tie
                               : std::nextafter(tie, 1e30f);
        if (!std::isfinite(v) || v > std::ldexp(1.0f, top)) v = std::ldexp(1.0f, top);
        x.push_back(i % 2 == 0 ? v : -v);
      }
    }
    simd_force(SimdLevel::scalar);
    const Bytes want = encode(c, x);
    for (SimdLevel level : supported_levels()) {
      simd_force(level);
      const Bytes got = encode(c, x);
      ASSERT_EQ(got.size(), want.size());
      for (size_t b = 0; b < want.size(); b += c.encoded_size(c.block_elems())) {
        ASSERT_TRUE(std::equal(want.begin() + static_cast<long>(b),
                               want.begin() + static_cast<long>(b + c.encoded_size(c.block_elems())),
                               got.begin() + static_cast<long>(b)))
            << name << " " << simd_name(level) << ": block " << b / c.encoded_size(c.block_elems())
            << " (largest element 2^" << static_cast<int>(b / c.encoded_size(c.block_elems())) - 149 << ")";
      }
    }
  }
}

TEST(CodecSimd, ArbitraryBytesDecodeAlike) {
  // Decoding must agree on every byte pattern, not just ones this encoder produces (a peer may run other code).
  LevelGuard guard;
  std::mt19937 rng(99);
  for (const Codec& c : all_codecs()) {
    const size_t n = 40 * c.block_elems() + 1;
    Bytes in(c.encoded_size(n));
    for (uint8_t& b : in) b = static_cast<uint8_t>(rng());
    simd_force(SimdLevel::scalar);
    const auto want = float_bits(decode(c, in, n));
    for (SimdLevel level : supported_levels()) {
      simd_force(level);
      EXPECT_EQ(float_bits(decode(c, in, n)), want) << c.name() << " " << simd_name(level);
    }
  }
}

TEST(CodecPieces, PiecesEqualWhole) {
  for (const Codec& c : all_codecs()) {
    const size_t b = c.block_elems();
    const size_t n = 7 * b + 3;
    const Floats x = random_data(n, 5, true);
    const Bytes whole = encode(c, x);
    for (size_t split : {b, 2 * b, 5 * b, 7 * b}) {
      Bytes parts(c.encoded_size(n));
      c.encode(x.data(), split, parts.data());
      c.encode(x.data() + split, n - split, parts.data() + c.encoded_size(split));
      EXPECT_EQ(parts, whole) << c.name() << " split " << split;
      Floats d(n);
      c.decode(whole.data(), split, d.data());
      c.decode(whole.data() + c.encoded_size(split), n - split, d.data() + split);
      EXPECT_EQ(float_bits(d), float_bits(decode(c, whole, n))) << c.name() << " split " << split;
    }
  }
}

// decode then reduce()'s float32 sum: the unfused composition the fused calls must reproduce.
Floats unfused_sum(const Codec& c, const Bytes& in, const Floats& addend) {
  Floats s = decode(c, in, addend.size());
  reduce(DataType::f32, ReduceOp::sum, s.data(), addend.data(), s.data(), s.size());
  return s;
}

TEST(CodecFused, DecodeAddMatchesUnfused) {
  LevelGuard guard;
  for (SimdLevel level : supported_levels()) {
    simd_force(level);
    for (const Codec& c : all_codecs()) {
      for (size_t n : {size_t{0}, size_t{1}, c.block_elems() + 1, size_t{5000}, size_t{10007}}) {
        const Floats x = random_data(n, 11, true);
        const Floats addend = random_data(n, 12, true);
        const Bytes in = encode(c, x);
        const auto want = float_bits(unfused_sum(c, in, addend));
        Floats out(n);
        c.decode_add(in.data(), n, addend.data(), out.data());
        EXPECT_EQ(float_bits(out), want) << c.name() << " n=" << n;
        Floats inplace = addend;
        c.decode_add(in.data(), n, inplace.data(), inplace.data());
        EXPECT_EQ(float_bits(inplace), want) << c.name() << " n=" << n << " in place";
      }
    }
  }
}

TEST(CodecFused, DecodeAddIsFloatAdd) {
  const Codec c = Codec::parse("mxfp8_e5m2");
  const Floats x = random_data(1000, 3, false);
  const Floats addend = random_data(1000, 4, false);
  const Bytes in = encode(c, x);
  const Floats dec = decode(c, in, x.size());
  Floats out(x.size());
  c.decode_add(in.data(), x.size(), addend.data(), out.data());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(bits(out[i]), bits(addend[i] + dec[i]));
}

TEST(CodecFused, EncodeWithDecodedMatchesUnfused) {
  LevelGuard guard;
  for (SimdLevel level : supported_levels()) {
    simd_force(level);
    for (const Codec& c : all_codecs()) {
      for (size_t n : {size_t{0}, size_t{1}, c.block_elems() + 1, size_t{5000}, size_t{10007}}) {
        for (bool specials : {false, true}) {
          Floats x = random_data(n, 31, specials);
          // Blocks of tiny values take the encoder's general path instead of its fixed-point one.
          for (size_t i = 0; i < std::min<size_t>(n, 64); ++i) x[i] = std::ldexp(x[i], -130);
          const Bytes want = encode(c, x);
          const auto want_back = float_bits(decode(c, want, n));
          Bytes out(want.size());
          Floats back(n);
          c.encode(x.data(), n, out.data(), back.data());
          EXPECT_EQ(out, want) << c.name() << " n=" << n;
          EXPECT_EQ(float_bits(back), want_back) << c.name() << " n=" << n << " specials " << specials;
          Floats inplace = x;
          c.encode(inplace.data(), n, out.data(), inplace.data());
          EXPECT_EQ(out, want) << c.name() << " n=" << n << " in place";
          EXPECT_EQ(float_bits(inplace), want_back) << c.name() << " n=" << n << " in place";
        }
      }
    }
  }
}

TEST(CodecFused, DecodeAddEncodeMatchesUnfused) {
  LevelGuard guard;
  for (SimdLevel level : supported_levels()) {
    simd_force(level);
    for (const Codec& c : all_codecs()) {
      for (size_t n : {size_t{0}, size_t{1}, c.block_elems() - 1, size_t{5000}, size_t{10007}}) {
        const Floats x = random_data(n, 21, true);
        const Floats addend = random_data(n, 22, true);
        const Bytes in = encode(c, x);
        const Floats sum = unfused_sum(c, in, addend);
        const Bytes want = encode(c, sum);

        Bytes out(in.size());
        Floats got_sum(n);
        c.decode_add_encode(in.data(), n, addend.data(), out.data(), got_sum.data());
        EXPECT_EQ(out, want) << c.name() << " n=" << n;
        EXPECT_EQ(float_bits(got_sum), float_bits(sum)) << c.name() << " n=" << n;

        Bytes inplace = in;
        c.decode_add_encode(inplace.data(), n, addend.data(), inplace.data(), nullptr);
        EXPECT_EQ(inplace, want) << c.name() << " n=" << n << " in place";

        Floats acc = addend;
        c.decode_add_encode(in.data(), n, acc.data(), out.data(), acc.data());
        EXPECT_EQ(out, want) << c.name() << " n=" << n << " sum aliases addend";
        EXPECT_EQ(float_bits(acc), float_bits(sum)) << c.name() << " n=" << n << " sum aliases addend";
      }
    }
  }
}

}  // namespace
}  // namespace smartcoll
