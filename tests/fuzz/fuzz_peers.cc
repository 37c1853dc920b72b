// Fuzz targets for what ranks read from each other: the hello on a new connection, a call's descriptor, and rank
// 0's start-up verdict in the store.
#include <cstring>
#include <string>

#include "core/agreement.h"
#include "targets.h"
#include "transport/tcp.h"

namespace smartcoll::fuzz {

namespace {

template <class T>
T from_bytes(const uint8_t* data, size_t size) {
  T value{};
  std::memcpy(&value, data, std::min(size, sizeof value));
  return value;
}

template <class T>
std::string to_bytes(const T& value) {
  return std::string(reinterpret_cast<const char*>(&value), sizeof value);
}

}  // namespace

void peer_hello(const uint8_t* data, size_t size) {
  const Hello h = from_bytes<Hello>(data, size);
  // The accepting rank's own view: taken from the input too, so that every combination is reached.
  const int world = 1 + (size > sizeof h ? data[sizeof h] % 16 : 4), rank = h.size % static_cast<uint32_t>(world);
  const int streams = 1 + (size > sizeof h + 1 ? data[sizeof h + 1] % 4 : 0);
  const uint64_t job = job_fingerprint("job");
  const bool valid = h.magic == kHelloMagic && h.job == job && h.size == static_cast<uint32_t>(world) &&
                     h.rank > static_cast<uint32_t>(rank) && h.rank < static_cast<uint32_t>(world) &&
                     h.stream < static_cast<uint32_t>(streams);
  FUZZ_CHECK(hello_refusal(h, rank, world, streams, job).empty() == valid);
}

Seeds peer_hello_seeds() {
  return {to_bytes(Hello{kHelloMagic, 3, 1, 4, job_fingerprint("job")}) + std::string("\x03\x01", 2),
          to_bytes(Hello{kHelloMagic, 1, 0, 2, job_fingerprint("other")}) + std::string("\x01\x00", 2)};
}

void call_descriptor(const uint8_t* data, size_t size) {
  const Descriptor d = from_bytes<Descriptor>(data, size);
  const std::string text = describe(d);
  // Whatever the bytes, describing them names a known call or says they are foreign: never a crash.
  const bool known = d.magic == kDescriptorMagic && d.coll < kCollectives;
  FUZZ_CHECK(known || text == "a corrupted or foreign message");
  const Descriptor mine =
      make_descriptor(Collective::allreduce, DataType::f32, ReduceOp::sum, Algorithm::ring, -1, 1024, Codec(), false);
  // The receiver's check is this comparison: with no padding in the struct it is exactly byte equality.
  FUZZ_CHECK((d == mine) == (std::memcmp(&d, &mine, sizeof d) == 0));
}

Seeds call_descriptor_seeds() {
  return {to_bytes(make_descriptor(Collective::allreduce, DataType::f32, ReduceOp::sum, Algorithm::ring, -1, 1024,
                                   Codec(), false)),
          to_bytes(make_descriptor(Collective::allgather, DataType::bf16, ReduceOp::sum, Algorithm::bruck, -1, 7,
                                   Codec::parse("bfp16"), false)),
          to_bytes(make_descriptor(Collective::broadcast, DataType::i64, ReduceOp::sum, Algorithm::tree, 3, 1 << 20,
                                   Codec(), false))};
}

void start_up_verdict(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const int world = 1 + static_cast<int>(size % 5);
  try {
    const StartUpVerdict v = parse_verdict(text, world);
    FUZZ_CHECK(v.claims.size() == static_cast<size_t>(world) && v.hosts.size() == static_cast<size_t>(world));
    for (int h : v.hosts) FUZZ_CHECK(h >= 0 && h < world);
  } catch (const CommError&) {  // malformed: refused, by name
  }
}

Seeds start_up_verdict_seeds() {
  return {"ok c0 0", "ok aa bb 0 1", "ok a b c 0 0 1", "ok a b c d 0 1 0 1", "ok a b c d e 0 1 2 3 4",
          "ranks disagree on settings"};
}

}  // namespace smartcoll::fuzz
