// Argument checks shared by the communicator's single-buffer and list calls: a caller's mistake becomes an
// InvalidArgument that says what to pass instead.
#pragma once

#include <string>
#include <type_traits>

#include "smartcoll/types.h"

namespace smartcoll {

// `message`: the text, or a callable that builds it. Checks that run on every call pass a callable, so that
// the text (an allocation or more) is built only when the check fails.
template <class Message>
void require(bool ok, Message&& message) {
  if (ok) return;
  if constexpr (std::is_invocable_v<Message>)
    throw InvalidArgument(message());
  else
    throw InvalidArgument(message);
}

inline void check_op(DataType dt, ReduceOp op) {
  require(op != ReduceOp::avg || is_floating(dt), [&] {
    return "op 'avg' needs a floating-point dtype, got " + std::string(dtype_name(dt)) + "; use 'sum' and divide";
  });
}

inline void check_root(int root, int size) {
  require(root >= 0 && root < size, [&] {
    return "root " + std::to_string(root) + " is outside the world of size " + std::to_string(size);
  });
}

}  // namespace smartcoll
