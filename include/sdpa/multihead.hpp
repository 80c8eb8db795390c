/**
 * \file sdpa/multihead.hpp
 * \brief Multi-head attention (MHA, GQA, MQA) over packed inputs, and batches of sequences of
 * different lengths.
 *
 * Packed layout, heads as column blocks (as `nn.Linear` outputs them):
 *   q: n_q x (H d_k), head h in columns [h d_k, (h + 1) d_k);
 *   k: n_k x (H_kv d_k), v: n_k x (H_kv d_v), kv head g in the g-th column block;
 *   output: n_q x (H d_v); logSumExp: n_q x H.
 * Query head h reads kv head h / (H / H_kv): H_kv = H is MHA, H_kv dividing H is GQA, H_kv = 1
 * is MQA. Each head is scaled with its own d_k, never d_model (seed C16).
 */
#ifndef SDPA_MULTIHEAD_HPP
#define SDPA_MULTIHEAD_HPP

#include <string>
#include <utility>
#include <vector>

#include "diagnostics_sink.hpp"
#include "dropout.hpp"
#include "forward.hpp"
#include "internal/checks.hpp"
#include "internal/forward_dispatch.hpp"
#include "layout.hpp"
#include "mask.hpp"
#include "scale.hpp"

namespace sdpa {

/// \brief Multi-head forward result: output n_q x (H d_v), logSumExp n_q x H (column h = head h).
template <typename Scalar_>
struct MultiHeadForwardResult {
  using Scalar = Scalar_;
  using AccScalar = internal::Accumulator<Scalar>;
  Matrix<Scalar> output;
  Matrix<AccScalar> logSumExp;
};

namespace internal {

/// The compile-time checks of every multi-head or batched forward entry point.
template <typename Out, typename Kernel, typename DQ, typename DK, typename DV, typename Scale, typename Mask>
void assertBatchedForward() {
  assertKernel<Kernel>();
  assertForwardScalars<DQ, DK, DV>();
  assertPolicyTypes<Scale, Mask>();
  assertOutputScalar<Out, typename DQ::Scalar>();
}

/// The multi-head and batched forward of either kernel, allocating its result.
template <typename Out, typename Kernel, typename DQ, typename DK, typename DV, typename Scale, typename Mask>
MultiHeadForwardResult<Out> batchedForward(const char* where, const Kernel& kern, const Eigen::MatrixBase<DQ>& q,
                                           const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                                           const BatchLayout& layout, const Heads& heads, const Scale& scale,
                                           const Mask& mask, const Dropout& dropout, DiagnosticsSink* sink) {
  assertBatchedForward<Out, Kernel, DQ, DK, DV, Scale, Mask>();
  using Acc = Accumulator<typename DQ::Scalar>;
  const HeadDims dims = checkBatch(where, q.rows(), q.cols(), k.rows(), k.cols(), v.rows(), v.cols(), layout, heads,
                                   scale, mask, dropout);
  MultiHeadForwardResult<Out> r{Matrix<Out>(q.rows(), heads.query * dims.dV), Matrix<Acc>(q.rows(), heads.query)};
  batchedForwardInto<Out>(where, kern, q, k, v, layout, heads, dims, scale, mask, dropout, sink, r.output, r.logSumExp);
  return r;
}

/// The same into outputs the caller sized (checked).
template <typename Kernel, typename DQ, typename DK, typename DV, typename DOut, typename DLse, typename Scale,
          typename Mask>
void batchedForwardInto(const char* where, const Kernel& kern, const Eigen::MatrixBase<DQ>& q,
                        const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v, const BatchLayout& layout,
                        const Heads& heads, const Scale& scale, const Mask& mask, const Dropout& dropout,
                        const Eigen::MatrixBase<DOut>& out, const Eigen::MatrixBase<DLse>& lse) {
  using Out = typename DOut::Scalar;
  using Acc = Accumulator<typename DQ::Scalar>;
  assertBatchedForward<Out, Kernel, DQ, DK, DV, Scale, Mask>();
  assertWritableOutput<DOut>();
  assertWritableOutput<DLse>();
  SDPA_STATIC_ASSERT((std::is_same_v<typename DLse::Scalar, Acc>),
                     THE_logSumExp_OUTPUT_MUST_BE_float_FOR_float_AND_HALF_INPUTS_AND_double_FOR_double);
  const HeadDims dims = checkBatch(where, q.rows(), q.cols(), k.rows(), k.cols(), v.rows(), v.cols(), layout, heads,
                                   scale, mask, dropout);
  checkOutputShape(where, "out", out.rows(), out.cols(), q.rows(), heads.query * dims.dV);
  checkOutputShape(where, "logSumExp", lse.rows(), lse.cols(), q.rows(), heads.query);
  batchedForwardInto<Out>(where, kern, q, k, v, layout, heads, dims, scale, mask, dropout, nullptr,
                          Eigen::Ref<Matrix<Out>>(const_cast<DOut&>(out.derived())),
                          Eigen::Ref<Matrix<Acc>>(const_cast<DLse&>(lse.derived())));
}

}  // namespace internal

/**
 * \brief Multi-head forward over packed inputs (see the file comment for the layout).
 *
 * \tparam OutScalar as for attentionForward: the input type, or float for half inputs
 * \param kern optional first argument, `kernel::Tiled{}` (default) or `kernel::Naive{}`
 * \param q, k, v packed heads: n_q x (H d_k), n_k x (H_kv d_k), n_k x (H_kv d_v)
 * \param heads `Heads{H}` or `Heads{H, H_kv}`
 * \param scale a shared policy (each head still uses its own d_k) or a `scale::PerHead<...>`
 * \param mask  a mask of sdpa::mask; Keep and Bias may be n_q x n_k (all heads) or
 *              (H n_q) x n_k (one per head); Alibi needs H slopes.
 * \param dropout attention dropout (default off)
 * \param sink  if not null, receives the per-row diagnostics of every head (either kernel)
 */
template <typename OutScalar = void, typename Kernel, typename DQ, typename DK, typename DV,
          typename Scale = scale::InvSqrtDk, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
MultiHeadForwardResult<OutputScalar<OutScalar, typename DQ::Scalar>> multiHeadAttentionForward(
    const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Heads& heads, const Scale& scale = Scale(), const Mask& mask = Mask(), const Dropout& dropout = Dropout(),
    DiagnosticsSink* sink = nullptr) {
  return internal::batchedForward<internal::OutputScalar<OutScalar, typename DQ::Scalar>>(
      "sdpa::multiHeadAttention", kern, q, k, v, internal::singleItem(q.rows(), k.rows()), heads, scale, mask, dropout,
      sink);
}

/// \brief multiHeadAttentionForward with the default kernel, kernel::Tiled.
template <typename OutScalar = void, typename DQ, typename DK, typename DV, typename Scale = scale::InvSqrtDk,
          typename Mask = mask::None>
MultiHeadForwardResult<OutputScalar<OutScalar, typename DQ::Scalar>> multiHeadAttentionForward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v, const Heads& heads,
    const Scale& scale = Scale(), const Mask& mask = Mask(), const Dropout& dropout = Dropout(),
    DiagnosticsSink* sink = nullptr) {
  return multiHeadAttentionForward<OutScalar>(kernel::Tiled{}, q, k, v, heads, scale, mask, dropout, sink);
}

/// \brief Multi-head attention, the output only: n_q x (H d_v).
template <typename OutScalar = void, typename Kernel, typename DQ, typename DK, typename DV,
          typename Scale = scale::InvSqrtDk, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
Matrix<OutputScalar<OutScalar, typename DQ::Scalar>> multiHeadAttention(
    const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Heads& heads, const Scale& scale = Scale(), const Mask& mask = Mask()) {
  return multiHeadAttentionForward<OutScalar>(kern, q, k, v, heads, scale, mask).output;
}

/// \brief multiHeadAttention with the default kernel, kernel::Tiled.
template <typename OutScalar = void, typename DQ, typename DK, typename DV, typename Scale = scale::InvSqrtDk,
          typename Mask = mask::None>
Matrix<OutputScalar<OutScalar, typename DQ::Scalar>> multiHeadAttention(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v, const Heads& heads,
    const Scale& scale = Scale(), const Mask& mask = Mask()) {
  return multiHeadAttentionForward<OutScalar>(kernel::Tiled{}, q, k, v, heads, scale, mask).output;
}

/**
 * \brief A batch of independent sequences in one packed matrix (`BatchLayout`), each with the
 * multi-head layout above: q is (sum n_q) x (H d_k), k and v (sum n_k) x (H_kv d_*). The mask
 * applies to each item in its own coordinates (a causal mask aligns per item); a Keep or Bias
 * matrix must fit every item. Output (sum n_q) x (H d_v), logSumExp (sum n_q) x H.
 */
template <typename OutScalar = void, typename Kernel, typename DQ, typename DK, typename DV,
          typename Scale = scale::InvSqrtDk, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
MultiHeadForwardResult<OutputScalar<OutScalar, typename DQ::Scalar>> batchedAttentionForward(
    const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const BatchLayout& layout, const Heads& heads, const Scale& scale = Scale(), const Mask& mask = Mask(),
    const Dropout& dropout = Dropout(), DiagnosticsSink* sink = nullptr) {
  return internal::batchedForward<internal::OutputScalar<OutScalar, typename DQ::Scalar>>(
      "sdpa::batchedAttention", kern, q, k, v, layout, heads, scale, mask, dropout, sink);
}

/// \brief batchedAttentionForward with the default kernel, kernel::Tiled.
template <typename OutScalar = void, typename DQ, typename DK, typename DV, typename Scale = scale::InvSqrtDk,
          typename Mask = mask::None>
MultiHeadForwardResult<OutputScalar<OutScalar, typename DQ::Scalar>> batchedAttentionForward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const BatchLayout& layout, const Heads& heads, const Scale& scale = Scale(), const Mask& mask = Mask(),
    const Dropout& dropout = Dropout(), DiagnosticsSink* sink = nullptr) {
  return batchedAttentionForward<OutScalar>(kernel::Tiled{}, q, k, v, layout, heads, scale, mask, dropout, sink);
}

/// \brief Batched attention, the output only: (sum n_q) x (H d_v).
template <typename OutScalar = void, typename Kernel, typename DQ, typename DK, typename DV,
          typename Scale = scale::InvSqrtDk, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
Matrix<OutputScalar<OutScalar, typename DQ::Scalar>> batchedAttention(
    const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const BatchLayout& layout, const Heads& heads, const Scale& scale = Scale(), const Mask& mask = Mask()) {
  return batchedAttentionForward<OutScalar>(kern, q, k, v, layout, heads, scale, mask).output;
}

/// \brief batchedAttention with the default kernel, kernel::Tiled.
template <typename OutScalar = void, typename DQ, typename DK, typename DV, typename Scale = scale::InvSqrtDk,
          typename Mask = mask::None>
Matrix<OutputScalar<OutScalar, typename DQ::Scalar>> batchedAttention(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const BatchLayout& layout, const Heads& heads, const Scale& scale = Scale(), const Mask& mask = Mask()) {
  return batchedAttentionForward<OutScalar>(kernel::Tiled{}, q, k, v, layout, heads, scale, mask).output;
}

/**
 * \brief multiHeadAttentionForward into outputs the caller sized: out n_q x (H d_v), logSumExp
 * n_q x H (the accumulation type), both column-major. Allocation-free under the conditions of
 * attentionForwardInto.
 */
template <typename Kernel, typename DQ, typename DK, typename DV, typename DOut, typename DLse,
          typename Scale = scale::InvSqrtDk, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
void multiHeadAttentionForwardInto(const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                   const Eigen::MatrixBase<DV>& v, const Heads& heads,
                                   const Eigen::MatrixBase<DOut>& out, const Eigen::MatrixBase<DLse>& logSumExp,
                                   const Scale& scale = Scale(), const Mask& mask = Mask(),
                                   const Dropout& dropout = Dropout()) {
  internal::batchedForwardInto("sdpa::multiHeadAttentionForwardInto", kern, q, k, v,
                               internal::singleItem(q.rows(), k.rows()), heads, scale, mask, dropout, out, logSumExp);
}

/// \brief multiHeadAttentionForwardInto with the default kernel, kernel::Tiled.
template <typename DQ, typename DK, typename DV, typename DOut, typename DLse, typename Scale = scale::InvSqrtDk,
          typename Mask = mask::None, typename = std::enable_if_t<!kernel::IsKernel<DQ>>>
void multiHeadAttentionForwardInto(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                   const Eigen::MatrixBase<DV>& v, const Heads& heads,
                                   const Eigen::MatrixBase<DOut>& out, const Eigen::MatrixBase<DLse>& logSumExp,
                                   const Scale& scale = Scale(), const Mask& mask = Mask(),
                                   const Dropout& dropout = Dropout()) {
  multiHeadAttentionForwardInto(kernel::Tiled{}, q, k, v, heads, out, logSumExp, scale, mask, dropout);
}

/// \brief batchedAttentionForward into outputs the caller sized: out (sum n_q) x (H d_v),
/// logSumExp (sum n_q) x H. Allocation-free under the conditions of attentionForwardInto.
template <typename Kernel, typename DQ, typename DK, typename DV, typename DOut, typename DLse,
          typename Scale = scale::InvSqrtDk, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
void batchedAttentionForwardInto(const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                 const Eigen::MatrixBase<DV>& v, const BatchLayout& layout, const Heads& heads,
                                 const Eigen::MatrixBase<DOut>& out, const Eigen::MatrixBase<DLse>& logSumExp,
                                 const Scale& scale = Scale(), const Mask& mask = Mask(),
                                 const Dropout& dropout = Dropout()) {
  internal::batchedForwardInto("sdpa::batchedAttentionForwardInto", kern, q, k, v, layout, heads, scale, mask, dropout,
                               out, logSumExp);
}

/// \brief batchedAttentionForwardInto with the default kernel, kernel::Tiled.
template <typename DQ, typename DK, typename DV, typename DOut, typename DLse, typename Scale = scale::InvSqrtDk,
          typename Mask = mask::None, typename = std::enable_if_t<!kernel::IsKernel<DQ>>>
void batchedAttentionForwardInto(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                 const Eigen::MatrixBase<DV>& v, const BatchLayout& layout, const Heads& heads,
                                 const Eigen::MatrixBase<DOut>& out, const Eigen::MatrixBase<DLse>& logSumExp,
                                 const Scale& scale = Scale(), const Mask& mask = Mask(),
                                 const Dropout& dropout = Dropout()) {
  batchedAttentionForwardInto(kernel::Tiled{}, q, k, v, layout, heads, out, logSumExp, scale, mask, dropout);
}

}  // namespace sdpa

#endif  // SDPA_MULTIHEAD_HPP
