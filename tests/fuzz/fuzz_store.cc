// Fuzz targets for the store's wire format and the MAC it uses.
#include <algorithm>
#include <string>
#include <string_view>

#include "core/mac.h"
#include "store/protocol.h"
#include "targets.h"

namespace smartcoll::fuzz {

namespace {

using store::Op;
using store::Request;

// Small limits, so that mutated length fields land on both sides of them often.
constexpr size_t kMaxKey = 64;
constexpr size_t kMaxValue = 1024;

// What the parser must make of a whole input: the requests it holds, the bytes they take, and whether what
// follows them is bad (rather than only incomplete). Written straight from docs/wire-format.md.
struct Expected {
  std::vector<Request> requests;
  size_t consumed = 0;
  bool bad = false;
};

Expected read_directly(std::string_view in) {
  Expected e;
  size_t pos = 0;
  while (pos < in.size()) {
    const auto op = static_cast<uint8_t>(in[pos]);
    if (op < 1 || op > 4) {  // set, get, check, erase
      e.bad = true;
      break;
    }
    if (in.size() - pos < 5) break;
    const uint32_t key_len = store::load_u32(in.data() + pos + 1);
    if (key_len > kMaxKey) {
      e.bad = true;
      break;
    }
    size_t at = pos + 5;
    if (in.size() - at < key_len) break;
    Request r{static_cast<Op>(op), std::string(in.substr(at, key_len)), ""};
    at += key_len;
    if (r.op == Op::set) {
      if (in.size() - at < 4) break;
      const uint32_t value_len = store::load_u32(in.data() + at);
      if (value_len > kMaxValue) {
        e.bad = true;
        break;
      }
      at += 4;
      if (in.size() - at < value_len) break;
      r.value = in.substr(at, value_len);
      at += value_len;
    }
    e.requests.push_back(std::move(r));
    pos = at;
  }
  e.consumed = pos;
  return e;
}

// Feeds `in` in pieces whose sizes come from a generator seeded by the input, taking requests after each piece.
void parse_in_pieces(std::string_view in, const Expected& expected) {
  store::RequestParser parser(kMaxKey, kMaxValue);
  uint64_t state = in.size() * 0x9e3779b97f4a7c15ull + (in.empty() ? 0 : static_cast<uint8_t>(in.back()));
  size_t fed = 0, got = 0, returned_bytes = 0;
  do {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const size_t piece = std::min(in.size() - fed, size_t{1} + (state >> 33) % 48);
    parser.feed(in.substr(fed, piece));
    fed += piece;
    while (auto r = parser.next()) {
      FUZZ_CHECK(got < expected.requests.size());
      const Request& want = expected.requests[got++];
      FUZZ_CHECK(r->op == want.op && r->key == want.key && r->value == want.value);
      FUZZ_CHECK(r->key.size() <= kMaxKey && r->value.size() <= kMaxValue);
      FUZZ_CHECK(r->op == Op::set || r->value.empty());
      // Re-encoding a request gives back exactly the bytes it was read from.
      const std::string wire = store::encode_request(*r);
      FUZZ_CHECK(in.substr(returned_bytes, wire.size()) == wire);
      returned_bytes += wire.size();
    }
    if (!parser.error().empty()) {
      FUZZ_CHECK(expected.bad);
      break;
    }
    // Whatever has not been returned is still held, and it is less than a complete request.
    FUZZ_CHECK(parser.buffered() == fed - returned_bytes);
  } while (fed < in.size());
  FUZZ_CHECK(got == expected.requests.size());
  FUZZ_CHECK(returned_bytes == expected.consumed);
  FUZZ_CHECK(parser.error().empty() == !expected.bad);
  if (expected.bad) {
    // A failed parser stays failed and holds nothing.
    parser.feed(store::encode_request({Op::get, "k", ""}));
    FUZZ_CHECK(!parser.next() && !parser.error().empty() && parser.buffered() == 0);
  } else {
    FUZZ_CHECK(parser.buffered() == in.size() - expected.consumed);
  }
}

}  // namespace

void store_request(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  parse_in_pieces(in, read_directly(in));
}

Seeds store_request_seeds() {
  const Request requests[] = {
      {Op::set, "addr/0", "10.0.0.1:29500,10.0.0.1:29501"},
      {Op::get, "addr/1", ""},
      {Op::erase, "rma/1/", ""},
      {Op::set, "settings/verdict", "ok"},
      {Op::set, "", ""},
      {Op::get, "", ""},
      {Op::set, std::string(kMaxKey, 'k'), std::string(kMaxValue, 'v')},
  };
  Seeds seeds;
  std::string all;
  for (const Request& r : requests) {
    seeds.push_back(store::encode_request(r));
    all += seeds.back();
  }
  seeds.push_back(all);
  return seeds;
}

void sha256_pieces(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const Digest whole = sha256(in);
  Sha256 pieces;
  for (size_t at = 0, step = 1; at < in.size(); at += step, step = step * 3 % 97 + 1)
    pieces.update(in.substr(at, step));
  FUZZ_CHECK(pieces.finish() == whole);
  // RFC 2104: a key longer than a block is replaced by its hash, a shorter one padded with zeros to a block.
  const size_t cut = size == 0 ? 0 : data[0] % (size + 1);
  const std::string_view key = in.substr(0, cut), message = in.substr(cut);
  const Digest mac = hmac_sha256(key, message);
  if (key.size() > 64) {
    const Digest hashed = sha256(key);
    FUZZ_CHECK(mac == hmac_sha256(std::string(hashed.begin(), hashed.end()), message));
  } else {
    FUZZ_CHECK(mac == hmac_sha256(std::string(key) + std::string(64 - key.size(), '\0'), message));
  }
}

Seeds sha256_pieces_seeds() { return {"", "abc", std::string(55, 'a'), std::string(64, 'b'), std::string(200, 'c')}; }

}  // namespace smartcoll::fuzz
