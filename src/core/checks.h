// Argument checks shared by the communicator's single-buffer and list calls: a caller's mistake becomes an
// InvalidArgument that says what to pass instead.
#pragma once

#include <string>

#include "smartcoll/types.h"

namespace smartcoll {

inline void require(bool ok, const std::string& message) {
  if (!ok) throw InvalidArgument(message);
}

inline void check_op(DataType dt, ReduceOp op) {
  require(op != ReduceOp::avg || is_floating(dt),
          "op 'avg' needs a floating-point dtype, got " + std::string(dtype_name(dt)) + "; use 'sum' and divide");
}

inline void check_root(int root, int size) {
  require(root >= 0 && root < size,
          "root " + std::to_string(root) + " is outside the world of size " + std::to_string(size));
}

}  // namespace smartcoll
