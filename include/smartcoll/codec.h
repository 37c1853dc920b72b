// Codecs: how float32 data is represented on the wire (SwitchML's pre/post-processor idea).
//
// identity, fp16, bf16, block floating point (BFP: blocks of `block` elements sharing an `exp_bits`-bit
// exponent, each element a sign and `mant_bits` mantissa bits; "bfp16" is the FPGA smart-NIC paper's preset:
// block 16, 8-bit exponent, 7-bit mantissa) and the OCP Microscaling v1.0 formats (blocks of 32 sharing an E8M0
// scale: mxint8, mxfp8_e4m3, mxfp8_e5m2, mxfp6_e3m2, mxfp6_e2m3, mxfp4_e2m1). Rounding is to nearest, ties to
// even. docs/wire-format.md gives every format's byte layout.
//
// Encoded data is a sequence of blocks; only the last block of a call may be partial. So a buffer may be
// encoded in pieces (each piece a multiple of block_elems() elements, except the last) and decoded in the same or
// other such pieces: encode(x[0:a]) + encode(x[a:]) == encode(x) byte for byte when a % block_elems() == 0.
//
// Every SIMD path (chosen by simd_active(), see reduce.h) gives the same bytes and floats as the scalar one.
// Decoding assumes the default floating-point environment (no flush-to-zero / denormals-are-zero).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace smartcoll {

enum class CodecKind : uint8_t {
  identity,
  fp16,
  bf16,
  bfp,
  mxint8,
  mxfp8_e4m3,
  mxfp8_e5m2,
  mxfp6_e3m2,
  mxfp6_e2m3,
  mxfp4_e2m1,
};

// Worst-case round-trip error: for every element i of a block whose values are all finite and below `limit` in
// magnitude,
//   |decode(encode(x))[i] - x[i]| <= rel * ref_i + abs
// where ref_i is |x[i]| when per_block is false (identity, fp16, bf16) and max_j |x[j]| over i's block when it
// is true (BFP and MX: the shared scale follows the block's largest magnitude). A block holding a NaN or an
// infinity decodes to NaN in every element (BFP, MX); fp16 and bf16 keep them element by element.
struct ErrorBound {
  double rel = 0;
  double abs = 0;
  double limit = std::numeric_limits<double>::infinity();
  bool per_block = false;
};

class Codec {
 public:
  // Names: "identity" (or "none"), "fp16", "bf16", "bfp16", "bfp:block=B,mant=M,exp=E" (1 <= M <= 15,
  // 1 <= E <= 8, 1 <= B <= 4096; keys in any order, a missing key takes bfp16's value), "mxint8", "mxfp8_e4m3",
  // "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1". Throws InvalidArgument listing the valid names.
  static Codec parse(std::string_view name);
  static std::vector<std::string> names();  // the preset names above

  CodecKind kind() const { return kind_; }
  std::string name() const;                    // canonical: parse(name()) == *this; bfp16's parameters give "bfp16"
  size_t block_elems() const;                  // 1 for identity/fp16/bf16
  size_t encoded_size(size_t count) const;     // exact bytes for `count` float32 elements
  double ratio() const;                        // 4 * block / encoded bytes per full block
  ErrorBound error_bound() const;

  void encode(const float* in, size_t count, uint8_t* out) const;
  void decode(const uint8_t* in, size_t count, float* out) const;
  // encode, and decoded (when not null; it may alias `in` exactly) receives decode(out): one pass where the format
  // has a fused kernel.
  void encode(const float* in, size_t count, uint8_t* out, float* decoded) const;
  // out[i] = addend[i] + decode(in)[i] (float32 add; out may alias addend).
  void decode_add(const uint8_t* in, size_t count, const float* addend, float* out) const;
  // out = encode(addend + decode(in)); if sum is not null it receives addend + decode(in) (float32). out may alias
  // in exactly (re-encoding in place), sum may alias addend.
  void decode_add_encode(const uint8_t* in, size_t count, const float* addend, uint8_t* out, float* sum) const;
  // Error feedback's step (smartcoll.codec.ErrorFeedback.step, the DDP hook's): x += residual, then residual =
  // x - decode(encode(x)), a non-finite residual stored as 0 (float32, the bits of those steps one by one).
  void feedback_step(float* x, float* residual, size_t count) const;

  // Parameters (meaningful for bfp; MX formats report their element format's bits: mxint8 has exp 0, mant 7).
  int block() const { return block_; }
  int mant_bits() const { return mant_bits_; }
  int exp_bits() const { return exp_bits_; }

  bool operator==(const Codec&) const = default;

 private:
  CodecKind kind_ = CodecKind::identity;
  int block_ = 1, mant_bits_ = 23, exp_bits_ = 8;
};

}  // namespace smartcoll
