#ifndef SDPA_INTERNAL_FORWARD_NAIVE_HPP
#define SDPA_INTERNAL_FORWARD_NAIVE_HPP

#include <cmath>
#include <limits>

#include "../softmax.hpp"
#include "macros.hpp"

namespace sdpa::internal {

/// Read-only view the naive kernel computes on: binds column-major matrices and blocks without a
/// copy; row-major inputs and expressions are evaluated once into a temporary.
template <typename Scalar>
using ConstRef = Eigen::Ref<const Matrix<Scalar>>;

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

  /// out (n_q x d_v) = P v. A hidden key has weight exactly 0 and its value row must have no
  /// effect even if it holds NaN or inf, which a GEMM (0 * NaN = NaN) would not honour; so a
  /// non-finite v takes a path that reads only the value rows of nonzero weights.
  static void weightedValues(const RowMajorMatrix<Scalar>& p, const ConstRef<Scalar>& v,
                             Eigen::Ref<Matrix<Scalar>> out) {
    if (v.allFinite()) {
      out.noalias() = p * v;
      return;
    }
    out.setZero();
    for (Index i = 0; i < p.rows(); ++i)
      for (Index j = 0; j < p.cols(); ++j)
        if (p(i, j) != Scalar(0)) out.row(i) += p(i, j) * v.row(j);
  }

  /// One head: out (n_q x d_v) and lse (n_q), with s as n_q x n_k scratch.
  template <typename Scale, typename Mask>
  static void run(const ConstRef<Scalar>& q, const ConstRef<Scalar>& k, const ConstRef<Scalar>& v, const Scale& scale,
                  const Mask& mask, Index head, Eigen::Ref<Matrix<Scalar>> out, Eigen::Ref<Vector<Scalar>> lse,
                  RowMajorMatrix<Scalar>& s) {
    logits(q, k, scale, mask, head, s);
    softmaxRows(s, lse);
    weightedValues(s, v, out);
  }
};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_FORWARD_NAIVE_HPP
