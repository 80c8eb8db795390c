// The tiled kernel against the long-double oracle where the small shapes of test_forward and
// test_masks do not reach (head sizes up to 256, shapes that are no multiple of any block), its
// results' independence of the thread count, and the tiled backward against the naive one.
// Special values: test_special_values.cpp; half precision: test_half.cpp; decoding:
// test_decode.cpp.
#include <sdpa/sdpa.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "support/cases.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace sdpa_test;
using sdpa::Index;
using sdpa::mask::Align;
namespace mask = sdpa::mask;
namespace kernel = sdpa::kernel;

namespace {

/// Runs f() with n OpenMP threads (a no-op without OpenMP), restoring the previous count.
template <typename F>
void withThreads(int n, F&& f) {
#ifdef _OPENMP
  const int before = omp_get_max_threads();
  omp_set_num_threads(n);
  f();
  omp_set_num_threads(before);
#else
  (void)n;
  f();
#endif
}

}  // namespace

TEMPLATE_TEST_CASE("tiled forward matches the fp64 reference for d_k up to 256 and awkward n  [seed C1]",
                   "[tiled][forward]", float, double) {
  using T = TestType;
  std::uint64_t seed = 900;
  const std::vector<std::pair<Index, Index>> sizes = {{1, 300}, {67, 45}, {130, 257}};
  for (const Index dK : {1, 3, 16, 64, 100, 256})
    for (const auto& [nQ, nK] : sizes) {
      // d 256 over several default tiles is test_kernel_paths.cpp's ({21, 61, 256, 7}, every ISA);
      // here Tiled{7, 33} cuts 67 x 45 into tiles (the largest case under the sanitizers' cost).
      if (dK == 256 && nQ == 130) continue;
      const Index dV = dK == 100 ? 37 : dK;
      INFO("n_q " << nQ << ", n_k " << nK << ", d_k " << dK << ", d_v " << dV);
      const Mat<T> q = randn<T>(nQ, dK, ++seed), k = randn<T>(nK, dK, ++seed), v = randn<T>(nK, dV, ++seed);
      const long double tau = 1.0L / std::sqrt((long double)dK);
      const Index L = nQ, S = nK;
      // The oracle of each mask is computed once for both block sizes.
      const auto kernels = {kernel::Tiled{}, kernel::Tiled{7, 33}};
      checkTiledKernels<T>(kernels, q, k, v, sdpa::scale::InvSqrtDk{}, mask::None{}, tau, allVisible(), noBias());
      checkTiledKernels<T>(kernels, q, k, v, sdpa::scale::None{}, mask::None{}, 1.0L, allVisible(), noBias());
      checkTiledKernels<T>(
          kernels, q, k, v, sdpa::scale::InvSqrtDk{}, mask::Causal{Align::LowerRight}, tau,
          [=](Index i, Index j) { return j <= i + S - L; }, noBias());
      checkTiledKernels<T>(
          kernels, q, k, v, sdpa::scale::InvSqrtDk{}, mask::SlidingWindow{40, 0, Align::UpperLeft}, tau,
          [=](Index i, Index j) { return j <= i && j >= i - 40; }, noBias());
      checkTiledKernels<T>(
          kernels, q, k, v, sdpa::scale::InvSqrtDk{},
          mask::combine(mask::Softcap{3.0}, mask::Causal{Align::UpperLeft}, mask::Alibi{{0.125}, Align::UpperLeft}),
          tau, [](Index i, Index j) { return j <= i; },
          [](Index i, Index j) { return -0.125L * std::abs((long double)(i - j)); }, 3.0L);
    }
}

TEST_CASE("1 and 2 threads give bitwise identical forward results, on every ISA path", "[tiled][threads]") {
  // Each output row is computed by one work unit whatever the thread count, and decoding splits
  // the keys by the shape, not by the threads, so the results are bitwise equal. On the portable
  // path too, where no unit is fast prefill: its GQA prefill units were once grouped as decoding
  // units (other arithmetic) when there were enough of them for the threads.
  using sdpa::internal::Isa;
  using sdpa::internal::IsaChoice;
  for (const Isa cap : {Isa::Portable, IsaChoice::detected()}) {
    IsaChoice::setCap(cap);
    INFO("ISA cap " << int(cap));
    const Index H = 4, Hkv = 2, dK = 32;
    const Mat<float> q = randn<float>(300, H * dK, 11), k = randn<float>(2000, Hkv * dK, 12),
                     v = randn<float>(2000, Hkv * dK, 13);
    const auto layout = sdpa::BatchLayout::varlen({0, 100, 300}, {0, 900, 2000});
    const auto m = mask::Causal{Align::LowerRight};
    // Decoding: one query row, and 16 (multi-token decoding, in wide register blocks).
    sdpa::MultiHeadForwardResult<float> one, two, decodeOne, decodeTwo, rowsOne, rowsTwo;
    withThreads(1, [&] {
      one = sdpa::batchedAttentionForward(q, k, v, layout, sdpa::Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, m);
      decodeOne = sdpa::multiHeadAttentionForward(q.topRows(1), k, v, sdpa::Heads{H, Hkv});
      rowsOne = sdpa::multiHeadAttentionForward(q.topRows(16), k, v, sdpa::Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, m);
    });
    withThreads(2, [&] {
      two = sdpa::batchedAttentionForward(q, k, v, layout, sdpa::Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, m);
      decodeTwo = sdpa::multiHeadAttentionForward(q.topRows(1), k, v, sdpa::Heads{H, Hkv});
      rowsTwo = sdpa::multiHeadAttentionForward(q.topRows(16), k, v, sdpa::Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, m);
    });
    CHECK(one.output == two.output);
    CHECK(one.logSumExp == two.logSumExp);
    CHECK(decodeOne.output == decodeTwo.output);
    CHECK(decodeOne.logSumExp == decodeTwo.logSumExp);
    CHECK(rowsOne.output == rowsTwo.output);
    CHECK(rowsOne.logSumExp == rowsTwo.logSumExp);
    // One group of query heads over one kv head, 37 rows each: a decoding group would be run
    // together on one thread and apart on two.
    const Mat<float> qg = randn<float>(37, H * dK, 17);
    sdpa::MultiHeadForwardResult<float> groupOne, groupTwo;
    withThreads(1, [&] {
      groupOne = sdpa::multiHeadAttentionForward(qg, k.leftCols(dK), v.leftCols(dK), sdpa::Heads{H, 1});
    });
    withThreads(2, [&] {
      groupTwo = sdpa::multiHeadAttentionForward(qg, k.leftCols(dK), v.leftCols(dK), sdpa::Heads{H, 1});
    });
    CHECK(groupOne.output == groupTwo.output);
    if (cap == Isa::Portable) continue;  // (the key splits below do not depend on the ISA)

    // Decoding against 20000 keys: a single work unit whose keys are split (8 ways); the split
    // depends on the shape only, so 1 and 2 threads, and the same head inside a multi-head call,
    // agree bitwise.
    const Mat<float> qd = randn<float>(1, 2 * dK, 14), kd = randn<float>(20000, 2 * dK, 15),
                     vd = randn<float>(20000, 2 * dK, 16);
    sdpa::ForwardResult<float> single1, single2;
    sdpa::MultiHeadForwardResult<float> both;
    withThreads(1, [&] { single1 = sdpa::attentionForward(qd.leftCols(dK), kd.leftCols(dK), vd.leftCols(dK)); });
    withThreads(2, [&] {
      single2 = sdpa::attentionForward(qd.leftCols(dK), kd.leftCols(dK), vd.leftCols(dK));
      both = sdpa::multiHeadAttentionForward(qd, kd, vd, sdpa::Heads{2});
    });
    CHECK(single1.output == single2.output);
    CHECK(single1.logSumExp == single2.logSumExp);
    CHECK(single1.output == both.output.leftCols(dK));
    CHECK(single1.logSumExp(0) == both.logSumExp(0, 0));
  }
  IsaChoice::setCap(Isa::Amx);
}

TEMPLATE_TEST_CASE("tiled and naive kernels agree on batched GQA with dropout", "[tiled][multihead]", float, double) {
  using T = TestType;
  const Index H = 4, Hkv = 2, dK = 8, dV = 5;
  const Mat<T> q = randn<T>(40, H * dK, 21), k = randn<T>(70, Hkv * dK, 22), v = randn<T>(70, Hkv * dV, 23);
  const auto layout = sdpa::BatchLayout::varlen({0, 15, 40}, {0, 33, 70});
  const sdpa::Dropout dropout{0.3, 77};
  const auto m = mask::combine(mask::Causal{Align::LowerRight}, mask::Alibi::standard(H, Align::LowerRight));
  const auto naive = sdpa::batchedAttentionForward(kernel::Naive{}, q, k, v, layout, sdpa::Heads{H, Hkv},
                                                   sdpa::scale::InvSqrtDk{}, m, dropout);
  // The double-precision naive kernel is the reference of the float runs.
  const auto gold = sdpa::batchedAttentionForward(kernel::Naive{}, q.template cast<double>(), k.template cast<double>(),
                                                  v.template cast<double>(), layout, sdpa::Heads{H, Hkv},
                                                  sdpa::scale::InvSqrtDk{}, m, dropout);
  for (const kernel::Tiled kern : {kernel::Tiled{}, kernel::Tiled{4, 8}}) {
    INFO("blocks " << kern.blockQ << " x " << kern.blockK);
    const auto tiled =
        sdpa::batchedAttentionForward(kern, q, k, v, layout, sdpa::Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, m, dropout);
    const double errNaive = maxAbsDiff(naive.output, gold.output), errTiled = maxAbsDiff(tiled.output, gold.output);
    INFO("tiled error " << errTiled << ", naive error " << errNaive);
    CHECK(errTiled <= errorBound<T>(errNaive, gold.output.cwiseAbs().maxCoeff()));
    CHECK(maxAbsDiff(tiled.logSumExp, gold.logSumExp) <=
          errorBound<T>(maxAbsDiff(naive.logSumExp, gold.logSumExp), gold.logSumExp.cwiseAbs().maxCoeff()));
  }
}

namespace {

/// Tiled backward (several block sizes) against the naive backward in double, for one mask, on a
/// batched GQA layout with dropout: the float error is within the 2x rule of the naive float run.
template <typename T, typename Mask>
void checkBackwardKernels(const Mask& m, const char* name, std::uint64_t seed) {
  INFO("mask " << name);
  const Index H = 4, Hkv = 2, dK = 12, dV = 7;
  const auto layout = sdpa::BatchLayout::varlen({0, 23, 60}, {0, 41, 80});
  const Mat<T> q = randn<T>(60, H * dK, seed), k = randn<T>(80, Hkv * dK, seed + 1),
               v = randn<T>(80, Hkv * dV, seed + 2), dO = randn<T>(60, H * dV, seed + 3);
  const sdpa::Dropout dropout{0.2, seed};
  const sdpa::Heads heads{H, Hkv};
  const sdpa::scale::InvSqrtDk scale;
  const auto fwd = sdpa::batchedAttentionForward(kernel::Naive{}, q, k, v, layout, heads, scale, m, dropout);
  const auto naive =
      sdpa::batchedAttentionBackward(kernel::Naive{}, q, k, v, fwd, dO, layout, heads, scale, m, dropout);
  const Mat<double> qd = q.template cast<double>(), kd = k.template cast<double>(), vd = v.template cast<double>(),
                    dOd = dO.template cast<double>();
  const auto fwdD = sdpa::batchedAttentionForward(kernel::Naive{}, qd, kd, vd, layout, heads, scale, m, dropout);
  const auto gold =
      sdpa::batchedAttentionBackward(kernel::Naive{}, qd, kd, vd, fwdD, dOd, layout, heads, scale, m, dropout);
  const double naiveErr = gradientDistance(naive, gold), gs = gradientScale(gold);
  for (const kernel::Tiled kern : {kernel::Tiled{}, kernel::Tiled{3, 5}, kernel::Tiled{16, 7}}) {
    INFO("blocks " << kern.blockQ << " x " << kern.blockK);
    const auto tiled = sdpa::batchedAttentionBackward(kern, q, k, v, fwd, dO, layout, heads, scale, m, dropout);
    const double err = gradientDistance(tiled, gold);
    INFO("tiled gradient error " << err << ", naive " << naiveErr << ", scale " << gs);
    // In double the naive double kernel is the gold itself (no higher-precision backward exists;
    // test_backward checks double gradients against finite differences): both kernels' rounding
    // over sums of n_k = 41 and n_q = 37 terms stays within 64 ulps of the gradient scale.
    const double bound =
        std::is_same_v<T, double> ? 64 * std::numeric_limits<double>::epsilon() * gs : errorBound<T>(naiveErr, gs);
    CHECK(err <= bound);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("tiled backward matches the naive backward for every mask, GQA, batches and dropout",
                   "[tiled][backward]", float, double) {
  using T = TestType;
  const Mat<T> bias = randn<T>(4 * 23, 41, 5);  // per head: (H n_q) x n_k, one item of 23 x 41 only
  checkBackwardKernels<T>(mask::None{}, "None", 100);
  checkBackwardKernels<T>(mask::Causal{Align::LowerRight}, "Causal LowerRight", 200);
  checkBackwardKernels<T>(mask::SlidingWindow{6, 2, Align::UpperLeft}, "SlidingWindow{6, 2}", 300);
  checkBackwardKernels<T>(
      mask::combine(mask::Softcap{2.0}, mask::Causal{Align::UpperLeft}, mask::Alibi::standard(4, Align::UpperLeft)),
      "Softcap + Causal + ALiBi", 400);
  checkBackwardKernels<T>(mask::combine(mask::KeyLength{30}, mask::QueryLength{20}), "lengths", 500);
}

TEMPLATE_TEST_CASE("tiled backward: bias gradients, learnable scales, 1 and 2 threads", "[tiled][backward]", float,
                   double) {
  using T = TestType;
  const Index H = 2, dK = 16, nQ = 70, nK = 90;
  const Mat<T> q = randn<T>(nQ, H * dK, 61), k = randn<T>(nK, H * dK, 62), v = randn<T>(nK, H * dK, 63),
               dO = randn<T>(nQ, H * dK, 64), bias = randn<T>(H * nQ, nK, 65);
  const auto m = mask::combine(mask::Causal{Align::LowerRight}, mask::Bias{bias});
  sdpa::scale::PerHead<sdpa::scale::Learnable<T>> naiveScale(
      {sdpa::scale::Learnable<T>{T(0.2)}, sdpa::scale::Learnable<T>{T(0.3)}}),
      tiledScale = naiveScale;
  const auto fwd = sdpa::multiHeadAttentionForward(q, k, v, sdpa::Heads{H}, naiveScale, m);
  const auto naive = sdpa::multiHeadAttentionBackward(kernel::Naive{}, q, k, v, fwd, dO, sdpa::Heads{H}, naiveScale, m);
  sdpa::MultiHeadGradients<T> one, two;
  withThreads(1, [&] {
    one = sdpa::multiHeadAttentionBackward(kernel::Tiled{8, 16}, q, k, v, fwd, dO, sdpa::Heads{H}, tiledScale, m);
  });
  withThreads(2, [&] {
    two = sdpa::multiHeadAttentionBackward(kernel::Tiled{8, 16}, q, k, v, fwd, dO, sdpa::Heads{H}, tiledScale, m);
  });
  const double tol = 64 * std::numeric_limits<T>::epsilon() * gradientScale(naive);
  CHECK(one.dbias.rows() == H * nQ);
  CHECK(gradientDistance(one, naive) <= tol);
  // Two threads sum dq, dtau and dbias in per-thread buffers: equal up to rounding, not bitwise.
  CHECK(gradientDistance(two, one) <= tol);
  // Each learnable head accumulated dL/dtau once per call: naive once, tiled twice.
  for (Index h = 0; h < H; ++h)
    CHECK(std::abs(tiledScale.head(h).grad() - 2 * naiveScale.head(h).grad()) <=
          tol * std::max<double>(1, std::abs(naiveScale.head(h).grad())));
}
