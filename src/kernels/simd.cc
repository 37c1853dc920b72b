#include "kernels/simd.h"

#include <atomic>

namespace smartcoll {
namespace {

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

}  // namespace smartcoll
