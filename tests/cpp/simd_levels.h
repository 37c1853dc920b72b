// SIMD levels in tests: which ones this CPU runs, and a guard that restores the level a test found, so that a
// failing test cannot leak a forced level into the next one.
#pragma once

#include <vector>

#include "smartcoll/reduce.h"

namespace smartcoll::test_support {

class LevelGuard {
 public:
  LevelGuard() : saved_(simd_active()) {}
  ~LevelGuard() { simd_force(saved_); }
  LevelGuard(const LevelGuard&) = delete;
  LevelGuard& operator=(const LevelGuard&) = delete;

 private:
  SimdLevel saved_;
};

inline std::vector<SimdLevel> supported_levels() {
  std::vector<SimdLevel> levels;
  for (SimdLevel l : {SimdLevel::scalar, SimdLevel::avx2, SimdLevel::avx512}) {
    if (static_cast<int>(l) <= static_cast<int>(simd_supported())) levels.push_back(l);
  }
  return levels;
}

}  // namespace smartcoll::test_support
