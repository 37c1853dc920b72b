#include "store/protocol.h"

#include <cstring>

namespace smartcoll::store {

namespace {

constexpr std::string_view kProofContext = "smartcoll-store";

void append_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>(v >> (8 * i));
}

}  // namespace

Digest handshake_proof(std::string_view secret, std::span<const uint8_t> nonce) {
  std::string message(kProofContext);
  message.append(reinterpret_cast<const char*>(nonce.data()), nonce.size());
  return hmac_sha256(secret, message);
}

uint32_t load_u32(const void* p) {
  const auto* b = static_cast<const uint8_t*>(p);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

std::string encode_request(const Request& r) {
  std::string out(1, static_cast<char>(r.op));
  append_u32(out, static_cast<uint32_t>(r.key.size()));
  out += r.key;
  if (r.op == Op::set) {
    append_u32(out, static_cast<uint32_t>(r.value.size()));
    out += r.value;
  }
  return out;
}

std::string encode_count(uint32_t n) {
  std::string out;
  append_u32(out, n);
  return out;
}

std::string encode_reply(std::optional<std::string_view> value) {
  std::string out;
  if (!value) {
    append_u32(out, kAbsent);
    return out;
  }
  out.reserve(4 + value->size());
  append_u32(out, static_cast<uint32_t>(value->size()));
  out += *value;
  return out;
}

void RequestParser::feed(std::string_view bytes) {
  if (!error_.empty()) return;
  if (pos_ > 0) {  // drop the requests already returned before the buffer grows
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  buf_.append(bytes);
}

std::optional<Request> RequestParser::fail(std::string why) {
  error_ = std::move(why);
  buf_.clear();
  pos_ = 0;
  return std::nullopt;
}

std::optional<Request> RequestParser::next() {
  if (!error_.empty()) return std::nullopt;
  const std::string_view in = std::string_view(buf_).substr(pos_);
  if (in.empty()) return std::nullopt;
  const auto op = static_cast<uint8_t>(in[0]);
  if (op < static_cast<uint8_t>(Op::set) || op > kLastOp)
    return fail("unknown op " + std::to_string(op));
  if (in.size() < 5) return std::nullopt;
  const uint32_t key_len = load_u32(in.data() + 1);
  if (key_len > max_key_)
    return fail("key of " + std::to_string(key_len) + " bytes, over the limit of " + std::to_string(max_key_));
  size_t header = 5 + size_t{key_len};
  uint32_t value_len = 0;
  if (op == static_cast<uint8_t>(Op::set)) {
    if (in.size() < header + 4) return std::nullopt;
    value_len = load_u32(in.data() + header);
    if (value_len > max_value_)
      return fail("value of " + std::to_string(value_len) + " bytes, over the limit of " + std::to_string(max_value_));
    header += 4;
  }
  if (in.size() < header + value_len) return std::nullopt;
  Request r{static_cast<Op>(op), std::string(in.substr(5, key_len)), std::string(in.substr(header, value_len))};
  pos_ += header + value_len;
  return r;
}

}  // namespace smartcoll::store
