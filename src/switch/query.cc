#include "switch/query.h"

#include <poll.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "switch/protocol.h"
#include "transport/udp.h"

namespace smartcoll::sw {

std::string query_stats(const std::string& host, uint16_t port, double timeout_s) {
  net::Fd fd = udp::open("0.0.0.0", 0);
  const sockaddr_in to = net::ipv4_address(host, port);
  // The padding is the room the switch may fill: the whole payload, so that many jobs fit.
  std::vector<uint8_t> datagram(kMaxDatagram, 0);
  Header h;
  h.type = Type::query;
  h.world = 1;
  write_header(h, kOpenKey, datagram.data() + kHeaderBytes, kMaxPayload, datagram.data());
  udp::SendBatch batch(1);
  udp::RecvBatch in(4, kMaxDatagram);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < give_up) {
    batch.add(to, datagram.data(), datagram.size());
    batch.flush(fd.get());
    pollfd p{fd.get(), POLLIN, 0};
    ::poll(&p, 1, 200);
    const size_t n = in.receive(fd.get());
    for (size_t i = 0; i < n; ++i) {
      if (in.from(i).sin_addr.s_addr != to.sin_addr.s_addr || in.from(i).sin_port != to.sin_port) continue;
      const Parsed got = parse(in.data(i), in.len(i));
      if (got.ok() && got.pkt.h.type == Type::stats && authentic(got.pkt, in.data(i), kOpenKey, true))
        return std::string(reinterpret_cast<const char*>(got.pkt.payload), got.pkt.payload_len);
    }
  }
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g", timeout_s);
  throw CommError("switch " + host + ":" + std::to_string(port) + " did not answer a stats query within " +
                  seconds + " s: is `smartcoll switch` (protocol version " +
                  std::to_string(kVersion) + ") running there?");
}

}  // namespace smartcoll::sw
