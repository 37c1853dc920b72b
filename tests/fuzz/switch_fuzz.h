// The switch's packet path as a fuzz target: fuzz_switch_packet(data, size) runs a datagram through parse() and
// an aggregation switch that has a job registered. A datagram that parses is also fed again with its MAC made
// right for that job (the open key for a query), so that the slot logic sees arbitrary well-formed fields, not
// only forgeries. The job has a codec (bfp16), so that encoded chunks are decoded, summed and encoded too.
#pragma once

#include <cstring>
#include <vector>

#include "switch/aggregator.h"

namespace smartcoll::sw::fuzzing {

inline constexpr uint64_t kJob = 0x66757a7a6a6f6221ULL;

class NullOutbox : public Outbox {
 public:
  void send(const sockaddr_in&, const uint8_t* data, size_t len, bool) override {
    if (len) sink_ ^= data[len - 1];  // touch what would go out
  }
  uint8_t sink_ = 0;
};

class Target {
 public:
  Target() : agg_(2, 64, false) {
    key_ = {0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL};
    for (uint16_t rank = 0; rank < 3; ++rank) {  // a job of 3 ranks, window 8, 64-byte payloads, bfp16
      JoinBody body{};
      key_.to_bytes(body.key);
      body.window = 8;
      body.max_payload = 64;
      put_codec(body, Codec::parse("bfp16"));
      Header h;
      h.type = Type::join;
      h.job = kJob;
      h.rank = rank;
      h.world = 3;
      uint8_t d[kHeaderBytes + sizeof body];
      std::memcpy(d + kHeaderBytes, &body, sizeof body);
      write_header(h, key_, d + kHeaderBytes, sizeof body, d);
      agg_.handle(0, d, sizeof d, sockaddr_in{}, out_, Clock::now());
    }
  }
  void feed(const uint8_t* data, size_t size) {
    const auto now = Clock::now();
    agg_.handle(0, data, size, sockaddr_in{}, out_, now);
    const Parsed p = parse(data, size);
    if (!p.ok() || p.pkt.h.type == Type::leave) return;  // (a leave of every rank would end the job)
    std::vector<uint8_t> copy(data, data + size);
    Header h = p.pkt.h;
    h.job = kJob;
    write_header(h, h.type == Type::query ? kOpenKey : key_, copy.data() + kHeaderBytes, size - kHeaderBytes,
                 copy.data());
    agg_.handle(static_cast<int>(h.slot % 2), copy.data(), copy.size(), sockaddr_in{}, out_, now);
  }

 private:
  Aggregator agg_;
  SipKey key_;
  NullOutbox out_;
};

}  // namespace smartcoll::sw::fuzzing

inline void fuzz_switch_packet(const uint8_t* data, size_t size) {
  static smartcoll::sw::fuzzing::Target target;
  target.feed(data, size);
}
