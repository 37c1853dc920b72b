// The gather and scatter kernels (kernels/copy.h): byte for byte what a loop of memcpy gives, for pieces of every
// size and alignment, empty ones with no address, below and above the size where streaming stores take over.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "kernels/copy.h"

namespace smartcoll::kernels {
namespace {

struct Layout {
  std::vector<std::pair<char*, size_t>> pieces;
  size_t total = 0;
};

// Pieces of 0-300 bytes at random offsets (any alignment, in random order, not overlapping) in `region`, until
// `want` bytes; every 7th piece empty with no address.
Layout random_layout(std::vector<char>& region, size_t want, unsigned seed) {
  std::mt19937 gen(seed);
  Layout l;
  std::vector<size_t> starts;
  for (size_t at = 0; l.total < want;) {
    const size_t len = std::uniform_int_distribution<size_t>(1, 300)(gen);
    const size_t gap = std::uniform_int_distribution<size_t>(0, 40)(gen);
    if (at + gap + len > region.size()) break;
    starts.push_back(at + gap);
    l.pieces.push_back({region.data() + at + gap, len});
    l.total += len;
    at += gap + len;
    if (l.pieces.size() % 7 == 0) l.pieces.push_back({nullptr, 0});
  }
  std::shuffle(l.pieces.begin(), l.pieces.end(), gen);
  return l;
}

void fill(std::vector<char>& v, unsigned seed) {
  std::mt19937 gen(seed);
  for (char& c : v) c = static_cast<char>(gen());
}

class Copy : public ::testing::TestWithParam<size_t> {};

TEST_P(Copy, GatherAndScatterMatchAMemcpyLoop) {
  const size_t want = GetParam();
  std::vector<char> region(want * 3 / 2 + 4096);
  fill(region, 1);
  const Layout l = random_layout(region, want, 2);
  ASSERT_GE(l.total, want);
  const auto at = [&](size_t k) { return l.pieces[k]; };

  std::vector<char> expect(l.total + 1), got(l.total + 1, 0);
  size_t off = 0;
  for (const auto& [p, n] : l.pieces) {
    if (n) std::memcpy(expect.data() + off, p, n);
    off += n;
  }
  // One byte in, so that the destination is not aligned either.
  gather(got.data() + 1, l.pieces.size(), at, l.total);
  ASSERT_EQ(0, std::memcmp(expect.data(), got.data() + 1, l.total));

  // Scatter other bytes back into the pieces: every piece's bytes change, the gaps keep theirs.
  std::vector<char> src(l.total + 1), before = region;
  fill(src, 3);
  scatter(src.data() + 1, l.pieces.size(), at, l.total);
  std::vector<char> want_region = before;
  off = 0;
  for (const auto& [p, n] : l.pieces) {
    if (n) std::memcpy(want_region.data() + (p - region.data()), src.data() + 1 + off, n);
    off += n;
  }
  ASSERT_EQ(0, std::memcmp(want_region.data(), region.data(), region.size()));
}

// Below and above kStreamBytes: plain and streaming stores.
INSTANTIATE_TEST_SUITE_P(Sizes, Copy, ::testing::Values(size_t{1} << 10, size_t{1} << 20, kStreamBytes + 4097));

TEST(Copy, NoPiecesTouchNothing) {
  const auto none = [](size_t) { return std::pair<char*, size_t>{nullptr, 0}; };
  gather(nullptr, 0, none, 0);
  scatter(nullptr, 3, none, 0);
}

}  // namespace
}  // namespace smartcoll::kernels
