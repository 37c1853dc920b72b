// The offload daemon (nicd/server.h) with ranks as threads of this process: the daemon reads and writes their
// buffers with process_vm_readv/writev on this process's own pid, so the whole path runs here (and under the
// sanitizers). Across "hosts" (the host knob) the daemons meet through a file store.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <thread>

#include "nicd/protocol.h"
#include "nicd/server.h"
#include "ranks.h"

namespace smartcoll {
namespace {

using harness::run_threads;
using harness::test_options;

std::string socket_path(const std::string& tag) {
  return "/tmp/smartcoll-nicd-gtest-" + std::to_string(::getpid()) + "-" + tag + ".sock";
}

Options nicd_options(const std::string& socket, const std::string& host = "", const std::string& timeout = "20") {
  return test_options({{"engine", "nicd"}, {"nicd_socket", socket}, {"host", host}, {"timeout", timeout}});
}

// Rank r sends rank d element i of block d: a value naming (r, d, i), with no short period in i, so a block or a
// part at the wrong place shows. Integers under 2^24: exact in float too. An alltoall only moves data, so the
// floats are checked bitwise too.
template <typename T>
T a2a_value(int from, int to, size_t i) {
  return static_cast<T>((static_cast<uint64_t>(from) * 1000003 + static_cast<uint64_t>(to) * 10007 + i * 7919) %
                        16777213);
}

template <typename T>
void check_alltoall(Communicator& comm, size_t count, DataType dt) {
  const int n = comm.size(), r = comm.rank();
  std::vector<T> in(static_cast<size_t>(n) * count), out(in.size(), T{-1});
  for (int d = 0; d < n; ++d)
    for (size_t i = 0; i < count; ++i) in[static_cast<size_t>(d) * count + i] = a2a_value<T>(r, d, i);
  comm.alltoall(in.data(), out.data(), count, dt)->wait();
  for (int s = 0; s < n; ++s)
    for (size_t i = 0; i < count; ++i) {
      const T want = a2a_value<T>(s, r, i), got = out[static_cast<size_t>(s) * count + i];
      ASSERT_EQ(std::memcmp(&got, &want, sizeof(T)), 0)
          << "rank " << r << ", block from rank " << s << ", element " << i;
    }
}

void check_alltoalls(Communicator& comm) {
  check_alltoall<int32_t>(comm, 1001, DataType::i32);
  check_alltoall<float>(comm, 777, DataType::f32);
  check_alltoall<int64_t>(comm, 1, DataType::i64);
  check_alltoall<double>(comm, 0, DataType::f64);  // no elements: completes on the rank
}

TEST(Nicd, OneHostEveryCollective) {
  nicd::Server daemon({socket_path("one"), {}, 20});
  daemon.start();
  const int n = 3;
  std::vector<std::vector<float>> sums(n);
  run_threads(n, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, n, std::move(store), nicd_options(daemon.path()));
    std::vector<int32_t> x(1003);
    std::iota(x.begin(), x.end(), r * 1000);
    std::vector<int32_t> y(x.size());
    comm.allreduce(x.data(), y.data(), x.size(), DataType::i32, ReduceOp::sum)->wait();
    for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], 3 * static_cast<int32_t>(i) + 3000) << i;
    std::vector<int64_t> b(17, r == 2 ? 42 : -1);
    comm.broadcast(b.data(), b.size(), DataType::i64, 2)->wait();
    for (int64_t v : b) ASSERT_EQ(v, 42);
    std::vector<int32_t> g(3 * 5);
    std::vector<int32_t> mine(5, r + 7);
    comm.allgather(mine.data(), g.data(), 5, DataType::i32)->wait();
    for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], static_cast<int32_t>(i / 5) + 7) << i;
    std::vector<int32_t> rs(4);
    std::vector<int32_t> full(12, r + 1);
    comm.reduce_scatter(full.data(), rs.data(), 4, DataType::i32, ReduceOp::sum)->wait();
    for (int32_t v : rs) ASSERT_EQ(v, 6);
    comm.barrier()->wait();
    std::vector<float> f(5000);
    for (size_t i = 0; i < f.size(); ++i) f[i] = 0.1f * static_cast<float>(i % 97) + 0.01f * static_cast<float>(r);
    sums[r].resize(f.size());
    comm.allreduce(f.data(), sums[r].data(), f.size(), DataType::f32, ReduceOp::sum)->wait();
    check_alltoalls(comm);
  });
  for (int r = 1; r < n; ++r) EXPECT_EQ(std::memcmp(sums[r].data(), sums[0].data(), sums[0].size() * 4), 0);
  EXPECT_EQ(daemon.stats().jobs_formed, 1u);
  EXPECT_EQ(daemon.stats().jobs_failed, 0u);
  daemon.stop();
}

// With spin=on a caller that waits reads the daemon's answers itself: small calls back to back, and calls posted
// together and waited for by two threads at once (one drives, the other sleeps on its request or finds it done),
// give the right sums, and some answers were taken by a waiting caller rather than the reader thread.
TEST(Nicd, WaitingCallersReadTheAnswersWhilePolling) {
  nicd::Server daemon({socket_path("drive"), {}, 20});
  daemon.start();
  const int n = 2;
  std::vector<uint64_t> driven(n);
  run_threads(n, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, n, std::move(store),
                      test_options({{"engine", "nicd"}, {"nicd_socket", daemon.path()}, {"spin", "on"},
                                    {"spin_us", "1000000"}}));
    for (int32_t i = 0; i < 200; ++i) {
      int32_t x = i + r, y = 0;
      comm.allreduce(&x, &y, 1, DataType::i32, ReduceOp::sum)->wait();
      ASSERT_EQ(y, 2 * i + 1) << "call " << i;
    }
    for (int32_t round = 0; round < 20; ++round) {
      std::vector<int32_t> x(8), y(8, -1);
      std::vector<std::shared_ptr<Request>> reqs;
      for (int32_t k = 0; k < 8; ++k) {
        x[k] = 100 * round + k + r;
        reqs.push_back(comm.allreduce(&x[k], &y[k], 1, DataType::i32, ReduceOp::sum));
      }
      std::thread other([&] { reqs[7]->wait(); });
      for (int k = 6; k >= 0; --k) reqs[k]->wait();
      other.join();
      for (int32_t k = 0; k < 8; ++k) ASSERT_EQ(y[k], 2 * (100 * round + k) + 1) << "round " << round << ", call " << k;
    }
    driven[r] = comm.engine_stats().driven_answers;
  });
  for (int r = 0; r < n; ++r) EXPECT_GT(driven[r], 0u) << "rank " << r << ": no answer read by a waiting caller";
  EXPECT_EQ(daemon.stats().jobs_failed, 0u);
  daemon.stop();
}

// close() waits for the calls still running even while another thread, waiting on one of them, holds the client
// as it polls: rank 0 closes while its call waits for rank 1, which posts 300 ms later.
TEST(Nicd, CloseWaitsForACallAnotherThreadPollsOn) {
  nicd::Server daemon({socket_path("close"), {}, 20});
  daemon.start();
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, std::move(store),
                      test_options({{"engine", "nicd"}, {"nicd_socket", daemon.path()}, {"spin", "on"},
                                    {"spin_us", "1000000"}}));
    int32_t x = r + 1, y = 0;
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto req = comm.allreduce(&x, &y, 1, DataType::i32, ReduceOp::sum);
    if (r == 0) {
      std::thread waiter([req] { req->wait(); });
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the waiter polls, holding the client
      comm.close();
      EXPECT_TRUE(req->test()) << "close returned while the daemon could still write the call's result";
      waiter.join();
    } else {
      req->wait();
    }
    EXPECT_EQ(y, 3) << "rank " << r;
  });
  daemon.stop();
}

// What a daemon may hold for a reduction or a broadcast of any size: its window of chunks in flight (4 x 4 MiB)
// and the piece of one rank's input it combines (1 MiB).
constexpr uint64_t kWindowBytes = (16 << 20) + (1 << 20);

// An allgather of `count` elements per rank whose values name their rank and place; in place: the input is the
// rank's own block of the output.
void check_allgather(Communicator& comm, size_t count, bool in_place = false) {
  const int n = comm.size(), r = comm.rank();
  std::vector<int32_t> mine(count), all(static_cast<size_t>(n) * count, -1);
  int32_t* in = in_place ? all.data() + static_cast<size_t>(r) * count : mine.data();
  for (size_t i = 0; i < count; ++i) in[i] = r * 1000000 + static_cast<int32_t>(i % 999983);
  comm.allgather(in, all.data(), count, DataType::i32)->wait();
  for (size_t i = 0; i < all.size(); ++i)
    ASSERT_EQ(all[i], static_cast<int32_t>(i / count) * 1000000 + static_cast<int32_t>(i % count % 999983)) << i;
}

TEST(Nicd, LargeCallsHoldAWindowOfChunksNotTheVector) {
  nicd::Server daemon({socket_path("large"), {}, 60});
  daemon.start();
  const int n = 3;
  run_threads(n, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, n, std::move(store), nicd_options(daemon.path()));
    std::vector<int32_t> x(6000001), y(x.size());  // 24 MB: more than the window
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<int32_t>(i % 1000) + r;
    comm.allreduce(x.data(), y.data(), x.size(), DataType::i32, ReduceOp::sum)->wait();
    for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], 3 * static_cast<int32_t>(i % 1000) + 3) << i;
    comm.allreduce(x.data(), x.data(), x.size(), DataType::i32, ReduceOp::sum)->wait();  // in place
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], 3 * static_cast<int32_t>(i % 1000) + 3) << i;
    const size_t count = 2500003;
    std::vector<int32_t> full(n * count), mine(count, -1);
    for (size_t j = 0; j < full.size(); ++j) full[j] = static_cast<int32_t>(j % 777) + r;
    comm.reduce_scatter(full.data(), mine.data(), count, DataType::i32, ReduceOp::sum)->wait();
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(mine[i], 3 * static_cast<int32_t>((r * count + i) % 777) + 3) << i;
    std::vector<int32_t> at_root(x.size(), -1);
    comm.reduce(y.data(), at_root.data(), y.size(), DataType::i32, ReduceOp::sum, 1)->wait();
    for (size_t i = 0; r == 1 && i < at_root.size(); ++i) ASSERT_EQ(at_root[i], 3 * y[i]) << i;
    std::vector<int64_t> b(5000000, -1);
    if (r == 2)
      for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<int64_t>(i) * 7;
    comm.broadcast(b.data(), b.size(), DataType::i64, 2)->wait();
    for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b[i], static_cast<int64_t>(i) * 7) << i;
    check_alltoall<int32_t>(comm, 786433, DataType::i32);  // 3 MB blocks: parts of 4 MiB / 3 ranks
    check_allgather(comm, 625001);                         // 2.5 MB blocks: 4 parts
  });
  const nicd::ServerStats st = daemon.stats();
  EXPECT_EQ(st.calls, 7u);
  // The alltoall spreads one rank's part of every block (about one chunk) besides the window kept from before.
  EXPECT_LE(st.buffer_peak, kWindowBytes + (4 << 20));
  EXPECT_GE(st.buffer_peak, uint64_t{16} << 20);  // the window was used whole
  daemon.stop();
}

// Two daemons, as on hosts a and b, and a file store both reach; body(comm) runs on n ranks, on host a where
// on_a(r). Every job forms on both daemons and none fails (fails: the job fails on both). Returns the daemons'
// counters.
template <class OnA, class Body>
std::pair<nicd::ServerStats, nicd::ServerStats> on_two_hosts(const std::string& tag, int n, OnA on_a, Body body,
                                                             bool fails = false) {
  nicd::Server a({socket_path(tag + "a"), {}, 20}), b({socket_path(tag + "b"), {}, 20});
  a.start();
  b.start();
  const auto dir = std::filesystem::temp_directory_path() /
                   ("smartcoll-nicd-gtest-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto store = std::make_shared<FileStore>(dir.string());
  run_threads(n, [&](int r, std::shared_ptr<Store>) {
    Communicator comm(r, n, store, nicd_options(on_a(r) ? a.path() : b.path(), on_a(r) ? "a" : "b"));
    body(r, comm);
  });
  EXPECT_EQ(a.stats().jobs_formed, 1u);
  EXPECT_EQ(b.stats().jobs_formed, 1u);
  EXPECT_EQ(a.stats().jobs_failed + b.stats().jobs_failed, fails ? 2u : 0u);
  const auto stats = std::pair{a.stats(), b.stats()};
  a.stop();
  b.stop();
  std::filesystem::remove_all(dir);
  return stats;
}

TEST(Nicd, TwoHostsMeetThroughTheJobsStore) {
  const auto [a, b] = on_two_hosts("store", 4, [](int r) { return r < 2; }, [](int r, Communicator& comm) {
    ASSERT_EQ(comm.hosts(), (std::vector<int>{0, 0, 1, 1}));
    std::vector<int64_t> x(600011, r + 1), y(x.size());  // two chunks between the hosts
    comm.allreduce(x.data(), y.data(), x.size(), DataType::i64, ReduceOp::prod)->wait();
    for (int64_t v : y) ASSERT_EQ(v, 24);
    std::vector<int32_t> g(4 * 3), mine(3, 10 * r);
    comm.allgather(mine.data(), g.data(), 3, DataType::i32)->wait();
    for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], 10 * static_cast<int32_t>(i / 3)) << i;
    std::vector<int32_t> bc(9, r == 3 ? 5 : 0);
    comm.broadcast(bc.data(), bc.size(), DataType::i32, 3)->wait();
    for (int32_t v : bc) ASSERT_EQ(v, 5);
    // Larger than the daemons' window: chunks between the hosts, several in flight, slots reused.
    std::vector<int32_t> big(6000001), sum(big.size());
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<int32_t>(i % 1000) * (r + 1);
    comm.allreduce(big.data(), sum.data(), big.size(), DataType::i32, ReduceOp::sum)->wait();
    for (size_t i = 0; i < sum.size(); ++i) ASSERT_EQ(sum[i], 10 * static_cast<int32_t>(i % 1000)) << i;
    std::vector<int64_t> wide(3000000, r == 3 ? 0 : -1);
    if (r == 3)
      for (size_t i = 0; i < wide.size(); ++i) wide[i] = static_cast<int64_t>(i) * 3;
    comm.broadcast(wide.data(), wide.size(), DataType::i64, 3)->wait();
    for (size_t i = 0; i < wide.size(); ++i) ASSERT_EQ(wide[i], static_cast<int64_t>(i) * 3) << i;
    check_alltoalls(comm);
    check_alltoall<float>(comm, 400001, DataType::f32);  // 1.6 MB blocks: 7 parts of 256 KiB between the hosts
    check_allgather(comm, 400001);                       // 1.6 MB blocks: 3 parts
  });
  // The window, which the daemon keeps for the next call, and an alltoall's spread part (under 1 MiB here).
  EXPECT_LE(std::max(a.buffer_peak, b.buffer_peak), kWindowBytes + (1 << 20));
}

// List calls of mixed sizes (empty entries, one entry over a chunk, pieces cut inside chunks and parts) against
// values computed here: each entry gets what the same call on that buffer alone would give, bit for bit.
int32_t list_value(int rank, size_t entry, size_t k) {
  return static_cast<int32_t>((entry * 1000 + k * 13 + static_cast<size_t>(rank) * 7) % 100003);
}

void check_lists(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const std::vector<size_t> counts{3, 0, 1500001, 17, 0, 1, 250000};  // 1.5 M int32: over a 4 MiB chunk
  const size_t lists = counts.size();
  auto sum_of = [&](size_t e, size_t k) {
    int32_t s = 0;
    for (int q = 0; q < n; ++q) s += list_value(q, e, k);
    return s;
  };
  std::vector<std::vector<int32_t>> bufs(lists), outs(lists);
  std::vector<void*> b(lists), o(lists);
  std::vector<const void*> in(lists);
  // allreduce, in place
  for (size_t e = 0; e < lists; ++e) {
    bufs[e].resize(counts[e]);
    for (size_t k = 0; k < counts[e]; ++k) bufs[e][k] = list_value(r, e, k);
    b[e] = bufs[e].data();
  }
  comm.allreduce(b, counts, DataType::i32, ReduceOp::sum)->wait();
  for (size_t e = 0; e < lists; ++e)
    for (size_t k = 0; k < counts[e]; ++k) ASSERT_EQ(bufs[e][k], sum_of(e, k)) << "allreduce entry " << e << ", " << k;
  // reduce_scatter: entry e's input is n blocks of counts[e]; this rank gets block r of each, reduced
  for (size_t e = 0; e < lists; ++e) {
    bufs[e].resize(static_cast<size_t>(n) * counts[e]);
    for (size_t k = 0; k < bufs[e].size(); ++k) bufs[e][k] = list_value(r, e, k);
    outs[e].assign(counts[e], -1);
    in[e] = bufs[e].data();
    o[e] = outs[e].data();
  }
  comm.reduce_scatter(in, o, counts, DataType::i32, ReduceOp::sum)->wait();
  for (size_t e = 0; e < lists; ++e)
    for (size_t k = 0; k < counts[e]; ++k)
      ASSERT_EQ(outs[e][k], sum_of(e, static_cast<size_t>(r) * counts[e] + k)) << "reduce_scatter " << e << ", " << k;
  // allgather: entry e's output holds every rank's entry e, rank q's at q * counts[e]
  for (size_t e = 0; e < lists; ++e) {
    bufs[e].resize(counts[e]);
    for (size_t k = 0; k < counts[e]; ++k) bufs[e][k] = list_value(r, e, k);
    outs[e].assign(static_cast<size_t>(n) * counts[e], -1);
    in[e] = bufs[e].data();
    o[e] = outs[e].data();
  }
  comm.allgather(in, o, counts, DataType::i32)->wait();
  for (size_t e = 0; e < lists; ++e)
    for (size_t k = 0; k < outs[e].size(); ++k)
      ASSERT_EQ(outs[e][k], list_value(static_cast<int>(k / counts[e]), e, k % counts[e])) << "allgather " << e;
  // broadcast from the last rank
  for (size_t e = 0; e < lists; ++e) {
    bufs[e].assign(counts[e], -1);
    if (r == n - 1)
      for (size_t k = 0; k < counts[e]; ++k) bufs[e][k] = list_value(r, e, k);
    b[e] = bufs[e].data();
  }
  comm.broadcast(b, counts, DataType::i32, n - 1)->wait();
  for (size_t e = 0; e < lists; ++e)
    for (size_t k = 0; k < counts[e]; ++k) ASSERT_EQ(bufs[e][k], list_value(n - 1, e, k)) << "broadcast " << e;
}

TEST(Nicd, ListCallsOnOneHostReadAndWriteTheBuffersInPlace) {
  nicd::Server daemon({socket_path("lists"), {}, 60});
  daemon.start();
  run_threads(3, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 3, std::move(store), nicd_options(daemon.path()));
    check_lists(comm);
  });
  EXPECT_EQ(daemon.stats().calls, 4u);
  EXPECT_EQ(daemon.stats().jobs_failed, 0u);
  daemon.stop();
}

TEST(Nicd, ListCallsAcrossUnevenHosts) {
  on_two_hosts("lists2", 4, [](int r) { return r != 2; }, [](int, Communicator& comm) { check_lists(comm); });
}

// Lists of the same total but other counts on two ranks of a host: the call fails on both, naming both layouts.
TEST(Nicd, ListsOfOtherCountsFailTheCallNamingThem) {
  nicd::Server daemon({socket_path("layout"), {}, 20});
  daemon.start();
  std::vector<std::string> errors(2);
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, std::move(store), nicd_options(daemon.path()));
    std::vector<int32_t> a(8, 1);
    std::vector<void*> bufs{a.data(), a.data() + (r == 0 ? 3 : 5)};
    const std::vector<size_t> counts = r == 0 ? std::vector<size_t>{3, 5} : std::vector<size_t>{5, 3};
    try {
      comm.allreduce(bufs, counts, DataType::i32, ReduceOp::sum)->wait();
    } catch (const CommError& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("ranks disagree"), std::string::npos) << e;
    EXPECT_NE(e.find("a list of layout"), std::string::npos) << e;
  }
  daemon.stop();
}

// alltoallv with uneven blocks (some empty, the largest over several parts), from one buffer with gaps between
// the blocks and from lists: every block lands at its place, bit for bit; the bytes between blocks stay.
size_t v_count(int from, int to, size_t scale) { return static_cast<size_t>((from * 7 + to * 3) % 5) * scale; }

void check_alltoallv(Communicator& comm, size_t scale) {
  const int n = comm.size(), r = comm.rank();
  std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
  size_t sent = 0, got = 0;
  for (int d = 0; d < n; ++d) {  // blocks in reverse order of rank, a gap of 3 elements after each
    sc[d] = v_count(r, d, scale), rc[d] = v_count(d, r, scale);
  }
  for (int d = n - 1; d >= 0; --d) {
    sd[d] = sent, rd[d] = got;
    sent += sc[d] + 3, got += rc[d] + 3;
  }
  std::vector<int32_t> in(sent, -7), out(got, -9);
  for (int d = 0; d < n; ++d)
    for (size_t i = 0; i < sc[d]; ++i) in[sd[d] + i] = a2a_value<int32_t>(r, d, i);
  comm.alltoallv(in.data(), sc, sd, out.data(), rc, rd, DataType::i32)->wait();
  std::vector<int32_t> want(got, -9);
  for (int s = 0; s < n; ++s)
    for (size_t i = 0; i < rc[s]; ++i) want[rd[s] + i] = a2a_value<int32_t>(s, r, i);
  ASSERT_EQ(out, want) << "rank " << r << ", one buffer";
  std::vector<std::vector<int32_t>> ins(n), outs(n);
  std::vector<const void*> ip(n);
  std::vector<void*> op(n);
  for (int d = 0; d < n; ++d) {
    ins[d].resize(sc[d]);
    for (size_t i = 0; i < sc[d]; ++i) ins[d][i] = a2a_value<int32_t>(r, d, i) ^ 1;
    outs[d].assign(rc[d], -1);
    ip[d] = ins[d].data(), op[d] = outs[d].data();
  }
  comm.alltoallv(ip, sc, op, rc, DataType::i32)->wait();
  for (int s = 0; s < n; ++s)
    for (size_t i = 0; i < rc[s]; ++i) ASSERT_EQ(outs[s][i], a2a_value<int32_t>(s, r, i) ^ 1) << "list, from " << s;
  // Rank 0 sends and receives nothing (its views hold no bytes); the others exchange one element each.
  for (int d = 0; d < n; ++d) {
    sc[d] = rc[d] = (r == 0 || d == 0) ? 0 : 1;
    ins[d].assign(sc[d], r * 10 + d);
    outs[d].assign(rc[d], -1);
    ip[d] = ins[d].data(), op[d] = outs[d].data();
  }
  comm.alltoallv(ip, sc, op, rc, DataType::i32)->wait();
  for (int s = 1; s < n && r > 0; ++s) ASSERT_EQ(outs[s], std::vector<int32_t>{s * 10 + r}) << "from " << s;
}

// A rank that expects another size than its peer sends fails the call on every rank, naming the pair.
void check_alltoallv_mismatch(Communicator& comm, std::vector<std::string>& errors) {
  const int n = comm.size(), r = comm.rank();
  std::vector<size_t> sc(n, 2), rc(n, 2), disp(n);
  for (int d = 0; d < n; ++d) disp[d] = 2 * static_cast<size_t>(d);
  if (r == n - 1) rc[0] = 1;  // rank 0 sends it 2
  std::vector<int32_t> in(2 * n, 1), out(2 * n);
  try {
    comm.alltoallv(in.data(), sc, disp, out.data(), rc, disp, DataType::i32)->wait();
  } catch (const CommError& e) {
    errors[static_cast<size_t>(r)] = e.what();
  }
}

TEST(Nicd, AlltoallvOnOneHostAndAcrossUnevenHosts) {
  nicd::Server daemon({socket_path("a2av"), {}, 60});
  daemon.start();
  run_threads(3, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 3, std::move(store), nicd_options(daemon.path()));
    check_alltoallv(comm, 1);
    check_alltoallv(comm, 150001);  // blocks of up to 2.4 MB: parts of 1.3 MB
  });
  daemon.stop();
  on_two_hosts("a2av2", 4, [](int r) { return r != 2; }, [](int, Communicator& comm) {
    check_alltoallv(comm, 1);
    check_alltoallv(comm, 70001);  // up to 1.1 MB per block: parts of 116 KiB between the hosts
  });
  // Two ranks on each side of every segment between the hosts: the order of the parts in it shows.
  on_two_hosts("a2av22", 4, [](int r) { return r < 2; }, [](int, Communicator& comm) {
    check_alltoallv(comm, 1);
    check_alltoallv(comm, 50001);
  });
}

// A table of blocks no memory could hold (here both ranks agree on it) fails the job naming the rank; the daemon
// serves the next job.
TEST(Nicd, AlltoallvBlocksBeyondAnyMemoryAreRefused) {
  nicd::Server daemon({socket_path("a2avhuge"), {}, 20});
  daemon.start();
  std::vector<std::string> errors(2);
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, std::move(store), nicd_options(daemon.path()));
    const size_t huge = size_t{1} << 47;  // int32 elements: 2^49 bytes
    std::vector<size_t> sc{0, r == 0 ? huge : 0}, rc{0, 0}, disp{0, 0};
    if (r == 1) rc[0] = huge;
    std::vector<int32_t> in(4), out(4);
    try {
      comm.alltoallv(in.data(), sc, disp, out.data(), rc, disp, DataType::i32)->wait();
    } catch (const CommError& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("table of blocks for alltoallv"), std::string::npos) << e;
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, std::move(store), nicd_options(daemon.path()));
    int32_t x = r + 1, y = 0;
    comm.allreduce(&x, &y, 1, DataType::i32, ReduceOp::sum)->wait();
    EXPECT_EQ(y, 3);
  });
  EXPECT_EQ(daemon.stats().jobs_failed, 1u);
  daemon.stop();
}

TEST(Nicd, AlltoallvCountsThatDisagreeFailTheCallNamingThePair) {
  for (bool two_hosts : {false, true}) {
    std::vector<std::string> errors(4);
    if (two_hosts) {  // rank 3 (expecting 1 from rank 0) on the other host
      on_two_hosts("a2avx2", 4, [](int r) { return r < 2; },
                   [&](int, Communicator& comm) { check_alltoallv_mismatch(comm, errors); }, /*fails=*/true);
    } else {
      nicd::Server daemon({socket_path("a2avx"), {}, 20});
      daemon.start();
      errors.resize(3);
      run_threads(3, [&](int r, std::shared_ptr<Store> store) {
        Communicator comm(r, 3, std::move(store), nicd_options(daemon.path()));
        check_alltoallv_mismatch(comm, errors);
      });
      daemon.stop();
    }
    const std::string last = std::to_string(errors.size() - 1);
    for (const std::string& e : errors)
      EXPECT_NE(e.find("alltoallv: rank 0 sends rank " + last + " 2 elements but rank " + last + " expects 1"),
                std::string::npos)
          << (two_hosts ? "two hosts: " : "one host: ") << e;
  }
}

// 3 ranks on host 0 and 1 on host 1: alltoall runs as alltoallv of equal blocks (no padding); allgather pads each
// host's parts to 3.
TEST(Nicd, AlltoallAcrossUnevenHosts) {
  on_two_hosts("uneven", 4, [](int r) { return r != 2; }, [](int, Communicator& comm) {
    ASSERT_EQ(comm.hosts(), (std::vector<int>{0, 0, 1, 0}));
    check_alltoalls(comm);
    check_alltoall<int32_t>(comm, 300001, DataType::i32);  // 1.2 MB blocks in parts, as alltoallv: no padding
    check_allgather(comm, 300001);                         // in parts, padded to 3 per host
  });
}

TEST(Nicd, AcrossHostsAPrivateStoreIsRefusedByName) {
  nicd::Server a({socket_path("pa"), {}, 20}), b({socket_path("pb"), {}, 20});
  a.start();
  b.start();
  std::vector<std::string> errors(2);
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    try {
      Communicator comm(r, 2, std::move(store), nicd_options(r ? b.path() : a.path(), r ? "b" : "a"));
    } catch (const CommError& e) {
      errors[r] = e.what();
    }
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("needs a rendezvous store the daemons can reach"), std::string::npos) << e;
  a.stop();
  b.stop();
}

TEST(Nicd, ARankThatDoesNotPostFailsTheCallWithinTheTimeoutNamingIt) {
  nicd::Server daemon({socket_path("late"), {}, 20});
  daemon.start();
  std::vector<std::string> errors(2);
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, std::move(store),
                      test_options({{"engine", "nicd"}, {"nicd_socket", daemon.path()}, {"timeout", "1"}}));
    comm.barrier()->wait();
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // stalls past the timeout
    try {
      comm.barrier()->wait();
    } catch (const CommError& e) {
      errors[r] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("rank 1 did not post barrier #1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("within 1 s of rank 0"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[1], errors[0]);  // the late rank learns the same reason when it posts
  EXPECT_EQ(daemon.stats().jobs_failed, 1u);
  daemon.stop();
}

TEST(Nicd, AbortFailsThePeersPendingCallWithTheReason) {
  nicd::Server daemon({socket_path("abort"), {}, 20});
  daemon.start();
  std::vector<std::string> errors(2);
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, std::move(store), nicd_options(daemon.path()));
    comm.barrier()->wait();
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 0's barrier is pending by now
      comm.abort("stop here");
    }
    try {
      comm.barrier()->wait();
    } catch (const CommError& e) {
      errors[r] = e.what();
    }
  });
  for (const std::string& e : errors) EXPECT_EQ(e, "rank 1 aborted: stop here");
  daemon.stop();
}

TEST(Nicd, NoDaemonFailsNamingTheSocket) {
  std::vector<std::string> errors(2);
  const std::string path = socket_path("none");
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    try {
      Communicator comm(r, 2, std::move(store),
                        test_options({{"engine", "nicd"}, {"nicd_socket", path}, {"connect_timeout", "0.5"}}));
    } catch (const CommError& e) {
      errors[r] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("cannot connect to the nicd daemon at " + path), std::string::npos) << e;
    EXPECT_NE(e.find("smartcoll nicd --socket"), std::string::npos) << e;
  }
}

// A raw connection to the daemon, as a rank's would be before its hello (-1 if it cannot connect).
int connect_to(const nicd::Server& daemon) {
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, daemon.path().data(), daemon.path().size());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) return fd;
  ::close(fd);
  return -1;
}

TEST(Nicd, AMalformedMessageIsRefusedAndTheDaemonServesOn) {
  nicd::Server daemon({socket_path("bad"), {}, 20});
  daemon.start();
  const int fd = connect_to(daemon);
  ASSERT_GE(fd, 0);
  const std::string garbage = "GET / HTTP/1.0";
  ASSERT_GT(::send(fd, garbage.data(), garbage.size(), 0), 0);
  std::string reply(nicd::kMaxMessage, '\0');
  const ssize_t k = ::recv(fd, reply.data(), reply.size(), 0);
  ASSERT_GT(k, 0);
  const nicd::Ready ready = nicd::decode_ready(std::string_view(reply.data(), static_cast<size_t>(k)));
  EXPECT_NE(ready.error.find("sent the nicd daemon a bad message: not a nicd message"), std::string::npos)
      << ready.error;
  ::close(fd);
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, std::move(store), nicd_options(daemon.path()));
    comm.barrier()->wait();
  });
  EXPECT_EQ(daemon.stats().refused, 1u);
  EXPECT_EQ(daemon.stats().jobs_formed, 1u);
  daemon.stop();
}

// A connection that never says hello is not a rank: the daemon drops it after its timeout (here 1 s) and says why.
TEST(Nicd, ASilentConnectionIsDroppedAfterTheTimeout) {
  nicd::Server daemon({socket_path("silent"), {}, 1});
  daemon.start();
  const int fd = connect_to(daemon);
  ASSERT_GE(fd, 0);
  const auto start = std::chrono::steady_clock::now();
  std::string reply(nicd::kMaxMessage, '\0');
  const ssize_t k = ::recv(fd, reply.data(), reply.size(), 0);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_GT(k, 0);
  const nicd::Ready ready = nicd::decode_ready(std::string_view(reply.data(), static_cast<size_t>(k)));
  EXPECT_NE(ready.error.find("no hello within 1 s of connecting"), std::string::npos) << ready.error;
  EXPECT_GE(waited, 0.9);
  EXPECT_LT(waited, 5.0);
  EXPECT_EQ(daemon.stats().refused, 1u);
  ::close(fd);
  daemon.stop();
}

// A post is checked against the job it belongs to: a broadcast whose root is not a rank fails that call, named,
// and the daemon serves on (an unchecked root would index past the job's host layout).
TEST(Nicd, ARootOutsideTheJobFailsTheCallNotTheDaemon) {
  nicd::Server daemon({socket_path("root"), {}, 20});
  daemon.start();
  const int fd = connect_to(daemon);
  ASSERT_GE(fd, 0);
  std::string reply(nicd::kMaxMessage, '\0');
  const auto next = [&](nicd::Type want) {
    for (;;) {
      const ssize_t k = ::recv(fd, reply.data(), reply.size(), 0);
      if (k <= 0) return std::string_view();
      const std::string_view msg(reply.data(), static_cast<size_t>(k));
      if (nicd::type_of(msg) == want) return msg;
    }
  };
  nicd::Hello hello;
  hello.size = 1;
  hello.timeout = hello.connect_timeout = 10;
  hello.job_id = "root-check";
  hello.hosts = {0};
  const std::string h = nicd::encode(hello);
  ASSERT_GT(::send(fd, h.data(), h.size(), 0), 0);
  ASSERT_EQ(nicd::decode_ready(next(nicd::Type::ready)).error, "");
  int value = 7;
  nicd::Post post;
  post.coll = static_cast<uint8_t>(Collective::broadcast);
  post.dtype = static_cast<uint8_t>(DataType::i32);
  post.root = 1 << 30;
  post.count = 1;
  post.in = post.out = reinterpret_cast<uintptr_t>(&value);
  post.codec = "identity";
  const std::string p = nicd::encode(post);
  ASSERT_GT(::send(fd, p.data(), p.size(), 0), 0);
  const nicd::Done done = nicd::decode_done(next(nicd::Type::done));
  EXPECT_NE(done.error.find("root 1073741824 is not a rank of this job of 1"), std::string::npos) << done.error;
  ::close(fd);
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, std::move(store), nicd_options(daemon.path()));
    comm.barrier()->wait();
  });
  EXPECT_EQ(daemon.stats().jobs_formed, 2u);
  daemon.stop();
}

// A client that posts hundreds of calls (its job's other rank never comes), aborts, and never reads: failing its
// job answers every queued call. Those answers used to be sent blocking, 2 s each once the socket was full, on the
// control thread that every job needs, so another job's calls stalled for minutes. Now a rank whose socket is full
// is cut off, and the other job's 20 barriers go through within its 5 s timeout.
TEST(Nicd, AClientThatStopsReadingHoldsUpNoOtherJob) {
  nicd::Server daemon({socket_path("noreader"), {}, 20});
  daemon.start();
  const int fd = connect_to(daemon);
  ASSERT_GE(fd, 0);
  nicd::Hello hello;
  hello.size = 2;
  hello.timeout = hello.connect_timeout = 1000;
  hello.job_id = "never-reads";
  hello.hosts = {0, 0};
  const std::string h = nicd::encode(hello);
  ASSERT_GT(::send(fd, h.data(), h.size(), 0), 0);
  int value = 7;
  for (uint64_t seq = 0; seq < 600; ++seq) {
    nicd::Post post;
    post.seq = seq;
    post.coll = static_cast<uint8_t>(Collective::allreduce);
    post.dtype = static_cast<uint8_t>(DataType::i32);
    post.count = 1;
    post.in = post.out = reinterpret_cast<uintptr_t>(&value);
    post.codec = "identity";
    const std::string p = nicd::encode(post);
    ASSERT_GT(::send(fd, p.data(), p.size(), 0), 0);
  }
  const std::string abort = nicd::encode(nicd::Abort{"a client that never reads"});
  ASSERT_GT(::send(fd, abort.data(), abort.size(), 0), 0);
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, std::move(store), nicd_options(daemon.path(), "", "5"));
    for (int i = 0; i < 20; ++i) comm.barrier()->wait();
  });
  ::close(fd);
  daemon.stop();
}

// 3 ranks on host 0 and 1 on host 1, every call in several chunks or parts: in place, avg, roots on either host.
TEST(Nicd, UnevenHostsInPlaceAvgAndRootsInChunks) {
  on_two_hosts("chunks", 4, [](int r) { return r != 2; }, [](int r, Communicator& comm) {
    const int n = 4;
    // in place, 6 chunks and a tail
    {
      std::vector<int32_t> x(6000001);
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<int32_t>(i % 1000) + r;
      comm.allreduce(x.data(), x.data(), x.size(), DataType::i32, ReduceOp::sum)->wait();
      for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], 4 * static_cast<int32_t>(i % 1000) + 6) << i;
    }
    // in-place reduce_scatter (in == out)
    {
      const size_t count = 2500003;
      std::vector<int32_t> full(n * count);
      for (size_t j = 0; j < full.size(); ++j) full[j] = static_cast<int32_t>(j % 777) * (r + 1);
      comm.reduce_scatter(full.data(), full.data(), count, DataType::i32, ReduceOp::sum)->wait();
      for (size_t i = 0; i < count; ++i)
        ASSERT_EQ(full[i], 10 * static_cast<int32_t>((r * count + i) % 777)) << "rs " << i;
    }
    // avg divides once, whatever the chunks
    {
      std::vector<double> f(1500007), g(f.size());
      for (size_t i = 0; i < f.size(); ++i) f[i] = 4.0 * (i % 100) + r;
      comm.allreduce(f.data(), g.data(), f.size(), DataType::f64, ReduceOp::avg)->wait();
      for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], 4.0 * (i % 100) + 1.5) << "avg " << i;
    }
    // to a root on the other host, and to one on this host, in place at the root
    for (int root : {2, 0}) {
      std::vector<int32_t> x(5000003);
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<int32_t>(i % 1001) + r;
      comm.reduce(x.data(), r == root ? x.data() : nullptr, x.size(), DataType::i32, ReduceOp::sum, root)->wait();
      if (r == root) {
        for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], 4 * static_cast<int32_t>(i % 1001) + 6) << "reduce " << i;
      }
    }
    // from a root that shares its host, 5 chunks and a tail
    {
      std::vector<int64_t> b(2700001, -1);
      if (r == 1)
        for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<int64_t>(i) * 5 + 1;
      comm.broadcast(b.data(), b.size(), DataType::i64, 1)->wait();
      for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b[i], static_cast<int64_t>(i) * 5 + 1) << "bc " << i;
    }
    check_allgather(comm, 600001, /*in_place=*/true);  // more parts than the window has slots
    check_alltoall<int32_t>(comm, 700001, DataType::i32);
  });
}

// In place on one host: the reduce_scatter's output is its own block of the input; the allgather's input is its
// own block of the output.
TEST(Nicd, InPlaceCallsOnOneHostInChunks) {
  nicd::Server daemon({socket_path("inplace"), {}, 60});
  daemon.start();
  const int n = 3;
  run_threads(n, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, n, std::move(store), nicd_options(daemon.path()));
    const size_t count = 2500003;
    std::vector<int32_t> full(n * count);
    for (size_t j = 0; j < full.size(); ++j) full[j] = static_cast<int32_t>(j % 777) * (r + 1);
    comm.reduce_scatter(full.data(), full.data(), count, DataType::i32, ReduceOp::sum)->wait();
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(full[i], 6 * static_cast<int32_t>((r * count + i) % 777)) << i;
    std::vector<int32_t> x(6000001);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<int32_t>(i % 1000) + r;
    comm.allreduce(x.data(), x.data(), x.size(), DataType::i32, ReduceOp::sum)->wait();
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], 3 * static_cast<int32_t>(i % 1000) + 3) << i;
    check_allgather(comm, 1000001, /*in_place=*/true);
  });
  daemon.stop();
}

}  // namespace
}  // namespace smartcoll
