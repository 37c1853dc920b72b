// Rendezvous store latency on loopback: client connect (with and without the shared-secret handshake), get of an
// existing key, set followed by get, and a round of many clients each fetching one key. Prints medians (and p90)
// in microseconds.
//
//     build-tests/smartcoll_store_bench [--iters N] [--clients N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "smartcoll/store.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Summary {
  double median_us, p90_us;
};

Summary summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[us.size() * 9 / 10]};
}

template <class F>
Summary time_each(int iters, F&& body) {
  std::vector<double> us;
  us.reserve(iters);
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    body(i);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return summarize(std::move(us));
}

void print(const char* what, Summary s) {
  std::printf("%-34s median %9.1f us   p90 %9.1f us\n", what, s.median_us, s.p90_us);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 2000, clients = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--clients")) clients = std::atoi(argv[i + 1]);
  }
  using smartcoll::TcpStore;
  const auto timeout = std::chrono::seconds(10);
  TcpStore server("127.0.0.1", 0, true, timeout);
  const uint16_t port = server.port();
  server.set("addr/0", std::string(64, 'a'));

  print("connect (new client)", time_each(iters / 4, [&](int) { TcpStore c("127.0.0.1", port, false, timeout); }));
  {
    TcpStore guarded("127.0.0.1", 0, true, timeout, "benchmark-secret");
    print("connect + secret handshake", time_each(iters / 4, [&](int) {
      TcpStore c("127.0.0.1", guarded.port(), false, timeout, "benchmark-secret");
    }));
  }

  TcpStore client("127.0.0.1", port, false, timeout);
  print("get (existing key, 64 B)", time_each(iters, [&](int) { client.get("addr/0", timeout); }));
  print("set + get (64 B)", time_each(iters, [&](int i) {
    const std::string key = "k/" + std::to_string(i);
    client.set(key, std::string(64, 'v'));
    client.get(key, timeout);
  }));

  std::vector<std::unique_ptr<TcpStore>> many;
  for (int i = 0; i < clients; ++i) many.push_back(std::make_unique<TcpStore>("127.0.0.1", port, false, timeout));
  char label[64];
  std::snprintf(label, sizeof label, "round of %d clients' gets", clients);
  print(label, time_each(iters / 20, [&](int) {
    for (auto& c : many) c->get("addr/0", timeout);
  }));
  return 0;
}
