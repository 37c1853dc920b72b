#include "switch/protocol.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace smartcoll::sw {

static_assert(std::endian::native == std::endian::little, "payload elements travel in the host's (x86) byte order");

namespace {

template <class T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);  // little-endian host: the wire order
  return v;
}

template <class T>
void put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

bool worker_to_switch(Type t) {
  return t == Type::join || t == Type::contribution || t == Type::leave || t == Type::query;
}

// Payload bytes a type must carry (SIZE_MAX: count * element size).
size_t expected_payload(const Header& h) {
  switch (h.type) {
    case Type::join: return sizeof(JoinBody);
    case Type::joined: return sizeof(JoinedBody);
    case Type::pending: return (h.world + 7u) / 8u;
    case Type::error: return sizeof(ErrorBody);
    case Type::leave:
    case Type::done: return 0;
    case Type::query:
    case Type::stats: return SIZE_MAX - 1;  // any length up to kMaxPayload
    case Type::contribution:
    case Type::result: return SIZE_MAX;
  }
  return 0;
}

}  // namespace

std::string_view reject_name(Reject r) {
  constexpr std::string_view names[] = {"none",     "short",    "bad_magic", "bad_version", "bad_type",
                                        "bad_flags", "bad_dtype", "bad_op",   "bad_codec",   "bad_world",
                                        "bad_rank",  "bad_slot",  "bad_count", "bad_length"};
  return names[static_cast<int>(r)];
}

Parsed parse(const uint8_t* data, size_t len) {
  Parsed out;
  auto reject = [&](Reject r) {
    out.why = r;
    return out;
  };
  if (data == nullptr || len < kHeaderBytes) return reject(Reject::short_datagram);
  if (get<uint32_t>(data) != kMagic) return reject(Reject::bad_magic);
  if (data[4] != kVersion) return reject(Reject::bad_version);
  if (data[5] == 0 || data[5] > kLastType) return reject(Reject::bad_type);
  // At most one of kScatter and kGather; kOwner only with one of them.
  const uint8_t share = data[6] & kShare;
  if ((data[6] & ~kKnownFlags) || share == kShare || ((data[6] & kOwner) && !share)) return reject(Reject::bad_flags);
  if (data[7] >= std::size(kAllDataTypes)) return reject(Reject::bad_dtype);
  // avg never travels: workers send sums and divide the result themselves.
  if (data[38] > static_cast<uint8_t>(ReduceOp::max)) return reject(Reject::bad_op);
  if (data[39] > kEncoded) return reject(Reject::bad_codec);
  Header& h = out.pkt.h;
  h.type = static_cast<Type>(data[5]);
  h.flags = data[6];
  h.dtype = static_cast<DataType>(data[7]);
  h.job = get<uint64_t>(data + 8);
  h.seq = get<uint64_t>(data + 16);
  h.slot = get<uint32_t>(data + 24);
  h.call = get<uint32_t>(data + 28);
  h.rank = get<uint16_t>(data + 32);
  h.world = get<uint16_t>(data + 34);
  h.count = get<uint16_t>(data + 36);
  h.op = static_cast<ReduceOp>(data[38]);
  h.codec = data[39];
  h.mac = get<uint64_t>(data + kMacOffset);
  if (h.world == 0 || h.world > kMaxWorld) return reject(Reject::bad_world);
  if (h.rank >= h.world && (worker_to_switch(h.type) || h.rank != kAllRanks)) return reject(Reject::bad_rank);
  if (h.slot >= kMaxWindow) return reject(Reject::bad_slot);
  const size_t payload = len - kHeaderBytes;
  size_t expect = expected_payload(h);
  if (expect == SIZE_MAX - 1) {
    if (h.count != 0 || h.codec != 0) return reject(h.count != 0 ? Reject::bad_count : Reject::bad_codec);
    expect = std::min(payload, kMaxPayload);
  } else if (expect == SIZE_MAX) {
    const size_t esize = dtype_size(h.dtype);
    if (h.count == 0 || (h.codec == 0 && h.count * esize > kMaxPayload)) return reject(Reject::bad_count);
    // Encoded: only float32 sums; the length depends on the job's codec, which the receiver checks.
    if (h.codec == kEncoded && (h.dtype != DataType::f32 || h.op != ReduceOp::sum || share))
      return reject(Reject::bad_codec);
    expect = h.codec == kEncoded ? std::clamp<size_t>(payload, 1, kMaxPayload) : payload_bytes(h, Codec());
  } else if (h.count != 0 || h.codec != 0) {
    return reject(h.count != 0 ? Reject::bad_count : Reject::bad_codec);
  }
  if (payload != expect) return reject(Reject::bad_length);
  out.pkt.payload = data + kHeaderBytes;
  out.pkt.payload_len = payload;
  return out;
}

uint64_t compute_mac(const SipKey& key, const uint8_t* raw, const void* payload, size_t payload_len, bool full) {
  SipHasher mac(key);
  mac.update(raw, kMacOffset);
  if (full) mac.update(payload, payload_len);
  return mac.finish();
}

void write_header(const Header& h, const SipKey& key, const void* payload, size_t payload_len, uint8_t* out) {
  put<uint32_t>(out, kMagic);
  out[4] = kVersion;
  out[5] = static_cast<uint8_t>(h.type);
  out[6] = h.flags;
  out[7] = static_cast<uint8_t>(h.dtype);
  put<uint64_t>(out + 8, h.job);
  put<uint64_t>(out + 16, h.seq);
  put<uint32_t>(out + 24, h.slot);
  put<uint32_t>(out + 28, h.call);
  put<uint16_t>(out + 32, h.rank);
  put<uint16_t>(out + 34, h.world);
  put<uint16_t>(out + 36, h.count);
  out[38] = static_cast<uint8_t>(h.op);
  out[39] = h.codec;
  put<uint64_t>(out + kMacOffset, compute_mac(key, out, payload, payload_len, h.flags & kFullAuth));
}

bool authentic(const Packet& p, const uint8_t* raw, const SipKey& key, bool need_full) {
  const bool full = p.h.flags & kFullAuth;
  if (need_full && !full) return false;
  // One 64-bit comparison: its time does not depend on where the values differ.
  return compute_mac(key, raw, p.payload, p.payload_len, full) == p.h.mac;
}

void put_codec(JoinBody& body, const Codec& codec) {
  body.codec = static_cast<uint8_t>(codec.kind());
  body.codec_mant = static_cast<uint8_t>(codec.mant_bits());
  body.codec_exp = static_cast<uint8_t>(codec.exp_bits());
  body.codec_block = static_cast<uint16_t>(codec.block());
}

bool get_codec(const JoinBody& body, Codec& codec) {
  const auto kind = static_cast<CodecKind>(body.codec);
  try {
    if (kind == CodecKind::bfp) {
      codec = Codec::parse("bfp:block=" + std::to_string(body.codec_block) + ",mant=" +
                           std::to_string(body.codec_mant) + ",exp=" + std::to_string(body.codec_exp));
      return true;
    }
    if (kind == CodecKind::identity) {
      codec = Codec();
      return true;
    }
    for (const std::string& name : Codec::names()) {
      const Codec c = Codec::parse(name);
      if (c.kind() == kind && c.kind() != CodecKind::bfp) {
        codec = c;
        return true;
      }
    }
  } catch (const InvalidArgument&) {
  }
  return false;
}

size_t payload_bytes(const Header& h, const Codec& codec) {
  if (h.type == Type::contribution && (h.flags & kShare) == kGather && !(h.flags & kOwner)) return 0;
  return h.codec == kEncoded ? codec.encoded_size(h.count) : h.count * dtype_size(h.dtype);
}

uint64_t job_tag(const SipKey& key, std::string_view job_id) { return siphash24(key, job_id.data(), job_id.size()); }

uint32_t call_digest(uint64_t number, size_t count, DataType dt, ReduceOp op, uint8_t share) {
  const uint64_t words[3] = {number, static_cast<uint64_t>(count),
                             static_cast<uint64_t>(dt) | static_cast<uint64_t>(op) << 8 |
                                 static_cast<uint64_t>(share) << 16};
  const uint64_t h = siphash24(SipKey{0x736d617274636f6cULL, 0x6c2d63616c6c2d31ULL}, words, sizeof words);
  return static_cast<uint32_t>(h ^ (h >> 32));
}

}  // namespace smartcoll::sw
