#include "core/onesided_wire.h"

#include <cstring>
#include <vector>

#include "core/checks.h"
#include "core/mac.h"
#include "kernels/copy.h"
#include "smartcoll/reduce.h"

namespace smartcoll::rma {

namespace {

bool valid_dtype(uint8_t d) { return d <= static_cast<uint8_t>(DataType::i64); }

std::string piece_text(size_t i, const RemotePiece& p) {
  return "piece " + std::to_string(i) + " (" + std::to_string(p.bytes) + " bytes at offset " +
         std::to_string(p.offset) + ")";
}

// The first reason the pieces do not fit `bytes` of a region of element type `dt` for `kind` ("" if they fit);
// `whole`: every piece must be whole elements (accumulate, or a codec).
std::string outside(Kind kind, bool whole, std::span<const RemotePiece> pieces, uint64_t bytes, DataType dt,
                    uint64_t id) {
  const size_t esize = dtype_size(dt);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const RemotePiece& p = pieces[i];
    // offset + bytes <= region, written so that it cannot overflow
    if (p.offset > bytes || p.bytes > bytes - p.offset)
      return piece_text(i, p) + " lies outside region " + std::to_string(id) + " of " + std::to_string(bytes) +
             " bytes";
    if (whole && (p.offset % esize != 0 || p.bytes % esize != 0))
      return std::string(kind_name(static_cast<uint8_t>(kind))) + ": " + piece_text(i, p) + " is not made of whole " +
             std::string(dtype_name(dt)) + " elements of region " + std::to_string(id) + " (offsets and sizes must be multiples of " +
             std::to_string(esize) + " bytes)";
  }
  return "";
}

}  // namespace

std::string hello_refusal(const Hello& h, int size, uint64_t job, const uint8_t (&token)[16]) {
  if (h.magic != kHelloMagic || h.version != kVersion)
    return "not a smartcoll one-sided hello, or another version (magic " + std::to_string(h.magic) + ", version " +
           std::to_string(h.version) + ")";
  if (h.job != job) return "it belongs to another job (a different job id)";
  if (h.size != static_cast<uint32_t>(size))
    return "it has world size " + std::to_string(h.size) + ", this job " + std::to_string(size);
  if (h.rank >= static_cast<uint32_t>(size)) return "rank " + std::to_string(h.rank) + " is outside the world";
  // Every byte compared: the time taken tells nothing of where a guess went wrong.
  if (!equal_constant_time(h.token, token)) return "a wrong token (it did not read this rank's address from the job's store)";
  return "";
}

const char* kind_name(uint8_t kind) {
  switch (static_cast<Kind>(kind)) {
    case Kind::get: return "getv";
    case Kind::put: return "putv";
    case Kind::accumulate: return "accumulatev";
    case Kind::data: return "data";
    case Kind::done: return "done";
    case Kind::error: return "error";
  }
  return "unknown";
}

std::string malformed(const Header& h, bool at_target) {
  if (h.magic != kMagic) return "bad magic " + std::to_string(h.magic);
  if (h.version != kVersion) return "version " + std::to_string(h.version) + ", this build speaks " +
                                    std::to_string(kVersion);
  if (h.reserved != 0) return "reserved field set";
  const Kind kind = static_cast<Kind>(h.kind);
  if (at_target ? !is_request(h.kind) : !is_answer(h.kind))
    return std::string(at_target ? "a target" : "an initiator") + " cannot take a message of kind " +
           std::to_string(h.kind) + " (" + kind_name(h.kind) + ")";
  if (h.payload > kMaxPayload)
    return "payload of " + std::to_string(h.payload) + " bytes exceeds " + std::to_string(kMaxPayload);
  if (at_target) {
    if (h.npieces > kMaxPieces)
      return std::to_string(h.npieces) + " pieces exceed " + std::to_string(kMaxPieces);
    if (kind == Kind::get && h.payload != 0) return "a getv request carries no payload";
    if (kind == Kind::accumulate && (!valid_dtype(h.dtype) || h.op > static_cast<uint8_t>(ReduceOp::avg)))
      return "accumulatev with dtype " + std::to_string(h.dtype) + " and op " + std::to_string(h.op);
    // A codec's canonical name, NUL-padded: nothing after the first NUL, and a name parse() takes.
    const size_t len = ::strnlen(h.codec, sizeof h.codec);
    if (len == sizeof h.codec) return "a codec name without its end";
    for (size_t i = len; i < sizeof h.codec; ++i)
      if (h.codec[i] != 0) return "bytes after the codec name";
    if (len) {
      try {
        Codec::parse(std::string_view(h.codec, len));
      } catch (const InvalidArgument&) {
        return "unknown codec '" + std::string(h.codec, len) + "'";
      }
    }
    return "";
  }
  if (h.npieces != 0) return "an answer carries no pieces";
  if (h.codec[0] != 0) return "an answer names no codec";
  if (kind == Kind::done && h.payload != 0) return "a done answer carries no payload";
  if (kind == Kind::error && h.payload > kMaxErrorText)
    return "an error text of " + std::to_string(h.payload) + " bytes";
  return "";
}

std::optional<Codec> codec_of(const Header& h) {
  if (h.codec[0] == 0) return std::nullopt;
  return Codec::parse(std::string_view(h.codec, ::strnlen(h.codec, sizeof h.codec)));
}

void set_codec(Header& h, const std::optional<Codec>& codec) {
  std::memset(h.codec, 0, sizeof h.codec);
  if (!codec) return;
  const std::string name = codec->name();
  require(name.size() < sizeof h.codec, "codec name '" + name + "' is too long for a one-sided call");
  std::memcpy(h.codec, name.data(), name.size());
}

uint64_t wire_bytes(std::span<const RemotePiece> pieces, const std::optional<Codec>& codec) {
  uint64_t total = 0;
  for (const RemotePiece& p : pieces) total += codec ? codec->encoded_size(p.bytes / 4) : p.bytes;
  return total;
}

std::string malformed_pieces(const Header& h, std::span<const RemotePiece> pieces) {
  const std::optional<Codec> codec = codec_of(h);
  size_t at = 0;
  if (!sum_bytes(pieces, kMaxPayload, &at))
    return "the pieces add up to more than " + std::to_string(kMaxPayload) + " bytes (at piece " +
           std::to_string(at) + ")";
  for (size_t i = 0; codec && i < pieces.size(); ++i)
    if (pieces[i].bytes % 4 != 0)
      return "under codec " + codec->name() + ", " + piece_text(i, pieces[i]) + " is not whole float32 elements";
  const uint64_t wire = wire_bytes(pieces, codec);  // no more than `total`: no codec is larger than float32
  if (static_cast<Kind>(h.kind) != Kind::get && wire != h.payload)
    return "the pieces add up to " + std::to_string(wire) + " bytes on the wire but the payload is " +
           std::to_string(h.payload);
  return "";
}

std::string refusal(const Header& h, std::span<const RemotePiece> pieces, const RegionInfo& region) {
  const Kind kind = static_cast<Kind>(h.kind);
  const bool coded = h.codec[0] != 0;
  if (coded && region.dtype != DataType::f32)
    return std::string(kind_name(h.kind)) + " with a codec needs a float32 region; region " +
           std::to_string(region.id) + " holds " + std::string(dtype_name(region.dtype));
  if (coded && kind == Kind::accumulate && static_cast<ReduceOp>(h.op) != ReduceOp::sum)
    return "accumulatev with a codec adds (op 'sum') and nothing else";
  if (kind == Kind::accumulate) {
    const auto dt = static_cast<DataType>(h.dtype);
    if (dt != region.dtype)
      return "accumulatev: region " + std::to_string(region.id) + " holds " + std::string(dtype_name(region.dtype)) +
             ", the initiator sent " + std::string(dtype_name(dt));
    if (static_cast<ReduceOp>(h.op) == ReduceOp::avg)
      return "accumulatev: op 'avg' is not an accumulation; use 'sum' and divide";
  }
  return outside(kind, kind == Kind::accumulate || coded, pieces, region.bytes, region.dtype, region.id);
}

void check_call(Kind kind, const RemoteRegion& region, std::span<const RemotePiece> pieces, size_t local_bytes,
                ReduceOp op, const std::optional<Codec>& codec) {
  const std::string name = kind_name(static_cast<uint8_t>(kind));
  require(pieces.size() <= kMaxPieces, name + ": " + std::to_string(pieces.size()) + " pieces exceed the limit of " +
                                           std::to_string(kMaxPieces) + " per call; split the call");
  const std::optional<uint64_t> total = sum_bytes(pieces, kMaxPayload);
  require(total.has_value(), name + ": a call moves at most " + std::to_string(kMaxPayload) + " bytes; split it");
  require(*total == local_bytes, name + ": the remote pieces add up to " + std::to_string(*total) +
                                    " bytes but the local buffers to " + std::to_string(local_bytes) +
                                    "; they must match");
  Header h;
  h.kind = static_cast<uint8_t>(kind);
  h.dtype = static_cast<uint8_t>(region.dtype);
  h.op = static_cast<uint8_t>(op);
  set_codec(h, codec);
  const std::string why = refusal(h, pieces, {region.id, region.bytes, region.dtype});
  require(why.empty(), name + " to rank " + std::to_string(region.rank) + ": " + why);
}

namespace {

// The pieces' bytes in the region, for the gather and scatter kernels.
auto in_region(char* base, std::span<const RemotePiece> pieces) {
  return [base, pieces](size_t k) { return std::pair<char*, size_t>{base + pieces[k].offset, pieces[k].bytes}; };
}

}  // namespace

void gather(const char* base, std::span<const RemotePiece> pieces, char* out, const std::optional<Codec>& codec) {
  if (!codec) {
    kernels::gather(out, pieces.size(), in_region(const_cast<char*>(base), pieces), sum_bytes(pieces, UINT64_MAX).value_or(0));
    return;
  }
  std::vector<float> floats;
  for (const RemotePiece& p : pieces) {
    if (p.bytes == 0) continue;  // an empty piece may come with a null `out`
    // Whole float32 elements (refusal()); the region may hold them at any address.
    const size_t n = p.bytes / 4;
    floats.resize(n);
    std::memcpy(floats.data(), base + p.offset, p.bytes);
    codec->encode(floats.data(), n, reinterpret_cast<uint8_t*>(out));
    out += codec->encoded_size(n);
  }
}

void scatter(char* base, std::span<const RemotePiece> pieces, const char* in, const Header& h,
             const std::optional<Codec>& codec) {
  const auto dt = static_cast<DataType>(h.dtype);
  const bool put = static_cast<Kind>(h.kind) == Kind::put;
  if (put && !codec) {  // `in` is the connection's staging, never inside a region: the kernel may copy
    kernels::scatter(in, pieces.size(), in_region(base, pieces), sum_bytes(pieces, UINT64_MAX).value_or(0));
    return;
  }
  std::vector<float> floats;
  for (const RemotePiece& p : pieces) {
    char* at = base + p.offset;
    if (p.bytes == 0) continue;  // `in` may be null when every piece is empty
    if (codec) {
      const size_t n = p.bytes / 4;
      floats.resize(n);
      std::memcpy(floats.data(), at, put ? 0 : p.bytes);
      const auto* enc = reinterpret_cast<const uint8_t*>(in);
      put ? codec->decode(enc, n, floats.data()) : codec->decode_add(enc, n, floats.data(), floats.data());
      std::memcpy(at, floats.data(), p.bytes);
      in += codec->encoded_size(n);
      continue;
    }
    reduce(dt, static_cast<ReduceOp>(h.op), at, at, in, p.bytes / dtype_size(dt));
    in += p.bytes;
  }
}

}  // namespace smartcoll::rma
