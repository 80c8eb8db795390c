#ifndef SDPA_INTERNAL_FORWARD_NAIVE_HPP
#define SDPA_INTERNAL_FORWARD_NAIVE_HPP

#include <cmath>
#include <limits>
#include <vector>

#include "../dropout.hpp"
#include "../mask.hpp"
#include "../scale.hpp"
#include "../softmax.hpp"
#include "diagnostics_rows.hpp"
#include "macros.hpp"

namespace sdpa::internal {

/// Read-only view the naive kernels compute on: binds column-major matrices and blocks without a
/// copy; row-major inputs and expressions are evaluated once into a temporary.
template <typename Scalar>
using ConstRef = Eigen::Ref<const Matrix<Scalar>>;

/**
 * x.allFinite() in one vectorised pass: x * 0 is 0 where x is finite and NaN where it is inf or
 * NaN, so the sum is NaN exactly when some entry is not finite. Eigen 3.4's allFinite() ends in a
 * scalar all(): 5% of a forward at n = 8192, d = 64, where every value tile is checked.
 */
template <typename Derived>
bool allFiniteVectorised(const Eigen::MatrixBase<Derived>& x) {
  using Scalar = typename Derived::Scalar;
  return !std::isnan((x.array() * Scalar(0)).sum());
}

/**
 * Every 4 x_ij is finite: |x_ij| <= max / 4 (to rounding), no inf or NaN; one vectorised pass as
 * allFiniteVectorised. The backward's dP - D (|D| <= max_j |dP_ij|, D being a weighted mean of
 * the row's dP) cannot then overflow: a finite dP near the largest float minus a D of the other
 * sign would be inf, and 0 * inf = NaN at a key of weight 0.
 */
template <typename Derived>
bool allWithHeadroom(const Eigen::MatrixBase<Derived>& x) {
  using Scalar = typename Derived::Scalar;
  return !std::isnan((x.array() * Scalar(4) * Scalar(0)).sum());
}

/**
 * out += a b, where a zero entry of a never reads its row of b. Attention weights are exactly 0
 * at hidden positions, and the value (or key, or query) row there must have no effect even if
 * it holds NaN or inf, which a GEMM (0 * NaN = NaN) would not honour; so a non-finite b takes a
 * path that reads only the rows of nonzero weights.
 */
template <typename DA, typename DB, typename DOut>
void addProductSkippingZeros(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b,
                             const Eigen::MatrixBase<DOut>& out_) {
  auto& out = const_cast<Eigen::MatrixBase<DOut>&>(out_);  // Eigen's idiom to write into blocks
  if (allFiniteVectorised(b)) {
    out.noalias() += a * b;
    return;
  }
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j)
      if (a(i, j) != 0) out.row(i) += a(i, j) * b.row(j);
}

/// Replaces P by P * M / (1 - p), M the dropout keep-mask of head `head`; (row0, col0) is the
/// global position of P(0, 0), so that every batch item draws its own mask.
template <typename Derived>
void applyDropout(const Eigen::MatrixBase<Derived>& p_, const Dropout& dropout, Index head, Index row0, Index col0) {
  using Scalar = typename Derived::Scalar;
  auto& p = const_cast<Eigen::MatrixBase<Derived>&>(p_);  // Eigen's idiom to write into blocks
  const Scalar keepScale = Scalar(dropout.keepScale());
  for (Index i = 0; i < p.rows(); ++i)
    for (Index j = 0; j < p.cols(); ++j)
      if (p(i, j) != 0) p(i, j) = dropout.keep(row0 + i, col0 + j, head) ? p(i, j) * keepScale : Scalar(0);
}

/// Whether a row's raw q.k is its logit / tau at every visible key (the diagnostics' raw sums
/// then come from the logits'): no softcap, no bias, tau != 0.
template <typename Scalar>
bool rawIsLogitOverTau(bool hasBias, double softcap, Scalar tau) {
  return !hasBias && softcap == 0 && tau != Scalar(0);
}
template <typename Mask, typename Scalar>
bool rawIsLogitOverTau(const Mask& mask, Scalar tau) {
  return rawIsLogitOverTau(Mask::HasBias, mask::internal::softcapOf(mask), tau);
}

/**
 * The reference kernel: materialises the n_q x n_k logits. Memory O(n_q n_k); the tiled kernel
 * that does not is a separate pass.
 */
template <typename Scalar>
struct forward_naive_impl {
  /// s (n_q x n_k, row-major so each softmax row is contiguous) = mask(tau * q k^T) for query
  /// head `head` (the mask may differ per head: ALiBi slopes, per-head Keep or Bias).
  template <typename Mask>
  static void logits(const ConstRef<Scalar>& q, const ConstRef<Scalar>& k, Scalar tau, const Mask& mask, Index head,
                     RowMajorMatrix<Scalar>& s) {
    s.resize(q.rows(), k.rows());
    s.noalias() = q * k.transpose();
    if (tau != Scalar(1)) s *= tau;
    if constexpr (!Mask::IsNone) mask.apply(s, 0, 0, s.rows(), s.cols(), head);
  }

  /// s becomes P = softmax of each row; lse (n_q) its logSumExp.
  static void softmaxRows(RowMajorMatrix<Scalar>& s, Eigen::Ref<Vector<Scalar>> lse) {
    for (Index i = 0; i < s.rows(); ++i) lse(i) = softmaxInPlace(s.row(i));
  }

  /// n_q x n_k buffers kept alive across heads and calls, and row buffers for the diagnostics.
  struct Scratch {
    RowMajorMatrix<Scalar> s;
    Eigen::Matrix<Scalar, 1, Eigen::Dynamic> raw, logits, finite;
  };

  /// scratch.s becomes P and lse its logSumExp, as logits + softmaxRows, and stats[row0 + i]
  /// receives the diagnostics of row i. Scale and mask are applied row by row, so the row's
  /// raw q.k is still in cache for its statistics.
  template <typename Mask>
  static void softmaxWithStats(const ConstRef<Scalar>& q, const ConstRef<Scalar>& k, Scalar tau, const Mask& mask,
                               Index head, Eigen::Ref<Vector<Scalar>> lse, Scratch& scratch,
                               std::vector<RowStats>& stats, Index row0) {
    constexpr Scalar inf = std::numeric_limits<Scalar>::infinity();
    auto& s = scratch.s;
    s.resize(q.rows(), k.rows());
    s.noalias() = q * k.transpose();
    // Without bias or softcap the raw q.k is the logit / tau: no copy needed.
    const bool rawFromLogits = rawIsLogitOverTau(mask, tau);
    for (Index i = 0; i < s.rows(); ++i) {
      auto row = s.row(i);
      if (!rawFromLogits) scratch.raw = row;
      if (tau != Scalar(1)) row *= tau;
      if constexpr (!Mask::IsNone) mask.apply(s.block(i, 0, 1, s.cols()), i, 0, s.rows(), s.cols(), head);
      scratch.logits = row;
      if constexpr (Mask::IsNone)
        scratch.finite = row;
      else
        scratch.finite = (row.array() > -inf).select(row, Scalar(0));
      lse(i) = softmaxInPlace(row);
      RowStats r = rowStats(scratch.logits, scratch.finite, row, double(lse(i)), Mask::IsNone);
      if (rawFromLogits) {
        r.rawSum = r.logitSum / double(tau);
        r.rawSumSq = r.logitSumSq / (double(tau) * double(tau));
      } else if (r.visible > 0) {
        const auto visible = scratch.logits.array() > -inf;
        r.rawSum = double(visible.select(scratch.raw.array(), Scalar(0)).sum());
        r.rawSumSq = double(visible.select(scratch.raw.array().square(), Scalar(0)).sum());
      }
      stats[size_t(row0 + i)] = r;
    }
  }

  /// One head: out (n_q x d_v) and lse (n_q). (row0, col0) place the head in the packed batch,
  /// for the dropout counters and the diagnostics rows (collected when stats is not null).
  template <typename Mask>
  static void run(const ConstRef<Scalar>& q, const ConstRef<Scalar>& k, const ConstRef<Scalar>& v, Scalar tau,
                  const Mask& mask, const Dropout& dropout, Index head, Index row0, Index col0,
                  Eigen::Ref<Matrix<Scalar>> out, Eigen::Ref<Vector<Scalar>> lse, Scratch& scratch,
                  std::vector<RowStats>* stats = nullptr) {
    if (stats) {
      softmaxWithStats(q, k, tau, mask, head, lse, scratch, *stats, row0);
    } else {
      logits(q, k, tau, mask, head, scratch.s);
      softmaxRows(scratch.s, lse);
    }
    if (dropout.enabled()) applyDropout(scratch.s, dropout, head, row0, col0);
    out.setZero();
    addProductSkippingZeros(scratch.s, v, out);  // out = P v
  }
};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_FORWARD_NAIVE_HPP
