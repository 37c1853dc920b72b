// Fuzz target for the aggregation switch's datagrams (switch_fuzz.h): parsed, then handled by a switch with a job.
#include "switch_fuzz.h"
#include "targets.h"

namespace smartcoll::fuzz {

void switch_packet(const uint8_t* data, size_t size) { fuzz_switch_packet(data, size); }

Seeds switch_packet_seeds() {
  using namespace smartcoll::sw;
  Seeds seeds;
  const size_t encoded = Codec::parse("bfp16").encoded_size(32);
  // Raw chunks of one slot from every rank, encoded ones of another, and an open stats query.
  for (uint8_t codec : {uint8_t{0}, kEncoded}) {
    for (uint16_t rank = 0; rank < 3; ++rank) {
      Header h;
      h.type = Type::contribution;
      h.dtype = DataType::f32;
      h.job = fuzzing::kJob;
      h.seq = codec;
      h.slot = codec;
      h.call = 7;
      h.rank = rank;
      h.world = 3;
      h.count = codec ? 32 : 16;
      h.codec = codec;
      const size_t len = codec ? encoded : 64;
      std::string d(kHeaderBytes + len, '\1');
      write_header(h, SipKey{0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL},
                   reinterpret_cast<uint8_t*>(d.data()) + kHeaderBytes, len, reinterpret_cast<uint8_t*>(d.data()));
      seeds.push_back(d);
    }
  }
  // Owned chunks: a reduce_scatter chunk from its owner and from another rank, an allgather chunk from its owner
  // (with data) and an empty one from another rank, and a done (which the switch never takes).
  const SipKey key{0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL};
  const uint8_t owned[][2] = {{kScatter | kOwner, 1}, {kScatter, 1}, {kGather | kOwner, 1}, {kGather, 0}};
  for (size_t i = 0; i < std::size(owned); ++i) {
    Header h;
    h.type = Type::contribution;
    h.flags = owned[i][0];
    h.job = fuzzing::kJob;
    h.seq = h.slot = static_cast<uint32_t>(2 + i / 2);
    h.call = 9;
    h.rank = static_cast<uint16_t>(i % 2);
    h.world = 3;
    h.count = 16;
    const size_t len = owned[i][1] ? 64 : 0;
    std::string d(kHeaderBytes + len, '\2');
    auto* bytes = reinterpret_cast<uint8_t*>(d.data());
    write_header(h, key, bytes + kHeaderBytes, len, bytes);
    seeds.push_back(d);
  }
  {
    Header h;
    h.type = Type::done;
    h.job = fuzzing::kJob;
    h.world = 3;
    std::string d(kHeaderBytes, '\0');
    write_header(h, key, nullptr, 0, reinterpret_cast<uint8_t*>(d.data()));
    seeds.push_back(d);
  }
  Header q;
  q.type = Type::query;
  q.world = 1;
  std::string d(kHeaderBytes + 2048, '\0');
  write_header(q, kOpenKey, reinterpret_cast<uint8_t*>(d.data()) + kHeaderBytes, 2048,
               reinterpret_cast<uint8_t*>(d.data()));
  seeds.push_back(d);
  return seeds;
}

}  // namespace smartcoll::fuzz
