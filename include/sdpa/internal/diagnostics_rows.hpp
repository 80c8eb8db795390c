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

/**
 * What one tile of keys adds to one row's statistics, in the tile's logit units (natural, or
 * units of ln 2 in the fast kernel's base-2 tiles), with e_j = exp(s_j - m) the online softmax's
 * weights at the row's running maximum m after the tile. The keys at the maximum (s_j = m, e_j = 1
 * exactly) are counted apart from the others, so that a nearly one-hot row's off-maximum weights
 * keep their digits (softmax.hpp's jacobianNormSquared needs their sum, not 1 minus the maximum).
 */
struct TileSums {
  double visible = 0, sum = 0, sumSq = 0;  ///< visible keys, sum s_j, sum s_j^2
  double rawSum = 0, rawSumSq = 0;         ///< of q.k (when it is not the logit / tau)
  double es = 0;                           ///< sum e_j s_j
  double atMax = 0;                        ///< keys with s_j = m
  double o1 = 0, o2 = 0, o3 = 0;           ///< sum e_j^k over the other keys
  double over16 = 0, over32 = 0;           ///< logits above the fp16 and fp32 exp limits
  double min = std::numeric_limits<double>::infinity();
  double top = -std::numeric_limits<double>::infinity(), second = -std::numeric_limits<double>::infinity();
  Index argmax = 0;  ///< the key of `top` (first of equals), global
};

/**
 * One query row's statistics streamed tile by tile (the tiled kernels' DiagnosticsSink rows):
 * rowStats' figures without the row, from sums the online softmax's rescaling keeps exact:
 * entropy = lse - sum_j p_j s_j with sum_j p_j s_j = es / l, and the Jacobian norm from the
 * power sums of the weights.
 */
struct RowStream {
  double m = -std::numeric_limits<double>::infinity();  ///< the running maximum the sums refer to
  TileSums t;                                           ///< totals (top, second, argmax over the row)

  /// The weights' sums referred to mNew (> m): they shrink by a = exp(m - mNew) (0 before any
  /// visible key), and the keys at the old maximum join the others.
  void rescale(double mNew, double toNatural) {
    const double a = std::exp((m - mNew) * toNatural), a2 = a * a;
    t.es *= a;
    t.o1 = (t.o1 + t.atMax) * a;
    t.o2 = (t.o2 + t.atMax) * a2;
    t.o3 = (t.o3 + t.atMax) * a2 * a;
    t.atMax = 0;
    m = mNew;
  }

  /// Folds in a tile's sums whose weights refer to mNew (>= m); toNatural: ln 2 for base-2 units.
  void add(const TileSums& x, double mNew, double toNatural) {
    if (mNew > m) rescale(mNew, toNatural);
    t.visible += x.visible;
    t.sum += x.sum;
    t.sumSq += x.sumSq;
    t.rawSum += x.rawSum;
    t.rawSumSq += x.rawSumSq;
    t.es += x.es;
    t.atMax += x.atMax;
    t.o1 += x.o1;
    t.o2 += x.o2;
    t.o3 += x.o3;
    t.over16 += x.over16;
    t.over32 += x.over32;
    t.min = std::min(t.min, x.min);
    if (x.top > t.top) {  // an equal top keeps the earlier key, as maxCoeff(&argmax)
      t.second = std::max(t.top, x.second);
      t.top = x.top;
      t.argmax = x.argmax;
    } else {
      t.second = std::max(t.second, x.top);
    }
  }

  /// Folds in the stream of the same row over a later range of keys (a key split).
  void merge(RowStream other) {
    if (m > other.m) other.rescale(m, 1.0);
    add(other.t, other.m, 1.0);
  }

  /**
   * The row's RowStats, given its logSumExp (natural units), the logits' unit in natural units
   * (1, or ln 2) and, where the raw q.k of a visible key is its logit / tau (no softcap, no bias,
   * tau != 0), tau; else rawTau = 0 and the raw sums are the tiles' own.
   */
  RowStats finish(double lse, double unit, double rawTau) const {
    RowStats r;
    r.visible = Index(t.visible);
    if (r.visible == 0) return r;
    r.logitSum = t.sum * unit;
    r.logitSumSq = t.sumSq * unit * unit;
    r.logitMin = t.min * unit;
    r.logitMax = t.top * unit;
    r.argmax = t.argmax;
    r.gap = (t.top - t.second) * unit;  // +inf with one visible key
    r.overFp16 = Index(t.over16);
    r.overFp32 = Index(t.over32);
    if (rawTau != 0) {
      r.rawSum = r.logitSum / rawTau;
      r.rawSumSq = r.logitSumSq / (rawTau * rawTau);
    } else {
      r.rawSum = t.rawSum;
      r.rawSumSq = t.rawSumSq;
    }
    r.lse = lse;
    r.pMax = std::exp(r.logitMax - lse);
    const double l = t.atMax + t.o1;  // sum_j e_j
    r.entropy = std::max(0.0, lse - unit * t.es / l);
    // jacobianNormSquared's two forms, from the power sums: p_j = e_j / l.
    double j2 = 0;
    if (r.pMax < 0.5) {
      const double s2 = (t.atMax + t.o2) / (l * l), s3 = (t.atMax + t.o3) / (l * l * l);
      j2 = s2 - 2 * s3 + s2 * s2;
    } else {
      // With pm = 1 - o the largest weight and r_k = sum p_j^k over the other keys (the others,
      // and the maximum's equals), sum p^2 - 2 sum p^3 + (sum p^2)^2 is
      // pm^2 o^2 + (r_2 - 2 r_3) + 2 pm^2 r_2 + r_2^2: every term >= 0 (each other p_j <= 1/2).
      const double ties = std::max(0.0, t.atMax - 1), pm = 1 / l, l2 = l * l;
      const double o = (t.o1 + ties) / l, r2 = (t.o2 + ties) / l2, r3 = (t.o3 + ties) / (l2 * l);
      j2 = pm * pm * o * o + std::max(0.0, r2 - 2 * r3) + 2 * pm * pm * r2 + r2 * r2;
    }
    r.jacobianNorm = std::sqrt(std::max(0.0, j2));
    return r;
  }
};

/**
 * The TileSums of one row of a tile: s its n logits (-inf where hidden), e its weights
 * exp(s - m) at the row's running maximum m after the tile, raw (null where the row's raw q.k
 * is the logit / tau) its q.k times rawScale, key0 the global index of its first key.
 */
template <typename Acc>
TileSums tileRowSums(const Acc* s, const Acc* e, const Acc* raw, Acc rawScale, Index n, Acc m, Index key0) {
  constexpr Acc inf = std::numeric_limits<Acc>::infinity();
  constexpr Acc fp16Limit = Acc(11.089866488461016), fp32Limit = Acc(88.72283905206835);
  TileSums x;
  Acc visible = 0, sum = 0, sumSq = 0, es = 0, atMax = 0, o1 = 0, o2 = 0, o3 = 0, mn = inf;
  Acc top = -inf, second = -inf;
  Index arg = 0;
  for (Index j = 0; j < n; ++j) {
    const Acc v = s[j];
    if (!(v > -inf)) continue;  // hidden (or NaN: the row is NaN)
    visible += 1;
    sum += v;
    sumSq += v * v;
    mn = std::min(mn, v);
    if (v > top) {
      second = top;
      top = v;
      arg = j;
    } else {
      second = std::max(second, v);
    }
    es += e[j] * v;
    if (v == m) {
      atMax += 1;
    } else {
      const Acc w = e[j], w2 = w * w;
      o1 += w;
      o2 += w2;
      o3 += w2 * w;
    }
    if (raw) {
      x.rawSum += double(raw[j] * rawScale);
      x.rawSumSq += double(raw[j] * rawScale) * double(raw[j] * rawScale);
    }
    x.over16 += v > fp16Limit;
    x.over32 += v > fp32Limit;
  }
  x.visible = double(visible);
  x.sum = double(sum);
  x.sumSq = double(sumSq);
  x.es = double(es);
  x.atMax = double(atMax);
  x.o1 = double(o1);
  x.o2 = double(o2);
  x.o3 = double(o3);
  x.min = double(mn);
  x.top = double(top);
  x.second = double(second);
  x.argmax = key0 + arg;
  return x;
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_DIAGNOSTICS_ROWS_HPP
