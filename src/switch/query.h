// The switch's open counters over the network (docs/wire-format.md, "Stats query"): what
// `smartcoll switch --query ADDR:PORT` and monitoring use, without the job's secret.
#pragma once

#include <cstdint>
#include <string>

namespace smartcoll::sw {

// Sends `query` datagrams to host:port (every 200 ms) until a `stats` answer comes; returns its JSON text.
// Throws CommError naming the address when none comes within timeout_s seconds.
std::string query_stats(const std::string& host, uint16_t port, double timeout_s);

}  // namespace smartcoll::sw
