// Scale policies: their tau, the Learnable parameter, and tau as a temperature (seed C7, C10, C17).
#include <sdpa/sdpa.hpp>

#include <cmath>
#include <stdexcept>

#include "support/cases.hpp"
#include "support/finite_differences.hpp"

using namespace sdpa_test;
namespace scale = sdpa::scale;

static_assert(scale::IsPolicy<scale::InvSqrtDk> && scale::IsPolicy<scale::None> && scale::IsPolicy<scale::Constant> &&
              scale::IsPolicy<scale::Temperature> && scale::IsPolicy<scale::Learnable<float>>);
static_assert(!scale::IsPolicy<float> && !scale::IsPolicy<sdpa::mask::None>);
static_assert(sdpa::mask::IsMask<sdpa::mask::Causal> && !sdpa::mask::IsMask<scale::None>);
static_assert(scale::Learnable<double>::IsLearnable && !scale::InvSqrtDk::IsLearnable);

TEST_CASE("each policy's tau", "[scale]") {
  CHECK(scale::InvSqrtDk{}.value<double>(64) == 0.125);
  CHECK(scale::InvSqrtDk{}.value<float>(16) == 0.25f);
  CHECK(scale::InvSqrtDk{}.value<double>(0) == 1.0);  // d_k = 0: logits are 0, keep them finite
  CHECK(scale::None{}.value<double>(64) == 1.0);
  CHECK(scale::Constant{0.3}.value<double>(64) == 0.3);
  CHECK(scale::Constant{-2.0}.value<float>(1) == -2.0f);
  CHECK(scale::Temperature{4.0}.value<double>(7) == 0.25);
  CHECK(scale::Temperature{std::sqrt(64.0)}.value<double>(64) == scale::InvSqrtDk{}.value<double>(64));  // C10
}

TEST_CASE("invalid policy values are rejected at construction", "[scale][errors]") {
  CHECK_THROWS_AS(scale::Constant{std::nan("")}, std::invalid_argument);
  CHECK_THROWS_AS(scale::Constant{INFINITY}, std::invalid_argument);
  CHECK_THROWS_AS(scale::Temperature{0.0}, std::invalid_argument);
  CHECK_THROWS_AS(scale::Temperature{-1.0}, std::invalid_argument);
  CHECK_THROWS_AS(scale::Temperature{INFINITY}, std::invalid_argument);
  CHECK_THROWS_AS(scale::Learnable<float>{NAN}, std::invalid_argument);
  CHECK_THROWS_WITH(scale::Temperature{0.0}, Catch::Matchers::Contains("finite and > 0"));
}

TEMPLATE_TEST_CASE("Learnable starts at 1/sqrt(d_k) and accumulates its gradient  [seed C17]", "[scale][learnable]",
                   float, double) {
  using T = TestType;
  scale::Learnable<T> tau;
  CHECK_FALSE(tau.hasValue());
  CHECK(tau.template value<T>(64) == T(0.125));
  CHECK(tau.template value<T>(16) == T(0.25));
  CHECK_THROWS_AS(tau.value(), std::logic_error);
  CHECK(scale::Learnable<T>::forHeadDim(16).value() == T(0.25));
  CHECK(scale::Learnable<T>{T(1)}.template value<T>(64) == T(1));  // the start the seed warns about

  CHECK(tau.grad() == 0);
  tau.accumulateGrad(T(0.5));
  tau.accumulateGrad(T(-0.25));
  CHECK(tau.grad() == T(0.25));
  tau.setValue(tau.template value<T>(64) - T(0.1) * tau.grad());  // one SGD step
  CHECK(tau.hasValue());
  CHECK(tau.value() == T(0.125) - T(0.1) * T(0.25));
  tau.zeroGrad();
  CHECK(tau.grad() == 0);
  // A Learnable computes exactly what the Constant of its value does.
  const Mat<T> q = randn<T>(3, 64, 1), k = randn<T>(4, 64, 2), v = randn<T>(4, 2, 3);
  CHECK(sdpa::attention(q, k, v, scale::Learnable<T>{}) == sdpa::attention(q, k, v, scale::InvSqrtDk{}));
  CHECK(sdpa::attention(q, k, v, tau) == sdpa::attention(q, k, v, scale::Constant{double(tau.value())}));
}

TEMPLATE_TEST_CASE("tau multiplies q k^T; the mask is added after it and never scaled", "[scale]", float, double) {
  using T = TestType;
  const Mat<T> q = randn<T>(4, 9, 1), k = randn<T>(5, 9, 2);
  const Mat<T> bias = randn<T>(4, 5, 3);
  const Mat<T> raw = q * k.transpose();
  for (const double c : {0.1, 1.0, 3.0}) {
    const Mat<T> s = sdpa::attentionLogits(q, k, scale::Constant{c}, sdpa::mask::Bias{bias});
    const Mat<T> expected = T(c) * raw + bias;
    CHECK(maxAbsDiff(s, expected) <= 8 * std::numeric_limits<T>::epsilon() * (1 + expected.cwiseAbs().maxCoeff()));
  }
}

TEST_CASE("a higher temperature flattens the attention, a lower one sharpens it  [seed C10]", "[scale][seed]") {
  const Mat<double> q = randn<double>(32, 64, 1), k = randn<double>(128, 64, 2);
  double previous = -1;
  for (const double t : {0.5, 1.0, 2.0, 8.0, 32.0, 1e6}) {
    const Mat<double> p = sdpa::attentionWeights(q, k, scale::Temperature{t});
    double h = 0;
    for (Index i = 0; i < p.rows(); ++i) h += sdpa::softmaxEntropy(Eigen::RowVectorXd(p.row(i)));
    h /= double(p.rows());
    INFO("T = " << t << ": mean entropy " << h);
    CHECK(h > previous);
    previous = h;
  }
  CHECK(std::abs(previous - std::log(128.0)) < 1e-6);  // T -> inf: uniform over 128 keys
}

// scale::LogN: tau_i = c ln(n_i) / sqrt(d_k), n_i the keys row i sees. The oracle runs the
// plain loops one row at a time with that row's own tau (computed here in long double from the
// test's own visibility predicate), so it shares nothing with the library's q' = r q folding.
namespace {

using sdpa::mask::Align;

long double logNTau(long double c, Index visible, Index dK) {
  const long double invSqrt = dK > 0 ? 1.0L / std::sqrt((long double)dK) : 1.0L;
  return visible > 1 ? c * std::log((long double)visible) * invSqrt : 0.0L;
}

Index visibleCount(const VisibleFn& visible, Index i, Index nK) {
  Index n = 0;
  for (Index j = 0; j < nK; ++j) n += visible(i, j) ? 1 : 0;
  return n;
}

/// referenceAttention row by row, row i with tau_i in T (the plain loop in precision T rounds
/// tau_i to T as it would round any tau).
template <typename T, typename In>
RefResult<T> logNReference(const Mat<In>& q, const Mat<In>& k, const Mat<In>& v, long double c,
                           const VisibleFn& visible, long double softcap = 0) {
  RefResult<T> r{Mat<T>::Zero(q.rows(), v.cols()), Vec<T>(q.rows())};
  for (Index i = 0; i < q.rows(); ++i) {
    const T tau = T(logNTau(c, visibleCount(visible, i, k.rows()), q.cols()));
    const Mat<In> qi = q.row(i);
    const RefResult<T> ri = referenceAttention<T>(
        qi, k, v, (long double)tau, [&](Index, Index j) { return visible(i, j); }, noBias(), softcap);
    r.output.row(i) = ri.output.row(0);
    r.logSumExp(i) = ri.logSumExp(0);
  }
  return r;
}

/// referenceBackward row by row; dscale becomes dL/dc = sum_i ln(n_i) / sqrt(d_k) dL/dtau_i.
template <typename T, typename In>
RefGradients<T> logNReferenceBackward(const Mat<In>& q, const Mat<In>& k, const Mat<In>& v, const Mat<In>& dO,
                                      long double c, const VisibleFn& visible) {
  RefGradients<T> g{Mat<T>::Zero(q.rows(), q.cols()), Mat<T>::Zero(k.rows(), k.cols()),
                    Mat<T>::Zero(v.rows(), v.cols()), T(0), Mat<T>(0, 0)};
  for (Index i = 0; i < q.rows(); ++i) {
    const Index n = visibleCount(visible, i, k.rows());
    const T tau = T(logNTau(c, n, q.cols()));
    const Mat<In> qi = q.row(i), dOi = dO.row(i);
    const RefGradients<T> gi =
        referenceBackward<T>(qi, k, v, dOi, (long double)tau, [&](Index, Index j) { return visible(i, j); });
    g.dq.row(i) = gi.dq.row(0);
    g.dk += gi.dk;
    g.dv += gi.dv;
    g.dscale += T(logNTau(1.0L, n, q.cols())) * gi.dscale;
  }
  return g;
}

/// Largest |a - b| over dq, dk, dv and the scalar dscale; and the largest gradient entry.
template <typename GA, typename GB>
double logNGradientDistance(const GA& a, const GB& b) {
  return std::max({maxAbsDiff(a.dq, b.dq), maxAbsDiff(a.dk, b.dk), maxAbsDiff(a.dv, b.dv),
                   std::abs(double(a.dscale) - double(b.dscale))});
}
template <typename G>
double logNGradientScale(const G& g) {
  return std::max({maxAbs(g.dq), maxAbs(g.dk), maxAbs(g.dv), std::abs(double(g.dscale))});
}

}  // namespace

TEST_CASE("LogN: c ln(n) / sqrt(d_k), matching a training length, rejecting bad values", "[scale][logn]") {
  static_assert(scale::IsPolicy<scale::LogN> && scale::DependsOnKeyCount<scale::LogN> &&
                scale::DependsOnKeyCount<scale::PerHead<scale::LogN>> && !scale::DependsOnKeyCount<scale::InvSqrtDk>);
  CHECK(scale::LogN{0.5}.value<double>(64) == 0.0625);
  CHECK(scale::LogN::rowFactor(0) == 0.0);
  CHECK(scale::LogN::rowFactor(1) == 0.0);  // one key: tau 0, its weight is 1 anyway
  CHECK(scale::LogN::rowFactor(512) == std::log(512.0));
  // matching(L): the plain 1/sqrt(d_k) at L visible keys; the default is matching(512).
  CHECK(scale::LogN::matching(2048).value() * scale::LogN::rowFactor(2048) == Approx(1.0).epsilon(1e-15));
  CHECK(scale::LogN{}.value() == scale::LogN::matching(512).value());
  CHECK_THROWS_WITH(scale::LogN::matching(1), Catch::Matchers::Contains("length >= 2"));
  CHECK_THROWS_AS(scale::LogN{NAN}, std::invalid_argument);
  scale::LogN logN;
  CHECK_THROWS_AS(logN.setValue(INFINITY), std::invalid_argument);
  logN.accumulateGrad(0.5);
  logN.accumulateGrad(0.25);
  CHECK(logN.grad() == 0.75);
  logN.zeroGrad();
  CHECK(logN.grad() == 0.0);
}

TEMPLATE_TEST_CASE("LogN: each row's tau follows the keys it sees, in every kernel and under every mask",
                   "[scale][logn]", float, double) {
  using T = TestType;
  namespace mask = sdpa::mask;
  const long double c = 0.6L;
  const scale::LogN logN{double(c)};
  for (const Shape& s : {Shape{1, 1, 1, 1}, Shape{7, 3, 5, 6}, Shape{17, 33, 13, 9}, Shape{31, 100, 20, 7}}) {
    INFO(toString(s));
    const Mat<T> q = randn<T>(s.nQ, s.dK, 11), k = randn<T>(s.nK, s.dK, 12), v = randn<T>(s.nK, s.dV, 13);
    const Index nQ = s.nQ, nK = s.nK, off = nK - nQ;
    const auto check = [&](const auto& m, const VisibleFn& visible, const char* name, long double softcap = 0) {
      INFO(name);
      const auto gold = logNReference<long double>(q, k, v, c, visible, softcap);
      const auto naive = logNReference<T>(q, k, v, c, visible, softcap);
      forEachKernel([&](const auto& kern, const char* kernelName) {
        INFO("kernel " << kernelName);
        checkForwardAgainst<T>(kern, q, k, v, logN, m, gold, naive);
      });
    };
    check(mask::None{}, allVisible(), "no mask: n_i = n_k");
    check(
        mask::Causal{Align::UpperLeft}, [](Index i, Index j) { return j <= i; }, "causal, upper left");
    check(
        mask::Causal{Align::LowerRight}, [=](Index i, Index j) { return j <= i + off; }, "causal, lower right");
    check(
        mask::SlidingWindow{4, 2, Align::LowerRight},
        [=](Index i, Index j) { return j >= i + off - 4 && j <= i + off + 2; }, "sliding window");
    check(
        mask::combine(mask::Softcap{3.0}, mask::KeyLength{(nK + 1) / 2}),
        [=](Index, Index j) { return j < (nK + 1) / 2; }, "key length (with a softcap: tau before the cap)", 3.0L);
  }
}

TEMPLATE_TEST_CASE("LogN backward: dq, dk, dv and dL/dc against the oracle and central differences",
                   "[scale][logn][backward]", float, double) {
  using T = TestType;
  namespace mask = sdpa::mask;
  const long double c = 0.45L;
  const Index nQ = 13, nK = 21, dK = 6, dV = 5;
  const Mat<T> q = randn<T>(nQ, dK, 21, 2.0), k = randn<T>(nK, dK, 22), v = randn<T>(nK, dV, 23),
               dO = randn<T>(nQ, dV, 24);
  const auto m = mask::Causal{Align::LowerRight};
  const VisibleFn visible = [=](Index i, Index j) { return j <= i + nK - nQ; };
  const auto gold = logNReferenceBackward<long double>(q, k, v, dO, c, visible);
  const auto naive = logNReferenceBackward<T>(q, k, v, dO, c, visible);
  const double scaleOf = logNGradientScale(gold);
  forEachKernel([&](const auto& kern, const char* kernelName) {
    INFO("kernel " << kernelName);
    scale::LogN logN{double(c)};
    const auto fwd = sdpa::attentionForward(kern, q, k, v, logN, m);
    const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dO, logN, m);
    const double err = logNGradientDistance(g, gold), naiveErr = logNGradientDistance(naive, gold);
    INFO("gradient error " << err << ", plain loop in the same precision " << naiveErr);
    CHECK(err <= errorBound<T>(naiveErr, scaleOf));
    CHECK(logN.grad() == double(g.dscale));  // a non-const LogN accumulates dL/dc
  });
  if constexpr (std::is_same_v<T, double>) {
    // dL/dc and dL/dq by central differences of L = sum(dO * O) through the library's forward.
    Eigen::MatrixXd cc(1, 1);
    cc(0, 0) = double(c);
    Eigen::MatrixXd qq = q;
    const auto loss = [&](const Eigen::MatrixXd& qx, double cx) {
      return (sdpa::attention(sdpa::kernel::Naive{}, qx, k, v, scale::LogN{cx}, m).array() * dO.array()).sum();
    };
    const Eigen::MatrixXd fdC = finiteDifferences(cc, [&] { return loss(q, cc(0, 0)); });
    const Eigen::MatrixXd fdQ = finiteDifferences(qq, [&] { return loss(qq, double(c)); });
    const auto g = sdpa::attentionBackward(q, k, v, sdpa::attentionForward(q, k, v, scale::LogN{double(c)}, m), dO,
                                           scale::LogN{double(c)}, m);
    CHECK(std::abs(g.dscale - fdC(0, 0)) <= 1e-7 * (1 + std::abs(fdC(0, 0))));
    CHECK(maxAbsDiff(g.dq, fdQ) <= 1e-7 * (1 + maxAbs(fdQ)));
  }
}

TEST_CASE("LogN over heads and batches: per-head c, GQA, padded items each count their own keys",
          "[scale][logn][multihead]") {
  namespace mask = sdpa::mask;
  using sdpa::BatchLayout;
  using sdpa::Heads;
  const Index H = 4, Hkv = 2, dK = 8, dV = 3, nQ = 9, nK = 12;
  const std::vector<double> cs = {0.3, 0.5, 0.8, 1.1};
  scale::PerHead<scale::LogN> perHead(std::vector<scale::LogN>(cs.begin(), cs.end()));
  // Two items padded to nQ x nK with valid lengths (6, 9) and (9, 12), causal lower right: row i
  // of an item with valid lengths (a, b) sees i + b - a + 1 keys.
  const BatchLayout layout = BatchLayout::padded(2, nQ, nK, {6, 9}, {9, 12});
  const Mat<double> q = randn<double>(2 * nQ, H * dK, 31), k = randn<double>(2 * nK, Hkv * dK, 32),
                    v = randn<double>(2 * nK, Hkv * dV, 33), dO = randn<double>(2 * nQ, H * dV, 34);
  const auto m = mask::Causal{Align::LowerRight};
  Mat<long double> expectOut = Mat<long double>::Zero(2 * nQ, H * dV),
                   expectDq = Mat<long double>::Zero(2 * nQ, H * dK);
  Vec<long double> expectDc = Vec<long double>::Zero(H);
  for (Index b = 0; b < 2; ++b) {
    const Index a = layout.queryLengths[size_t(b)], kl = layout.keyLengths[size_t(b)];
    for (Index h = 0; h < H; ++h) {
      const Index g = h / (H / Hkv);
      const Mat<double> qh = q.block(b * nQ, h * dK, a, dK), kh = k.block(b * nK, g * dK, kl, dK),
                        vh = v.block(b * nK, g * dV, kl, dV), dOh = dO.block(b * nQ, h * dV, a, dV);
      const VisibleFn visible = [=](Index i, Index j) { return j <= i + kl - a; };
      expectOut.block(b * nQ, h * dV, a, dV) = logNReference<long double>(qh, kh, vh, cs[size_t(h)], visible).output;
      const auto gr = logNReferenceBackward<long double>(qh, kh, vh, dOh, cs[size_t(h)], visible);
      expectDq.block(b * nQ, h * dK, a, dK) = gr.dq;
      expectDc(h) += gr.dscale;
    }
  }
  forEachKernel([&](const auto& kern, const char* kernelName) {
    INFO("kernel " << kernelName);
    const auto fwd = sdpa::batchedAttentionForward(kern, q, k, v, layout, Heads{H, Hkv}, perHead, m);
    CHECK(maxAbsDiff(fwd.output, expectOut.cast<double>()) <= 1e-13);
    const auto g = sdpa::batchedAttentionBackward(kern, q, k, v, fwd, dO, layout, Heads{H, Hkv}, perHead, m);
    CHECK(maxAbsDiff(g.dq, expectDq.cast<double>()) <= 1e-13);
    CHECK(maxAbsDiff(g.dscale, expectDc.cast<double>()) <= 1e-12);
  });
  // Each head accumulated its own dL/dc, once per kernel above.
  for (Index h = 0; h < H; ++h) CHECK(perHead.head(h).grad() == Approx(double(4 * expectDc(h))).epsilon(1e-12));
}

TEMPLATE_TEST_CASE("LogN on half inputs computes the float call on the converted values", "[scale][logn][half]",
                   Eigen::half, Eigen::bfloat16) {
  using H = TestType;
  const Mat<H> q = toHalf<H>(randn<float>(70, 16, 41)), k = toHalf<H>(randn<float>(90, 16, 42)),
               v = toHalf<H>(randn<float>(90, 8, 43));
  const auto m = sdpa::mask::Causal{Align::LowerRight};
  const auto half = sdpa::attentionForward<float>(q, k, v, scale::LogN{}, m);
  const auto single = sdpa::attentionForward<float>(q.template cast<float>(), k.template cast<float>(),
                                                    v.template cast<float>(), scale::LogN{}, m);
  CHECK(half.output == single.output);
  CHECK(half.logSumExp == single.logSumExp);
  const auto packed = sdpa::multiHeadAttentionForward<H>(q, k, v, sdpa::Heads{2}, scale::LogN{}, m);
  const auto packedF = sdpa::multiHeadAttentionForward(q.template cast<float>(), k.template cast<float>(),
                                                       v.template cast<float>(), sdpa::Heads{2}, scale::LogN{}, m);
  CHECK(packed.output == packedF.output.template cast<H>());
}

TEST_CASE("LogN keeps a standing-out key's weight at every length; a fixed tau dilutes it", "[scale][logn]") {
  // d_k = 1, q = 1, key 0 at m = 1 / c, the others at 0: with LogN key 0's logit is ln(n), so its
  // weight is n / (n + n - 1) -> 1/2 at every n; with tau = 1 it is e^2 / (e^2 + n - 1).
  const double c = 0.5;
  for (const Index n : {Index(16), Index(1024), Index(65536)}) {
    Mat<float> q = Mat<float>::Ones(1, 1), k = Mat<float>::Zero(n, 1), v = Mat<float>::Zero(n, 1);
    k(0, 0) = float(1 / c);
    v(0, 0) = 1;
    const double logN = double(sdpa::attention(q, k, v, scale::LogN{c})(0, 0));
    const double fixed = double(sdpa::attention(q, k, v, scale::Constant{1.0})(0, 0));
    INFO("n = " << n << ": weight of key 0 " << logN << " (LogN), " << fixed << " (fixed tau)");
    CHECK(logN == Approx(double(n) / double(2 * n - 1)).epsilon(1e-5));
    CHECK(fixed == Approx(std::exp(2.0) / (std::exp(2.0) + double(n - 1))).epsilon(1e-5));
  }
}

TEST_CASE("LogN with a DiagnosticsSink is refused with a clear error", "[scale][logn][errors]") {
  const Mat<double> q = randn<double>(3, 4, 51), k = randn<double>(5, 4, 52), v = randn<double>(5, 2, 53);
  sdpa::DiagnosticsSink sink;
  CHECK_THROWS_WITH(sdpa::attentionForward(q, k, v, scale::LogN{}, sdpa::mask::None{}, sdpa::Dropout{}, &sink),
                    Catch::Matchers::Contains("scale::LogN"));
}
