// Special values, every kernel, in one place: logits at and past the fp32 exp limit, 1e30
// magnitudes, all-equal logits, n_k = 1, d_k = 1, denormals, fully masked rows, values at hidden
// positions (NaN and inf among them), NaN and +inf propagation across tiles, forward and
// backward, and d_k = 0 or d_v = 0. The expected values are exact (one-hot or uniform weights, 0
// and -inf) or the long-double oracle's. The fast kernels' own paths for them, ISA by ISA:
// test_kernel_paths.cpp ("special values in the float prefill kernel ...").
#include <sdpa/sdpa.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "support/cases.hpp"

using namespace sdpa_test;
using sdpa::Index;
using sdpa::mask::Align;
namespace mask = sdpa::mask;
namespace scale = sdpa::scale;
namespace kernel = sdpa::kernel;

TEMPLATE_TEST_CASE("logits near and past the fp32 exp limit stay finite  [seed C13]", "[extreme]", float, double) {
  using T = TestType;
  // One query, keys whose unscaled logits are q.k = s * (0, 1, 2, 3) for s around ln(FLT_MAX).
  for (const double s : {80.0, 88.7, 88.8, 100.0, 1e4, 1e30}) {
    DYNAMIC_SECTION("logit spacing " << s) {
      Mat<T> q(1, 1), k(4, 1);
      q << T(s);
      k << T(0), T(1), T(2), T(3);
      const Mat<T> v = randn<T>(4, 3, 11);
      forEachKernel([&](const auto& kern, const char* name) {
        INFO(name);
        const auto fwd = sdpa::attentionForward(kern, q, k, v, scale::None{});
        const auto gold = referenceAttention<long double>(q, k, v, 1.0L);
        CHECK(fwd.output.allFinite());
        CHECK(std::isfinite(double(fwd.logSumExp(0))));
        // Spacing >= 80 puts all but 1e-34 of the weight on the last key: the output is its v row.
        CHECK(maxAbsDiff(fwd.output, gold.output.template cast<double>()) <= errorBound<T>(0, v.cwiseAbs().maxCoeff()));
        const double lse = double(gold.logSumExp(0));
        CHECK(std::abs(double(fwd.logSumExp(0)) - lse) <= 8 * double(std::numeric_limits<T>::epsilon()) * lse);
      });
    }
  }
}

TEST_CASE("1e30 magnitudes: finite logits give a one-hot row, overflowing ones a NaN row  [seed C13]", "[extreme]") {
  Mat<float> v(2, 2);
  v << 1, 2, 3, 4;
  // q.k = 1e30 * (1, 2): finite in float, the softmax is one-hot on key 1, lse = 2e30.
  Mat<float> k(2, 1);
  k << 1, 2;
  const Mat<float> q = Mat<float>::Constant(3, 1, 1e30f);
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    const auto fwd = sdpa::attentionForward(kern, q, k, v, scale::None{});
    CHECK((fwd.output.col(0).array() == 3.0f).all());
    CHECK((fwd.output.col(1).array() == 4.0f).all());
    CHECK((fwd.logSumExp.array() == 2e30f).all());
  });
  // Row 1 only: q.k = 1e20 * 2e20 = 2e40 overflows float to +inf, a visible +inf logit, so that
  // row is NaN (NUMERICS.md) and row 0 is untouched; in double both rows are finite.
  Mat<float> q2(2, 1), k2(2, 1);
  q2 << 1, 1e20f;
  k2 << 1, 2e20f;
  k2(0, 0) = 1e-30f;
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    const auto fwd = sdpa::attentionForward(kern, q2, k2, v, scale::None{});
    CHECK(fwd.output.row(0) == v.row(1));  // logits (1e-30, 2e20): one-hot on key 1
    CHECK(std::isnan(fwd.output(1, 0)));
    CHECK(std::isnan(fwd.output(1, 1)));
    const auto fwdD = sdpa::attentionForward(kern, q2.cast<double>().eval(), k2.cast<double>().eval(),
                                             v.cast<double>().eval(), scale::None{});
    CHECK(fwdD.output.allFinite());
    CHECK(fwdD.output.row(1) == v.row(1).cast<double>());
  });
}

TEMPLATE_TEST_CASE("all-equal logits give uniform weights and logSumExp = c + log n_k", "[extreme]", float, double) {
  using T = TestType;
  const Index nK = 1000;
  const Mat<T> q = Mat<T>::Constant(3, 8, T(0.5)), k = Mat<T>::Constant(nK, 8, T(2));  // logits 8 for every key
  const Mat<T> v = randn<T>(nK, 5, 12);
  const Mat<T> mean = v.colwise().mean();
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    const auto fwd = sdpa::attentionForward(kern, q, k, v, scale::None{});
    // Summing n_k terms: (n_k + 2) eps of the largest |v| bounds the error of any order.
    const double bound = double(nK + 2) * double(std::numeric_limits<T>::epsilon()) * double(v.cwiseAbs().maxCoeff());
    for (Index i = 0; i < 3; ++i) CHECK(maxAbsDiff(fwd.output.row(i), mean) <= bound);
    const double lse = 8.0 + std::log(double(nK));
    CHECK((fwd.logSumExp.template cast<double>().array() - lse).abs().maxCoeff() <=
          8 * double(std::numeric_limits<T>::epsilon()) * lse);
  });
}

TEMPLATE_TEST_CASE("n_k = 1: the weight is exactly 1, for any logit", "[extreme]", float, double) {
  using T = TestType;
  Mat<T> q(4, 2), k(1, 2), v(1, 3);
  q << 1, 2, -1e6, 3, 1e-40, 0, 1e15, 1e15;
  k << 1e10, -2;
  v << 1.5, -2.5, 1e-30;
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    const auto fwd = sdpa::attentionForward(kern, q, k, v, scale::None{});
    for (Index i = 0; i < 4; ++i) {
      INFO("row " << i);
      CHECK(fwd.output.row(i) == v.row(0));
    }
  });
}

TEMPLATE_TEST_CASE("d_k = 1 and denormal queries", "[extreme]", float, double) {
  using T = TestType;
  const Mat<T> k = randn<T>(37, 1, 13), v = randn<T>(37, 4, 14);
  Mat<T> q = randn<T>(9, 1, 15);
  q(3, 0) = std::numeric_limits<T>::denorm_min();
  q(4, 0) = std::numeric_limits<T>::min() / T(8);  // a denormal
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    checkForwardWith<T>(kern, q, k, v, scale::InvSqrtDk{}, mask::None{}, 1.0L, allVisible(), noBias());
    // A denormal query gives logits that round to 0 against O(1) keys: uniform weights.
    const auto fwd = sdpa::attentionForward(kern, q, k, v);
    const Mat<T> mean = v.colwise().mean();
    const double bound = 39 * double(std::numeric_limits<T>::epsilon()) * double(v.cwiseAbs().maxCoeff());
    CHECK(maxAbsDiff(fwd.output.row(3), mean) <= bound);
  });
}

TEMPLATE_TEST_CASE("fully masked rows: output 0, logSumExp -inf, zero gradients, by every hiding mask", "[extreme]",
                   float, double) {
  using T = TestType;
  const Mat<T> q = randn<T>(5, 4, 19), k = randn<T>(7, 4, 20), v = randn<T>(7, 3, 21), dOut = randn<T>(5, 3, 22);
  Eigen::Matrix<bool, -1, -1> keep = Eigen::Matrix<bool, -1, -1>::Constant(5, 7, true);
  keep.row(2).setConstant(false);
  Mat<T> bias = Mat<T>::Zero(5, 7);
  bias.row(2).setConstant(-std::numeric_limits<T>::infinity());
  auto check = [&](const auto& kern, const auto& m, Index maskedRow) {
    const auto fwd = sdpa::attentionForward(kern, q, k, v, scale::InvSqrtDk{}, m);
    CHECK(fwd.logSumExp(maskedRow) == -std::numeric_limits<T>::infinity());
    CHECK((fwd.output.row(maskedRow).array() == T(0)).all());
    CHECK(fwd.output.allFinite());
    const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dOut, scale::InvSqrtDk{}, m);
    CHECK((g.dq.row(maskedRow).array() == T(0)).all());
    CHECK(g.dq.allFinite());
    CHECK(g.dk.allFinite());
    CHECK(g.dv.allFinite());
    CHECK(std::isfinite(double(g.dscale)));
  };
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    check(kern, mask::Keep{keep}, 2);
    check(kern, mask::Bias{bias}, 2);
    check(kern, mask::combine(mask::KeyLength{0}), 0);
    const auto fwd = sdpa::attentionForward(kern, q, k, v, scale::InvSqrtDk{}, mask::KeyLength{0});
    const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dOut, scale::InvSqrtDk{}, mask::KeyLength{0});
    CHECK(g.dk.isZero(0));  // no key is seen by any row
    CHECK(g.dv.isZero(0));
  });
}

TEMPLATE_TEST_CASE("fully masked rows by a causal mask, Keep and Bias: output 0 and logSumExp -inf, never NaN",
                   "[extreme][mask]", float, double) {
  using T = TestType;
  constexpr T inf = std::numeric_limits<T>::infinity();
  const Mat<T> q = randn<T>(6, 8, 1), k = randn<T>(4, 8, 2), v = randn<T>(4, 3, 3);
  Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic> keep =
      Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic>::Constant(6, 4, true);
  keep.row(3).setConstant(false);
  Mat<T> bias = Mat<T>::Zero(6, 4);
  bias.row(5).setConstant(-inf);
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    // LowerRight causal with n_q > n_k hides every key from the first n_q - n_k queries.
    const auto f = sdpa::attentionForward(kern, q, k, v, scale::InvSqrtDk{}, mask::Causal{Align::LowerRight});
    for (Index i = 0; i < 2; ++i) {
      CHECK(f.logSumExp(i) == -inf);
      CHECK(f.output.row(i).isZero(0));
    }
    for (Index i = 2; i < 6; ++i) CHECK(std::isfinite(f.logSumExp(i)));
    // The last query sees every key: its row equals unmasked attention.
    const auto all = sdpa::attention(kern, q.bottomRows(1), k, v);
    CHECK(maxAbsDiff(f.output.bottomRows(1), all) <= 4 * std::numeric_limits<T>::epsilon());
    // An all-false Keep row and an all -inf Bias row.
    const auto f1 = sdpa::attentionForward(kern, q, k, v, scale::None{}, mask::Keep{keep});
    CHECK(f1.logSumExp(3) == -inf);
    CHECK(f1.output.row(3).isZero(0));
    CHECK(f1.output.allFinite());
    const auto f2 = sdpa::attentionForward(kern, q, k, v, scale::None{}, mask::Bias{bias});
    CHECK(f2.logSumExp(5) == -inf);
    CHECK(f2.output.row(5).isZero(0));
    CHECK(f2.output.allFinite());
  });
}

TEMPLATE_TEST_CASE("values at hidden positions never reach the output, even NaN and inf", "[extreme][mask]", float,
                   double) {
  using T = TestType;
  constexpr T nan = std::numeric_limits<T>::quiet_NaN(), inf = std::numeric_limits<T>::infinity();
  const Mat<T> q = randn<T>(5, 6, 1), k = randn<T>(5, 6, 2), v = randn<T>(5, 4, 3);
  const mask::Causal causal{Align::UpperLeft};
  // Key 4 is visible only to query 4; poison it and drop query 4 from the comparison.
  Mat<T> kBad = k, vBad = v;
  kBad(4, 0) = nan;
  vBad(4, 1) = inf;
  vBad(4, 2) = nan;
  // A NaN bias at a visible position poisons exactly its row; NaN at a position the same
  // bias hides cannot exist (-inf is how Bias hides), so composition with Keep covers that case.
  Mat<T> bias = randn<T>(5, 5, 4);
  bias(1, 3) = nan;
  bias(2, 0) = -inf;
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    const auto clean = sdpa::attentionForward(kern, q, k, v, scale::InvSqrtDk{}, causal);
    const auto dirty = sdpa::attentionForward(kern, q, kBad, vBad, scale::InvSqrtDk{}, causal);
    // Equal up to summation order: a non-finite v takes the path that skips zero weights.
    CHECK(maxAbsDiff(dirty.output.topRows(4), clean.output.topRows(4)) <= 4 * std::numeric_limits<T>::epsilon());
    CHECK(dirty.logSumExp.head(4) == clean.logSumExp.head(4));
    // Query 4 sees the poisoned key: NaN propagates to that row only (defined behaviour).
    CHECK(dirty.output.row(4).hasNaN());
    const auto withBias = sdpa::attentionForward(kern, q, k, v, scale::None{}, mask::Bias{bias});
    CHECK(withBias.output.row(1).hasNaN());
    CHECK(std::isnan(withBias.logSumExp(1)));
    CHECK(withBias.output.topRows(1).allFinite());
    CHECK(withBias.output.bottomRows(3).allFinite());
  });
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

TEST_CASE("backward: products that overflow at hidden positions do not leak into the gradients",
          "[extreme][backward]") {
  // Causal, 6 x 6. Key 3's v is near FLT_MAX: dP = dO v^T overflows to inf in rows 0-2 (dO = 2),
  // where key 3 is hidden. Query 2 is near FLT_MAX: with tau = 7 the folded tau q overflows,
  // and is multiplied by the zero dS of the keys row 2 does not see. Both are finite inputs
  // (found by tests/fuzz); row 2 itself overflows in every kernel.
  Mat<float> q = randn<float>(6, 2, 23), k = randn<float>(6, 2, 24), v = randn<float>(6, 3, 25);
  Mat<float> dOut = Mat<float>::Constant(6, 3, 2.0f);
  dOut.bottomRows(3).setConstant(0.5f);
  v(3, 0) = 3e38f;
  q(2, 0) = 3e38f;
  const auto causal = mask::Causal{mask::Align::UpperLeft};
  for (const double tau : {1.0, 7.0}) {
    DYNAMIC_SECTION("tau " << tau) {
      const scale::Constant sc{tau};
      const auto fwdN = sdpa::attentionForward(sdpa::kernel::Naive{}, q, k, v, sc, causal);
      const auto gN = sdpa::attentionBackward(sdpa::kernel::Naive{}, q, k, v, fwdN, dOut, sc, causal);
      forEachKernel([&](const auto& kern, const char* name) {
        INFO(name);
        const auto fwd = sdpa::attentionForward(kern, q, k, v, sc, causal);
        const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dOut, sc, causal);
        for (Index i = 0; i < 6; ++i) {
          INFO("row " << i);
          CHECK(g.dq.row(i).allFinite() == gN.dq.row(i).allFinite());
          CHECK(g.dk.row(i).allFinite() == gN.dk.row(i).allFinite());
          CHECK(g.dv.row(i).allFinite() == gN.dv.row(i).allFinite());
          if (i < 2) CHECK(g.dq.row(i).allFinite());
          if (i >= 3) CHECK((g.dk.row(i).allFinite() && g.dv.row(i).allFinite()));
        }
      });
    }
  }
}

TEST_CASE("backward: finite dP - D that overflows at a key of weight 0 does not make NaN", "[extreme][backward]") {
  // Unscaled logits 200 and 0: weights exactly 1 and 0 in float. dP = dO v^T = (-2e38, 2e38) are
  // finite, D = sum_j P_j dP_j = -2e38, so dP - D at key 1 is 4e38 = inf, and its weight 0 times
  // inf would make dL, and every gradient it enters, NaN. The plain computation's dL there is 0
  // (found by tests/fuzz: crash-0cb1ed82...). Several queries and keys, so that tiles hold both.
  const Index n = 6;
  Mat<float> q = Mat<float>::Ones(n, 1), k = Mat<float>::Zero(n, 1), v(n, 2);
  for (Index j = 0; j < n; ++j) {
    k(j, 0) = j % 3 == 0 ? 200.0f : 0.0f;
    v(j, 0) = j % 3 == 0 ? -2e38f : 2e38f;
    v(j, 1) = float(j);
  }
  const Mat<float> dOut = Mat<float>::Constant(n, 2, 1.0f);
  const sdpa::scale::None unscaled;
  const auto fwdN = sdpa::attentionForward(sdpa::kernel::Naive{}, q, k, v, unscaled);
  const auto gN = sdpa::attentionBackward(sdpa::kernel::Naive{}, q, k, v, fwdN, dOut, unscaled);
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    const auto fwd = sdpa::attentionForward(kern, q, k, v, unscaled);
    const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dOut, unscaled);
    // Keys 0 and 3 share the weight: dL = P (dP - D) = 0 at every key (dP is the same at both).
    CHECK(g.dq.isZero(0));
    CHECK(g.dk.isZero(0));
    CHECK(std::isfinite(g.dscale));
    CHECK(g.dscale == 0);
    CHECK(g.dv.allFinite());
    CHECK(maxAbsDiff(g.dv, gN.dv) <= 1e-6);
  });
}

TEST_CASE("backward: an infinite D from another tile leaves the keys of weight 0 with zero gradients",
          "[extreme][backward]") {
  // Unscaled logits 1, 1 and -200: weights 0.5, 0.5 and exactly 0 in float. dP = dO v^T is inf at
  // key 1 (v = 3e38, dO = 2), so D = sum_j P_j dP_j is inf and the gradients of the two keys
  // that share the weight are not finite: float's rounding, not a defect. Keys 2 to 5 have weight
  // 0 and finite dP: dL = 0 there whatever D is, so their dk and dv are 0. With Tiled{2, 3} keys
  // 3 to 5 form a tile whose dP has headroom; its plain path once formed 0 * (dP - D) = NaN
  // (found by tests/fuzz: crash-cb6704e2...).
  const Index nQ = 2, nK = 6;
  const Mat<float> q = Mat<float>::Ones(nQ, 1), dOut = Mat<float>::Constant(nQ, 1, 2.0f);
  Mat<float> k(nK, 1), v(nK, 1);
  k << 1, 1, -200, -200, -200, -200;
  v << 1, 3e38f, 1, 2, 3, 4;
  const sdpa::scale::None unscaled;
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    const auto fwd = sdpa::attentionForward(kern, q, k, v, unscaled);
    const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dOut, unscaled);
    CHECK(g.dk.bottomRows(4).isZero(0));
    CHECK(g.dv.bottomRows(4).isZero(0));
    CHECK(g.dv.topRows(2).allFinite());  // P^T dO: 0.5 x 2 at each, no dP in it
  });
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

TEST_CASE("a scale above 1 multiplies the logits, not q: |q| near the largest float with tiny keys",
          "[extreme][tiled]") {
  // tau = 5.6, q_c = 3e38 against k_c = 1e-40 (subnormal): q_c k_c = 3e-2 and every logit is
  // finite, but a folded tau q_c is inf, which made the tiled row NaN (found by tests/fuzz).
  // Every kernel now computes tau (q k^T) where |tau| > 1, as the plain computation does, and
  // agrees with the oracle; |tau| <= 1 keeps the fold, where it cannot overflow. At tau = 1 the
  // fold of base-2 tiles (tau log2(e) q_c = 4.3e38) would overflow: those tiles are not taken.
  const Index nQ = 7, nK = 11, dK = 3, dV = 2;
  Mat<float> q = randn<float>(nQ, dK, 61), k = randn<float>(nK, dK, 62);
  const Mat<float> v = randn<float>(nK, dV, 63), dOut = randn<float>(nQ, dV, 64);
  q.col(2).setConstant(3e38f);
  k.col(2).setConstant(1e-40f);
  for (const double tau : {5.6, -2.0, 0.75, 1.0}) {
    DYNAMIC_SECTION("tau " << tau) {
      const scale::Constant sc{tau};
      const auto causal = mask::Causal{mask::Align::UpperLeft};
      checkEveryKernel<float>(
          q, k, v, sc, causal, (long double)tau, [](Index i, Index j) { return j <= i; }, noBias());
      const auto gold =
          referenceBackward<long double>(q, k, v, dOut, (long double)tau, [](Index i, Index j) { return j <= i; });
      const auto plain =
          referenceBackward<float>(q, k, v, dOut, (long double)tau, [](Index i, Index j) { return j <= i; });
      forEachKernel([&](const auto& kern, const char* name) {
        INFO(name);
        const auto fwd = sdpa::attentionForward(kern, q, k, v, sc, causal);
        const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dOut, sc, causal);
        // (dk = tau dS^T q may overflow with q at 3e38, in the plain computation too: not checked.)
        REQUIRE(g.dq.allFinite());
        REQUIRE(g.dv.allFinite());
        const Mat<double> gdv = gold.dv.cast<double>();
        CHECK(maxAbsDiff(g.dv, gdv) <= errorBound<float>(maxAbsDiff(plain.dv, gdv), maxAbs(gdv)));
        // dq's third column is tau sum_j dS_ij k_j2 = O(1e-40 tau): compare the first two.
        const Mat<double> gdq = gold.dq.cast<double>().leftCols(2);
        CHECK(maxAbsDiff(g.dq.leftCols(2), gdq) <=
              errorBound<float>(maxAbsDiff(plain.dq.leftCols(2), gdq), maxAbs(gdq)));
      });
    }
  }
}

TEST_CASE("q near the largest float in one entry, stored by columns or by keys, over several heads",
          "[extreme][tiled]") {
  // The scan that bounds a head's logits (whether base-2 tiles may fold log2(e) into q) reads
  // every entry of every head in either storage order: one q entry of 3e38, in the last row and
  // column of head 1, against keys of 1e-40 in that column, tau = 1 (3e38 log2(e) overflows).
  const Index n = 9, d = 4, H = 3;
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Mat<float> q = randn<float>(n, H * d, 71), k = randn<float>(n, H * d, 72);
  const Mat<float> v = randn<float>(n, H * d, 73);
  q(n - 1, 2 * d - 1) = 3e38f;
  k.col(2 * d - 1).setConstant(1e-40f);
  const RowMajor qr = q, kr = k, vr = v;
  const auto visible = [](Index, Index) { return true; };
  for (const Index h : {Index(0), Index(1), Index(2)}) {
    INFO("head " << h);
    const auto cols = [&](const auto& m) { return Mat<float>(m.middleCols(h * d, d)); };
    const auto gold = referenceAttention<long double>(cols(q), cols(k), cols(v), 1.0L, visible, noBias());
    const auto plain = referenceAttention<float>(cols(q), cols(k), cols(v), 1.0L, visible, noBias());
    const Mat<double> want = gold.output.template cast<double>();
    const double bound = errorBound<float>(maxAbsDiff(plain.output, want), maxAbs(want));
    const auto byColumns = sdpa::multiHeadAttention(q, k, v, sdpa::Heads{H}, scale::None{});
    const auto byKeys = sdpa::multiHeadAttention(qr, kr, vr, sdpa::Heads{H}, scale::None{});
    REQUIRE(byColumns.allFinite());
    REQUIRE(byKeys.allFinite());
    CHECK(maxAbsDiff(Mat<float>(byColumns.middleCols(h * d, d)), want) <= bound);
    CHECK(maxAbsDiff(Mat<float>(byKeys.middleCols(h * d, d)), want) <= bound);
    const auto one = sdpa::attentionForward(cols(qr), cols(kr), cols(vr), scale::None{});
    CHECK(maxAbsDiff(one.output, want) <= bound);
  }
}

TEMPLATE_TEST_CASE("d_k = 0 and d_v = 0 over many tiles, batch items and heads, forward and backward",
                   "[extreme][edge]", float, double) {
  // A zero-column matrix has no data: the tiled kernels must never form blocks of it at a row
  // offset (UB under UBSan, found by tests/fuzz). d_k = 0: every logit is 0 before the mask, so
  // ALiBi alone shapes the weights; d_v = 0: an empty output, a defined logSumExp, zero gradients.
  // Item 0 has n_q > n_k: its first 10 rows are fully masked (logSumExp -inf); its 150 rows are
  // two of the default kernel's query blocks.
  using T = TestType;
  const Index H = 4, Hkv = 2;
  const sdpa::Heads heads{H, Hkv};
  const auto layout = sdpa::BatchLayout::varlen({0, 150, 187}, {0, 140, 185});
  const auto m = mask::combine(mask::Causal{Align::LowerRight}, mask::Alibi::standard(H, Align::LowerRight));
  const scale::InvSqrtDk sc;
  for (const auto& [dK, dV] : {std::pair<Index, Index>{0, 3}, {5, 0}, {0, 0}}) {
    DYNAMIC_SECTION("d_k " << dK << ", d_v " << dV) {
      const Mat<T> q = randn<T>(187, H * dK, 31), k = randn<T>(185, Hkv * dK, 32), v = randn<T>(185, Hkv * dV, 33),
                   dO = randn<T>(187, H * dV, 34);
      const Mat<double> qd = q.template cast<double>(), kd = k.template cast<double>(), vd = v.template cast<double>(),
                        dOd = dO.template cast<double>();
      const auto goldF = sdpa::batchedAttentionForward(kernel::Naive{}, qd, kd, vd, layout, heads, sc, m);
      const auto gold = sdpa::batchedAttentionBackward(kernel::Naive{}, qd, kd, vd, goldF, dOd, layout, heads, sc, m);
      const auto naiveF = sdpa::batchedAttentionForward(kernel::Naive{}, q, k, v, layout, heads, sc, m);
      const auto naive = sdpa::batchedAttentionBackward(kernel::Naive{}, q, k, v, naiveF, dO, layout, heads, sc, m);
      for (const kernel::Tiled kern : {kernel::Tiled{}, kernel::Tiled{7, 5}}) {
        INFO("blocks " << kern.blockQ << " x " << kern.blockK);
        const auto fwd = sdpa::batchedAttentionForward(kern, q, k, v, layout, heads, sc, m);
        REQUIRE(fwd.output.rows() == 187);
        REQUIRE(fwd.output.cols() == H * dV);
        CHECK(maxAbsDiff(fwd.logSumExp, goldF.logSumExp) <=
              errorBound<T>(maxAbsDiff(naiveF.logSumExp, goldF.logSumExp), goldF.logSumExp.cwiseAbs().maxCoeff()));
        if (dV > 0)
          CHECK(maxAbsDiff(fwd.output, goldF.output) <=
                errorBound<T>(maxAbsDiff(naiveF.output, goldF.output), goldF.output.cwiseAbs().maxCoeff()));
        const auto g = sdpa::batchedAttentionBackward(kern, q, k, v, fwd, dO, layout, heads, sc, m);
        REQUIRE(g.dq.rows() == 187);
        REQUIRE(g.dq.cols() == H * dK);
        REQUIRE(g.dk.cols() == Hkv * dK);
        REQUIRE(g.dv.cols() == Hkv * dV);
        if (dV == 0) CHECK(g.dq.isZero(0));
        if (dV == 0) CHECK(g.dk.isZero(0));
        if (dK == 0) CHECK(g.dscale.isZero(0));  // dtau = sum dY q k^T with q k^T = 0
        CHECK(gradientDistance(g, gold) <= errorBound<T>(gradientDistance(naive, gold), gradientScale(gold)));
      }
    }
  }
}
