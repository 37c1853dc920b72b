// The TCP store's wire format (docs/wire-format.md, "Rendezvous store"): the handshake, requests and replies.
// Everything here is pure (no sockets), so the server's parsing can be unit-tested and fuzzed byte by byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "core/mac.h"

namespace smartcoll::store {

// Handshake. On accept the server sends one greeting byte: kGreetingOpen (no secret: requests may follow at
// once) or kGreetingSecret followed by a kNonceSize-byte random nonce, which the client answers with
// handshake_proof(secret, nonce) (32 bytes); the server replies kAccepted, or kRefused and closes.
inline constexpr uint8_t kGreetingOpen = 0;
inline constexpr uint8_t kGreetingSecret = 1;
inline constexpr size_t kNonceSize = 16;
inline constexpr size_t kProofSize = 32;
inline constexpr uint8_t kAccepted = 1;
inline constexpr uint8_t kRefused = 0;

// HMAC-SHA-256(secret, "smartcoll-store" || nonce). The context string keeps a proof made here from being
// accepted by another component that uses the same secret with a challenge of the same shape.
Digest handshake_proof(std::string_view secret, std::span<const uint8_t> nonce);

// Requests: op (u8), key length (u32 LE), key, and for a set: value length (u32 LE), value.
// A get is answered, once the key exists, with value length (u32 LE) and value; a check (a get that does not
// wait) at once, the same way or with length kAbsent when the key does not exist; a set is not answered. An
// erase (op 4, new after release 0.1.0) deletes every key that begins with its key and is answered with how many it
// deleted (u32 LE); a server of an earlier release drops the client at its op byte.
enum class Op : uint8_t { set = 1, get = 2, check = 3, erase = 4 };
inline constexpr uint8_t kLastOp = static_cast<uint8_t>(Op::erase);
inline constexpr uint32_t kAbsent = 0xffffffff;

struct Request {
  Op op = Op::get;
  std::string key;
  std::string value;  // empty for a get
};

std::string encode_request(const Request& r);
std::string encode_reply(std::optional<std::string_view> value);  // nullopt: a check of a key that does not exist
std::string encode_count(uint32_t n);  // the reply to an erase
uint32_t load_u32(const void* p);

// Splits a client's byte stream into requests. Each header field is checked as soon as its bytes are in, so a
// bad op is refused at the first byte and an oversized key or value at its length field, before any body is
// buffered. After an error the stream cannot be resynchronised: the parser stays failed.
class RequestParser {
 public:
  RequestParser(size_t max_key, size_t max_value) : max_key_(max_key), max_value_(max_value) {}
  void feed(std::string_view bytes);
  // The next complete request; nullopt when more bytes are needed or the stream is bad (then error() says why).
  std::optional<Request> next();
  const std::string& error() const { return error_; }
  // Bytes fed and not yet returned in a request (they belong to requests still to come).
  size_t buffered() const { return buf_.size() - pos_; }

 private:
  std::optional<Request> fail(std::string why);
  size_t max_key_, max_value_;
  std::string buf_;
  size_t pos_ = 0;  // start of the first request not yet returned
  std::string error_;
};

}  // namespace smartcoll::store
