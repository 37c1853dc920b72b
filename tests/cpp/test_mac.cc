// SHA-256 against the NIST example vectors (FIPS 180-4 examples, "SHA256.pdf"), HMAC-SHA-256 against RFC 4231's
// test cases, plus the incremental interface, the constant-time comparison and random bytes.
#include "core/mac.h"

#include <gtest/gtest.h>

#include <string>

namespace smartcoll {
namespace {

std::string hex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  for (uint8_t b : bytes) s += {kDigits[b >> 4], kDigits[b & 15]};
  return s;
}

std::string repeat(char c, size_t n) { return std::string(n, c); }

TEST(Sha256, NistVectors) {
  EXPECT_EQ(hex(sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // 448 bits: the padding no longer fits the block, so a second block holds the length.
  EXPECT_EQ(hex(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(hex(sha256("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmno"
                       "pqrsmnopqrstnopqrstu")),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(hex(sha256(repeat('a', 1000000))), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, PiecesGiveTheDigestOfTheWhole) {
  std::string msg;
  for (int i = 0; i < 300; ++i) msg += static_cast<char>(i * 7 + 1);
  for (size_t cut1 : {0, 1, 55, 56, 63, 64, 65, 128}) {
    for (size_t cut2 : {cut1, cut1 + 1, cut1 + 64, size_t{300}}) {
      const std::string_view v(msg);
      Sha256 pieces;
      pieces.update(v.substr(0, cut1)).update(v.substr(cut1, cut2 - cut1)).update(v.substr(cut2));
      EXPECT_EQ(pieces.finish(), sha256(msg)) << cut1 << " " << cut2;
    }
  }
}

TEST(HmacSha256, Rfc4231) {
  struct Case {
    std::string key, data, mac;
  };
  std::string key4;
  for (char c = 1; c <= 25; ++c) key4 += c;
  const Case cases[] = {
      {repeat('\x0b', 20), "Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {repeat('\xaa', 20), repeat('\xdd', 50), "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {key4, repeat('\xcd', 50), "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      // Test case 5 specifies only the first 128 bits.
      {repeat('\x0c', 20), "Test With Truncation", "a3b6167473100ee06e0c796c2955552b"},
      // 131-byte keys: longer than a block, so hashed first.
      {repeat('\xaa', 131), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {repeat('\xaa', 131),
       "This is a test using a larger than block-size key and a larger than block-size data. The key needs to be "
       "hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const Case& c : cases) EXPECT_EQ(hex(hmac_sha256(c.key, c.data)).substr(0, c.mac.size()), c.mac) << c.data;
}

TEST(HmacSha256, KeyOfExactlyOneBlockIsNotHashed) {
  // 64 bytes is used as it is, 65 is hashed first: the two must differ from each other and from a hashed key.
  const std::string k64 = repeat('k', 64), k65 = repeat('k', 65);
  EXPECT_NE(hmac_sha256(k64, "m"), hmac_sha256(k65, "m"));
  const Digest h = sha256(k64);
  EXPECT_NE(hmac_sha256(k64, "m"), hmac_sha256(std::string(h.begin(), h.end()), "m"));
  const Digest h65 = sha256(k65);
  EXPECT_EQ(hmac_sha256(k65, "m"), hmac_sha256(std::string(h65.begin(), h65.end()), "m"));
}

TEST(EqualConstantTime, ComparesEveryByte) {
  Digest a = sha256("x"), b = a;
  EXPECT_TRUE(equal_constant_time(a, b));
  for (size_t i : {size_t{0}, size_t{17}, size_t{31}}) {
    b = a;
    b[i] ^= 0x01;
    EXPECT_FALSE(equal_constant_time(a, b)) << i;
  }
  EXPECT_FALSE(equal_constant_time(std::span(a).first(31), b));
  EXPECT_TRUE(equal_constant_time({}, {}));
}

TEST(RandomBytes, FillsAndDiffers) {
  std::array<uint8_t, 16> a{}, b{};
  random_bytes(a);
  random_bytes(b);
  EXPECT_NE(a, b);  // a 2^-128 chance of failing
  std::array<uint8_t, 4096> big{};
  random_bytes(big);
  int zeros = 0;
  for (uint8_t x : big) zeros += x == 0;
  EXPECT_LT(zeros, 64);  // about 16 expected
}

}  // namespace
}  // namespace smartcoll
