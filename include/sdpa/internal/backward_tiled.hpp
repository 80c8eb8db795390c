#ifndef SDPA_INTERNAL_BACKWARD_TILED_HPP
#define SDPA_INTERNAL_BACKWARD_TILED_HPP

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "../dropout.hpp"
#include "../kernel.hpp"
#include "../layout.hpp"
#include "../mask.hpp"
#include "backward_fast.hpp"
#include "erased_mask.hpp"
#include "forward_naive.hpp"
#include "forward_tiled.hpp"
#include "macros.hpp"
#include "math.hpp"
#include "online_softmax.hpp"
#include "parallel.hpp"

namespace sdpa::internal {

/**
 * The tiled backward (FlashAttention-2's): each work unit owns one block of keys of one kv head
 * and walks the query blocks of every query head that reads it, recomputing each tile's P, so no
 * n_q x n_k buffer exists. dk and dv of the block are written by their unit alone; dq rows
 * receive a term from every key block, so each thread accumulates dq (and dtau, and a shared
 * bias gradient) in its own buffer, summed after the loop.
 *
 * P is not rebuilt from the forward's logSumExp but from this pass's own row maxima and sums
 * (RowSoftmax), gathered by a first pass over the same tiles with the same products: the
 * weights are then the softmax of exactly the logits this pass differentiates, whichever kernel,
 * tile shape or decoding path the forward took (NUMERICS.md).
 */
template <typename Scalar>
struct backward_tiled_impl {
  using TileMap = Eigen::Map<RowMajorMatrix<Scalar>>;

  struct Scratch {
    Buffer<Scalar> x, y, t, p, pDropped, dp, g;
    Buffer<Scalar> cacheX, cacheY, cacheDp;  // a query block's L, Y and dP against every key
    std::vector<char> dpSafe;                // per key tile of the block: every 4 dP is finite
  };
  static Scratch& threadScratch() {
    thread_local Scratch scratch;
    return scratch;
  }

  /// Everything a tile needs besides its position. q, qs (tau q or q: foldsScaleIntoQuery), k, v,
  /// dO are the head's blocks, q, k, v and dO read in place through their views (each
  /// column-major ConstRef or row-major RowConstRef), qs built by the call (column-major); finite says q, k, v and dO
  /// hold no NaN or inf (plain products, no zero-skipping).
  template <typename Mask, typename QView = ConstRef<Scalar>, typename KView = QView, typename VView = KView,
            typename OView = QView>
  struct Head {
    QView q;
    ConstRef<Scalar> qs;
    KView k;
    VView v;
    OView dO;
    const Mask& mask;
    Scalar tau, cap;         // the head's scale; the softcap, 0 for none
    Index head, row0, col0;  // query head; position of the item in the packed batch (dropout)
    Index dbiasRow0;         // row of the head's (0, 0) in the bias gradient
    bool finite;
    /// The logits before the mask, Y = tau q k^T, are kept beside L when L is not Y wherever
    /// it is visible: under a softcap or an additive mask.
    bool keepY() const { return cap > 0 || mask.hasBias(); }
  };

  /// The head's row statistics (n_q each): the softmax of each row over all keys, D_i =
  /// sum_j P_ij dP_ij, and dL/dtau's factor at the row's maximum (the centre of the dtau sum).
  struct Rows {
    Eigen::Ref<Vector<Scalar>> max, sum, d, centre;
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

  /// forward: Y = tau q k^T = (tau q) k^T;  L = mask(softcap(Y)). x (bq x bk) becomes L and, if
  /// the head keeps it, y becomes Y. Both passes of the backward compute logits here alone, so
  /// that they are bitwise the same. qs is tau q for |tau| <= 1, else q (as in the forward).
  template <typename Mask, typename... Views>
  static void logits(const Head<Mask, Views...>& h, Index i0, Index bq, Index j0, Index bk, mask::Tile kind, TileMap& x,
                     TileMap& y) {
    x.noalias() = h.qs.middleRows(i0, bq) * h.k.middleRows(j0, bk).transpose();
    if (!foldsScaleIntoQuery(h.tau)) x *= h.tau;
    if (h.keepY()) y = x;
    if (kind == mask::Tile::Partial) h.mask.apply(x, i0, j0, h.q.rows(), h.k.rows(), h.head);
  }

  /// forward: O = Pd v   =>   dPd = dO v^T;  and Pd = P * M / (1 - p_drop)  =>  dP = dPd * M / (1 - p_drop)
  template <typename Mask, typename... Views>
  static void valueGradient(const Head<Mask, Views...>& h, const Dropout& dropout, Index i0, Index bq, Index j0,
                            Index bk, TileMap& dp) {
    dp.noalias() = h.dO.middleRows(i0, bq) * h.v.middleRows(j0, bk).transpose();
    if (dropout.enabled()) {
      const Scalar keepScale = Scalar(dropout.keepScale());
      for (Index r = 0; r < bq; ++r)
        for (Index c = 0; c < bk; ++c)
          dp(r, c) = dropout.keep(h.row0 + i0 + r, h.col0 + j0 + c, h.head) ? dp(r, c) * keepScale : Scalar(0);
    }
  }

  /// Where a query block's tiles live between the two passes: in the cache when it holds the
  /// block's row of tiles (tile j0 at offset bq j0), else in the scratch tiles, recomputed.
  struct Tiles {
    Scalar *x, *y, *dp;
    bool cached;
    Index bq;
    Scalar* at(Scalar* cache, Buffer<Scalar>& scratch, Index j0, Index bk) const {
      return cached ? cache + bq * j0 : scratch.get(bq * bk);
    }
  };

  /**
   * Calls f(j0, bk, x, y, dp) for every key tile [j0, j0 + bk) of query rows [i0, i0 + bq) that
   * the mask does not hide, with L, Y and dP of the tile: computed here when `compute` or when
   * the tiles are not cached, else as the cache holds them.
   */
  template <typename Mask, typename... Views, typename F>
  static void forEachTile(const Head<Mask, Views...>& h, const Dropout& dropout, Index i0, Index bq, Index tileK,
                          const Tiles& tiles, bool compute, Scratch& sc, F&& f) {
    const Index nQ = h.q.rows(), nK = h.k.rows();
    const bool keepY = h.keepY();
    for (Index j0 = 0; j0 < nK; j0 += tileK) {
      const Index bk = std::min(tileK, nK - j0);
      const mask::Tile kind = h.mask.classify(i0, bq, j0, bk, nQ, nK, h.head);
      if (kind == mask::Tile::Hidden) continue;
      TileMap x(tiles.at(tiles.x, sc.x, j0, bk), bq, bk), dp(tiles.at(tiles.dp, sc.dp, j0, bk), bq, bk);
      TileMap y(keepY ? tiles.at(tiles.y, sc.y, j0, bk) : sc.y.get(0), keepY ? bq : 0, bk);
      if (compute || !tiles.cached) {
        logits(h, i0, bq, j0, bk, kind, x, y);
        valueGradient(h, dropout, i0, bq, j0, bk, dp);
      }
      f(j0, bk, x, y, dp);
    }
  }

  /**
   * The first pass, for query rows [i0, i0 + bq) over every key tile [j0, j0 + bk) of the head:
   * L, Y and dP of each tile (kept in `tiles` when cached), and from them the running maximum and
   * sum of each row, as OnlineSoftmax keeps them, the running sum_j exp(L_ij - m_i) dP_ij for D,
   * and Y at the row's maximum. A NaN or +inf visible logit marks the row with a NaN maximum, as
   * the forward does.
   *
   * D is the softmax's own sum_j P_ij dP_ij, not FlashAttention-2's shortcut dO_i . O_i: with the
   * forward's rounded O, dP_ij - D loses every digit in a row whose weight sits on one key (a
   * large logit), where a plain computation, summing the same dP it subtracts from, cancels
   * exactly (NUMERICS.md).
   */
  template <typename Mask, typename... Views>
  static void firstPass(const Head<Mask, Views...>& h, const Dropout& dropout, Index i0, Index bq, Index tileK,
                        Rows rows, const Tiles& tiles, Scratch& sc) {
    constexpr Scalar inf = std::numeric_limits<Scalar>::infinity();
    auto m = rows.max.segment(i0, bq), l = rows.sum.segment(i0, bq), d = rows.d.segment(i0, bq);
    auto yc = rows.centre.segment(i0, bq);
    m.setConstant(-inf);
    l.setZero();
    d.setZero();
    yc.setZero();
    const bool keepY = h.keepY();
    sc.dpSafe.assign(size_t((h.k.rows() + tileK - 1) / tileK), 1);
    // One row of one tile: folds the tile into the row's running sums; returns whether its dP has
    // headroom (every 4 dP finite), or -1 when the row was not summed (its dP not looked at).
    const auto absorb = [&](Index r, Index bk, TileMap& x, TileMap& y, TileMap& dp) -> int {
      if (std::isnan(m(r))) return -1;
      auto row = x.row(r).array();
      // The plain maximum, and a NaN it misses caught by the exp pass, as in OnlineSoftmax.
      const Scalar tileMax = row.maxCoeff();
      if (!(tileMax < inf)) {
        m(r) = std::numeric_limits<Scalar>::quiet_NaN();
        return -1;
      }
      const Scalar mNew = std::max(m(r), tileMax);
      if (mNew == -inf) {
        if (row.hasNaN()) m(r) = std::numeric_limits<Scalar>::quiet_NaN();
        return -1;
      }
      if (tileMax > m(r)) {
        if (keepY) {
          Index jc = 0;
          while (x(r, jc) != tileMax) ++jc;
          yc(r) = y(r, jc);
        } else {
          yc(r) = tileMax;
        }
      }
      const auto s = expShiftedSumDot(x.row(r).data(), dp.row(r).data(), bk, mNew);
      if (std::isnan(s.sum)) {
        m(r) = std::numeric_limits<Scalar>::quiet_NaN();
        return s.wHeadroom;
      }
      // alpha = 0 (the first visible tile, or a new maximum so far above that the earlier
      // weights are exactly 0): the earlier sums are dropped, not multiplied by 0 (a dP of inf
      // at a key of weight 0 now would turn into NaN), as OnlineSoftmax::absorb does.
      const Scalar alpha = std::exp(m(r) - mNew);
      l(r) = alpha == Scalar(0) ? s.sum : alpha * l(r) + s.sum;
      d(r) = alpha == Scalar(0) ? s.dot : alpha * d(r) + s.dot;
      m(r) = mNew;
      return s.wHeadroom;
    };
    forEachTile(h, dropout, i0, bq, tileK, tiles, true, sc,
                [&](Index j0, Index bk, TileMap& x, TileMap& y, TileMap& dp) {
                  // Whether every 4 dP of the tile is finite, for the second pass (which may then use
                  // plain products and form dP - D everywhere): gathered here, where dP is in cache.
                  bool safe = true;
                  for (Index r = 0; r < bq; ++r) {
                    const int rowSafe = absorb(r, bk, x, y, dp);
                    safe = safe && (rowSafe < 0 ? allWithHeadroom(dp.row(r)) : rowSafe == 1);
                  }
                  sc.dpSafe[size_t(j0 / tileK)] = safe;
                });
  }

  /// The first pass's sums of rows [i0, i0 + bq) made final: D = sum_j exp(L_ij - m) dP_ij / l,
  /// and the centre as dL/dtau's factor (in units of tau), Y softcap'(Y) at the row's maximum.
  static void finishRows(Rows rows, Index i0, Index bq, Scalar cap) {
    auto l = rows.sum.segment(i0, bq), d = rows.d.segment(i0, bq), yc = rows.centre.segment(i0, bq);
    for (Index r = 0; r < bq; ++r) {
      if (l(r) > Scalar(0)) d(r) /= l(r);
      // A softcap saturated to 1 - tanh^2 = 0 has factor 0, also at Y = +-inf (the limit of
      // Y sech^2(Y / c)), not inf * 0.
      if (cap > 0) {
        const Scalar t = tanhAccurate(yc(r) / cap), slope = Scalar(1) - t * t;
        yc(r) = slope == Scalar(0) ? Scalar(0) : yc(r) * slope;
      }
    }
  }

  /**
   * Folds the first-pass sums of rows whose keys were split in two parts (b into a): as
   * OnlineSoftmax merges two states, the sums of the part with the smaller maximum rescaled (and
   * dropped where that factor is 0), the centre from the part holding the maximum (a on a tie,
   * the keys seen first); a NaN maximum wins. Both before finishRows.
   */
  static void mergeRows(Rows a, const Rows& b) {
    for (Index r = 0; r < a.max.size(); ++r) {
      const Scalar ma = a.max(r), mb = b.max(r);
      if (std::isnan(ma) || std::isnan(mb)) {
        a.max(r) = std::numeric_limits<Scalar>::quiet_NaN();
        continue;
      }
      const Scalar m = std::max(ma, mb);
      if (m == -std::numeric_limits<Scalar>::infinity()) continue;
      const Scalar alphaA = std::exp(ma - m), alphaB = std::exp(mb - m);
      const auto fold = [](Scalar alpha, Scalar x) { return alpha == Scalar(0) ? Scalar(0) : alpha * x; };
      a.sum(r) = fold(alphaA, a.sum(r)) + fold(alphaB, b.sum(r));
      a.d(r) = fold(alphaA, a.d(r)) + fold(alphaB, b.d(r));
      if (mb > ma) a.centre(r) = b.centre(r);
      a.max(r) = m;
    }
  }

  /// The first pass and its final rows, with the rare recomputation of D below.
  template <typename Mask, typename... Views>
  static void rowPass(const Head<Mask, Views...>& h, const Dropout& dropout, Index i0, Index bq, Index tileK, Rows rows,
                      const Tiles& tiles, Scratch& sc) {
    firstPass(h, dropout, i0, bq, tileK, rows, tiles, sc);
    finishRows(rows, i0, bq, h.cap);
    auto m = rows.max.segment(i0, bq), l = rows.sum.segment(i0, bq), d = rows.d.segment(i0, bq);
    // A dP of inf at a key whose weight was nonzero in its tile but rounds to 0 in the final
    // softmax has no effect on D, but made this running sum inf (or NaN): such rows are summed
    // again from the final weights, as the second pass computes them (rare: non-finite values only).
    bool again = false;
    for (Index r = 0; r < bq; ++r) again = again || (std::isfinite(m(r)) && !std::isfinite(d(r)));
    if (again) {
      Vector<Scalar> dNew = Vector<Scalar>::Zero(bq);
      forEachTile(h, dropout, i0, bq, tileK, tiles, false, sc, [&](Index, Index bk, TileMap& x, TileMap&, TileMap& dp) {
        TileMap p(sc.p.get(bq * bk), bq, bk);
        for (Index r = 0; r < bq; ++r) {
          if (!(std::isfinite(m(r)) && !std::isfinite(d(r)))) continue;
          expDivided(x.row(r).data(), p.row(r).data(), bk, m(r), l(r));  // as the second pass
          dNew(r) += centredDotSkippingZeros(p.row(r).data(), dp.row(r).data(), bk, Scalar(0));
        }
      });
      for (Index r = 0; r < bq; ++r)
        if (std::isfinite(m(r)) && !std::isfinite(d(r))) d(r) = dNew(r);
    }
  }

  /**
   * One tile: query rows [i0, i0 + bq) x keys [j0, j0 + bk). Accumulates dq rows (bq x d_k),
   * dk and dv rows (bk x d_*) and, if dbias is not null, the bias gradient; returns the tile's
   * dL/dtau. finite: the head's inputs are all finite and this tile's dP has headroom (every 4
   * dP finite: the first pass's finding), so that plain products may read them and dP - D cannot
   * overflow at a key of weight 0. Each step quotes the forward line it differentiates.
   */
  template <typename Mask, typename DQ, typename DK, typename DV, typename... Views>
  static double tile(const Head<Mask, Views...>& h, const Rows& rows, const Dropout& dropout, Index i0, Index bq,
                     Index j0, Index bk, bool finite, TileMap& x, TileMap& y, TileMap& dp,
                     const Eigen::MatrixBase<DQ>& dq_, const Eigen::MatrixBase<DK>& dk, const Eigen::MatrixBase<DV>& dv,
                     Matrix<Scalar>* dbias, Scratch& sc) {
    auto& dq = const_cast<Eigen::MatrixBase<DQ>&>(dq_);
    const Index dK = h.q.cols();
    const auto qi = h.q.middleRows(i0, bq);
    const auto kj = h.k.middleRows(j0, bk);
    const auto dOi = h.dO.middleRows(i0, bq);

    // forward: Y = tau q k^T;  L = mask(softcap(Y)), and dP: x, y and dp as the first pass left them
    const bool keepY = h.keepY();
    TileMap p(sc.p.get(bq * bk), bq, bk);

    // The common case in one sweep a row (softmaxGradientRow): P, dL = P * (dP - D), dtau's row
    // sum and dX = tau dL below, spelled out step by step for the other cases (a non-finite
    // input or dP, a softcap, a bias gradient, tau = 0) and rows without a finite maximum.
    const bool fused = finite && h.cap == Scalar(0) && h.tau != Scalar(0) && !dbias;
    const auto done = [&](Index r) { return fused && std::isfinite(rows.max(i0 + r)); };
    double dtauFused = 0;

    // forward: P = softmax(L) = exp(L - m) / l; hidden entries and fully masked rows are exactly 0.
    for (Index r = 0; r < bq; ++r) {
      const RowSoftmax<Scalar> row{rows.max(i0 + r), rows.sum(i0 + r)};
      if (done(r)) {
        const Scalar* factor = keepY ? y.row(r).data() : x.row(r).data();
        dtauFused += double(softmaxGradientRow(x.row(r).data(), factor, p.row(r).data(), dp.row(r).data(), bk, row.max,
                                               row.sum, rows.d(i0 + r), rows.centre(i0 + r), h.tau));
      } else if (std::isfinite(row.max)) {
        expDivided(x.row(r).data(), p.row(r).data(), bk, row.max, row.sum);
      } else {
        weightsFromRowSoftmax(x.row(r).array(), p.row(r).array(), row);
      }
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

    // forward: P = softmax(L)   =>   dL = P * (dP - D), D_i = sum_j P_ij dP_ij. Where P is 0 (hidden)
    // dL is 0 even if dP is NaN or inf there: from a non-finite input, or from finite ones whose
    // product overflows (|v| near the largest float). Eigen 3.4's select is scalar, so the
    // select path runs only when the inputs or this tile's dP are not all finite.
    for (Index r = 0; r < bq; ++r) {
      if (done(r)) continue;
      const Scalar d = rows.d(i0 + r);
      auto pr = p.row(r).array();
      if (finite)
        dp.row(r).array() = pr * (dp.row(r).array() - d);
      else
        dp.row(r).array() = (pr == Scalar(0)).select(Scalar(0), pr * (dp.row(r).array() - d));
    }
    // forward: L = softcap(Y) + bias   =>   dbias = dL
    if (dbias) dbias->block(h.dbiasRow0 + i0, j0, bq, bk) += dp;

    // softcap'(Y) = 1 - tanh^2(Y / c), into t; then Y softcap'(Y), dL/dtau's factor (in units of
    // tau), into y. Without a softcap that factor is Y, which is L wherever dL is not 0.
    TileMap t(sc.t.get(h.cap > 0 ? bq * bk : 0), h.cap > 0 ? bq : 0, bk);
    if (h.cap > 0) {
      t = y;
      for (Index r = 0; r < bq; ++r) tanhInPlace(t.row(r).data(), bk, h.cap, Scalar(1));
      t.array() = Scalar(1) - t.array() * t.array();
      // Y = +-inf (an infinite q or k, which the softcap makes a finite logit) with slope 0:
      // the factor is 0, the limit of Y sech^2(Y / c), not inf * 0 (clamped to the finite range).
      constexpr Scalar big = std::numeric_limits<Scalar>::max();
      y.array() = y.array().max(-big).min(big) * t.array();
    }
    // forward: L = softcap(tau X) + bias   =>   dtau = sum_ij dL_ij X_ij softcap'(Y_ij). Each row of
    // dL sums to 0, so the row's centre (that factor at its maximum) may be taken off every term:
    // the same value in exact arithmetic, and in float it stops the rounding left in a row's sum
    // of dL from being multiplied by logits of 40 or more. Rows in
    // float, the tiles' sums in double (NUMERICS.md). tau = 0: Y = 0 says nothing of X, and dtau
    // is read off G = dY k below.
    double dtau = dtauFused;
    if (h.tau != Scalar(0)) {
      const TileMap& factor = keepY ? y : x;
      for (Index r = 0; r < bq; ++r)
        if (!done(r))
          dtau += double(centredDotSkippingZeros(dp.row(r).data(), factor.row(r).data(), bk, rows.centre(i0 + r)));
      dtau /= double(h.tau);
    }

    // forward: softcap(Y) = c tanh(Y / c)   =>   dY = dL (1 - tanh^2(Y / c))
    if (h.cap > 0) {
      if (finite)
        dp.array() *= t.array();
      else
        dp = (dp.array() == Scalar(0)).select(Scalar(0), dp.array() * t.array()).matrix();
    }

    // forward: Y = tau X, X = q k^T   =>   dX = tau dY;  dq += dX k;  dk += dX^T q
    if (h.tau == Scalar(0)) {  // dX = 0; dtau = sum_ij dY_ij X_ij = sum_i q_i . (dY k)_i
      Eigen::Map<Matrix<Scalar>> g(sc.g.get(bq * dK), bq, dK);
      g.setZero();
      addProduct(finite, dp, kj, g);
      if (finite) return double((qi.array() * g.array()).sum());
      return double((g.array() == Scalar(0)).select(Scalar(0), qi.array() * g.array()).sum());
    }
    if (h.tau != Scalar(1))  // 0 stays 0: a hidden entry stays skippable
      for (Index r = 0; r < bq; ++r)
        if (!done(r)) dp.row(r) *= h.tau;
    addProduct(finite, dp, kj, dq);
    addProduct(finite, dp.transpose(), qi, dk);
    return dtau;
  }
};

/**
 * The tiled backward of a packed batch (the layout of multihead.hpp). Accumulates into dq, dk,
 * dv (zeroed by the caller, packed like q, k, v), dscale (H) and, if not null, dbias.
 */
/// Per thread, the backward keeps a query block's logits and dP against every key (and Y under a
/// softcap or an additive mask) while they fit in this many bytes (4 MiB for 128 float rows
/// against 4096 keys); beyond it, the second pass recomputes them (two more products a tile).
inline constexpr Index kBackwardCacheBytes = Index(64) << 20;

/**
 * Where the backward's row statistics come from. Own: its first pass, every key of a row being
 * in the call. Context parallelism splits a row's keys over calls: Collect runs the first pass
 * only and leaves its sums (before finishRows) in `stats` for the caller to merge
 * (backward_tiled_impl::mergeRows) and finish; Given takes those final rows from `stats` and adds
 * the gradients of the call's keys. `stats`: 4 (n_q x H) column-major blocks, the rows' maxima,
 * sums, D and centres (backward_tiled_impl::Rows).
 */
struct BackwardRows {
  enum Mode { Own, Collect, Given } mode = Own;
  void* stats = nullptr;
};

template <typename Scalar, typename QView, typename KView, typename VView, typename OView>
void backwardTiledKernel(const kernel::Tiled& kern, const typename Identity<QView>::type& q,
                         const typename Identity<KView>::type& k, const typename Identity<VView>::type& v,
                         const typename Identity<OView>::type& dO, const BatchLayout& layout, const Heads& heads,
                         const HeadDims& dims, const HeadTaus<Scalar>& taus, const ErasedMask<Scalar>& mask,
                         const Dropout& dropout, Eigen::Ref<Matrix<Scalar>> dq, Eigen::Ref<Matrix<Scalar>> dk,
                         Eigen::Ref<Matrix<Scalar>> dv, Eigen::Ref<Vector<Scalar>> dscale, Matrix<Scalar>* dbias,
                         BackwardRows from) {
  using Impl = backward_tiled_impl<Scalar>;
  if (dims.dK == 0 || dims.dV == 0) {
    if constexpr (!(std::is_same_v<QView, ConstRef<Scalar>> && std::is_same_v<KView, ConstRef<Scalar>> &&
                    std::is_same_v<VView, ConstRef<Scalar>> && std::is_same_v<OView, ConstRef<Scalar>>)) {
      // No data to read in place: the column-major route.
      using Ref = ConstRef<Scalar>;
      backwardTiledKernel<Scalar, Ref, Ref, Ref, Ref>(kern, Ref(q), Ref(k), Ref(v), Ref(dO), layout, heads, dims, taus,
                                                      mask, dropout, dq, dk, dv, dscale, dbias, from);
      return;
    } else {
      // As in forwardTiled: blocks of a matrix without data at a row offset are undefined
      // behaviour, so run with one zero column and drop its gradient. d_k = 0: the logits are 0
      // either way and dtau = sum dY X = 0. d_v = 0: a zero dO gives dP = 0 and D = 0, so every
      // gradient is 0, as it is for a loss that cannot depend on an empty output.
      Matrix<Scalar> q1, k1, dq1, dk1, v1, dO1, dv1;  // (degenerate shapes only: these allocate)
      if (dims.dK == 0) {
        q1.setZero(q.rows(), heads.query);
        k1.setZero(k.rows(), heads.keyValue);
        dq1.setZero(q.rows(), heads.query);
        dk1.setZero(k.rows(), heads.keyValue);
      }
      if (dims.dV == 0) {
        v1.setZero(v.rows(), heads.keyValue);
        dO1.setZero(dO.rows(), heads.query);
        dv1.setZero(v.rows(), heads.keyValue);
      }
      const bool noK = dims.dK == 0;
      const bool noV = dims.dV == 0;
      using Ref = ConstRef<Scalar>;
      backwardTiledKernel<Scalar, Ref, Ref, Ref, Ref>(
          kern, noK ? Ref(q1) : q, noK ? Ref(k1) : k, noV ? Ref(v1) : v, noV ? Ref(dO1) : dO, layout, heads,
          HeadDims{std::max<Index>(dims.dK, 1), std::max<Index>(dims.dV, 1)}, taus, mask, dropout,
          noK ? Eigen::Ref<Matrix<Scalar>>(dq1) : dq, noK ? Eigen::Ref<Matrix<Scalar>>(dk1) : dk,
          noV ? Eigen::Ref<Matrix<Scalar>>(dv1) : dv, dscale, dbias, from);
      return;
    }
  }
  const TileSizes tile = backwardTileSizes(kern, dims.dK, dims.dV);
  const Index H = heads.query;
  // The call's plan and per-call buffers, in the calling thread's containers (grown, never
  // shrunk): no allocation once an earlier call on the thread was as large.
  struct Unit {
    Index pair, i0, rows;
  };
  struct Plan {
    std::vector<ItemHead> pairs;
    std::vector<Unit> units;
    std::vector<char> started;  // per thread: it has run a unit (its shares below are zeroed)
    // Thread t's share of dk, dv and a shared dbias (t > 0), owned by the calling thread: a pool
    // thread of the OpenMP runtime may serve another caller's team once this region ends, so
    // its thread_local scratch must not be read after it.
    std::vector<Matrix<Scalar>> dkT, dvT, dbiasT;
    // The fast path's dk and dv of thread t (every t): row-major, rows padded (fast::BackwardOut).
    std::vector<Buffer<Scalar>> dkF, dvF;
    std::vector<char> base2;                     // per pair: the fast path takes base-2 logits
    std::vector<Index> packedAt;                 // per pair: its kv head's packing in `packed`
    std::vector<std::pair<Index, Index>> packs;  // (pair, key tile) of every tile to pack
    Buffer<Scalar> packed;
    Buffer<Scalar> qs, rowStats;
    Buffer<double> dscaleT;
  };
  thread_local Plan plan;
  auto& pairs = plan.pairs;
  pairs.clear();
  forEachItemHead(layout, heads, [&](const ItemHead& u) { pairs.push_back(u); });

  const Scalar cap = Scalar(mask.softcap());

  // The fast path (fast::backwardBlock): float inputs, a CPU with its kernels, rows of the
  // call's own, a mask that only hides, no dropout, no bias gradient, and for every pair a scale
  // tau != 0 with finite q, k, v, dO whose logits and dP = dO v^T cannot overflow (logitBounds).
  // Else the general tiles below, which handle every special value.
  bool useFast = false;
  auto& base2 = plan.base2;
  if constexpr (std::is_same_v<Scalar, float>) {
    useFast = mask.onlyHides() && fast::available() && from.mode == BackwardRows::Own && !dropout.enabled() && !dbias;
    base2.assign(pairs.size(), 0);
    for (size_t p = 0; useFast && p < pairs.size(); ++p) {
      const ItemHead& u = pairs[p];
      const float tau = float(taus.tau(u.head));
      const auto qk = fast::logitBounds(q.block(u.q0, u.head * dims.dK, u.nQ, dims.dK),
                                        k.block(u.k0, u.kvHead * dims.dK, u.nK, dims.dK), tau);
      const auto dp = fast::logitBounds(dO.block(u.q0, u.head * dims.dV, u.nQ, dims.dV),
                                        v.block(u.k0, u.kvHead * dims.dV, u.nK, dims.dV), 1.0f);
      useFast = tau != 0.0f && qk.bounded && dp.bounded;
      base2[p] = qk.base2;
    }
  }

  // Once per call (the general tiles): qs = tau_h q (the scale folded into q where |tau_h| <= 1,
  // as in the forward); whether every input is finite. (The forward's output O is not read: D is
  // summed from this pass's P.)
  Eigen::Map<Matrix<Scalar>> qs(plan.qs.get(useFast ? 0 : q.rows() * q.cols()), useFast ? 0 : q.rows(),
                                useFast ? 0 : q.cols());
  bool finite = true;
  if (!useFast) {
    for (Index h = 0; h < H; ++h) {
      const Scalar tau = taus.tau(h);
      qs.middleCols(h * dims.dK, dims.dK) =
          (foldsScaleIntoQuery(tau) ? tau : Scalar(1)) * q.middleCols(h * dims.dK, dims.dK);
    }
    // qs rather than q: 0 q is NaN where q is inf.
    finite = allFiniteVectorised(qs) && allFiniteVectorised(k) && allFiniteVectorised(v) && allFiniteVectorised(dO);
  }
  const Index pad = useFast ? fast::backwardPadding() : 1;
  const Index dKp = (dims.dK + pad - 1) / pad * pad, dVp = (dims.dV + pad - 1) / pad * pad;
  // (Rows an odd number of cache lines apart, as the blocks' rows: fast::oddLineStride.)
  const Index ldkF = fast::oddLineStride(heads.keyValue * dKp), ldvF = fast::oddLineStride(heads.keyValue * dVp);
  const Index fastK = kern.blockK > 0 ? kern.blockK : 128;
  // Query blocks of 128 rows (64 at d = 128: n 4096, one thread, 172 against 196 ms; d 64 and
  // 256 as fast or faster with 128), fewer where the longest key range would not let a block
  // keep its tiles for the second pass (n_k beyond 65536 keys), down to one lane group.
  const Index widest = std::max(dims.dK, dims.dV);
  Index fastQ = kern.blockQ > 0 ? kern.blockQ : widest > 96 && widest <= 192 ? 64 : 128;
  if (useFast && kern.blockQ <= 0) {
    Index nK = 0;
    for (const ItemHead& u : pairs) nK = std::max(nK, u.nK);
    while (fastQ > 2 * fast::backwardPadding() && !fast::backwardCaches(fastQ, nK)) fastQ /= 2;
  }
  // The fast path's k and v packed once per call, each (item, kv head) by the first pair that
  // reads it, tile by tile in parallel (fast::packBackwardTile); the pairs of a GQA group share it.
  Scalar* packed = nullptr;
  auto& packedAt = plan.packedAt;  // (a reference: the threads below must not reach their own plan)
  if (useFast) {
    auto& at = packedAt;
    auto& packs = plan.packs;
    at.assign(pairs.size(), -1);
    packs.clear();
    Index floats = 0;
    for (size_t p = 0; p < pairs.size(); ++p) {
      const ItemHead& u = pairs[p];
      for (size_t o = p; o-- > 0 && pairs[o].item == u.item;)
        if (pairs[o].kvHead == u.kvHead) at[p] = at[o];
      if (at[p] >= 0) continue;
      at[p] = floats;
      floats += fast::packedHeadFloats(u.nK, dims.dK, dims.dV);
      for (Index j0 = 0; j0 < u.nK; j0 += fastK) packs.emplace_back(Index(p), j0);
    }
    packed = plan.packed.get(floats);
    if constexpr (std::is_same_v<Scalar, float>)
      parallelFor(Index(packs.size()), int(std::min<Index>(maxThreads(), Index(packs.size()))), [&](Index w) {
        const ItemHead& u = pairs[size_t(packs[size_t(w)].first)];
        fast::packBackwardTile(fast::stridedInput(k, u.k0, u.kvHead * dims.dK),
                               fast::stridedInput(v, u.k0, u.kvHead * dims.dV), u.nK, dims.dK, dims.dV,
                               packs[size_t(w)].second, fastK, packed + at[size_t(packs[size_t(w)].first)]);
      });
  }

  // The head of pair u as a tile sees it, handed to f (the item's mask lives in this frame).
  const auto withHead = [&](const ItemHead& u, const auto& f) {
    const auto m = itemMask(mask, u);
    const Index dbiasRow0 = dbias && dbias->rows() != u.nQ ? u.head * u.nQ : 0;
    const typename Impl::template Head<std::decay_t<decltype(m)>, QView, KView, VView, OView> hd{
        q.block(u.q0, u.head * dims.dK, u.nQ, dims.dK),
        qs.block(u.q0, u.head * dims.dK, u.nQ, dims.dK),
        k.block(u.k0, u.kvHead * dims.dK, u.nK, dims.dK),
        v.block(u.k0, u.kvHead * dims.dV, u.nK, dims.dV),
        dO.block(u.q0, u.head * dims.dV, u.nQ, dims.dV),
        m,
        taus.tau(u.head),
        cap,
        u.head,
        u.q0,
        u.k0,
        dbiasRow0,
        finite};
    f(hd);
  };
  // Rows of every (item, head): the softmax of each row and the centre of its dtau sum.
  const Index nH = q.rows() * H;
  Scalar* stats = from.mode == BackwardRows::Own ? plan.rowStats.get(4 * nH) : static_cast<Scalar*>(from.stats);
  Eigen::Map<Matrix<Scalar>> rowMax(stats, q.rows(), H), rowSum(stats + nH, q.rows(), H),
      rowD(stats + 2 * nH, q.rows(), H), centre(stats + 3 * nH, q.rows(), H);
  const auto rowsOf = [&](const ItemHead& u) {
    return typename Impl::Rows{rowMax.col(u.head).segment(u.q0, u.nQ), rowSum.col(u.head).segment(u.q0, u.nQ),
                               rowD.col(u.head).segment(u.q0, u.nQ), centre.col(u.head).segment(u.q0, u.nQ)};
  };

  // Work units: (item, query head, query block), each owning its rows of dq. dk, dv and a
  // shared bias gradient collect terms from every unit: each thread keeps its own (thread 0
  // writes the caller's), summed after the loop.
  auto& units = plan.units;
  units.clear();
  for (Index p = 0; p < Index(pairs.size()); ++p)
    for (Index i0 = 0, bq = useFast ? fastQ : tile.q; i0 < pairs[size_t(p)].nQ; i0 += bq)
      units.push_back({p, i0, std::min(bq, pairs[size_t(p)].nQ - i0)});
  const int threads = int(std::min<Index>(maxThreads(), Index(units.size())));
  auto& started = plan.started;
  started.assign(size_t(std::max(1, threads)), 0);
  // References: the threads below must reach this thread's plan, not their own thread_local one.
  auto &dkT = plan.dkT, &dvT = plan.dvT, &dbiasT = plan.dbiasT;
  auto &dkF = plan.dkF, &dvF = plan.dvF;
  if (dkT.size() < started.size()) {
    dkT.resize(started.size());
    dvT.resize(started.size());
    dbiasT.resize(started.size());
    dkF.resize(started.size());
    dvF.resize(started.size());
  }
  // dL/dtau_h of each thread: column t.
  Eigen::Map<Matrix<double>> dscaleT(plan.dscaleT.get(H * std::max(1, threads)), H, std::max(1, threads));
  dscaleT.setZero();

  parallelFor(Index(units.size()), threads, [&](Index w) {
    const Unit& un = units[size_t(w)];
    const ItemHead& u = pairs[size_t(un.pair)];
    const int t = threadIndex();
    auto& sc = Impl::threadScratch();
    if (from.mode == BackwardRows::Collect) {
      withHead(u, [&](const auto& hd) {
        const typename Impl::Tiles none{nullptr, nullptr, nullptr, false, un.rows};
        Impl::firstPass(hd, dropout, un.i0, un.rows, tile.k, rowsOf(u), none, sc);
      });
      return;
    }
    if constexpr (std::is_same_v<Scalar, float>) {
      if (useFast) {
        if (!started[size_t(t)]) {
          started[size_t(t)] = 1;
          std::fill_n(dkF[size_t(t)].get(k.rows() * ldkF), k.rows() * ldkF, 0.0f);
          std::fill_n(dvF[size_t(t)].get(v.rows() * ldvF), v.rows() * ldvF, 0.0f);
        }
        const auto m = itemMask(mask, u);
        const Index dK = dims.dK, dV = dims.dV;
        const fast::BackwardHead<std::decay_t<decltype(m)>> hd{fast::stridedInput(q, u.q0, u.head * dK),
                                                               fast::stridedInput(dO, u.q0, u.head * dV),
                                                               u.nQ,
                                                               u.nK,
                                                               dK,
                                                               dV,
                                                               m,
                                                               u.head,
                                                               float(taus.tau(u.head)),
                                                               packed + packedAt[size_t(un.pair)],
                                                               fastK};
        const fast::BackwardOut out{dq.data() + u.q0 + un.i0 + u.head * dK * dq.outerStride(), dq.outerStride(),
                                    dkF[size_t(t)].get(0) + u.k0 * ldkF + u.kvHead * dKp,      ldkF,
                                    dvF[size_t(t)].get(0) + u.k0 * ldvF + u.kvHead * dVp,      ldvF};
        dscaleT(u.head, t) += fast::backwardBlock(hd, un.i0, un.rows, base2[size_t(un.pair)] != 0, out);
        return;
      }
    }
    if (!started[size_t(t)]) {  // this thread's first unit: its gradient buffers, zeroed
      started[size_t(t)] = 1;
      if (t > 0) {
        dkT[size_t(t)].setZero(dk.rows(), dk.cols());
        dvT[size_t(t)].setZero(dv.rows(), dv.cols());
        if (dbias) dbiasT[size_t(t)].setZero(dbias->rows(), dbias->cols());
      }
    }
    Eigen::Ref<Matrix<Scalar>> dkDst = t == 0 ? dk : Eigen::Ref<Matrix<Scalar>>(dkT[size_t(t)]);
    Eigen::Ref<Matrix<Scalar>> dvDst = t == 0 ? dv : Eigen::Ref<Matrix<Scalar>>(dvT[size_t(t)]);
    Matrix<Scalar>* dbDst = dbias ? (t == 0 ? dbias : &dbiasT[size_t(t)]) : nullptr;
    withHead(u, [&](const auto& hd) {
      const auto rows = rowsOf(u);
      const Index bq = un.rows, nK = u.nK;
      const bool keepY = hd.keepY();
      // The block's L, Y and dP against every key are kept for the second pass when they fit
      // kBackwardCacheBytes: five products a tile instead of seven.
      const Index perTile = keepY ? 3 : 2;
      const bool given = from.mode == BackwardRows::Given;
      const bool cached = !given && Index(sizeof(Scalar)) * perTile * bq * nK <= kBackwardCacheBytes;
      const typename Impl::Tiles tiles{cached ? sc.cacheX.get(bq * nK) : nullptr,
                                       cached && keepY ? sc.cacheY.get(bq * nK) : nullptr,
                                       cached ? sc.cacheDp.get(bq * nK) : nullptr, cached, bq};
      if (!given) Impl::rowPass(hd, dropout, un.i0, bq, tile.k, rows, tiles, sc);
      // dP - D cannot overflow where 4 dP and 4 D are finite. D sums the whole row: a dP of inf in
      // another tile, at a key whose float logit ties the maximum (weight 0.2 where the exact
      // weight is 1e-70), makes it inf, and then a plain tile's 0 * (dP - D) at a key of weight 0
      // is NaN (found by the fuzzer): no tile of such a block takes the plain path.
      bool dHeadroom = true;
      for (Index r = 0; r < bq; ++r) dHeadroom = dHeadroom && std::isfinite(Scalar(4) * rows.d(un.i0 + r));
      auto dqRows = dq.block(u.q0 + un.i0, u.head * dims.dK, bq, dims.dK);
      using TileMap = typename Impl::TileMap;
      Impl::forEachTile(hd, dropout, un.i0, bq, tile.k, tiles, given, sc,
                        [&](Index j0, Index bk, TileMap& x, TileMap& y, TileMap& dp) {
                          // Given rows: no first pass looked at this dP, so its headroom is found here.
                          bool safe = hd.finite && dHeadroom;
                          if (given)
                            for (Index r = 0; safe && r < bq; ++r) safe = allWithHeadroom(dp.row(r));
                          else
                            safe = safe && sc.dpSafe[size_t(j0 / tile.k)];
                          dscaleT(u.head, t) +=
                              Impl::tile(hd, rows, dropout, un.i0, bq, j0, bk, safe, x, y, dp, dqRows,
                                         dkDst.block(u.k0 + j0, u.kvHead * dims.dK, bk, dims.dK),
                                         dvDst.block(u.k0 + j0, u.kvHead * dims.dV, bk, dims.dV), dbDst, sc);
                        });
    });
  });
  if (from.mode == BackwardRows::Collect) return;
  if (useFast) {
    for (size_t t = 0; t < started.size(); ++t) {
      if (!started[t]) continue;
      const Eigen::Map<const RowMajorMatrix<Scalar>> dkAll(dkF[t].get(0), k.rows(), ldkF);
      const Eigen::Map<const RowMajorMatrix<Scalar>> dvAll(dvF[t].get(0), v.rows(), ldvF);
      for (Index h = 0; h < heads.keyValue; ++h) {
        dk.middleCols(h * dims.dK, dims.dK) += dkAll.middleCols(h * dKp, dims.dK);
        dv.middleCols(h * dims.dV, dims.dV) += dvAll.middleCols(h * dVp, dims.dV);
      }
    }
    dscale += dscaleT.rowwise().sum().template cast<Scalar>();
    return;
  }
  for (size_t t = 1; t < started.size(); ++t) {
    if (!started[t]) continue;
    dk += dkT[t];
    dv += dvT[t];
    if (dbias) *dbias += dbiasT[t];
  }
  dscale += dscaleT.rowwise().sum().template cast<Scalar>();
}

/// backwardTiledKernel (above) with any mask: compiled once per precision and input layout, each
/// mask type adds only its ErasedMask table.
template <typename Scalar, typename QView = ConstRef<Scalar>, typename KView = QView, typename VView = KView,
          typename OView = QView, typename Mask>
void backwardTiled(const kernel::Tiled& kern, const typename Identity<QView>::type& q,
                   const typename Identity<KView>::type& k, const typename Identity<VView>::type& v,
                   const typename Identity<OView>::type& dO, const BatchLayout& layout, const Heads& heads,
                   const HeadDims& dims, const HeadTaus<Scalar>& taus, const Mask& mask, const Dropout& dropout,
                   Eigen::Ref<Matrix<Scalar>> dq, Eigen::Ref<Matrix<Scalar>> dk, Eigen::Ref<Matrix<Scalar>> dv,
                   Eigen::Ref<Vector<Scalar>> dscale, Matrix<Scalar>* dbias, BackwardRows from = {}) {
  backwardTiledKernel<Scalar, QView, KView, VView, OView>(
      kern, q, k, v, dO, layout, heads, dims, taus, ErasedMask<Scalar>(mask), dropout, dq, dk, dv, dscale, dbias, from);
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_BACKWARD_TILED_HPP
