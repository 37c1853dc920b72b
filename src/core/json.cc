#include "core/json.h"

#include <cctype>
#include <cstdlib>

#include "smartcoll/comm.h"

namespace smartcoll::json {

namespace {

class Reader {
 public:
  explicit Reader(std::string_view text) : s_(text) {}

  Value document() {
    Value v = value(0);
    skip();
    if (i_ != s_.size()) fail("unexpected text after the value");
    return v;
  }

 private:
  // Nesting deeper than any profile needs is refused rather than recursed into.
  static constexpr int kMaxDepth = 32;

  [[noreturn]] void fail(const std::string& what) const {
    throw InvalidArgument("not valid JSON at byte " + std::to_string(i_) + ": " + what);
  }
  void skip() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool eat(char c) {
    skip();
    if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool word(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }

  Value value(int depth) {
    if (depth > kMaxDepth) fail("nested too deeply");
    skip();
    if (i_ >= s_.size()) fail("unexpected end of text");
    Value v;
    const char c = s_[i_];
    if (c == '{') {
      v.kind = Value::Kind::object;
      ++i_;
      if (eat('}')) return v;
      do {
        skip();
        if (i_ >= s_.size() || s_[i_] != '"') fail("expected a field name in quotes");
        std::string key = string();
        expect(':');
        v.object[key] = value(depth + 1);
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      v.kind = Value::Kind::array;
      ++i_;
      if (eat(']')) return v;
      do v.array.push_back(value(depth + 1));
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Value::Kind::string;
      v.string = string();
    } else if (word("true")) {
      v.kind = Value::Kind::boolean;
      v.boolean = true;
    } else if (word("false")) {
      v.kind = Value::Kind::boolean;
    } else if (word("null")) {
      v.kind = Value::Kind::null;
    } else {
      v.kind = Value::Kind::number;
      const std::string rest(s_.substr(i_, 64));
      char* end = nullptr;
      v.number = std::strtod(rest.c_str(), &end);
      if (end == rest.c_str() || std::isalpha(static_cast<unsigned char>(rest[0]))) fail("expected a value");
      i_ += static_cast<size_t>(end - rest.c_str());
    }
    return v;
  }

  std::string string() {
    ++i_;  // the opening quote
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c == '\\') {
        if (i_ >= s_.size()) break;
        c = s_[i_++];
        switch (c) {
          case 'n': c = '\n'; break;
          case 't': c = '\t'; break;
          case 'r': c = '\r'; break;
          case 'b': c = '\b'; break;
          case 'f': c = '\f'; break;
          case 'u': {
            // Profiles are ASCII; other code points are kept as '?' rather than decoded.
            if (i_ + 4 > s_.size()) fail("truncated \\u escape");
            i_ += 4;
            c = '?';
            break;
          }
          default: break;  // '"', '\\', '/'
        }
      }
      out += c;
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }

  std::string_view s_;
  size_t i_ = 0;
};

}  // namespace

std::string_view Value::kind_name() const {
  switch (kind) {
    case Kind::null: return "null";
    case Kind::boolean: return "a boolean";
    case Kind::number: return "a number";
    case Kind::string: return "a string";
    case Kind::array: return "an array";
    case Kind::object: return "an object";
  }
  return "?";
}

Value parse(std::string_view text) { return Reader(text).document(); }

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

}  // namespace smartcoll::json
