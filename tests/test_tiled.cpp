// The tiled kernel against the long-double oracle where the small shapes of test_forward and
// test_masks do not reach: head sizes up to 256, shapes that are no multiple of any block,
// decoding against a long key range, thread counts, half-precision inputs and non-finite values.
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

TEMPLATE_TEST_CASE("decoding: a few queries against a long key range, split over key ranges", "[tiled][decode]", float,
                   double) {
  using T = TestType;
  for (const Index nQ : {1, 3}) {
    const Index nK = 20011, dK = 128;
    INFO("n_q " << nQ << ", n_k " << nK);
    const Mat<T> q = randn<T>(nQ, dK, 1, 3.0), k = randn<T>(nK, dK, 2), v = randn<T>(nK, dK, 3);
    const long double tau = 1.0L / std::sqrt((long double)dK);
    checkForwardWith<T>(kernel::Tiled{}, q, k, v, sdpa::scale::InvSqrtDk{}, mask::None{}, tau, allVisible(), noBias());
    // A KV cache filled to 15000 of its 20011 rows; the rest is stale (NaN) and must not be read.
    Mat<T> kStale = k, vStale = v;
    kStale.bottomRows(nK - 15000).setConstant(std::numeric_limits<T>::quiet_NaN());
    vStale.bottomRows(nK - 15000).setConstant(std::numeric_limits<T>::quiet_NaN());
    checkForwardWith<T>(
        kernel::Tiled{}, q, kStale, vStale, sdpa::scale::InvSqrtDk{}, mask::KeyLength{15000}, tau,
        [](Index, Index j) { return j < 15000; }, noBias());
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
    sdpa::MultiHeadForwardResult<float> one, two, decodeOne, decodeTwo;
    withThreads(1, [&] {
      one = sdpa::batchedAttentionForward(q, k, v, layout, sdpa::Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, m);
      decodeOne = sdpa::multiHeadAttentionForward(q.topRows(1), k, v, sdpa::Heads{H, Hkv});
    });
    withThreads(2, [&] {
      two = sdpa::batchedAttentionForward(q, k, v, layout, sdpa::Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, m);
      decodeTwo = sdpa::multiHeadAttentionForward(q.topRows(1), k, v, sdpa::Heads{H, Hkv});
    });
    CHECK(one.output == two.output);
    CHECK(one.logSumExp == two.logSumExp);
    CHECK(decodeOne.output == decodeTwo.output);
    CHECK(decodeOne.logSumExp == decodeTwo.logSumExp);
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

TEST_CASE("NaN and +inf propagate to the affected rows only, across tiles", "[tiled][nan]") {
  constexpr float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const Mat<float> q = randn<float>(20, 8, 31), k = randn<float>(50, 8, 32), v = randn<float>(50, 4, 33);
  const auto m = mask::Causal{Align::LowerRight};  // query i sees keys j <= i + 30
  const kernel::Tiled kern{3, 7};
  const auto clean = sdpa::attentionForward(kern, q, k, v, sdpa::scale::InvSqrtDk{}, m);
  const auto naiveClean = sdpa::attentionForward(kernel::Naive{}, q, k, v, sdpa::scale::InvSqrtDk{}, m);
  CHECK(maxAbsDiff(clean.output, naiveClean.output) <= 1e-6);

  Mat<float> qBad = q, kBad = k, vBad = v;
  qBad(4, 2) = nan;   // row 4 only
  kBad(40, 0) = nan;  // key 40: seen by queries i >= 10
  vBad(49, 1) = inf;  // value 49: seen by query 19 only
  const auto dirty = sdpa::attentionForward(kern, qBad, kBad, vBad, sdpa::scale::InvSqrtDk{}, m);
  const auto naiveDirty = sdpa::attentionForward(kernel::Naive{}, qBad, kBad, vBad, sdpa::scale::InvSqrtDk{}, m);
  for (Index i = 0; i < q.rows(); ++i) {
    INFO("row " << i);
    const bool poisoned = i == 4 || i >= 10;
    CHECK(std::isnan(dirty.logSumExp(i)) == poisoned);
    CHECK(dirty.output.row(i).array().isNaN().all() == poisoned);
    CHECK(std::isnan(naiveDirty.logSumExp(i)) == poisoned);
    // Unaffected rows keep their value; the non-finite v switches P v to a zero-skipping loop,
    // whose summation order differs from the GEMM's by rounding.
    if (!poisoned) CHECK(maxAbsDiff(dirty.output.row(i), clean.output.row(i)) <= 1e-6);
  }

  Mat<float> bias = Mat<float>::Zero(20, 50);
  bias(2, 5) = inf;  // a visible +inf logit: no finite softmax for row 2
  const auto capped = sdpa::attentionForward(kern, q, k, v, sdpa::scale::InvSqrtDk{}, mask::Bias{bias});
  for (Index i = 0; i < q.rows(); ++i) CHECK(std::isnan(capped.logSumExp(i)) == (i == 2));
}

TEMPLATE_TEST_CASE("a NaN logit among hidden keys poisons its row, wherever it sits in the tile", "[tiled][nan]", float,
                   double) {
  // The online softmax takes a plain tile maximum, which may skip a NaN (x86's max returns one
  // operand for NaN; Eigen's scalar tail another): the tile's exp pass must still see it. Row i
  // holds one NaN logit at a position that walks through packets and scalar tails, among -inf
  // (hidden) entries: in the first key half with the second visible (the running max is -inf
  // when the NaN arrives), or in the second half after a visible first (a finite running max).
  // Rows i % 8 == 2 see only the NaN; rows i % 4 == 3 hold no NaN and stay finite.
  using T = TestType;
  constexpr T nan = std::numeric_limits<T>::quiet_NaN(), inf = std::numeric_limits<T>::infinity();
  const Index nQ = 96, nK = 96, half = nK / 2;
  const Mat<T> q = randn<T>(nQ, 8, 34), k = randn<T>(nK, 8, 35), v = randn<T>(nK, 4, 36);
  Mat<T> bias = Mat<T>::Zero(nQ, nK);
  for (Index i = 0; i < nQ; ++i) {
    const Index p = (i * 7) % half;
    const bool nanFirst = i % 2 == 0;
    bias.row(i).segment(nanFirst ? 0 : half, half).setConstant(-inf);
    if (i % 8 == 2) bias.row(i).setConstant(-inf);
    if (i % 4 != 3) bias(i, nanFirst ? p : half + p) = nan;
  }
  const VisibleFn visible = [&](Index i, Index j) { return bias(i, j) != -inf; };
  const BiasFn biasAt = [&](Index i, Index j) { return (long double)bias(i, j); };
  const long double tau = 1.0L / std::sqrt(8.0L);
  const Mat<double> gold =
      referenceAttention<long double>(q, k, v, tau, visible, biasAt).output.template cast<double>();
  const auto plain = referenceAttention<T>(q, k, v, tau, visible, biasAt);
  double plainErr = 0;
  for (Index i = 3; i < nQ; i += 4) plainErr = std::max(plainErr, maxAbsDiff(plain.output.row(i), gold.row(i)));
  const auto check = [&](const auto& kern, const std::string& name) {
    INFO(name);
    const auto fwd = sdpa::attentionForward(kern, q, k, v, sdpa::scale::InvSqrtDk{}, mask::Bias{bias});
    for (Index i = 0; i < nQ; ++i) {
      INFO("row " << i);
      const bool poisoned = i % 4 != 3;
      CHECK(bool(std::isnan(fwd.logSumExp(i))) == poisoned);
      CHECK(fwd.output.row(i).array().isNaN().all() == poisoned);
      if (!poisoned) CHECK(maxAbsDiff(fwd.output.row(i), gold.row(i)) <= errorBound<T>(plainErr, maxAbs(gold.row(i))));
    }
  };
  check(kernel::Naive{}, "Naive");
  for (const auto& tiled : {kernel::Tiled{}, kernel::Tiled{16, 48}, kernel::Tiled{8, 40}, kernel::Tiled{32, 96}})
    check(tiled, "Tiled{" + std::to_string(tiled.blockQ) + ", " + std::to_string(tiled.blockK) + "}");
}

TEMPLATE_TEST_CASE("a non-finite value whose weight a later, larger logit turns to 0 has no effect", "[tiled][nan]",
                   float, double) {
  // Logits 0 for keys 0..46 and 1e4 for key 47: the softmax is one-hot on key 47 and every
  // other weight is exactly 0 (exp(-1e4) underflows), so the inf, -inf and NaN values of keys 0,
  // 5 and 20 must not reach the output. The online softmax first sees them with weight 1 (a
  // tile's or a key split's own maximum is 0), then rescales by exp(0 - 1e4) = 0: a product
  // 0 * inf there made the output NaN (found by the fuzzer, in the merge of decoding splits).
  using T = TestType;
  constexpr T inf = std::numeric_limits<T>::infinity();
  const Index nK = 48;
  Mat<T> k = Mat<T>::Zero(nK, 1), v = randn<T>(nK, 3, 37);
  k(nK - 1, 0) = T(1e4);
  v(0, 1) = inf;
  v(5, 0) = -inf;
  v(20, 2) = std::numeric_limits<T>::quiet_NaN();
  for (const Index nQ : {1, 7}) {
    const Mat<T> q = Mat<T>::Ones(nQ, 1);
    const auto check = [&](const auto& kern, const std::string& name) {
      INFO(name << ", n_q " << nQ);
      const auto fwd = sdpa::attentionForward(kern, q, k, v, sdpa::scale::None{});
      for (Index i = 0; i < nQ; ++i) {
        CHECK(fwd.output.row(i) == v.row(nK - 1));
        CHECK(fwd.logSumExp(i) == T(1e4));
      }
    };
    check(kernel::Naive{}, "Naive");
    // Tiled{4, 3} splits a decoding unit's 48 keys four ways (keySplits); {2, 3} and {8, 3} tile
    // the keys three at a time.
    for (const auto& tiled : {kernel::Tiled{}, kernel::Tiled{4, 3}, kernel::Tiled{2, 3}, kernel::Tiled{8, 3}})
      check(tiled, "Tiled{" + std::to_string(tiled.blockQ) + ", " + std::to_string(tiled.blockK) + "}");
  }
}

TEMPLATE_TEST_CASE("half and bfloat16 inputs: fp32 accumulation, bounded by the storage epsilon", "[tiled][half]",
                   Eigen::half, Eigen::bfloat16) {
  using H = TestType;
  // The output is within the float rule of a float run on the same (exactly converted) inputs,
  // plus one rounding to H: |out_H - gold| <= 2 err_float + 8 eps_f max|gold| + (eps_H / 2) max|gold|.
  // eps = 2^-10 (half), 2^-7 (bfloat16); not NumTraits<half>::epsilon(), which is 2^-13 in Eigen 3.4.
  const double epsH = std::is_same_v<H, Eigen::half> ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
  const Index nQ = 70, nK = 300, dK = 64;
  const Mat<H> q = toHalf<H>(randn<float>(nQ, dK, 41)), k = toHalf<H>(randn<float>(nK, dK, 42)),
               v = toHalf<H>(randn<float>(nK, dK, 43));
  const Mat<double> qd = fromHalf(q), kd = fromHalf(k), vd = fromHalf(v);
  const long double tau = 0.125L;
  const auto gold = referenceAttention<long double>(qd, kd, vd, tau, [](Index i, Index j) { return j <= i + 230; });
  const auto naive = referenceAttention<float>(qd, kd, vd, tau, [](Index i, Index j) { return j <= i + 230; });
  const Mat<double> goldOut = gold.output.template cast<double>();
  const double scale = goldOut.cwiseAbs().maxCoeff();
  const double errFloat = maxAbsDiff(naive.output, goldOut);

  const auto inH = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, mask::Causal{Align::LowerRight});
  STATIC_REQUIRE(std::is_same_v<typename decltype(inH.output)::Scalar, H>);
  STATIC_REQUIRE(std::is_same_v<typename decltype(inH.logSumExp)::Scalar, float>);
  const double errH = maxAbsDiff(fromHalf(inH.output), goldOut);
  INFO("error of the " << sizeof(H) * 8 << "-bit output " << errH << ", float naive error " << errFloat);
  CHECK(errH <= errorBound<float>(errFloat, scale) + 0.5 * epsH * scale);

  const auto inFloat =
      sdpa::attentionForward<float>(q, k, v, sdpa::scale::InvSqrtDk{}, mask::Causal{Align::LowerRight});
  STATIC_REQUIRE(std::is_same_v<typename decltype(inFloat.output)::Scalar, float>);
  CHECK(maxAbsDiff(inFloat.output, goldOut) <= errorBound<float>(errFloat, scale));
  CHECK(maxAbsDiff(inFloat.logSumExp, gold.logSumExp.template cast<double>()) <=
        errorBound<float>(maxAbsDiff(naive.logSumExp, gold.logSumExp.template cast<double>()),
                          gold.logSumExp.cwiseAbs().template cast<double>().maxCoeff()));

  const auto naiveKernel = sdpa::attentionForward<float>(kernel::Naive{}, q, k, v, sdpa::scale::InvSqrtDk{},
                                                         mask::Causal{Align::LowerRight});
  CHECK(maxAbsDiff(naiveKernel.output, goldOut) <= errorBound<float>(errFloat, scale));

  const auto multi = sdpa::multiHeadAttentionForward<float>(q, k, v, sdpa::Heads{2}, sdpa::scale::InvSqrtDk{});
  const auto multiGold =
      sdpa::multiHeadAttentionForward(kernel::Naive{}, qd, kd, vd, sdpa::Heads{2}, sdpa::scale::InvSqrtDk{});
  CHECK(maxAbsDiff(multi.output, multiGold.output) <= 1e-5);
}

TEST_CASE("unscaled fp16 inputs whose fp16 logits overflow still give the finite result  [seed C13][seed C15]",
          "[tiled][half]") {
  // Entries of standard deviation 60 and d_k = 64: q.k has standard deviation 60 * 60 * 8 = 28800
  // and reaches beyond fp16's 65504. The logits are computed in float, so the output is the
  // (nearly one-hot) softmax of the reference.
  const Index nQ = 16, nK = 40, dK = 64;
  const Mat<Eigen::half> q = (60.0f * randn<float>(nQ, dK, 51)).cast<Eigen::half>(),
                         k = (60.0f * randn<float>(nK, dK, 52)).cast<Eigen::half>(),
                         v = randn<float>(nK, 8, 53).cast<Eigen::half>();
  const Mat<double> qd = fromHalf(q), kd = fromHalf(k), vd = fromHalf(v);
  const auto logits = (qd * kd.transpose()).cwiseAbs();
  REQUIRE(logits.maxCoeff() > 65504.0);
  const auto out = sdpa::attentionForward<float>(q, k, v, sdpa::scale::None{});
  const auto gold = referenceAttention<long double>(qd, kd, vd, 1.0L);
  CHECK(out.output.allFinite());
  CHECK(out.logSumExp.allFinite());
  CHECK(maxAbsDiff(out.output, gold.output.cast<double>()) <= 1e-5);
  const auto outH = sdpa::attentionForward(q, k, v, sdpa::scale::None{});
  CHECK(fromHalf(outH.output).allFinite());
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

TEMPLATE_TEST_CASE("decoding over half storage: a few queries against a long fp16 or bf16 KV cache",
                   "[tiled][half][decode]", Eigen::half, Eigen::bfloat16) {
  using H = TestType;
  // The decoding path converts k and v in registers when compiled for AVX-512 (8 columns at a
  // time, then single columns; 32 keys at a time, then single keys), column by column otherwise;
  // both against the float rule on the exactly converted inputs.
  // The last key sits in the ragged end of the last chunk: valid = n_k in the last case.
  for (const auto& [nK, dK, dV, valid] :
       {std::tuple<Index, Index, Index, Index>{5000, 64, 64, 4321}, {4999, 100, 37, 4320}, {777, 13, 9, 777}}) {
    DYNAMIC_SECTION("n_k " << nK << ", d_k " << dK << ", d_v " << dV << ", valid keys " << valid) {
      const Index nQ = 2;
      Mat<H> q = randn<float>(nQ, dK, 71).template cast<H>(), k = randn<float>(nK, dK, 72).template cast<H>(),
             v = randn<float>(nK, dV, 73).template cast<H>();
      v.bottomRows(nK - valid).setConstant(H(std::numeric_limits<float>::quiet_NaN()));  // stale cache rows
      const Mat<double> qd = fromHalf(q), kd = fromHalf(k), vd = fromHalf(v);
      const Index nValid = valid;  // a structured binding cannot be captured in C++17
      const auto visible = [=](Index, Index j) { return j < nValid; };
      const long double tau = 1.0L / std::sqrt((long double)dK);
      const auto gold = referenceAttention<long double>(qd, kd, vd, tau, visible);
      const auto naive = referenceAttention<float>(qd, kd, vd, tau, visible);
      const Mat<double> goldOut = gold.output.template cast<double>();
      const auto out = sdpa::attentionForward<float>(q, k, v, sdpa::scale::InvSqrtDk{}, mask::KeyLength{valid});
      CHECK(out.output.allFinite());
      CHECK(maxAbsDiff(out.output, goldOut) <=
            errorBound<float>(maxAbsDiff(naive.output, goldOut), goldOut.cwiseAbs().maxCoeff()));
    }
  }
}

TEST_CASE("backward: a NaN query row poisons only the gradients of what it saw", "[tiled][backward][nan]") {
  // Causal (upper-left): query 2 sees keys 0..2. Its NaN reaches dq row 2 and dk, dv rows 0..2;
  // keys 3.. (hidden from it) and every other dq row keep finite gradients, in both kernels.
  Mat<double> q = randn<double>(12, 8, 81);
  const Mat<double> k = randn<double>(12, 8, 82), v = randn<double>(12, 5, 83), dO = randn<double>(12, 5, 84);
  q(2, 3) = std::numeric_limits<double>::quiet_NaN();
  const auto m = mask::Causal{Align::UpperLeft};
  const auto check = [&](const auto& kern, const char* name) {
    INFO("kernel " << name);
    const auto fwd = sdpa::attentionForward(kern, q, k, v, sdpa::scale::InvSqrtDk{}, m);
    const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dO, sdpa::scale::InvSqrtDk{}, m);
    for (Index i = 0; i < 12; ++i) CHECK(g.dq.row(i).allFinite() == (i != 2));
    CHECK(g.dk.bottomRows(9).allFinite());
    CHECK(g.dv.bottomRows(9).allFinite());
    CHECK(g.dv.topRows(3).array().isNaN().any());
  };
  check(kernel::Naive{}, "Naive");
  check(kernel::Tiled{}, "Tiled{}");
  check(kernel::Tiled{2, 3}, "Tiled{2, 3}");
}
