// Recursive doubling reads its input where it lies and reduces its last step into the output: out of place and
// in place must give the same bits, on every rank, for folded (non-power-of-two) worlds too, and leave the input
// of an out-of-place call alone.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ranks.h"
#include "smartcoll/comm.h"

namespace smartcoll {
namespace {

TEST(RecursiveDoubling, InPlaceAndOutOfPlaceGiveTheSameBitsOnEveryRank) {
  const size_t count = 1001;
  for (int n : {2, 3, 5, 6}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
      std::vector<std::vector<float>> results(static_cast<size_t>(n));
      harness::run_ranks(n, [&](Communicator& comm) {
        const std::vector<float> x = harness::noise(comm.rank(), count);
        std::vector<float> in = x, out(count, NAN), same = x;
        comm.allreduce(in.data(), out.data(), count, DataType::f32, op, Algorithm::rd)->wait();
        comm.allreduce(same.data(), same.data(), count, DataType::f32, op, Algorithm::rd)->wait();
        ASSERT_EQ(in, x) << "the out-of-place call wrote into its input (n " << n << ")";
        ASSERT_EQ(0, std::memcmp(out.data(), same.data(), count * sizeof(float)))
            << "in place and out of place differ (n " << n << ")";
        results[static_cast<size_t>(comm.rank())] = out;
      });
      for (size_t i = 0; i < count; ++i) {
        double want = 0;
        for (int r = 0; r < n; ++r) want += harness::noise(r, count)[i];
        if (op == ReduceOp::avg) want /= n;
        ASSERT_NEAR(results[0][i], want, 1e-5) << "n " << n << " element " << i;
        for (int r = 1; r < n; ++r)
          ASSERT_EQ(std::memcmp(&results[0][i], &results[static_cast<size_t>(r)][i], sizeof(float)), 0)
              << "rank " << r << " differs from rank 0 at element " << i << " (n " << n << ")";
      }
    }
  }
}

}  // namespace
}  // namespace smartcoll
