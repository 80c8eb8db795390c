// The theory the library was designed from, measured through the library (seed C3, C4, C5, C7,
// C13, C15). Fixed seeds; statistical bounds come from the sampling distribution, stated below.
#include <sdpa/sdpa.hpp>

#include <cfloat>
#include <cmath>

#include "support/cases.hpp"

using namespace sdpa_test;

namespace {

/// N independent samples of tau q.k, each pair (q, k) fresh, computed by the library: the
/// diagonal of attentionLogits over blocks of B rows (off-diagonal entries share a q or a k and
/// are not independent, so they are discarded).
template <typename Scale>
Eigen::VectorXd logitSamples(const Scale& scale, Index dK, Index n, double sdQ, double sdK, std::uint64_t seed) {
  constexpr Index B = 16;
  Eigen::VectorXd x(n);
  for (Index b = 0; b < n; b += B) {
    const Index rows = std::min(B, n - b);
    const Mat<double> q = randn<double>(rows, dK, seed + 2 * std::uint64_t(b), sdQ);
    const Mat<double> k = randn<double>(rows, dK, seed + 2 * std::uint64_t(b) + 1, sdK);
    x.segment(b, rows) = sdpa::attentionLogits(q, k, scale).diagonal();
  }
  return x;
}

/**
 * Checks the sample mean and variance of n iid samples of X = c * q.k against E X = 0 and
 * Var X = sigma2. q.k is a sum of d iid products q_i k_i with E(q_i k_i)^4 = 9 (s_q s_k)^4, so
 * its excess kurtosis is 6/d and the sample variance S^2 has
 *   Var(S^2 / sigma2) = 2/(n-1) + 6/(d n).
 * Bounds are z = 5 standard errors (two-sided p = 5.7e-7 per check under the normal
 * approximation; with about 40 checks in this file a false failure has probability < 3e-5).
 */
void checkMoments(const Eigen::VectorXd& x, double sigma2, Index d) {
  const double n = double(x.size());
  const double mean = x.mean();
  const double var = (x.array() - mean).square().sum() / (n - 1);
  const double z = 5.0;
  const double seVar = std::sqrt(2.0 / (n - 1) + 6.0 / (double(d) * n));
  INFO("d_k " << d << ": sample mean " << mean << ", sample variance " << var << ", expected " << sigma2 << " +- "
              << z * seVar * sigma2);
  CHECK(std::abs(mean) <= z * std::sqrt(sigma2 / n));
  CHECK(std::abs(var / sigma2 - 1) <= z * seVar);
}

constexpr Index kSamples = 8192;
/// Samples at d_k: 2 d_k normal draws each, which dominate these tests' time (under the
/// sanitizers most of all), so d_k >= 256 takes a quarter: its bounds widen by 2x, still 16% of
/// the variance at 5 standard errors (against a variance off by a factor of d_k or s_q^2 s_k^2).
Index samplesAt(Index d) { return d >= 256 ? kSamples / 4 : kSamples; }

}  // namespace

TEST_CASE("Var(q.k) = d_k with unit-variance components  [seed C3]", "[theory][seed]") {
  for (const Index d : {4, 16, 64, 256, 1024})
    checkMoments(logitSamples(sdpa::scale::None{}, d, samplesAt(d), 1, 1, 1000 + d * 7919), double(d), d);
}

TEST_CASE("Var(tau q.k) = 1 with tau = 1/sqrt(d_k)  [seed C7]", "[theory][seed]") {
  for (const Index d : {4, 16, 64, 256, 1024})
    checkMoments(logitSamples(sdpa::scale::InvSqrtDk{}, d, samplesAt(d), 1, 1, 2000 + d * 7919), 1.0, d);
}

TEST_CASE("Var(q.k) = d_k s_q^2 s_k^2 with component variances s_q^2, s_k^2 != 1  [seed C3]", "[theory][seed]") {
  const double sq = 0.5, sk = 3.0;
  for (const Index d : {4, 16, 64, 256, 1024}) {
    checkMoments(logitSamples(sdpa::scale::None{}, d, samplesAt(d), sq, sk, 3000 + d * 7919),
                 double(d) * sq * sq * sk * sk, d);
    // 1/sqrt(d_k) removes the d_k but not the component variances: Var = s_q^2 s_k^2.
    checkMoments(logitSamples(sdpa::scale::InvSqrtDk{}, d, samplesAt(d), sq, sk, 4000 + d * 7919), sq * sq * sk * sk,
                 d);
  }
}

TEST_CASE("d_k = 64 unscaled: logit std 8, one key takes most of the weight  [seed C4]", "[theory][seed]") {
  const Mat<double> q = randn<double>(64, 64, 50), k = randn<double>(256, 64, 51);
  const Mat<double> s = sdpa::attentionLogits(q, k, sdpa::scale::None{});
  const double sd = std::sqrt((s.array() - s.mean()).square().mean());
  INFO("unscaled logit std " << sd);
  // 16384 logits, but rows share q: the std of one row's logits is |q| / 1 ~ 8 (1 +- 0.09), so
  // the pooled std is within a few percent of 8.
  CHECK(std::abs(sd - 8.0) < 0.08 * 8.0);
  const Mat<double> pUnscaled = sdpa::attentionWeights(q, k, sdpa::scale::None{});
  const Mat<double> pScaled = sdpa::attentionWeights(q, k);
  const double maxUnscaled = pUnscaled.rowwise().maxCoeff().mean(), maxScaled = pScaled.rowwise().maxCoeff().mean();
  INFO("mean largest weight: unscaled " << maxUnscaled << ", scaled " << maxScaled);
  CHECK(maxUnscaled > 0.6);
  CHECK(maxScaled < 0.1);
}

TEST_CASE("softmax-Jacobian norm falls as d_k grows unscaled and stays put scaled  [seed C5]", "[theory][seed]") {
  // n = 256 keys, 64 queries, mean over queries of ||diag(p) - p p^T||_F.
  // Scaled logits of one query are ~N(0, 1), so sum p^2 -> E e^{2x} / (n (E e^x)^2) = e / n and
  // ||J||_F ~ sqrt(e / n) = 0.103 for every d_k; Jensen's inequality and the spread of |q|^2/d_k
  // put the mean a few percent below. Unscaled, the std grows as sqrt(d_k) and rows saturate.
  const Index n = 256;
  const double predicted = std::sqrt(std::exp(1.0) / double(n));
  double previousUnscaled = INFINITY;
  for (const Index d : {16, 32, 64, 128, 256, 512, 1024}) {
    const Mat<double> q = randn<double>(64, d, 60 + d), k = randn<double>(n, d, 61 + d);
    const Mat<double> pu = sdpa::attentionWeights(q, k, sdpa::scale::None{});
    const Mat<double> ps = sdpa::attentionWeights(q, k, sdpa::scale::InvSqrtDk{});
    double ju = 0, js = 0;
    for (Index i = 0; i < 64; ++i) {
      ju += sdpa::softmaxJacobianNorm(Eigen::RowVectorXd(pu.row(i))) / 64;
      js += sdpa::softmaxJacobianNorm(Eigen::RowVectorXd(ps.row(i))) / 64;
    }
    INFO("d_k " << d << ": mean Jacobian norm unscaled " << ju << ", scaled " << js << " (predicted " << predicted
                << ")");
    CHECK(ju < previousUnscaled);
    CHECK(js > 0.85 * predicted);
    CHECK(js < 1.05 * predicted);
    previousUnscaled = ju;
  }
  CHECK(previousUnscaled < 0.9 * predicted);  // at d_k = 1024 unscaled is below the scaled level
}

TEST_CASE("unscaled d_k = 64 logits cross the fp16 exp limit 11.09, scaled ones do not  [seed C13, C15]",
          "[theory][seed]") {
  // The logits of independent pairs are N(0, 64) unscaled and N(0, 1) scaled.
  // P(X > 11.09) = P(Z > 1.386) = 0.0829 unscaled; P(Z > 11.09) ~ 7e-29 scaled.
  const Eigen::VectorXd unscaled = logitSamples(sdpa::scale::None{}, 64, kSamples, 1, 1, 77);
  const Eigen::VectorXd scaled = logitSamples(sdpa::scale::InvSqrtDk{}, 64, kSamples, 1, 1, 78);
  const double limit = std::log(65504.0);
  const double fraction = double((unscaled.array() > limit).count()) / double(kSamples);
  const double expected = 0.5 * std::erfc(limit / 8.0 / std::sqrt(2.0));
  const double se = std::sqrt(expected * (1 - expected) / double(kSamples));  // binomial standard error
  INFO("fraction above 11.09 unscaled " << fraction << ", expected " << expected);
  CHECK(std::abs(fraction - expected) <= 5 * se);
  CHECK((scaled.array() > limit).count() == 0);
  CHECK((unscaled.array() > std::log(double(FLT_MAX))).count() == 0);  // fp32 holds at d_k = 64
}
