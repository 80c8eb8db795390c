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
#include "internal/forward_naive.hpp"
#include "internal/key_count_scale.hpp"
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

/// Checks the packed shapes against the head layout and returns each head's d_k and d_v.
inline HeadDims checkHeads(const char* where, const Heads& heads, Index qRows, Index qCols, Index kRows, Index kCols,
                           Index vRows, Index vCols) {
  const auto n = [](Index x) { return std::to_string(x); };
  if (heads.query < 1 || heads.keyValue < 1 || heads.query % heads.keyValue != 0)
    throwInvalid(where, "Heads{" + n(heads.query) + ", " + n(heads.keyValue) +
                            "}: need H >= 1 query heads and H_kv >= 1 kv heads with H_kv dividing H");
  if (qCols % heads.query != 0)
    throwInvalid(where, "q is " + shapeString(qRows, qCols) + ": its " + n(qCols) + " columns do not split into " +
                            n(heads.query) + " heads");
  const Index dK = qCols / heads.query;
  if (kCols != heads.keyValue * dK)
    throwInvalid(where, "q is " + shapeString(qRows, qCols) + " (" + n(heads.query) + " heads of d_k = " + n(dK) +
                            ") so k must have " + n(heads.keyValue) + " x " + n(dK) + " = " + n(heads.keyValue * dK) +
                            " columns, but k is " + shapeString(kRows, kCols));
  if (vCols % heads.keyValue != 0)
    throwInvalid(where, "v is " + shapeString(vRows, vCols) + ": its " + n(vCols) + " columns do not split into " +
                            n(heads.keyValue) + " kv heads");
  if (kRows != vRows)
    throwInvalid(where, "k is " + shapeString(kRows, kCols) + " and v is " + shapeString(vRows, vCols) +
                            ": k and v must have the same number of rows (n_k)");
  return {dK, vCols / heads.keyValue};
}

template <typename Scale>
void checkScaleHeads(const char* where, const Scale& scale, Index heads) {
  if constexpr (scale::IsPerHead<Scale>) {
    if (scale.size() != heads)
      throwInvalid(where, "the PerHead scale has " + std::to_string(scale.size()) + " policies for " +
                              std::to_string(heads) + " heads");
  }
}

template <typename Scalar, typename Scale, typename Mask>
void multiHeadForward(const ConstRef<Scalar>& q, const ConstRef<Scalar>& k, const ConstRef<Scalar>& v,
                      const Heads& heads, const HeadDims& dims, const Scale& scale, const Mask& mask,
                      const Dropout& dropout, const BatchLayout& layout, Eigen::Ref<Matrix<Scalar>> out,
                      Eigen::Ref<Matrix<Scalar>> lse, DiagnosticsSink* sink) {
  typename forward_naive_impl<Scalar>::Scratch scratch;
  if (sink) startSink<Scalar>(*sink, q, k, heads, dims.dK, scale);
  forEachItemHead(layout, heads, [&](const ItemHead& u) {
    forward_naive_impl<Scalar>::run(
        headBlock(q, u.q0, u.head * dims.dK, u.nQ, dims.dK), headBlock(k, u.k0, u.kvHead * dims.dK, u.nK, dims.dK),
        headBlock(v, u.k0, u.kvHead * dims.dV, u.nK, dims.dV), headScale(scale, u.head), itemMask(mask, u), dropout,
        u.head, u.q0, u.k0, headBlock(out, u.q0, u.head * dims.dV, u.nQ, dims.dV), lse.col(u.head).segment(u.q0, u.nQ),
        scratch, sink ? &sink->rows(u.head) : nullptr);
  });
}

inline void checkLayout(const char* where, const BatchLayout& l, Index qRows, Index kRows) {
  const auto n = [](Index x) { return std::to_string(x); };
  const size_t items = l.qOffsets.size();
  if (items < 1 || l.kOffsets.size() != items)
    throwInvalid(where, "the batch layout needs B + 1 query and key offsets, got " + n(Index(l.qOffsets.size())) +
                            " and " + n(Index(l.kOffsets.size())));
  if (l.qOffsets.front() != 0 || l.kOffsets.front() != 0) throwInvalid(where, "the batch offsets must start at 0");
  for (size_t b = 0; b + 1 < items; ++b)
    if (l.qOffsets[b + 1] < l.qOffsets[b] || l.kOffsets[b + 1] < l.kOffsets[b])
      throwInvalid(where, "the batch offsets must not decrease (item " + n(Index(b)) + ")");
  if (l.qOffsets.back() != qRows || l.kOffsets.back() != kRows)
    throwInvalid(where, "the batch offsets end at " + n(l.qOffsets.back()) + " query and " + n(l.kOffsets.back()) +
                            " key rows, but q has " + n(qRows) + " rows and k has " + n(kRows));
  const size_t b = items - 1;
  if (!l.queryLengths.empty() && l.queryLengths.size() != b)
    throwInvalid(where,
                 "queryLengths has " + n(Index(l.queryLengths.size())) + " entries for " + n(Index(b)) + " items");
  if (!l.keyLengths.empty() && l.keyLengths.size() != b)
    throwInvalid(where, "keyLengths has " + n(Index(l.keyLengths.size())) + " entries for " + n(Index(b)) + " items");
  for (size_t i = 0; i < b; ++i) {
    if (!l.queryLengths.empty() && (l.queryLengths[i] < 0 || l.queryLengths[i] > l.qOffsets[i + 1] - l.qOffsets[i]))
      throwInvalid(where, "queryLengths[" + n(Index(i)) + "] = " + n(l.queryLengths[i]) + " is outside [0, " +
                              n(l.qOffsets[i + 1] - l.qOffsets[i]) + "]");
    if (!l.keyLengths.empty() && (l.keyLengths[i] < 0 || l.keyLengths[i] > l.kOffsets[i + 1] - l.kOffsets[i]))
      throwInvalid(where, "keyLengths[" + n(Index(i)) + "] = " + n(l.keyLengths[i]) + " is outside [0, " +
                              n(l.kOffsets[i + 1] - l.kOffsets[i]) + "]");
  }
}

}  // namespace internal

namespace internal {

/// Every run-time check of a multi-head or batched call; returns each head's d_k and d_v.
template <typename Scale, typename Mask>
HeadDims checkBatch(const char* where, Index qRows, Index qCols, Index kRows, Index kCols, Index vRows, Index vCols,
                    const BatchLayout& layout, const Heads& heads, const Scale& scale, const Mask& mask,
                    const Dropout& dropout) {
  const HeadDims dims = checkHeads(where, heads, qRows, qCols, kRows, kCols, vRows, vCols);
  checkScaleHeads(where, scale, heads.query);
  checkLayout(where, layout, qRows, kRows);
  for (Index b = 0; b < layout.size(); ++b)
    mask.check(where, layout.qOffsets[size_t(b) + 1] - layout.qOffsets[size_t(b)],
               layout.kOffsets[size_t(b) + 1] - layout.kOffsets[size_t(b)], heads.query);
  dropout.check(where);
  return dims;
}

/// The multi-head and batched forward of either kernel (a sink's rows from either) into
/// sized outputs, after checkBatch: out (sum n_q) x (H d_v), lse (sum n_q) x H.
template <typename Out, typename Kernel, typename DQ, typename DK, typename DV, typename Scale, typename Mask>
void batchedForwardInto(const char* where, const Kernel& kern, const Eigen::MatrixBase<DQ>& q,
                        const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v, const BatchLayout& layout,
                        const Heads& heads, const HeadDims& dims, const Scale& scale, const Mask& mask,
                        const Dropout& dropout, DiagnosticsSink* sink, Eigen::Ref<Matrix<Out>> out,
                        Eigen::Ref<Matrix<Accumulator<typename DQ::Scalar>>> lse) {
  using In = typename DQ::Scalar;
  using Acc = Accumulator<In>;
  const HeadTaus<Acc> taus(scale, heads.query, dims.dK);
  if constexpr (scale::DependsOnKeyCount<Scale>) {
    // tau_i = tau_h r(n_i): the same call on q' = r q with the per-head taus.
    forwardRowScaled<Scale>(where, sink != nullptr, q, k, v, layout, heads, dims.dK, mask, out,
                            [&](const auto& qs, const auto& kx, const auto& vx, auto o) {
                              batchedForwardInto<typename decltype(o)::Scalar>(
                                  where, kern, qs, kx, vx, layout, heads, dims, taus, mask, dropout, nullptr, o, lse);
                            });
  } else {
    if constexpr (std::is_same_v<Kernel, kernel::Tiled>) {
      const std::vector<RowStats*> rows =
          sink ? startSink<Acc>(*sink, q, k, heads, dims.dK, taus) : std::vector<RowStats*>{};
      withInputViews<In>(q, k, v, [&](const auto& qv, const auto& kv, const auto& vv) {
        forwardTiled<In, Out, std::decay_t<decltype(qv)>>(kern, qv, kv, vv, layout, heads, dims, taus, mask, dropout,
                                                          out, lse, sink ? rows.data() : nullptr);
      });
    } else if constexpr (std::is_same_v<Out, Acc>) {
      multiHeadForward<Acc>(q.template cast<Acc>(), k.template cast<Acc>(), v.template cast<Acc>(), heads, dims, taus,
                            mask, dropout, layout, out, lse, sink);
    } else {
      Matrix<Acc> outAcc(out.rows(), out.cols());
      multiHeadForward<Acc>(q.template cast<Acc>(), k.template cast<Acc>(), v.template cast<Acc>(), heads, dims, taus,
                            mask, dropout, layout, outAcc, lse, sink);
      out = outAcc.template cast<Out>();
    }
  }
}

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
