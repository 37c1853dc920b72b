// One-sided vectored operations (smartcoll/onesided.h): getv, putv and accumulatev against a local reference,
// bit for bit; the checks at the initiator and at the target, naming the cause; deregistering while requests are
// served; a malformed message closes its channel and the target serves the next one.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/onesided_wire.h"
#include "ranks.h"
#include "smartcoll/comm.h"
#include "transport/socket.h"
#include "transport/tcp.h"

namespace smartcoll {
namespace {

using harness::run_ranks;
using harness::run_threads;
using harness::test_options;

constexpr size_t kRegion = 1 << 20;  // bytes of every test region

// Rank r's region as it starts: a byte pattern the other ranks can compute.
std::vector<uint8_t> pattern(int r) {
  std::vector<uint8_t> v(kRegion);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>((i * 131 + static_cast<size_t>(r) * 17) ^ (i >> 9));
  return v;
}

// Random pieces of 1 B to 64 KiB, overlapping (offsets drawn independently), each inside the region.
std::vector<RemotePiece> random_pieces(std::mt19937& gen, size_t count, size_t align = 1) {
  std::uniform_int_distribution<size_t> len(1, 64 * 1024 / align);
  std::vector<RemotePiece> pieces;
  for (size_t i = 0; i < count; ++i) {
    const size_t bytes = len(gen) * align;
    const size_t offset = std::uniform_int_distribution<size_t>(0, (kRegion - bytes) / align)(gen) * align;
    pieces.push_back({offset, bytes});
  }
  return pieces;
}

size_t total(const std::vector<RemotePiece>& pieces) {
  size_t t = 0;
  for (const RemotePiece& p : pieces) t += p.bytes;
  return t;
}

// `bytes` of `buf` as local buffers of uneven sizes (a piece may span two of them).
std::vector<LocalPiece> split(std::vector<uint8_t>& buf, std::mt19937& gen) {
  std::vector<LocalPiece> local;
  size_t at = 0;
  while (at < buf.size()) {
    const size_t n = std::min(buf.size() - at, std::uniform_int_distribution<size_t>(1, 100'000)(gen));
    local.push_back({buf.data() + at, n});
    at += n;
  }
  return local;
}

RemoteRegion region_of(int rank, uint64_t id, DataType dt = DataType::u8, size_t bytes = kRegion) {
  return {rank, id, bytes, dt};
}

TEST(OneSided, GetvReadsOverlappingPiecesOfEveryPeer) {
  run_ranks(3, [](Communicator& comm) {
    std::vector<uint8_t> mine = pattern(comm.rank());
    ASSERT_EQ(comm.register_region(mine.data(), mine.size(), DataType::u8), 1u);
    comm.barrier()->wait();
    std::mt19937 gen(100 + comm.rank());
    for (int peer = 0; peer < comm.size(); ++peer) {  // itself included
      const auto pieces = random_pieces(gen, 300);
      std::vector<uint8_t> got(total(pieces), 0xee), want;
      const auto theirs = pattern(peer);
      for (const RemotePiece& p : pieces)
        want.insert(want.end(), theirs.begin() + static_cast<ptrdiff_t>(p.offset),
                    theirs.begin() + static_cast<ptrdiff_t>(p.offset + p.bytes));
      comm.getv(region_of(peer, 1), pieces, split(got, gen))->wait();
      ASSERT_EQ(got, want) << "rank " << comm.rank() << " reading rank " << peer;
    }
    comm.barrier()->wait();  // nobody deregisters (or leaves) while others read
  });
}

TEST(OneSided, PutvWritesPiecesInOrderAndLeavesTheRestAlone) {
  run_ranks(2, [](Communicator& comm) {
    std::vector<uint8_t> mine = pattern(comm.rank());
    comm.register_region(mine.data(), mine.size(), DataType::u8);
    comm.barrier()->wait();
    // Rank 0 writes into rank 1; overlapping pieces land in call order, later over earlier.
    std::mt19937 gen(7);
    const auto pieces = random_pieces(gen, 200);
    std::vector<uint8_t> data(total(pieces));
    for (auto& b : data) b = static_cast<uint8_t>(gen());
    if (comm.rank() == 0) {
      auto local = split(data, gen);
      comm.putv(local, region_of(1, 1), pieces)->wait();
    }
    comm.barrier()->wait();
    if (comm.rank() == 1) {
      std::vector<uint8_t> want = pattern(1);
      size_t at = 0;
      for (const RemotePiece& p : pieces) {
        std::memcpy(want.data() + p.offset, data.data() + at, p.bytes);
        at += p.bytes;
      }
      ASSERT_EQ(mine, want);
    }
    comm.barrier()->wait();
  });
}

TEST(OneSided, AccumulatevSumsIntegersExactlyFromEveryRank) {
  run_ranks(3, [](Communicator& comm) {
    std::vector<int64_t> mine(kRegion / 8, 5);
    comm.register_region(mine.data(), kRegion, DataType::i64);
    comm.barrier()->wait();
    // Every rank adds its pieces into rank 0's region; the reference replays all ranks' draws.
    auto draw = [](int r, std::vector<RemotePiece>& pieces, std::vector<int64_t>& values) {
      std::mt19937 gen(500 + r);
      pieces = random_pieces(gen, 100, 8);
      values.resize(total(pieces) / 8);
      for (auto& v : values) v = static_cast<int64_t>(gen()) - (int64_t{1} << 31);
    };
    std::vector<RemotePiece> pieces;
    std::vector<int64_t> values;
    draw(comm.rank(), pieces, values);
    const LocalPiece local{values.data(), values.size() * 8};
    comm.accumulatev({&local, 1}, region_of(0, 1, DataType::i64), pieces, ReduceOp::sum)->wait();
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      std::vector<int64_t> want(kRegion / 8, 5);
      for (int r = 0; r < comm.size(); ++r) {
        draw(r, pieces, values);
        size_t at = 0;
        for (const RemotePiece& p : pieces)
          for (size_t i = 0; i < p.bytes / 8; ++i) want[p.offset / 8 + i] += values[at++];
      }
      ASSERT_EQ(mine, want);
    }
    comm.barrier()->wait();
  });
}

// Under a codec every piece travels encoded on its own: the result is, bit for bit, what the codec's own
// round trip of each piece gives (a put: decode(encode(piece)); an accumulate: region + decode(encode(piece))
// in float32, pieces in order; a get: decode(encode(the region's piece))).
TEST(OneSided, CodecsEncodeEachPieceOnTheWay) {
  for (const char* name : {"bfp16", "mxfp4_e2m1", "fp16"}) {
    const Codec codec = Codec::parse(name);
    run_ranks(2, [&](Communicator& comm) {
      std::vector<float> mine(kRegion / 4);
      std::mt19937 gen(3);
      std::normal_distribution<float> normal(0, 10);
      for (float& x : mine) x = normal(gen);
      const std::vector<float> start = mine;
      comm.register_region(mine.data(), kRegion, DataType::f32);
      comm.barrier()->wait();
      const RemoteRegion peer = region_of(1 - comm.rank(), 1, DataType::f32);
      auto pieces = random_pieces(gen, 50, 4);
      std::vector<float> values(total(pieces) / 4);
      for (float& x : values) x = normal(gen);
      auto round_trip = [&](const float* x, size_t n) {
        std::vector<uint8_t> enc(codec.encoded_size(n));
        std::vector<float> back(n);
        codec.encode(x, n, enc.data());
        codec.decode(enc.data(), n, back.data());
        return back;
      };
      // getv: the peer's region is `start` (same seed) until the barrier below.
      std::vector<float> got(values.size());
      const LocalPiece into{got.data(), got.size() * 4};
      comm.getv(peer, pieces, {&into, 1}, codec)->wait();
      size_t at = 0;
      for (const RemotePiece& p : pieces) {
        const auto want = round_trip(start.data() + p.offset / 4, p.bytes / 4);
        ASSERT_EQ(std::memcmp(got.data() + at, want.data(), p.bytes), 0) << name << " getv";
        at += p.bytes / 4;
      }
      comm.barrier()->wait();
      // Rank 0 puts, then accumulates the same pieces into rank 1.
      if (comm.rank() == 0) {
        const LocalPiece from{values.data(), values.size() * 4};
        comm.putv({&from, 1}, peer, pieces, codec)->wait();
        comm.accumulatev({&from, 1}, peer, pieces, ReduceOp::sum, codec)->wait();
        const RemotePiece one{0, 4};
        EXPECT_THROW(comm.accumulatev({&from, 1}, peer, {&one, 1}, ReduceOp::max, codec), InvalidArgument);
      }
      comm.barrier()->wait();
      if (comm.rank() == 1) {
        std::vector<float> want = start;
        at = 0;
        for (const RemotePiece& p : pieces) {
          const auto back = round_trip(values.data() + at, p.bytes / 4);
          std::memcpy(want.data() + p.offset / 4, back.data(), p.bytes);
          at += p.bytes / 4;
        }
        at = 0;
        for (const RemotePiece& p : pieces) {
          const auto back = round_trip(values.data() + at, p.bytes / 4);
          for (size_t i = 0; i < back.size(); ++i) want[p.offset / 4 + i] += back[i];
          at += p.bytes / 4;
        }
        ASSERT_EQ(std::memcmp(mine.data(), want.data(), kRegion), 0) << name << " putv then accumulatev";
      }
      comm.barrier()->wait();
    });
  }
}

TEST(OneSided, TheInitiatorRefusesBadCallsByName) {
  run_ranks(2, [](Communicator& comm) {
    std::vector<float> mine(1024);
    comm.register_region(mine.data(), mine.size() * 4, DataType::f32);
    const RemoteRegion peer = region_of(1 - comm.rank(), 1, DataType::f32, 4096);
    float buf[4];
    const LocalPiece local{buf, 16};
    auto refused = [&](auto call, const std::string& what) {
      try {
        call();
        ADD_FAILURE() << "not refused: " << what;
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      }
    };
    const RemotePiece past{4090, 16}, wrap{~uint64_t{0} - 4, 16}, odd{2, 16}, fine{0, 16}, short_piece{0, 8};
    refused([&] { comm.getv(peer, {&past, 1}, {&local, 1}); }, "piece 0 (16 bytes at offset 4090) lies outside "
                                                                "region 1 of 4096 bytes");
    refused([&] { comm.putv({&local, 1}, peer, {&wrap, 1}); }, "lies outside region 1");
    refused([&] { comm.accumulatev({&local, 1}, peer, {&odd, 1}); }, "is not made of whole float32 elements");
    refused([&] { comm.accumulatev({&local, 1}, peer, {&fine, 1}, ReduceOp::avg); }, "op 'avg'");
    refused([&] { comm.getv(peer, {&short_piece, 1}, {&local, 1}); }, "the remote pieces add up to 8 bytes but "
                                                                       "the local buffers to 16");
    refused([&] { comm.getv(region_of(2, 1, DataType::f32, 4096), {&fine, 1}, {&local, 1}); },
            "rank 2 is outside the world of size 2");
    comm.barrier()->wait();
  });
}

// The target checks again, against the region it has: an initiator that believes in a larger region, or names
// one that does not exist or was deregistered, gets the target's reason and the channel goes on.
TEST(OneSided, TheTargetRefusesWhatItsRegionsDoNotAllow) {
  run_ranks(2, [](Communicator& comm) {
    std::vector<float> mine(1024, 1.5f);
    const uint64_t a = comm.register_region(mine.data(), 4096, DataType::f32);
    const uint64_t b = comm.register_region(mine.data(), 4096, DataType::f32);
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      float buf[4];
      const LocalPiece local{buf, 16};
      const RemotePiece far{8000, 16}, fine{0, 16};
      auto target_says = [&](const RemoteRegion& r, const RemotePiece& p, const std::string& what) {
        try {
          comm.getv(r, {&p, 1}, {&local, 1})->wait();
          ADD_FAILURE() << "not refused: " << what;
        } catch (const CommError& e) {
          EXPECT_NE(std::string(e.what()).find("rank 1 refused it: " + what), std::string::npos) << e.what();
        }
      };
      target_says(region_of(1, a, DataType::f32, 1 << 20), far, "piece 0 (16 bytes at offset 8000) lies outside "
                                                               "region 1 of 4096 bytes");
      target_says(region_of(1, 9, DataType::f32, 4096), fine, "rank 1 has no region 9 (it has registered 2)");
      const LocalPiece acc{buf, 16};
      try {
        comm.accumulatev({&acc, 1}, region_of(1, b, DataType::i32, 4096), {&fine, 1})->wait();
        ADD_FAILURE() << "an accumulate of the wrong dtype was not refused";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("region 2 holds float32, the initiator sent int32"), std::string::npos)
            << e.what();
      }
      comm.barrier()->wait();  // rank 1 deregisters region 1
      comm.barrier()->wait();
      target_says(region_of(1, a, DataType::f32, 4096), fine, "region 1 was deregistered");
      comm.getv(region_of(1, b, DataType::f32, 4096), {&fine, 1}, {&local, 1})->wait();  // the channel goes on
      EXPECT_EQ(buf[3], 1.5f);
    } else {
      comm.barrier()->wait();
      comm.deregister_region(a);
      EXPECT_THROW(comm.deregister_region(a), InvalidArgument);
      comm.barrier()->wait();
    }
    comm.barrier()->wait();
  });
}

// Requests keep coming while the target deregisters the region: each one is served whole from the live region
// or refused as deregistered, and nothing is read after deregister_region returns (the buffer is freed then:
// under AddressSanitizer a late read would be reported).
TEST(OneSided, DeregisteringWhileServingIsSafe) {
  run_ranks(2, [](Communicator& comm) {
    auto mine = std::make_unique<std::vector<uint8_t>>(pattern(comm.rank()));
    const uint64_t id = comm.register_region(mine->data(), kRegion, DataType::u8);
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      const auto want = pattern(1);
      const RemotePiece all{0, kRegion};
      int served = 0, refused = 0;
      for (int round = 0; round < 200 && refused == 0; ++round) {
        std::vector<std::vector<uint8_t>> bufs(4, std::vector<uint8_t>(kRegion));
        std::vector<std::shared_ptr<Request>> reqs;
        for (auto& b : bufs) {
          const LocalPiece local{b.data(), b.size()};
          reqs.push_back(comm.getv(region_of(1, id), {&all, 1}, {&local, 1}));
        }
        for (size_t i = 0; i < reqs.size(); ++i) {
          try {
            reqs[i]->wait();
            ASSERT_EQ(bufs[i], want);
            ++served;
          } catch (const CommError& e) {
            ASSERT_NE(std::string(e.what()).find("region 1 was deregistered"), std::string::npos) << e.what();
            ++refused;
          }
        }
        if (round == 2) comm.barrier()->wait();  // lets rank 1 deregister while requests flow
      }
      EXPECT_GT(served, 0);
      EXPECT_GT(refused, 0);
    } else {
      comm.barrier()->wait();
      comm.deregister_region(id);
      mine.reset();
    }
    comm.barrier()->wait();
  });
}

// A forged message on a one-sided channel, or a hello without the target's token: the target closes that
// channel (the forger sees it closed, and no answer) and goes on serving everyone else.
TEST(OneSided, AMalformedMessageClosesItsChannelOnly) {
  run_threads(2, [](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, store, test_options({{"log", "error"}}));
    std::vector<float> mine(1024, 2.5f);
    comm.register_region(mine.data(), 4096, DataType::f32);
    comm.barrier()->wait();
    if (r == 0) {
      const std::string job = store->get("smartcoll/job", std::chrono::seconds(5));
      const std::string published = store->get("job/" + job + "/rma/1", std::chrono::seconds(5));
      const std::string addr = published.substr(0, published.find(' ')), hex = published.substr(published.find(' ') + 1);
      const auto colon = addr.rfind(':');
      const auto deadline = net::Clock::now() + std::chrono::seconds(5);
      for (int forged = 0; forged < 4; ++forged) {
        net::Fd s = net::connect_to({addr.substr(0, colon), static_cast<uint16_t>(std::stoi(addr.substr(colon + 1)))},
                                    deadline);
        rma::Hello hello{rma::kHelloMagic, 0, 2, rma::kVersion, job_fingerprint(job), {}};
        for (size_t i = 0; i < 16; ++i) hello.token[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
        if (forged == 3) hello.token[5] ^= 1;  // someone who did not read the store, with a valid request
        net::send_all(s.get(), &hello, sizeof hello, deadline, "hello");
        rma::Header h;
        h.kind = static_cast<uint8_t>(rma::Kind::get);
        if (forged == 0) h.magic ^= 1;                        // not a one-sided message
        if (forged == 1) h.npieces = rma::kMaxPieces + 1;     // more pieces than any call has
        if (forged == 2) h.kind = static_cast<uint8_t>(rma::Kind::data);  // an answer sent to a target
        h.region = 1;
        net::send_all(s.get(), &h, sizeof h, deadline, "forged header");
        char byte;
        const timeval patience{5, 0};
        ::setsockopt(s.get(), SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience);
        // Closed: an orderly end, or a reset when the target closed with the forged bytes unread.
        const ssize_t got = ::recv(s.get(), &byte, 1, 0);
        EXPECT_TRUE(got == 0 || (got < 0 && errno == ECONNRESET))
            << "forged message " << forged << ": recv gave " << got << " (" << std::strerror(errno) << ")";
      }
      float buf[4];
      const LocalPiece local{buf, 16};
      const RemotePiece fine{16, 16};
      comm.getv(region_of(1, 1, DataType::f32, 4096), {&fine, 1}, {&local, 1})->wait();
      EXPECT_EQ(buf[0], 2.5f);
    }
    comm.barrier()->wait();
  });
}

TEST(OneSided, ATargetThatRegisteredNothingIsNamed) {
  run_ranks(2, [](Communicator& comm) {
    if (comm.rank() == 0) {
      float buf[1];
      const LocalPiece local{buf, 4};
      const RemotePiece fine{0, 4};
      try {
        comm.getv(region_of(1, 1, DataType::f32, 4), {&fine, 1}, {&local, 1})->wait();
        ADD_FAILURE() << "a getv from a rank that serves nothing succeeded";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 1 serves no one-sided operations"), std::string::npos)
            << e.what();
      }
    }
    comm.barrier()->wait();
  }, test_options({{"connect_timeout", "3"}}));
}

}  // namespace
}  // namespace smartcoll
