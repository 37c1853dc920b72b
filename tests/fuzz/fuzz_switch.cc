// Fuzz target for the aggregation switch's datagrams (switch_fuzz.h): parsed, then handled by a switch with a job.
#include "switch_fuzz.h"
#include "targets.h"

namespace smartcoll::fuzz {

void switch_packet(const uint8_t* data, size_t size) { fuzz_switch_packet(data, size); }

Seeds switch_packet_seeds() {
  using namespace smartcoll::sw;
  Seeds seeds;
  for (uint16_t rank = 0; rank < 3; ++rank) {
    Header h;
    h.type = Type::contribution;
    h.dtype = DataType::f32;
    h.job = fuzzing::kJob;
    h.seq = rank;
    h.slot = rank;
    h.call = 7;
    h.rank = rank;
    h.world = 3;
    h.count = 16;
    std::string d(kHeaderBytes + 64, '\1');
    write_header(h, SipKey{0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL},
                 reinterpret_cast<uint8_t*>(d.data()) + kHeaderBytes, 64, reinterpret_cast<uint8_t*>(d.data()));
    seeds.push_back(d);
  }
  return seeds;
}

}  // namespace smartcoll::fuzz
