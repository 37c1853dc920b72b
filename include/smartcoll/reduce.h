// Element-wise reduction kernels, vectorized (AVX-512, AVX2) with a scalar fallback chosen at run time.
//
// Every path gives the same bits as the scalar one: float16 and bfloat16 are widened to float32, combined, and
// rounded back to nearest-even once per call; no fused multiply-add. min and max propagate NaN (a NaN in either
// operand gives a NaN). Integer sum and prod wrap around (two's complement).
#pragma once

#include <cstddef>
#include <string_view>

#include "smartcoll/types.h"

namespace smartcoll {

enum class SimdLevel { scalar, avx2, avx512 };

// dst[i] = a[i] op b[i] for i < count. dst may alias a or b (exactly, not partially). avg combines as sum;
// divide the final result with scale_divide().
void reduce(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b, size_t count);

// x[i] = x[i] / divisor, for floating types (used for avg). Throws InvalidArgument for integer types.
void scale_divide(DataType dtype, void* x, size_t count, double divisor);

// Widest level this CPU supports, and the level in use (tests force a narrower one to compare bits).
SimdLevel simd_supported();
SimdLevel simd_active();
void simd_force(SimdLevel level);  // clamps to simd_supported()
std::string_view simd_name(SimdLevel level);

// Scalar float16/bfloat16 conversions with round-to-nearest-even (also used by codecs and tests).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t h);
uint16_t float_to_bf16(float f);

}  // namespace smartcoll
