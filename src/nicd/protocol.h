// The control protocol between ranks and the offload daemon (`smartcoll nicd`), over a Unix SOCK_SEQPACKET
// socket: one message per datagram, each a header (magic "NICD", version, type) and the type's fields in little
// endian, strings as a 32-bit length and bytes. Only addresses and small records travel here; the data itself is
// read from and written into the ranks' memory by the daemon (process_vm_readv / process_vm_writev).
// docs/nicd.md describes every message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace smartcoll::nicd {

inline constexpr uint32_t kMagic = 0x4443494e;  // "NICD" as little-endian bytes
inline constexpr uint16_t kVersion = 2;
inline constexpr size_t kMaxMessage = 512 * 1024;  // a hello of the largest world fits
inline constexpr int kMaxWorld = 65536;
inline constexpr size_t kMaxText = 4096;  // every string field
inline constexpr uint32_t kMaxListPieces = 1u << 20;  // a list call's pieces per side

// $XDG_RUNTIME_DIR/smartcoll-nicd.sock, or /tmp/smartcoll-nicd-UID.sock: where ranks and daemon meet by default.
std::string default_socket();

enum class Type : uint16_t { hello = 1, ready = 2, post = 3, done = 4, abort = 5, bye = 6, heartbeat = 7 };

// rank -> daemon, first message: who the rank is and how the daemons of its job meet.
struct Hello {
  int32_t rank = 0, size = 0;
  double timeout = 0, connect_timeout = 0;
  std::string job_id;
  std::string store;       // where the job's rendezvous store is (Store::locator()); empty: none reachable
  std::string route_hint;  // MASTER_ADDR: the daemons listen on the address that routes to it
  std::string settings;    // the knobs every rank must share, "name=value ..." (Config::must_match)
  std::vector<int32_t> hosts;  // [rank]: its host number
};

// daemon -> rank: the job is formed (every local rank connected, the daemons of all hosts joined) or why not.
struct Ready {
  std::string error;  // empty: ready
};

// rank -> daemon: one collective, numbered from 0 in call order; addresses are in the rank's own memory.
// A list call's in and out are the starts of its views (coll/segmented.h): address ranges that stand for the
// list's buffers one after the other, which the tables map, each an array of `pieces` (address u64, bytes u64)
// in the rank's memory that the daemon reads when it runs the call. A table of 0 pieces: in or out is a buffer.
struct Post {
  uint64_t seq = 0;
  uint8_t coll = 0, dtype = 0, op = 0;
  int32_t root = -1;
  uint64_t count = 0;
  uint64_t in = 0, out = 0;
  std::string codec;  // name of the codec for the inter-host allreduce ("identity": raw elements)
  uint64_t in_table = 0, out_table = 0;
  uint32_t in_pieces = 0, out_pieces = 0;
  uint32_t layout = 0;  // a list call's digest of its counts (0: one buffer), which the ranks of a host must share
  // alltoallv: the address of the rank's table of blocks, per rank d four u64: the offset from `in` and the bytes
  // of its block for d, the offset from `out` and the bytes of its block from d.
  uint64_t blocks = 0;
};

// daemon -> rank: collective `seq` finished (error empty) or failed.
struct Done {
  uint64_t seq = 0;
  std::string error;
};

// rank -> daemon: the application aborted the communicator (reason); daemon -> rank is never sent.
struct Abort {
  std::string reason;
};

// Thrown for a message that is truncated, too long, of another protocol version or with a field out of range.
struct ProtocolError {
  std::string what;
};

std::string encode(const Hello& m);
std::string encode(const Ready& m);
std::string encode(const Post& m);
std::string encode(const Done& m);
std::string encode(const Abort& m);
std::string encode(Type bodiless);  // bye, heartbeat

// The type of a message after checking its header; throws ProtocolError.
Type type_of(std::string_view msg);
// Each checks the header, the type and every field; throws ProtocolError.
Hello decode_hello(std::string_view msg);
Ready decode_ready(std::string_view msg);
Post decode_post(std::string_view msg);
Done decode_done(std::string_view msg);
Abort decode_abort(std::string_view msg);

}  // namespace smartcoll::nicd
