// SipHash-2-4 (Aumasson and Bernstein, "SipHash: a fast short-input PRF", 2012): a keyed 64-bit MAC, fast on
// the short messages the switch protocol authenticates (a 40-byte header, optionally its payload).
#pragma once

#include <cstddef>
#include <cstdint>

namespace smartcoll {

struct SipKey {
  uint64_t k0 = 0, k1 = 0;  // key bytes 0-7 and 8-15, little-endian, as the paper defines them
  static SipKey from_bytes(const uint8_t bytes[16]);
  void to_bytes(uint8_t bytes[16]) const;
  bool operator==(const SipKey&) const = default;
};

// Incremental SipHash-2-4: update() any number of times, then finish() once. Hashing a message in pieces gives
// the same value as hashing it whole.
class SipHasher {
 public:
  explicit SipHasher(const SipKey& key);
  void update(const void* data, size_t len);
  uint64_t finish();

 private:
  void compress(uint64_t m);
  uint64_t v0_, v1_, v2_, v3_;
  uint64_t tail_ = 0;  // bytes not yet compressed (fewer than 8), little-endian
  size_t len_ = 0;     // bytes seen so far
};

uint64_t siphash24(const SipKey& key, const void* data, size_t len);

}  // namespace smartcoll
