/**
 * \file sdpa/diagnostics.hpp
 * \brief Diagnostics of the attention scale: logit statistics, entropy, saturation, the softmax
 * Jacobian, overflow headroom, head collapse and the variance check (seed C3, C5, C6, C10,
 * C12-C14, C17, C18).
 *
 * `diagnose(q, k, scale, mask)` (one head) or `diagnose(q, k, heads, scale, mask)` (packed heads)
 * returns a `Diagnostics` with per-head figures, a verdict line per problem found, `toString()`
 * and `toJson()`. The same per-row figures can be gathered during a forward pass by passing a
 * `DiagnosticsSink` to `attentionForward` / `multiHeadAttentionForward` and read with
 * `diagnostics(sink)`, without a second pass.
 * All statistics are over visible (unmasked) positions; rows with no visible key are counted as
 * fully masked and left out of the row statistics.
 */
#ifndef SDPA_DIAGNOSTICS_HPP
#define SDPA_DIAGNOSTICS_HPP

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "diagnostics_sink.hpp"
#include "internal/diagnostics_rows.hpp"
#include "internal/forward_naive.hpp"
#include "mask.hpp"
#include "multihead.hpp"
#include "scale.hpp"

namespace sdpa {

/// \brief Mean and order statistics of a per-row quantity (quantiles by nearest rank).
struct Quantiles {
  double mean = 0, min = 0, p05 = 0, median = 0, p95 = 0, max = 0;
};

/// Where plain (not max-subtracted) exp overflows: ln of the largest finite value (seed C13).
inline constexpr double kExpLimitFp16 = 11.089866488461016;  // ln 65504
inline constexpr double kExpLimitBf16 = 88.72283905206835;   // ln 3.3895e38
inline constexpr double kExpLimitFp32 = 88.72283905206835;   // ln 3.4028e38
/// Thresholds of the verdicts: p_max above kSaturated is a saturated row; an entropy fraction
/// H / log(n_visible) above kNearUniform is a near-uniform row.
inline constexpr double kSaturated = 0.99;
inline constexpr double kNearUniform = 0.99;

/// \brief The figures of one head.
struct HeadDiagnostics {
  Index head = 0, headDim = 0, queries = 0, keys = 0;
  double tau = 0;             ///< the scale used
  Index visibleLogits = 0;    ///< unmasked (query, key) pairs
  Index fullyMaskedRows = 0;  ///< queries that see no key
  Index singleKeyRows = 0;    ///< queries that see one key (left out of the row statistics)
  /// Of the final logits tau q.k (+ softcap, + bias) at visible positions.
  double logitMean = 0, logitStd = 0, logitMin = 0, logitMax = 0;
  /// Std of the raw q.k at visible positions, and the std 1/sqrt(d_k) would give (seed C14).
  double rawStd = 0, invSqrtDkStd = 0;
  /// Per row that sees at least two keys: the largest weight p_max = exp(max - lse), the entropy
  /// H (nats), H / log(n_visible), the effective number of keys exp(H), ||diag(p) - p p^T||_F.
  Quantiles maxWeight, entropy, entropyFraction, effectiveKeys, jacobianNorm;
  double saturatedFraction = 0;  ///< rows with p_max > kSaturated
  double uniformFraction = 0;    ///< rows with H / log(n_visible) > kNearUniform
  /// Visible logits above the exp limits of fp16, bf16, fp32 (seed C13, C15).
  Index overflowFp16 = 0, overflowBf16 = 0, overflowFp32 = 0;
  /// Var(q.k) over visible pairs against d_k Var(q) Var(k) (seed C3).
  double varianceObserved = 0, variancePredicted = 0;
};

/// \brief Per-head figures, head-to-head similarity and verdicts.
struct Diagnostics {
  std::vector<HeadDiagnostics> heads;
  /// Mean over head pairs and query rows of 1 - JS(P_a, P_b) / ln 2: 1 when all heads attend
  /// identically (collapse, seed C6, C12), NaN with fewer than two heads or without weights.
  double headSimilarity = std::numeric_limits<double>::quiet_NaN();
  /// H x H matrix of the pairwise similarities (empty without weights).
  Eigen::MatrixXd pairwiseSimilarity;
  /// One line per problem found, or one line saying none was.
  std::vector<std::string> verdicts;

  std::string toString() const;
  std::string toJson() const;
};

inline std::ostream& operator<<(std::ostream& os, const Diagnostics& d) { return os << d.toString(); }

namespace internal {

inline Quantiles quantiles(std::vector<double> x) {
  Quantiles q;
  if (x.empty()) return q;
  std::sort(x.begin(), x.end());
  const auto at = [&](double f) { return x[std::min(x.size() - 1, size_t(f * double(x.size())))]; };
  double sum = 0;
  for (const double v : x) sum += v;
  q.mean = sum / double(x.size());
  q.min = x.front();
  q.max = x.back();
  q.p05 = at(0.05);
  q.median = at(0.5);
  q.p95 = at(0.95);
  return q;
}

/// Folds the per-row records of one head into its figures.
inline HeadDiagnostics summarize(const std::vector<RowStats>& rows, const HeadInputs& in, Index head) {
  HeadDiagnostics d;
  d.head = head;
  d.headDim = in.headDim;
  d.queries = Index(rows.size());
  d.keys = in.keys;
  d.tau = in.tau;
  double sum = 0, sumSq = 0, rawSum = 0, rawSumSq = 0;
  d.logitMin = std::numeric_limits<double>::infinity();
  d.logitMax = -std::numeric_limits<double>::infinity();
  std::vector<double> pMax, entropy, fraction, effective, jacobian;
  for (const RowStats& r : rows) {
    if (r.visible == 0) {
      ++d.fullyMaskedRows;
      continue;
    }
    d.visibleLogits += r.visible;
    sum += r.logitSum;
    sumSq += r.logitSumSq;
    rawSum += r.rawSum;
    rawSumSq += r.rawSumSq;
    d.logitMin = std::min(d.logitMin, r.logitMin);
    d.logitMax = std::max(d.logitMax, r.logitMax);
    d.overflowFp16 += r.overFp16;
    d.overflowFp32 += r.overFp32;
    if (r.visible < 2) {  // one visible key: p = 1 by construction, not by the scale
      ++d.singleKeyRows;
      continue;
    }
    pMax.push_back(r.pMax);
    entropy.push_back(r.entropy);
    effective.push_back(std::exp(r.entropy));
    jacobian.push_back(r.jacobianNorm);
    fraction.push_back(r.entropy / std::log(double(r.visible)));
  }
  d.overflowBf16 = d.overflowFp32;  // bf16 has fp32's exponent range
  const double n = double(d.visibleLogits);
  if (n > 0) {
    d.logitMean = sum / n;
    d.logitStd = std::sqrt(std::max(0.0, sumSq / n - d.logitMean * d.logitMean));
    const double rawMean = rawSum / n;
    d.varianceObserved = std::max(0.0, rawSumSq / n - rawMean * rawMean);
    d.rawStd = std::sqrt(d.varianceObserved);
    d.invSqrtDkStd = in.headDim > 0 ? d.rawStd / std::sqrt(double(in.headDim)) : 0;
  } else {
    d.logitMin = d.logitMax = 0;
  }
  d.variancePredicted = double(in.headDim) * in.varQ * in.varK;
  const auto countAbove = [](const std::vector<double>& x, double t) {
    return x.empty() ? 0.0
                     : double(std::count_if(x.begin(), x.end(), [t](double v) { return v > t; })) / double(x.size());
  };
  d.saturatedFraction = countAbove(pMax, kSaturated);
  d.uniformFraction = countAbove(fraction, kNearUniform);
  d.maxWeight = quantiles(pMax);
  d.entropy = quantiles(entropy);
  d.entropyFraction = quantiles(fraction);
  d.effectiveKeys = quantiles(effective);
  d.jacobianNorm = quantiles(jacobian);
  return d;
}

inline std::string format(const char* fmt, double a, double b = 0, double c = 0, double e = 0) {
  char buf[256];
  std::snprintf(buf, sizeof buf, fmt, a, b, c, e);
  return buf;
}

/// The verdict lines: each names the problem, the figure and the seed claim it comes from.
inline std::vector<std::string> verdicts(const Diagnostics& diag, bool learnable) {
  std::vector<std::string> out;
  for (const HeadDiagnostics& h : diag.heads) {
    const std::string who = diag.heads.size() > 1 ? "head " + std::to_string(h.head) + ": " : "";
    const double sqrtDk = std::sqrt(double(std::max<Index>(1, h.headDim)));
    if (h.visibleLogits == 0) {
      out.push_back(who + "every query is fully masked: nothing to diagnose");
      continue;
    }
    if (h.logitStd > 3) {
      if (h.invSqrtDkStd > 0 && std::abs(h.logitStd / h.invSqrtDkStd / sqrtDk - 1) < 0.25)
        out.push_back(who +
                      format("logit std %.1f -- about sqrt(d_k) = %.1f times the %.2f that 1/sqrt(d_k) would give: "
                             "the scale looks missing (C4, C14)",
                             h.logitStd, sqrtDk, h.invSqrtDkStd));
      else
        out.push_back(who + format("logit std %.1f: far above the ~1 of a healthy start; check the scale and the "
                                   "initialisation of q and k (C14)",
                                   h.logitStd));
    }
    if (h.saturatedFraction > 0.1)
      out.push_back(who + format("%.0f%% of rows are saturated (max weight > 0.99): a saturated row's softmax "
                                 "Jacobian is ~0, so its gradients vanish (C5); Jacobian norm median %.2g",
                                 100 * h.saturatedFraction, h.jacobianNorm.median));
    if (h.uniformFraction > 0.5)
      out.push_back(who + format("%.0f%% of rows are near uniform (entropy > 99%% of log n): the logits are too "
                                 "small to choose between keys (temperature too high, C10)",
                                 100 * h.uniformFraction));
    if (h.overflowFp32 > 0)
      out.push_back(who + format("%.0f logits exceed 88.72: plain exp overflows even in fp32 and bf16 (C13); the "
                                 "max-subtracted softmax used here is safe",
                                 double(h.overflowFp32)));
    else if (h.overflowFp16 > 0)
      out.push_back(who + format("%.0f logits (%.2f%%) exceed 11.09: plain exp overflows in fp16 (C13, C15); "
                                 "compute the softmax in fp32 or max-subtracted",
                                 double(h.overflowFp16), 100.0 * double(h.overflowFp16) / double(h.visibleLogits)));
    if (h.variancePredicted > 0 && h.varianceObserved > 0) {
      const double ratio = h.varianceObserved / h.variancePredicted;
      if (ratio > 2 || ratio < 0.5)
        out.push_back(who + format("Var(q.k) = %.3g but d_k Var(q) Var(k) = %.3g (ratio %.2f): q and k are not "
                                   "independent with zero mean, so 1/sqrt(d_k) is not the variance-preserving scale "
                                   "(C3)",
                                   h.varianceObserved, h.variancePredicted, ratio));
    }
    if (learnable && h.headDim > 0) {
      const double ratio = h.tau * sqrtDk;
      if (ratio > 2 || ratio < 0.5)
        out.push_back(who + format("the learnable tau = %.3g is %.2f x 1/sqrt(d_k): a start far from 1/sqrt(d_k) "
                                   "risks collapse (C17)",
                                   h.tau, ratio));
    }
  }
  if (diag.heads.size() > 1 && diag.headSimilarity > 0.9)
    out.push_back(format("heads attend alike (mean similarity %.3f, 1 = identical): head collapse (C6, C12)",
                         diag.headSimilarity));
  if (out.empty()) out.push_back("healthy: no saturation, no overflow, logit scale near 1");
  return out;
}

/// JSON number: finite as %.17g, non-finite as null.
inline std::string jsonNumber(double x) { return std::isfinite(x) ? format("%.17g", x) : std::string("null"); }

inline std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

inline std::string jsonQuantiles(const Quantiles& q) {
  return "{\"mean\":" + jsonNumber(q.mean) + ",\"min\":" + jsonNumber(q.min) + ",\"p05\":" + jsonNumber(q.p05) +
         ",\"median\":" + jsonNumber(q.median) + ",\"p95\":" + jsonNumber(q.p95) + ",\"max\":" + jsonNumber(q.max) +
         "}";
}

}  // namespace internal

/// \brief The diagnostics gathered by the last forward pass that wrote into `sink` (without
/// head similarity, which needs the weights of every head at once).
inline Diagnostics diagnostics(const DiagnosticsSink& sink) {
  Diagnostics d;
  for (Index h = 0; h < sink.heads(); ++h) d.heads.push_back(internal::summarize(sink.rows(h), sink.inputs(h), h));
  d.verdicts = internal::verdicts(d, false);
  return d;
}

inline std::string Diagnostics::toString() const {
  std::string s;
  for (const HeadDiagnostics& h : heads) {
    s += (heads.size() > 1 ? "head " + std::to_string(h.head) + ": " : std::string()) + "d_k " +
         std::to_string(h.headDim) + ", " + std::to_string(h.queries) + " queries x " + std::to_string(h.keys) +
         " keys, tau " + internal::format("%.4g", h.tau) + "\n";
    s += internal::format("  logits   mean %.3f  std %.3f  min %.3f  max %.3f\n", h.logitMean, h.logitStd, h.logitMin,
                          h.logitMax);
    s += internal::format("  raw q.k  std %.3f (1/sqrt(d_k) would give %.3f); Var %.3g vs d_k Var(q) Var(k) %.3g\n",
                          h.rawStd, h.invSqrtDkStd, h.varianceObserved, h.variancePredicted);
    s += internal::format("  rows     max weight median %.3f, entropy median %.3f nats (%.0f%% of log n), ",
                          h.maxWeight.median, h.entropy.median, 100 * h.entropyFraction.median) +
         internal::format("effective keys median %.1f\n", h.effectiveKeys.median);
    s += internal::format("           saturated %.1f%%, near uniform %.1f%%, Jacobian norm mean %.3g min %.3g\n",
                          100 * h.saturatedFraction, 100 * h.uniformFraction, h.jacobianNorm.mean, h.jacobianNorm.min);
    s += internal::format("  overflow max logit %.2f: %.0f above 11.09 (fp16), %.0f above 88.72 (bf16, fp32)\n",
                          h.logitMax, double(h.overflowFp16), double(h.overflowFp32));
    if (h.fullyMaskedRows > 0) s += "  " + std::to_string(h.fullyMaskedRows) + " fully masked rows\n";
  }
  if (heads.size() > 1 && std::isfinite(headSimilarity))
    s += internal::format("head similarity %.3f (1 - Jensen-Shannon / ln 2, mean over head pairs)\n", headSimilarity);
  for (const std::string& v : verdicts) s += "verdict: " + v + "\n";
  return s;
}

inline std::string Diagnostics::toJson() const {
  using internal::jsonNumber;
  std::string s = "{\"heads\":[";
  for (size_t i = 0; i < heads.size(); ++i) {
    const HeadDiagnostics& h = heads[i];
    s += std::string(i ? "," : "") + "{\"head\":" + std::to_string(h.head) + ",\"d_k\":" + std::to_string(h.headDim) +
         ",\"queries\":" + std::to_string(h.queries) + ",\"keys\":" + std::to_string(h.keys) +
         ",\"tau\":" + jsonNumber(h.tau) + ",\"visible_logits\":" + std::to_string(h.visibleLogits) +
         ",\"fully_masked_rows\":" + std::to_string(h.fullyMaskedRows) +
         ",\"single_key_rows\":" + std::to_string(h.singleKeyRows) + ",\"logit\":{\"mean\":" + jsonNumber(h.logitMean) +
         ",\"std\":" + jsonNumber(h.logitStd) + ",\"min\":" + jsonNumber(h.logitMin) +
         ",\"max\":" + jsonNumber(h.logitMax) + "},\"raw_std\":" + jsonNumber(h.rawStd) +
         ",\"inv_sqrt_dk_std\":" + jsonNumber(h.invSqrtDkStd) +
         ",\"max_weight\":" + internal::jsonQuantiles(h.maxWeight) +
         ",\"entropy\":" + internal::jsonQuantiles(h.entropy) +
         ",\"entropy_fraction\":" + internal::jsonQuantiles(h.entropyFraction) +
         ",\"effective_keys\":" + internal::jsonQuantiles(h.effectiveKeys) +
         ",\"jacobian_norm\":" + internal::jsonQuantiles(h.jacobianNorm) +
         ",\"saturated_fraction\":" + jsonNumber(h.saturatedFraction) +
         ",\"uniform_fraction\":" + jsonNumber(h.uniformFraction) +
         ",\"overflow\":{\"fp16\":" + std::to_string(h.overflowFp16) + ",\"bf16\":" + std::to_string(h.overflowBf16) +
         ",\"fp32\":" + std::to_string(h.overflowFp32) +
         "},\"variance\":{\"observed\":" + jsonNumber(h.varianceObserved) +
         ",\"predicted\":" + jsonNumber(h.variancePredicted) + "}}";
  }
  s += "],\"head_similarity\":" + jsonNumber(headSimilarity) + ",\"verdicts\":[";
  for (size_t i = 0; i < verdicts.size(); ++i) s += std::string(i ? "," : "") + internal::jsonString(verdicts[i]);
  return s + "]}";
}

namespace internal {

/// 1 - JS(p, r) / ln 2 for two distributions over the same keys (1 = identical, 0 = disjoint).
inline double jsSimilarity(const Eigen::Ref<const Eigen::RowVectorXd>& p,
                           const Eigen::Ref<const Eigen::RowVectorXd>& r) {
  double js = 0;
  for (Index j = 0; j < p.size(); ++j) {
    const double m = 0.5 * (p(j) + r(j));
    if (p(j) > 0) js += 0.5 * p(j) * std::log(p(j) / m);
    if (r(j) > 0) js += 0.5 * r(j) * std::log(r(j) / m);
  }
  return 1 - std::max(0.0, js) / std::log(2.0);
}

template <typename DQ, typename DK, typename Scale, typename Mask>
Diagnostics diagnoseImpl(const char* where, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                         const Heads& heads, const Scale& scale, const Mask& mask) {
  assertScalars<DQ, DK>();
  assertPolicyTypes<Scale, Mask>();
  using Scalar = typename DQ::Scalar;
  // k doubles as v (n_k x H_kv d_k) for the shape check; v is never read here.
  const HeadDims dims = checkBatch(where, q.rows(), q.cols(), k.rows(), k.cols(), k.rows(), k.cols(),
                                   singleItem(q.rows(), k.rows()), heads, scale, mask, Dropout{});
  const ConstRef<Scalar> qr(q), kr(k);
  Diagnostics d;
  std::vector<Eigen::MatrixXd> weights;
  typename forward_naive_impl<Scalar>::Scratch scratch;
  std::vector<RowStats> rows(size_t(q.rows()));
  Vector<Scalar> lse(q.rows());
  for (Index h = 0; h < heads.query; ++h) {
    const Index g = h / heads.groupSize();
    const auto qh = qr.middleCols(h * dims.dK, dims.dK);
    const auto kh = kr.middleCols(g * dims.dK, dims.dK);
    const FixedTau<Scalar> sc{headScale(scale, h).template value<Scalar>(dims.dK)};
    forward_naive_impl<Scalar>::softmaxWithStats(qh, kh, sc, mask, h, lse, scratch, rows, 0);
    d.heads.push_back(summarize(rows, headInputs(qh, kh, double(sc.tau)), h));
    weights.push_back(scratch.s.template cast<double>());
  }
  if (heads.query > 1) {
    d.pairwiseSimilarity = Eigen::MatrixXd::Identity(heads.query, heads.query);
    double total = 0;
    Index pairs = 0;
    for (Index a = 0; a < heads.query; ++a)
      for (Index b = a + 1; b < heads.query; ++b) {
        double sum = 0;
        Index n = 0;
        for (Index i = 0; i < q.rows(); ++i) {
          if (weights[size_t(a)].row(i).sum() == 0) continue;  // fully masked
          sum += jsSimilarity(weights[size_t(a)].row(i), weights[size_t(b)].row(i));
          ++n;
        }
        const double sim = n ? sum / double(n) : 1.0;
        d.pairwiseSimilarity(a, b) = d.pairwiseSimilarity(b, a) = sim;
        total += sim;
        ++pairs;
      }
    d.headSimilarity = total / double(pairs);
  }
  d.verdicts = verdicts(d, std::decay_t<Scale>::IsLearnable);
  return d;
}

}  // namespace internal

/**
 * \brief Diagnoses one head: q n_q x d_k, k n_k x d_k, with the scale and mask the model uses.
 * Materialises n_q x n_k.
 */
template <typename DQ, typename DK, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
Diagnostics diagnose(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Scale& scale = Scale(),
                     const Mask& mask = Mask()) {
  internal::checkAttentionShapes("sdpa::diagnose", q.rows(), q.cols(), k.rows(), k.cols(), k.rows(), 0);
  return internal::diagnoseImpl("sdpa::diagnose", q, k, Heads{1}, scale, mask);
}

/// \brief Diagnoses packed multi-head q (n_q x H d_k) and k (n_k x H_kv d_k), with head
/// similarity. Materialises H x n_q x n_k.
template <typename DQ, typename DK, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
Diagnostics diagnose(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Heads& heads,
                     const Scale& scale = Scale(), const Mask& mask = Mask()) {
  return internal::diagnoseImpl("sdpa::diagnose", q, k, heads, scale, mask);
}

/// \brief What calibrateTemperature aims for: a mean entropy fraction H / log(n_visible) in
/// (0, 1), or a logit std > 0.
struct CalibrationTarget {
  enum class Kind { EntropyFraction, LogitStd } kind;
  double value;
  static CalibrationTarget entropyFraction(double f) { return {Kind::EntropyFraction, f}; }
  static CalibrationTarget logitStd(double s) { return {Kind::LogitStd, s}; }
};

/**
 * \brief The tau > 0 at which one head reaches the target (seed C10): the mean entropy fraction
 * falls and the logit std rises monotonically with tau (without a bias), so a bisection on
 * log tau over [1e-6, 1e6] (60 steps, relative precision ~1e-9) finds it. Throws
 * std::invalid_argument if the target is out of range or not reachable in that bracket.
 */
template <typename DQ, typename DK, typename Mask = mask::None>
double calibrateTemperature(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                            const CalibrationTarget& target, const Mask& mask = Mask()) {
  constexpr const char* where = "sdpa::calibrateTemperature";
  const bool entropy = target.kind == CalibrationTarget::Kind::EntropyFraction;
  if (entropy ? !(target.value > 0 && target.value < 1) : !(target.value > 0 && std::isfinite(target.value)))
    internal::throwInvalid(where, "the target must be an entropy fraction in (0, 1) or a logit std > 0, got " +
                                      std::to_string(target.value));
  // f(tau) increases with tau: the logit std, or minus the entropy fraction.
  const auto f = [&](double logTau) {
    const HeadDiagnostics h = diagnose(q, k, scale::Constant{std::exp(logTau)}, mask).heads.front();
    return entropy ? -h.entropyFraction.mean : h.logitStd;
  };
  const double goal = entropy ? -target.value : target.value;
  double lo = std::log(1e-6), hi = std::log(1e6);
  if (!(f(lo) <= goal && goal <= f(hi)))
    internal::throwInvalid(where,
                           "the target " + std::to_string(target.value) + " is not reached for tau in [1e-6, 1e6]");
  for (int i = 0; i < 60; ++i) {
    const double mid = 0.5 * (lo + hi);
    (f(mid) < goal ? lo : hi) = mid;
  }
  return std::exp(0.5 * (lo + hi));
}

}  // namespace sdpa

#endif  // SDPA_DIAGNOSTICS_HPP
