// A small JSON reader for the few files the core reads itself (the cost model's profile): objects, arrays,
// numbers, strings, true/false/null. Errors throw InvalidArgument with the byte offset of the problem.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace smartcoll::json {

struct Value {
  enum class Kind { null, boolean, number, string, array, object } kind = Kind::null;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Value> array;
  std::map<std::string, Value> object;

  std::string_view kind_name() const;
};

// The whole text must be one value (whitespace around it allowed).
Value parse(std::string_view text);
// A JSON string literal of `s`, quotes included.
std::string quote(std::string_view s);

}  // namespace smartcoll::json
