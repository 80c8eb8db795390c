#ifndef SDPA_INTERNAL_KEY_COUNT_SCALE_HPP
#define SDPA_INTERNAL_KEY_COUNT_SCALE_HPP

#include <algorithm>
#include <type_traits>

#include "../layout.hpp"
#include "../mask.hpp"
#include "../scale.hpp"
#include "checks.hpp"
#include "macros.hpp"

/*
 * A scale whose tau depends on the keys a row sees (scale::LogN: tau_i = value(d_k) r(n_i)) is
 * reduced, once per call, to a per-head tau and a query with the row factors folded in:
 *   tau_i q_i . k_j = value(d_k) (r(n_i) q_i) . k_j,
 * so that every kernel, forward and backward, runs unchanged on q' = r q with the per-head tau.
 * The backward then maps back: dq_i = r(n_i) dq'_i, and dL/dc = dL/dtau_h dtau_h/dc.
 */
namespace sdpa::internal {

/// The policy that defines the row factor: Scale itself, or the policy of each head of a PerHead.
template <typename Scale>
struct RowFactorPolicy {
  using type = Scale;
};
template <typename P>
struct RowFactorPolicy<scale::PerHead<P>> {
  using type = P;
};

/// The number of keys row i (of nQ) sees among keys [firstKey, nK) under mask m for query head
/// `head`: whole blocks of keys by classify, entry by entry only where a block is partly hidden
/// (O(n_k / 64 + 64) per row for causal and window masks). firstKey > 0: a ring's oldest
/// positions, gone from the cache.
template <typename Mask>
Index visibleKeys(const Mask& m, Index i, Index nQ, Index nK, Index head, Index firstKey = 0) {
  if constexpr (Mask::IsNone) {
    return nK - firstKey;
  } else {
    constexpr Index kBlock = 64;
    Index count = 0;
    for (Index j0 = firstKey; j0 < nK; j0 += kBlock) {
      const Index cols = std::min(kBlock, nK - j0);
      const mask::Tile t = m.classify(i, 1, j0, cols, nQ, nK, head);
      if (t == mask::Tile::Visible) {
        count += cols;
      } else if (t == mask::Tile::Partial) {
        for (Index j = j0; j < j0 + cols; ++j) count += m.visible(i, j, nQ, nK, head) ? 1 : 0;
      }
    }
    return count;
  }
}

/**
 * q' = r q for every (item, head) of a packed batch: row i of head h scaled by
 * r(n_i) = Policy::rowFactor(visible keys of row i under the item's mask for head h, from key
 * firstKey on), computed in double and rounded once to S. factors (n_q x H) receives r. q is
 * n_q x (H d_k); q' a Result (a column- or row-major matrix of S).
 */
template <typename S, typename Scale, typename Result = Matrix<S>, typename DQ, typename Mask>
Result rowScaledQuery(const Eigen::MatrixBase<DQ>& q, const BatchLayout& layout, const Heads& heads, Index dK,
                      const Mask& mask, Matrix<double>& factors, Index firstKey = 0) {
  using Policy = typename RowFactorPolicy<std::decay_t<Scale>>::type;
  Result qs(q.rows(), q.cols());
  factors.setZero(q.rows(), heads.query);
  forEachItemHead(layout, heads, [&](const ItemHead& u) {
    const auto m = itemMask(mask, u);
    for (Index i = 0; i < u.nQ; ++i)
      factors(u.q0 + i, u.head) = Policy::rowFactor(visibleKeys(m, i, u.nQ, u.nK, u.head, firstKey));
    for (Index c = 0; c < dK; ++c)
      for (Index i = 0; i < u.nQ; ++i)
        qs(u.q0 + i, u.head * dK + c) =
            S(factors(u.q0 + i, u.head) * double(Accumulator<typename DQ::Scalar>(q(u.q0 + i, u.head * dK + c))));
  });
  return qs;
}

/**
 * The forward of a key-count scale: run(q', k, v, out) with q' = r q in the accumulation type,
 * k and v as they are (float, double) or converted to float (half inputs), and out the caller's
 * output or, for a half output, a float one rounded into it afterwards. A DiagnosticsSink takes
 * fixed taus only.
 */
template <typename Scale, typename DQ, typename DK, typename DV, typename Mask, typename Out, typename Run>
void forwardRowScaled(const char* where, bool sink, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                      const Eigen::MatrixBase<DV>& v, const BatchLayout& layout, const Heads& heads, Index dK,
                      const Mask& mask, Eigen::Ref<Matrix<Out>> out, Run&& run) {
  using In = typename DQ::Scalar;
  using Acc = Accumulator<In>;
  if (sink)
    throwInvalid(where, "a DiagnosticsSink takes a fixed tau, not one that depends on the key count (scale::LogN)");
  Matrix<double> factors;
  const Matrix<Acc> qs = rowScaledQuery<Acc, Scale>(q, layout, heads, dK, mask, factors);
  if constexpr (std::is_same_v<In, Acc>) {
    run(qs, k, v, out);
  } else {
    const Matrix<Acc> kAcc = k.template cast<Acc>(), vAcc = v.template cast<Acc>();
    if constexpr (std::is_same_v<Out, Acc>) {
      run(qs, kAcc, vAcc, out);
    } else {
      Matrix<Acc> outAcc(out.rows(), out.cols());
      run(qs, kAcc, vAcc, Eigen::Ref<Matrix<Acc>>(outAcc));
      out = outAcc.template cast<Out>();
    }
  }
}

/// dq = r dq' (row i of head h times factors(i, h), in double, rounded once).
template <typename S>
void scaleQueryGradient(Eigen::Ref<Matrix<S>> dq, const Matrix<double>& factors, Index dK) {
  for (Index h = 0; h < factors.cols(); ++h)
    for (Index c = 0; c < dK; ++c)
      for (Index i = 0; i < dq.rows(); ++i) dq(i, h * dK + c) = S(factors(i, h) * double(dq(i, h * dK + c)));
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_KEY_COUNT_SCALE_HPP
