// The oracle every kernel is checked against: attention written as plain loops, templated on the
// accumulation type. Instantiated with long double it is the golden result; with float or double
// it is "the naive kernel in the same precision" of the FlashAttention error rule. It shares no
// code with the library: masks are given as plain predicates written out in each test.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <utility>
#include <vector>

namespace sdpa_test {

using Index = Eigen::Index;
template <typename T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
template <typename T>
using Vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;
/// numpy's and PyTorch's layout, which the library reads in place.
template <typename T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// visible(i, j): may query i attend to key j. bias(i, j): additive term after the scale.
using VisibleFn = std::function<bool(Index, Index)>;
using BiasFn = std::function<long double(Index, Index)>;

inline VisibleFn allVisible() {
  return [](Index, Index) { return true; };
}
inline BiasFn noBias() {
  return [](Index, Index) { return 0.0L; };
}

template <typename T>
struct RefResult {
  Mat<T> output;
  Vec<T> logSumExp;
};

/// out_i = sum_j p_ij v_j, p_ij = exp(cap(tau q_i.k_j) + b_ij - lse_i) over visible j, all in
/// T, where cap(s) = c tanh(s / c) when softcap c > 0 (Gemma 2) and s otherwise.
/// Inputs are read as T; masked keys are never read (their values may be NaN).
template <typename T, typename In>
RefResult<T> referenceAttention(const Mat<In>& q, const Mat<In>& k, const Mat<In>& v, long double tau,
                                const VisibleFn& visible = allVisible(), const BiasFn& bias = noBias(),
                                long double softcap = 0) {
  const Index nQ = q.rows(), nK = k.rows(), dK = q.cols(), dV = v.cols();
  RefResult<T> r{Mat<T>::Zero(nQ, dV), Vec<T>::Constant(nQ, -std::numeric_limits<T>::infinity())};
  std::vector<T> s(static_cast<size_t>(nK));
  // Column-major entries read through their pointers: the same arithmetic as q(i, c), without
  // Eigen's checked accessors, which dominate the sanitizer build's time at -O0. visible(i, j)
  // is asked once per pair and kept (seen), as bias(i, j) is: at -O0 a std::function call
  // costs more than the pair's arithmetic.
  std::vector<char> seen(static_cast<size_t>(nK));
  const In *qd = q.data(), *kd = k.data(), *vd = v.data();
  T* od = r.output.data();
  for (Index i = 0; i < nQ; ++i) {
    T m = -std::numeric_limits<T>::infinity();
    bool nan = false;
    for (Index j = 0; j < nK; ++j) {
      seen[size_t(j)] = visible(i, j);
      if (!seen[size_t(j)]) continue;
      T dot = 0;
      for (Index c = 0; c < dK; ++c) dot += T(qd[i + c * nQ]) * T(kd[j + c * nK]);
      T logit = T(tau) * dot;
      if (softcap > 0) logit = T(softcap) * std::tanh(logit / T(softcap));
      s[size_t(j)] = logit + T(bias(i, j));
      if (s[size_t(j)] > m) m = s[size_t(j)];
      nan = nan || std::isnan(s[size_t(j)]);
    }
    if (nan) {  // a NaN logit it can see makes the row NaN (NUMERICS.md)
      if (dV) r.output.row(i).setConstant(std::numeric_limits<T>::quiet_NaN());  // no row() of null data
      r.logSumExp(i) = std::numeric_limits<T>::quiet_NaN();
      continue;
    }
    // No key, or only -inf logits: weight 0 everywhere, output 0, lse -inf.
    if (m == -std::numeric_limits<T>::infinity()) continue;
    T sum = 0;
    for (Index j = 0; j < nK; ++j)
      if (seen[size_t(j)]) sum += std::exp(s[size_t(j)] - m);
    for (Index j = 0; j < nK; ++j) {
      if (!seen[size_t(j)]) continue;
      const T p = std::exp(s[size_t(j)] - m) / sum;
      if (p == T(0)) continue;
      for (Index c = 0; c < dV; ++c) od[i + c * nQ] += p * T(vd[j + c * nK]);
    }
    r.logSumExp(i) = m + std::log(sum);
  }
  return r;
}

template <typename T>
struct RefGradients {
  Mat<T> dq, dk, dv;
  T dscale = 0;
  Mat<T> dbias;  ///< n_q x n_k: dL/dS, the gradient of an additive bias
};

/**
 * The plain backward pass in T, with P materialised and no shortcut: S = cap(tau q k^T) + b,
 * P = softmax(S) over the visible keys, dP = dO v^T, dS = P (dP - sum_j P dP), dY = dS cap',
 * dq = tau dY k, dk = tau dY^T q, dv = P^T dO, dtau = sum dY q.k. With long double it is the
 * golden result; with float it is "the plain computation in the same precision" of the
 * FlashAttention rule. Rows with no visible key contribute nothing.
 */
template <typename T, typename In>
RefGradients<T> referenceBackward(const Mat<In>& q, const Mat<In>& k, const Mat<In>& v, const Mat<In>& dO,
                                  long double tau, const VisibleFn& visible = allVisible(),
                                  const BiasFn& bias = noBias(), long double softcap = 0) {
  const Index nQ = q.rows(), nK = k.rows(), dK = q.cols(), dV = v.cols();
  RefGradients<T> g{Mat<T>::Zero(nQ, dK), Mat<T>::Zero(nK, dK), Mat<T>::Zero(nK, dV), T(0), Mat<T>::Zero(nQ, nK)};
  std::vector<T> x(static_cast<size_t>(nK)), p(static_cast<size_t>(nK)), dp(static_cast<size_t>(nK));
  std::vector<char> seen(static_cast<size_t>(nK));
  const In *qd = q.data(), *kd = k.data(), *vd = v.data(), *od = dO.data();  // as in referenceAttention
  T *dqd = g.dq.data(), *dkd = g.dk.data(), *dvd = g.dv.data();
  for (Index i = 0; i < nQ; ++i) {
    T m = -std::numeric_limits<T>::infinity();
    for (Index j = 0; j < nK; ++j) {
      seen[size_t(j)] = visible(i, j);
      if (!seen[size_t(j)]) continue;
      T dot = 0;
      for (Index c = 0; c < dK; ++c) dot += T(qd[i + c * nQ]) * T(kd[j + c * nK]);
      x[size_t(j)] = dot;
      T s = T(tau) * dot;
      if (softcap > 0) s = T(softcap) * std::tanh(s / T(softcap));
      p[size_t(j)] = s + T(bias(i, j));
      m = std::max(m, p[size_t(j)]);
    }
    if (m == -std::numeric_limits<T>::infinity()) continue;
    T sum = 0;
    for (Index j = 0; j < nK; ++j)
      if (seen[size_t(j)]) sum += std::exp(p[size_t(j)] - m);
    T d = 0;
    for (Index j = 0; j < nK; ++j) {
      if (!seen[size_t(j)]) continue;
      p[size_t(j)] = std::exp(p[size_t(j)] - m) / sum;
      T dpj = 0;
      for (Index c = 0; c < dV; ++c) dpj += T(od[i + c * nQ]) * T(vd[j + c * nK]);
      dp[size_t(j)] = dpj;
      d += p[size_t(j)] * dpj;
    }
    for (Index j = 0; j < nK; ++j) {
      if (!seen[size_t(j)]) continue;
      for (Index c = 0; c < dV; ++c) dvd[j + c * nK] += p[size_t(j)] * T(od[i + c * nQ]);
      T dy = p[size_t(j)] * (dp[size_t(j)] - d);
      g.dbias(i, j) = dy;
      if (softcap > 0) {
        const T t = std::tanh(T(tau) * x[size_t(j)] / T(softcap));
        dy *= T(1) - t * t;
      }
      g.dscale += dy * x[size_t(j)];
      for (Index c = 0; c < dK; ++c) {
        dqd[i + c * nQ] += T(tau) * dy * T(kd[j + c * nK]);
        dkd[j + c * nK] += T(tau) * dy * T(qd[i + c * nQ]);
      }
    }
  }
  return g;
}

/// Seeded N(0, sd^2) matrix; the same seed gives the same matrix on every run.
template <typename T>
Mat<T> randn(Index rows, Index cols, std::uint64_t seed, double sd = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, sd);
  Mat<T> m(rows, cols);
  T* p = m.data();  // column by column, as m(r, c) in that order, without the checked accessor
  for (Index i = 0; i < rows * cols; ++i) p[i] = T(dist(gen));
  return m;
}

/// max |a - b| over entries, treating equal infinities as 0 and any NaN as infinite error.
template <typename A, typename B>
double maxAbsDiff(const Eigen::MatrixBase<A>& a, const Eigen::MatrixBase<B>& b) {
  double e = 0;
  for (Index c = 0; c < a.cols(); ++c)
    for (Index r = 0; r < a.rows(); ++r) {
      const double x = double(a(r, c)), y = double(b(r, c));
      if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
      if (x == y) continue;
      e = std::max(e, std::abs(x - y));
    }
  return e;
}

/**
 * The FlashAttention rule: the kernel's error against the long-double oracle is at most twice
 * the error of the plain loop in the same precision, plus a floor for the cases where the plain
 * loop happens to be exact: a few ulps of the output scale and, for an output, one rounding of
 * its largest logit (logitScale, |logSumExp| serves): every computation in precision T rounds
 * each logit s to T (a half ulp, eps |s| / 2, in the exponent), which moves a weight by that
 * relative amount and the output by up to eps |s| times its scale. With one or a few rows the
 * plain loop's own logits can all round luckily (n_q 1, n_k 300, d_k 64, unscaled doubles:
 * plain error 1.6e-15, a kernel whose largest logit is one ulp off 7.3e-15 at |s| ~ 25).
 */
template <typename T>
double errorBound(double naiveError, double outputScale, double logitScale = 0) {
  const double eps = double(std::numeric_limits<T>::epsilon());
  return 2.0 * naiveError + (8.0 + logitScale) * eps * std::max(1.0, outputScale);
}

/// Largest |x| of a matrix, 0 for an empty one.
template <typename D>
double maxAbs(const Eigen::MatrixBase<D>& m) {
  return m.size() ? double(m.cwiseAbs().maxCoeff()) : 0.0;
}

/// Largest |a - b| over every gradient of two backward results (sdpa::Gradients and alike).
template <typename GA, typename GB>
double gradientDistance(const GA& a, const GB& b) {
  double e = std::max(
      {maxAbsDiff(a.dq, b.dq), maxAbsDiff(a.dk, b.dk), maxAbsDiff(a.dv, b.dv), maxAbsDiff(a.dscale, b.dscale)});
  if (a.dbias.size() || b.dbias.size()) e = std::max(e, maxAbsDiff(a.dbias, b.dbias));
  return e;
}
/// Largest |gradient entry| of a backward result: the scale of its error bound.
template <typename G>
double gradientScale(const G& g) {
  return std::max({maxAbs(g.dq), maxAbs(g.dk), maxAbs(g.dv), maxAbs(g.dscale), maxAbs(g.dbias)});
}

/// d <Gq, Gk>_F / (tr Gq tr Gk) in double from the centred inputs, and the factor C by which a
/// Gram entry's relative rounding can grow in the ratio: sum_ab (|Gq|_ab |Gk_ab| + |Gq_ab| |Gk|_ab)
/// over 2 <Gq, Gk>, with |G|_ab = sum_i |x_ia x_ib| (1 for isotropic inputs, more where the
/// Gram matrices' off-diagonal entries cancel).
inline std::pair<double, double> centredRatioOf(const Mat<double>& q, const Mat<double>& k) {
  const Mat<double> qc = q.rowwise() - q.colwise().mean(), kc = k.rowwise() - k.colwise().mean();
  const Mat<double> gq = qc.transpose() * qc, gk = kc.transpose() * kc;
  const Mat<double> aq = qc.cwiseAbs().transpose() * qc.cwiseAbs(), ak = kc.cwiseAbs().transpose() * kc.cwiseAbs();
  const double inner = gq.cwiseProduct(gk).sum();
  const double spread = (aq.cwiseProduct(gk.cwiseAbs()).sum() + gq.cwiseAbs().cwiseProduct(ak).sum()) / (2 * inner);
  return {double(q.cols()) * inner / (gq.trace() * gk.trace()), spread};
}

}  // namespace sdpa_test
