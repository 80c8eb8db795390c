/**
 * \file sdpa/forward.hpp
 * \brief The attention forward pass: softmax(tau * q k^T + mask) v (seed C1).
 *
 * Shapes (rows are positions, columns features): q n_q x d_k, k n_k x d_k, v n_k x d_v; the
 * output is n_q x d_v and the logits S = tau q k^T are n_q x n_k. Inputs are any
 * `Eigen::MatrixBase` of float or double (matrices, blocks, maps, row-major, fixed-size,
 * expressions); q, k and v share one scalar type, which is also the accumulation type.
 */
#ifndef SDPA_FORWARD_HPP
#define SDPA_FORWARD_HPP

#include <type_traits>

#include "diagnostics_sink.hpp"
#include "dropout.hpp"
#include "internal/checks.hpp"
#include "internal/forward_naive.hpp"
#include "internal/macros.hpp"
#include "mask.hpp"
#include "scale.hpp"

namespace sdpa {

/**
 * \brief What the forward pass returns: the output and, per query row, the logSumExp of its
 * visible logits, which a backward pass needs to recompute the attention weights.
 */
template <typename Scalar_>
struct ForwardResult {
  using Scalar = Scalar_;
  /// n_q x d_v. Rows of fully masked queries are 0.
  internal::Matrix<Scalar> output;
  /// n_q: log sum_j exp(S_ij) over the keys query i sees; -inf for a fully masked row, NaN for a
  /// row with a NaN visible logit.
  internal::Vector<Scalar> logSumExp;
};

namespace internal {

/// Scale and mask argument types; per-head scales are allowed (the multi-head entry points).
template <typename Scale, typename Mask>
void assertPolicyTypes() {
  SDPA_STATIC_ASSERT(
      scale::IsPolicy<Scale>,
      THE_SCALE_ARGUMENT_MUST_BE_A_SCALE_POLICY__PASS_sdpa_scale_InvSqrtDk_OR_ANOTHER_POLICY_BEFORE_THE_MASK);
  SDPA_STATIC_ASSERT(mask::IsMask<Mask>,
                     THE_MASK_ARGUMENT_MUST_BE_A_MASK_FROM_sdpa_mask__FOR_A_MATRIX_WRAP_IT_IN_Keep_OR_Bias);
}

/// The same for the single-head entry points, which have no per-head scale.
template <typename Scale, typename Mask>
void assertPolicies() {
  assertPolicyTypes<Scale, Mask>();
  SDPA_STATIC_ASSERT(!scale::IsPerHead<Scale>,
                     A_PER_HEAD_SCALE_NEEDS_THE_MULTI_HEAD_ENTRY_POINTS__USE_multiHeadAttention);
}

template <typename DQ, typename DK>
void assertScalars() {
  using Scalar = typename DQ::Scalar;
  SDPA_STATIC_ASSERT(IsSupportedScalar<Scalar>, ATTENTION_INPUTS_MUST_BE_float_OR_double__CONVERT_WITH_cast);
  SDPA_STATIC_ASSERT((std::is_same_v<Scalar, typename DK::Scalar>),
                     Q_K_AND_V_MUST_HAVE_THE_SAME_SCALAR_TYPE__CONVERT_WITH_cast);
}

/// The checks every single-head entry point makes before computing anything.
template <typename Mask>
void checkForward(const char* where, Index qRows, Index qCols, Index kRows, Index kCols, Index vRows, Index vCols,
                  const Mask& mask) {
  checkAttentionShapes(where, qRows, qCols, kRows, kCols, vRows, vCols);
  mask.check(where, qRows, kRows);
}

}  // namespace internal

/**
 * \brief Forward pass returning the output (n_q x d_v) and the per-row logSumExp (n_q).
 *
 * \param q     queries, n_q x d_k
 * \param k     keys, n_k x d_k
 * \param v     values, n_k x d_v
 * \param scale a policy of sdpa::scale (default InvSqrtDk: tau = 1/sqrt(d_k))
 * \param mask  a mask of sdpa::mask (default None)
 * \param dropout attention dropout for training (default off)
 * \param sink  if not null, receives the per-row diagnostics of this pass (diagnostics.hpp)
 * \throws std::invalid_argument naming the shapes if q/k columns, k/v rows or the mask disagree.
 */
template <typename DQ, typename DK, typename DV, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
ForwardResult<typename DQ::Scalar> attentionForward(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                                    const Eigen::MatrixBase<DV>& v, const Scale& scale = Scale(),
                                                    const Mask& mask = Mask(), const Dropout& dropout = Dropout(),
                                                    DiagnosticsSink* sink = nullptr) {
  internal::assertScalars<DQ, DK>();
  internal::assertScalars<DQ, DV>();
  internal::assertPolicies<Scale, Mask>();
  using Scalar = typename DQ::Scalar;
  internal::checkForward("sdpa::attentionForward", q.rows(), q.cols(), k.rows(), k.cols(), v.rows(), v.cols(), mask);
  dropout.check("sdpa::attentionForward");
  ForwardResult<Scalar> result{internal::Matrix<Scalar>(q.rows(), v.cols()), internal::Vector<Scalar>(q.rows())};
  typename internal::forward_naive_impl<Scalar>::Scratch scratch;
  if (sink) {
    sink->start(1, q.rows());
    sink->inputs(0) = internal::headInputs(q, k, double(scale.template value<Scalar>(q.cols())));
  }
  internal::forward_naive_impl<Scalar>::run(q, k, v, scale, mask, dropout, 0, 0, 0, result.output, result.logSumExp,
                                            scratch, sink ? &sink->rows(0) : nullptr);
  return result;
}

/// \brief softmax(tau * q k^T + mask) v: the output only, n_q x d_v. See attentionForward.
template <typename DQ, typename DK, typename DV, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
internal::Matrix<typename DQ::Scalar> attention(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                                const Eigen::MatrixBase<DV>& v, const Scale& scale = Scale(),
                                                const Mask& mask = Mask()) {
  return attentionForward(q, k, v, scale, mask).output;
}

/// \brief Scaled dot-product attention, softmax(q k^T / sqrt(d_k) + mask) v (seed C1).
template <typename DQ, typename DK, typename DV, typename Mask = mask::None>
internal::Matrix<typename DQ::Scalar> scaledDotProductAttention(const Eigen::MatrixBase<DQ>& q,
                                                                const Eigen::MatrixBase<DK>& k,
                                                                const Eigen::MatrixBase<DV>& v,
                                                                const Mask& mask = Mask()) {
  return attentionForward(q, k, v, scale::InvSqrtDk{}, mask).output;
}

/// \brief Unscaled dot-product attention, softmax(q k^T + mask) v: what the seed article warns
/// against for large d_k (C4), kept for comparison and for models trained without a scale.
template <typename DQ, typename DK, typename DV, typename Mask = mask::None>
internal::Matrix<typename DQ::Scalar> dotProductAttention(const Eigen::MatrixBase<DQ>& q,
                                                          const Eigen::MatrixBase<DK>& k,
                                                          const Eigen::MatrixBase<DV>& v, const Mask& mask = Mask()) {
  return attentionForward(q, k, v, scale::None{}, mask).output;
}

/**
 * \brief The masked, scaled logits S = tau q k^T + mask, n_q x n_k, with -inf at hidden positions.
 * Materialises n_q x n_k: for inspection and diagnostics, not for the hot path.
 */
template <typename DQ, typename DK, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
internal::Matrix<typename DQ::Scalar> attentionLogits(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                                      const Scale& scale = Scale(), const Mask& mask = Mask()) {
  internal::assertScalars<DQ, DK>();
  internal::assertPolicies<Scale, Mask>();
  using Scalar = typename DQ::Scalar;
  internal::checkForward("sdpa::attentionLogits", q.rows(), q.cols(), k.rows(), k.cols(), k.rows(), 0, mask);
  internal::RowMajorMatrix<Scalar> s;
  internal::forward_naive_impl<Scalar>::logits(q, k, scale, mask, 0, s);
  return s;
}

/**
 * \brief The attention weights P = softmax(S) row by row, n_q x n_k (PyTorch's `need_weights`).
 * Rows sum to 1, or are 0 for fully masked queries. Materialises n_q x n_k.
 */
template <typename DQ, typename DK, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
internal::Matrix<typename DQ::Scalar> attentionWeights(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                                       const Scale& scale = Scale(), const Mask& mask = Mask()) {
  internal::assertScalars<DQ, DK>();
  internal::assertPolicies<Scale, Mask>();
  using Scalar = typename DQ::Scalar;
  internal::checkForward("sdpa::attentionWeights", q.rows(), q.cols(), k.rows(), k.cols(), k.rows(), 0, mask);
  internal::RowMajorMatrix<Scalar> s;
  internal::Vector<Scalar> lse(q.rows());
  internal::forward_naive_impl<Scalar>::logits(q, k, scale, mask, 0, s);
  internal::forward_naive_impl<Scalar>::softmaxRows(s, lse);
  return s;
}

}  // namespace sdpa

#endif  // SDPA_FORWARD_HPP
