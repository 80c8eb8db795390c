/**
 * \file sdpa/backward.hpp
 * \brief The attention backward pass: gradients for q, k, v, the scale tau and the bias.
 *
 * Given the forward pass O = softmax(mask(softcap(tau q k^T))) v and dOut = dL/dO, returns
 * dL/dq (n_q x d_k), dL/dk (n_k x d_k), dL/dv (n_k x d_v), dL/dtau and, when the mask holds a
 * `Bias` matrix, dL/dbias shaped like that matrix. dL/dtau is reported for every scale policy:
 * its sign says which way the temperature wants to move (seed C10, C17). A `Learnable` scale
 * passed as a non-const lvalue also accumulates it (`accumulateGrad`), per head for a
 * `PerHead<Learnable<...>>`; a const one is left alone. For `scale::LogN`, whose tau differs per
 * row, dscale is dL/dc, the gradient of its parameter, and a non-const LogN accumulates that.
 */
#ifndef SDPA_BACKWARD_HPP
#define SDPA_BACKWARD_HPP

#include <type_traits>

#include "dropout.hpp"
#include "forward.hpp"
#include "internal/backward_naive.hpp"
#include "internal/backward_tiled.hpp"
#include "kernel.hpp"
#include "mask.hpp"
#include "multihead.hpp"
#include "scale.hpp"

namespace sdpa {

/// \brief Gradients of one head.
template <typename Scalar_>
struct Gradients {
  using Scalar = Scalar_;
  Matrix<Scalar> dq;     ///< n_q x d_k
  Matrix<Scalar> dk;     ///< n_k x d_k
  Matrix<Scalar> dv;     ///< n_k x d_v
  Scalar dscale = 0;     ///< dL/dtau (scale::LogN: dL/dc)
  Matrix<Scalar> dbias;  ///< shaped like the mask's Bias matrix; empty without one
};

/// \brief Gradients of a multi-head or batched call, in the packed layout of its inputs.
template <typename Scalar_>
struct MultiHeadGradients {
  using Scalar = Scalar_;
  Matrix<Scalar> dq;      ///< like q: n_q x (H d_k); GQA sums the query heads of a kv head into dk, dv
  Matrix<Scalar> dk;      ///< like k: n_k x (H_kv d_k)
  Matrix<Scalar> dv;      ///< like v: n_k x (H_kv d_v)
  Vector<Scalar> dscale;  ///< H: dL/dtau_h of each query head (scale::LogN: dL/dc_h)
  /// Shaped like the mask's Bias matrix (a shared n_q x n_k bias gets the sum over heads and
  /// batch items, a per-head one its blocks); empty without one.
  Matrix<Scalar> dbias;
};

namespace internal {

template <typename Scalar>
void checkBackwardInputs(const char* where, Index nQ, Index outCols, Index lseCols, Index oRows, Index oCols,
                         Index lseRows, Index lseColsGot, Index dRows, Index dCols) {
  if (oRows != nQ || oCols != outCols)
    throwInvalid(where, "the forward output is " + shapeString(oRows, oCols) + " but must be " +
                            shapeString(nQ, outCols) + ": pass the ForwardResult of the same inputs");
  if (lseRows != nQ || lseColsGot != lseCols)
    throwInvalid(where, "the forward logSumExp is " + shapeString(lseRows, lseColsGot) + " but must be " +
                            shapeString(nQ, lseCols));
  if (dRows != nQ || dCols != outCols)
    throwInvalid(where, "dOut is " + shapeString(dRows, dCols) + " but the output is " + shapeString(nQ, outCols));
}

/// Adds the per-head dL/dtau to a Learnable parameter (shared: the sum; PerHead: each head).
template <typename Scale, typename D>
void accumulateScaleGrad(Scale& scale, const Eigen::MatrixBase<D>& dscale) {
  if constexpr (scale::IsPerHead<Scale>) {
    if constexpr (Scale::IsLearnable)
      for (Index h = 0; h < dscale.size(); ++h) scale.head(h).accumulateGrad(typename Scale::Policy::Scalar(dscale(h)));
  } else if constexpr (Scale::IsLearnable) {
    scale.accumulateGrad(typename Scale::Scalar(dscale.sum()));
  }
}

template <typename Scale>
inline constexpr bool AccumulatesInto =
    std::decay_t<Scale>::IsLearnable && !std::is_const_v<std::remove_reference_t<Scale>>;

/**
 * The backward of either kernel into gradients the caller sized and zeroed, after the checks:
 * dq n_q x (H d_k), dk n_k x (H_kv d_k), dv n_k x (H_kv d_v), dscale H (dL/dtau_h, or dL/dc_h
 * for a key-count scale); dbias, if not null, shaped as the mask's Bias matrix.
 */
/// QView, KView, VView, OView (withInputViews): how q, k, v and dO are read in place, each
/// column-major (ConstRef) or row-major (RowConstRef).
template <typename Scalar, typename QView = ConstRef<Scalar>, typename KView = QView, typename VView = KView,
          typename OView = QView, typename Kernel, typename Scale, typename Mask>
void batchedBackwardInto(const Kernel& kern, const typename Identity<QView>::type& q,
                         const typename Identity<KView>::type& k, const typename Identity<VView>::type& v,
                         const typename Identity<OView>::type& dO, const BatchLayout& layout, const Heads& heads,
                         const HeadDims& dims, const Scale& scale, const Mask& mask, const Dropout& dropout,
                         Eigen::Ref<Matrix<Scalar>> dq, Eigen::Ref<Matrix<Scalar>> dk, Eigen::Ref<Matrix<Scalar>> dv,
                         Eigen::Ref<Vector<Scalar>> dscale, Matrix<Scalar>* dbias) {
  if constexpr (scale::DependsOnKeyCount<Scale>) {
    // forward: tau_i q_i . k_j = tau_h (r_i q_i) . k_j with tau_h = c s(d_k)   =>   the gradients
    // of q' = r q and tau_h, then dq_i = r_i dq'_i and dL/dc = s(d_k) dL/dtau_h.
    using QMatrix = std::conditional_t<std::is_same_v<QView, ConstRef<Scalar>>, Matrix<Scalar>, RowMajorMatrix<Scalar>>;
    Matrix<double> factors;
    const QMatrix qs = rowScaledQuery<Scalar, Scale, QMatrix>(q, layout, heads, dims.dK, mask, factors);
    batchedBackwardInto<Scalar, QView, KView, VView, OView>(kern, QView(qs), k, v, dO, layout, heads, dims,
                                                            HeadTaus<Scalar>(scale, heads.query, dims.dK), mask,
                                                            dropout, dq, dk, dv, dscale, dbias);
    scaleQueryGradient<Scalar>(dq, factors, dims.dK);
    using Policy = typename RowFactorPolicy<Scale>::type;
    dscale *= Scalar(Policy::valueSlope(dims.dK));
  } else {
    const HeadTaus<Scalar> taus(scale, heads.query, dims.dK);
    if constexpr (std::is_same_v<Kernel, kernel::Tiled>) {
      backwardTiled<Scalar, QView, KView, VView, OView>(kern, q, k, v, dO, layout, heads, dims, taus, mask, dropout, dq,
                                                        dk, dv, dscale, dbias);
    } else {  // an else, not an early return: a tiled call must not instantiate the naive kernel
      typename backward_naive_impl<Scalar>::Scratch scratch;
      Vector<double> dtau = Vector<double>::Zero(heads.query);
      forEachItemHead(layout, heads, [&](const ItemHead& u) {
        const Index dbiasRow0 = dbias && dbias->rows() != u.nQ ? u.head * u.nQ : 0;
        dtau(u.head) += backward_naive_impl<Scalar>::run(
            headBlock(q, u.q0, u.head * dims.dK, u.nQ, dims.dK), headBlock(k, u.k0, u.kvHead * dims.dK, u.nK, dims.dK),
            headBlock(v, u.k0, u.kvHead * dims.dV, u.nK, dims.dV), headBlock(dO, u.q0, u.head * dims.dV, u.nQ, dims.dV),
            taus.tau(u.head), itemMask(mask, u), dropout, u.head, u.q0, u.k0,
            headBlock(dq, u.q0, u.head * dims.dK, u.nQ, dims.dK),
            headBlock(dk, u.k0, u.kvHead * dims.dK, u.nK, dims.dK),
            headBlock(dv, u.k0, u.kvHead * dims.dV, u.nK, dims.dV), dbias, dbiasRow0, scratch);
      });
      dscale += dtau.template cast<Scalar>();
    }
  }
}

/// The shape of an argument that is only checked, never read (the forward's output and
/// logSumExp): taken as its sizes, so that no storage order makes a copy of it.
struct Shape {
  Index rows, cols;
};
template <typename D>
Shape shapeOf(const Eigen::MatrixBase<D>& x) {
  return {x.rows(), x.cols()};
}

/// Every run-time check of a backward call; returns each head's d_k and d_v.
template <typename Scalar, typename Scale, typename Mask>
HeadDims checkBackward(const char* where, Shape q, Shape k, Shape v, Shape o, Shape lse, Shape dO,
                       const BatchLayout& layout, const Heads& heads, const Scale& scale, const Mask& mask,
                       const Dropout& dropout) {
  const HeadDims dims =
      checkBatch(where, q.rows, q.cols, k.rows, k.cols, v.rows, v.cols, layout, heads, scale, mask, dropout);
  checkBackwardInputs<Scalar>(where, q.rows, heads.query * dims.dV, heads.query, o.rows, o.cols, lse.rows, lse.cols,
                              dO.rows, dO.cols);
  return dims;
}

/// batchedBackwardInto on q, k, v and dO read in place, each in its own storage order
/// (withInputViews).
template <typename Scalar, typename Kernel, typename DQ, typename DK, typename DV, typename DO, typename Scale,
          typename Mask>
void backwardOnViews(const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                     const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& dO, const BatchLayout& layout,
                     const Heads& heads, const HeadDims& dims, const Scale& scale, const Mask& mask,
                     const Dropout& dropout, Eigen::Ref<Matrix<Scalar>> dq, Eigen::Ref<Matrix<Scalar>> dk,
                     Eigen::Ref<Matrix<Scalar>> dv, Eigen::Ref<Vector<Scalar>> dscale, Matrix<Scalar>* dbias) {
  withInputViews<Scalar>(
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& dOv) {
        batchedBackwardInto<Scalar, std::decay_t<decltype(qv)>, std::decay_t<decltype(kv)>, std::decay_t<decltype(vv)>,
                            std::decay_t<decltype(dOv)>>(kern, qv, kv, vv, dOv, layout, heads, dims, scale, mask,
                                                         dropout, dq, dk, dv, dscale, dbias);
      },
      q, k, v, dO);
}

template <typename Scalar, typename Kernel, typename DQ, typename DK, typename DV, typename DO, typename Scale,
          typename Mask>
MultiHeadGradients<Scalar> batchedBackward(const char* where, const Kernel& kern, const Eigen::MatrixBase<DQ>& q,
                                           const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v, Shape o,
                                           Shape lse, const Eigen::MatrixBase<DO>& dO, const BatchLayout& layout,
                                           const Heads& heads, const Scale& scale, const Mask& mask,
                                           const Dropout& dropout) {
  const HeadDims dims = checkBackward<Scalar>(where, shapeOf(q), shapeOf(k), shapeOf(v), o, lse, shapeOf(dO), layout,
                                              heads, scale, mask, dropout);
  MultiHeadGradients<Scalar> g{Matrix<Scalar>::Zero(q.rows(), q.cols()),
                               Matrix<Scalar>::Zero(k.rows(), k.cols()),
                               Matrix<Scalar>::Zero(v.rows(), v.cols()),
                               Vector<Scalar>::Zero(heads.query),
                               {}};
  const std::pair<Index, Index> biasShape = mask::internal::biasMatrixShape(mask);
  if (biasShape.first >= 0) g.dbias.setZero(biasShape.first, biasShape.second);
  backwardOnViews<Scalar>(kern, q, k, v, dO, layout, heads, dims, scale, mask, dropout, g.dq, g.dk, g.dv, g.dscale,
                          biasShape.first >= 0 ? &g.dbias : nullptr);
  return g;
}

/// The backward into the caller's gradients (checked, then zeroed); the bias gradient is not
/// computed.
template <typename Scalar, typename Kernel, typename DQ, typename DK, typename DV, typename DO, typename Scale,
          typename Mask, typename DDq, typename DDk, typename DDv, typename DDs>
void batchedBackwardIntoChecked(const char* where, const Kernel& kern, const Eigen::MatrixBase<DQ>& q,
                                const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v, Shape o, Shape lse,
                                const Eigen::MatrixBase<DO>& dO, const BatchLayout& layout, const Heads& heads,
                                const Scale& scale, const Mask& mask, const Dropout& dropout,
                                const Eigen::MatrixBase<DDq>& dq, const Eigen::MatrixBase<DDk>& dk,
                                const Eigen::MatrixBase<DDv>& dv, const Eigen::MatrixBase<DDs>& dscale) {
  assertWritableOutput<DDq>();
  assertWritableOutput<DDk>();
  assertWritableOutput<DDv>();
  SDPA_STATIC_ASSERT((std::is_same_v<typename DDq::Scalar, Scalar> && std::is_same_v<typename DDk::Scalar, Scalar> &&
                      std::is_same_v<typename DDv::Scalar, Scalar> && std::is_same_v<typename DDs::Scalar, Scalar>),
                     THE_GRADIENTS_MUST_HAVE_THE_SCALAR_TYPE_OF_THE_INPUTS);
  const HeadDims dims = checkBackward<Scalar>(where, shapeOf(q), shapeOf(k), shapeOf(v), o, lse, shapeOf(dO), layout,
                                              heads, scale, mask, dropout);
  checkOutputShape(where, "dq", dq.rows(), dq.cols(), q.rows(), q.cols());
  checkOutputShape(where, "dk", dk.rows(), dk.cols(), k.rows(), k.cols());
  checkOutputShape(where, "dv", dv.rows(), dv.cols(), v.rows(), v.cols());
  checkOutputShape(where, "dscale", dscale.rows(), dscale.cols(), heads.query, 1);
  Eigen::Ref<Matrix<Scalar>> dqR(const_cast<DDq&>(dq.derived())), dkR(const_cast<DDk&>(dk.derived())),
      dvR(const_cast<DDv&>(dv.derived()));
  Eigen::Ref<Vector<Scalar>> dsR(const_cast<DDs&>(dscale.derived()));
  dqR.setZero();
  dkR.setZero();
  dvR.setZero();
  dsR.setZero();
  backwardOnViews<Scalar>(kern, q, k, v, dO, layout, heads, dims, scale, mask, dropout, dqR, dkR, dvR, dsR, nullptr);
}

template <typename Kernel, typename DQ, typename DK, typename DV, typename DO, typename Scale, typename Mask>
void assertBackwardTypes() {
  assertKernel<Kernel>();
  assertScalars<DQ, DK>();
  assertScalars<DQ, DV>();
  assertScalars<DQ, DO>();
  assertPolicyTypes<Scale, Mask>();
}

/// The checks of the single-head backward entry points, compile-time and run-time.
template <typename Kernel, typename DO, typename Scale, typename DQ, typename DK, typename DV, typename Mask>
void checkSingleHeadBackward(const char* where, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                             const Eigen::MatrixBase<DV>& v, const Mask& mask) {
  assertBackwardTypes<Kernel, DQ, DK, DV, DO, Scale, Mask>();
  SDPA_STATIC_ASSERT(!scale::IsPerHead<Scale>,
                     A_PER_HEAD_SCALE_NEEDS_THE_MULTI_HEAD_ENTRY_POINTS__USE_multiHeadAttentionBackward);
  checkForward(where, q.rows(), q.cols(), k.rows(), k.cols(), v.rows(), v.cols(), mask);
}

/// The multi-head and batched backward Into entry points: their checks, the call into the
/// caller's gradients, and the accumulation into a non-const learnable scale.
template <typename Kernel, typename DQ, typename DK, typename DV, typename DOutF, typename DLse, typename DO,
          typename DDq, typename DDk, typename DDv, typename DDs, typename Scale, typename Mask>
void packedBackwardInto(const char* where, const Kernel& kern, const Eigen::MatrixBase<DQ>& q,
                        const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                        const Eigen::MatrixBase<DOutF>& out, const Eigen::MatrixBase<DLse>& logSumExp,
                        const Eigen::MatrixBase<DO>& dOut, const BatchLayout& layout, const Heads& heads,
                        const Eigen::MatrixBase<DDq>& dq, const Eigen::MatrixBase<DDk>& dk,
                        const Eigen::MatrixBase<DDv>& dv, const Eigen::MatrixBase<DDs>& dscale, Scale&& scale,
                        const Mask& mask, const Dropout& dropout) {
  assertBackwardTypes<Kernel, DQ, DK, DV, DO, std::decay_t<Scale>, Mask>();
  batchedBackwardIntoChecked<typename DQ::Scalar>(where, kern, q, k, v, shapeOf(out), shapeOf(logSumExp), dOut, layout,
                                                  heads, scale, mask, dropout, dq, dk, dv, dscale);
  if constexpr (AccumulatesInto<Scale>) accumulateScaleGrad(scale, dscale);
}

}  // namespace internal

/**
 * \brief Backward pass of one head.
 *
 * \param kern optional first argument: `kernel::Tiled{}` (the default) or `kernel::Naive{}`
 * \param q, k, v the forward pass's inputs (n_q x d_k, n_k x d_k, n_k x d_v)
 * \param fwd   the ForwardResult of attentionForward(q, k, v, scale, mask, dropout); its shapes are
 *              checked, but the softmax is recomputed from q and k (NUMERICS.md: a logSumExp
 *              rounded to float would cost float gradients their accuracy at large logits)
 * \param dOut  dL/dO, n_q x d_v
 * \param scale the same policy as the forward pass; a non-const Learnable accumulates dL/dtau
 * \param mask, dropout the same as the forward pass
 * \throws std::invalid_argument naming the shapes on any mismatch.
 */
template <typename Kernel, typename DQ, typename DK, typename DV, typename DO, typename Scale,
          typename Mask = mask::None, typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
Gradients<typename DQ::Scalar> attentionBackward(const Kernel& kern, const Eigen::MatrixBase<DQ>& q,
                                                 const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                                                 const ForwardResult<typename DQ::Scalar>& fwd,
                                                 const Eigen::MatrixBase<DO>& dOut, Scale&& scale,
                                                 const Mask& mask = Mask(), const Dropout& dropout = Dropout()) {
  using Scalar = typename DQ::Scalar;
  constexpr const char* where = "sdpa::attentionBackward";
  internal::checkSingleHeadBackward<Kernel, DO, std::decay_t<Scale>>(where, q, k, v, mask);
  auto g = internal::batchedBackward<Scalar>(where, kern, q, k, v, internal::shapeOf(fwd.output),
                                             internal::shapeOf(fwd.logSumExp), dOut,
                                             internal::singleItem(q.rows(), k.rows()), Heads{1}, scale, mask, dropout);
  if constexpr (internal::AccumulatesInto<Scale>) internal::accumulateScaleGrad(scale, g.dscale);
  return Gradients<Scalar>{std::move(g.dq), std::move(g.dk), std::move(g.dv), g.dscale(0), std::move(g.dbias)};
}

/// \brief attentionBackward with the default kernel, kernel::Tiled.
template <typename DQ, typename DK, typename DV, typename DO, typename Scale, typename Mask = mask::None,
          typename = std::enable_if_t<!kernel::IsKernel<DQ>>>
Gradients<typename DQ::Scalar> attentionBackward(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                                 const Eigen::MatrixBase<DV>& v,
                                                 const ForwardResult<typename DQ::Scalar>& fwd,
                                                 const Eigen::MatrixBase<DO>& dOut, Scale&& scale,
                                                 const Mask& mask = Mask(), const Dropout& dropout = Dropout()) {
  return attentionBackward(kernel::Tiled{}, q, k, v, fwd, dOut, std::forward<Scale>(scale), mask, dropout);
}

/// \brief Backward pass with the default policies of the forward pass (InvSqrtDk, no mask).
template <typename DQ, typename DK, typename DV, typename DO>
Gradients<typename DQ::Scalar> attentionBackward(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                                 const Eigen::MatrixBase<DV>& v,
                                                 const ForwardResult<typename DQ::Scalar>& fwd,
                                                 const Eigen::MatrixBase<DO>& dOut) {
  return attentionBackward(kernel::Tiled{}, q, k, v, fwd, dOut, scale::InvSqrtDk{});
}

/**
 * \brief Backward pass of multiHeadAttentionForward: gradients in the packed layout, GQA/MQA
 * kv-head gradients summed over the query heads that share them, dscale per query head.
 */
template <typename Kernel, typename DQ, typename DK, typename DV, typename DO, typename Scale,
          typename Mask = mask::None, typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
MultiHeadGradients<typename DQ::Scalar> multiHeadAttentionBackward(
    const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const MultiHeadForwardResult<typename DQ::Scalar>& fwd, const Eigen::MatrixBase<DO>& dOut, const Heads& heads,
    Scale&& scale, const Mask& mask = Mask(), const Dropout& dropout = Dropout()) {
  internal::assertBackwardTypes<Kernel, DQ, DK, DV, DO, std::decay_t<Scale>, Mask>();
  using Scalar = typename DQ::Scalar;
  auto g = internal::batchedBackward<Scalar>("sdpa::multiHeadAttentionBackward", kern, q, k, v,
                                             internal::shapeOf(fwd.output), internal::shapeOf(fwd.logSumExp), dOut,
                                             internal::singleItem(q.rows(), k.rows()), heads, scale, mask, dropout);
  if constexpr (internal::AccumulatesInto<Scale>) internal::accumulateScaleGrad(scale, g.dscale);
  return g;
}

/// \brief multiHeadAttentionBackward with the default kernel, kernel::Tiled.
template <typename DQ, typename DK, typename DV, typename DO, typename Scale, typename Mask = mask::None,
          typename = std::enable_if_t<!kernel::IsKernel<DQ>>>
MultiHeadGradients<typename DQ::Scalar> multiHeadAttentionBackward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const MultiHeadForwardResult<typename DQ::Scalar>& fwd, const Eigen::MatrixBase<DO>& dOut, const Heads& heads,
    Scale&& scale, const Mask& mask = Mask(), const Dropout& dropout = Dropout()) {
  return multiHeadAttentionBackward(kernel::Tiled{}, q, k, v, fwd, dOut, heads, std::forward<Scale>(scale), mask,
                                    dropout);
}

/// \brief Backward pass of batchedAttentionForward (same layout, heads, scale, mask, dropout).
template <typename Kernel, typename DQ, typename DK, typename DV, typename DO, typename Scale,
          typename Mask = mask::None, typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
MultiHeadGradients<typename DQ::Scalar> batchedAttentionBackward(
    const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const MultiHeadForwardResult<typename DQ::Scalar>& fwd, const Eigen::MatrixBase<DO>& dOut,
    const BatchLayout& layout, const Heads& heads, Scale&& scale, const Mask& mask = Mask(),
    const Dropout& dropout = Dropout()) {
  internal::assertBackwardTypes<Kernel, DQ, DK, DV, DO, std::decay_t<Scale>, Mask>();
  using Scalar = typename DQ::Scalar;
  auto g =
      internal::batchedBackward<Scalar>("sdpa::batchedAttentionBackward", kern, q, k, v, internal::shapeOf(fwd.output),
                                        internal::shapeOf(fwd.logSumExp), dOut, layout, heads, scale, mask, dropout);
  if constexpr (internal::AccumulatesInto<Scale>) internal::accumulateScaleGrad(scale, g.dscale);
  return g;
}

/// \brief batchedAttentionBackward with the default kernel, kernel::Tiled.
template <typename DQ, typename DK, typename DV, typename DO, typename Scale, typename Mask = mask::None,
          typename = std::enable_if_t<!kernel::IsKernel<DQ>>>
MultiHeadGradients<typename DQ::Scalar> batchedAttentionBackward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const MultiHeadForwardResult<typename DQ::Scalar>& fwd, const Eigen::MatrixBase<DO>& dOut,
    const BatchLayout& layout, const Heads& heads, Scale&& scale, const Mask& mask = Mask(),
    const Dropout& dropout = Dropout()) {
  return batchedAttentionBackward(kernel::Tiled{}, q, k, v, fwd, dOut, layout, heads, std::forward<Scale>(scale), mask,
                                  dropout);
}

/**
 * \brief The backward pass into gradients the caller sized, for training loops that must not
 * allocate: returns dL/dtau (dL/dc for scale::LogN) and, for a non-const Learnable or LogN,
 * accumulates it as attentionBackward does.
 *
 * \param kern optional first argument: `kernel::Tiled{}` (the default) or `kernel::Naive{}`
 * \param q, k, v the forward pass's inputs (n_q x d_k, n_k x d_k, n_k x d_v)
 * \param out, logSumExp the forward's results (from attentionForwardInto or attentionForward)
 * \param dOut dL/dO, n_q x d_v
 * \param dq, dk, dv column-major, n_q x d_k, n_k x d_k, n_k x d_v (checked), overwritten
 * \param scale, mask, dropout the forward pass's (a non-const Learnable or LogN accumulates)
 * \throws std::invalid_argument naming the shapes on any mismatch. The gradient of a Bias matrix is not computed (the
 * allocating attentionBackward returns it). With kernel::Tiled, column-major inputs and a fixed
 * tau, a call allocates nothing once an earlier one on the thread was as large, except for the
 * workspace Eigen's products take on the heap where it exceeds their stack limit (128 KiB):
 * the backward's products are Eigen's (NUMERICS.md, tests/test_allocations.cpp).
 */
template <typename Kernel, typename DQ, typename DK, typename DV, typename DOutF, typename DLse, typename DO,
          typename DDq, typename DDk, typename DDv, typename Scale, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
typename DQ::Scalar attentionBackwardInto(const Kernel& kern, const Eigen::MatrixBase<DQ>& q,
                                          const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                                          const Eigen::MatrixBase<DOutF>& out, const Eigen::MatrixBase<DLse>& logSumExp,
                                          const Eigen::MatrixBase<DO>& dOut, const Eigen::MatrixBase<DDq>& dq,
                                          const Eigen::MatrixBase<DDk>& dk, const Eigen::MatrixBase<DDv>& dv,
                                          Scale&& scale, const Mask& mask = Mask(),
                                          const Dropout& dropout = Dropout()) {
  using S = std::decay_t<Scale>;
  using Scalar = typename DQ::Scalar;
  constexpr const char* where = "sdpa::attentionBackwardInto";
  internal::checkSingleHeadBackward<Kernel, DO, S>(where, q, k, v, mask);
  Scalar dscale[1] = {Scalar(0)};
  Eigen::Map<Vector<Scalar>> ds(dscale, 1);
  internal::batchedBackwardIntoChecked<Scalar>(
      where, kern, q, k, v, internal::shapeOf(out), internal::shapeOf(logSumExp), dOut,
      internal::singleItem(q.rows(), k.rows()), Heads{1}, scale, mask, dropout, dq, dk, dv, ds);
  if constexpr (internal::AccumulatesInto<Scale>) scale.accumulateGrad(typename S::Scalar(dscale[0]));
  return dscale[0];
}

/// \brief attentionBackwardInto with the default kernel, kernel::Tiled.
template <typename DQ, typename DK, typename DV, typename DOutF, typename DLse, typename DO, typename DDq, typename DDk,
          typename DDv, typename Scale, typename Mask = mask::None, typename = std::enable_if_t<!kernel::IsKernel<DQ>>>
typename DQ::Scalar attentionBackwardInto(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                          const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DOutF>& out,
                                          const Eigen::MatrixBase<DLse>& logSumExp, const Eigen::MatrixBase<DO>& dOut,
                                          const Eigen::MatrixBase<DDq>& dq, const Eigen::MatrixBase<DDk>& dk,
                                          const Eigen::MatrixBase<DDv>& dv, Scale&& scale, const Mask& mask = Mask(),
                                          const Dropout& dropout = Dropout()) {
  return attentionBackwardInto(kernel::Tiled{}, q, k, v, out, logSumExp, dOut, dq, dk, dv, std::forward<Scale>(scale),
                               mask, dropout);
}

/**
 * \brief batchedAttentionBackward into gradients the caller sized (packed as the inputs; dscale
 * H, dL/dtau_h), under the conditions of attentionBackwardInto. multiHeadAttentionBackwardInto is
 * this with one item: `BatchLayout::varlen({0, n_q}, {0, n_k})`.
 */
template <typename Kernel, typename DQ, typename DK, typename DV, typename DOutF, typename DLse, typename DO,
          typename DDq, typename DDk, typename DDv, typename DDs, typename Scale, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
void batchedAttentionBackwardInto(const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                  const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DOutF>& out,
                                  const Eigen::MatrixBase<DLse>& logSumExp, const Eigen::MatrixBase<DO>& dOut,
                                  const BatchLayout& layout, const Heads& heads, const Eigen::MatrixBase<DDq>& dq,
                                  const Eigen::MatrixBase<DDk>& dk, const Eigen::MatrixBase<DDv>& dv,
                                  const Eigen::MatrixBase<DDs>& dscale, Scale&& scale, const Mask& mask = Mask(),
                                  const Dropout& dropout = Dropout()) {
  internal::packedBackwardInto("sdpa::batchedAttentionBackwardInto", kern, q, k, v, out, logSumExp, dOut, layout, heads,
                               dq, dk, dv, dscale, std::forward<Scale>(scale), mask, dropout);
}

/// \brief multiHeadAttentionBackward into gradients the caller sized (see
/// batchedAttentionBackwardInto).
template <typename Kernel, typename DQ, typename DK, typename DV, typename DOutF, typename DLse, typename DO,
          typename DDq, typename DDk, typename DDv, typename DDs, typename Scale, typename Mask = mask::None,
          typename = std::enable_if_t<kernel::IsKernel<Kernel>>>
void multiHeadAttentionBackwardInto(const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                    const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DOutF>& out,
                                    const Eigen::MatrixBase<DLse>& logSumExp, const Eigen::MatrixBase<DO>& dOut,
                                    const Heads& heads, const Eigen::MatrixBase<DDq>& dq,
                                    const Eigen::MatrixBase<DDk>& dk, const Eigen::MatrixBase<DDv>& dv,
                                    const Eigen::MatrixBase<DDs>& dscale, Scale&& scale, const Mask& mask = Mask(),
                                    const Dropout& dropout = Dropout()) {
  internal::packedBackwardInto("sdpa::multiHeadAttentionBackwardInto", kern, q, k, v, out, logSumExp, dOut,
                               internal::singleItem(q.rows(), k.rows()), heads, dq, dk, dv, dscale,
                               std::forward<Scale>(scale), mask, dropout);
}

}  // namespace sdpa

#endif  // SDPA_BACKWARD_HPP
