#ifndef SDPA_INTERNAL_DECODE_ROWS_HPP
#define SDPA_INTERNAL_DECODE_ROWS_HPP

// Decoding's row kernels: a few query rows (at most 4 per pass: one head, a GQA group's heads, a
// few tokens) against keys stored column by column (key j, channel c at j + c ld), each column
// block loaded once for all the rows. Both decoding paths use them: over plain matrices
// (forward_tiled.hpp's streamDecode) and over a KvCache's pieces (decode_cache.hpp, which adds
// its wider multi-row blocks and its span-wise values).

#include <algorithm>
#include <cmath>

#include "half.hpp"
#include "macros.hpp"

namespace sdpa::internal {

/// Keeps a loaded packet in a register for all the multiply-adds that use it. Without this GCC
/// folds the load into each of them (a memory operand per FMA): the multi-row decoding kernels
/// then issue a load per FMA, as many as the load ports take, and ran at 0.3-0.45 of the FMA peak
/// on an AVX2 EPYC (session 25) where one load per packet lets them reach 0.65-0.8.
template <typename Packet>
inline void inRegister(Packet& x) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  if constexpr (sizeof(Packet) >= 16) {
#if defined(__AVX512F__)
    __asm__("" : "+v"(x));
#else
    __asm__("" : "+x"(x));
#endif
  }
#else
  (void)x;
#endif
}

/// A packet of floats from float storage, or (builds for AVX-512, or AVX2 and F16C: kHalfPackets)
/// of half or bfloat16 widened, so that the kernels read short half pieces in place.
inline Eigen::internal::packet_traits<float>::type loadFloats(const float* x) {
  return Eigen::internal::ploadu<Eigen::internal::packet_traits<float>::type>(x);
}
#if defined(__AVX512F__)
inline constexpr bool kHalfPackets = true;
inline __m512 loadFloats(const Eigen::half* x) { return half_columns::avx512::widen(x); }
inline __m512 loadFloats(const Eigen::bfloat16* x) { return half_columns::avx512::widen(x); }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)  // (Eigen's packets: 8 floats)
inline constexpr bool kHalfPackets = true;
inline __m256 loadFloats(const Eigen::half* x) { return half_columns::avx2::widen(x); }
inline __m256 loadFloats(const Eigen::bfloat16* x) { return half_columns::avx2::widen(x); }
#else
inline constexpr bool kHalfPackets = false;
#endif

namespace decode_rows {

/**
 * s[m][j] += sum_c a[m][c] k[j + c ldk] for Rows (<= 4) rows fixed at compile time (with a
 * run-time count GCC keeps the partial sums on the stack: a store-to-load chain per
 * multiply-add): 8 columns per pass over the keys, a packet of keys loaded once per column for
 * every row, each row's partial sums in a register across the 8. The same arithmetic per (row,
 * key) whatever Rows: columns in order, one FMA each. T: float, or half / bfloat16 where
 * kHalfPackets. Ahead (the KvCache's one-row pass, memory-bound): each pass requests the next
 * 8 columns at the same keys, so that their streams are in flight when it reaches them (one
 * token 1.1x faster on an AVX2 EPYC, session 25; over plain matrices within noise).
 */
template <int Rows, bool Ahead = false, typename T>
void logits(const float* const* a, const T* k, Index ldk, Index d, Index n, float* const* s) {
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<float>::type;
  constexpr Index W = ei::packet_traits<float>::size, kCols = 8;
  for (Index c0 = 0; c0 < d; c0 += kCols) {
    const Index c1 = std::min(d, c0 + kCols);
    const bool ahead = Ahead && Rows == 1 && c1 < d;
    Index j = 0;
    for (; j + W <= n; j += W) {
      Packet acc[Rows];
      for (int m = 0; m < Rows; ++m) acc[m] = ei::ploadu<Packet>(s[m] + j);
      for (Index c = c0; c < c1; ++c) {
        Packet kc = loadFloats(k + j + c * ldk);
        inRegister(kc);
        if (ahead) __builtin_prefetch(k + j + std::min(c + kCols, d - 1) * ldk, 0, 2);
        for (int m = 0; m < Rows; ++m) acc[m] = ei::pmadd(ei::pset1<Packet>(a[m][c]), kc, acc[m]);
      }
      for (int m = 0; m < Rows; ++m) ei::pstoreu(s[m] + j, acc[m]);
    }
    for (; j < n; ++j)
      for (int m = 0; m < Rows; ++m) {
        float t = s[m][j];
        for (Index c = c0; c < c1; ++c) t = std::fma(a[m][c], float(k[j + c * ldk]), t);
        s[m][j] = t;
      }
  }
}

/**
 * decodeValuesRows for Rows rows fixed at compile time, kCols columns per pass. The weights'
 * packets are pinned to registers only where they fit beside the Rows kCols accumulators and a
 * packet of v: with AVX2's 16 registers, 4 rows x 4 columns pinned pushed every accumulator to
 * the stack (a load and a store around each FMA), and 4 x 2 read v once per 2 columns; left to
 * itself GCC keeps the 16 accumulators and reads the weights from L1 as memory operands (GQA
 * decoding 1.25-1.35x faster than 4 x 2 pinned on an AVX2 EPYC, session 26).
 */
template <int Rows, Index kCols>
void values(const float* const* p, const float* v, Index ldv, Index dV, Index n, float* const* dots) {
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<float>::type;
  constexpr Index W = ei::packet_traits<float>::size;
  constexpr bool kPinWeights = Rows * kCols + Rows + 1 <= EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS;
  const Index whole = n / W * W;
  for (Index c0 = 0; c0 < dV; c0 += kCols) {
    const Index cols = std::min(kCols, dV - c0);
    Packet acc[Rows][kCols];
    for (int m = 0; m < Rows; ++m)
      for (Index c = 0; c < kCols; ++c) acc[m][c] = ei::pset1<Packet>(0.0f);
    const float* vc[kCols];
    for (Index c = 0; c < kCols; ++c) vc[c] = v + (c0 + std::min(c, cols - 1)) * ldv;
    for (Index j = 0; j < whole; j += W) {
      Packet pm[Rows];
      for (int m = 0; m < Rows; ++m) {
        pm[m] = ei::ploadu<Packet>(p[m] + j);
        if constexpr (kPinWeights) inRegister(pm[m]);
      }
      for (Index c = 0; c < kCols; ++c) {
        Packet x = ei::ploadu<Packet>(vc[c] + j);
        inRegister(x);
        for (int m = 0; m < Rows; ++m) acc[m][c] = ei::pmadd(pm[m], x, acc[m][c]);
      }
    }
    // Compile-time bounds (a short last block's repeated columns dropped): with `c < cols` as
    // the loop's bound GCC kept acc on the stack, a load and a store around every FMA.
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m)
#pragma GCC unroll 8
      for (Index c = 0; c < kCols; ++c) {
        if (c >= cols) continue;
        float t = ei::predux(acc[m][c]);
        for (Index j = whole; j < n; ++j) t = std::fma(p[m][j], vc[c][j], t);
        dots[m][c0 + c] = t;
      }
  }
}

}  // namespace decode_rows

/**
 * Decoding's logits for R query rows over n keys of column-major float k (column stride ldk):
 * s[r][j] += sum_c a[r][c] k[j + c ldk], by one fused multiply-add per column in the order
 * c = 0..d-1 for every (row, key), whatever R and whichever rows share a pass. So a query head's
 * logits are the same computed alone or beside the other heads of its GQA group, which then
 * read each block of k once for up to four rows: a column block (8 columns) of a packet of keys
 * is loaded once, each row's partial sums stay in a register across it.
 */
inline void decodeLogitsRows(const float* const* a, Index R, const float* k, Index ldk, Index d, Index n,
                             float* const* s) {
  for (Index r0 = 0; r0 < R; r0 += 4) {
    switch (std::min<Index>(4, R - r0)) {
      case 1:
        decode_rows::logits<1>(a + r0, k, ldk, d, n, s + r0);
        break;
      case 2:
        decode_rows::logits<2>(a + r0, k, ldk, d, n, s + r0);
        break;
      case 3:
        decode_rows::logits<3>(a + r0, k, ldk, d, n, s + r0);
        break;
      default:
        decode_rows::logits<4>(a + r0, k, ldk, d, n, s + r0);
        break;
    }
  }
}

/**
 * Decoding's weighted values for R rows of weights p over n keys of column-major float v (column
 * stride ldv): dots[r][c] = sum_j p[r][j] v[j + c ldv], each a packet of partial sums over the
 * keys in order, reduced, then the last keys one by one: whatever R, as decodeLogitsRows. A
 * packet of each of four columns is loaded once for up to four rows.
 */
inline void decodeValuesRows(const float* const* p, Index R, const float* v, Index ldv, Index dV, Index n,
                             float* const* dots) {
  for (Index r0 = 0; r0 < R; r0 += 4) {
    switch (std::min<Index>(4, R - r0)) {
      case 1:
        decode_rows::values<1, 4>(p + r0, v, ldv, dV, n, dots + r0);
        break;
      case 2:
        decode_rows::values<2, 4>(p + r0, v, ldv, dV, n, dots + r0);
        break;
      case 3:
        decode_rows::values<3, 4>(p + r0, v, ldv, dV, n, dots + r0);
        break;
      default:
        decode_rows::values<4, 4>(p + r0, v, ldv, dV, n, dots + r0);
        break;
    }
  }
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_DECODE_ROWS_HPP
