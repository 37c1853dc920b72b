// Element types and reduction operators shared by every layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace smartcoll {

enum class DataType : uint8_t { f32, f64, f16, bf16, i8, u8, i32, i64 };
enum class ReduceOp : uint8_t { sum, prod, min, max, avg };

inline constexpr DataType kAllDataTypes[] = {DataType::f32, DataType::f64, DataType::f16, DataType::bf16,
                                             DataType::i8,  DataType::u8,  DataType::i32, DataType::i64};
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max,
                                             ReduceOp::avg};

constexpr size_t dtype_size(DataType t) {
  switch (t) {
    case DataType::f64:
    case DataType::i64: return 8;
    case DataType::f32:
    case DataType::i32: return 4;
    case DataType::f16:
    case DataType::bf16: return 2;
    case DataType::i8:
    case DataType::u8: return 1;
  }
  return 0;
}

constexpr bool is_floating(DataType t) {
  return t == DataType::f32 || t == DataType::f64 || t == DataType::f16 || t == DataType::bf16;
}

constexpr std::string_view dtype_name(DataType t) {
  constexpr std::string_view names[] = {"float32", "float64", "float16", "bfloat16",
                                        "int8",    "uint8",   "int32",   "int64"};
  return names[static_cast<int>(t)];
}

constexpr std::string_view op_name(ReduceOp op) {
  constexpr std::string_view names[] = {"sum", "prod", "min", "max", "avg"};
  return names[static_cast<int>(op)];
}

// Thrown for a caller's mistake that is detected locally (bad argument, unsupported combination).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Thrown when a collective fails: a peer died or timed out, ranks disagree, a packet is malformed.
// The communicator is unusable afterwards; create a new one.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace smartcoll
