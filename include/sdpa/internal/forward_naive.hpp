#ifndef SDPA_INTERNAL_FORWARD_NAIVE_HPP
#define SDPA_INTERNAL_FORWARD_NAIVE_HPP

#include <cmath>
#include <limits>

#include "../dropout.hpp"
#include "../softmax.hpp"
#include "macros.hpp"

namespace sdpa::internal {

/// Read-only view the naive kernels compute on: binds column-major matrices and blocks without a
/// copy; row-major inputs and expressions are evaluated once into a temporary.
template <typename Scalar>
using ConstRef = Eigen::Ref<const Matrix<Scalar>>;

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
  if (b.allFinite()) {
    out.noalias() += a * b;
    return;
  }
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j)
      if (a(i, j) != 0) out.row(i) += a(i, j) * b.row(j);
}

/// Replaces P by P * M / (1 - p), M the dropout keep-mask of head `head`; (row0, col0) is the
/// global position of P(0, 0), so that every batch item draws its own mask.
template <typename Scalar>
void applyDropout(RowMajorMatrix<Scalar>& p, const Dropout& dropout, Index head, Index row0, Index col0) {
  const Scalar keepScale = Scalar(dropout.keepScale());
  for (Index i = 0; i < p.rows(); ++i)
    for (Index j = 0; j < p.cols(); ++j)
      if (p(i, j) != 0) p(i, j) = dropout.keep(row0 + i, col0 + j, head) ? p(i, j) * keepScale : Scalar(0);
}

/**
 * The reference kernel: materialises the n_q x n_k logits. Memory O(n_q n_k); the tiled kernel
 * that does not is a separate pass.
 */
template <typename Scalar>
struct forward_naive_impl {
  /// s (n_q x n_k, row-major so each softmax row is contiguous) = mask(tau * q k^T) for query
  /// head `head` (the mask may differ per head: ALiBi slopes, per-head Keep or Bias).
  template <typename Scale, typename Mask>
  static void logits(const ConstRef<Scalar>& q, const ConstRef<Scalar>& k, const Scale& scale, const Mask& mask,
                     Index head, RowMajorMatrix<Scalar>& s) {
    s.resize(q.rows(), k.rows());
    s.noalias() = q * k.transpose();
    if constexpr (!Scale::IsIdentity) s *= scale.template value<Scalar>(q.cols());
    if constexpr (!Mask::IsNone) mask.apply(s, 0, 0, s.rows(), s.cols(), head);
  }

  /// s becomes P = softmax of each row; lse (n_q) its logSumExp.
  static void softmaxRows(RowMajorMatrix<Scalar>& s, Eigen::Ref<Vector<Scalar>> lse) {
    for (Index i = 0; i < s.rows(); ++i) lse(i) = softmaxInPlace(s.row(i));
  }

  /// One head: out (n_q x d_v) and lse (n_q), with s as n_q x n_k scratch. (row0, col0) place the
  /// head in the packed batch for the dropout counters.
  template <typename Scale, typename Mask>
  static void run(const ConstRef<Scalar>& q, const ConstRef<Scalar>& k, const ConstRef<Scalar>& v, const Scale& scale,
                  const Mask& mask, const Dropout& dropout, Index head, Index row0, Index col0,
                  Eigen::Ref<Matrix<Scalar>> out, Eigen::Ref<Vector<Scalar>> lse, RowMajorMatrix<Scalar>& s) {
    logits(q, k, scale, mask, head, s);
    softmaxRows(s, lse);
    if (dropout.enabled()) applyDropout(s, dropout, head, row0, col0);
    out.setZero();
    addProductSkippingZeros(s, v, out);  // out = P v
  }
};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_FORWARD_NAIVE_HPP
