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
#include "internal/forward_tiled.hpp"
#include "internal/key_count_scale.hpp"
#include "internal/macros.hpp"
#include "kernel.hpp"
#include "layout.hpp"
#include "mask.hpp"
#include "scale.hpp"

namespace sdpa {

/// The output type of a forward pass: the input type In unless the caller asked for another
/// (`attentionForward<float>(...)` on half inputs).
template <typename Requested, typename In>
using OutputScalar = std::conditional_t<std::is_void_v<Requested>, In, Requested>;

/**
 * \brief What the forward pass returns: the output and, per query row, the logSumExp of its
 * visible logits, which a backward pass needs to recompute the attention weights.
 */
template <typename Scalar_>
struct ForwardResult {
  using Scalar = Scalar_;
  /// The type of the logits and the logSumExp: float for half, bfloat16 and float, else double.
  using AccScalar = internal::Accumulator<Scalar>;
  /// n_q x d_v. Rows of fully masked queries are 0.
  Matrix<Scalar> output;
  /// n_q: log sum_j exp(S_ij) over the keys query i sees; -inf for a fully masked row, NaN for a
  /// row with a NaN visible logit.
  Vector<AccScalar> logSumExp;
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

/// Inputs of the backward pass and of the materialising helpers: float or double.
template <typename DQ, typename DK>
void assertScalars() {
  using Scalar = typename DQ::Scalar;
  SDPA_STATIC_ASSERT(IsSupportedScalar<Scalar>, ATTENTION_INPUTS_MUST_BE_float_OR_double__CONVERT_WITH_cast);
  SDPA_STATIC_ASSERT((std::is_same_v<Scalar, typename DK::Scalar>),
                     Q_K_AND_V_MUST_HAVE_THE_SAME_SCALAR_TYPE__CONVERT_WITH_cast);
}

/// Inputs of the forward pass: float, double, Eigen::half or Eigen::bfloat16, all the same.
template <typename DQ, typename DK, typename DV>
void assertForwardScalars() {
  using Scalar = typename DQ::Scalar;
  SDPA_STATIC_ASSERT(IsSupportedScalar<Scalar> || IsHalfScalar<Scalar>,
                     ATTENTION_INPUTS_MUST_BE_float_OR_double_OR_Eigen_half_OR_Eigen_bfloat16__CONVERT_WITH_cast);
  SDPA_STATIC_ASSERT((std::is_same_v<Scalar, typename DK::Scalar> && std::is_same_v<Scalar, typename DV::Scalar>),
                     Q_K_AND_V_MUST_HAVE_THE_SAME_SCALAR_TYPE__CONVERT_WITH_cast);
}

using sdpa::OutputScalar;

template <typename Out, typename In>
void assertOutputScalar() {
  SDPA_STATIC_ASSERT((std::is_same_v<Out, In> || (IsHalfScalar<In> && std::is_same_v<Out, float>)),
                     THE_OUTPUT_TYPE_IS_THE_INPUT_TYPE__OR_float_FOR_half_OR_bfloat16_INPUTS);
}

template <typename Kernel>
void assertKernel() {
  SDPA_STATIC_ASSERT(kernel::IsKernel<Kernel>, THE_FIRST_ARGUMENT_MUST_BE_sdpa_kernel_Tiled_OR_sdpa_kernel_Naive);
}

/// The checks every single-head entry point makes before computing anything.
template <typename Mask>
void checkForward(const char* where, Index qRows, Index qCols, Index kRows, Index kCols, Index vRows, Index vCols,
                  const Mask& mask) {
  checkAttentionShapes(where, qRows, qCols, kRows, kCols, vRows, vCols);
  mask.check(where, qRows, kRows);
}

/// s = mask(tau q k^T) of one head, materialised (attentionLogits, attentionWeights); a
/// key-count scale as q' = r q with its row-independent tau.
template <typename DQ, typename DK, typename Scale, typename Mask>
void logitsOf(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Scale& scale, const Mask& mask,
              RowMajorMatrix<typename DQ::Scalar>& s) {
  using Scalar = typename DQ::Scalar;
  const FixedTau<Scalar> tau{scale.template value<Scalar>(q.cols())};
  if constexpr (scale::DependsOnKeyCount<Scale>) {
    Matrix<double> factors;
    const Matrix<Scalar> qs = rowScaledQuery<Scalar, Scale>(q, singleItem(q.rows(), k.rows()), Heads{1}, q.cols(),
                                                            mask, factors);
    forward_naive_impl<Scalar>::logits(qs, k, tau, mask, 0, s);
  } else {
    forward_naive_impl<Scalar>::logits(q, k, tau, mask, 0, s);
  }
}

/// The naive kernel on one head: half-precision inputs are converted to float first.
template <typename Out, typename DQ, typename DK, typename DV, typename Scale, typename Mask>
void forwardNaive(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                  const Scale& scale, const Mask& mask, const Dropout& dropout, DiagnosticsSink* sink,
                  ForwardResult<Out>& result) {
  using Acc = Accumulator<typename DQ::Scalar>;
  typename forward_naive_impl<Acc>::Scratch scratch;
  const FixedTau<Acc> tau{scale.template value<Acc>(q.cols())};
  if (sink) {
    sink->start(1, q.rows());
    sink->inputs(0) = headInputs(q.template cast<Acc>(), k.template cast<Acc>(), double(tau.tau));
  }
  Matrix<Acc> out(q.rows(), v.cols());
  forward_naive_impl<Acc>::run(q.template cast<Acc>(), k.template cast<Acc>(), v.template cast<Acc>(), tau, mask,
                               dropout, 0, 0, 0, out, result.logSumExp, scratch, sink ? &sink->rows(0) : nullptr);
  result.output = out.template cast<Out>();
}

}  // namespace internal

/**
 * \brief Forward pass returning the output (n_q x d_v) and the per-row logSumExp (n_q).
 *
 * \tparam OutScalar the output type: by default the input type; `float` for half or bfloat16
 *         inputs (`sdpa::attentionForward<float>(q, k, v)`).
 * \param kern optional first argument, `sdpa::kernel::Tiled{}` (the default) or `kernel::Naive{}`
 * \param q     queries, n_q x d_k (float, double, Eigen::half or Eigen::bfloat16)
 * \param k     keys, n_k x d_k
 * \param v     values, n_k x d_v
 * \param scale a policy of sdpa::scale (default InvSqrtDk: tau = 1/sqrt(d_k))
 * \param mask  a mask of sdpa::mask (default None)
 * \param dropout attention dropout for training (default off)
 * \param sink  if not null, receives the per-row diagnostics of this pass (diagnostics.hpp);
 *              the rows need whole logit rows, so a sink runs the naive kernel.
 * \throws std::invalid_argument naming the shapes if q/k columns, k/v rows or the mask disagree.
 */
template <typename OutScalar = void, typename Kernel, typename DQ, typename DK, typename DV,
          typename Scale = scale::InvSqrtDk, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
ForwardResult<OutputScalar<OutScalar, typename DQ::Scalar>> attentionForward(
    const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Scale& scale = Scale(), const Mask& mask = Mask(), const Dropout& dropout = Dropout(),
    DiagnosticsSink* sink = nullptr) {
  internal::assertForwardScalars<DQ, DK, DV>();
  internal::assertPolicies<Scale, Mask>();
  using In = typename DQ::Scalar;
  using Out = internal::OutputScalar<OutScalar, In>;
  internal::assertOutputScalar<Out, In>();
  internal::checkForward("sdpa::attentionForward", q.rows(), q.cols(), k.rows(), k.cols(), v.rows(), v.cols(), mask);
  dropout.check("sdpa::attentionForward");
  using Acc = internal::Accumulator<In>;
  if constexpr (scale::DependsOnKeyCount<Scale>) {
    // tau_i = value(d_k) r(n_i): the same call on q' = r q with the row-independent tau
    // (internal/key_count_scale.hpp); half inputs are converted to float for it.
    if (sink)
      internal::throwInvalid("sdpa::attentionForward",
                             "a DiagnosticsSink takes a fixed tau, not one that depends on the key count (scale::LogN)");
    Matrix<double> factors;
    const Matrix<Acc> qs = internal::rowScaledQuery<Acc, Scale>(
        q, internal::singleItem(q.rows(), k.rows()), Heads{1}, q.cols(), mask, factors);
    const internal::FixedTau<Acc> tau{scale.template value<Acc>(q.cols())};
    if constexpr (std::is_same_v<In, Acc>) {
      return attentionForward<Out>(kern, qs, k, v, tau, mask, dropout);
    } else {
      auto r = attentionForward<Acc>(kern, qs, k.template cast<Acc>(), v.template cast<Acc>(), tau, mask, dropout);
      return ForwardResult<Out>{r.output.template cast<Out>(), std::move(r.logSumExp)};
    }
  } else {
    ForwardResult<Out> result{Matrix<Out>(q.rows(), v.cols()), Vector<Acc>(q.rows())};
    if constexpr (!std::is_same_v<Kernel, kernel::Naive>) {
      if (!sink) {
        internal::forwardTiled<In, Out>(kern, q, k, v, internal::singleItem(q.rows(), k.rows()), Heads{1},
                                        internal::HeadDims{q.cols(), v.cols()}, internal::HeadTaus<Acc>(scale, 1, q.cols()),
                                        mask, dropout, result.output, result.logSumExp);
        return result;
      }
    }
    // The naive kernel, also for a DiagnosticsSink (it reads the materialised weights).
    internal::forwardNaive<Out>(q, k, v, scale, mask, dropout, sink, result);
    return result;
  }
}

/// \brief attentionForward with the default kernel, kernel::Tiled.
template <typename OutScalar = void, typename DQ, typename DK, typename DV, typename Scale = scale::InvSqrtDk,
          typename Mask = mask::None>
ForwardResult<OutputScalar<OutScalar, typename DQ::Scalar>> attentionForward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Scale& scale = Scale(), const Mask& mask = Mask(), const Dropout& dropout = Dropout(),
    DiagnosticsSink* sink = nullptr) {
  return attentionForward<OutScalar>(kernel::Tiled{}, q, k, v, scale, mask, dropout, sink);
}

/// \brief softmax(tau * q k^T + mask) v: the output only, n_q x d_v. See attentionForward.
template <typename OutScalar = void, typename Kernel, typename DQ, typename DK, typename DV,
          typename Scale = scale::InvSqrtDk, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
Matrix<OutputScalar<OutScalar, typename DQ::Scalar>> attention(
    const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Scale& scale = Scale(), const Mask& mask = Mask()) {
  return attentionForward<OutScalar>(kern, q, k, v, scale, mask).output;
}

/// \brief attention with the default kernel, kernel::Tiled.
template <typename OutScalar = void, typename DQ, typename DK, typename DV, typename Scale = scale::InvSqrtDk,
          typename Mask = mask::None>
Matrix<OutputScalar<OutScalar, typename DQ::Scalar>> attention(const Eigen::MatrixBase<DQ>& q,
                                                                                   const Eigen::MatrixBase<DK>& k,
                                                                                   const Eigen::MatrixBase<DV>& v,
                                                                                   const Scale& scale = Scale(),
                                                                                   const Mask& mask = Mask()) {
  return attentionForward<OutScalar>(kernel::Tiled{}, q, k, v, scale, mask).output;
}

/// \brief Scaled dot-product attention, softmax(q k^T / sqrt(d_k) + mask) v (seed C1).
template <typename DQ, typename DK, typename DV, typename Mask = mask::None>
Matrix<typename DQ::Scalar> scaledDotProductAttention(const Eigen::MatrixBase<DQ>& q,
                                                                const Eigen::MatrixBase<DK>& k,
                                                                const Eigen::MatrixBase<DV>& v,
                                                                const Mask& mask = Mask()) {
  return attentionForward(q, k, v, scale::InvSqrtDk{}, mask).output;
}

/// \brief Unscaled dot-product attention, softmax(q k^T + mask) v: what the seed article warns
/// against for large d_k (C4), kept for comparison and for models trained without a scale.
template <typename DQ, typename DK, typename DV, typename Mask = mask::None>
Matrix<typename DQ::Scalar> dotProductAttention(const Eigen::MatrixBase<DQ>& q,
                                                          const Eigen::MatrixBase<DK>& k,
                                                          const Eigen::MatrixBase<DV>& v, const Mask& mask = Mask()) {
  return attentionForward(q, k, v, scale::None{}, mask).output;
}

/**
 * \brief The masked, scaled logits S = tau q k^T + mask, n_q x n_k, with -inf at hidden positions.
 * Materialises n_q x n_k: for inspection and diagnostics, not for the hot path.
 */
template <typename DQ, typename DK, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
Matrix<typename DQ::Scalar> attentionLogits(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                                      const Scale& scale = Scale(), const Mask& mask = Mask()) {
  internal::assertScalars<DQ, DK>();
  internal::assertPolicies<Scale, Mask>();
  using Scalar = typename DQ::Scalar;
  internal::checkForward("sdpa::attentionLogits", q.rows(), q.cols(), k.rows(), k.cols(), k.rows(), 0, mask);
  internal::RowMajorMatrix<Scalar> s;
  internal::logitsOf(q, k, scale, mask, s);
  return s;
}

/**
 * \brief The attention weights P = softmax(S) row by row, n_q x n_k (PyTorch's `need_weights`).
 * Rows sum to 1, or are 0 for fully masked queries. Materialises n_q x n_k.
 */
template <typename DQ, typename DK, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
Matrix<typename DQ::Scalar> attentionWeights(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                                       const Scale& scale = Scale(), const Mask& mask = Mask()) {
  internal::assertScalars<DQ, DK>();
  internal::assertPolicies<Scale, Mask>();
  using Scalar = typename DQ::Scalar;
  internal::checkForward("sdpa::attentionWeights", q.rows(), q.cols(), k.rows(), k.cols(), k.rows(), 0, mask);
  internal::RowMajorMatrix<Scalar> s;
  Vector<Scalar> lse(q.rows());
  internal::logitsOf(q, k, scale, mask, s);
  internal::forward_naive_impl<Scalar>::softmaxRows(s, lse);
  return s;
}

}  // namespace sdpa

#endif  // SDPA_FORWARD_HPP
