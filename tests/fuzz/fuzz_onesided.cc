// Fuzz target for what a one-sided target reads from an initiator (core/onesided_wire.h): a header, a pieces
// table and a payload. A request the checks let through touches only bytes inside the region when served (the
// region is a heap block of exactly its size, so AddressSanitizer sees any stray byte); an answer the checks let
// through is data, done or error, carries no pieces, and keeps its kind's payload bounds.
#include <cstring>
#include <vector>

#include "core/onesided_wire.h"
#include "targets.h"

namespace smartcoll::fuzz {

namespace {

constexpr uint64_t kRegionBytes = 4096;
constexpr uint64_t kMaxServed = 1 << 20;  // larger gathers are checked, not run

std::string request(rma::Kind kind, std::vector<RemotePiece> pieces, DataType dt = DataType::f32,
                    const char* codec = nullptr) {
  rma::Header h;
  h.kind = static_cast<uint8_t>(kind);
  h.dtype = static_cast<uint8_t>(dt);
  h.npieces = static_cast<uint32_t>(pieces.size());
  h.id = 7;
  h.region = 8 + static_cast<uint64_t>(dt);  // the target below takes region % 8 as the region's dtype
  if (codec) rma::set_codec(h, Codec::parse(codec));
  h.payload = kind == rma::Kind::get ? 0 : rma::wire_bytes(pieces, rma::codec_of(h));
  std::string m(reinterpret_cast<const char*>(&h), sizeof h);
  m.append(reinterpret_cast<const char*>(pieces.data()), pieces.size() * sizeof(RemotePiece));
  m.append(h.payload, '\x01');
  return m;
}

}  // namespace

void onesided_message(const uint8_t* data, size_t size) {
  if (size < sizeof(rma::Header)) return;
  rma::Header h;
  std::memcpy(&h, data, sizeof h);
  if (rma::malformed(h, false).empty()) {  // an answer an initiator takes: data, done or error, and no more
    FUZZ_CHECK(h.npieces == 0 && rma::is_answer(h.kind) && h.payload <= rma::kMaxPayload);
    if (h.kind == static_cast<uint8_t>(rma::Kind::done)) FUZZ_CHECK(h.payload == 0);
    if (h.kind == static_cast<uint8_t>(rma::Kind::error)) FUZZ_CHECK(h.payload <= rma::kMaxErrorText);
  }
  if (!rma::malformed(h, true).empty()) return;
  FUZZ_CHECK(rma::is_request(h.kind) && h.npieces <= rma::kMaxPieces && h.payload <= rma::kMaxPayload);
  const size_t table = static_cast<size_t>(h.npieces) * sizeof(RemotePiece);
  if (size - sizeof h < table) return;  // the target would wait for the rest
  std::vector<RemotePiece> pieces(h.npieces);
  if (table) std::memcpy(pieces.data(), data + sizeof h, table);
  if (!rma::malformed_pieces(h, pieces).empty()) return;
  const DataType dt = static_cast<DataType>(h.region % 8);  // the region's dtype, from a field the input sets
  if (!rma::refusal(h, pieces, {h.region, kRegionBytes, dt}).empty()) return;
  const std::optional<Codec> codec = rma::codec_of(h);
  uint64_t total = 0;
  for (const RemotePiece& p : pieces) {
    FUZZ_CHECK(p.offset <= kRegionBytes && p.bytes <= kRegionBytes - p.offset);
    if (h.kind == static_cast<uint8_t>(rma::Kind::accumulate) || codec)
      FUZZ_CHECK(p.offset % dtype_size(dt) == 0 && p.bytes % dtype_size(dt) == 0);
    total += p.bytes;
  }
  if (codec) FUZZ_CHECK(dt == DataType::f32);
  if (total > kMaxServed) return;
  const uint64_t wire = rma::wire_bytes(pieces, codec);
  std::vector<char> region(kRegionBytes);
  if (h.kind == static_cast<uint8_t>(rma::Kind::get)) {
    std::vector<char> out(wire);
    rma::gather(region.data(), pieces, out.data(), codec);
    return;
  }
  FUZZ_CHECK(wire == h.payload);
  std::vector<char> payload(wire);
  const size_t have = size - sizeof h - table;
  if (have && wire) std::memcpy(payload.data(), data + sizeof h + table, std::min<size_t>(have, wire));
  rma::scatter(region.data(), pieces, payload.data(), h, codec);
}

Seeds onesided_message_seeds() {
  return {request(rma::Kind::get, {{0, 64}, {128, 16}, {4000, 96}}),
          request(rma::Kind::put, {{8, 32}, {0, 4}}),
          request(rma::Kind::accumulate, {{16, 64}, {16, 64}}),
          request(rma::Kind::accumulate, {{6, 2}, {0, 4094}}, DataType::bf16),
          request(rma::Kind::get, {}),
          request(rma::Kind::put, {{64, 256}, {0, 4}}, DataType::f32, "bfp16"),
          request(rma::Kind::accumulate, {{8, 128}}, DataType::f32, "mxfp4_e2m1"),
          request(rma::Kind::get, {{4092, 4}, {0, 4096}}, DataType::f32, "bfp:block=4096,mant=15,exp=8")};
}

}  // namespace smartcoll::fuzz
