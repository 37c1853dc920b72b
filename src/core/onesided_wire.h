// The wire format of one-sided operations (docs/wire-format.md, "One-sided channel"), and the checks both ends
// make. Everything here is a pure function of its arguments, so the fuzz target runs exactly what the server runs.
//
// A one-sided channel is a TCP connection that an initiator opens to a target's one-sided listener; it carries
// the initiator's requests one way and the target's answers the other, each a message: a Header, then (requests)
// a table of `npieces` RemotePieces, then `payload` bytes. Integers are in host byte order (one job runs one build).
//
//   get:        header + pieces                     -> data (payload: the pieces, concatenated) or error
//   put:        header + pieces + the pieces' bytes -> done or error
//   accumulate: header + pieces + the pieces' bytes -> done or error (reduced into the region, element-wise)
//   error:      payload is the reason, text
// A request that names a codec (float32 regions only) carries, and gets back, each piece encoded on its own
// (piece i's elements as one encode() call), the encoded pieces concatenated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "smartcoll/codec.h"
#include "smartcoll/onesided.h"
#include "smartcoll/types.h"

namespace smartcoll::rma {

inline constexpr uint32_t kMagic = 0x53435231;  // "SCR1"
inline constexpr uint8_t kVersion = 1;
// Bounds a message must keep, so that a forged header cannot make a target allocate or loop without limit.
inline constexpr uint32_t kMaxPieces = 1u << 20;
inline constexpr uint64_t kMaxPayload = uint64_t{1} << 30;
inline constexpr uint64_t kMaxErrorText = 4096;

enum class Kind : uint8_t { get = 1, put = 2, accumulate = 3, data = 4, done = 5, error = 6 };

struct Header {
  uint32_t magic = kMagic;
  uint8_t version = kVersion;
  uint8_t kind = 0;
  uint8_t dtype = 0;  // accumulate: the region's element type as the initiator knows it
  uint8_t op = 0;     // accumulate: the ReduceOp
  uint32_t npieces = 0;
  uint32_t reserved = 0;
  uint64_t id = 0;      // chosen by the initiator; an answer carries its request's
  uint64_t region = 0;  // requests: the region's id at the target
  uint64_t payload = 0;
  char codec[32] = {};  // requests: the codec's canonical name, NUL-padded; empty: raw bytes
};
static_assert(sizeof(Header) == 72, "a wire format: no padding");

// The codec a request names; nullopt when it names none (raw bytes). Call on a header malformed() accepted.
std::optional<Codec> codec_of(const Header& h);
void set_codec(Header& h, const std::optional<Codec>& codec);
// The payload bytes of `pieces` on the wire: their sizes, or their encoded sizes under `codec`.
uint64_t wire_bytes(std::span<const RemotePiece> pieces, const std::optional<Codec>& codec);

// The first bytes an initiator sends on a new channel. `token` is the target's: 16 random bytes it publishes
// with its address in the job's store, so that only who can read the store (the job's ranks; with a store
// secret, nobody else) can reach a registered region.
inline constexpr uint32_t kHelloMagic = 0x53435248;  // "SCRH"
struct Hello {
  uint32_t magic, rank, size, version;
  uint64_t job;
  uint8_t token[16];
};
static_assert(sizeof(Hello) == 40, "a wire format: no padding");
// Why a target of world size `size` and token `token` refuses `h` ("" to accept).
std::string hello_refusal(const Hello& h, int size, uint64_t job, const uint8_t (&token)[16]);

// The sum of `items`' sizes (size(item)), or nullopt if it exceeds `limit`; written so that it cannot overflow.
// at: where it first did.
template <class T, class Size>
std::optional<uint64_t> sum_bytes(std::span<const T> items, uint64_t limit, Size size, size_t* at = nullptr) {
  uint64_t total = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const uint64_t n = size(items[i]);
    if (n > limit - total) {
      if (at) *at = i;
      return std::nullopt;
    }
    total += n;
  }
  return total;
}
inline std::optional<uint64_t> sum_bytes(std::span<const RemotePiece> pieces, uint64_t limit, size_t* at = nullptr) {
  return sum_bytes(pieces, limit, [](const RemotePiece& p) { return p.bytes; }, at);
}

const char* kind_name(uint8_t kind);
inline bool is_request(uint8_t kind) { return kind >= 1 && kind <= 3; }
inline bool is_answer(uint8_t kind) { return kind >= 4 && kind <= 6; }

// Why `h` is not a well-formed message for the receiving end ("" if it is): a request at a target, an answer
// (data, done or error) at an initiator. A malformed message closes the channel.
std::string malformed(const Header& h, bool at_target);
// Why a well-formed request's pieces table is malformed ("" if not): sizes that overflow, or that do not add up
// to the payload of a put or accumulate (encoded, under a codec), or exceed kMaxPayload for a get; under a codec,
// pieces that are not whole float32 elements.
std::string malformed_pieces(const Header& h, std::span<const RemotePiece> pieces);

// What a target knows of one of its regions.
struct RegionInfo {
  uint64_t id = 0;
  uint64_t bytes = 0;
  DataType dtype = DataType::u8;
};
// Why a well-formed request may not be served on `region` ("" if it may): pieces outside it (overflow-safe),
// accumulate pieces not made of whole elements, a dtype or op the region does not take. The message names the
// cause; the channel stays open.
std::string refusal(const Header& h, std::span<const RemotePiece> pieces, const RegionInfo& region);
// The checks an initiator makes before sending, the same as the target's (InvalidArgument naming the cause).
void check_call(Kind kind, const RemoteRegion& region, std::span<const RemotePiece> pieces, size_t local_bytes,
                ReduceOp op, const std::optional<Codec>& codec);

// Serving a request that refusal() let through, on the region's memory `base` (its bytes as RegionInfo says).
// get: the pieces into `out` (their wire bytes); put: `in` into the pieces; accumulate: reduce `in` into them.
// Under a codec, gather encodes each piece and scatter decodes each (accumulate: decode_add, op sum).
void gather(const char* base, std::span<const RemotePiece> pieces, char* out, const std::optional<Codec>& codec);
void scatter(char* base, std::span<const RemotePiece> pieces, const char* in, const Header& h,
             const std::optional<Codec>& codec);

}  // namespace smartcoll::rma
