#ifndef SDPA_INTERNAL_FORWARD_TILED_HPP
#define SDPA_INTERNAL_FORWARD_TILED_HPP

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "../dropout.hpp"
#include "../kernel.hpp"
#include "../layout.hpp"
#include "../mask.hpp"
#include "../scale.hpp"
#include "cpu.hpp"
#include "decode_rows.hpp"
#include "diagnostics_rows.hpp"
#include "erased_mask.hpp"
#include "forward_fast.hpp"
#include "forward_naive.hpp"
#include "half.hpp"
#include "macros.hpp"
#include "online_softmax.hpp"
#include "parallel.hpp"

namespace sdpa::internal {

/// Query rows and keys per tile.
struct TileSizes {
  Index q, k;
};

/**
 * Forward block sizes, measured with bench_forward's BM_ForwardBlocks on a 2-core AVX-512
 * machine (1 MiB L2 per core) at n = 4096 (docs/PERFORMANCE.md has the table): larger tiles
 * amortise the packing of Eigen's products, up to a logits tile of 128-256 KiB in L2. An
 * explicit kernel::Tiled{b_q, b_k} overrides either.
 */
inline TileSizes tileSizes(const kernel::Tiled& kernel, Index dK, Index dV) {
  const Index d = std::max(dK, dV);
  TileSizes t = d <= 32 ? TileSizes{128, 512} : TileSizes{256, 256};
  if (kernel.blockQ > 0) t.q = kernel.blockQ;
  if (kernel.blockK > 0) t.k = kernel.blockK;
  return t;
}

/// Whether the tiled kernels fold the scale into the query block, (tau q) k^T, or multiply the
/// logits after the product: folded only for |tau| <= 1, where no product or partial sum of
/// (tau q) k^T is larger than the plain computation's q k^T (tau q may overflow where tau (q.k)
/// does not). The forward and the backward must agree, so that they compute the same logits.
template <typename Acc>
bool foldsScaleIntoQuery(Acc tau) {
  return std::abs(tau) <= Acc(1);
}

/// Backward block sizes: five products and three b_q x b_k buffers per tile; measured with
/// bench_backward's BM_BackwardBlocks at n = 2048, flat within 5% from 64 x 128 up.
inline TileSizes backwardTileSizes(const kernel::Tiled& kernel, Index, Index) {
  TileSizes t{128, 256};
  if (kernel.blockQ > 0) t.q = kernel.blockQ;
  if (kernel.blockK > 0) t.k = kernel.blockK;
  return t;
}

/// Whether D's columns are contiguous in memory (column-major storage, or a vector).
template <typename D>
struct ColumnsAre {
  static constexpr bool contiguous = !(D::Flags & Eigen::RowMajorBit) || D::ColsAtCompileTime == 1;
};

/**
 * The tiled forward of one head: query blocks stream key blocks through an OnlineSoftmax.
 * `In` is the storage type of q, k, v (float, double, Eigen::half, Eigen::bfloat16); logits,
 * softmax and accumulation are in Accumulator<In>.
 */
template <typename In>
struct forward_tiled_impl {
  using Acc = Accumulator<In>;
  using TileMap = Eigen::Map<RowMajorMatrix<Acc>>;

  /// Per-thread scratch, allocated on first use and reused by every later call on the thread.
  struct Scratch {
    Buffer<Acc> qs, s, k, v;
    Buffer<Acc> logits, raw;                   // a DiagnosticsSink's copies of a tile
    Buffer<Acc> v2;                            // a decoding chunk of row-major half values
    OnlineSoftmax<Acc> state, part;            // part: a key split merged into state
    std::vector<OnlineSoftmax<Acc>> group;     // the states of a group of decoding units
    std::vector<RowStream> rows, partRows;     // a DiagnosticsSink's rows of the block (and of part)
    std::vector<const Acc*> rowsA;             // streamDecode's rows of q, then of the weights
    std::vector<Acc*> rowsS, rowsD;            // its rows of logits and of weighted values
    std::vector<char> active;                  // its heads that see the chunk
    std::vector<Index> runFirst, runRows;      // its kv heads' first members and first rows
    std::vector<const In*> runK, runV, runAt;  // their k and v, and at the chunk's first key
    // A key split's last values pass requests the first chunk of the split after it where that
    // split runs next on this thread (followOn, which the caller sets per call): `requested`,
    // those keys' address, tells the next call that it need not read them first.
    bool followOn = false;
    const void* requested = nullptr;
  };
  static Scratch& threadScratch() {
    thread_local Scratch scratch;
    return scratch;
  }

  /// Rows [j0, j0 + rows) of a k or v head block, in Acc: the block itself, or a converted copy
  /// of half-precision storage (converted once per tile, read b_q times by the products).
  template <typename Block>
  static auto rowsAsAcc(const Block& x, Index j0, Index rows, Buffer<Acc>& buf) {
    if constexpr (std::is_same_v<typename Block::Scalar, Acc>) {
      return x.middleRows(j0, rows);
    } else {
      Eigen::Map<Matrix<Acc>> m(buf.get(rows * x.cols()), rows, x.cols());
      m = x.middleRows(j0, rows).template cast<Acc>();
      return m;
    }
  }

  /// Rows [j0, j0 + rows) of a row-major half-precision k or v head block as a row-major Acc
  /// matrix in buf: each row is contiguous, converted by halfToFloat (Eigen's cast of a
  /// row-major half block to float runs an element at a time, 12x slower for decoding).
  template <typename Block>
  static auto rowMajorRowsAsAcc(const Block& x, Index j0, Index rows, Buffer<Acc>& buf) {
    Eigen::Map<RowMajorMatrix<Acc>> m(buf.get(rows * x.cols()), rows, x.cols());
    for (Index j = 0; j < rows; ++j) halfToFloat(&x.coeffRef(j0 + j, 0), &m(j, 0), x.cols());
    return m;
  }

  /// Decoding's row pointers for the logits' row kernels: sc.rowsA[r] = qs's row r, sc.rowsS[r]
  /// = s's.
  template <typename QS, typename S>
  static void setRows(const QS& qs, S& s, Scratch& sc) {
    sc.rowsA.resize(size_t(qs.rows()));
    sc.rowsS.resize(size_t(qs.rows()));
    for (Index r = 0; r < qs.rows(); ++r) {
      sc.rowsA[size_t(r)] = &qs(r, 0);
      sc.rowsS[size_t(r)] = &s(r, 0);
    }
  }
  /// ... and for the values': sc.rowsA[r] = s's row r (the weights), sc.rowsD[r] = its dots (d_v
  /// apart from dots).
  template <typename S>
  static void setValueRows(const S& s, Acc* dots, Index dV, Scratch& sc) {
    sc.rowsA.resize(size_t(s.rows()));
    sc.rowsD.resize(size_t(s.rows()));
    for (Index r = 0; r < s.rows(); ++r) {
      sc.rowsA[size_t(r)] = &s(r, 0);
      sc.rowsD[size_t(r)] = dots + r * dV;
    }
  }

  /// A column segment of k or v in Acc: itself, or converted into buf. A separate conversion
  /// pass is vectorised by Eigen 3.4 where a cast inside a larger expression is not (5x slower).
  template <typename Segment>
  static auto columnAsAcc(const Segment& x, Buffer<Acc>& buf) {
    if constexpr (std::is_same_v<typename Segment::Scalar, Acc>) {
      return x;
    } else {
      Eigen::Map<Vector<Acc>> m(buf.get(x.size()), x.size());
      if (x.innerStride() == 1)
        halfToFloat(x.data(), m.data(), x.size());
      else
        m = x.template cast<Acc>();  // a column of row-major storage
      return m;
    }
  }

  /// Decoding's logits s (bq x cols, zero) += qs k[j0 .., :]^T one column of k at a time, each
  /// converted to Acc: storage without column kernels of its own (double, or half storage where
  /// the CPU has no F16C).
  template <typename DK, typename QS, typename S>
  static void logitsByColumn(const Eigen::MatrixBase<DK>& k, const QS& qs, Index j0, Index cols, S& s, Scratch& sc) {
    for (Index c = 0; c < k.cols(); ++c) {
      const auto kc = columnAsAcc(k.col(c).segment(j0, cols), sc.k);
      for (Index r = 0; r < s.rows(); ++r) s.row(r) += qs(r, c) * kc.transpose();
    }
  }

  /// One query head of streamDecode: its block of q (the item's n_q x d_k), scale, place in the
  /// packed batch (as stream's head, row0, col0), state, the sink's rows (or null), and which
  /// of the kv heads streamDecode's k and v hold it reads (their columns kv d_k .., kv d_v ..).
  template <typename DQ>
  struct Member {
    DQ q;
    Acc tau;
    Index head, row0, col0;
    OnlineSoftmax<Acc>* state;
    RowStream* stats;
    Index kv = 0;
  };

  /**
   * stream's decoding (decodes: a few rows) over keys [kBegin, kEnd) for float k and v holding
   * one or more kv heads side by side (n_k x (heads d_k), n_k x (heads d_v)), for `count` query
   * heads with the same rows [i0, i0 + bq) of one item, ordered by kv head (Member::kv): a GQA
   * group, one head, or the groups of several kv heads. Each chunk's products for all their rows
   * at once: stored by columns, decodeLogitsRows and decodeValuesRows per kv head (each column
   * block of k and v loaded once for its rows); by keys, decodeLogitsByKey and decodeValuesByKey
   * for one kv head (each block of keys once), their ...Heads forms for several (each block of
   * keys' rows whole, for every head in turn). Scale, mask and softmax per head as stream. A
   * head's result is the same in a group as alone, to the bit.
   */
  template <typename DQ, typename DK, typename DV, typename Mask>
  static void streamDecode(const Member<DQ>* members, Index count, const Eigen::MatrixBase<DK>& k,
                           const Eigen::MatrixBase<DV>& v, Index dK, Index dV, const Mask& mask, const Dropout& dropout,
                           Index i0, Index bq, Index kBegin, Index kEnd, Scratch& sc, bool resume) {
    const Index nK = k.rows(), chunk = decodeKeys(dK, dV);
    const Index ldk = k.derived().outerStride(), ldv = v.derived().outerStride();
    const void* requested = std::exchange(sc.requested, nullptr);  // (by the call before, if any)
    constexpr bool kByKey = !ColumnsAre<DK>::contiguous, vByKey = !ColumnsAre<DV>::contiguous;
    Acc* qsAll = sc.qs.get(count * bq * dK);
    Acc* sAll = sc.s.get(count * bq * chunk);
    Acc* dotsAll = sc.v.get(count * bq * dV);
    sc.rowsA.resize(size_t(count * bq));
    sc.rowsS.resize(size_t(count * bq));
    sc.rowsD.resize(size_t(count * bq));
    sc.active.resize(size_t(count));
    // qs = tau q per head, as stream's.
    for (Index m = 0; m < count; ++m) {
      const auto& u = members[m];
      if (!resume) u.state->start(bq, dV);
      scaledQuery(u.q, i0, u.tau, folds(u.tau, u.stats), TileMap(qsAll + m * bq * dK, bq, dK));
    }
    if (kBegin >= kEnd) return;  // (no keys: k and v may have no data to point into)
    // The kv heads' runs of members (members [runFirst[g], runFirst[g + 1]) read kv head g of
    // the run), their rows (rows [runRows[g], runRows[g + 1]) of a chunk's products) and the
    // runs' k and v.
    sc.runFirst.clear();
    for (Index m = 0; m < count; ++m)
      if (m == 0 || members[m].kv != members[m - 1].kv) sc.runFirst.push_back(m);
    const Index G = Index(sc.runFirst.size());
    sc.runFirst.push_back(count);
    sc.runRows.resize(size_t(G + 1));
    sc.runK.resize(size_t(G));
    sc.runV.resize(size_t(G));
    sc.runAt.resize(size_t(G));
    for (Index g = 0; g < G; ++g) {
      const Index kv = members[sc.runFirst[size_t(g)]].kv;
      sc.runK[size_t(g)] = k.derived().data() + kv * dK * (kByKey ? 1 : ldk);
      sc.runV[size_t(g)] = v.derived().data() + kv * dV * (vByKey ? 1 : ldv);
    }
    // One kv head whose k and v are each one run of keys (stored by keys, no other head between
    // them): a chunk's values are requested while its logits are computed, the next chunk's keys
    // while its values are (ByKeyReads), so that memory streams during the products.
    const bool runs = std::is_same_v<In, float> && kByKey && vByKey && G == 1 && ldk == dK && ldv == dV;
    // The first key of the chunk whose keys the last values pass requested (this call's or, for
    // its first chunk, the call before's: the split before this one, on this thread).
    Index requestedChunk = runs && requested == sc.runK[0] + kBegin * ldk ? kBegin : -1;
    for (Index j0 = kBegin; j0 < kEnd; j0 += chunk) {
      const Index cols = std::min(chunk, kEnd - j0);
      Index R = 0;
      for (Index g = 0; g < G; ++g) {
        sc.runRows[size_t(g)] = R;
        for (Index m = sc.runFirst[size_t(g)]; m < sc.runFirst[size_t(g) + 1]; ++m) {
          const auto& u = members[m];
          const mask::Tile t = mask.classify(i0, bq, j0, cols, u.q.rows(), nK, u.head);
          sc.active[size_t(m)] = static_cast<char>(t == mask::Tile::Hidden ? 0 : t == mask::Tile::Partial ? 2 : 1);
          if (t == mask::Tile::Hidden) continue;
          TileMap s(sAll + m * bq * chunk, bq, cols);
          s.setZero();
          for (Index r = 0; r < bq; ++r, ++R) {
            sc.rowsA[size_t(R)] = qsAll + (m * bq + r) * dK;
            sc.rowsS[size_t(R)] = &s(r, 0);
          }
        }
      }
      sc.runRows[size_t(G)] = R;
      if (R == 0) continue;
      const Index* runRows = sc.runRows.data();
      // Several kv heads stored by keys: the chunk's rows read whole, a block of keys at a time,
      // each block for every head (the bits of each head's call alone).
      for (Index g = 0; g < G; ++g) sc.runAt[size_t(g)] = sc.runK[size_t(g)] + j0 * (kByKey ? ldk : 1);
      if constexpr (kByKey) {
        ByKeyReads reads;
        if (runs) reads = {requestedChunk == j0, sc.runV[0] + j0 * ldv, cols * dV * Index(sizeof(In))};
        decodeLogitsByKeyHeads(sc.rowsA.data(), runRows, G, sc.runAt.data(), ldk, dK, cols, sc.rowsS.data(), reads);
      } else {
        for (Index g = 0; g < G; ++g)
          decodeLogitsRows(sc.rowsA.data() + runRows[g], runRows[g + 1] - runRows[g], sc.runAt[size_t(g)], ldk, dK,
                           cols, sc.rowsS.data() + runRows[g]);
      }
      R = 0;
      for (Index g = 0; g < G; ++g) {
        sc.runRows[size_t(g)] = R;
        for (Index m = sc.runFirst[size_t(g)]; m < sc.runFirst[size_t(g) + 1]; ++m) {
          if (!sc.active[size_t(m)]) continue;
          const auto& u = members[m];
          TileMap s(sAll + m * bq * chunk, bq, cols);
          absorbChunk(s, u.tau, folds(u.tau, u.stats), sc.active[size_t(m)] == 2, mask, dropout, u.q.rows(), nK, u.head,
                      u.row0, u.col0, i0, j0, *u.state, sc, u.stats);
          for (Index r = 0; r < bq; ++r, ++R) {
            sc.rowsA[size_t(R)] = &s(r, 0);
            sc.rowsD[size_t(R)] = dotsAll + (m * bq + r) * dV;
          }
        }
      }
      for (Index g = 0; g < G; ++g) sc.runAt[size_t(g)] = sc.runV[size_t(g)] + j0 * (vByKey ? ldv : 1);
      if constexpr (vByKey) {
        ByKeyReads reads;
        if (runs) {
          reads.requested = true;
          if (j0 + chunk < kEnd) {
            reads.next = sc.runK[0] + (j0 + chunk) * ldk;
            reads.nextBytes = std::min(chunk, kEnd - j0 - chunk) * dK * Index(sizeof(In));
            requestedChunk = j0 + chunk;
          } else if (sc.followOn && kEnd < nK) {  // the next split's first chunk
            reads.next = sc.runK[0] + kEnd * ldk;
            reads.nextBytes = std::min(chunk, nK - kEnd) * dK * Index(sizeof(In));
            sc.requested = reads.next;
          }
        }
        decodeValuesByKeyHeads(sc.rowsA.data(), runRows, G, sc.runAt.data(), ldv, dV, cols, sc.rowsD.data(), reads);
      } else {
        for (Index g = 0; g < G; ++g)
          decodeValuesRows(sc.rowsA.data() + runRows[g], runRows[g + 1] - runRows[g], sc.runAt[size_t(g)], ldv, dV,
                           cols, sc.rowsD.data() + runRows[g]);
      }
      for (Index g = 0; g < G; ++g) {
        const Index kv = members[sc.runFirst[size_t(g)]].kv;
        for (Index m = sc.runFirst[size_t(g)]; m < sc.runFirst[size_t(g) + 1]; ++m) {
          if (!sc.active[size_t(m)]) continue;
          TileMap s(sAll + m * bq * chunk, bq, cols);
          auto acc = members[m].state->acc();
          for (Index r = 0; r < bq; ++r) {
            const Acc* dots = dotsAll + (m * bq + r) * dV;
            for (Index c = 0; c < dV; ++c)
              acc(r, c) +=
                  std::isfinite(dots[c]) ? dots[c] : dotSkippingZeros(s.row(r), v.col(kv * dV + c).segment(j0, cols));
          }
        }
      }
    }
  }

  /// Whether tau is folded into the query block (foldsScaleIntoQuery), but not a tau of 0 with a
  /// sink, whose raw q.k needs the product before the scale.
  static bool folds(Acc tau, const RowStream* stats) { return foldsScaleIntoQuery(tau) && !(stats && tau == Acc(0)); }

  /**
   * qs (b_q x d_k) = tau q rows [i0, i0 + b_q) where `fold`, else those rows: the scale folded into
   * the query block once, so that every policy costs one b_q x d_k multiply and None none.
   * Copied column by column: q is column-major (columns n_q apart), and a walk in qs's row order
   * touched a page per element (3%).
   */
  template <typename DQ>
  static void scaledQuery(const Eigen::MatrixBase<DQ>& q, Index i0, Acc tau, bool fold, TileMap qs) {
    for (Index c = 0; c < qs.cols(); ++c) {
      const auto column = q.col(c).segment(i0, qs.rows()).template cast<Acc>();
      if (tau == Acc(1) || !fold)
        qs.col(c) = column;
      else
        qs.col(c) = tau * column;
    }
  }

  /// sum_j p_j x_j over the j with p_j != 0: a value of weight 0 has no effect even if it is NaN
  /// or inf (0 * inf = NaN). Only a dot that came out non-finite pays for it.
  template <typename P, typename X>
  static Acc dotSkippingZeros(const P& p, const X& x) {
    return (p.transpose().array() == Acc(0)).select(Acc(0), p.transpose().array() * x.array()).sum();
  }

  /**
   * The steps of a tile between its products, as stream takes them: the raw q.k kept for a sink,
   * the scale where it was not folded into q, the mask where the tile is partial, the sink's
   * copy of the logits, the online softmax (s becomes the weights), the sink's figures and the
   * dropout.
   */
  template <typename Mask>
  static void absorbChunk(TileMap s, Acc tau, bool fold, bool partial, const Mask& mask, const Dropout& dropout,
                          Index nQ, Index nK, Index head, Index row0, Index col0, Index i0, Index j0,
                          OnlineSoftmax<Acc>& state, Scratch& sc, RowStream* stats) {
    const Index bq = s.rows(), cols = s.cols();
    const bool rawNeeded = stats && !rawIsLogitOverTau(mask, tau);
    TileMap raw(rawNeeded ? sc.raw.get(bq * cols) : nullptr, bq, rawNeeded ? cols : 0);
    if (rawNeeded) raw = s;
    if (!fold) s *= tau;
    if (partial) mask.apply(s, i0, j0, nQ, nK, head);
    TileMap logits(stats ? sc.logits.get(bq * cols) : nullptr, bq, stats ? cols : 0);
    if (stats) logits = s;
    // Masked tiles hold -inf; so may any tile whose k holds inf (q k^T = -inf), which only the
    // logits themselves reveal without another pass over k: every tile takes the select.
    state.absorb(s);
    if (stats)
      for (Index r = 0; r < bq; ++r)
        stats[r].add(tileRowSums(&logits(r, 0), &s(r, 0), rawNeeded ? &raw(r, 0) : nullptr,
                                 fold ? Acc(1) / tau : Acc(1), cols, state.max()(r), j0),
                     double(state.max()(r)), 1.0);
    if (dropout.enabled()) applyDropout(s, dropout, head, row0 + i0, col0 + j0);
  }

  /**
   * Query rows [i0, i0 + bq) of one head (q n_q x d_k, k n_k x d_k, v n_k x d_v) against keys
   * [kBegin, kEnd) in tiles of bk: leaves the unnormalised state in `state`. (row0, col0) place
   * the head in the packed batch for the dropout counters. `stats` (bq rows, or null) streams
   * the rows' diagnostics (a DiagnosticsSink's), from each tile's logits before the dropout.
   */
  template <typename DQ, typename DK, typename DV, typename Mask>
  static void stream(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                     Acc tau, const Mask& mask, const Dropout& dropout, Index head, Index row0, Index col0, Index i0,
                     Index bq, Index kBegin, Index kEnd, Index bk, OnlineSoftmax<Acc>& state, Scratch& sc,
                     bool resume = false, RowStream* stats = nullptr) {
    if constexpr (std::is_same_v<In, float>) {
      if (decodes<DK, DV>(bq, k.rows())) {  // float decoding: the GQA group's kernel, on one head
        const Member<DQ> one{q.derived(), tau, head, row0, col0, &state, stats};
        streamDecode(&one, 1, k, v, k.cols(), v.cols(), mask, dropout, i0, bq, kBegin, kEnd, sc, resume);
        return;
      }
    }
    const Index nQ = q.rows(), nK = k.rows(), dK = q.cols(), dV = v.cols();
    if (!resume) state.start(bq, dV);
    // qs = tau q where folded; else the logits are multiplied after the product.
    TileMap qs(sc.qs.get(bq * dK), bq, dK);
    const bool fold = folds(tau, stats);
    scaledQuery(q, i0, tau, fold, qs);
    // Decoding (a few query rows): chunks of many keys, the products written column by column
    // so that each column of k and v streams contiguously from memory (a b_k x d tile would
    // read d short segments d_k pages apart) and half storage converts in registers.
    const bool decode = decodes<DK, DV>(bq, nK);
    const Index chunk = decode ? decodeKeys(dK, dV) : bk;
    // Half storage's decoding column kernels (AVX2 or AVX-512), or None: convert column by column.
    const half_columns::Path halfPath = IsHalfScalar<In> ? half_columns::path() : half_columns::Path::None;
    for (Index j0 = kBegin; j0 < kEnd; j0 += chunk) {
      const Index cols = std::min(chunk, kEnd - j0);
      const mask::Tile t = mask.classify(i0, bq, j0, cols, nQ, nK, head);
      if (t == mask::Tile::Hidden) continue;
      TileMap s(sc.s.get(bq * chunk), bq, cols);
      if (decode) {
        const auto kChunk = k.middleRows(j0, cols);  // cols x d_k, each column contiguous (or row)
        if constexpr (IsHalfScalar<In> && !ColumnsAre<DK>::contiguous) {
          // Row-major half storage: the row kernels by keys, each packet widened in registers
          // (AVX2, AVX-512); elsewhere blocks of key rows converted (within L1/L2), each a
          // matrix-vector product per query row.
          setRows(qs, s, sc);
          s.setZero();
          if (!decodeLogitsByKey(sc.rowsA.data(), bq, &kChunk.coeffRef(0, 0), k.derived().outerStride(), dK, cols,
                                 sc.rowsS.data()))
            for (Index b = 0; b < cols; b += kRowBlock) {
              const Index n = std::min(kRowBlock, cols - b);
              const auto kt = rowMajorRowsAsAcc(kChunk, b, n, sc.k);
              for (Index r = 0; r < bq; ++r) s.row(r).segment(b, n).transpose().noalias() = kt * qs.row(r).transpose();
            }
        } else if constexpr (IsHalfScalar<In>) {
          s.setZero();
          if (halfPath != half_columns::Path::None) {
            // Every row in one pass over each column block, each packet widened once for up to
            // 4 rows (axpyAllRows: the bits of axpyAll row by row), or 8 in the wide blocks.
            setRows(qs, s, sc);
            const In* kc = &kChunk.coeffRef(0, 0);
            const Index ldk = k.derived().outerStride();
            const Index wide = decodeHalfLogitsWide(sc.rowsA.data(), bq, kc, ldk, dK, cols, sc.rowsS.data());
            half_columns::axpyAllRows(halfPath, sc.rowsA.data() + wide, bq - wide, kc, ldk, dK, sc.rowsS.data() + wide,
                                      cols);
          } else {
            logitsByColumn(k, qs, j0, cols, s, sc);
          }
        } else {
          s.setZero();
          logitsByColumn(k, qs, j0, cols, s, sc);
        }
      } else {
        const auto kt = rowsAsAcc(k.derived(), j0, cols, sc.k);
        s.noalias() = qs * kt.transpose();  // b_q x b_k logits
      }
      absorbChunk(s, tau, fold, t == mask::Tile::Partial, mask, dropout, nQ, nK, head, row0, col0, i0, j0, state, sc,
                  stats);
      auto acc = state.acc();
      if (decode) {
        // dots[c] = s_r . v_c for every value column, then the guard: a value of weight 0 must
        // have no effect even if it is NaN or inf (0 * inf = NaN), so only a non-finite dot
        // pays for the (scalar) select.
        const auto vChunk = v.middleRows(j0, cols);
        Acc* dotsAll = sc.v.get(bq * dV);
        bool allRows = false;  // every row's dots computed at once (the row kernels)
        const In* vc = &vChunk.coeffRef(0, 0);
        const Index ldv = v.derived().outerStride();
        if constexpr (!ColumnsAre<DV>::contiguous && IsHalfScalar<In>) {
          // As k's logits: the row kernels by keys (row-major v, where they widen it in
          // registers).
          setValueRows(s, dotsAll, dV, sc);
          allRows = decodeValuesByKey(sc.rowsA.data(), bq, vc, ldv, dV, cols, sc.rowsD.data());
        } else if constexpr (IsHalfScalar<In>) {
          if (halfPath != half_columns::Path::None) {
            // Each packet of v widened once for up to 8 rows (dotAllRows: dotAll's bits row by row).
            setValueRows(s, dotsAll, dV, sc);
            half_columns::dotAllRows(halfPath, sc.rowsA.data(), 0, bq, vc, ldv, dV, cols, sc.rowsD.data());
            allRows = true;
          }
        }
        for (Index r = 0; r < bq; ++r) {
          Eigen::Map<Vector<Acc>> dots(dotsAll + r * dV, dV);
          if (!allRows) {
            if constexpr (IsHalfScalar<In> && !ColumnsAre<DV>::contiguous) {
              // Row-major half storage: blocks of value rows converted, as k's.
              dots.setZero();
              for (Index b = 0; b < cols; b += kRowBlock) {
                const Index n = std::min(kRowBlock, cols - b);
                dots.transpose().noalias() += s.row(r).segment(b, n) * rowMajorRowsAsAcc(vChunk, b, n, sc.v2);
              }
            } else if constexpr (!std::is_same_v<In, float>) {
              for (Index c = 0; c < dV; ++c) dots(c) = s.row(r).dot(columnAsAcc(vChunk.col(c), sc.k).transpose());
            }
          }
          for (Index c = 0; c < dV; ++c) {
            if (!std::isfinite(dots(c))) dots(c) = dotSkippingZeros(s.row(r), columnAsAcc(vChunk.col(c), sc.k));
            acc(r, c) += dots(c);
          }
        }
      } else {
        const auto vt = rowsAsAcc(v.derived(), j0, cols, sc.v);
        addProductSkippingZeros(s, vt, acc);  // a GEMM unless this v tile holds NaN or inf
      }
    }
  }

  /// Key rows per block of row-major half storage converted for decoding (64 KiB of floats at
  /// d = 128: in L2 beside the chunk).
  static constexpr Index kRowBlock = 128;
  /// Query blocks of at most this many rows take the decoding path (and more: decodes).
  static constexpr Index kDecodeRows = 4;
  /// Query blocks of up to this many rows take it for float (half) k and v stored by columns,
  /// against at least kManyKeys keys a row.
  static constexpr Index kWideDecodeRows = 32, kWideHalfRows = 32, kManyKeys = 4;

  /**
   * Whether a block of `rows` query rows against nK keys takes the decoding path, for k and v of
   * types DK, DV: at most kDecodeRows rows, or for float k and v (streamDecode over columns, the
   * by-key kernels over rows) up to kWideDecodeRows, and for half columns where the CPU has
   * their column kernels up to kWideHalfRows, where the keys outnumber the rows kManyKeys times
   * (multi-token or speculative decoding, a short chunk of a long prompt).
   * Decoding reads each chunk of k and v once for all the rows (float: in wide register blocks
   * from 5 rows on; half: each packet widened once for up to 4 or 8 rows); the prefill kernel
   * packs (or converts) all of k and v for each query block, scans k for its bounds and runs a
   * block on one thread.
   * bench_decode's BM_DecodeQueryRows (d 128, causal, 65536 keys; session 35): one thread, 16
   * rows 11.8-12.6 ms there against 6.1-6.2 here, 5 rows 11.2-12.8 against 3.5; two threads
   * 11.7-12.8 against 2.9-3.2 and 12.0-12.2 against 1.7. Where the keys are few it loses: a
   * batch of 16 items of 8 heads (d 128), 16 rows against 32 keys, 1.41 ms there, 1.69 here;
   * 8 rows against 32 keys still gained (1.29 -> 0.94). fp16 K/V (the prefill kernel converts
   * them per call): one thread, 16 rows 37-40 ms there, 8.6-8.9 here, 5 rows 38-42 against 2.7;
   * 32 rows 27.7 against 17.0, 64 rows 34-35 against 30-32, 96 rows 39 against 48 (two threads:
   * 31 against 8.5 at 32 rows); 4096 keys, 32 rows 2.45 against 0.72 ms. Float stayed at 16
   * until session 37, when the wide blocks came to share each block of keys: on a Sapphire
   * Rapids Xeon (65536 keys, d 128, causal, attentionForwardInto, best of 8) 17, 24 and 32 rows
   * took 15-16 ms there against 6.6-7.6, 8.2-8.6 and 10.8-11.3 here on one thread, 14.6-15.7
   * against 3.3, 4.0-4.1 and 5.3 on two; 48 rows 21-22 ms either way. Row-major float k and v
   * (numpy's and PyTorch's layout) took the prefill path from 5 rows until session 42: there 5,
   * 16 and 32 rows took 22 ms on one thread (one unit, so 24 on two), here 5.7-6.6, 6.0-6.2 and
   * 14.3 (2.5, 3.7 and 6.6 on two threads).
   */
  template <typename DK, typename DV>
  static bool decodes(Index rows, Index nK) {
    if (rows <= kDecodeRows) return true;
    if constexpr (!ColumnsAre<DK>::contiguous || !ColumnsAre<DV>::contiguous) {
      // The by-key kernels: float, or half where they widen it in registers (AVX2, AVX-512).
      const bool rowKernels =
          std::is_same_v<In, float> || (IsHalfScalar<In> && half_columns::path() != half_columns::Path::None);
      return rowKernels && rows <= kWideDecodeRows && nK >= kManyKeys * rows;
    } else {
      constexpr Index kRows = std::is_same_v<In, float> ? kWideDecodeRows : IsHalfScalar<In> ? kWideHalfRows : 0;
      const bool columnKernels = !IsHalfScalar<In> || half_columns::path() != half_columns::Path::None;
      return columnKernels && rows <= kRows && nK >= kManyKeys * rows;
    }
  }
  /// Keys per decoding chunk: k and v of a chunk take about 1 MiB (within L2), so that the
  /// query heads of a GQA group that run a chunk in turn read it from L2; 256 to 16384 keys, a
  /// multiple of 64. The chunks start at the key range's first key, whoever runs them.
  static Index decodeKeys(Index dK, Index dV) {
    const Index perKey = std::max<Index>(1, (dK + dV) * Index(sizeof(In)));
    return std::clamp<Index>((Index(1) << 20) / perKey / 64 * 64, 256, 16384);
  }
};

/// A row-major view of an input: binds row-major matrices, maps and blocks (numpy's and
/// PyTorch's layout) without a copy.
template <typename Scalar>
using RowConstRef = Eigen::Ref<const RowMajorMatrix<Scalar>>;

/// Whether an input is stored row by row (a matrix, not a vector).
template <typename D>
inline constexpr bool IsRowMajorInput =
    bool(D::Flags& Eigen::RowMajorBit) && D::RowsAtCompileTime != 1 && D::ColsAtCompileTime != 1;

/// The view the tiled kernels read an input through in place: RowConstRef for one stored row
/// by row, else ConstRef (column-major; binds column-major storage without a copy).
template <typename In, typename D>
using InputView = std::conditional_t<IsRowMajorInput<D>, RowConstRef<In>, ConstRef<In>>;

/**
 * f(x...) on views the tiled kernels read in place, each input in its own storage order
 * (InputView): no input is copied whole, whatever mix of orders the call has. (Each mix is its
 * own instantiation of the kernels, made only where a caller uses it.)
 */
template <typename In, typename F, typename... D>
void withInputViews(F&& f, const Eigen::MatrixBase<D>&... x) {
  f(InputView<In, D>(x)...);
}

template <typename T>
struct Identity {
  using type = T;
};

/// Key splits of a work unit against nK keys: only decoding units (`decoding`: a few query rows)
/// with many keys are split, and by their own shape alone, so that a head's result does
/// not depend on the thread count, the other heads or the other batch items (bitwise).
inline Index keySplits(bool decoding, Index nK, Index tileK) {
  constexpr Index kMaxSplits = 8, kMinTilesPerSplit = 4;
  if (!decoding) return 1;
  return std::clamp<Index>(nK / (kMinTilesPerSplit * tileK), 1, kMaxSplits);
}

/**
 * The tiled forward of a packed batch (layout and heads as in multihead.hpp): out is
 * (sum n_q) x (H d_v), lse (sum n_q) x H. Work units are (item, head, query block). A decoding
 * unit (a few query rows, many keys) is also split over key ranges (keySplits) whose states are
 * merged by their logSumExp, left to right: in parallel when the units are fewer than the
 * threads, else one after the other inside the unit's work item -- the same arithmetic. (Units
 * that read the same k and v chunk by chunk run as a group: a GQA group's, and for float k and
 * v stored by keys an item's kv heads, whose splits are the work items on several threads.)
 * `stats` (null, or one pointer per query head to its (sum n_q) rows): a DiagnosticsSink's rows,
 * streamed with the online softmax and merged across key splits as the states are; decoding
 * units are then not grouped (the same arithmetic), and a head of tau = 0 takes the general
 * kernel (its raw q.k is a product of its own). QView, KView, VView: how q, k and v are read
 * (withInputViews): each ConstRef (column-major) or RowConstRef (row-major), in place.
 */
template <typename In, typename Out, typename QView, typename KView, typename VView>
void forwardTiledKernel(const kernel::Tiled& kernel, const typename Identity<QView>::type& q,
                        const typename Identity<KView>::type& k, const typename Identity<VView>::type& v,
                        const BatchLayout& layout, const Heads& heads, const HeadDims& dims,
                        const HeadTaus<Accumulator<In>>& taus, const ErasedMask<Accumulator<In>>& mask,
                        const Dropout& dropout, Eigen::Ref<Matrix<Out>> out, Eigen::Ref<Matrix<Accumulator<In>>> lse,
                        RowStats* const* stats) {
  using Impl = forward_tiled_impl<In>;
  using Acc = Accumulator<In>;
  // Whether a block of `rows` rows against nK keys is decoding (the decoding path, which splits
  // its keys; a prefill block is a unit of its own).
  const auto decodes = [](Index rows, Index nK) { return Impl::template decodes<KView, VView>(rows, nK); };
  constexpr bool kColumnMajor =
      std::is_same_v<QView, ConstRef<In>> && std::is_same_v<KView, ConstRef<In>> && std::is_same_v<VView, ConstRef<In>>;
  if constexpr (!kColumnMajor) {
    if (dims.dK == 0 || dims.dV == 0) {  // no data to read in place: the column-major route
      forwardTiledKernel<In, Out, ConstRef<In>, ConstRef<In>, ConstRef<In>>(kernel, ConstRef<In>(q), ConstRef<In>(k),
                                                                            ConstRef<In>(v), layout, heads, dims, taus,
                                                                            mask, dropout, out, lse, stats);
      return;
    }
  }
  if (dims.dK == 0 || dims.dV == 0) {
    // A matrix without columns has no data, and an Eigen block of it at a row offset computes
    // null + offset (undefined behaviour). Run with one zero column instead: every logit is
    // tau 0 = 0 either way (scales are finite), and a zero value column feeds an output column
    // that is dropped. O(n H) extra memory, for these degenerate shapes only.
    Matrix<In> q1, k1, v1;
    Matrix<Out> out1;
    if (dims.dK == 0) {
      q1.setZero(q.rows(), heads.query);
      k1.setZero(k.rows(), heads.keyValue);
    }
    if (dims.dV == 0) {
      v1.setZero(v.rows(), heads.keyValue);
      out1.resize(out.rows(), heads.query);
    }
    forwardTiledKernel<In, Out, ConstRef<In>, ConstRef<In>, ConstRef<In>>(
        kernel, dims.dK == 0 ? ConstRef<In>(q1) : ConstRef<In>(q), dims.dK == 0 ? ConstRef<In>(k1) : ConstRef<In>(k),
        dims.dV == 0 ? ConstRef<In>(v1) : ConstRef<In>(v), layout, heads,
        HeadDims{std::max<Index>(dims.dK, 1), std::max<Index>(dims.dV, 1)}, taus, mask, dropout,
        dims.dV == 0 ? Eigen::Ref<Matrix<Out>>(out1) : out, lse, stats);
    return;
  }
  const TileSizes tile = tileSizes(kernel, dims.dK, dims.dV);

  // The call's plan, in the calling thread's containers: cleared, never shrunk, so that a call
  // allocates nothing once an earlier one on the thread was as large (allocation-free calls).
  struct Unit {
    Index pair, i0, rows, splits, firstPart;
  };
  struct Plan {
    std::vector<ItemHead> pairs;
    std::vector<Unit> units;
    std::vector<fast::LogitBounds> bounds;
    std::vector<fast::Bf16Head> bf16;
    std::vector<const float*> kF, vF;
    std::vector<Index> offset, owner, owners, unitOf, groupStart, groupItem, groupState;
    std::vector<OnlineSoftmax<Acc>> states;
    std::vector<char> done;
  };
  thread_local Plan plan;
  auto& pairs = plan.pairs;
  pairs.clear();
  forEachItemHead(layout, heads, [&](const ItemHead& u) { pairs.push_back(u); });
  // The fast prefill kernels (forward_fast.hpp), without dropout, for float and for bfloat16 or
  // half inputs (kernel.products: fp32 products of k and v converted once per call, or bf16
  // products of k and v packed in pairs once per call, on a CPU with AVX512_BF16). Per pair,
  // what the magnitudes of its q, k and tau allow (logitBounds: O(n d) once, against the pair's
  // O(n_q n_k d)).
  constexpr bool kFloat = std::is_same_v<In, float> && std::is_same_v<Out, float>;
  constexpr bool kHalf = (std::is_same_v<In, Eigen::bfloat16> ||
                          std::is_same_v<In, Eigen::half>)&&(std::is_same_v<Out, float> || std::is_same_v<Out, In>);
  const bool useFast = (kFloat || kHalf) && fast::available() && !dropout.enabled();
  const bool useBf16 =
      kHalf && useFast && kernel.products == kernel::Products::Bf16 && IsaChoice::current() >= Isa::Avx512Bf16;
  const bool useAmx = useBf16 && IsaChoice::current() == Isa::Amx;
  // Items of more queries than decoding takes (decodes) run every query block on the fast
  // kernel, the last short one too (with Products::Bf16, every row of the item then has bf16
  // products); the others are decoding, split over key ranges.
  const auto prefill = [&](const ItemHead& u) {
    return useFast && !decodes(u.nQ, u.nK) && !(stats && float(taus.tau(u.head)) == 0.0f);
  };
  const int threads = maxThreads();
  // The fp32 products' own block sizes, for prefill: the kernel takes a tile one lane group at a
  // time (forward_fast.hpp), so a large query block costs no L1 and saves packings of k and v
  // (each query block reads all of them): up to 1024 query rows (BM_ForwardBlocks, n 4096,
  // d 64..256, one thread: 1024 rows 2-4% above 512, 512 3-8% above 256). Fewer rows where the
  // threads' shares are evener so: each block's work (rows x keys its mask leaves, a partial
  // tile counted half) dealt in order to the thread free first, as parallelFor's dynamic schedule
  // does; the size whose last thread finishes first, ties to the larger (n_q 1024 on 2 threads:
  // 2 blocks of 512, not 1 of 1024).
  TileSizes fastTile = tile;
  if (useFast && !useBf16) {
    // A mask that hides leaves partial tiles along its edges, which cost more per entry (the mask
    // applied, the checked softmax) and cover bq / 2 keys of every row: at most 512 rows there
    // (causal n 4096, d 64, one thread: 1024 rows 0.56x the unmasked time, 512 0.545x).
    const Index largestQ = mask.none() ? 1024 : 512;
    // 256 keys per tile from d = 128 (n 4096, one thread: d 256 +2.5%, d 128 +1% over 128 keys).
    if (kernel.blockK <= 0) fastTile.k = std::max(dims.dK, dims.dV) >= 128 ? 256 : 128;
    if (kernel.blockQ <= 0 && threads > 1) {
      const auto makespan = [&](Index bq) {
        constexpr int kMaxThreads = 64;
        std::array<double, kMaxThreads> load{};
        const auto end = load.begin() + std::min(threads, kMaxThreads);
        // (In the order the units run: last first under a mask.)
        for (size_t p = pairs.size(); p-- > 0;) {
          const ItemHead& u = pairs[mask.none() ? pairs.size() - 1 - p : p];
          if (!prefill(u)) continue;
          const auto m = itemMask(mask, u);
          const Index blocks = (u.nQ + bq - 1) / bq;
          for (Index b = 0; b < blocks; ++b) {
            const Index i0 = (mask.none() ? b : blocks - 1 - b) * bq, rows = std::min(bq, u.nQ - i0);
            double keys = 0.0;
            for (Index j0 = 0; j0 < u.nK; j0 += fastTile.k) {
              const Index cols = std::min(fastTile.k, u.nK - j0);
              const mask::Tile t = m.classify(i0, rows, j0, cols, u.nQ, u.nK, u.head);
              keys += t == mask::Tile::Visible ? double(cols) : t == mask::Tile::Partial ? 0.5 * double(cols) : 0.0;
            }
            *std::min_element(load.begin(), end) += double(rows) * keys;
          }
        }
        return *std::max_element(load.begin(), end);
      };
      fastTile.q = largestQ;
      double best = makespan(fastTile.q);
      for (const Index bq : {512, 256}) {
        const double t = bq < largestQ ? makespan(bq) : best;
        if (t < best) fastTile.q = bq, best = t;
      }
    } else if (kernel.blockQ <= 0) {
      fastTile.q = largestQ;
    }
  }
  auto& units = plan.units;
  units.clear();
  Index parts = 0;
  for (Index p = 0; p < Index(pairs.size()); ++p) {
    const bool fastPair = prefill(pairs[size_t(p)]);
    const Index bq = fastPair ? fastTile.q : tile.q;
    for (Index i0 = 0; i0 < pairs[size_t(p)].nQ; i0 += bq) {
      const Index rows = std::min(bq, pairs[size_t(p)].nQ - i0);
      const Index splits = fastPair ? 1 : keySplits(decodes(rows, pairs[size_t(p)].nK), pairs[size_t(p)].nK, tile.k);
      units.push_back({p, i0, rows, splits, parts});
      parts += splits;
    }
  }

  // bf16 pairs never straddle two key tiles: an even tile length; the AMX products take blocks of
  // 32 keys.
  const Index bk = useAmx ? fast::amx::roundUp(tile.k, fast::amx::kKeys) : useBf16 ? tile.k + (tile.k & 1) : fastTile.k;
  auto& bounds = plan.bounds;
  // Half inputs: each (item, kv head)'s k and v once per call, as floats (kF, vF) or as bf16
  // pairs (bf16), at offsets in one buffer that the calling thread keeps from call to call
  // (fresh pages cost more than the conversion).
  auto& bf16 = plan.bf16;
  auto& kF = plan.kF;
  auto& vF = plan.vF;
  if (useFast) {
    bounds.resize(pairs.size());
    // A pass over each pair's q and k, on the call's threads (on one, 0.75-1.5% of a Heads{8}
    // prefill at n 4096, d 64, which a second thread otherwise waits out); on one where there
    // is too little to scan to pay for a parallel region.
    Index scanned = 0;
    for (const ItemHead& u : pairs) scanned += prefill(u) ? (u.nQ + u.nK) * dims.dK : 0;
    constexpr Index kParallelScan = Index(1) << 18;  // floats (1 MiB): tens of microseconds
    parallelFor(Index(pairs.size()), scanned >= kParallelScan ? threads : 1, [&](Index i) {
      const auto p = size_t(i);
      const ItemHead& u = pairs[p];
      // Decoding pairs take the general kernel, which needs no bound: a scan of their k (all of
      // it, against a few query rows) would cost more than the decoding itself.
      if (!prefill(u)) return;
      bounds[p] = fast::logitBounds(q.block(u.q0, u.head * dims.dK, u.nQ, dims.dK),
                                    k.block(u.k0, u.kvHead * dims.dK, u.nK, dims.dK), float(taus.tau(u.head)));
    });
    if constexpr (kHalf) {
      // The pairs that share an (item, kv head) share its conversion, done by the first of them.
      auto& offset = plan.offset;
      auto& owner = plan.owner;
      auto& owners = plan.owners;
      offset.assign(pairs.size(), -1);
      owner.resize(pairs.size());
      owners.clear();
      Index words = 0;
      for (size_t p = 0; p < pairs.size(); ++p) {
        const ItemHead& u = pairs[p];
        owner[p] = Index(p);
        for (size_t o = p; o-- > 0 && pairs[o].item == u.item;)
          if (pairs[o].kvHead == u.kvHead) owner[p] = owner[o];
        // Decoding items read k and v in place.
        if (owner[p] != Index(p) || !prefill(u)) continue;
        owners.push_back(Index(p));
        offset[p] = words;
        words += useBf16 ? fast::bf16HeadWords(u.nK, dims.dK, dims.dV, bk, useAmx) : u.nK * (dims.dK + dims.dV);
      }
      thread_local Buffer<std::uint32_t> packed;
      thread_local Buffer<float> converted;
      std::uint32_t* pairBase = useBf16 ? packed.get(words) : nullptr;
      float* floatBase = useBf16 ? nullptr : converted.get(words);
      bf16.resize(pairs.size());
      kF.resize(pairs.size());
      vF.resize(pairs.size());
      parallelFor(Index(owners.size()), threads, [&](Index i) {
        const size_t p = size_t(owners[size_t(i)]);
        const ItemHead& u = pairs[p];
        const auto kh = k.block(u.k0, u.kvHead * dims.dK, u.nK, dims.dK);
        const auto vh = v.block(u.k0, u.kvHead * dims.dV, u.nK, dims.dV);
        if (useBf16) {
          bf16[p] = fast::packBf16Head(kh, vh, bk, useAmx, pairBase + offset[p]);
        } else {
          float* f = floatBase + offset[p];
          fast::convertHead(kh, vh, f, f + u.nK * dims.dK);
          kF[p] = f;
          vF[p] = f + u.nK * dims.dK;
        }
      });
      for (size_t p = 0; p < pairs.size(); ++p) {
        bf16[p] = bf16[size_t(owner[p])];
        kF[p] = kF[size_t(owner[p])];
        vF[p] = vF[size_t(owner[p])];
      }
    }
  }
  const auto fastUnit = [&](const Unit& w) {
    if constexpr (kFloat || kHalf) {
      const ItemHead& u = pairs[size_t(w.pair)];
      if (!prefill(u)) return false;
      const float tau = float(taus.tau(u.head));
      const auto qh = q.block(u.q0, u.head * dims.dK, u.nQ, dims.dK);
      const auto kh = k.block(u.k0, u.kvHead * dims.dK, u.nK, dims.dK);
      const auto vh = v.block(u.k0, u.kvHead * dims.dV, u.nK, dims.dV);
      const auto o = out.block(u.q0 + w.i0, u.head * dims.dV, w.rows, dims.dV);
      const auto l = lse.col(u.head).segment(u.q0 + w.i0, w.rows);
      const auto m = itemMask(mask, u);
      const fast::LogitBounds& b = bounds[size_t(w.pair)];
      RowStats* rows = stats ? stats[u.head] + u.q0 + w.i0 : nullptr;
      if constexpr (kFloat) {
        fast::forwardBlock(qh, kh, vh, tau, foldsScaleIntoQuery(tau), b, m, u.head, w.i0, w.rows, bk, o, l, nullptr,
                           rows);
      } else if (useBf16) {
        fast::forwardBlock(qh, kh, vh, tau, false, b, m, u.head, w.i0, w.rows, bk, o, l, &bf16[size_t(w.pair)], rows);
      } else {
        const Eigen::Map<const Matrix<float>> kf(kF[size_t(w.pair)], u.nK, dims.dK),
            vf(vF[size_t(w.pair)], u.nK, dims.dV);
        fast::forwardBlock(qh, kf, vf, tau, foldsScaleIntoQuery(tau), b, m, u.head, w.i0, w.rows, bk, o, l, nullptr,
                           rows);
      }
      return true;
    } else {
      (void)w;
      return false;
    }
  };

  // Split s of a unit covers whole key tiles [s * per, (s + 1) * per) of the item.
  const auto splitBegin = [&](const Unit& w, Index split) {
    const ItemHead& u = pairs[size_t(w.pair)];
    const Index tilesK = (u.nK + tile.k - 1) / tile.k, per = (tilesK + w.splits - 1) / w.splits;
    return std::min(u.nK, split * per * tile.k);
  };
  // rows: the sink's streams of the unit's rows (sc.rows, or sc.partRows for a split merged after).
  const auto streamKeys = [&](const Unit& w, Index kBegin, Index kEnd, OnlineSoftmax<Acc>& state,
                              typename Impl::Scratch& sc, bool resume, std::vector<RowStream>* rows = nullptr) {
    const ItemHead& u = pairs[size_t(w.pair)];
    if (rows && !resume) rows->assign(size_t(w.rows), RowStream{});
    Impl::stream(q.block(u.q0, u.head * dims.dK, u.nQ, dims.dK), k.block(u.k0, u.kvHead * dims.dK, u.nK, dims.dK),
                 v.block(u.k0, u.kvHead * dims.dV, u.nK, dims.dV), taus.tau(u.head), itemMask(mask, u), dropout, u.head,
                 u.q0, u.k0, w.i0, w.rows, kBegin, kEnd, tile.k, state, sc, resume, rows ? rows->data() : nullptr);
  };
  const auto slice = [&](const Unit& w, Index split, OnlineSoftmax<Acc>& state, typename Impl::Scratch& sc,
                         std::vector<RowStream>* rows = nullptr) {
    streamKeys(w, splitBegin(w, split), splitBegin(w, split + 1), state, sc, false, rows);
  };
  const auto finish = [&](const Unit& w, OnlineSoftmax<Acc>& state) {
    const ItemHead& u = pairs[size_t(w.pair)];
    const auto l = lse.col(u.head).segment(u.q0 + w.i0, w.rows);
    state.finish(out.block(u.q0 + w.i0, u.head * dims.dV, w.rows, dims.dV), l);
    if (stats) {  // the unit's rows, streamed and merged by this thread (sc.rows)
      const Acc tau = taus.tau(u.head);
      const double rawTau = rawIsLogitOverTau(itemMask(mask, u), tau) ? double(tau) : 0.0;
      const auto& rows = Impl::threadScratch().rows;
      for (Index i = 0; i < w.rows; ++i)
        stats[u.head][u.q0 + w.i0 + i] = rows[size_t(i)].finish(double(l(i)), 1.0, rawTau);
    }
  };

  // Float k and v: the decoding units [first, first + members) (the same item and rows, so the
  // same splits and chunks; their kv heads in order) over split s, into states[0, members): the
  // group's products in one pass over each chunk (streamDecode, which stream() takes alone for
  // float), the same per head as alone. (Until session 42 k and v stored by keys ran each head
  // over the chunk in turn: with heads as column blocks of rows 4 KiB apart, each key a page of
  // its own, Heads{32, 8} took 4x Heads{8}.)
  const auto decodeGroupSplit = [&](Index first, Index members, Index s, OnlineSoftmax<Acc>* states,
                                    typename Impl::Scratch& sc) {
    if constexpr (std::is_same_v<In, float>) {
      const Unit& lead = units[size_t(first)];
      const ItemHead& lu = pairs[size_t(lead.pair)];
      const Index kvs = pairs[size_t(units[size_t(first + members - 1)].pair)].kvHead - lu.kvHead + 1;
      using QBlock = decltype(q.block(0, 0, 1, 1));
      thread_local std::vector<typename Impl::template Member<QBlock>> group;
      group.clear();
      for (Index m = 0; m < members; ++m) {
        const ItemHead& u = pairs[size_t(units[size_t(first + m)].pair)];
        group.push_back({q.block(u.q0, u.head * dims.dK, u.nQ, dims.dK), taus.tau(u.head), u.head, u.q0, u.k0,
                         states + m, nullptr, u.kvHead - lu.kvHead});
      }
      Impl::streamDecode(group.data(), members, k.block(lu.k0, lu.kvHead * dims.dK, lu.nK, kvs * dims.dK),
                         v.block(lu.k0, lu.kvHead * dims.dV, lu.nK, kvs * dims.dV), dims.dK, dims.dV,
                         itemMask(mask, lu), dropout, lead.i0, lead.rows, splitBegin(lead, s), splitBegin(lead, s + 1),
                         sc, false);
    } else {
      (void)first, (void)members, (void)s, (void)states, (void)sc;
    }
  };

  // (With a sink, always: each thread merges its units' splits, and their rows' streams.)
  if (Index(units.size()) >= threads || parts == Index(units.size()) || stats) {
    // Decoding units of the query heads that share a kv head (GQA, MQA) with the same rows form
    // a group that one thread runs chunk by chunk (decodeKeys: about 1 MiB of k and v), each
    // chunk for every head of the group in turn: the chunk is read from memory once and from L2
    // by the group's other heads, instead of streamed again per head. Each unit's arithmetic,
    // its chunks, splits and merge order are the same as alone: the same bits.
    auto& groupStart = plan.groupStart;
    groupStart.clear();
    // (Decoding: a few rows, which stream() alone also takes to streamDecode. On the portable
    // path a prefill unit is not `prefill` either, and grouped it would take streamDecode's
    // arithmetic instead of its own: other bits with a sink, or with another thread count.)
    const auto decoding = [&](const Unit& w) {
      const ItemHead& u = pairs[size_t(w.pair)];
      return !prefill(u) && decodes(w.rows, u.nK);
    };
    // Float k and v stored by keys: a group also takes the next kv heads, up to kvPerGroup (an
    // equal share of the item's kv heads per thread), and runs each chunk for each of them in
    // turn. A key's row holds every kv head's k (4 KiB for 8 heads of d 128, PyTorch's
    // [n, heads x d] layout): a head alone reads a slice of each row, a page of its own, which
    // the hardware prefetchers do not follow across pages; in turn over a chunk, the heads read
    // the chunk's pages together.
    // On several threads, where every unit is decoding, a group takes all of the item's kv heads
    // and the threads deal out its key splits instead (splitGroups): each reads whole rows where
    // threads with a share of the heads each would read a part of every row.
    constexpr bool kCrossKv =
        std::is_same_v<In, float> && !(ColumnsAre<KView>::contiguous && ColumnsAre<VView>::contiguous);
    const bool splitGroups = kCrossKv && threads > 1 && !stats &&
                             std::all_of(units.begin(), units.end(), [&](const Unit& w) { return decoding(w); });
    const Index kvPerGroup = !kCrossKv     ? 1
                             : splitGroups ? heads.keyValue
                                           : std::max<Index>(1, (heads.keyValue + threads - 1) / threads);
    Index groupKv = 0;  // kv heads in the current group
    for (Index i = 0; i < Index(units.size()); ++i) {
      const ItemHead& u = pairs[size_t(units[size_t(i)].pair)];
      bool newKv = true;
      const bool joins = i > 0 && decoding(units[size_t(i)]) && [&] {
        const Unit& prev = units[size_t(i - 1)];
        const ItemHead& p = pairs[size_t(prev.pair)];
        if (!decoding(prev) || p.item != u.item || prev.i0 != units[size_t(i)].i0) return false;
        newKv = p.kvHead != u.kvHead;
        return !newKv || groupKv < kvPerGroup;
      }();
      if (!joins) {  // (then newKv is true: a unit of the same kv head joins)
        groupStart.push_back(i);
        groupKv = 0;
      }
      groupKv += newKv ? 1 : 0;
    }
    const Index groups = Index(groupStart.size());
    if (splitGroups) {
      // Work items (group g, split s): items [groupItem[g], groupItem[g + 1]); member m's state of
      // split s at states[groupState[g] + s members + m], merged left to right after.
      groupStart.push_back(Index(units.size()));
      auto& groupItem = plan.groupItem;
      auto& groupState = plan.groupState;
      groupItem.assign(1, 0);
      groupState.assign(1, 0);
      for (Index g = 0; g < groups; ++g) {
        const Index members = groupStart[size_t(g) + 1] - groupStart[size_t(g)];
        const Index splits = units[size_t(groupStart[size_t(g)])].splits;
        groupItem.push_back(groupItem.back() + splits);
        groupState.push_back(groupState.back() + splits * members);
      }
      auto& states = plan.states;
      if (Index(states.size()) < groupState.back()) states.resize(size_t(groupState.back()));
      parallelFor(groupItem.back(), threads, [&](Index i) {
        const Index g = Index(std::upper_bound(groupItem.begin(), groupItem.end(), i) - groupItem.begin()) - 1;
        const Index s = i - groupItem[size_t(g)], first = groupStart[size_t(g)];
        const Index members = groupStart[size_t(g) + 1] - first;
        decodeGroupSplit(first, members, s, states.data() + groupState[size_t(g)] + s * members, Impl::threadScratch());
      });
      for (Index g = 0; g < groups; ++g) {
        const Index first = groupStart[size_t(g)], members = groupStart[size_t(g) + 1] - first;
        OnlineSoftmax<Acc>* st = states.data() + groupState[size_t(g)];
        for (Index m = 0; m < members; ++m) {
          for (Index s = 1; s < units[size_t(first)].splits; ++s) st[m].merge(st[s * members + m]);
          finish(units[size_t(first + m)], st[m]);
        }
      }
      return;
    }
    // Grouped only where the groups still give every thread work.
    const bool grouped = groups < Index(units.size()) && groups >= threads && !stats;
    if (grouped) groupStart.push_back(Index(units.size()));
    const bool latestFirst = !mask.none() && threads > 1;
    parallelFor(grouped ? groups : Index(units.size()), threads, [&](Index i) {
      auto& sc = Impl::threadScratch();
      if (!grouped || groupStart[size_t(i) + 1] - groupStart[size_t(i)] == 1) {
        // Masked calls deal their units last first: under a causal mask the later query blocks
        // see more keys, and the largest first evens the threads' shares (as fastTile assumed).
        const Index at = grouped ? groupStart[size_t(i)] : latestFirst ? Index(units.size()) - 1 - i : i;
        const Unit& w = units[size_t(at)];
        if (fastUnit(w)) return;
        // (Split s + 1 follows split s on this thread: each requests the next one's first keys.)
        sc.followOn = w.splits > 1;
        slice(w, 0, sc.state, sc, stats ? &sc.rows : nullptr);
        for (Index s = 1; s < w.splits; ++s) {
          sc.followOn = s + 1 < w.splits;
          slice(w, s, sc.part, sc, stats ? &sc.partRows : nullptr);
          sc.state.merge(sc.part);
          if (stats)
            for (Index i = 0; i < w.rows; ++i) sc.rows[size_t(i)].merge(sc.partRows[size_t(i)]);
        }
        finish(w, sc.state);
        return;
      }
      // group[m]: member m's state; group[members + m]: its current split, merged at the split's end.
      const Index first = groupStart[size_t(i)], members = groupStart[size_t(i) + 1] - first;
      if (Index(sc.group.size()) < 2 * members) sc.group.resize(size_t(2 * members));
      const Unit& lead = units[size_t(first)];  // the same rows and keys: the same splits, chunks
      const Index chunk = Impl::decodeKeys(dims.dK, dims.dV);
      for (Index s = 0; s < lead.splits; ++s) {
        const Index kBegin = splitBegin(lead, s), kEnd = splitBegin(lead, s + 1);
        if constexpr (std::is_same_v<In, float>) {
          sc.followOn = s + 1 < lead.splits;
          decodeGroupSplit(first, members, s, sc.group.data() + (s == 0 ? 0 : members), sc);
          sc.followOn = false;
        } else {
          Index j0 = kBegin;
          do {  // once for an empty split: its states start, empty
            const Index j1 = std::min(j0 + chunk, kEnd);
            for (Index m = 0; m < members; ++m)
              streamKeys(units[size_t(first + m)], j0, j1, sc.group[size_t(s == 0 ? m : members + m)], sc,
                         j0 != kBegin);
            j0 = j1;
          } while (j0 < kEnd);
        }
        if (s > 0)
          for (Index m = 0; m < members; ++m) sc.group[size_t(m)].merge(sc.group[size_t(members + m)]);
      }
      for (Index m = 0; m < members; ++m) finish(units[size_t(first + m)], sc.group[size_t(m)]);
    });
    return;
  }
  // Few units: every split of every unit is a work item of its own.
  auto& states = plan.states;
  if (states.size() < size_t(parts)) states.resize(size_t(parts));
  auto& unitOf = plan.unitOf;
  unitOf.resize(size_t(parts));
  for (size_t w = 0; w < units.size(); ++w)
    for (Index s = 0; s < units[w].splits; ++s) unitOf[size_t(units[w].firstPart + s)] = Index(w);
  // (A prefill unit among them takes the fast kernel here as in the loop above: which kernel
  // computes a row never depends on the thread count.)
  auto& done = plan.done;
  done.assign(units.size(), 0);
  parallelFor(parts, threads, [&](Index i) {
    const Index u = unitOf[size_t(i)];
    const Unit& w = units[size_t(u)];
    if (w.splits == 1 && fastUnit(w)) {
      done[size_t(u)] = 1;
      return;
    }
    slice(w, i - w.firstPart, states[size_t(i)], Impl::threadScratch());
  });
  for (size_t u = 0; u < units.size(); ++u) {
    if (done[u]) continue;
    const Unit& w = units[u];
    for (Index s = 1; s < w.splits; ++s) states[size_t(w.firstPart)].merge(states[size_t(w.firstPart + s)]);
    finish(w, states[size_t(w.firstPart)]);
  }
}

/// forwardTiledKernel (above) with any mask: the kernel is compiled once per precision and input
/// layout, each mask type adds only its ErasedMask table.
template <typename In, typename Out, typename QView = ConstRef<In>, typename KView = QView, typename VView = KView,
          typename Mask>
void forwardTiled(const kernel::Tiled& kernel, const typename Identity<QView>::type& q,
                  const typename Identity<KView>::type& k, const typename Identity<VView>::type& v,
                  const BatchLayout& layout, const Heads& heads, const HeadDims& dims,
                  const HeadTaus<Accumulator<In>>& taus, const Mask& mask, const Dropout& dropout,
                  Eigen::Ref<Matrix<Out>> out, Eigen::Ref<Matrix<Accumulator<In>>> lse,
                  RowStats* const* stats = nullptr) {
  forwardTiledKernel<In, Out, QView, KView, VView>(kernel, q, k, v, layout, heads, dims, taus,
                                                   ErasedMask<Accumulator<In>>(mask), dropout, out, lse, stats);
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_FORWARD_TILED_HPP
