#ifndef SDPA_INTERNAL_BACKWARD_NAIVE_HPP
#define SDPA_INTERNAL_BACKWARD_NAIVE_HPP

#include <cmath>
#include <limits>

#include "../dropout.hpp"
#include "../mask.hpp"
#include "forward_naive.hpp"
#include "macros.hpp"

namespace sdpa::internal {

/**
 * The reference backward pass of one head. It recomputes P from the saved logSumExp and uses
 * D = rowsum(dO * O) instead of a stored P, the recurrence a tiled kernel reuses tile by tile;
 * here the n_q x n_k buffers are whole. Each step quotes the forward line it differentiates.
 */
template <typename Scalar>
struct backward_naive_impl {
  /// n_q x n_k buffers, kept alive across heads.
  struct Scratch {
    RowMajorMatrix<Scalar> x, p, pDropped, dp;
  };

  /// Accumulates dq (n_q x d_k), dk (n_k x d_k), dv (n_k x d_v) and, if dbias is not null,
  /// dbias->block(dbiasRow0, 0, n_q, n_k); returns dL/dtau of this head.
  template <typename Scale, typename Mask>
  static Scalar run(const ConstRef<Scalar>& q, const ConstRef<Scalar>& k, const ConstRef<Scalar>& v,
                    const ConstRef<Scalar>& o, const Eigen::Ref<const Vector<Scalar>>& lse, const ConstRef<Scalar>& dO,
                    const Scale& scale, const Mask& mask, const Dropout& dropout, Index head, Index row0, Index col0,
                    Eigen::Ref<Matrix<Scalar>> dq, Eigen::Ref<Matrix<Scalar>> dk, Eigen::Ref<Matrix<Scalar>> dv,
                    Matrix<Scalar>* dbias, Index dbiasRow0, Scratch& s) {
    const Index nQ = q.rows(), nK = k.rows();
    const Scalar tau = scale.template value<Scalar>(q.cols());

    // forward: X = q k^T;  Y = tau X;  L = mask(softcap(Y))
    s.x.resize(nQ, nK);
    s.x.noalias() = q * k.transpose();
    s.p = s.x;
    if (tau != Scalar(1)) s.p *= tau;
    if constexpr (!Mask::IsNone) mask.apply(s.p, 0, 0, nQ, nK, head);

    // forward: P = softmax(L) = exp(L - lse); hidden entries are exactly 0, and so is a fully
    // masked row (lse = -inf), never exp(-inf - -inf) = NaN.
    for (Index i = 0; i < nQ; ++i) {
      auto row = s.p.row(i).array();
      weightsFromLogSumExp(row, row, lse(i));
    }

    // forward: Pd = P * M / (1 - p_drop);  O = Pd v   =>   dv += Pd^T dO
    const RowMajorMatrix<Scalar>* pUsed = &s.p;
    if (dropout.enabled()) {
      s.pDropped = s.p;
      applyDropout(s.pDropped, dropout, head, row0, col0);
      pUsed = &s.pDropped;
    }
    addProductSkippingZeros(pUsed->transpose(), dO, dv);

    // forward: O = Pd v   =>   dPd = dO v^T;  and Pd = P * M / (1 - p_drop)  =>  dP = dPd * M / (1 - p_drop)
    s.dp.resize(nQ, nK);
    s.dp.noalias() = dO * v.transpose();
    if (dropout.enabled()) {
      const Scalar keepScale = Scalar(dropout.keepScale());
      for (Index i = 0; i < nQ; ++i)
        for (Index j = 0; j < nK; ++j)
          s.dp(i, j) = dropout.keep(row0 + i, col0 + j, head) ? s.dp(i, j) * keepScale : Scalar(0);
    }

    // forward: P = softmax(L)   =>   dL = P * (dP - D), D_i = sum_j P_ij dP_ij = dO_i . O_i
    // (softmaxJacobianVjp row by row). Where P is 0 (hidden) dL is 0 even if dP is NaN there.
    for (Index i = 0; i < nQ; ++i) {
      const Scalar d = dO.cols() ? dO.row(i).dot(o.row(i)) : Scalar(0);  // d_v = 0: no row() of null data
      auto p = s.p.row(i).array();
      auto dp = s.dp.row(i).array();
      dp = (p == Scalar(0)).select(Scalar(0), p * (dp - d));
    }
    // forward: L = softcap(Y) + bias   =>   dbias = dL
    if (dbias) dbias->block(dbiasRow0, 0, nQ, nK) += s.dp;

    // forward: softcap(Y) = c tanh(Y / c)   =>   dY = dL (1 - tanh^2(Y / c))
    const Scalar cap = Scalar(mask::internal::softcapOf(mask));
    Scalar dtau = 0;
    for (Index i = 0; i < nQ; ++i)
      for (Index j = 0; j < nK; ++j) {
        Scalar& g = s.dp(i, j);
        if (g == Scalar(0)) continue;  // hidden: X may be NaN there
        if (cap > 0) {
          const Scalar t = std::tanh(tau * s.x(i, j) / cap);
          g *= Scalar(1) - t * t;
        }
        // forward: Y = tau X   =>   dtau = sum dY * X,  dX = tau dY
        dtau += g * s.x(i, j);
        g *= tau;
      }

    // forward: X = q k^T   =>   dq += dX k,  dk += dX^T q
    addProductSkippingZeros(s.dp, k, dq);
    addProductSkippingZeros(s.dp.transpose(), q, dk);
    return dtau;
  }
};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_BACKWARD_NAIVE_HPP
