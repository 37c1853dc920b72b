// The engine: several workers give the same bits as one, several calls in flight, lazy connections.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <latch>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ranks.h"
#include "smartcoll/comm.h"

namespace smartcoll {
namespace {

Options options(std::map<std::string, std::string> extra) { return harness::test_options(std::move(extra)); }

void run_ranks(int n, const Options& o, const std::function<void(Communicator&)>& body) {
  harness::run_ranks(n, body, o);
}

// Every collective's output on every rank, concatenated, for one engine_threads value.
std::vector<std::vector<float>> run_all(int n, const std::string& threads) {
  const size_t count = 30011;
  std::vector<std::vector<float>> out(static_cast<size_t>(n));
  run_ranks(n, options({{"engine_threads", threads}, {"streams", "4"}, {"segment_size", "4096"}, {"cma", "off"}}),
            [&](Communicator& comm) {
              const int r = comm.rank();
              std::vector<float> x = harness::noise(r, count * static_cast<size_t>(n)), result;
              for (Algorithm a : {Algorithm::ring, Algorithm::rhd, Algorithm::rd}) {
                std::vector<float> y(count);
                comm.allreduce(x.data(), y.data(), count, DataType::f32, ReduceOp::sum, a)->wait();
                result.insert(result.end(), y.begin(), y.end());
              }
              std::vector<float> y(count), all(count * static_cast<size_t>(n)), b(x.begin(), x.begin() + count);
              comm.allreduce(x.data(), y.data(), count, DataType::f32, ReduceOp::avg, Algorithm::ring,
                             Codec::parse("bfp16"))->wait();
              result.insert(result.end(), y.begin(), y.end());
              comm.reduce_scatter(x.data(), y.data(), count, DataType::f32, ReduceOp::sum)->wait();
              result.insert(result.end(), y.begin(), y.end());
              for (Algorithm a : {Algorithm::ring, Algorithm::bruck}) {
                comm.allgather(x.data(), all.data(), count, DataType::f32, std::nullopt, a)->wait();
                result.insert(result.end(), all.begin(), all.end());
              }
              for (Algorithm a : {Algorithm::chain, Algorithm::tree}) {
                std::vector<float> c = b;
                comm.broadcast(c.data(), count, DataType::f32, n - 1, a)->wait();
                result.insert(result.end(), c.begin(), c.end());
                std::vector<float> s(count, 0.0f);
                comm.reduce(x.data(), s.data(), count, DataType::f32, ReduceOp::sum, 1, a)->wait();
                if (r == 1) result.insert(result.end(), s.begin(), s.end());
              }
              for (Algorithm a : {Algorithm::direct, Algorithm::bruck, Algorithm::pairwise}) {
                comm.alltoall(x.data(), all.data(), count, DataType::f32, a)->wait();
                result.insert(result.end(), all.begin(), all.end());
              }
              comm.barrier()->wait();
              out[static_cast<size_t>(r)] = std::move(result);
            });
  return out;
}

TEST(Engine, ResultsAreBitwiseIdenticalWhateverTheNumberOfWorkers) {
  const int n = 3;
  const auto one = run_all(n, "1");
  for (const std::string threads : {"2", "3", "4"}) {
    const auto many = run_all(n, threads);
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(one[r].size(), many[r].size());
      ASSERT_EQ(std::memcmp(one[r].data(), many[r].data(), one[r].size() * sizeof(float)), 0)
          << "engine_threads=" << threads << " rank " << r;
    }
  }
  // And the allreduce parts agree across ranks (the first three results).
  for (int r = 1; r < n; ++r) ASSERT_EQ(std::memcmp(one[0].data(), one[r].data(), 3 * 30011 * sizeof(float)), 0);
}

TEST(Engine, SeveralCallsInFlight) {
  const int n = 4;
  run_ranks(n, options({{"engine_threads", "2"}, {"streams", "2"}, {"segment_size", "8192"}}), [&](Communicator& c) {
    std::vector<std::vector<int32_t>> bufs;
    std::vector<std::shared_ptr<Request>> reqs;
    for (int k = 0; k < 12; ++k) bufs.emplace_back(static_cast<size_t>(1 + k * 3001), c.rank() + k);
    for (int k = 0; k < 12; ++k)  // all posted before any is waited on
      reqs.push_back(k % 3 == 2 ? c.broadcast(bufs[k].data(), bufs[k].size(), DataType::i32, k % n)
                                : c.allreduce(bufs[k].data(), bufs[k].data(), bufs[k].size(), DataType::i32,
                                              ReduceOp::sum));
    for (int k = 11; k >= 0; --k) reqs[k]->wait();  // in reverse: completion does not depend on waiting
    for (int k = 0; k < 12; ++k) {
      const int32_t expect = k % 3 == 2 ? k % n + k : n * (n - 1) / 2 + n * k;
      for (int32_t v : bufs[k]) ASSERT_EQ(v, expect) << "call " << k;
    }
  });
}

TEST(Engine, CallsPostedFromTwoThreadsInAFixedOrder) {
  run_ranks(3, options({{"posting", "ordered"}}), [&](Communicator& c) {
    std::vector<float> a(100000, 1.0f), b(7, 2.0f);
    std::latch posted(1);
    std::shared_ptr<Request> first;
    std::thread other([&] {
      first = c.allreduce(a.data(), a.data(), a.size(), DataType::f32, ReduceOp::sum);
      posted.count_down();
      first->wait();
    });
    posted.wait();
    c.allreduce(b.data(), b.data(), b.size(), DataType::f32, ReduceOp::sum)->wait();
    other.join();
    for (float v : a) ASSERT_EQ(v, 3.0f);
    for (float v : b) ASSERT_EQ(v, 6.0f);
  });
}

TEST(Engine, ConnectsOnlyToThePeersItsAlgorithmsUse) {
  const int n = 16;
  std::vector<int> after_ring(n), after_barrier(n);
  // Ranks are threads here: latches, not collectives, hold them together while they count.
  std::latch ring_done(n), counted(n), barrier_done(n), counted_again(n);
  run_ranks(n, options({{"cma", "off"}, {"engine_threads", "1"}}), [&](Communicator& c) {
    std::vector<float> x(1 << 16, 1.0f);
    c.allreduce(x.data(), x.data(), x.size(), DataType::f32, ReduceOp::sum, Algorithm::ring)->wait();
    ring_done.arrive_and_wait();
    after_ring[c.rank()] = c.engine_stats().open_channels;
    counted.arrive_and_wait();
    c.barrier()->wait();
    barrier_done.arrive_and_wait();
    after_barrier[c.rank()] = c.engine_stats().open_channels;
    counted_again.arrive_and_wait();
  });
  for (int r = 0; r < n; ++r) {
    // The ring talks to rank-1 and rank+1 only.
    EXPECT_EQ(after_ring[r], 2) << "rank " << r;
    // The dissemination barrier adds rank +- 2, 4, 8: at most 2 + 6 channels, never all 15 peers.
    EXPECT_LE(after_barrier[r], 8) << "rank " << r;
  }
}

TEST(Engine, ReachesPeersOnThisHostOverUnixSockets) {
  // Rank 0 listens on TCP alone (unix_sockets=off), as a peer in another network namespace would be unreachable
  // by name: ranks 1 and 2 fall back to TCP for it and use a Unix socket between themselves. The results are
  // the same bytes whatever carries them.
  const int n = 3;
  std::vector<int> open(n), local(n);
  std::vector<std::vector<int32_t>> out(n);
  harness::run_threads(n, [&](int r, std::shared_ptr<Store> store) {
    Communicator c(r, n, std::move(store),
                   options({{"cma", "off"}, {"unix_sockets", r == 0 ? "off" : "auto"}, {"streams", "2"}}));
    std::vector<int32_t> x(300001);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<int32_t>(i * 7 + r);
    c.allreduce(x.data(), x.data(), x.size(), DataType::i32, ReduceOp::sum, Algorithm::ring)->wait();
    out[static_cast<size_t>(r)] = std::move(x);
    open[static_cast<size_t>(r)] = c.engine_stats().open_channels;
    local[static_cast<size_t>(r)] = c.engine_stats().local_channels;
  });
  for (size_t i = 0; i < out[0].size(); ++i) ASSERT_EQ(out[0][i], static_cast<int32_t>(3 * (i * 7) + 3)) << i;
  EXPECT_EQ(out[1], out[0]);
  EXPECT_EQ(out[2], out[0]);
  // Two streams to each of the two ring neighbours.
  EXPECT_EQ(open, (std::vector<int>{4, 4, 4}));
  EXPECT_EQ(local, (std::vector<int>{0, 2, 2}));
}


namespace hier {

// Ranks as threads with a host each (the host knob), over one in-memory store.
void run_on_hosts(const std::vector<std::string>& host_of, const std::function<void(Communicator&)>& body,
                  std::map<std::string, std::string> extra = {}) {
  const int n = static_cast<int>(host_of.size());
  harness::run_threads(n, [&](int r, std::shared_ptr<Store> store) {
    auto opts = extra;
    opts["host"] = host_of[static_cast<size_t>(r)];
    Communicator comm(r, n, std::move(store), options(opts));
    body(comm);
  });
}

TEST(Hierarchy, LayoutFromTheHostKnob) {
  run_on_hosts({"a", "b", "a", "c", "b", "c"}, [](Communicator& c) {
    EXPECT_EQ(c.hosts(), (std::vector<int>{0, 1, 0, 2, 1, 2}));
    EXPECT_EQ(c.choose(Collective::allreduce, 1 << 20, DataType::f32), Algorithm::hier);
    EXPECT_EQ(c.choose(Collective::allreduce, 16, DataType::f32), Algorithm::rd);  // latency still wins small
  });
  run_on_hosts({"a", "a", "a", "b"}, [](Communicator& c) {  // uneven: no hierarchy
    EXPECT_EQ(c.choose(Collective::allreduce, 1 << 20, DataType::f32), Algorithm::ring);
    EXPECT_THROW(c.choose(Collective::allreduce, 1 << 20, DataType::f32, Algorithm::hier), InvalidArgument);
  });
}

TEST(Hierarchy, AllreduceExactOnInterleavedHosts) {
  // Ranks of a host need not be contiguous: 0,2,4 on one host, 1,3,5 on the other; and 3 hosts x 2 ranks.
  for (const auto& layout : {std::vector<std::string>{"a", "b", "a", "b", "a", "b"},
                             std::vector<std::string>{"x", "x", "y", "y", "z", "z"}}) {
    const int n = static_cast<int>(layout.size());
    run_on_hosts(layout, [n](Communicator& c) {
      // 2500001: in pieces (4 of int64, 2 of float), each through the three rings.
      for (size_t count : {size_t{5}, size_t{1000003}, size_t{2500001}}) {
        std::vector<int64_t> x(count);
        for (size_t e = 0; e < count; ++e) x[e] = static_cast<int64_t>(e * 7 + static_cast<size_t>(c.rank()) * 1000);
        c.allreduce(x.data(), x.data(), count, DataType::i64, ReduceOp::sum, Algorithm::hier)->wait();
        for (size_t e = 0; e < count; ++e)
          ASSERT_EQ(x[e], static_cast<int64_t>(e * 7 * n) + 1000 * (n * (n - 1) / 2)) << "element " << e;
        std::vector<float> y(count);
        for (size_t e = 0; e < count; ++e) y[e] = static_cast<float>(c.rank() + 1) * 0.5f;
        c.allreduce(y.data(), y.data(), count, DataType::f32, ReduceOp::avg, Algorithm::hier)->wait();
        const float expect = 0.5f * static_cast<float>(n + 1) / 2.0f;
        for (size_t e = 0; e < count; ++e) ASSERT_NEAR(y[e], expect, 1e-6) << "element " << e;
      }
    }, {{"segment_size", "65536"}});
  }
}

TEST(Hierarchy, FloatSumsAreIdenticalOnEveryRank) {
  const int n = 4;
  std::vector<std::vector<float>> got(n);
  run_on_hosts({"a", "a", "b", "b"}, [&](Communicator& c) {
    std::vector<float> x(2100007);  // two pieces
    for (size_t e = 0; e < x.size(); ++e) x[e] = std::sin(static_cast<float>(e) * 0.001f + static_cast<float>(c.rank()));
    std::vector<float> out(x.size());
    c.allreduce(x.data(), out.data(), x.size(), DataType::f32, ReduceOp::sum)->wait();
    got[static_cast<size_t>(c.rank())] = out;
    for (size_t e = 0; e < x.size(); e += 9973) {
      double ref = 0;
      for (int r = 0; r < n; ++r) ref += std::sin(static_cast<double>(static_cast<float>(e) * 0.001f) + r);
      ASSERT_NEAR(out[e], ref, 1e-5) << "element " << e;
    }
  });
  for (int r = 1; r < n; ++r) EXPECT_EQ(got[static_cast<size_t>(r)], got[0]) << "rank " << r;
}

// Interleaved ranks (0,2,4 on one host), blocks of hosts (x,x,y,y,z,z) and 2 hosts of 3.
const std::vector<std::vector<std::string>> kLayouts = {
    {"a", "b", "a", "b", "a", "b"}, {"x", "x", "y", "y", "z", "z"}, {"p", "p", "p", "q", "q", "q"}};

TEST(Hierarchy, AllgatherExactAndLikeTheRing) {
  for (const auto& layout : kLayouts) {
    const int n = static_cast<int>(layout.size());
    run_on_hosts(layout, [n](Communicator& c) {
      EXPECT_EQ(c.choose(Collective::allgather, 1 << 20, DataType::f32, Algorithm::hier), Algorithm::hier);
      for (size_t count : {size_t{1}, size_t{7}, size_t{300007}}) {
        std::vector<int64_t> mine(count), hier(count * static_cast<size_t>(n)), flat(hier.size());
        for (size_t e = 0; e < count; ++e) mine[e] = static_cast<int64_t>(e * 131 + static_cast<size_t>(c.rank()) * 7919);
        c.allgather(mine.data(), hier.data(), count, DataType::i64, std::nullopt, Algorithm::hier)->wait();
        c.allgather(mine.data(), flat.data(), count, DataType::i64, std::nullopt, Algorithm::ring)->wait();
        ASSERT_EQ(hier, flat) << "count " << count;
        for (int r = 0; r < n; ++r)
          ASSERT_EQ(hier[static_cast<size_t>(r) * count + count - 1],
                    static_cast<int64_t>((count - 1) * 131 + static_cast<size_t>(r) * 7919)) << "block of rank " << r;
        // In place: this rank's block already sits in the output.
        std::vector<int64_t> inplace(hier.size(), -1);
        std::copy(mine.begin(), mine.end(), inplace.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(c.rank()) * count));
        c.allgather(inplace.data() + static_cast<size_t>(c.rank()) * count, inplace.data(), count, DataType::i64,
                    std::nullopt, Algorithm::hier)->wait();
        ASSERT_EQ(inplace, flat) << "in place, count " << count;
      }
    }, {{"segment_size", "65536"}});
  }
}

TEST(Hierarchy, ReduceScatterExactAndWithinFloatBounds) {
  for (const auto& layout : kLayouts) {
    const int n = static_cast<int>(layout.size());
    run_on_hosts(layout, [n](Communicator& c) {
      for (size_t count : {size_t{1}, size_t{5}, size_t{200003}}) {
        const size_t all = count * static_cast<size_t>(n);
        std::vector<int64_t> x(all), hier(count), flat(count);
        for (size_t e = 0; e < all; ++e) x[e] = static_cast<int64_t>(e * 3 + static_cast<size_t>(c.rank()) * 100003);
        c.reduce_scatter(x.data(), hier.data(), count, DataType::i64, ReduceOp::sum, std::nullopt, Algorithm::hier)->wait();
        c.reduce_scatter(x.data(), flat.data(), count, DataType::i64, ReduceOp::sum, std::nullopt, Algorithm::ring)->wait();
        ASSERT_EQ(hier, flat) << "count " << count;
        for (size_t e = 0; e < count; ++e) {
          const size_t at = static_cast<size_t>(c.rank()) * count + e;
          ASSERT_EQ(hier[e], static_cast<int64_t>(at * 3 * static_cast<size_t>(n)) + 100003 * (n * (n - 1) / 2))
              << "element " << e;
        }
        // avg divides once, by the world size; sums of floats against float64.
        std::vector<float> y(all), got(count);
        for (size_t e = 0; e < all; ++e) y[e] = std::sin(static_cast<float>(e) * 0.01f + static_cast<float>(c.rank()));
        c.reduce_scatter(y.data(), got.data(), count, DataType::f32, ReduceOp::avg, std::nullopt, Algorithm::hier)->wait();
        for (size_t e = 0; e < count; e += 997) {
          const size_t at = static_cast<size_t>(c.rank()) * count + e;
          double ref = 0;
          for (int r = 0; r < n; ++r) ref += std::sin(static_cast<float>(at) * 0.01f + static_cast<float>(r));  // the inputs, in float
          ASSERT_NEAR(got[e], ref / n, 1e-6) << "element " << e;
        }
      }
    }, {{"segment_size", "65536"}});
  }
}

TEST(Hierarchy, BroadcastFromEveryRoot) {
  for (const auto& layout : kLayouts) {
    const int n = static_cast<int>(layout.size());
    run_on_hosts(layout, [n](Communicator& c) {
      for (size_t count : {size_t{3}, size_t{250001}}) {
        for (int root = 0; root < n; ++root) {
          std::vector<int32_t> x(count, -1);
          if (c.rank() == root)
            for (size_t e = 0; e < count; ++e) x[e] = static_cast<int32_t>(e * 13 + static_cast<size_t>(root));
          c.broadcast(x.data(), count, DataType::i32, root, Algorithm::hier)->wait();
          for (size_t e = 0; e < count; ++e)
            ASSERT_EQ(x[e], static_cast<int32_t>(e * 13 + static_cast<size_t>(root))) << "root " << root << " element " << e;
        }
      }
    }, {{"segment_size", "65536"}, {"streams", "2"}});
  }
}

TEST(Hierarchy, ReduceToEveryRoot) {
  for (const auto& layout : kLayouts) {
    const int n = static_cast<int>(layout.size());
    run_on_hosts(layout, [n](Communicator& c) {
      for (size_t count : {size_t{3}, size_t{250001}}) {
        std::vector<int64_t> x(count);
        for (size_t e = 0; e < count; ++e) x[e] = static_cast<int64_t>(e * 5 + static_cast<size_t>(c.rank()) * 1009);
        for (int root = 0; root < n; ++root) {
          std::vector<int64_t> out(count, -1);
          c.reduce(x.data(), out.data(), count, DataType::i64, ReduceOp::sum, root, Algorithm::hier)->wait();
          if (c.rank() != root) continue;
          for (size_t e = 0; e < count; ++e)
            ASSERT_EQ(out[e], static_cast<int64_t>(e * 5 * static_cast<size_t>(n)) + 1009 * (n * (n - 1) / 2))
                << "root " << root << " element " << e;
        }
        // avg divides once, at the root.
        std::vector<float> y(count, static_cast<float>(c.rank() + 1)), mean(count, -1.0f);
        c.reduce(y.data(), mean.data(), count, DataType::f32, ReduceOp::avg, n - 1, Algorithm::hier)->wait();
        if (c.rank() == n - 1) {
          for (size_t e = 0; e < count; e += 977) ASSERT_EQ(mean[e], static_cast<float>(n + 1) / 2) << "element " << e;
        }
      }
    }, {{"segment_size", "65536"}, {"streams", "2"}});
  }
}

TEST(Hierarchy, AutoGoesHierarchicalWhereItSavesLinkBytes) {
  // allgather and reduce_scatter save a host's link bytes in any layout; broadcast and reduce only where the
  // hosts' ranks are interleaved (a flat chain over consecutive ranks crosses each link once too).
  for (const auto& layout : kLayouts) {
    const bool interleaved = layout == kLayouts[0];
    run_on_hosts(layout, [interleaved](Communicator& c) {
      for (Collective coll :
           {Collective::allgather, Collective::reduce_scatter, Collective::broadcast, Collective::reduce}) {
        const bool chain = coll == Collective::broadcast || coll == Collective::reduce;
        const Algorithm flat = chain ? Algorithm::chain : Algorithm::ring;
        EXPECT_EQ(c.choose(coll, 1 << 20, DataType::f32), interleaved || !chain ? Algorithm::hier : flat)
            << collective_name(coll);
        EXPECT_NE(c.choose(coll, 16, DataType::f32), Algorithm::hier) << "small " << collective_name(coll);
      }
    });
  }
}

TEST(Hierarchy, UnevenHostsRefuseAllgatherAndReduceScatter) {
  run_on_hosts({"a", "a", "b"}, [](Communicator& c) {
    for (Collective coll : {Collective::allgather, Collective::reduce_scatter}) {
      try {
        c.choose(coll, 1 << 20, DataType::f32, Algorithm::hier);
        ADD_FAILURE() << "hier accepted on uneven hosts";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("same number"), std::string::npos) << e.what();
      }
    }
  });
}

}  // namespace hier

}  // namespace
}  // namespace smartcoll
