#ifndef SDPA_INTERNAL_BACKWARD_TILED_HPP
#define SDPA_INTERNAL_BACKWARD_TILED_HPP

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../dropout.hpp"
#include "../kernel.hpp"
#include "../layout.hpp"
#include "../mask.hpp"
#include "forward_naive.hpp"
#include "forward_tiled.hpp"
#include "macros.hpp"
#include "online_softmax.hpp"
#include "parallel.hpp"

namespace sdpa::internal {

/**
 * The tiled backward (FlashAttention-2's): each work unit owns one block of keys of one kv head
 * and walks the query blocks of every query head that reads it, recomputing each tile's P from
 * the saved logSumExp, so no n_q x n_k buffer exists. dk and dv of the block are written by
 * their unit alone; dq rows receive a term from every key block, so each thread accumulates dq
 * (and dtau, and a shared bias gradient) in its own buffer, summed after the loop.
 */
template <typename Scalar>
struct backward_tiled_impl {
  using TileMap = Eigen::Map<RowMajorMatrix<Scalar>>;

  struct Scratch {
    Buffer<Scalar> x, y, p, pDropped, dp, g;
  };
  static Scratch& threadScratch() {
    thread_local Scratch scratch;
    return scratch;
  }

  /// Everything a tile needs besides its position. q, qs = tau q, k, v, o, dO are the head's
  /// blocks; finite says q, k, v and dO hold no NaN or inf (plain products, no zero-skipping).
  template <typename Scale, typename Mask>
  struct Head {
    ConstRef<Scalar> q, qs, k, v, dO;
    Eigen::Ref<const Vector<Scalar>> lse, rowD;  // n_q each; rowD_i = dO_i . O_i
    const Mask& mask;
    Scalar tau, cap;         // the head's scale; the softcap, 0 for none
    Index head, row0, col0;  // query head; position of the item in the packed batch (dropout)
    Index dbiasRow0;         // row of the head's (0, 0) in the bias gradient
    bool finite;
  };

  /// out += a b, skipping the rows of b whose weight is 0 unless every input is finite.
  template <typename DA, typename DB, typename DOut>
  static void addProduct(bool finite, const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b,
                         const Eigen::MatrixBase<DOut>& out_) {
    auto& out = const_cast<Eigen::MatrixBase<DOut>&>(out_);  // Eigen's idiom to write into blocks
    if (finite)
      out.noalias() += a * b;
    else
      addProductSkippingZeros(a, b, out);
  }

  /**
   * One tile: query rows [i0, i0 + bq) x keys [j0, j0 + bk). Accumulates dq rows (bq x d_k),
   * dk and dv rows (bk x d_*) and, if dbias is not null, the bias gradient; returns the tile's
   * dL/dtau. Each step quotes the forward line it differentiates.
   */
  template <typename Scale, typename Mask, typename DQ, typename DK, typename DV>
  static Scalar tile(const Head<Scale, Mask>& h, const Dropout& dropout, Index i0, Index bq, Index j0, Index bk,
                     mask::Tile kind, const Eigen::MatrixBase<DQ>& dq_, const Eigen::MatrixBase<DK>& dk,
                     const Eigen::MatrixBase<DV>& dv, Matrix<Scalar>* dbias, Scratch& sc) {
    auto& dq = const_cast<Eigen::MatrixBase<DQ>&>(dq_);
    const Index nQ = h.q.rows(), nK = h.k.rows(), dK = h.q.cols();
    const auto qi = h.q.middleRows(i0, bq);
    const auto qsi = h.qs.middleRows(i0, bq);
    const auto kj = h.k.middleRows(j0, bk);
    const auto vj = h.v.middleRows(j0, bk);
    const auto dOi = h.dO.middleRows(i0, bq);

    // forward: Y = tau q k^T = (tau q) k^T;  L = mask(softcap(Y))
    TileMap x(sc.x.get(bq * bk), bq, bk), p(sc.p.get(bq * bk), bq, bk), dp(sc.dp.get(bq * bk), bq, bk);
    x.noalias() = qsi * kj.transpose();
    TileMap y(sc.y.get(h.cap > 0 ? bq * bk : 0), h.cap > 0 ? bq : 0, bk);
    if (h.cap > 0) y = x;  // the softcap's derivative needs Y
    if (kind == mask::Tile::Partial) h.mask.apply(x, i0, j0, nQ, nK, h.head);

    // forward: P = exp(L - lse); hidden entries and fully masked rows (lse = -inf) are exactly 0.
    for (Index r = 0; r < bq; ++r) {
      const Scalar l = h.lse(i0 + r);
      weightsFromLogSumExp(x.row(r).array(), p.row(r).array(), l);
    }

    // forward: Pd = P * M / (1 - p_drop);  O = Pd v   =>   dv += Pd^T dO
    if (dropout.enabled()) {
      TileMap pd(sc.pDropped.get(bq * bk), bq, bk);
      pd = p;
      applyDropout(pd, dropout, h.head, h.row0 + i0, h.col0 + j0);
      addProductSkippingZeros(pd.transpose(), dOi, dv);
    } else {
      addProduct(h.finite, p.transpose(), dOi, dv);
    }

    // forward: O = Pd v   =>   dPd = dO v^T;  and Pd = P * M / (1 - p_drop)  =>  dP = dPd * M / (1 - p_drop)
    dp.noalias() = dOi * vj.transpose();
    if (dropout.enabled()) {
      const Scalar keepScale = Scalar(dropout.keepScale());
      for (Index r = 0; r < bq; ++r)
        for (Index c = 0; c < bk; ++c)
          dp(r, c) = dropout.keep(h.row0 + i0 + r, h.col0 + j0 + c, h.head) ? dp(r, c) * keepScale : Scalar(0);
    }

    // forward: P = softmax(L)   =>   dL = P * (dP - D), D_i = dO_i . O_i. Where P is 0 (hidden)
    // dL is 0 even if dP is NaN or inf there: from a non-finite input, or from finite ones whose
    // product overflows (|v| near the largest float). Eigen 3.4's select is scalar, so the
    // select path runs only when the inputs or this tile's dP are not all finite.
    const bool finite = h.finite && allFiniteVectorised(dp);
    for (Index r = 0; r < bq; ++r) {
      const Scalar d = h.rowD(i0 + r);
      auto pr = p.row(r).array();
      if (finite)
        dp.row(r).array() = pr * (dp.row(r).array() - d);
      else
        dp.row(r).array() = (pr == Scalar(0)).select(Scalar(0), pr * (dp.row(r).array() - d));
    }
    // forward: L = softcap(Y) + bias   =>   dbias = dL
    if (dbias) dbias->block(h.dbiasRow0 + i0, j0, bq, bk) += dp;

    // forward: softcap(Y) = c tanh(Y / c)   =>   dY = dL (1 - tanh^2(Y / c))
    if (h.cap > 0) {
      auto t = (y.array() / h.cap).tanh();
      if (finite)
        dp.array() *= Scalar(1) - t * t;
      else
        dp = (dp.array() == Scalar(0)).select(Scalar(0), dp.array() * (Scalar(1) - t * t)).matrix();
    }

    // forward: Y = tau X, X = q k^T   =>   dX = tau dY;  dq += dX k = tau (dY k);  dk += dX^T q = dY^T (tau q);
    // dtau = sum_ij dY_ij X_ij = sum_i q_i . (dY k)_i, read off G = dY k at b_q x d_k cost.
    Eigen::Map<Matrix<Scalar>> g(sc.g.get(bq * dK), bq, dK);
    g.setZero();
    addProduct(finite, dp, kj, g);
    dq += h.tau * g;
    addProduct(finite, dp.transpose(), qsi, dk);
    if (finite) return (qi.array() * g.array()).sum();
    return (g.array() == Scalar(0)).select(Scalar(0), qi.array() * g.array()).sum();
  }
};

/**
 * The tiled backward of a packed batch (the layout of multihead.hpp). Accumulates into dq, dk,
 * dv (zeroed by the caller, packed like q, k, v), dscale (H) and, if not null, dbias.
 */
template <typename Scalar, typename Scale, typename Mask>
void backwardTiled(const kernel::Tiled& kern, const ConstRef<Scalar>& q, const ConstRef<Scalar>& k,
                   const ConstRef<Scalar>& v, const ConstRef<Scalar>& o, const ConstRef<Scalar>& lse,
                   const ConstRef<Scalar>& dO, const BatchLayout& layout, const Heads& heads, const HeadDims& dims,
                   const Scale& scale, const Mask& mask, const Dropout& dropout, Matrix<Scalar>& dq, Matrix<Scalar>& dk,
                   Matrix<Scalar>& dv, Vector<Scalar>& dscale, Matrix<Scalar>* dbias) {
  using Impl = backward_tiled_impl<Scalar>;
  if (dims.dK == 0 || dims.dV == 0) {
    // As in forwardTiled: blocks of a matrix without data at a row offset are undefined
    // behaviour, so run with one zero column and drop its gradient. d_k = 0: the logits are 0
    // either way and dtau = sum dY X = 0. d_v = 0: zero dO and O give D = 0 and dP = 0, so every
    // gradient is 0, as it is for a loss that cannot depend on an empty output.
    Matrix<Scalar> q1, k1, dq1, dk1, v1, o1, dO1, dv1;
    if (dims.dK == 0) {
      q1.setZero(q.rows(), heads.query);
      k1.setZero(k.rows(), heads.keyValue);
      dq1.setZero(q.rows(), heads.query);
      dk1.setZero(k.rows(), heads.keyValue);
    }
    if (dims.dV == 0) {
      v1.setZero(v.rows(), heads.keyValue);
      o1.setZero(o.rows(), heads.query);
      dO1.setZero(dO.rows(), heads.query);
      dv1.setZero(v.rows(), heads.keyValue);
    }
    const bool noK = dims.dK == 0;
    const bool noV = dims.dV == 0;
    backwardTiled<Scalar>(kern, noK ? ConstRef<Scalar>(q1) : q, noK ? ConstRef<Scalar>(k1) : k,
                          noV ? ConstRef<Scalar>(v1) : v, noV ? ConstRef<Scalar>(o1) : o, lse,
                          noV ? ConstRef<Scalar>(dO1) : dO, layout, heads,
                          HeadDims{std::max<Index>(dims.dK, 1), std::max<Index>(dims.dV, 1)}, scale, mask, dropout,
                          noK ? dq1 : dq, noK ? dk1 : dk, noV ? dv1 : dv, dscale, dbias);
    return;
  }
  const TileSizes tile = backwardTileSizes(kern, dims.dK, dims.dV);
  const Index H = heads.query, group = heads.groupSize();
  std::vector<ItemHead> pairs;  // item-major: pairs[b * H + h]
  forEachItemHead(layout, heads, [&](const ItemHead& u) { pairs.push_back(u); });

  // Once per call: D_i = dO_i . O_i of every row and head (n_q x H); qs = tau_h q (the scale
  // folded into q, as in the forward); whether every input is finite.
  Matrix<Scalar> rowD(q.rows(), H), qs(q.rows(), q.cols());
  for (Index h = 0; h < H; ++h) {
    rowD.col(h) =
        (dO.middleCols(h * dims.dV, dims.dV).array() * o.middleCols(h * dims.dV, dims.dV).array()).rowwise().sum();
    qs.middleCols(h * dims.dK, dims.dK) =
        headScale(scale, h).template value<Scalar>(dims.dK) * q.middleCols(h * dims.dK, dims.dK);
  }
  // qs rather than q: tau q may overflow where q does not.
  const bool finite =
      allFiniteVectorised(qs) && allFiniteVectorised(k) && allFiniteVectorised(v) && allFiniteVectorised(dO);
  const Scalar cap = Scalar(mask::internal::softcapOf(mask));

  struct Unit {
    Index item, kvHead, j0, cols;
  };
  std::vector<Unit> units;
  for (Index b = 0; b < layout.size(); ++b) {
    const Index nK = layout.kOffsets[size_t(b) + 1] - layout.kOffsets[size_t(b)];
    for (Index g = 0; g < heads.keyValue; ++g)
      for (Index j0 = 0; j0 < nK; j0 += tile.k) units.push_back({b, g, j0, std::min(tile.k, nK - j0)});
  }
  const int threads = int(std::min<Index>(maxThreads(), Index(units.size())));
  // Per-thread dq, dscale and bias gradient when threaded; thread 0 writes the caller's.
  std::vector<Matrix<Scalar>> dqT(size_t(std::max(0, threads - 1)), Matrix<Scalar>::Zero(dq.rows(), dq.cols()));
  std::vector<Matrix<Scalar>> dbiasT(dbias ? size_t(std::max(0, threads - 1)) : 0);
  for (auto& m : dbiasT) m.setZero(dbias->rows(), dbias->cols());
  std::vector<Vector<Scalar>> dscaleT(size_t(std::max(1, threads)), Vector<Scalar>::Zero(H));

  parallelFor(Index(units.size()), threads, [&](Index w) {
    const Unit& un = units[size_t(w)];
    const int t = threadIndex();
    Matrix<Scalar>& dqDst = t == 0 ? dq : dqT[size_t(t - 1)];
    Matrix<Scalar>* dbDst = dbias ? (t == 0 ? dbias : &dbiasT[size_t(t - 1)]) : nullptr;
    auto& sc = Impl::threadScratch();
    for (Index h = un.kvHead * group; h < (un.kvHead + 1) * group; ++h) {
      const ItemHead& u = pairs[size_t(un.item * H + h)];
      const auto m = itemMask(mask, u);
      const auto& sh = headScale(scale, u.head);
      const Index dbiasRow0 = dbias && dbias->rows() != u.nQ ? u.head * u.nQ : 0;
      const typename Impl::template Head<std::decay_t<decltype(sh)>, std::decay_t<decltype(m)>> hd{
          q.block(u.q0, u.head * dims.dK, u.nQ, dims.dK),
          qs.block(u.q0, u.head * dims.dK, u.nQ, dims.dK),
          k.block(u.k0, u.kvHead * dims.dK, u.nK, dims.dK),
          v.block(u.k0, u.kvHead * dims.dV, u.nK, dims.dV),
          dO.block(u.q0, u.head * dims.dV, u.nQ, dims.dV),
          lse.col(u.head).segment(u.q0, u.nQ),
          rowD.col(u.head).segment(u.q0, u.nQ),
          m,
          sh.template value<Scalar>(dims.dK),
          cap,
          u.head,
          u.q0,
          u.k0,
          dbiasRow0,
          finite};
      auto dqHead = dqDst.block(u.q0, u.head * dims.dK, u.nQ, dims.dK);
      auto dkBlock = dk.block(u.k0 + un.j0, u.kvHead * dims.dK, un.cols, dims.dK);
      auto dvBlock = dv.block(u.k0 + un.j0, u.kvHead * dims.dV, un.cols, dims.dV);
      for (Index i0 = 0; i0 < u.nQ; i0 += tile.q) {
        const Index rows = std::min(tile.q, u.nQ - i0);
        const mask::Tile kind = m.classify(i0, rows, un.j0, un.cols, u.nQ, u.nK, u.head);
        if (kind == mask::Tile::Hidden) continue;
        dscaleT[size_t(t)](u.head) += Impl::tile(hd, dropout, i0, rows, un.j0, un.cols, kind,
                                                 dqHead.middleRows(i0, rows), dkBlock, dvBlock, dbDst, sc);
      }
    }
  });
  for (const auto& m : dqT) dq += m;
  for (const auto& m : dbiasT) *dbias += m;
  for (const auto& s : dscaleT) dscale += s;
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_BACKWARD_TILED_HPP
