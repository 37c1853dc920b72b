// The switch wire protocol (docs/wire-format.md, "The aggregation switch"): UDP datagrams of a 48-byte header
// and a payload, between workers (client.h) and the aggregation switch (server.h).
//
// Every datagram carries a keyed MAC (SipHash-2-4 with the job's 128-bit secret) over its header, and with
// full authentication over its payload too. parse() is pure: it range-checks every field that does not need the
// job's state and says why it rejects a datagram; the receiver then checks the MAC with the job's key and the
// fields against the job (rank < world, slot < window, ...), so that nothing from the network is used unchecked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/siphash.h"
#include "smartcoll/codec.h"
#include "smartcoll/types.h"

namespace smartcoll::sw {

inline constexpr uint32_t kMagic = 0x57534353;  // the bytes "SCSW"
inline constexpr uint8_t kVersion = 2;  // 2: encoded payloads (codec byte 1) and the codec in join
inline constexpr size_t kHeaderBytes = 48;
inline constexpr size_t kMacOffset = 40;  // the MAC covers bytes [0, 40) of the header
inline constexpr size_t kMaxPayload = 32768;
inline constexpr uint32_t kMaxWorld = 1024;
inline constexpr uint32_t kMaxWindow = 4096;   // slots of one job on one switch
inline constexpr uint16_t kAllRanks = 0xffff;  // rank field of a result: for every worker
inline constexpr size_t kMaxDatagram = kHeaderBytes + kMaxPayload;

enum class Type : uint8_t {
  join = 1,          // worker -> switch: register (or rejoin) a job; payload JoinBody
  joined = 2,        // switch -> worker: the answer; payload JoinedBody
  contribution = 3,  // worker -> switch: one chunk of a worker's vector
  result = 4,        // switch -> workers: the chunk reduced over every worker
  pending = 5,       // switch -> worker: a retransmitted chunk is still waiting; payload: bitmap of ranks in
  error = 6,         // switch -> worker: the chunk cannot complete; payload ErrorBody
  leave = 7,         // worker -> switch: this rank is done with the job
  query = 8,         // anyone -> switch: asks for the open counters; payload: padding, the room for the answer
  stats = 9,         // switch -> asker: the open counters as JSON, never longer than the query
  done = 10,         // switch -> worker: a chunk of reduce_scatter or allgather is complete, its data went to others
};
inline constexpr uint8_t kLastType = 10;
// query and stats are open (docs/wire-format.md): their MAC uses this public key, so it only checks integrity.
inline constexpr SipKey kOpenKey{0, 0};

enum Flags : uint8_t {
  kFullAuth = 1,    // the MAC covers the payload too
  kRetransmit = 2,  // a worker's copy sent again after a timeout (statistics only)
  // A chunk of one rank's block (its owner's; docs/wire-format.md). reduce_scatter: every rank sends its copy,
  // the sum goes to the owner alone. allgather: the owner sends the data, every other rank an empty payload,
  // and the data goes to the others. The ranks that get no data get a `done`.
  kScatter = 4,
  kGather = 8,
  kOwner = 16,  // the sender owns the chunk (with kScatter or kGather only)
};
inline constexpr uint8_t kShare = kScatter | kGather;
inline constexpr uint8_t kKnownFlags = kFullAuth | kRetransmit | kShare | kOwner;

struct Header {
  Type type = Type::contribution;
  uint8_t flags = 0;
  DataType dtype = DataType::f32;
  uint64_t job = 0;
  uint64_t seq = 0;    // the chunk's number in the job's sequence on this switch (every worker counts alike)
  uint32_t slot = 0;   // seq mod window: the switch's aggregation slot
  uint32_t call = 0;   // digest of the call (number, count, dtype, op): workers that disagree never mix
  uint16_t rank = 0;   // the sender (worker -> switch) or the addressee, kAllRanks for everyone
  uint16_t world = 0;  // workers in the job
  uint16_t count = 0;  // elements in the payload (contribution, result)
  ReduceOp op = ReduceOp::sum;
  uint8_t codec = 0;  // 0: raw elements; kEncoded: float32 sums encoded with the job's codec (JoinBody)
  uint64_t mac = 0;
};

// The header's codec byte: a contribution or result whose payload is `count` float32 elements encoded with the
// job's codec (sum only), which the switch decodes, sums in float32 and encodes once for every worker.
inline constexpr uint8_t kEncoded = 1;

// join's payload: the job's secret (trust on first use: the first join of a job id binds it), its window, the
// largest payload it sends, whether every datagram is fully authenticated, and the codec of its encoded chunks.
struct JoinBody {
  uint8_t key[16];
  uint32_t window;
  uint32_t max_payload;
  uint8_t full_auth;
  uint8_t codec;  // CodecKind (0: identity: the job sends no encoded chunks)
  uint8_t codec_mant, codec_exp;
  uint16_t codec_block;
  uint8_t pad[2];
};
static_assert(sizeof(JoinBody) == 32);
void put_codec(JoinBody& body, const Codec& codec);
// The codec a join asks for; false when its fields name none (the join is refused as too_large).
bool get_codec(const JoinBody& body, Codec& codec);
// Payload bytes of `count` elements of a contribution or result: raw, or encoded with `codec`; none for an
// allgather contribution of a rank that does not own the chunk.
size_t payload_bytes(const Header& h, const Codec& codec);
// Whether rank r gets a chunk's data (a result) rather than a `done`, for the chunk's kShare flags and owner.
inline bool gets_data(uint8_t share, int owner, int r) {
  return share == 0 || (share == kScatter) == (r == owner);
}

// What a switch supports, in the `call` field of its `joined` answer (a switch from before these echoes the join's
// 0 there). kFeatureOwned: chunks owned by one rank (kScatter, kGather), which an older switch drops as bad_flags.
inline constexpr uint32_t kFeatureOwned = 1;
inline constexpr uint32_t kFeatures = kFeatureOwned;

enum class JoinStatus : uint32_t { ok = 0, no_room = 1, needs_full_auth = 2, too_large = 3, conflict = 4 };
struct JoinedBody {
  uint32_t status;   // JoinStatus
  uint32_t threads;  // slot s goes to UDP port base + s mod threads
  uint32_t window;
  uint32_t free_slots;  // what the switch could still grant (for the refusal's message)
};
static_assert(sizeof(JoinedBody) == 16);

enum class ErrorCause : uint32_t { mismatch = 1 };
struct ErrorBody {
  uint32_t cause;  // ErrorCause
  uint16_t first_rank;  // mismatch: the rank whose call the slot holds
  uint16_t pad;
};
static_assert(sizeof(ErrorBody) == 8);

// Why parse() rejected a datagram (also the switch's drop counters for malformed ones).
enum class Reject : uint8_t {
  none,
  short_datagram,
  bad_magic,
  bad_version,
  bad_type,
  bad_flags,
  bad_dtype,
  bad_op,
  bad_codec,
  bad_world,
  bad_rank,
  bad_slot,
  bad_count,
  bad_length,
};
inline constexpr int kRejectReasons = 14;
std::string_view reject_name(Reject r);

struct Packet {
  Header h;
  const uint8_t* payload = nullptr;
  size_t payload_len = 0;
};

struct Parsed {
  Reject why = Reject::none;
  Packet pkt;
  bool ok() const { return why == Reject::none; }
};

// Checks every field a datagram's header can be checked for on its own; never reads past len.
Parsed parse(const uint8_t* data, size_t len);

// Serializes h (its mac field ignored) into out[0, kHeaderBytes) with the MAC over it, and over the payload when
// h.flags has kFullAuth.
void write_header(const Header& h, const SipKey& key, const void* payload, size_t payload_len, uint8_t* out);
// The MAC a datagram should carry (raw: its first kHeaderBytes bytes as received).
uint64_t compute_mac(const SipKey& key, const uint8_t* raw, const void* payload, size_t payload_len, bool full);
// True when the datagram's MAC is right for `key`, and it covers the payload where `need_full` says it must.
bool authentic(const Packet& p, const uint8_t* raw, const SipKey& key, bool need_full);

// The 64-bit job id the switch knows a job by: the job id string keyed with the job's secret, so that it is new
// for every communicator and cannot be guessed before the job joins.
uint64_t job_tag(const SipKey& key, std::string_view job_id);
// The digest of one call as every worker computes it (share: its kShare flags).
uint32_t call_digest(uint64_t number, size_t count, DataType dt, ReduceOp op, uint8_t share = 0);

}  // namespace smartcoll::sw
