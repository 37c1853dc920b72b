// Tests for the cost model (src/coll/cost.h): hand-worked times, the FPGA smart-NIC paper's equations with its own
// parameters, the DPDK paper's switch bound, auto's choices with a profile, and malformed profiles.
#include "coll/cost.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>

#include "smartcoll/codec.h"

namespace smartcoll::coll {
namespace {

// A profile where only the link and the latency cost anything, unless a test says otherwise.
Profile link_only(double alpha, double link_Bps) {
  Profile p = Profile::builtin();
  p.alpha_algo.clear();
  p.efficiency_algo.clear();
  p.alpha_s = alpha;
  p.link_Bps = link_Bps;
  p.link_efficiency = 1;
  p.reduce_Bps = p.mem_Bps = p.copy_Bps = 1e30;
  p.codecs["bfp16"] = {1e30, 1e30};
  return p;
}

Query call(int n, double bytes) { return Query{n, static_cast<size_t>(bytes), false, false, false}; }

constexpr double kMiB = 1 << 20;

TEST(CostModel, RingAllreduceHandWorked) {
  const Profile p = link_only(1e-4, 1e8);
  const Cost k = predict(Collective::allreduce, Algorithm::ring, call(4, 64 * kMiB), p);
  // 2(n-1) = 6 steps; 2(n-1)/n = 1.5 of the vector on the busiest link.
  EXPECT_DOUBLE_EQ(k.steps, 6);
  EXPECT_DOUBLE_EQ(k.wire_bytes, 1.5 * 64 * kMiB);
  EXPECT_NEAR(k.total, 6e-4 + 1.5 * 64 * kMiB / 1e8, 1e-12);
  EXPECT_EQ(k.bound, "link");
  // One rank: nothing to do.
  EXPECT_EQ(predict(Collective::allreduce, Algorithm::ring, call(1, kMiB), p).total, 0);
}

TEST(CostModel, HierarchicalHandWorked) {
  Profile p = link_only(1e-4, 1e8);
  p.copy_Bps = 1e9;
  Query q = call(8, 4 * kMiB);  // 4 hosts x 2 ranks
  q.hosts = 4, q.per_host = 2;
  // allreduce: 2(k-1) + 2(H-1) = 8 steps; the host's link carries 2(H-1)/H = 1.5 vectors; each rank copies
  // 2(k-1)/k of the vector through the host's connections. In 2 pieces of 2 MiB, half the copies (the first
  // piece's reduce-scatter, the last one's allgather) are not overlapped with the link; the other half are.
  const Cost ar = predict(Collective::allreduce, Algorithm::hier, q, p);
  EXPECT_DOUBLE_EQ(ar.steps, 8);
  EXPECT_DOUBLE_EQ(ar.wire_bytes, 1.5 * 4 * kMiB);
  EXPECT_NEAR(ar.total, 8e-4 + 1.5 * 4 * kMiB / 1e8 + 0.5 * 4 * kMiB / 1e9, 1e-12);
  // One piece (under 4 MiB): none overlapped.
  Query small = call(8, 2 * kMiB);
  small.hosts = 4, small.per_host = 2;
  EXPECT_NEAR(predict(Collective::allreduce, Algorithm::hier, small, p).total,
              8e-4 + 1.5 * 2 * kMiB / 1e8 + 2 * kMiB / 1e9, 1e-12);
  // allgather and reduce_scatter (4 MiB per rank's block): (H-1) + H(k-1) = 7 steps; the link carries the
  // k(H-1) = 6 blocks the host's ranks get from (or send to) the other hosts, against the flat ring's n-1 = 7;
  // H(k-1) = 4 blocks go through the host's connections.
  for (Collective c : {Collective::allgather, Collective::reduce_scatter}) {
    const Cost k = predict(c, Algorithm::hier, q, p);
    EXPECT_DOUBLE_EQ(k.steps, 7) << collective_name(c);
    EXPECT_DOUBLE_EQ(k.wire_bytes, 6 * 4 * kMiB) << collective_name(c);
    EXPECT_NEAR(k.total, 7e-4 + 6 * 4 * kMiB / 1e8 + 4 * 4 * kMiB / 1e9, 1e-12) << collective_name(c);
    EXPECT_DOUBLE_EQ(predict(c, Algorithm::ring, q, p).wire_bytes, 7 * 4 * kMiB) << collective_name(c);
  }
  // broadcast: two chains, (H-1) + (k-1) = 4 steps to fill; the vector crosses the link once, and the copies on
  // the host overlap it.
  const Cost bc = predict(Collective::broadcast, Algorithm::hier, q, p);
  EXPECT_DOUBLE_EQ(bc.steps, 4);
  EXPECT_DOUBLE_EQ(bc.wire_bytes, 4 * kMiB);
  EXPECT_NEAR(bc.total, 4e-4 + 4 * kMiB / 1e8, 1e-12);
}

TEST(CostModel, HierarchicalSwitchHandWorked) {
  Profile p = link_only(1e-4, 1e8);
  p.copy_Bps = 1e9;
  p.alpha_algo["switch"] = 3e-4;
  p.switch_Bps = 1e30;
  Query q = call(8, 4 * kMiB);  // 4 hosts x 2 ranks
  q.hosts = 4, q.per_host = 2;
  q.switch_set = true;
  // A round trip through the switches (2 steps at the switch's alpha) and the 2(k-1) = 2 steps of the host's
  // reduce-scatter and allgather (at hier's); the host's link carries the vector once, half from each rank,
  // against 2(H-1)/H = 1.5 times for hier; the host's copies 2(k-1)/k of the vector first.
  const Cost k = predict(Collective::allreduce, Algorithm::switch_hier, q, p);
  EXPECT_DOUBLE_EQ(k.steps, 2);
  EXPECT_DOUBLE_EQ(k.wire_bytes, 4 * kMiB);
  EXPECT_NEAR(k.total, 2 * 3e-4 + 2 * 1e-4 + 4 * kMiB / 1e8 + 4 * kMiB / 1e9, 1e-12);
  EXPECT_LT(k.total, predict(Collective::allreduce, Algorithm::hier, q, p).total);
  // The flat switch: both of a host's ranks send their vector over its link.
  const Cost flat = predict(Collective::allreduce, Algorithm::switch_, q, p);
  EXPECT_DOUBLE_EQ(flat.wire_bytes, 2 * 4 * kMiB);
  EXPECT_NEAR(flat.link, 2 * 4 * kMiB / 1e8, 1e-12);
  EXPECT_EQ(choose(Collective::allreduce, q, Algorithm::automatic, 0, &p), Algorithm::switch_hier);
  // A switch that is a host takes the vector from each of the 4 hosts over its one link (not from each of the 8
  // ranks, as the flat switch's does).
  p.switch_link_Bps = 1e8;
  EXPECT_NEAR(predict(Collective::allreduce, Algorithm::switch_hier, q, p).link, 4 * 4 * kMiB / 1e8, 1e-12);
  EXPECT_NEAR(predict(Collective::allreduce, Algorithm::switch_, q, p).link, 8 * 4 * kMiB / 1e8, 1e-12);
  // (the flat switch's own link term, 2 vectors, is below the switch's 8 here)
  // With a codec each rank encodes and decodes its half alone.
  p.switch_link_Bps = 0;
  p.codecs["bfp16"] = {1e9, 1e9};
  const Cost c = predict(Collective::allreduce, Algorithm::switch_hier, q, p, "bfp16");
  EXPECT_NEAR(c.codec, 4 * kMiB * 2 / 1e9 / 2, 1e-12);
  EXPECT_NEAR(c.wire_bytes, 4 * kMiB / Codec::parse("bfp16").ratio(), 1e-6);
}

// auto without a profile, several ranks per host: the hierarchical ring, or through the switches where one is set
// and the built-in model predicts it faster (from 3 hosts on); never on one host or with hosts of unequal size.
TEST(CostModel, AutoTakesTheSwitchHierarchicallyFromThreeHosts) {
  auto pick = [](int hosts, bool switch_set, int per_host = 2) {
    Query q = call(hosts * 2, 16 * kMiB);
    q.hosts = hosts, q.per_host = per_host, q.switch_set = switch_set;
    return choose(Collective::allreduce, q, Algorithm::automatic, 262144);
  };
  EXPECT_EQ(pick(4, true), Algorithm::switch_hier);
  EXPECT_EQ(pick(8, true), Algorithm::switch_hier);
  EXPECT_EQ(pick(2, true), Algorithm::hier);
  EXPECT_EQ(pick(4, false), Algorithm::hier);
  EXPECT_EQ(pick(4, true, 0), Algorithm::switch_);  // unequal hosts: the flat switch
  Query one_host = call(4, 16 * kMiB);
  one_host.hosts = 1, one_host.per_host = 4, one_host.switch_set = true;
  try {
    choose(Collective::allreduce, one_host, Algorithm::switch_hier, 262144);
    FAIL() << "switch_hier on one host";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("several hosts"), std::string::npos) << e.what();
  }
}

TEST(CostModel, FoldOnlyOffPowersOfTwo) {
  // rhd and rd run among the largest power of two p <= n; n - p extra ranks fold in: 2 more steps, 1 more vector.
  const Profile p = link_only(1, 1e30);
  auto steps = [&](Algorithm a, int n) { return predict(Collective::allreduce, a, call(n, kMiB), p).steps; };
  auto wire = [&](Algorithm a, int n) { return predict(Collective::allreduce, a, call(n, kMiB), p).wire_bytes / kMiB; };
  EXPECT_EQ(steps(Algorithm::rhd, 4), 4);
  EXPECT_DOUBLE_EQ(wire(Algorithm::rhd, 4), 1.5);
  EXPECT_EQ(steps(Algorithm::rhd, 6), 2 * 2 + 2);
  EXPECT_DOUBLE_EQ(wire(Algorithm::rhd, 6), 1.5 + 1);
  EXPECT_EQ(steps(Algorithm::rd, 8), 3);
  EXPECT_DOUBLE_EQ(wire(Algorithm::rd, 8), 3);
  EXPECT_EQ(steps(Algorithm::rd, 5), 2 + 2);
  EXPECT_DOUBLE_EQ(wire(Algorithm::rd, 5), 2 + 1);
}

TEST(CostModel, BruckAlltoallTradesBytesForSteps) {
  // n = 8: 3 steps; slots 1..7 hold 1+1+2+1+2+2+3 = 12 set bits, so 12 blocks leave each rank (direct: 7 blocks,
  // one message each, all in flight at once: one step). n = 5: slots 1..4 hold 1+1+2+1 = 5 bits, 3 steps.
  const Profile p = link_only(1e-4, 1e8);
  const Cost bruck = predict(Collective::alltoall, Algorithm::bruck, call(8, 1024), p);
  EXPECT_DOUBLE_EQ(bruck.steps, 3);
  EXPECT_DOUBLE_EQ(bruck.wire_bytes, 12 * 1024);
  EXPECT_NEAR(bruck.total, 3e-4 + 12 * 1024 / 1e8, 1e-12);
  const Cost direct = predict(Collective::alltoall, Algorithm::direct, call(8, 1024), p);
  EXPECT_DOUBLE_EQ(direct.steps, 1);
  EXPECT_DOUBLE_EQ(direct.wire_bytes, 7 * 1024);
  EXPECT_DOUBLE_EQ(predict(Collective::alltoall, Algorithm::bruck, call(5, 1024), p).steps, 3);
  EXPECT_DOUBLE_EQ(predict(Collective::alltoall, Algorithm::bruck, call(5, 1024), p).wire_bytes, 5 * 1024);
  // auto never picks them from a profile, even where their entries come out cheaper (steps dear, one-byte blocks;
  // a profile that makes Bruck's steps nearly free).
  Profile cheap_bruck = link_only(1, 1e30);
  cheap_bruck.alpha_algo["bruck"] = 1e-9;
  EXPECT_LT(predict(Collective::alltoall, Algorithm::bruck, call(8, 1), cheap_bruck).total,
            predict(Collective::alltoall, Algorithm::direct, call(8, 1), cheap_bruck).total);
  EXPECT_EQ(choose(Collective::alltoall, call(8, 1), Algorithm::automatic, 0, &cheap_bruck), Algorithm::direct);
}

TEST(CostModel, PerAlgorithmLatencyAndEfficiency) {
  Profile p = link_only(1e-4, 1e8);
  p.alpha_algo["rhd"] = 3e-4;
  p.efficiency_algo["rhd"] = 0.5;
  const Cost rhd = predict(Collective::allreduce, Algorithm::rhd, call(4, 64 * kMiB), p);
  EXPECT_NEAR(rhd.total, 4 * 3e-4 + 1.5 * 64 * kMiB / (0.5 * 1e8), 1e-9);
  const Cost ring = predict(Collective::allreduce, Algorithm::ring, call(4, 64 * kMiB), p);
  EXPECT_NEAR(ring.total, 6 * 1e-4 + 1.5 * 64 * kMiB / 1e8, 1e-9);  // the others keep alpha_s and link_efficiency
}

TEST(CostModel, SlowestPipelinedTermBounds) {
  Profile p = link_only(0, 1e8);
  p.reduce_Bps = 1e7;  // adding (n-1)/n of the vector at 10 MB/s is slower than the link
  const Cost k = predict(Collective::allreduce, Algorithm::ring, call(4, 8 * kMiB), p);
  EXPECT_EQ(k.bound, "reduce");
  EXPECT_NEAR(k.total, 0.75 * 8 * kMiB / 1e7, 1e-9);
  p.reduce_Bps = 1e30;
  p.mem_Bps = 1e7;  // reading and writing the caller's buffer: 2 S
  EXPECT_NEAR(predict(Collective::allreduce, Algorithm::ring, call(4, 8 * kMiB), p).total, 2 * 8 * kMiB / 1e7, 1e-9);
}

TEST(CostModel, CodecShrinksTheWireAndCostsItsRates) {
  Profile p = link_only(0, 1e8);
  const double ratio = Codec::parse("bfp16").ratio();
  const Cost k = predict(Collective::allreduce, Algorithm::ring, call(4, 64 * kMiB), p, "bfp16");
  EXPECT_NEAR(k.link, 1.5 * 64 * kMiB / ratio / 1e8, 1e-9);
  p.codecs["bfp16"] = {1e8, 2e8};  // every hop encodes what it sends and decodes what it receives
  p.cores = 2;
  const Cost slow = predict(Collective::allreduce, Algorithm::ring, call(4, 64 * kMiB), p, "bfp16");
  EXPECT_NEAR(slow.codec, 1.5 * 64 * kMiB * (1 / 1e8 + 1 / 2e8) / 2, 1e-9);
  EXPECT_EQ(slow.bound, "codec");
  p.codecs.clear();
  try {
    predict(Collective::allreduce, Algorithm::ring, call(4, kMiB), p, "bfp16");
    FAIL() << "a codec without rates was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no rates for codec 'bfp16'"), std::string::npos) << e.what();
  }
}

// Sec. IV-C of the FPGA smart-NIC paper with its parameters: 2048 x 2048 layers, float32 gradients (b = 32), 40
// Gbit/s links used fully (alpha = 1), BFP16 (8-bit shared exponent, 7-bit mantissas, blocks of 16).
constexpr double kM = 2048, kEth = 40e9 / 8;

TEST(CostModel, PaperBfp16Ratio) {
  // "BFP16 ... achieves 3.8x compression ratio": 16 x 32 bits in 8 + 16 x 8 bits.
  EXPECT_NEAR(Codec::parse("bfp16").ratio(), 3.8, 0.05);
}

TEST(CostModel, PaperRingAndMemTerms) {
  const int N = 6;
  const double b = 32;
  const double R = b * N * std::ceil(kM * kM / N);  // bits per node, padded to N chunks
  const double beta = Codec::parse("bfp16").ratio();
  const double t_ring = R * 2 * (N - 1) / (N * kEth * 8);
  const double t_ring_bfp = t_ring / beta;
  Profile p = link_only(0, kEth);
  const Query q = call(N, 4 * kM * kM);
  // The padding of R is 2 elements in 4M: within 1e-6.
  EXPECT_NEAR(predict(Collective::allreduce, Algorithm::ring, q, p).total / t_ring, 1, 1e-6);
  EXPECT_NEAR(predict(Collective::allreduce, Algorithm::ring, q, p, "bfp16").total / t_ring_bfp, 1, 1e-6);
  EXPECT_NEAR(t_ring, 5.59e-3, 0.01e-3);  // 16 MiB per layer, 5/3 of it each way at 5 GB/s
  // T_mem = 2 R / BW_pcie (PCIe Gen3 x8, about 7.9 GB/s), and T_AR = max(T_ring, T_add, T_mem).
  p.mem_Bps = 7.88e9;
  const double t_mem = 2 * R / 8 / p.mem_Bps;
  const Cost k = predict(Collective::allreduce, Algorithm::ring, q, p, "bfp16");
  EXPECT_NEAR(k.mem / t_mem, 1, 1e-6);
  EXPECT_NEAR(k.total / std::max(t_ring_bfp, t_mem), 1, 1e-6);
  EXPECT_EQ(k.bound, "mem");
}

// P_Worker is not printed in the paper; 2 TFLOP/s (a 28-core Xeon 8280 on float32 GEMMs) is this test's assumption.
Profile paper_profile() {
  Profile p = link_only(0, kEth);
  p.flops = 2e12;
  p.update_s_per_byte = 1e-11;
  return p;
}

TEST(CostModel, PaperIterationFormula) {
  const Profile p = paper_profile();
  const std::vector<double> layers(20, kM * kM);
  const double B = 448, N = 6;
  const IterationCost it = iteration(layers, B, N, Algorithm::ring, "", p);
  const double F = 2 * kM * kM * B / p.flops, Bw = 4 * kM * kM * B / p.flops, U = 4 * kM * kM * 1e-11;
  const double AR = 4 * kM * kM * 2 * (N - 1) / N / kEth;
  // T_total = sum T_F + T_B,L + max(T_B,L-1, T_AR,L) + sum_{l=2}^{L-1} max(T_U,l+1 + T_B,l-1, T_AR,l)
  //           + max(T_U,2, T_AR,1) + T_U,1
  const double expected = 20 * F + Bw + std::max(Bw, AR) + 18 * std::max(U + Bw, AR) + std::max(U, AR) + U;
  EXPECT_NEAR(it.total, expected, 1e-9);
  EXPECT_NEAR(it.fwd, 20 * F, 1e-12);
  EXPECT_NEAR(it.exposed, expected - 20 * F - 20 * Bw - 20 * U, 1e-9);
  // One layer: no overlap at all.
  const IterationCost one = iteration({kM * kM}, B, N, Algorithm::ring, "", p);
  EXPECT_NEAR(one.total, F + Bw + AR + U, 1e-12);
}

TEST(CostModel, MeasuredComputeReplacesTheGemmModel) {
  // Two layers of 1e6 and 3e6 parameters: the measured phases split 1:3 between them, whatever the profile's
  // GEMM rate, compute_scale and error feedback; only the all-reduce and its overlap remain the model's.
  Profile p = link_only(0, 1e9);
  p.flops = 1e12;
  p.codecs["bfp16"] = {10e9, 40e9};
  const std::vector<double> layers = {1e6, 3e6};
  const MeasuredCompute m{0.040, 0.080, 0.008};
  const IterationCost it = iteration(layers, 64, 4, Algorithm::ring, "bfp16", p, 2, true, &m);
  EXPECT_NEAR(it.fwd, 0.040, 1e-12);
  EXPECT_NEAR(it.bwd, 0.080, 1e-12);
  EXPECT_NEAR(it.update, 0.008, 1e-12);
  EXPECT_EQ(it.feedback, 0);
  ASSERT_EQ(it.layer_allreduce.size(), 2u);
  const double ar1 = it.layer_allreduce[0], ar2 = it.layer_allreduce[1];
  EXPECT_GT(ar2, 2.9 * ar1);  // 3x the bytes on the same link
  // T = sum F + B_2 + max(B_1, AR_2) + max(U_2, AR_1) + U_1, with B_1 = 0.02, B_2 = 0.06, U_1 = 0.002, U_2 = 0.006.
  EXPECT_NEAR(it.total, 0.040 + 0.060 + std::max(0.020, ar2) + std::max(0.006, ar1) + 0.002, 1e-12);
  // The same call without measured phases uses the GEMM model: another forward time.
  EXPECT_NEAR(iteration(layers, 64, 4, Algorithm::ring, "bfp16", p).fwd, 2 * 4e6 * 64 / 1e12, 1e-15);
}

TEST(CostModel, ErrorFeedbackLengthensTheBackwardPass) {
  Profile p = link_only(0, 1e9);
  p.flops = 1e12;
  p.mem_Bps = 20e9;
  p.codecs["bfp16"] = {10e9, 40e9};
  const std::vector<double> layers(3, 1e6);
  const IterationCost plain = iteration(layers, 64, 4, Algorithm::ring, "bfp16", p);
  const IterationCost ef = iteration(layers, 64, 4, Algorithm::ring, "bfp16", p, 2, true);
  const IterationCost ef1 = iteration(layers, 64, 4, Algorithm::ring, "bfp16", p, 1, true);
  // Per layer: 4 MB encoded (10 GB/s), decoded (40 GB/s) and passed over 7.5 times (20 GB/s), on a worker that
  // computes at half speed (compute_scale 2).
  const double per_layer = 4e6 * (1 / 10e9 + 1 / 40e9 + 7.5 / 20e9);
  EXPECT_NEAR(ef1.feedback, 3 * per_layer, 1e-12);
  EXPECT_NEAR(ef.feedback, 2 * 3 * per_layer, 1e-12);
  EXPECT_NEAR(ef1.bwd - plain.bwd, 3 * per_layer, 1e-12);
  EXPECT_GT(ef1.total, plain.total);
  // Nothing to compensate without compression or with one worker.
  EXPECT_EQ(iteration(layers, 64, 4, Algorithm::ring, "", p, 1, true).feedback, 0);
  EXPECT_EQ(iteration(layers, 64, 1, Algorithm::ring, "bfp16", p, 1, true).feedback, 0);
  // A profile without the codec's rates says how to get them.
  p.codecs.clear();
  try {
    iteration(layers, 64, 4, Algorithm::ring, "bfp16", p, 1, true);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("smartcoll model calibrate --codecs bfp16"), std::string::npos) << e.what();
  }
}

// Compute and an all-reduce on shared cores, as a fair scheduler runs them (hand-worked, milliseconds).
TEST(CostModel, ASharedWindowGivesTheAllreduceAtMostHalfTheCoresWhileTheComputeRuns) {
  // No CPU in the all-reduce, or under half the cores: the longer of compute + CPU time and the all-reduce.
  EXPECT_NEAR(shared_window(10, 52, 0), 52, 1e-9);
  EXPECT_NEAR(shared_window(10, 52, 20), 52, 1e-9);   // needs 20/52 < 1/2: never slowed
  EXPECT_NEAR(shared_window(40, 52, 20), 60, 1e-9);   // compute 40 + CPU 20 outlasts the all-reduce
  // Needs 32/52 of the cores, gets 1/2 while the compute (10 ms of work) runs at 1/2: the compute ends at 20 ms,
  // the all-reduce has done 20 x (1/2) / (32/52) = 16.25 ms of its 52 and runs the other 35.75 alone.
  EXPECT_NEAR(shared_window(10, 52, 32), 20 + 52 - 16.25, 1e-9);
  // Needs 42/52: halved, it would end at 52 x (42/52) / (1/2) = 84 ms; the compute (60 ms of work) does 42 by
  // then and its other 18 alone.
  EXPECT_NEAR(shared_window(60, 52, 42), 84 + 18, 1e-9);
  // CPU-bound (more CPU time than link time): every demand on the cores adds up.
  EXPECT_NEAR(shared_window(10, 6, 24), 34, 1e-9);
  EXPECT_NEAR(shared_window(0, 6, 24), 24, 1e-9);
  // Exactly the bound where the all-reduce needs at most half (no rounding: contention stays 0), and no NaN from
  // an endless all-reduce or a CPU time too small to divide by.
  EXPECT_EQ(shared_window(10, 52, 26), 52);
  EXPECT_EQ(shared_window(1, 10, 5e-324), 10);
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(shared_window(1, inf, 1), inf);
  EXPECT_EQ(shared_window(1, 10, inf), inf);
}

// A rank's all-reduce costs it CPU time: its reductions at one core's rate and its bytes on the busiest link at
// wire_cpu_s_per_byte. Where compute and all-reduce share the rank's cores, each overlapped window lasts at least
// the compute plus that CPU time over the cores; with cores set aside for the engine the compute runs on the rest.
TEST(CostModel, SharedCoresStretchTheComputeAnAllreduceOverlaps) {
  Profile p = link_only(0, 1e9);
  p.flops = 1e12;
  p.update_s_per_byte = 1e-11;
  p.reduce_Bps = 10e9;
  p.wire_cpu_s_per_byte = 2e-9;
  const double e = 1e6, S = 4 * e;  // 1e6 parameters a layer, 4 MB of gradient
  const Cost k = predict(Collective::allreduce, Algorithm::ring, call(4, S), p);
  // The ring at N = 4: 1.5 S on the busiest link, 0.75 S reduced.
  EXPECT_NEAR(k.cpu, 0.75 * S / 10e9 + 1.5 * S * 2e-9, 1e-12);
  const double AR = 1.5 * S / 1e9, F = 2 * e * 64 / 1e12, B = 2 * F, U = 1e-11 * S;
  const std::vector<double> layers(3, e);
  // The paper's model: the all-reduce takes nothing from the compute (AR = 6 ms hides B and U).
  const IterationCost paper = iteration(layers, 64, 4, Algorithm::ring, "", p);
  EXPECT_NEAR(paper.total, 3 * F + B + 3 * AR + U, 1e-12);
  EXPECT_EQ(paper.contention, 0);
  // Half a core per rank (4 ranks on 2 cores): C = 2 x 12.3 ms of CPU per layer stretches every window.
  const double C = k.cpu / 0.5;
  auto w = [&](double compute) { return std::max(compute + C, AR); };
  const IterationCost shared = iteration(layers, 64, 4, Algorithm::ring, "", p, 1, false, nullptr, {0.5, 0});
  EXPECT_NEAR(shared.total, 3 * F + B + w(B) + w(U + B) + w(U) + U, 1e-12);
  EXPECT_NEAR(shared.contention, shared.total - paper.total, 1e-12);
  EXPECT_NEAR(shared.exposed, shared.total - 3 * (F + B + U), 1e-12);
  // Two cores, one of them the engine's: compute at half speed, no contention, and the all-reduce takes at least
  // its 12.3 ms of CPU on the engine's one core (more than its 6 ms on the link).
  const IterationCost aside = iteration(layers, 64, 4, Algorithm::ring, "", p, 1, false, nullptr, {2, 1});
  const double ar1 = std::max(AR, k.cpu / 1);
  EXPECT_NEAR(aside.total, 3 * 2 * F + 2 * B + std::max(2 * B, ar1) + std::max(2 * U + 2 * B, ar1) +
                               std::max(2 * U, ar1) + 2 * U, 1e-12);
  EXPECT_EQ(aside.contention, 0);
  EXPECT_NEAR(aside.allreduce, 3 * k.cpu, 1e-12);
  // Measured phases already ran on the cores the engine left: they are not stretched again.
  const MeasuredCompute m{0.003, 0.006, 0.0003};
  EXPECT_NEAR(iteration(layers, 64, 4, Algorithm::ring, "", p, 1, false, &m, {2, 1}).fwd, 0.003, 1e-15);
  // With one worker there is no all-reduce and nothing to share.
  EXPECT_EQ(iteration(layers, 64, 1, Algorithm::ring, "", p, 1, false, nullptr, {0.5, 0}).contention, 0);
  // The engine cannot have all of the rank's cores.
  EXPECT_THROW(iteration(layers, 64, 4, Algorithm::ring, "", p, 1, false, nullptr, {1, 1}), InvalidArgument);
  EXPECT_THROW(iteration(layers, 64, 4, Algorithm::ring, "", p, 1, false, nullptr, {-1, 0}), InvalidArgument);
}

// A host's ranks share its link: each rank's CPU counts its share of the host link's bytes.
TEST(CostModel, CpuCountsOneRanksShareOfAHostsLink) {
  Profile p = link_only(0, 1e9);
  p.reduce_Bps = 1e30;
  p.copy_Bps = 1e30;
  p.wire_cpu_s_per_byte = 1e-9;
  Query q{8, 8 << 20, false, false, false};
  q.hosts = 4, q.per_host = 2;
  const Cost hier = predict(Collective::allreduce, Algorithm::hier, q, p);
  EXPECT_NEAR(hier.cpu, hier.wire_bytes / 2 * 1e-9, 1e-12);  // 2 ranks on each host's link
  const Cost flat = predict(Collective::allreduce, Algorithm::ring, q, p);
  EXPECT_NEAR(flat.cpu, flat.wire_bytes * 1e-9, 1e-12);
}

// Through the offload daemons: 4 hosts of 2 ranks, 64 MiB allreduce, the ring among the daemons. Worked by hand:
// the daemons' ring is the 4-rank ring's (1.5 x 64 MiB over a 1e8 B/s link: 1.0066 s, 6 steps of 1 ms); each
// daemon reads and writes 2 x 64 MiB (268 MB at 1e9 B/s: 0.268 s) and combines 64 MiB (67 MB at 1e9: 0.067 s),
// 0.336 s under the ring; the first chunk's read and the last one's write, 4 MiB of a rank's 64: 1/16 of that;
// posting and waiting: 2 alpha. Where the daemon's copies are the longer side, the last chunk's trip between the
// hosts is what overlaps nothing.
TEST(CostModel, OffloadedCallsAddTheDaemonsCopiesAroundTheDaemonsCall) {
  Profile p = link_only(1e-3, 1e8);
  p.copy_Bps = 1e9, p.reduce_Bps = 1e9;
  Query q = call(8, 64 * kMiB);
  q.hosts = 4, q.per_host = 2;
  const Cost ring = predict(Collective::allreduce, Algorithm::ring, call(4, 64 * kMiB), p);
  const double local = 4 * 64 * kMiB / 1e9 + 64 * kMiB / 1e9;
  const Cost k = predict_offloaded(Collective::allreduce, q, p, "", Algorithm::ring);
  EXPECT_NEAR(ring.total, 6e-3 + 1.5 * 64 * kMiB / 1e8, 1e-9);
  EXPECT_NEAR(k.copy, local, 1e-12);
  EXPECT_NEAR(k.total, ring.total + 2e-3 + local / 16, 1e-9);
  EXPECT_EQ(k.bound, "link");
  EXPECT_NEAR(k.cpu, (ring.cpu + local) / 2, 1e-12);  // the daemon's work, over its 2 ranks
  // One host: nothing to overlap; the daemon's copies and combining are the call.
  Query one = call(2, 64 * kMiB);
  one.hosts = 1, one.per_host = 2;
  const Cost alone = predict_offloaded(Collective::allreduce, one, p);
  EXPECT_NEAR(alone.total, 2e-3 + local, 1e-9);
  EXPECT_EQ(alone.bound, "daemon");
  // A slow copy makes the daemon the bound across hosts too.
  p.copy_Bps = 1e8;
  const Cost slow = predict_offloaded(Collective::allreduce, q, p, "", Algorithm::ring);
  const double slow_local = 4 * 64 * kMiB / 1e8 + 64 * kMiB / 1e9;
  EXPECT_EQ(slow.bound, "daemon");  // the last chunk's trip between the hosts overlaps nothing
  EXPECT_NEAR(slow.total, 6e-3 + 2e-3 + slow_local + (ring.total - 6e-3) / 16, 1e-9);
  // A rank alone has no daemon; a codec goes between hosts for allreduce only; the daemons' algorithm must run.
  EXPECT_EQ(predict_offloaded(Collective::allreduce, call(1, 64 * kMiB), p).total, 0);
  EXPECT_EQ(offloaded_unsupported(Collective::allgather, q, "bfp16", Algorithm::automatic),
            "engine=nicd compresses only allreduce between hosts");
  EXPECT_EQ(offloaded_unsupported(Collective::allreduce, q, "bfp16", Algorithm::ring), "");
  EXPECT_NE(offloaded_unsupported(Collective::allreduce, q, "bfp16", Algorithm::rhd), "");
  // The training iteration through the daemons is the paper's with each all-reduce offloaded.
  const std::vector<double> layers(4, 1024.0 * 1024);
  const IterationCost in_process = iteration(layers, 64, 4, Algorithm::ring, "", p);
  const IterationCost offloaded = iteration(layers, 64, 4, Algorithm::ring, "", p, 1, false, nullptr, {}, true);
  Query layer = call(4, 4 * 1024.0 * 1024);
  layer.hosts = 4, layer.per_host = 1;
  EXPECT_NEAR(offloaded.allreduce, 4 * predict_offloaded(Collective::allreduce, layer, p, "", Algorithm::ring).total,
              1e-9);
  EXPECT_GT(offloaded.allreduce, in_process.allreduce);
}

TEST(CostModel, WireCpuIsAnOptionalProfileField) {
  Profile p = Profile::builtin();
  EXPECT_EQ(p.wire_cpu_s_per_byte, 0);  // not measured: no contention term
  p.wire_cpu_s_per_byte = 1.25e-9;
  const Profile back = Profile::parse(p.to_json(), "round trip");
  EXPECT_EQ(back.wire_cpu_s_per_byte, 1.25e-9);
  std::string text = p.to_json();
  text.replace(text.find("1.25e-09"), 8, "-1");
  try {
    Profile::parse(text, "bad.json");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json: field 'wire_cpu_s_per_byte': expected a non-negative number"),
              std::string::npos)
        << e.what();
  }
}

double scaling(const Profile& p, double batch, int n, std::string_view codec) {
  const std::vector<double> layers(20, kM * kM);
  return n * iteration(layers, batch, 1, Algorithm::ring, codec, p).total /
         iteration(layers, batch, n, Algorithm::ring, codec, p).total;
}

TEST(CostModel, PaperFig4bShapes) {
  const Profile p = paper_profile();
  // Batch 1792: backward compute hides the ring at any N, "ideal scaling", and BFP adds (almost) nothing: only
  // the first layer's all-reduce, which no backward step is left to hide, gets shorter.
  for (int n : {6, 32}) {
    EXPECT_GT(scaling(p, 1792, n, "") / n, 0.97) << n;
    EXPECT_NEAR(scaling(p, 1792, n, "bfp16") / scaling(p, 1792, n, ""), 1, 0.02) << n;
  }
  // Batch 448: the ring is exposed without BFP; with it the system moves towards ideal scaling.
  EXPECT_LT(scaling(p, 448, 32, "") / 32, 0.8);
  EXPECT_GT(scaling(p, 448, 32, "bfp16"), 1.2 * scaling(p, 448, 32, ""));
  EXPECT_GT(scaling(p, 448, 32, "bfp16") / 32, 0.97);
}

TEST(CostModel, SwitchBoundDpdkPaper) {
  // Model size M, N workers, links of B: through a switch that sums in the network each worker's link carries
  // M each way (2M/B counting both directions); a host aggregator's one link carries N M each way (2MN/B).
  const double M = 64 * kMiB, B = 125e6;
  const int N = 8;
  Profile p = link_only(0, B);
  p.switch_Bps = 1e30;
  Query q = call(N, M);
  q.switch_set = true;
  const Cost in_network = predict(Collective::allreduce, Algorithm::switch_, q, p);
  EXPECT_NEAR(2 * in_network.total, 2 * M / B, 1e-9);
  p.switch_link_Bps = B;
  const Cost host = predict(Collective::allreduce, Algorithm::switch_, q, p);
  EXPECT_NEAR(2 * host.total, 2 * M * N / B, 1e-9);
  // k sharded switches each take 1/k of the chunks.
  q.switches = 4;
  EXPECT_NEAR(predict(Collective::allreduce, Algorithm::switch_, q, p).total, M * N / 4 / B, 1e-9);
}

TEST(CostModel, AutoPicksTheCheaperAlgorithm) {
  const Query q = call(8, kMiB);
  // Huge latency: the fewest steps (recursive doubling: log2(8) = 3).
  const Profile slow_steps = link_only(1, 1e9);
  EXPECT_EQ(choose(Collective::allreduce, q, Algorithm::automatic, 0, &slow_steps), Algorithm::rd);
  // Latency free, bandwidth dear: the ring's 2(n-1)/n (6 ranks: rhd and rd pay the fold of 2 more).
  const Profile slow_link = link_only(0, 1e6);
  EXPECT_EQ(choose(Collective::allreduce, call(6, kMiB), Algorithm::automatic, 0, &slow_link), Algorithm::ring);
  // With a power of two, rhd moves as many bytes as the ring in fewer steps.
  const Profile both = link_only(1e-3, 1e6);
  EXPECT_EQ(choose(Collective::allreduce, q, Algorithm::automatic, 0, &both), Algorithm::rhd);
  EXPECT_EQ(choose(Collective::broadcast, q, Algorithm::automatic, 0, &slow_link), Algorithm::chain);
  EXPECT_EQ(choose(Collective::broadcast, q, Algorithm::automatic, 0, &slow_steps), Algorithm::tree);
  // Bruck's allgather only for calls up to small_bytes in all (8 blocks of 1 MiB here): its steps are not pipelined.
  EXPECT_EQ(choose(Collective::allgather, q, Algorithm::automatic, 8 * kMiB, &slow_steps), Algorithm::bruck);
  EXPECT_EQ(choose(Collective::allgather, q, Algorithm::automatic, 8 * kMiB - 1, &slow_steps), Algorithm::ring);
  // Unsupported algorithms are never picked: rd and rhd do not take codecs.
  Query compressed = q;
  compressed.compressed = true;
  EXPECT_EQ(choose(Collective::allreduce, compressed, Algorithm::automatic, 0, &slow_steps), Algorithm::ring);
  // The switch only once its rate is in the profile.
  Query with_switch = call(6, kMiB);
  with_switch.switch_set = true;
  Profile sw = slow_link;
  EXPECT_EQ(choose(Collective::allreduce, with_switch, Algorithm::automatic, 0, &sw), Algorithm::ring);
  sw.switch_Bps = 1e12;
  EXPECT_EQ(choose(Collective::allreduce, with_switch, Algorithm::automatic, 0, &sw), Algorithm::switch_);
  // reduce_scatter and allgather never, even where steps are dear and the switch's 2 beat the ring's n - 1 (they
  // measured slower than the ring).
  Profile steps_sw = slow_steps;
  steps_sw.switch_Bps = 1e12;
  Query many = call(64, kMiB);
  many.switch_set = true;
  EXPECT_EQ(choose(Collective::allreduce, many, Algorithm::automatic, 0, &steps_sw), Algorithm::switch_);
  EXPECT_NE(choose(Collective::reduce_scatter, many, Algorithm::automatic, 0, &steps_sw), Algorithm::switch_);
  EXPECT_NE(choose(Collective::allgather, many, Algorithm::automatic, 0, &steps_sw), Algorithm::switch_);
  // A per-algorithm step latency tips the balance back.
  Profile dear_ring = link_only(1e-6, 1e9);
  dear_ring.alpha_algo["ring"] = 1;
  EXPECT_NE(choose(Collective::allreduce, call(8, 64 * kMiB), Algorithm::automatic, 0, &dear_ring), Algorithm::ring);
}

// On one host with room in the control segment: through it while the call fits and stays cache-sized (at most
// 6 MiB copied through the segment per rank, 24 MiB by all ranks), with or without a profile; else the reads
// (cma) above rhd_max_bytes, the TCP latency algorithms below.
TEST(CostModel, SameHostCallsGoThroughTheSegmentWhileCacheSized) {
  auto pick = [](Collective c, int n, size_t bytes, size_t room = kMiB, const Profile* profile = nullptr) {
    Query q{n, bytes, false, true, false};
    q.shm_room = room;
    return choose(c, q, Algorithm::automatic, 256 * 1024, profile);
  };
  const Profile builtin = Profile::builtin();
  EXPECT_EQ(pick(Collective::allreduce, 2, 8), Algorithm::shm);
  EXPECT_EQ(pick(Collective::allreduce, 2, 8, kMiB, &builtin), Algorithm::shm);
  EXPECT_EQ(pick(Collective::barrier, 8, 0), Algorithm::shm);
  // allreduce in chunks: its input in, one vector read in chunks and (n-1)/n of it copied out.
  EXPECT_EQ(pick(Collective::allreduce, 4, kMiB), Algorithm::shm);          // 1 + 1.75 MiB per rank, 11 in all
  EXPECT_EQ(pick(Collective::allreduce, 4, kMiB + 4), Algorithm::cma);      // beyond the room
  EXPECT_EQ(pick(Collective::allreduce, 2, 4 * kMiB, 64 * kMiB), Algorithm::cma);  // 10 MiB per rank
  EXPECT_EQ(pick(Collective::allreduce, 16, kMiB), Algorithm::cma);         // 2.9 MiB per rank, 47 in all
  EXPECT_EQ(pick(Collective::allgather, 4, 256 * 1024), Algorithm::shm);    // 1.25 MiB per rank
  EXPECT_EQ(pick(Collective::allgather, 8, kMiB, 64 * kMiB), Algorithm::cma);  // 9 MiB per rank
  EXPECT_EQ(pick(Collective::alltoall, 4, 256 * 1024), Algorithm::shm);     // 1 MiB in, 1 MiB out
  EXPECT_EQ(pick(Collective::alltoall, 2, 2 * kMiB, 64 * kMiB), Algorithm::cma);   // 8 MiB per rank
  EXPECT_EQ(pick(Collective::allreduce, 16, 256 * 1024), Algorithm::shm);   // 0.73 MiB per rank, 11.8 in all
  EXPECT_EQ(pick(Collective::allreduce, 64, 256 * 1024), Algorithm::rhd);   // 0.75 MiB per rank, 47.8 in all
  // Under 16 KiB a reduction takes one round: every rank reads all n vectors.
  EXPECT_EQ(pick(Collective::allreduce, 32, 8192), Algorithm::shm);         // 264 KiB per rank, 8.3 MiB in all
  EXPECT_EQ(pick(Collective::allreduce, 64, 8192), Algorithm::rd);          // 520 KiB per rank, 32.5 MiB in all
  EXPECT_EQ(pick(Collective::allgather, 16, 256 * 1024), Algorithm::cma);   // 4.25 MiB per rank, 68 in all
  EXPECT_EQ(pick(Collective::allreduce, 2, 8, 0), Algorithm::rd);           // no room: shm_bytes=0
  EXPECT_EQ(pick(Collective::alltoallv, 2, 8), Algorithm::direct);
}

TEST(CostModel, AlltoallAcrossManyHostsGoesPairwiseUpTo4MiB) {
  // 8 hosts or more, above rhd_max_bytes and up to 4 MiB per rank in all: pairwise (incast), with a profile too
  // (the model, which has no incast term, would take direct: the rule comes first).
  const Profile builtin = Profile::builtin();
  for (const Profile* profile : {static_cast<const Profile*>(nullptr), &builtin}) {
    auto pick = [&](int n, int hosts, size_t block) {
      Query q{n, block, false, false, false};
      q.hosts = hosts;
      q.per_host = n / hosts;
      return choose(Collective::alltoall, q, Algorithm::automatic, 256 * 1024, profile);
    };
    EXPECT_EQ(pick(8, 8, 128 * 1024), Algorithm::pairwise);      // 1 MiB in all
    EXPECT_EQ(pick(16, 16, 256 * 1024), Algorithm::pairwise);    // 4 MiB in all
    EXPECT_EQ(pick(16, 16, 256 * 1024 + 1), Algorithm::direct);  // beyond 4 MiB
    EXPECT_NE(pick(8, 8, 4 * 1024), Algorithm::pairwise);        // 32 KiB in all: small
    EXPECT_EQ(pick(4, 4, 256 * 1024), Algorithm::direct);        // 4 hosts: direct measured fine
    EXPECT_EQ(pick(8, 4, 128 * 1024), Algorithm::direct);        // 4 hosts of 2 ranks
  }
}

TEST(CostModel, WithoutProfileTheSizeRulesStay) {
  EXPECT_EQ(choose(Collective::allreduce, call(8, 4096), Algorithm::automatic, 262144), Algorithm::rd);
  EXPECT_EQ(choose(Collective::allreduce, call(8, 65536), Algorithm::automatic, 262144), Algorithm::rhd);
  // Two ranks (three fold into two): one exchange of the whole vector beats two of halves.
  EXPECT_EQ(choose(Collective::allreduce, call(2, 65536), Algorithm::automatic, 262144), Algorithm::rd);
  EXPECT_EQ(choose(Collective::allreduce, call(3, 262144), Algorithm::automatic, 262144), Algorithm::rd);
  EXPECT_EQ(choose(Collective::allreduce, call(4, 65536), Algorithm::automatic, 262144), Algorithm::rhd);
  EXPECT_EQ(choose(Collective::allreduce, call(8, 64 * kMiB), Algorithm::automatic, 262144), Algorithm::ring);
}

TEST(CostModel, ProfileRoundTripAndDigest) {
  Profile p = Profile::builtin();
  p.alpha_algo["ring"] = 2e-4;
  p.efficiency_algo["rhd"] = 0.8;
  const Profile back = Profile::parse(p.to_json(), "roundtrip.json");
  EXPECT_EQ(back.to_json(), p.to_json());
  EXPECT_EQ(back.digest(), p.digest());
  p.link_Bps *= 2;
  EXPECT_NE(back.digest(), p.digest());
}

std::string parse_error(const std::string& text) {
  try {
    Profile::parse(text, "/tmp/bad-profile.json");
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(CostModel, MalformedProfilesNameFileAndField) {
  std::string good = Profile::builtin().to_json();
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  const std::string missing = parse_error(with("\"link_Bps\"", "\"link_bps\""));
  EXPECT_NE(missing.find("/tmp/bad-profile.json"), std::string::npos) << missing;
  EXPECT_NE(missing.find("field 'link_Bps': missing"), std::string::npos) << missing;
  EXPECT_NE(parse_error(with("\"alpha_s\": ", "\"alpha_s\": \"fast\", \"x\": ")).find("field 'alpha_s': expected a number"),
            std::string::npos);
  EXPECT_NE(parse_error(with("\"mem_Bps\": ", "\"mem_Bps\": -")).find("field 'mem_Bps': expected a positive number"),
            std::string::npos);
  EXPECT_NE(parse_error(with("\"encode_Bps\"", "\"encode_bps\"")).find("field 'codecs.bf16.encode_Bps': missing"),
            std::string::npos);
  EXPECT_NE(parse_error(with("\"bf16\"", "\"bogus\"")).find("field 'codecs.bogus'"), std::string::npos);
  EXPECT_NE(parse_error(with("\"alpha_algo\": {", "\"alpha_algo\": {\"zigzag\": 1, ")).find("field 'alpha_algo.zigzag'"),
            std::string::npos);
  EXPECT_NE(parse_error(with("\"cores\"", "\"speed\": 1, \"cores\"")).find("field 'speed': unknown field"),
            std::string::npos);
  EXPECT_NE(parse_error(good.substr(0, 40)).find("/tmp/bad-profile.json: not valid JSON at byte"), std::string::npos);
  EXPECT_NE(parse_error("[1, 2]").find("expected an object, got an array"), std::string::npos);
  try {
    Profile::load("/nonexistent/profile.json");
    FAIL() << "a missing file was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/profile.json: cannot be read"), std::string::npos);
  }
}

}  // namespace
}  // namespace smartcoll::coll
