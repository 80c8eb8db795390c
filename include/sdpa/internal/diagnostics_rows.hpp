#ifndef SDPA_INTERNAL_DIAGNOSTICS_ROWS_HPP
#define SDPA_INTERNAL_DIAGNOSTICS_ROWS_HPP

#include <algorithm>
#include <cmath>
#include <limits>

#include "../softmax.hpp"
#include "macros.hpp"

namespace sdpa::internal {

/// What one query row contributes to the diagnostics: sums, extremes and the figures of its
/// softmax, all over its visible keys. Enough to fold rows into head statistics without P.
struct RowStats {
  Index visible = 0;
  double logitSum = 0, logitSumSq = 0, logitMin = 0, logitMax = 0;
  double rawSum = 0, rawSumSq = 0;  ///< of q.k before scale, softcap and bias
  Index overFp16 = 0, overFp32 = 0;
  double lse = 0, pMax = 0, entropy = 0, jacobianNorm = 0;
  /// The key of the largest logit, and its lead over the second largest (+inf with one visible
  /// key): the off-max weights are at most exp(-gap), so the gap says in which precision the
  /// row's softmax Jacobian underflows.
  Index argmax = 0;
  double gap = 0;
};

/// Per-head inputs of the summaries. centredRatio is d_k <Gq, Gk>_F / (tr Gq tr Gk), with Gq, Gk
/// the d_k x d_k Gram matrices of q and k centred on their column means: the variance of the
/// centred logits over every (query, key) pair against d_k Var(q) Var(k), which is 1 when the
/// components of q and k are independent with equal variance (seed C3's premise).
struct HeadInputs {
  Index headDim = 0, keys = 0;
  double tau = 0, varQ = 0, varK = 0;
  double centredRatio = std::numeric_limits<double>::quiet_NaN();
};

/**
 * The statistics of one row from its final logits s (n_k, -inf where hidden) before the softmax,
 * the same logits with hidden entries set to 0 (`finite`), its softmax p and logSumExp; the raw
 * q.k sums are filled in by the caller. Entropy as lse - sum p s (the streaming form: one running
 * sum of exp(s - m) s beside the softmax's own; its absolute error is a few ulps of max |s|);
 * Jacobian norm as softmaxJacobianNorm. Every step is a vectorised pass over the row in the
 * kernel's precision; `allVisible` (no mask) skips the selects.
 */
template <typename RowS, typename RowF, typename RowP>
RowStats rowStats(const RowS& s, const RowF& finite, const RowP& p, double lse, bool allVisible) {
  using Scalar = typename RowS::Scalar;
  constexpr Scalar inf = std::numeric_limits<Scalar>::infinity();
  constexpr double fp16Limit = 11.089866488461016, fp32Limit = 88.72283905206835;
  RowStats r;
  r.visible = allVisible ? s.size() : Index((s.array() > -inf).count());
  if (r.visible == 0) return r;
  r.logitSum = double(finite.sum());
  r.logitSumSq = double(finite.squaredNorm());
  r.logitMax = double(s.maxCoeff(&r.argmax));  // and where: the key the row looks at most
  r.logitMin = double(allVisible ? s.minCoeff() : (s.array() > -inf).select(s.array(), inf).minCoeff());
  if (r.logitMax > fp16Limit) {  // overflow counts only when there is something to count
    r.overFp16 = Index((s.array() > Scalar(fp16Limit)).count());
    r.overFp32 = Index((s.array() > Scalar(fp32Limit)).count());
  }
  r.lse = lse;
  r.pMax = std::exp(r.logitMax - lse);
  const Index tail = s.size() - r.argmax - 1;
  double second = -std::numeric_limits<double>::infinity();
  if (r.argmax > 0) second = double(s.head(r.argmax).maxCoeff());
  if (tail > 0) second = std::max(second, double(s.tail(tail).maxCoeff()));
  r.gap = r.logitMax - second;
  r.entropy = std::max(0.0, lse - double(p.dot(finite)));
  r.jacobianNorm = std::sqrt(jacobianNormSquared(p, r.pMax));
  return r;
}

/// Records the per-head inputs of the summaries: d_k, n_k, tau and Var(q), Var(k) of the head.
template <typename DQ, typename DK>
HeadInputs headInputs(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, double tau) {
  const auto variance = [](const auto& m) {
    if (m.size() == 0) return 0.0;
    const double mean = m.template cast<double>().mean();
    return (m.template cast<double>().array() - mean).square().mean();
  };
  HeadInputs in{q.cols(), k.rows(), tau, variance(q), variance(k)};
  if (q.rows() > 1 && k.rows() > 1) {
    const Eigen::MatrixXd qc = q.template cast<double>().rowwise() - q.template cast<double>().colwise().mean();
    const Eigen::MatrixXd kc = k.template cast<double>().rowwise() - k.template cast<double>().colwise().mean();
    const Eigen::MatrixXd gq = qc.transpose() * qc, gk = kc.transpose() * kc;
    const double norm = gq.trace() * gk.trace();
    if (norm > 0) in.centredRatio = double(q.cols()) * gq.cwiseProduct(gk).sum() / norm;
  }
  return in;
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_DIAGNOSTICS_ROWS_HPP
