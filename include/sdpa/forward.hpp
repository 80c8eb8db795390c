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

#include <string>
#include <type_traits>
#include <vector>

#include "diagnostics_sink.hpp"
#include "dropout.hpp"
#include "internal/checks.hpp"
#include "internal/forward_dispatch.hpp"
#include "internal/forward_naive.hpp"
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

/// s = mask(tau q k^T) of one head, materialised (attentionLogits, attentionWeights); a
/// key-count scale as q' = r q with its row-independent tau.
template <typename DQ, typename DK, typename Scale, typename Mask>
void logitsOf(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Scale& scale, const Mask& mask,
              RowMajorMatrix<typename DQ::Scalar>& s) {
  using Scalar = typename DQ::Scalar;
  const Scalar tau = HeadTaus<Scalar>(scale, 1, q.cols()).tau(0);
  if constexpr (scale::DependsOnKeyCount<Scale>) {
    Matrix<double> factors;
    const Matrix<Scalar> qs =
        rowScaledQuery<Scalar, Scale>(q, singleItem(q.rows(), k.rows()), Heads{1}, q.cols(), mask, factors);
    forward_naive_impl<Scalar>::logits(qs, k, tau, mask, 0, s);
  } else {
    forward_naive_impl<Scalar>::logits(q, k, tau, mask, 0, s);
  }
}

/// Checks an output of an allocation-free call: its storage (a Ref binds it in place) and size.
template <typename DOut>
void assertWritableOutput() {
  SDPA_STATIC_ASSERT(
      !(DOut::Flags & Eigen::RowMajorBit) || DOut::ColsAtCompileTime == 1 || DOut::RowsAtCompileTime == 1,
      THE_OUTPUT_MUST_BE_COLUMN_MAJOR__AN_Eigen_MatrixX_A_Map_OR_A_BLOCK_OF_ONE);
}
inline void checkOutputShape(const char* where, const char* name, Index rows, Index cols, Index wantRows,
                             Index wantCols) {
  if (rows != wantRows || cols != wantCols)
    throwInvalid(where, std::string(name) + " is " + shapeString(rows, cols) + " but must be " +
                            shapeString(wantRows, wantCols) +
                            " (allocation-free calls write into outputs the caller sized)");
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
 * \param sink  if not null, receives the per-row diagnostics of this pass (diagnostics.hpp),
 *              streamed by the tiled kernel beside its softmax (O(n_q) memory; the output is
 *              bitwise that of the same call without a sink), read whole by the naive one.
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
  ForwardResult<Out> result{Matrix<Out>(q.rows(), v.cols()), Vector<internal::Accumulator<In>>(q.rows())};
  internal::forwardInto<Out>("sdpa::attentionForward", kern, q, k, v, scale, mask, dropout, sink, result.output,
                             result.logSumExp);
  return result;
}

/**
 * \brief attentionForward into outputs the caller sized, for loops that must not allocate: with
 * kernel::Tiled, column-major q, k, v (matrices, maps or blocks), float or half inputs (double:
 * decoding; its prefill products are Eigen's, with a heap workspace) and any policy but
 * scale::LogN, a call allocates nothing once an earlier call on the same thread was at least as
 * large (the kernel's plan and scratch are kept per thread; with several OpenMP threads, each
 * worker's scratch grows on the first call it takes part in).
 *
 * \param kern      optional first argument, `kernel::Tiled{}` (the default) or `kernel::Naive{}`
 * \param q, k, v   as attentionForward: n_q x d_k, n_k x d_k, n_k x d_v
 * \param out       n_q x d_v, column-major (a matrix, a Map or a block of one); its scalar is the
 *                  output type (the input type, or float for half inputs)
 * \param logSumExp n_q, of the accumulation type (float for float and half inputs, else double)
 * \param scale, mask, dropout as attentionForward
 * \throws std::invalid_argument naming the shapes, as attentionForward, and for outputs of the
 *         wrong size. out and logSumExp must not alias the inputs.
 */
template <typename Kernel, typename DQ, typename DK, typename DV, typename DOut, typename DLse,
          typename Scale = scale::InvSqrtDk, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
void attentionForwardInto(const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                          const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DOut>& out,
                          const Eigen::MatrixBase<DLse>& logSumExp, const Scale& scale = Scale(),
                          const Mask& mask = Mask(), const Dropout& dropout = Dropout()) {
  internal::assertForwardScalars<DQ, DK, DV>();
  internal::assertPolicies<Scale, Mask>();
  using In = typename DQ::Scalar;
  using Out = typename DOut::Scalar;
  using Acc = internal::Accumulator<In>;
  internal::assertOutputScalar<Out, In>();
  internal::assertWritableOutput<DOut>();
  SDPA_STATIC_ASSERT((std::is_same_v<typename DLse::Scalar, Acc>),
                     THE_logSumExp_OUTPUT_MUST_BE_float_FOR_float_AND_HALF_INPUTS_AND_double_FOR_double);
  constexpr const char* where = "sdpa::attentionForwardInto";
  internal::checkForward(where, q.rows(), q.cols(), k.rows(), k.cols(), v.rows(), v.cols(), mask);
  dropout.check(where);
  internal::checkOutputShape(where, "out", out.rows(), out.cols(), q.rows(), v.cols());
  internal::checkOutputShape(where, "logSumExp", logSumExp.rows(), logSumExp.cols(), q.rows(), 1);
  internal::forwardInto<Out>(where, kern, q, k, v, scale, mask, dropout, nullptr,
                             Eigen::Ref<Matrix<Out>>(const_cast<DOut&>(out.derived())),
                             Eigen::Ref<Vector<Acc>>(const_cast<DLse&>(logSumExp.derived())));
}

/// \brief attentionForwardInto with the default kernel, kernel::Tiled.
template <typename DQ, typename DK, typename DV, typename DOut, typename DLse, typename Scale = scale::InvSqrtDk,
          typename Mask = mask::None, typename = std::enable_if_t<!kernel::IsKernel<DQ>>>
void attentionForwardInto(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                          const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DOut>& out,
                          const Eigen::MatrixBase<DLse>& logSumExp, const Scale& scale = Scale(),
                          const Mask& mask = Mask(), const Dropout& dropout = Dropout()) {
  attentionForwardInto(kernel::Tiled{}, q, k, v, out, logSumExp, scale, mask, dropout);
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
Matrix<OutputScalar<OutScalar, typename DQ::Scalar>> attention(const Kernel& kern, const Eigen::MatrixBase<DQ>& q,
                                                               const Eigen::MatrixBase<DK>& k,
                                                               const Eigen::MatrixBase<DV>& v,
                                                               const Scale& scale = Scale(),
                                                               const Mask& mask = Mask()) {
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
Matrix<typename DQ::Scalar> scaledDotProductAttention(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                                      const Eigen::MatrixBase<DV>& v, const Mask& mask = Mask()) {
  return attentionForward(q, k, v, scale::InvSqrtDk{}, mask).output;
}

/// \brief Unscaled dot-product attention, softmax(q k^T + mask) v: what the seed article warns
/// against for large d_k (C4), kept for comparison and for models trained without a scale.
template <typename DQ, typename DK, typename DV, typename Mask = mask::None>
Matrix<typename DQ::Scalar> dotProductAttention(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
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
