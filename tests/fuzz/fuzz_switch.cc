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
