#include "core/mac.h"

#include <sys/random.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <string>

#include "smartcoll/types.h"

namespace smartcoll {

namespace {

// FIPS 180-4 section 4.2.2: the first 32 bits of the fractional parts of the cube roots of the first 64 primes.
constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// Section 5.3.3: the first 32 bits of the fractional parts of the square roots of the first 8 primes.
constexpr std::array<uint32_t, 8> kInitial = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                              0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

uint32_t load_be32(const uint8_t* p) {
  return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | uint32_t{p[3]};
}

constexpr size_t kBlock = 64;

}  // namespace

Sha256::Sha256() : h_(kInitial) {}

// Section 6.2.2, one 512-bit block.
void Sha256::compress(const uint8_t* block) {
  uint32_t w[64];
  for (int t = 0; t < 16; ++t) w[t] = load_be32(block + 4 * t);
  for (int t = 16; t < 64; ++t) {
    const uint32_t s0 = std::rotr(w[t - 15], 7) ^ std::rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    const uint32_t s1 = std::rotr(w[t - 2], 17) ^ std::rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int t = 0; t < 64; ++t) {
    const uint32_t t1 = h + (std::rotr(e, 6) ^ std::rotr(e, 11) ^ std::rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                        kRound[t] + w[t];
    const uint32_t t2 = (std::rotr(a, 2) ^ std::rotr(a, 13) ^ std::rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h_[0] += a;
  h_[1] += b;
  h_[2] += c;
  h_[3] += d;
  h_[4] += e;
  h_[5] += f;
  h_[6] += g;
  h_[7] += h;
}

Sha256& Sha256::update(std::span<const uint8_t> bytes) {
  length_ += bytes.size();
  const uint8_t* p = bytes.data();
  size_t n = bytes.size();
  if (used_ > 0) {
    const size_t take = std::min(n, kBlock - used_);
    std::memcpy(block_.data() + used_, p, take);
    used_ += take;
    p += take;
    n -= take;
    if (used_ < kBlock) return *this;
    compress(block_.data());
    used_ = 0;
  }
  for (; n >= kBlock; p += kBlock, n -= kBlock) compress(p);
  if (n > 0) std::memcpy(block_.data(), p, n);
  used_ = n;
  return *this;
}

Sha256& Sha256::update(std::string_view bytes) {
  return update(std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
}

// Section 5.1.1: a 1 bit, zeros up to 56 mod 64 bytes, then the message length in bits, big-endian.
Digest Sha256::finish() {
  const uint64_t bits = length_ * 8;
  uint8_t pad[kBlock + 8] = {0x80};
  const size_t zeros = (used_ < 56 ? 56 : 120) - used_;
  for (int i = 0; i < 8; ++i) pad[zeros + i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  update(std::span<const uint8_t>(pad, zeros + 8));
  Digest out;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(h_[i] >> (24 - 8 * j));
  return out;
}

Digest sha256(std::string_view bytes) { return Sha256().update(bytes).finish(); }

// RFC 2104: H((K ^ opad) || H((K ^ ipad) || message)), K hashed first when longer than a block, then zero-padded.
Digest hmac_sha256(std::string_view key, std::string_view message) {
  std::array<uint8_t, kBlock> k{};
  if (key.size() > kBlock) {
    const Digest hashed = sha256(key);
    std::memcpy(k.data(), hashed.data(), hashed.size());
  } else {
    std::memcpy(k.data(), key.data(), key.size());
  }
  std::array<uint8_t, kBlock> inner_pad, outer_pad;
  for (size_t i = 0; i < kBlock; ++i) {
    inner_pad[i] = k[i] ^ 0x36;
    outer_pad[i] = k[i] ^ 0x5c;
  }
  const Digest inner = Sha256().update(inner_pad).update(message).finish();
  return Sha256().update(outer_pad).update(inner).finish();
}

bool equal_constant_time(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  if (a.size() != b.size()) return false;
  // Accumulate every difference instead of returning at the first one; volatile keeps the compiler from
  // turning the loop back into an early exit.
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = diff | (a[i] ^ b[i]);
  return diff == 0;
}

void random_bytes(std::span<uint8_t> out) {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::getrandom(out.data() + done, out.size() - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CommError(std::string("getrandom failed: ") + std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

}  // namespace smartcoll
