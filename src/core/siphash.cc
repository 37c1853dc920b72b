#include "core/siphash.h"

#include <cstring>

namespace smartcoll {

namespace {

constexpr uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// One SipRound (the paper's Figure 2.1).
inline void round(uint64_t& v0, uint64_t& v1, uint64_t& v2, uint64_t& v3) {
  v0 += v1;
  v1 = rotl(v1, 13);
  v1 ^= v0;
  v0 = rotl(v0, 32);
  v2 += v3;
  v3 = rotl(v3, 16);
  v3 ^= v2;
  v0 += v3;
  v3 = rotl(v3, 21);
  v3 ^= v0;
  v2 += v1;
  v1 = rotl(v1, 17);
  v1 ^= v2;
  v2 = rotl(v2, 32);
}

}  // namespace

SipKey SipKey::from_bytes(const uint8_t bytes[16]) { return {load_le64(bytes), load_le64(bytes + 8)}; }

void SipKey::to_bytes(uint8_t bytes[16]) const {
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<uint8_t>(k0 >> (8 * i));
    bytes[8 + i] = static_cast<uint8_t>(k1 >> (8 * i));
  }
}

// Initialization: the key xored with the ASCII of "somepseudorandomlygeneratedbytes".
SipHasher::SipHasher(const SipKey& key)
    : v0_(key.k0 ^ 0x736f6d6570736575ULL), v1_(key.k1 ^ 0x646f72616e646f6dULL),
      v2_(key.k0 ^ 0x6c7967656e657261ULL), v3_(key.k1 ^ 0x7465646279746573ULL) {}

void SipHasher::compress(uint64_t m) {  // c = 2 rounds per message word
  v3_ ^= m;
  round(v0_, v1_, v2_, v3_);
  round(v0_, v1_, v2_, v3_);
  v0_ ^= m;
}

void SipHasher::update(const void* data, size_t len) {
  const auto* p = static_cast<const uint8_t*>(data);
  size_t have = len_ % 8;
  len_ += len;
  if (have) {  // fill the pending word first
    while (have < 8 && len) tail_ |= static_cast<uint64_t>(*p++) << (8 * have++), --len;
    if (have < 8) return;
    compress(tail_);
    tail_ = 0;
  }
  for (; len >= 8; p += 8, len -= 8) compress(load_le64(p));
  for (size_t i = 0; i < len; ++i) tail_ |= static_cast<uint64_t>(p[i]) << (8 * i);
}

uint64_t SipHasher::finish() {
  // The last word: the remaining bytes, and the message length mod 256 in its top byte.
  compress(tail_ | (static_cast<uint64_t>(len_ & 0xff) << 56));
  v2_ ^= 0xff;
  for (int i = 0; i < 4; ++i) round(v0_, v1_, v2_, v3_);  // d = 4 finalization rounds
  return v0_ ^ v1_ ^ v2_ ^ v3_;
}

uint64_t siphash24(const SipKey& key, const void* data, size_t len) {
  SipHasher h(key);
  h.update(data, len);
  return h.finish();
}

}  // namespace smartcoll
