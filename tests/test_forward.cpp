// The forward pass against the long-double oracle: every scale policy and mask, awkward and empty
// shapes, fully masked rows, and every way of handing Eigen data to the API.
#include <sdpa/sdpa.hpp>

#include <limits>

#include "support/cases.hpp"

using namespace sdpa_test;
using sdpa::mask::Align;

namespace {

/// A keep-mask with about 30% hidden entries and query row 0 fully hidden (when n_q > 1).
Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic> randomKeep(Index nQ, Index nK, std::uint64_t seed) {
  const Mat<double> u = randn<double>(nQ, nK, seed);
  Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic> keep = (u.array() > -0.5).matrix();
  if (nQ > 1) keep.row(0).setConstant(false);
  return keep;
}

}  // namespace

TEMPLATE_TEST_CASE("forward matches the fp64 reference for every policy and mask  [seed C1]", "[forward]", float,
                   double) {
  using T = TestType;
  std::uint64_t seed = 100;
  for (const Shape& sh : standardShapes()) {
    INFO("shape " << toString(sh));
    const Mat<T> q = randn<T>(sh.nQ, sh.dK, ++seed), k = randn<T>(sh.nK, sh.dK, ++seed),
                 v = randn<T>(sh.nK, sh.dV, ++seed);
    const auto keep = randomKeep(sh.nQ, sh.nK, ++seed);
    Mat<T> bias = randn<T>(sh.nQ, sh.nK, ++seed);
    bias(0, 0) = -std::numeric_limits<T>::infinity();
    if (sh.nQ > 2) bias.row(2).setConstant(-std::numeric_limits<T>::infinity());
    const Index nQ = sh.nQ, nK = sh.nK;

    // Every kernel against one oracle per policy and mask.
    forEachPolicy<T>(sh.dK, [&](const auto& scale, long double tau, const char* name) {
      INFO("policy " << name);
      {
        INFO("mask None");
        checkEveryKernel<T>(q, k, v, scale, sdpa::mask::None{}, tau, allVisible(), noBias());
      }
      {
        INFO("mask Causal UpperLeft: tril(ones(L, S), 0)");
        checkEveryKernel<T>(
            q, k, v, scale, sdpa::mask::Causal{Align::UpperLeft}, tau, [](Index i, Index j) { return j <= i; },
            noBias());
      }
      {
        INFO("mask Causal LowerRight: tril(ones(L, S), S - L)");
        checkEveryKernel<T>(
            q, k, v, scale, sdpa::mask::Causal{Align::LowerRight}, tau,
            [=](Index i, Index j) { return j <= i + nK - nQ; }, noBias());
      }
      {
        INFO("mask Keep");
        checkEveryKernel<T>(
            q, k, v, scale, sdpa::mask::Keep{keep}, tau, [&](Index i, Index j) { return bool(keep(i, j)); }, noBias());
      }
      {
        INFO("mask Bias");
        checkEveryKernel<T>(
            q, k, v, scale, sdpa::mask::Bias{bias}, tau,
            [&](Index i, Index j) { return bias(i, j) != -std::numeric_limits<T>::infinity(); },
            [&](Index i, Index j) {
              return bias(i, j) == -std::numeric_limits<T>::infinity() ? 0.0L : (long double)bias(i, j);
            });
      }
    });
  }
}

TEMPLATE_TEST_CASE("empty inputs give empty or defined results", "[forward][edge]", float, double) {
  using T = TestType;
  constexpr T inf = std::numeric_limits<T>::infinity();
  SECTION("no queries: 0 x d_v output") {
    const auto f = sdpa::attentionForward(Mat<T>(0, 4), randn<T>(3, 4, 1), randn<T>(3, 2, 2));
    CHECK(f.output.rows() == 0);
    CHECK(f.output.cols() == 2);
    CHECK(f.logSumExp.size() == 0);
  }
  SECTION("no keys: every row fully masked, output 0, logSumExp -inf") {
    const auto f = sdpa::attentionForward(randn<T>(3, 4, 1), Mat<T>(0, 4), Mat<T>(0, 2));
    CHECK(f.output == Mat<T>::Zero(3, 2));
    CHECK((f.logSumExp.array() == -inf).all());
  }
  SECTION("d_k = 0: every logit is 0, attention is uniform, output is the mean of v") {
    const Mat<T> v = randn<T>(5, 3, 3);
    const auto f = sdpa::attentionForward(Mat<T>(2, 0), Mat<T>(5, 0), v);
    const Eigen::Matrix<T, 1, Eigen::Dynamic> mean = v.colwise().mean();
    for (Index i = 0; i < 2; ++i) CHECK(maxAbsDiff(f.output.row(i), mean) <= 4 * std::numeric_limits<T>::epsilon());
    CHECK(f.logSumExp.isApprox(Vec<T>::Constant(2, std::log(T(5)))));
  }
  SECTION("d_v = 0: n_q x 0 output, logSumExp still defined") {
    const auto f = sdpa::attentionForward(randn<T>(2, 3, 1), randn<T>(4, 3, 2), Mat<T>(4, 0));
    CHECK(f.output.rows() == 2);
    CHECK(f.output.cols() == 0);
    CHECK(f.logSumExp.allFinite());
  }
}

TEST_CASE("blocks, maps, row-major, fixed-size and expression inputs give identical results", "[forward][api]") {
  const Mat<float> big = randn<float>(40, 48, 7);
  const Mat<float> q = big.block(0, 0, 12, 16), k = big.block(12, 16, 20, 16), v = big.block(5, 32, 20, 8);
  const auto ref = sdpa::attentionForward(q, k, v);

  // Blocks of a larger matrix (outer stride != rows).
  const auto fromBlocks =
      sdpa::attentionForward(big.block(0, 0, 12, 16), big.block(12, 16, 20, 16), big.block(5, 32, 20, 8));
  CHECK(fromBlocks.output == ref.output);
  CHECK(fromBlocks.logSumExp == ref.logSumExp);

  // q.middleCols(...) as for a head of a packed multi-head input.
  Mat<float> packed(12, 48);
  packed.setZero();
  packed.middleCols(16, 16) = q;
  CHECK(sdpa::attention(packed.middleCols(16, 16), k, v) == ref.output);

  // Row-major copies.
  const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> qr = q, kr = k, vr = v;
  CHECK(sdpa::attention(qr, kr, vr) == ref.output);

  // Maps over raw buffers.
  std::vector<float> qbuf(q.data(), q.data() + q.size());
  const Eigen::Map<const Mat<float>> qm(qbuf.data(), 12, 16);
  CHECK(sdpa::attention(qm, k, v) == ref.output);

  // Expressions are evaluated once.
  CHECK(sdpa::attention(q * 1.0f, k.array().matrix(), v + Mat<float>::Zero(20, 8)) == ref.output);

  // Fixed-size matrices.
  const Eigen::Matrix<double, 3, 4> qf = randn<double>(3, 4, 1);
  const Eigen::Matrix<double, 5, 4> kf = randn<double>(5, 4, 2);
  const Eigen::Matrix<double, 5, 2> vf = randn<double>(5, 2, 3);
  CHECK(sdpa::attention(qf, kf, vf) == sdpa::attention(Mat<double>(qf), Mat<double>(kf), Mat<double>(vf)));
}

TEMPLATE_TEST_CASE("row-major q, k and v are read in place: the column-major result", "[forward][api][rowmajor]", float,
                   double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  using Acc = sdpa::internal::Accumulator<T>;
  using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const double eps = double(std::numeric_limits<Acc>::epsilon());
  const Index H = 4, G = 2, dK = 24, dV = 16;
  // Prefill (the fast kernel reads tiles of either order: the same bits for float and half
  // inputs), and decoding over key splits, of a few rows or (12) many (its products differ in
  // order only).
  for (const auto& [nQ, nK] : std::vector<std::pair<Index, Index>>{{70, 300}, {3, 5000}, {1, 777}, {12, 3000}}) {
    INFO(nQ << " x " << nK);
    const bool prefill = nQ > 32;
    const Mat<T> q = randn<double>(nQ, H * dK, 1).template cast<T>(),
                 k = randn<double>(nK, G * dK, 2).template cast<T>(),
                 v = randn<double>(nK, G * dV, 3).template cast<T>();
    const RowMat qr = q, kr = k, vr = v;
    const auto causal = sdpa::mask::Causal{Align::LowerRight};
    const auto col = sdpa::multiHeadAttentionForward(q, k, v, sdpa::Heads{H, G}, sdpa::scale::InvSqrtDk{}, causal);
    const auto row = sdpa::multiHeadAttentionForward(qr, kr, vr, sdpa::Heads{H, G}, sdpa::scale::InvSqrtDk{}, causal);
    // Maps of row-major buffers, as numpy and PyTorch hand them over.
    const Eigen::Map<const RowMat> qm(qr.data(), nQ, H * dK), km(kr.data(), nK, G * dK), vm(vr.data(), nK, G * dV);
    const auto mapped =
        sdpa::multiHeadAttentionForward(qm, km, vm, sdpa::Heads{H, G}, sdpa::scale::InvSqrtDk{}, causal);
    CHECK(mapped.output == row.output);
    if (prefill && !std::is_same_v<T, double>) {
      CHECK(row.output == col.output);
      CHECK(row.logSumExp == col.logSumExp);
    } else {
      // Sums of n_k terms in another order: each output within a few eps of the weighted mean's
      // scale, and for half outputs the roundings of two such floats.
      const Mat<double> a = row.output.template cast<double>(), b = col.output.template cast<double>();
      const double tol = 16 * eps * std::sqrt(double(nK)) * maxAbs(v.template cast<double>()) +
                         (std::is_same_v<T, Acc> ? 0.0 : 2 * double(Eigen::NumTraits<T>::epsilon()) * maxAbs(b));
      CHECK(maxAbsDiff(a, b) <= tol);
      CHECK(maxAbsDiff(row.logSumExp.template cast<double>(), col.logSumExp.template cast<double>()) <=
            16 * eps * std::sqrt(double(nK)) * 10);
    }
    // The single-head entry point and a head's block of the packed row-major inputs.
    const auto one = sdpa::attentionForward(qr.leftCols(dK), kr.leftCols(dK), vr.leftCols(dV));
    const auto oneCol = sdpa::attentionForward(q.leftCols(dK), k.leftCols(dK), v.leftCols(dV));
    if (prefill && !std::is_same_v<T, double>)
      CHECK(one.output == oneCol.output);
    else
      CHECK(maxAbsDiff(one.output.template cast<double>(), oneCol.output.template cast<double>()) <=
            16 * eps * std::sqrt(double(nK)) * maxAbs(v.template cast<double>()) +
                2 * double(Eigen::NumTraits<T>::epsilon()) * maxAbs(oneCol.output.template cast<double>()));
  }
}

TEST_CASE("the named entry points are the policies they name  [seed C1]", "[forward][api]") {
  const Mat<double> q = randn<double>(4, 64, 1), k = randn<double>(6, 64, 2), v = randn<double>(6, 3, 3);
  CHECK(sdpa::scaledDotProductAttention(q, k, v) == sdpa::attention(q, k, v, sdpa::scale::InvSqrtDk{}));
  CHECK(sdpa::scaledDotProductAttention(q, k, v) == sdpa::attention(q, k, v));
  CHECK(sdpa::dotProductAttention(q, k, v) == sdpa::attention(q, k, v, sdpa::scale::None{}));
  const sdpa::mask::Causal causal{Align::UpperLeft};
  CHECK(sdpa::dotProductAttention(q, k, v, causal) == sdpa::attention(q, k, v, sdpa::scale::None{}, causal));
  // Temperature{sqrt(d_k)} is the InvSqrtDk scale (seed C10).
  CHECK(maxAbsDiff(sdpa::attention(q, k, v, sdpa::scale::Temperature{8.0}), sdpa::scaledDotProductAttention(q, k, v)) <=
        1e-15);
}

TEMPLATE_TEST_CASE("attentionLogits and attentionWeights expose S and P", "[forward][api]", float, double) {
  using T = TestType;
  const Mat<T> q = randn<T>(5, 7, 1), k = randn<T>(6, 7, 2);
  const sdpa::mask::Causal causal{Align::LowerRight};
  const Mat<T> s = sdpa::attentionLogits(q, k, sdpa::scale::Constant{0.5}, causal);
  const Mat<T> p = sdpa::attentionWeights(q, k, sdpa::scale::Constant{0.5}, causal);
  const Mat<T> raw = q * k.transpose();
  for (Index i = 0; i < 5; ++i) {
    for (Index j = 0; j < 6; ++j) {
      if (j <= i + 1) {
        CHECK(std::abs(s(i, j) - T(0.5) * raw(i, j)) <= 4 * std::numeric_limits<T>::epsilon() * std::abs(raw(i, j)));
        CHECK(p(i, j) > 0);
      } else {
        CHECK(s(i, j) == -std::numeric_limits<T>::infinity());
        CHECK(p(i, j) == 0);
      }
    }
    CHECK(std::abs(p.row(i).sum() - T(1)) <= 8 * std::numeric_limits<T>::epsilon());
  }
}
