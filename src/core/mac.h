// Message authentication for the control plane: SHA-256 (FIPS 180-4), HMAC-SHA-256 (RFC 2104), a comparison
// whose time does not depend on where two digests differ, and random bytes from the kernel.
//
// Components that prove knowledge of a shared secret (the store's handshake, docs/wire-format.md) answer a fresh
// random challenge with hmac_sha256(secret, context || challenge) and check answers with equal_constant_time.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace smartcoll {

using Digest = std::array<uint8_t, 32>;

// Incremental SHA-256, for messages that arrive or are built in pieces.
class Sha256 {
 public:
  Sha256();
  Sha256& update(std::string_view bytes);
  Sha256& update(std::span<const uint8_t> bytes);
  // The digest of everything updated so far; the object must not be used afterwards.
  Digest finish();

 private:
  void compress(const uint8_t* block);
  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> block_{};
  size_t used_ = 0;      // bytes waiting in block_
  uint64_t length_ = 0;  // message bytes so far
};

Digest sha256(std::string_view bytes);
Digest hmac_sha256(std::string_view key, std::string_view message);

// True when a and b hold the same bytes. For equal sizes the time taken does not depend on the contents, so a
// peer timing the check of its guesses learns nothing about the expected value. Sizes are not secret.
bool equal_constant_time(std::span<const uint8_t> a, std::span<const uint8_t> b);

// Fills `out` from the kernel's random source (getrandom); throws CommError if it fails.
void random_bytes(std::span<uint8_t> out);

}  // namespace smartcoll
