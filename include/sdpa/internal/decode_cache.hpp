#ifndef SDPA_INTERNAL_DECODE_CACHE_HPP
#define SDPA_INTERNAL_DECODE_CACHE_HPP

// The decoding kernel of a KvCache: a few query rows against keys stored in pieces (a
// contiguous cache is one piece, a ring two, a paged sequence one per block, a quantised cache
// its groups and a float tail), read in place. Each kv head's keys stream once for all the query
// heads of its GQA group and all the query rows of a block, chunk by chunk; masks see logical
// positions; key ranges split over threads by the shape alone and merge by logSumExp in order,
// so that results do not depend on the thread count.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../layout.hpp"
#include "../mask.hpp"
#include "decode_pieces.hpp"
#include "decode_rows.hpp"
#include "erased_mask.hpp"
#include "forward_tiled.hpp"
#include "kv_quant.hpp"
#include "online_softmax.hpp"
#include "parallel.hpp"

namespace sdpa::internal::cache {

/**
 * cachedAttention's kernel for storage `Storage` (float, double, Eigen::half, Eigen::bfloat16,
 * kv::Q8, kv::Q4): q (n_q x H d_k, Acc) against one sequence, out (n_q x H d_v), lse (n_q x H).
 * Work items are (kv head, block of query rows, key split); an item computes the rows of every
 * query head of the kv head's group in one pass over each chunk of keys.
 */
template <typename Storage>
struct decode_cache_impl {
  static constexpr bool kQuantised = quant::IsQuantised<Storage>;
  /// The element type of float-like pieces (a quantised cache's tail is float).
  using Plain = std::conditional_t<kQuantised, float, Storage>;
  using Acc = Accumulator<Plain>;
  using TileMap = Eigen::Map<RowMajorMatrix<Acc>>;

  /// Query rows per block: decoding (one token, or the few of speculative decoding) is one block.
  static constexpr Index kRowBlock = 16;

  /// Keys per chunk: k and v of a chunk take about 512 KiB (float storage: 1 MiB), in L2 while
  /// the group's rows read it; a multiple of 32 (whole quantised groups). Float's kernels read a
  /// chunk's columns 8 at a time, each a run of the chunk's keys left to the hardware prefetcher:
  /// at d 128, runs of 1024 keys (4 KiB) rather than 512 read one token's K/V at 0.80-0.88 of
  /// the read probe's bandwidth against 0.59-0.63 on an AMD EPYC (session 24; 8 heads and 1-16
  /// query rows gained too). Half and quantised storage (software-prefetched, or read group by
  /// group) did not gain.
  static Index chunkKeys(Index dK, Index dV) {
    double perKey, bytes = double(Index(1) << 19);
    if constexpr (kQuantised) {
      perKey = double(quant::groupBytes<Storage, true>(dK) + quant::groupBytes<Storage>(dV)) / double(quant::kGroup);
    } else {
      perKey = double((dK + dV) * Index(sizeof(Plain)));
      if constexpr (std::is_same_v<Plain, float>) bytes *= 2;
    }
    return std::clamp<Index>(Index(bytes / perKey) / 32 * 32, 256, 8192);
  }

  struct Chunk {
    Index first, last;  // pieces [first, last) of the plan's cut pieces
    Index pos, keys;
  };

  struct Scratch {
    Buffer<Acc> qs, s, dots, kf, vf, as, acc;
    std::vector<const Acc*> rowsA;
    std::vector<Acc*> rowsS, rowsD, rowsO;
    std::vector<const unsigned char*> groups;
    std::vector<FloatSpan> spans;
    std::vector<const Plain*> pieces;  // logits(): a run of short pieces' keys
    std::vector<char> active;
    ChunkPrefetch prefetch;
  };
  static Scratch& threadScratch() {
    thread_local Scratch scratch;
    return scratch;
  }

  struct Plan {
    std::vector<Piece> cut;
    std::vector<Chunk> chunks;
    std::vector<OnlineSoftmax<Acc>> states;
  };

  /// Cuts the pieces into chunks of at most chunkKeys keys (a quantised piece at group bounds).
  static void makeChunks(const std::vector<Piece>& pieces, Index dK, Index dV, Plan& plan) {
    const Index limit = chunkKeys(dK, dV);
    plan.cut.clear();
    plan.chunks.clear();
    Index used = limit;  // keys in the open chunk; none open yet
    for (const Piece& whole : pieces) {
      Piece p = whole;
      while (p.count > 0) {
        if (used == limit) {
          plan.chunks.push_back({Index(plan.cut.size()), Index(plan.cut.size()), p.pos, 0});
          used = 0;
        }
        const Index take = std::min(p.count, limit - used);
        Piece head = p;
        head.count = take;
        plan.cut.push_back(head);
        Chunk& c = plan.chunks.back();
        c.last = Index(plan.cut.size());
        c.keys += take;
        used += take;
        p.pos += take;
        p.count -= take;
        if constexpr (kQuantised) {
          if (p.quantised) {
            p.k += take / quant::kGroup * quant::groupBytes<Storage, true>(dK);
            p.v += take / quant::kGroup * quant::groupBytes<Storage>(dV);
            continue;
          }
        }
        p.k += take * Index(sizeof(Plain));
        p.v += take * Index(sizeof(Plain));
      }
    }
  }

  /// Key splits: by the chunk count alone (never the thread count), at most 8.
  static Index splitsOf(Index chunks) { return std::clamp<Index>(chunks / 2, 1, 8); }

  /// run with any mask: the kernel below is compiled once per storage, not once per mask type.
  template <typename Mask>
  static void run(const ConstRef<Acc>& q, const SequenceView& seq, const Heads& heads, Index dK, Index dV,
                  const HeadTaus<Acc>& taus, const Mask& mask, Eigen::Ref<Matrix<Acc>> out,
                  Eigen::Ref<Matrix<Acc>> lse) {
    run(q, seq, heads, dK, dV, taus, ErasedMask<Acc>(mask), out, lse);
  }
  static void run(const ConstRef<Acc>& q, const SequenceView& seq, const Heads& heads, Index dK, Index dV,
                  const HeadTaus<Acc>& taus, const ErasedMask<Acc>& mask, Eigen::Ref<Matrix<Acc>> out,
                  Eigen::Ref<Matrix<Acc>> lse) {
    // The calling thread's plan (a reference: the workers' own thread_local would be empty).
    thread_local Plan callerPlan;
    Plan& plan = callerPlan;
    makeChunks(*seq.pieces, dK, dV, plan);
    const Index nQ = q.rows(), G = heads.groupSize(), nChunks = Index(plan.chunks.size());
    const Index blocks = (nQ + kRowBlock - 1) / kRowBlock, S = splitsOf(nChunks);
    const Index items = heads.keyValue * blocks * S;
    if (Index(plan.states.size()) < items * G) plan.states.resize(size_t(items * G));
    const auto state = [&](Index h, Index b, Index s, Index m) -> OnlineSoftmax<Acc>& {
      return plan.states[size_t(((h * blocks + b) * S + s) * G + m)];
    };
    const Index perSplit = (nChunks + S - 1) / S;
    parallelFor(items, maxThreads(), [&](Index item) {
      const Index s = item % S, b = item / S % blocks, h = item / S / blocks;
      const Index i0 = b * kRowBlock, bq = std::min(kRowBlock, nQ - i0);
      for (Index m = 0; m < G; ++m) state(h, b, s, m).start(bq, dV);
      const Index c0 = std::min(nChunks, s * perSplit), c1 = std::min(nChunks, (s + 1) * perSplit);
      block(q, seq, plan, c0, c1, h, G, i0, bq, dK, dV, taus, mask,
            [&](Index m) -> OnlineSoftmax<Acc>& { return state(h, b, s, m); });
    });
    for (Index h = 0; h < heads.keyValue; ++h)
      for (Index b = 0; b < blocks; ++b)
        for (Index m = 0; m < G; ++m) {
          auto& st = state(h, b, 0, m);
          for (Index s = 1; s < S; ++s) st.merge(state(h, b, s, m));
          const Index hq = h * G + m, i0 = b * kRowBlock, bq = std::min(kRowBlock, nQ - i0);
          st.finish(out.block(i0, hq * dV, bq, dV), lse.col(hq).segment(i0, bq));
        }
  }

  /// Rows [i0, i0 + bq) of the query heads of kv head h against chunks [c0, c1).
  template <typename States>
  static void block(const ConstRef<Acc>& q, const SequenceView& seq, const Plan& plan, Index c0, Index c1, Index h,
                    Index G, Index i0, Index bq, Index dK, Index dV, const HeadTaus<Acc>& taus,
                    const ErasedMask<Acc>& mask, States&& stateOf) {
    Scratch& sc = threadScratch();
    const Index nQ = q.rows(), L = seq.length, R = G * bq;
    const Index limit = chunkKeys(dK, dV);
    Acc* qs = sc.qs.get(R * dK);
    Acc* sAll = sc.s.get(R * limit);
    Acc* dots = sc.dots.get(R * dV);
    sc.rowsA.resize(size_t(R));
    sc.rowsS.resize(size_t(R));
    sc.rowsD.resize(size_t(R));
    sc.rowsO.resize(size_t(R));
    sc.active.resize(size_t(G));
    // qs: member m's rows (query head h G + m) from row m bq, tau folded in where it may be.
    for (Index m = 0; m < G; ++m) {
      const Index hq = h * G + m;
      const Acc tau = taus.tau(hq);
      const bool fold = foldsScaleIntoQuery(tau);
      for (Index i = 0; i < bq; ++i)
        for (Index c = 0; c < dK; ++c) {
          const Acc x = q(i0 + i, hq * dK + c);
          qs[(m * bq + i) * dK + c] = fold ? tau * x : x;
        }
    }
    for (Index ci = c0; ci < c1; ++ci) {
      const Chunk& chunk = plan.chunks[size_t(ci)];
      const Index n = chunk.keys;
      Index Ra = 0;
      for (Index m = 0; m < G; ++m) {
        const mask::Tile t = mask.none() ? mask::Tile::Visible : mask.classify(i0, bq, chunk.pos, n, nQ, L, h * G + m);
        sc.active[size_t(m)] = static_cast<char>(t == mask::Tile::Hidden ? 0 : t == mask::Tile::Partial ? 2 : 1);
        if (t == mask::Tile::Hidden) continue;
        for (Index i = 0; i < bq; ++i, ++Ra) {
          Acc* row = sAll + (m * bq + i) * n;
          std::fill(row, row + n, Acc(0));
          sc.rowsA[size_t(Ra)] = qs + (m * bq + i) * dK;
          sc.rowsS[size_t(Ra)] = row;
        }
      }
      if (Ra == 0) continue;
      // The products are matrix-vector kernels for any row count (up to kRowBlock per head,
      // times the group): a row's arithmetic is its own, so a row gets the same bits whatever
      // other rows share the call over the same keys. From 8 rows on the products outlast the
      // chunk's memory stream, so the next chunk is prefetched meanwhile, where software
      // requests pay (ChunkPrefetch).
      sc.prefetch.clear();
      if (Ra >= 8 && ci + 1 < c1 && CpuVendor::chunkRequests())
        nextChunk(plan, plan.chunks[size_t(ci + 1)], n, h, Ra, dK, dV, sc.prefetch);
      logits(plan, chunk, h, Ra, dK, sc);
      // A ring's oldest group may start before the first position it still holds.
      if (chunk.pos < seq.first) {
        const Index hide = std::min(n, seq.first - chunk.pos);
        for (Index r = 0; r < Ra; ++r) std::fill(sc.rowsS[size_t(r)], sc.rowsS[size_t(r)] + hide, -kInf);
      }
      Ra = 0;
      for (Index m = 0; m < G; ++m) {
        if (!sc.active[size_t(m)]) continue;
        const Index hq = h * G + m;
        TileMap s(sAll + m * bq * n, bq, n);
        const Acc tau = taus.tau(hq);
        if (!foldsScaleIntoQuery(tau)) s *= tau;
        if (sc.active[size_t(m)] == 2) mask.apply(s, i0, chunk.pos, nQ, L, hq);
        stateOf(m).absorb(s);
        for (Index i = 0; i < bq; ++i, ++Ra) {
          sc.rowsA[size_t(Ra)] = &s(i, 0);
          sc.rowsD[size_t(Ra)] = dots + (m * bq + i) * dV;
        }
      }
      values(plan, chunk, h, Ra, dV, sc);
      for (Index m = 0; m < G; ++m) {
        if (!sc.active[size_t(m)]) continue;
        auto acc = stateOf(m).acc();
        for (Index i = 0; i < bq; ++i) {
          const Acc* p = sAll + (m * bq + i) * n;
          const Acc* d = dots + (m * bq + i) * dV;
          for (Index c = 0; c < dV; ++c)
            acc(i, c) += std::isfinite(d[c]) ? d[c] : dotSkippingZeros(plan, chunk, h, p, c, dV);
        }
      }
    }
  }

  /// The next chunk's float-like keys and values of kv head h into `pf`, spread over the calls
  /// of its step that R rows make in the wide kernels over the current chunk's n keys (one per
  /// key packet and key column, one per key packet and group of value columns).
  static void nextChunk(const Plan& plan, const Chunk& next, Index n, Index h, Index R, Index dK, Index dV,
                        ChunkPrefetch& pf) {
    if constexpr (!kQuantised && !std::is_same_v<Plain, double>) {
      for (Index t = next.first; t < next.last; ++t) {
        const Piece& p = plan.cut[size_t(t)];
        const Plain *k = at<Plain>(p.k, p.kHead, h), *v = at<Plain>(p.v, p.vHead, h);
        for (Index c = 0; c < dK; ++c) pf.add(k + c * p.ld, p.count * Index(sizeof(Plain)));
        for (Index c = 0; c < dV; ++c) pf.add(v + c * p.ld, p.count * Index(sizeof(Plain)));
      }
      withDecodeSimd([&](auto simd) { pf.spreadOver(wideSteps(simd, R, n, dK, dV)); });
    }
  }

  static constexpr Acc kInf = std::numeric_limits<Acc>::infinity();
  /// Pieces of fewer keys on average are short (valuesShortSpans); the fused half kernels need
  /// runs of at least kFusedRun keys (their loops take 32 keys at a time).
  static constexpr Index kShortSpan = 64, kFusedRun = 256;

  static bool fusedHalf(const Plan& plan, const Chunk& chunk) {
    for (Index t = chunk.first; t < chunk.last; ++t)
      if (plan.cut[size_t(t)].count < kFusedRun && chunk.last - chunk.first > 1) return false;
    return true;
  }
  /// The column kernels' path for a chunk of half storage in long pieces; None otherwise (other
  /// storage, short pieces, a CPU without F16C).
  static half_columns::Path halfColumns(const Plan& plan, const Chunk& chunk) {
    if constexpr (IsHalfScalar<Plain>) {
      const auto path = half_columns::path();
      if (path != half_columns::Path::None && fusedHalf(plan, chunk)) return path;
    }
    return half_columns::Path::None;
  }

  template <typename T>
  static const T* at(const unsigned char* base, Index headBytes, Index h) {
    return reinterpret_cast<const T*>(base + h * headBytes);
  }

  /// The chunk's quantised groups of kv head h's keys (or values), in key order, into sc.groups;
  /// returns the keys they hold (the offset of the chunk's float tail).
  template <bool Keys>
  static Index gatherGroups(const Plan& plan, const Chunk& chunk, Index h, Index d, Scratch& sc) {
    sc.groups.clear();
    Index keys = 0;
    for (Index t = chunk.first; t < chunk.last; ++t) {
      const Piece& p = plan.cut[size_t(t)];
      if (!p.quantised) continue;
      const unsigned char* g0 = Keys ? p.k + h * p.kHead : p.v + h * p.vHead;
      for (Index g = 0; g < p.count / quant::kGroup; ++g)
        sc.groups.push_back(g0 + g * quant::groupBytes<Storage, Keys>(d));
      keys += p.count;
    }
    return keys;
  }

  /// s rows (sc.rowsA's queries, sc.rowsS's logits) += q k^T over the chunk's keys.
  static void logits(const Plan& plan, const Chunk& chunk, Index h, Index R, Index dK, Scratch& sc) {
    Index offset = 0;
    if constexpr (kQuantised) {
      offset = gatherGroups<true>(plan, chunk, h, dK, sc);
      if (!sc.groups.empty())
        quant::logitsGroups<Storage>(sc.rowsA.data(), R, sc.groups.data(), Index(sc.groups.size()), dK, sc.rowsS.data(),
                                     sc.as.get(quant::logitsScratch(R, dK)));
    }
    for (Index t = chunk.first; t < chunk.last; ++t) {
      const Piece& p = plan.cut[size_t(t)];
      if (p.quantised) continue;
      for (Index r = 0; r < R; ++r) sc.rowsO[size_t(r)] = sc.rowsS[size_t(r)] + offset;
      const Plain* k = at<Plain>(p.k, p.kHead, h);
      if constexpr (!std::is_same_v<Plain, double>) {
        // Pieces alike (a paged sequence's blocks), several at once: short ones without requests
        // ahead, each one's logits too short a chain of multiply-adds to fill the FMA units
        // (shortRun); long ones on first-generation Zen column by column, each one's stream beside
        // the others' (longRun).
        const Index shortPieces = shortRun(plan, chunk, t, R);
        const Index run = shortPieces > 1 ? shortPieces : longRun(plan, chunk, t, R);
        if (run > 1) {
          sc.pieces.clear();
          for (Index u = t; u < t + run; ++u) {
            const Piece& pu = plan.cut[size_t(u)];
            sc.pieces.push_back(at<Plain>(pu.k, pu.kHead, h));
          }
          bool done = false;  // (a portable instance without half loads: piece by piece, below)
          withDecodeSimd([&](auto simd) {
            if constexpr (std::is_same_v<Plain, float> || decltype(simd)::kHalfLoads) {
              if (shortPieces > 1)
                cacheShortLogits(simd, sc.rowsA.data(), R, sc.pieces.data(), run, p.ld, p.count, dK, sc.rowsO.data());
              else
                cacheLongLogits(simd, sc.rowsA.data(), R, sc.pieces.data(), run, p.ld, p.count, dK, sc.rowsO.data());
              done = true;
            }
          });
          if (done) {
            offset += run * p.count;
            t += run - 1;
            continue;
          }
        }
      }
      ColumnsAhead ahead;
      if constexpr (!std::is_same_v<Plain, double>) {
        // Short pieces (paged blocks of up to 64 keys, a few KiB each in pages of their own, where
        // the hardware prefetcher stops): the keys of the piece after next requested a column at
        // a time as the kernel reads this piece's (ColumnsAhead). Longer pieces gain nothing.
        if (p.count <= ColumnsAhead::kKeys && t + 2 < chunk.last && sc.prefetch.runs.empty()) {
          const Piece& n2 = plan.cut[size_t(t + 2)];
          if (!n2.quantised) ahead = ColumnsAhead(at<Plain>(n2.k, n2.kHead, h), n2.ld, n2.count);
        }
      }
      if constexpr (std::is_same_v<Plain, double>) {
        const Eigen::Map<const Matrix<double>, 0, Eigen::OuterStride<>> km(k, p.count, dK, Eigen::OuterStride<>(p.ld));
        for (Index r = 0; r < R; ++r)
          Eigen::Map<Vector<double>>(sc.rowsO[size_t(r)], p.count).noalias() +=
              km * Eigen::Map<const Vector<double>>(sc.rowsA[size_t(r)], dK);
      } else if (const auto path = halfColumns(plan, chunk); path != half_columns::Path::None && R < 5) {
        // Long half pieces: widened in registers (AVX2 or AVX-512, at run time), 8 columns per
        // pass over a row of logits, with prefetching; float's kernel's bits. From 5 rows on
        // cacheLogits' wide blocks (below) take them, with the same bits: each packet of keys
        // widened once for up to 8 rows, the partial sums over 32 columns in registers where
        // these load and store them every 8 columns and widen each packet once per 4 rows (from
        // 8 until session 38: 5-7 rows took two passes, 5 rows 1.05-1.1x slower).
        if constexpr (IsHalfScalar<Plain>)
          half_columns::axpyAllRows(path, sc.rowsA.data(), R, k, p.ld, dK, sc.rowsO.data(), p.count);
      } else if constexpr (std::is_same_v<Plain, float>) {
        withDecodeSimd([&](auto simd) {
          cacheLogits(simd, sc.rowsA.data(), R, k, p.ld, dK, p.count, sc.rowsO.data(), sc.prefetch, ahead);
        });
      } else {
        withDecodeSimd([&](auto simd) {
          if constexpr (decltype(simd)::kHalfLoads) {
            // Short half pieces widened in registers: in place.
            cacheLogits(simd, sc.rowsA.data(), R, k, p.ld, dK, p.count, sc.rowsO.data(), sc.prefetch, ahead);
          } else {
            ahead.all(dK);
            // Short half pieces on a portable build without half loads: the piece's columns
            // converted into L1/L2 (halfToFloat), then float's kernel.
            float* kf = sc.kf.get(p.count * dK);
            for (Index c = 0; c < dK; ++c) halfToFloat(k + c * p.ld, kf + c * p.count, p.count);
            cacheLogits(simd, sc.rowsA.data(), R, kf, p.count, dK, p.count, sc.rowsO.data(), sc.prefetch);
          }
        });
      }
      offset += p.count;
    }
  }

  /// The pieces from t on that logits() reads together (cacheShortLogits): float-like pieces of
  /// at most ColumnsAhead::kKeys keys, the same count and stride, for at most 4 rows, where no
  /// piece's successor is requested (CpuVendor::groupedPieceKeys: Intel's order, first-generation
  /// Zen's shortest pieces) and the half column kernels do not take the chunk; 1 otherwise.
  static Index shortRun(const Plan& plan, const Chunk& chunk, Index t, Index R) {
    if constexpr (std::is_same_v<Plain, double>) {
      return 1;
    } else {
      const Piece& p = plan.cut[size_t(t)];
      if (R > 4 || p.count > ColumnsAhead::kKeys || p.count > CpuVendor::groupedPieceKeys() ||
          halfColumns(plan, chunk) != half_columns::Path::None)
        return 1;
      Index u = t + 1;
      while (u < chunk.last && !plan.cut[size_t(u)].quantised && plan.cut[size_t(u)].count == p.count &&
             plan.cut[size_t(u)].ld == p.ld)
        ++u;
      return u - t;
    }
  }

  /// The float-like pieces from t on that logits() reads together column by column
  /// (cacheLongLogits): longer than shortRun's (CpuVendor::groupedPieceKeys), columns close, the
  /// same count and stride, at most CpuVendor::longPiecesAtOnce of them, for at most 4 rows, where
  /// the half column kernels do not take the chunk; 1 otherwise.
  static Index longRun(const Plan& plan, const Chunk& chunk, Index t, Index R) {
    const Piece& p = plan.cut[size_t(t)];
    const Index most = CpuVendor::longPiecesAtOnce();
    if (most < 2 || R > 4 || p.count <= CpuVendor::groupedPieceKeys() || !columnsClose<Plain>(p.ld) ||
        halfColumns(plan, chunk) != half_columns::Path::None)
      return 1;
    Index u = t + 1;
    while (u < chunk.last && u - t < most && !plan.cut[size_t(u)].quantised && plan.cut[size_t(u)].count == p.count &&
           plan.cut[size_t(u)].ld == p.ld)
      ++u;
    return u - t;
  }

  /// dots rows (sc.rowsD) = weights (sc.rowsA) . v over the chunk's keys.
  static void values(const Plan& plan, const Chunk& chunk, Index h, Index R, Index dV, Scratch& sc) {
    Index offset = 0;
    bool any = false;
    if constexpr (kQuantised) {
      offset = gatherGroups<false>(plan, chunk, h, dV, sc);
      if (!sc.groups.empty()) {
        quant::valuesGroups<Storage>(sc.rowsA.data(), R, sc.groups.data(), Index(sc.groups.size()), dV,
                                     sc.rowsD.data());
        any = true;
      }
    }
    if constexpr (std::is_same_v<Plain, double>) {
      for (Index r = 0; r < R; ++r) Eigen::Map<Vector<double>>(sc.rowsD[size_t(r)], dV).setZero();
      for (Index t = chunk.first; t < chunk.last; ++t) {
        const Piece& p = plan.cut[size_t(t)];
        const Eigen::Map<const Matrix<double>, 0, Eigen::OuterStride<>> vm(at<double>(p.v, p.vHead, h), p.count, dV,
                                                                           Eigen::OuterStride<>(p.ld));
        for (Index r = 0; r < R; ++r)
          Eigen::Map<Vector<double>>(sc.rowsD[size_t(r)], dV).transpose().noalias() +=
              Eigen::Map<const Vector<double>>(sc.rowsA[size_t(r)] + offset, p.count).transpose() * vm;
        offset += p.count;
      }
    } else {
      if constexpr (IsHalfScalar<Plain>) {
        if (const auto path = halfColumns(plan, chunk); path != half_columns::Path::None) {
          // Half storage widened in registers: each piece's dots, 8 columns per pass over the weights.
          float* part = sc.vf.get(R * dV);
          for (Index r = 0; r < R; ++r) {  // rowsO (the logits' rows, free by now): each row's part
            std::fill(sc.rowsD[size_t(r)], sc.rowsD[size_t(r)] + dV, 0.0f);
            sc.rowsO[size_t(r)] = part + r * dV;
          }
          for (Index t = chunk.first; t < chunk.last; ++t) {
            const Piece& p = plan.cut[size_t(t)];
            const Plain* v = at<Plain>(p.v, p.vHead, h);
            half_columns::dotAllRows(path, sc.rowsA.data(), offset, R, v, p.ld, dV, p.count, sc.rowsO.data());
            for (Index r = 0; r < R; ++r)
              for (Index c = 0; c < dV; ++c) sc.rowsD[size_t(r)][c] += part[r * dV + c];
            offset += p.count;
          }
          return;
        }
      }
      withDecodeSimd([&](auto simd) { floatValues(simd, plan, chunk, h, R, dV, offset, any, sc); });
    }
  }

  /// values() for float storage (and half: short pieces, or a CPU without the column kernels,
  /// or a quantised cache's float tail) on the decoding kernels' instance simd, from key `offset`
  /// of the chunk's logits (past its quantised groups, whose dots are in sc.rowsD where `any`).
  template <typename Simd>
  static void floatValues(Simd simd, const Plan& plan, const Chunk& chunk, Index h, Index R, Index dV, Index offset,
                          bool any, Scratch& sc) {
    constexpr Index W = Simd::kLanes;
    if constexpr (IsHalfScalar<Plain> && Simd::kHalfLoads) {
      // Short pieces: read in place, widened in registers.
      thread_local std::vector<SpanOf<Plain>> spans;
      spans.clear();
      for (Index t = chunk.first; t < chunk.last; ++t) {
        const Piece& p = plan.cut[size_t(t)];
        spans.push_back({at<Plain>(p.v, p.vHead, h), p.ld, p.count, offset});
        offset += p.count;
      }
      cacheShortValues(simd, sc.rowsA.data(), R, spans.data(), Index(spans.size()), dV, sc.rowsD.data(),
                       sc.acc.get(R * dV * W), sc.kf.get(R * dV));
      return;
    }
    // Float spans: the pieces themselves, or (half storage) the chunk's values converted.
    sc.spans.clear();
    const Index first = offset;
    Index tailKeys = 0;
    for (Index t = chunk.first; t < chunk.last; ++t)
      if (!plan.cut[size_t(t)].quantised) tailKeys += plan.cut[size_t(t)].count;
    float* vf = std::is_same_v<Plain, float> ? nullptr : sc.vf.get(tailKeys * dV);
    for (Index t = chunk.first; t < chunk.last; ++t) {
      const Piece& p = plan.cut[size_t(t)];
      if (p.quantised) continue;
      const Plain* v = at<Plain>(p.v, p.vHead, h);
      if constexpr (std::is_same_v<Plain, float>) {
        sc.spans.push_back({v, p.ld, p.count, offset});
      } else {
        float* dst = vf + (offset - first);
        for (Index c = 0; c < dV; ++c) halfToFloat(v + c * p.ld, dst + c * tailKeys, p.count);
      }
      offset += p.count;
    }
    if constexpr (!std::is_same_v<Plain, float>) {
      if (tailKeys > 0) sc.spans.push_back({vf, tailKeys, tailKeys, first});
    }
    if (sc.spans.empty()) {
      if (!any)
        for (Index r = 0; r < R; ++r) std::fill(sc.rowsD[size_t(r)], sc.rowsD[size_t(r)] + dV, 0.0f);
      return;
    }
    if (!any) {
      const Index spans = Index(sc.spans.size());
      bool close = true;
      for (const FloatSpan& sp : sc.spans) close = close && columnsClose<float>(sp.ld);
      if (close || (spans > 1 && chunk.keys < kShortSpan * spans))
        cacheShortValues(simd, sc.rowsA.data(), R, sc.spans.data(), spans, dV, sc.rowsD.data(), sc.acc.get(R * dV * W),
                         sc.kf.get(R * dV));
      else
        cacheValues(simd, sc.rowsA.data(), R, sc.spans.data(), spans, dV, sc.rowsD.data(), sc.prefetch);
    } else {
      // A quantised chunk's float tail: added to the groups' dots.
      float* extra = sc.kf.get(R * dV);
      for (Index r = 0; r < R; ++r) sc.rowsO[size_t(r)] = extra + r * dV;
      cacheValues(simd, sc.rowsA.data(), R, sc.spans.data(), Index(sc.spans.size()), dV, sc.rowsO.data(), sc.prefetch);
      for (Index r = 0; r < R; ++r)
        for (Index c = 0; c < dV; ++c) sc.rowsD[size_t(r)][c] += extra[r * dV + c];
    }
  }

  /// sum_j p_j v_jc over the chunk's keys with p_j != 0: a value of weight 0 has no effect even
  /// if it is NaN or inf (only a dot that came out non-finite pays for this scalar pass).
  static Acc dotSkippingZeros(const Plan& plan, const Chunk& chunk, Index h, const Acc* p, Index c, Index dV) {
    Acc sum = 0;
    Index offset = 0;
    for (Index t = chunk.first; t < chunk.last; ++t) {
      const Piece& piece = plan.cut[size_t(t)];
      for (Index j = 0; j < piece.count; ++j) {
        const Acc w = p[offset + j];
        if (w == Acc(0)) continue;
        Acc x;
        if constexpr (kQuantised) {
          if (piece.quantised) {
            const unsigned char* g = piece.v + h * piece.vHead + j / quant::kGroup * quant::groupBytes<Storage>(dV);
            x = quant::dequantised<Storage>(g, dV, j % quant::kGroup, c);
            sum += w * x;
            continue;
          }
        }
        x = Acc(at<Plain>(piece.v, piece.vHead, h)[j + c * piece.ld]);
        sum += w * x;
      }
      offset += piece.count;
    }
    return sum;
  }
};

}  // namespace sdpa::internal::cache

#endif  // SDPA_INTERNAL_DECODE_CACHE_HPP
