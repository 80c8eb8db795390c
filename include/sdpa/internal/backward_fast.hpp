#ifndef SDPA_INTERNAL_BACKWARD_FAST_HPP
#define SDPA_INTERNAL_BACKWARD_FAST_HPP

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "../mask.hpp"
#include "cpu.hpp"
#include "forward_fast.hpp"
#include "macros.hpp"
#include "parallel.hpp"

namespace sdpa::internal {
namespace fast {

/// A float matrix read in place: entry (i, c) at data[i row + c col] (column-major: row = 1,
/// col = the column stride; row-major: the reverse).
struct StridedInput {
  const float* data;
  Index row, col;
  const float* at(Index i, Index c) const { return data + i * row + c * col; }
};

/// An Eigen view (a column- or row-major Ref) as a StridedInput from its entry (i, c).
template <typename View>
StridedInput stridedInput(const View& x, Index i, Index c) {
  return {x.data() + i * x.rowStride() + c * x.colStride(), x.rowStride(), x.colStride()};
}

/**
 * One head of an fp32 backward for the fast path (backwardBlock): q (n_q x d_k) and dO
 * (n_q x d_v) read in place, in either storage order; the item's mask (one that only hides),
 * the query head and its scale tau != 0.
 */
template <typename Mask>
struct BackwardHead {
  StridedInput q, dO;
  Index nQ, nK, dK, dV;
  const Mask& mask;
  Index head;
  float tau;
  /// k and v in tiles of bk keys as the products read them, tile j0 at packed + j0 (2 d_k + d_v)
  /// (packBackwardTile): k's keys, v's keys, k's columns.
  const float* packed;
  Index bk;
};

/**
 * Where a query block's gradients go, each added to: dq's rows of the block (column-major, from
 * its first row), and the head's dk and dv rows in row-major accumulators whose rows are padded
 * to whole vectors (key j at dk + j ldk, d_k rounded up to the vector width, the padding
 * columns receiving 0).
 */
struct BackwardOut {
  float* dq;
  Index ldq;
  float* dk;
  Index ldk;
  float* dv;
  Index ldv;
};

/// Per-thread buffers of backwardBlock (grown, never shrunk).
struct BackwardScratch {
  Buffer<float> qT, dOT, qR, dOR, dqT;   // the block's q and dO transposed by group, and by rows
  Buffer<float> s, dp;                   // the block's S^T and dP^T tiles (all keys, or one tile)
  Buffer<float> max, sum, d, dtau, top;  // per lane
  Buffer<Index> keyBegin, keyEnd, at;    // per group
  static BackwardScratch& thread() {
    thread_local BackwardScratch scratch;
    return scratch;
  }
};

/// Bytes of S^T and dP^T a query block keeps for its second pass (beyond, it recomputes them:
/// two more products a tile). Keeping them was 1.2-1.8x faster than recomputing at n 2048-4096,
/// d 64-128 on a third-generation EPYC (512 KiB L2: they live in L3 there).
inline constexpr Index kBackwardFastCacheBytes = Index(64) << 20;
/// The budget backwardCaches reads: kBackwardFastCacheBytes unless a test set another.
inline std::atomic<Index>& backwardCacheBytesSlot() {
  static std::atomic<Index> bytes{kBackwardFastCacheBytes};
  return bytes;
}
/// Sets the budget of backwardCaches for later calls (not thread-safe against running kernels;
/// tests only: the recomputing pass over a few hundred keys instead of more than 65536).
inline void setBackwardCacheBytes(Index bytes) { backwardCacheBytesSlot().store(bytes, std::memory_order_relaxed); }
/// Whether a block of `lanes` query rows keeps its tiles against n_k keys.
inline bool backwardCaches(Index lanes, Index nK) {
  return Index(sizeof(float)) * 2 * lanes * nK <= backwardCacheBytesSlot().load(std::memory_order_relaxed);
}

#if SDPA_HAS_ISA_DISPATCH
// GCC 12 warns of uninitialised values inside its own AVX-512 intrinsics (as forward_fast.hpp).
// The same macros as forward_fast.hpp's instances, whose helpers and micro-kernels these use.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// clang-format off
#define SDPA_FAST_NS avx512
#define SDPA_FAST_TARGET __attribute__((target("avx512f,avx512dq,avx2,fma")))
#define SDPA_FAST_WIDTH 16
#include "backward_fast_isa.inc"
#undef SDPA_FAST_NS
#undef SDPA_FAST_TARGET
#undef SDPA_FAST_WIDTH
#define SDPA_FAST_NS avx2
#define SDPA_FAST_TARGET __attribute__((target("avx2,fma")))
#define SDPA_FAST_WIDTH 8
#include "backward_fast_isa.inc"
#undef SDPA_FAST_NS
#undef SDPA_FAST_TARGET
#undef SDPA_FAST_WIDTH
// clang-format on
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

/**
 * The gradients of query rows [i0, i0 + bq) of one head against all its keys, added to `out`;
 * returns the block's dL/dtau. The fast path of backward_tiled_impl for float inputs that are
 * all finite, whose logits tau q.k and dP = dO v^T cannot overflow (logitBounds), with a mask
 * that only hides, no dropout, no softcap, no bias gradient: the same two passes (row sums of
 * this pass's own softmax and D = sum_j P_ij dP_ij, then the gradients) with the forward's
 * register-blocked products on transposed tiles. `base2`: the logits in units of ln 2, as the
 * forward takes them where logitBounds allows. Tiles of bk keys; the block's S^T and dP^T are
 * kept for the second pass if they fit backwardCaches' budget.
 */
template <typename Mask>
double backwardBlock(const BackwardHead<Mask>& h, Index i0, Index bq, bool base2, const BackwardOut& out) {
#if SDPA_HAS_ISA_DISPATCH
  BackwardScratch& sc = BackwardScratch::thread();
  if (IsaChoice::current() >= Isa::Avx512)
    return base2 ? avx512::backwardBlock<true>(h, i0, bq, out, sc) : avx512::backwardBlock<false>(h, i0, bq, out, sc);
  return base2 ? avx2::backwardBlock<true>(h, i0, bq, out, sc) : avx2::backwardBlock<false>(h, i0, bq, out, sc);
#else
  (void)h, (void)i0, (void)bq, (void)base2, (void)out;
  return 0.0;
#endif
}

/// Floats BackwardHead::packed takes for n_k keys.
inline Index packedHeadFloats(Index nK, Index dK, Index dV) { return nK * (2 * dK + dV); }

/// The tile [j0, j0 + bk) of a kv head's packing (BackwardHead::packed) from its k (n_k x d_k)
/// and v (n_k x d_v), in either storage order.
inline void packBackwardTile(StridedInput k, StridedInput v, Index nK, Index dK, Index dV, Index j0, Index bk,
                             float* packed) {
#if SDPA_HAS_ISA_DISPATCH
  const Index cols = std::min(bk, nK - j0);
  float* out = packed + j0 * (2 * dK + dV);
  const StridedInput kt{k.at(j0, 0), k.row, k.col}, vt{v.at(j0, 0), v.row, v.col};
  if (IsaChoice::current() >= Isa::Avx512)
    avx512::packBackwardTile(kt, vt, cols, dK, dV, out);
  else
    avx2::packBackwardTile(kt, vt, cols, dK, dV, out);
#else
  (void)k, (void)v, (void)nK, (void)dK, (void)dV, (void)j0, (void)bk, (void)packed;
#endif
}

/// The vector width backwardBlock's dk and dv rows are padded to (BackwardOut).
inline Index backwardPadding() {
#if SDPA_HAS_ISA_DISPATCH
  return IsaChoice::current() >= Isa::Avx512 ? 16 : 8;
#else
  return 1;
#endif
}

}  // namespace fast
}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_BACKWARD_FAST_HPP
