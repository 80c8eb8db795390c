#ifndef SDPA_INTERNAL_BACKWARD_NAIVE_HPP
#define SDPA_INTERNAL_BACKWARD_NAIVE_HPP

#include <cmath>
#include <limits>

#include "../dropout.hpp"
#include "../mask.hpp"
#include "forward_naive.hpp"
#include "macros.hpp"
#include "math.hpp"

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
    Vector<Scalar> centre;
  };

  /// Accumulates dq (n_q x d_k), dk (n_k x d_k), dv (n_k x d_v) and, if dbias is not null,
  /// dbias->block(dbiasRow0, 0, n_q, n_k); returns dL/dtau of this head (in double: see below).
  /// The forward's logSumExp is not read: P is the softmax of this pass's own logits (see
  /// RowSoftmax), so each row sums to 1 in them, as in a plain computation.
  template <typename Mask>
  static double run(const ConstRef<Scalar>& q, const ConstRef<Scalar>& k, const ConstRef<Scalar>& v,
                    const ConstRef<Scalar>& dO, Scalar tau, const Mask& mask, const Dropout& dropout, Index head,
                    Index row0, Index col0, Eigen::Ref<Matrix<Scalar>> dq, Eigen::Ref<Matrix<Scalar>> dk,
                    Eigen::Ref<Matrix<Scalar>> dv, Matrix<Scalar>* dbias, Index dbiasRow0, Scratch& s) {
    const Index nQ = q.rows(), nK = k.rows();
    const Scalar cap = Scalar(mask::internal::softcapOf(mask));

    // forward: X = q k^T;  Y = tau X;  L = mask(softcap(Y))
    s.x.resize(nQ, nK);
    s.x.noalias() = q * k.transpose();
    s.p = s.x;
    if (tau != Scalar(1)) s.p *= tau;
    mask.apply(s.p, 0, 0, nQ, nK, head);

    // dL_ij/dtau = X_ij softcap'(Y_ij), the factor dL/dtau sums against dL (below).
    // A saturated softcap (slope 0, also at X = +-inf) has factor 0, the limit, not inf * 0.
    const auto dLdTau = [&](Index i, Index j) {
      if (cap == 0) return s.x(i, j);
      const Scalar t = tanhAccurate(tau * s.x(i, j) / cap), slope = Scalar(1) - t * t;
      return slope == Scalar(0) ? Scalar(0) : s.x(i, j) * slope;
    };

    // forward: P = softmax(L) = exp(L - m) / l; hidden entries are exactly 0, and so is a fully
    // masked row, never exp(-inf - -inf) = NaN. centre_i: dL/dtau's factor at the row's maximum.
    s.centre.setZero(nQ);
    for (Index i = 0; i < nQ; ++i) {
      Index jc = 0;
      if (std::isfinite(backwardSoftmaxInPlace(s.p.row(i), &jc))) s.centre(i) = dLdTau(i, jc);
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

    // forward: P = softmax(L)   =>   dL = P * (dP - D), D_i = sum_j P_ij dP_ij (softmaxJacobianVjp row
    // by row), summed from the same dP, not as dO_i . O_i (see backward_tiled_impl::rowStatistics).
    // Where P is 0 (hidden) dL is 0 even if dP is NaN there.
    for (Index i = 0; i < nQ; ++i) {
      const Scalar d = centredDotSkippingZeros(s.p.row(i).data(), s.dp.row(i).data(), nK, Scalar(0));
      auto p = s.p.row(i).array();
      auto dp = s.dp.row(i).array();
      dp = (p == Scalar(0)).select(Scalar(0), p * (dp - d));
    }
    // forward: L = softcap(Y) + bias   =>   dbias = dL
    if (dbias) dbias->block(dbiasRow0, 0, nQ, nK) += s.dp;

    // forward: L = softcap(tau X) + bias   =>   dtau = sum_ij dL_ij X_ij softcap'(Y_ij). Each row of dL
    // sums to 0, so the row's centre may be taken off every term: the same value in exact
    // arithmetic, and in float it stops the rounding left in a row's sum of dL (from D = dO . O)
    // from being multiplied by logits of 40 or more; summed in double (NUMERICS.md).
    // forward: softcap(Y) = c tanh(Y / c)   =>   dY = dL (1 - tanh^2(Y / c));  Y = tau X  =>  dX = tau dY
    double dtau = 0;
    for (Index i = 0; i < nQ; ++i)
      for (Index j = 0; j < nK; ++j) {
        Scalar& g = s.dp(i, j);
        if (g == Scalar(0)) continue;  // hidden: X may be NaN there
        const Scalar factor = dLdTau(i, j);
        dtau += double(g * (factor - s.centre(i)));
        if (cap > 0) {
          const Scalar t = tanhAccurate(tau * s.x(i, j) / cap);
          g *= Scalar(1) - t * t;
        }
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
