// One-sided vectored operations (smartcoll/onesided.h): getv, putv and accumulatev against a local reference,
// bit for bit; the checks at the initiator and at the target, naming the cause; deregistering while requests are
// served; a malformed message closes its channel and the target serves the next one.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/agreement.h"
#include "core/onesided.h"
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

// The pieces of a region holding `bytes`, one after the other: what a getv of them gives.
std::vector<uint8_t> pieces_of(const std::vector<uint8_t>& bytes, const std::vector<RemotePiece>& pieces) {
  std::vector<uint8_t> out;
  for (const RemotePiece& p : pieces)
    out.insert(out.end(), bytes.begin() + static_cast<ptrdiff_t>(p.offset),
               bytes.begin() + static_cast<ptrdiff_t>(p.offset + p.bytes));
  return out;
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

// A raw channel to rank `target`'s one-sided server, as a forger or a greedy initiator would open one: the
// address and token read from the store, the hello sent (as rank `as`, its token spoiled if `bad_token`).
struct RawChannel {
  net::Fd fd;
  std::string job;
};

// The store key (in the shared store) under which `rank` of a world of `size` publishes its one-sided address.
std::string rma_key(Store& store, int rank, int size) {
  const std::string job = "job/" + store.get("smartcoll/job", std::chrono::seconds(5)) + "/";
  const auto claims = parse_verdict(store.get(job + "settings/verdict", std::chrono::seconds(5)), size).claims;
  return job + "rma/" + std::to_string(rank) + "/" + claims.at(static_cast<size_t>(rank));
}

RawChannel raw_channel(Store& store, int target, int as, int size, bool bad_token = false) {
  const std::string job = store.get("smartcoll/job", std::chrono::seconds(5));
  const std::string published = store.get(rma_key(store, target, size), std::chrono::seconds(5));
  const std::string addr = published.substr(0, published.find(' ')), hex = published.substr(published.find(' ') + 1);
  const auto colon = addr.rfind(':');
  const auto deadline = net::Clock::now() + std::chrono::seconds(5);
  net::Fd s = net::connect_to({addr.substr(0, colon), static_cast<uint16_t>(std::stoi(addr.substr(colon + 1)))},
                              deadline);
  rma::Hello hello{rma::kHelloMagic, static_cast<uint32_t>(as), static_cast<uint32_t>(size), rma::kVersion,
                   job_fingerprint(job), {}};
  for (size_t i = 0; i < 16; ++i) hello.token[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  if (bad_token) hello.token[5] ^= 1;
  net::send_all(s.get(), &hello, sizeof hello, deadline, "hello");
  const timeval patience{5, 0};
  ::setsockopt(s.get(), SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience);
  return {std::move(s), job};
}

// What a target says before it closes a channel: an error answer of id 0 with the reason ("" if none came).
std::string farewell_text(int fd) {
  rma::Header h;
  if (::recv(fd, &h, sizeof h, MSG_WAITALL) != static_cast<ssize_t>(sizeof h)) return "";
  if (h.kind != static_cast<uint8_t>(rma::Kind::error) || h.id != 0 || h.payload > rma::kMaxErrorText)
    return "a message of kind " + std::to_string(h.kind) + " and id " + std::to_string(h.id);
  std::string text(h.payload, '\0');
  if (::recv(fd, text.data(), text.size(), MSG_WAITALL) != static_cast<ssize_t>(text.size())) return "";
  return text;
}

// Closed: an orderly end, or a reset when the target closed with bytes unread.
void expect_closed(int fd, const std::string& what) {
  char byte;
  const ssize_t got = ::recv(fd, &byte, 1, 0);
  EXPECT_TRUE(got == 0 || (got < 0 && errno == ECONNRESET))
      << what << ": recv gave " << got << " (" << std::strerror(errno) << ")";
}

size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

TEST(OneSided, GetvReadsOverlappingPiecesOfEveryPeer) {
  run_ranks(3, [](Communicator& comm) {
    std::vector<uint8_t> mine = pattern(comm.rank());
    ASSERT_EQ(comm.register_region(mine.data(), mine.size(), DataType::u8), 1u);
    comm.barrier()->wait();
    std::mt19937 gen(100 + comm.rank());
    for (int peer = 0; peer < comm.size(); ++peer) {  // itself included
      const auto pieces = random_pieces(gen, 300);
      std::vector<uint8_t> got(total(pieces), 0xee);
      const std::vector<uint8_t> want = pieces_of(pattern(peer), pieces);
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

// Regions in memory the communicator allocated: peers of this host map them and copy pieces themselves (the
// gather and scatter kernels, or piece by piece into local buffers cut across the pieces), bit for bit as the
// server would.
TEST(OneSided, AllocatedRegionsAreCopiedThroughAMappingBitForBit) {
  run_ranks(3, [](Communicator& comm) {
    AllocatedRegion mine = comm.allocate_region(kRegion, DataType::u8);
    ASSERT_EQ(mine.id, 1u);
    ASSERT_EQ(mine.bytes, kRegion);
    const auto start = pattern(comm.rank());
    std::memcpy(mine.data, start.data(), kRegion);
    comm.barrier()->wait();
    const uint64_t before = comm.engine_stats().direct_gets;
    std::mt19937 gen(300 + comm.rank());
    for (int peer = 0; peer < comm.size(); ++peer) {
      const auto pieces = random_pieces(gen, 300);
      std::vector<uint8_t> one(total(pieces), 0xee), many(total(pieces), 0xee);
      const std::vector<uint8_t> want = pieces_of(pattern(peer), pieces);
      comm.getv(region_of(peer, 1), pieces, std::vector<LocalPiece>{{one.data(), one.size()}})->wait();
      comm.getv(region_of(peer, 1), pieces, split(many, gen))->wait();
      ASSERT_EQ(one, want) << "rank " << comm.rank() << " reading rank " << peer << " into one buffer";
      ASSERT_EQ(many, want) << "rank " << comm.rank() << " reading rank " << peer << " into many";
    }
    const uint64_t direct = comm.engine_stats().direct_gets - before;
    EXPECT_EQ(direct, 6u) << "gets copied through the mapping";
    comm.barrier()->wait();
    // Rank 0 writes into rank 1 (from many local buffers) and rank 2 (from one); later pieces over earlier.
    std::mt19937 shared_gen(9);
    const auto pieces = random_pieces(shared_gen, 200);
    std::vector<uint8_t> data(total(pieces));
    for (auto& b : data) b = static_cast<uint8_t>(shared_gen());
    if (comm.rank() == 0) {
      comm.putv(split(data, gen), region_of(1, 1), pieces)->wait();
      comm.putv(std::vector<LocalPiece>{{data.data(), data.size()}}, region_of(2, 1), pieces)->wait();
    }
    comm.barrier()->wait();
    std::vector<uint8_t> want = start;
    if (comm.rank() > 0) {
      size_t at = 0;
      for (const RemotePiece& p : pieces) {
        std::memcpy(want.data() + p.offset, data.data() + at, p.bytes);
        at += p.bytes;
      }
    }
    ASSERT_EQ(0, std::memcmp(mine.data, want.data(), kRegion)) << "rank " << comm.rank();
    comm.barrier()->wait();
    comm.deregister_region(mine.id);
    static_cast<uint8_t*>(mine.data)[0] ^= 1;  // the memory outlives the registration
  });
}

// Mappings of this process's memory that belong to allocated regions (every rank's: the ranks are threads).
int region_mappings() {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) n += line.find("memfd:smartcoll-region") != std::string::npos;
  return n;
}

// A peer that mapped a region lets it go within about a second of its deregistration, with no further call to
// its owner (the server thread looks over every mapping once a second), so the memory is freed.
TEST(OneSided, APeerDropsADeregisteredRegionsMappingWithoutAnotherCall) {
  ASSERT_EQ(region_mappings(), 0);
  run_ranks(2, [](Communicator& comm) {
    std::optional<AllocatedRegion> mine;
    if (comm.rank() == 0) mine = comm.allocate_region(kRegion, DataType::u8);
    comm.barrier()->wait();
    if (comm.rank() == 1) {
      std::vector<uint8_t> into(4096);
      const RemotePiece piece{0, into.size()};
      comm.getv(region_of(0, 1), {&piece, 1}, std::vector<LocalPiece>{{into.data(), into.size()}})->wait();
      EXPECT_EQ(comm.engine_stats().direct_gets, 1u);
      EXPECT_EQ(region_mappings(), 2) << "the owner's and the peer's";
    }
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      comm.deregister_region(mine->id);
      mine.reset();  // the owner's own mapping goes with its last reference
    }
    comm.barrier()->wait();
    if (comm.rank() == 1) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (region_mappings() > 0 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      EXPECT_EQ(region_mappings(), 0) << "the peer kept the deregistered region mapped";
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

// Accumulates into an allocated region are reduced straight into the mapping (rank 0 into its own region, rank 2
// into rank 0's) while the server applies rank 1's (rma_direct=off: no directory, so it goes through the server),
// all on the same few elements at once: the slot's lock makes them apply one at a time, so no update is lost and
// the integer sums are exact. Each call's local side is one buffer or several (a piece may span two).
TEST(OneSided, DirectAndServedAccumulatesIntoAnAllocatedRegionLoseNoUpdate) {
  const int n = 3, rounds = 2000;
  constexpr size_t kElems = 64;  // every piece lies within the region's first 64 elements: they overlap
  std::vector<uint64_t> direct(n);
  auto draw = [](int r, int round, std::vector<RemotePiece>& pieces, std::vector<int64_t>& values) {
    std::mt19937 gen(static_cast<uint32_t>(1000 * r + round));
    pieces.clear();
    for (int k = 0; k < 3; ++k) {
      const size_t first = std::uniform_int_distribution<size_t>(0, kElems - 1)(gen);
      const size_t count = std::uniform_int_distribution<size_t>(1, kElems - first)(gen);
      pieces.push_back({first * 8, count * 8});
    }
    values.resize(total(pieces) / 8);
    for (auto& v : values) v = static_cast<int64_t>(gen() % 1000) - 500;
  };
  harness::run_threads(n, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, n, std::move(store), test_options({{"rma_direct", r == 1 ? "off" : "auto"}}));
    AllocatedRegion mine = comm.allocate_region(kRegion, DataType::i64);
    auto* elems = static_cast<int64_t*>(mine.data);
    for (size_t i = 0; i < kRegion / 8; ++i) elems[i] = 5;
    comm.barrier()->wait();
    std::vector<RemotePiece> pieces;
    std::vector<int64_t> values;
    std::mt19937 gen(77 + r);
    for (int round = 0; round < rounds; ++round) {
      draw(r, round, pieces, values);
      std::vector<uint8_t> bytes(values.size() * 8);
      std::memcpy(bytes.data(), values.data(), bytes.size());
      std::vector<LocalPiece> local{{bytes.data(), bytes.size()}};
      if (round % 2) {  // buffers of 1 to 100 bytes
        local.clear();
        for (size_t at = 0, k; at < bytes.size(); at += k) {
          k = std::min(bytes.size() - at, std::uniform_int_distribution<size_t>(1, 100)(gen));
          local.push_back({bytes.data() + at, k});
        }
      }
      comm.accumulatev(local, region_of(0, mine.id, DataType::i64), pieces, ReduceOp::sum)->wait();
    }
    direct[static_cast<size_t>(r)] = comm.engine_stats().direct_accumulates;
    comm.barrier()->wait();
    if (r == 0) {
      std::vector<int64_t> want(kRegion / 8, 5);
      for (int q = 0; q < n; ++q) {
        for (int round = 0; round < rounds; ++round) {
          draw(q, round, pieces, values);
          size_t at = 0;
          for (const RemotePiece& p : pieces)
            for (size_t i = 0; i < p.bytes / 8; ++i) want[p.offset / 8 + i] += values[at++];
        }
      }
      ASSERT_EQ(0, std::memcmp(elems, want.data(), kRegion)) << "an accumulate was lost or applied twice";
    }
    comm.barrier()->wait();
  });
  EXPECT_EQ(direct[0], static_cast<uint64_t>(rounds)) << "rank 0 into its own region";
  EXPECT_EQ(direct[1], 0u) << "rma_direct=off goes through the server";
  EXPECT_EQ(direct[2], static_cast<uint64_t>(rounds)) << "rank 2 into rank 0's region";
}

// A direct accumulate is refused as the server refuses it when the region holds another dtype than the call says
// (never reduced as the wrong type), and takes its values before applying any where they lie in the region itself:
// rank 0 adds its region's elements 0-5 into elements 1-6, and gets what the server gives (each element plus its
// old neighbour), not a running sum. 56 elements, more than a vector register holds, which would hide it.
TEST(OneSided, DirectAccumulatesCheckTheRegionsDtypeAndReadAliasedValuesFirst) {
  run_ranks(2, [](Communicator& comm) {
    constexpr int kElems = 64;
    AllocatedRegion mine = comm.allocate_region(8 * kElems, DataType::i64);
    auto* elems = static_cast<int64_t*>(mine.data);
    for (int i = 0; i < kElems; ++i) elems[i] = 1;
    comm.barrier()->wait();
    if (comm.rank() == 1) {
      std::vector<double> values(4, 1.0);
      const LocalPiece local{values.data(), 32};
      const std::vector<RemotePiece> pieces{{0, 32}};
      try {
        comm.accumulatev({&local, 1}, region_of(0, mine.id, DataType::f64, 8 * kElems), pieces, ReduceOp::sum)->wait();
        ADD_FAILURE() << "an accumulate of float64 into an int64 region was applied";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("holds int64, the initiator sent float64"), std::string::npos)
            << e.what();
      }
    }
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      for (int i = 0; i < kElems; ++i) ASSERT_EQ(elems[i], 1) << "element " << i << " after the refused accumulate";
      const uint64_t before = comm.engine_stats().direct_accumulates;
      const LocalPiece local{elems, 8 * 56};
      const std::vector<RemotePiece> pieces{{8, 8 * 56}};
      comm.accumulatev({&local, 1}, region_of(0, mine.id, DataType::i64, 8 * kElems), pieces, ReduceOp::sum)->wait();
      EXPECT_EQ(comm.engine_stats().direct_accumulates - before, 1u);
      std::vector<int64_t> want(kElems, 1);
      std::fill(want.begin() + 1, want.begin() + 57, 2);
      EXPECT_EQ(std::vector<int64_t>(elems, elems + kElems), want);
    }
    comm.barrier()->wait();
  });
}

// A putv or getv whose local buffers are the region's own memory (here rank 0's own allocated region) is copied
// as the server copies it, every byte read before any is written: a put of the region's two halves swapped swaps
// them, a get of its first half onto bytes 4-11 moves it; neither goes direct, where the copy would read bytes it
// had already written.
TEST(OneSided, CallsWhoseLocalBuffersAreTheRegionCopyAsTheServerDoes) {
  run_ranks(2, [](Communicator& comm) {
    AllocatedRegion mine = comm.allocate_region(16, DataType::u8);
    auto* bytes = static_cast<uint8_t*>(mine.data);
    for (uint8_t i = 0; i < 16; ++i) bytes[i] = i;
    comm.barrier()->wait();
    if (comm.rank() == 0) {
      const EngineStats before = comm.engine_stats();
      const std::vector<LocalPiece> halves{{bytes + 8, 8}, {bytes, 8}};
      comm.putv(halves, region_of(0, mine.id, DataType::u8, 16), std::vector<RemotePiece>{{0, 8}, {8, 8}})->wait();
      const std::vector<uint8_t> swapped{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
      EXPECT_EQ(std::vector<uint8_t>(bytes, bytes + 16), swapped);
      const LocalPiece into{bytes + 4, 8};
      comm.getv(region_of(0, mine.id, DataType::u8, 16), std::vector<RemotePiece>{{0, 8}}, {&into, 1})->wait();
      const std::vector<uint8_t> moved{8, 9, 10, 11, 8, 9, 10, 11, 12, 13, 14, 15, 4, 5, 6, 7};
      EXPECT_EQ(std::vector<uint8_t>(bytes, bytes + 16), moved);
      EXPECT_EQ(comm.engine_stats().direct_puts, before.direct_puts);
      EXPECT_EQ(comm.engine_stats().direct_gets, before.direct_gets);
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

// The error of a 16-byte getv from rank 1's region 1 (float32, 4096 bytes): "" if it succeeded.
std::string getv_error(Communicator& comm) {
  float buf[4];
  const LocalPiece local{buf, 16};
  const RemotePiece fine{0, 16};
  try {
    comm.getv(region_of(1, 1, DataType::f32, 4096), {&fine, 1}, {&local, 1})->wait();
    return "";
  } catch (const CommError& e) {
    return e.what();
  }
}

// Two ranks, each with region 1: 1024 floats of 2.5; body(rank, store, comm) runs after a barrier.
// Gets go to the target's server here (rma_direct=off), whose channel these tests forge messages on.
void with_float_regions(const std::function<void(int, Store&, Communicator&)>& body) {
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, store, test_options({{"log", "error"}, {"rma_direct", "off"}}));
    std::vector<float> mine(1024, 2.5f);
    comm.register_region(mine.data(), 4096, DataType::f32);
    comm.barrier()->wait();
    body(r, *store, comm);
    comm.barrier()->wait();
  });
}

// A forged message on a one-sided channel, or a hello without the target's token: the target says why in an
// error answer of id 0, closes that channel, and goes on serving everyone else.
TEST(OneSided, AMalformedMessageClosesItsChannelOnly) {
  with_float_regions([](int r, Store& store, Communicator& comm) {
    if (r == 0) {
      const char* causes[] = {"bad magic", "pieces exceed", "a target cannot take a message of kind 4 (data)",
                              "a wrong token"};
      for (int forged = 0; forged < 4; ++forged) {
        RawChannel ch = raw_channel(store, 1, 0, 2, forged == 3);  // 3: a valid request without the token
        rma::Header h;
        h.kind = static_cast<uint8_t>(rma::Kind::get);
        if (forged == 0) h.magic ^= 1;                        // not a one-sided message
        if (forged == 1) h.npieces = rma::kMaxPieces + 1;     // more pieces than any call has
        if (forged == 2) h.kind = static_cast<uint8_t>(rma::Kind::data);  // an answer sent to a target
        h.region = 1;
        net::send_all(ch.fd.get(), &h, sizeof h, net::Clock::now() + std::chrono::seconds(5), "forged header");
        const std::string why = farewell_text(ch.fd.get());
        EXPECT_NE(why.find(causes[forged]), std::string::npos) << "forged message " << forged << ": " << why;
        EXPECT_NE(why.find("rank 1 "), std::string::npos) << why;
        expect_closed(ch.fd.get(), "forged message " + std::to_string(forged));
      }
      float buf[4];
      const LocalPiece local{buf, 16};
      const RemotePiece fine{16, 16};
      comm.getv(region_of(1, 1, DataType::f32, 4096), {&fine, 1}, {&local, 1})->wait();
      EXPECT_EQ(buf[0], 2.5f);
    }
  });
}

// A target that refuses the hello (here: the token in the store is not the target's) says why, and the
// initiator's error names it, not only "closed by that rank".
TEST(OneSided, TheInitiatorNamesARefusedHello) {
  with_float_regions([](int r, Store& store, Communicator& comm) {
    if (r == 1) {
      const std::string key = rma_key(store, 1, 2), published = store.get(key, std::chrono::seconds(5));
      std::string spoiled = published;
      spoiled.back() = spoiled.back() == '0' ? '1' : '0';
      store.set(key, spoiled);
    }
    comm.barrier()->wait();
    if (r == 0) {
      const std::string what = getv_error(comm);
      EXPECT_NE(what.find("rank 1 refused the one-sided channel: a wrong token"), std::string::npos) << what;
      const std::string published = store.get(rma_key(store, 1, 2), std::chrono::seconds(1));
      EXPECT_EQ(what.find(published.substr(published.find(' ') + 1)), std::string::npos) << "the token is shown";
    }
  });
}

// What a fake target answers on one channel: a header (its id set to the request's), then `payload`.
struct FakeAnswer {
  rma::Header head;
  std::string payload;
};

// A fake target on rank 1: publishes its own address and token, and for each entry of `channels` takes one
// channel, reads the hello and one request's header and pieces table, and answers (none: no answer). Then it
// holds the channels open, reading nothing, until `release` is set.
void fake_target(Store& store, const std::vector<std::optional<FakeAnswer>>& channels,
                 const std::atomic<bool>& release) {
  net::Fd listener = net::listen_on("127.0.0.1", 0, 4);
  store.set(rma_key(store, 1, 2),
            "127.0.0.1:" + std::to_string(net::bound_port(listener.get())) + " " + std::string(32, 'a'));
  std::vector<net::Fd> open;
  for (const std::optional<FakeAnswer>& answer : channels) {
    const auto deadline = net::Clock::now() + std::chrono::seconds(10);
    net::Fd s = net::accept_from(listener.get(), deadline);
    rma::Hello hello;
    net::recv_all(s.get(), &hello, sizeof hello, deadline, "hello");
    rma::Header h;
    try {
      net::recv_all(s.get(), &h, sizeof h, deadline, "request");
      std::vector<RemotePiece> pieces(h.npieces);
      net::recv_all(s.get(), pieces.data(), pieces.size() * sizeof(RemotePiece), deadline, "pieces");
    } catch (const CommError&) {
      if (answer) throw;  // with no answer to give, the initiator may close before its request leaves (abort)
    }
    if (answer) {
      rma::Header a = answer->head;
      a.id = h.id;
      net::send_all(s.get(), &a, sizeof a, deadline, "answer");
      net::send_all(s.get(), answer->payload.data(), answer->payload.size(), deadline, "payload");
    }
    open.push_back(std::move(s));
  }
  while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

// Rank 1 runs fake_target() on `channels`, rank 0 runs `initiator`. No collective after it (the initiator may
// have aborted): rank 1 waits for `release` alone.
void with_fake_target(const std::vector<std::optional<FakeAnswer>>& channels,
                      const std::function<void(Communicator&)>& initiator, const std::string& timeout = "20") {
  std::atomic<bool> release{false};
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, store, test_options({{"log", "error"}, {"timeout", timeout}}));
    comm.barrier()->wait();
    if (r == 1) {
      fake_target(*store, channels, release);
    } else {
      initiator(comm);
      release = true;
    }
  });
}

// An answer of a kind no target sends (0, 7..255) is malformed: the call fails naming it, and does not
// complete with its buffers untouched.
TEST(OneSided, AnAnswerOfUnknownKindFailsTheCall) {
  for (uint8_t kind : {uint8_t{0}, uint8_t{7}, uint8_t{255}}) {
    FakeAnswer answer;
    answer.head.kind = kind;
    answer.head.payload = 16;
    answer.payload.assign(16, 'x');
    with_fake_target({answer}, [&](Communicator& comm) {
      const std::string what = getv_error(comm);
      EXPECT_NE(what.find("malformed one-sided message from rank 1: an initiator cannot take a message of kind " +
                          std::to_string(kind)), std::string::npos) << what;
    });
  }
}

// A putv sends straight from the caller's buffers: an answer that comes before the request has left whole
// would hand the buffers back while they are still read. The call fails instead, naming it.
TEST(OneSided, AnAnswerBeforeThePutLeftWholeIsMalformed) {
  FakeAnswer answer;
  answer.head.kind = static_cast<uint8_t>(rma::Kind::done);
  with_fake_target({answer}, [](Communicator& comm) {
    std::vector<uint8_t> big(64 << 20, 7);  // more than the socket buffers hold while the target reads nothing
    const LocalPiece local{big.data(), big.size()};
    const RemotePiece all{0, big.size()};
    try {
      comm.putv({&local, 1}, region_of(1, 1, DataType::u8, big.size()), {&all, 1})->wait();
      ADD_FAILURE() << "a putv answered before it was sent succeeded";
    } catch (const CommError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("malformed one-sided message from rank 1: an answer to putv #1 on rank 0 to rank 1 "
                          "(region 1) before its request was sent whole"), std::string::npos) << what;
    }
  });
}

// A target that does not answer within the timeout knob fails the call; it may be alive but slow, so the next
// call opens a new channel instead of failing at once.
TEST(OneSided, ACallAfterATimeoutReconnects) {
  FakeAnswer data;
  data.head.kind = static_cast<uint8_t>(rma::Kind::data);
  data.head.payload = 16;
  data.payload.assign(16, '\x42');
  with_fake_target({std::nullopt, data}, [](Communicator& comm) {
    const std::string first = getv_error(comm);
    EXPECT_NE(first.find("no answer from rank 1 for 1"), std::string::npos) << first;
    float buf[4];
    const LocalPiece local{buf, 16};
    const RemotePiece fine{0, 16};
    comm.getv(region_of(1, 1, DataType::f32, 4096), {&fine, 1}, {&local, 1})->wait();
    EXPECT_EQ(std::memcmp(buf, std::string(16, '\x42').data(), 16), 0);
  }, "1");
}

// Communicator::abort fails the one-sided calls outstanding and every later one, naming the reason.
TEST(OneSided, AbortFailsOneSidedCalls) {
  with_fake_target({std::nullopt}, [](Communicator& comm) {
    float buf[4];
    const LocalPiece local{buf, 16};
    const RemotePiece fine{0, 16};
    auto req = comm.getv(region_of(1, 1, DataType::f32, 4096), {&fine, 1}, {&local, 1});
    comm.abort("the test is over");
    try {
      ASSERT_TRUE(req->wait(std::chrono::seconds(5))) << "abort left the call outstanding";
      ADD_FAILURE() << "a call outstanding at abort succeeded";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 aborted: the test is over"), std::string::npos) << e.what();
    }
    const std::string later = getv_error(comm);
    EXPECT_NE(later.find("rank 0 aborted: the test is over"), std::string::npos) << later;
  });
}

// A token holder that floods a target with getv requests and reads no answer: the target stops reading that
// channel once its answers queue up (its memory stays bounded), and serves the other ranks meanwhile.
TEST(OneSided, AFloodOfUnreadAnswersKeepsTheTargetsMemoryBounded) {
  constexpr size_t kBig = 8 << 20;
  run_threads(3, [](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 3, store, test_options({{"log", "error"}}));
    std::vector<uint8_t> mine(kBig, static_cast<uint8_t>(r + 1));
    comm.register_region(mine.data(), mine.size(), DataType::u8);
    comm.barrier()->wait();
    if (r == 2) {
      const size_t before = resident_bytes();
      RawChannel ch = raw_channel(*store, 1, 2, 3);
      // 100 requests for 8 MiB each: 800 MiB of answers if the target took them all.
      const RemotePiece all{0, kBig};
      rma::Header h;
      h.kind = static_cast<uint8_t>(rma::Kind::get);
      h.npieces = 1;
      h.region = 1;
      std::string requests;
      for (int i = 0; i < 100; ++i) {
        h.id = static_cast<uint64_t>(i + 1);
        requests.append(reinterpret_cast<const char*>(&h), sizeof h);
        requests.append(reinterpret_cast<const char*>(&all), sizeof all);
      }
      net::send_all(ch.fd.get(), requests.data(), requests.size(), net::Clock::now() + std::chrono::seconds(10),
                    "requests");
      std::this_thread::sleep_for(std::chrono::seconds(1));
      const size_t grown = resident_bytes() - std::min(before, resident_bytes());
      EXPECT_LT(grown, size_t{100} << 20) << "the target grew by " << (grown >> 20) << " MiB";
    }
    if (r == 0) {  // served while the flood waits
      std::vector<uint8_t> got(kBig);
      const LocalPiece local{got.data(), got.size()};
      const RemotePiece all{0, kBig};
      for (int i = 0; i < 3; ++i) {
        comm.getv(region_of(1, 1, DataType::u8, kBig), {&all, 1}, {&local, 1})->wait();
        EXPECT_EQ(got, std::vector<uint8_t>(kBig, 2));
      }
    }
    comm.barrier()->wait();
  });
}

// Connections that send no hello are capped: at most kMaxPendingHellos wait for theirs (5 s each); the rest wait
// in the listener's backlog, unaccepted, until those are dropped.
TEST(OneSided, PendingHellosAreCapped) {
  with_float_regions([](int r, Store& store, Communicator&) {
    if (r != 0) return;
    const std::string published = store.get(rma_key(store, 1, 2), std::chrono::seconds(5));
    const std::string addr = published.substr(0, published.find(' '));
    const auto colon = addr.rfind(':');
    const net::Endpoint at{addr.substr(0, colon), static_cast<uint16_t>(std::stoi(addr.substr(colon + 1)))};
    std::vector<net::Fd> silent;
    const auto start = net::Clock::now();
    for (size_t i = 0; i < rma::kMaxPendingHellos + 36; ++i)
      silent.push_back(net::connect_to(at, net::Clock::now() + std::chrono::seconds(5)));
    const auto dropped = [&] {
      size_t n = 0;
      for (const net::Fd& fd : silent) {
        char byte;
        n += ::recv(fd.get(), &byte, 1, MSG_DONTWAIT) == 0;
      }
      return n;
    };
    // The first ones go after their 5 s, all at once; the next ones are taken only then, so theirs end 5 s
    // later: a second after the first drop, none of them has gone (without the cap, all would have).
    size_t first = 0;
    while ((first = dropped()) < rma::kMaxPendingHellos && net::Clock::now() < start + std::chrono::seconds(9))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(first, rma::kMaxPendingHellos);
    std::this_thread::sleep_for(std::chrono::seconds(1));
    EXPECT_EQ(dropped(), rma::kMaxPendingHellos) << "the connections beyond the cap did not wait for their own 5 s";
  });
}

// A request whose bytes stop coming (a put header claiming a large payload, then silence) is not held
// forever: the target closes the channel after the timeout knob.
TEST(OneSided, AHalfSentRequestIsDroppedAfterTheTimeout) {
  std::atomic<bool> done{false};
  run_threads(2, [&](int r, std::shared_ptr<Store> store) {
    Communicator comm(r, 2, store, test_options({{"log", "error"}, {"timeout", "1"}}));
    std::vector<uint8_t> mine(1 << 20);
    comm.register_region(mine.data(), mine.size(), DataType::u8);
    comm.barrier()->wait();
    if (r == 0) {
      RawChannel ch = raw_channel(*store, 1, 0, 2);
      const RemotePiece all{0, mine.size()};
      rma::Header h;
      h.kind = static_cast<uint8_t>(rma::Kind::put);
      h.npieces = 1;
      h.region = 1;
      h.id = 1;
      h.payload = all.bytes;
      std::string request(reinterpret_cast<const char*>(&h), sizeof h);
      request.append(reinterpret_cast<const char*>(&all), sizeof all);
      request.append(100, 'x');
      const auto start = net::Clock::now();
      net::send_all(ch.fd.get(), request.data(), request.size(), start + std::chrono::seconds(5), "request");
      expect_closed(ch.fd.get(), "a half-sent put");
      const double waited = std::chrono::duration<double>(net::Clock::now() - start).count();
      EXPECT_GT(waited, 0.8);
      EXPECT_LT(waited, 4.0);
      done = true;
    }
    // No collective meanwhile: it would time out too. Rank 1 keeps its server up until rank 0 has seen it act.
    while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  });
}

// Closing with calls in flight: each finishes, served (bit for bit) or failed naming the close; none hangs,
// and a later call is refused. Deregistering from another thread while closing returns only once the server
// touches the region no more (AddressSanitizer sees the buffer freed right after).
TEST(OneSided, ClosingWithCallsInFlightAndDeregisteringMeanwhile) {
  run_ranks(2, [](Communicator& comm) {
    auto mine = std::make_unique<std::vector<uint8_t>>(pattern(comm.rank()));
    const uint64_t id = comm.register_region(mine->data(), kRegion, DataType::u8);
    comm.barrier()->wait();
    const auto want = pattern(1 - comm.rank());
    std::vector<std::vector<uint8_t>> bufs(8, std::vector<uint8_t>(kRegion));
    std::vector<std::shared_ptr<Request>> reqs;
    const RemotePiece all{0, kRegion};
    for (auto& b : bufs) {
      const LocalPiece local{b.data(), b.size()};
      reqs.push_back(comm.getv(region_of(1 - comm.rank(), id), {&all, 1}, {&local, 1}));
    }
    comm.barrier()->wait();  // both channels are open: the peer's close may come while its calls are served
    std::thread deregister([&] {
      comm.deregister_region(id);
      mine.reset();
    });
    comm.close();
    deregister.join();
    for (size_t i = 0; i < reqs.size(); ++i) {
      try {
        ASSERT_TRUE(reqs[i]->wait(std::chrono::seconds(10))) << "call " << i << " never finished";
        EXPECT_EQ(bufs[i], want) << "call " << i;
      } catch (const CommError& e) {
        const std::string what = e.what();
        // This rank's close, or the peer's (a reset when it closed with requests unread).
        EXPECT_TRUE(what.find("the communicator was closed") != std::string::npos ||
                    what.find("closed by that rank") != std::string::npos ||
                    what.find("broke while") != std::string::npos ||
                    what.find("was deregistered") != std::string::npos) << what;
      }
    }
    const LocalPiece local{bufs[0].data(), kRegion};
    EXPECT_THROW(comm.getv(region_of(1 - comm.rank(), id), {&all, 1}, {&local, 1}), InvalidArgument);
  });
}

TEST(OneSided, ATargetThatRegisteredNothingIsNamed) {
  run_ranks(2, [](Communicator& comm) {
    if (comm.rank() == 0) {
      const std::string what = getv_error(comm);
      EXPECT_NE(what.find("rank 1 serves no one-sided operations"), std::string::npos) << what;
    }
    comm.barrier()->wait();
  }, test_options({{"connect_timeout", "3"}}));
}

}  // namespace
}  // namespace smartcoll
