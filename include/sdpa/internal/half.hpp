#ifndef SDPA_INTERNAL_HALF_HPP
#define SDPA_INTERNAL_HALF_HPP

// Half and bfloat16 storage read as float: runs converted into a float buffer (halfToFloat), and
// decoding's column kernels, which widen k and v in registers as they stream them (no float copy
// of a column). Both pick F16C / AVX2 / AVX-512 at run time where the compiler can build them
// (SDPA_HAS_ISA_DISPATCH), so that a build without -march gets them on every AVX2 CPU.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu.hpp"
#include "macros.hpp"

#if defined(__F16C__) || defined(__AVX512F__) || SDPA_HAS_ISA_DISPATCH
#include <immintrin.h>
#endif

namespace sdpa::internal {

#if defined(__F16C__) || SDPA_HAS_ISA_DISPATCH
#if defined(__F16C__)
#define SDPA_F16C_TARGET
#else
#define SDPA_F16C_TARGET __attribute__((target("avx,f16c")))
#endif
/// The first n - n % 8 of dst[i] = float(src[i]) by F16C, 8 lanes per instruction (16 where the
/// translation unit is compiled for AVX-512); returns how many it converted.
SDPA_F16C_TARGET inline Index halfToFloatF16c(const Eigen::half* src, float* dst, Index n) {
  Index i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  return i;
}
#undef SDPA_F16C_TARGET
#endif

/**
 * dst[i] = float(src[i]) for contiguous half or bfloat16 storage. Half takes F16C where the
 * build targets it, else where the CPU has it (every AVX2 CPU; chosen at run time, capped by
 * IsaChoice as the tile kernels are): 8 lanes per instruction instead of Eigen's scalar
 * conversion, 13x faster (PERFORMANCE.md, decoding). bfloat16 is the upper half of a float, a
 * shift the compiler vectorises.
 */
inline void halfToFloat(const Eigen::half* src, float* dst, Index n) {
  Index i = 0;
#if defined(__F16C__)
  i = halfToFloatF16c(src, dst, n);
#elif SDPA_HAS_ISA_DISPATCH
  if (int(IsaChoice::current()) >= int(Isa::Avx2)) i = halfToFloatF16c(src, dst, n);
#endif
  for (; i < n; ++i) dst[i] = float(src[i]);
}
inline void halfToFloat(const Eigen::bfloat16* src, float* dst, Index n) {
  const auto* bits = reinterpret_cast<const std::uint16_t*>(src);
  for (Index i = 0; i < n; ++i) {
    const std::uint32_t word = std::uint32_t(bits[i]) << 16;
    std::memcpy(dst + i, &word, sizeof(float));
  }
}

/**
 * Whether columns `ld` elements apart lie close together (a paged block: its d runs of keys back
 * to back, at most 2 KiB apart): decoding's kernels then read them in address order, a column at
 * a time. Eight columns side by side (the long columns' order) read a block as eight interleaved
 * runs of a few hundred bytes each, which the hardware prefetcher of some CPUs does not follow:
 * on an AMD EPYC (session 24) paged blocks of 16-512 keys took 1.6-2.3x the contiguous cache's
 * time for the same kernels over the same bytes; in column order, about the same time. The same
 * bits either way: each key's and each column's sums do not depend on how many columns share a
 * pass.
 */
template <typename T>
bool columnsClose(Index ld) {
  return ld * Index(sizeof(T)) <= 2048;
}

/**
 * Whether the long pieces' half kernels below (axpyAll, axpyAllRows, dotAll) read close columns
 * one at a time: columnsClose, in the others' order only (CpuVendor). Intel's prefetchers follow
 * eight side by side: one token over fp16 blocks of 256 keys (512-byte columns) on an Emerald
 * Rapids Xeon took 1.20-1.22x the contiguous cache's time column by column, 1.03-1.05x eight at a
 * time (session 32); the float kernels' short pieces (decode_cache_isa.inc) stay in address order
 * there (blocks of 16 and 64 keys were slower side by side).
 */
template <typename H>
bool halfColumnByColumn(Index ld) {
  return columnsClose<H>(ld) && !CpuVendor::intel();
}

/**
 * Decoding's column kernels over half storage (fp16 or bf16): columns of n contiguous values at
 * a column stride, widened in registers 32 keys (a cache line of each column) at a time.
 * axpy: y += sum_c a[c] x_c, one fused multiply-add per column in column order for every key,
 * so the logits are float's kernel's bits. dot: out[c] = sum_i p[i] x_c[i] in 16 partial sums
 * (key i into sum i mod 16 of its block of 32, in order), added as a tree (laneSum), then the
 * tail: the same bits on the AVX2 path (two vectors of 8 sums) as on the AVX-512 path (one of 16).
 */
namespace half_columns {

/**
 * Halves ahead of the loads that the kernels prefetch in each column: G short column streams at
 * once (a key split holds a few thousand keys) outrun the hardware prefetcher. Measured with
 * bench_decode (n_k 65536, d 128, fp16, 1 thread, AVX-512): no prefetch 1.74x the float run,
 * 512 halves 1.94-2.01x, 1024 1.97-2.06x, 2048 1.55x.
 */
inline constexpr Index kPrefetch = 1024;

#if defined(__AVX512F__) || SDPA_HAS_ISA_DISPATCH || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
template <typename H>
inline void prefetch(const H* x) {
  // A prefetch never faults; the address is formed as an integer, as it may lie past the array
  // (pointer arithmetic there would be undefined).
  const std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(x) + std::uintptr_t(kPrefetch) * sizeof(H);
  _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);  // NOLINT(performance-no-int-to-ptr)
}

/// prefetch with the distance in halves given (where the next pass's columns lie).
template <typename H>
inline void prefetchAt(const H* x, Index halves) {
  const std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(x) + std::uintptr_t(halves) * sizeof(H);
  _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);  // NOLINT(performance-no-int-to-ptr)
}

/**
 * The halves from a key of a column to the same key of the column G on, which the kernels below
 * request as they read close columns (columnsClose: a paged block, its columns back to back, a
 * pass of G = 8 over a few KiB), so that the next pass finds its lines in L1; 0 for far columns
 * (those take kPrefetch within the column). A pass of 8 close columns covers about one 4 KiB
 * page, where the hardware prefetcher stops: one token over fp16 blocks of 256 and 512 keys
 * took 1.08-1.15x the contiguous cache's time without the requests, 0.94-0.98x with them (an
 * Emerald Rapids Xeon, session 32). Past a block's last pass they fall on memory the kernels
 * read next or not at all (a prefetch never faults).
 */
template <int G, typename H>
inline Index nextPass(Index stride) {
  return G > 1 && columnsClose<H>(stride) ? G * stride : 0;
}

// GCC 12 warns of uninitialised values inside its own AVX-512 intrinsics (as forward_fast.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#if defined(__AVX512F__) || SDPA_HAS_ISA_DISPATCH
namespace avx512 {
#define SDPA_HALF_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))
/// 16 half or bfloat16 values widened to float (bfloat16 is the upper half of a float); also the
/// loads of decode_cache.hpp's kernels on Eigen's packets, in builds whose packets are AVX-512.
SDPA_HALF_TARGET inline __m512 widen(const Eigen::half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
SDPA_HALF_TARGET inline __m512 widen(const Eigen::bfloat16* x) {
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}

/// The 16 lanes' sum as a tree: lanes i and i + 8, then i and i + 4, i + 2, i + 1 (avx2::laneSum's
/// order). Summed in order, one scalar add after another, it took a fifth of dotRows's time
/// over a chunk of 1024 keys.
SDPA_HALF_TARGET inline float laneSum(__m512 v) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), high);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/// y (n) += sum_c a[c] x_c over G columns x_c = x + c stride: y is read and written once per G
/// columns instead of once per column.
template <int G, typename H>
SDPA_HALF_TARGET void axpy(const float* a, const H* x, Index stride, float* y, Index n) {
  __m512 va[G];
  for (int c = 0; c < G; ++c) va[c] = _mm512_set1_ps(a[c]);
  Index i = 0;
  // No prefetch past the end of the columns' run: a chunk of 2048 keys would fetch half as much
  // again for nothing (the next chunk's start is the hardware prefetcher's).
  const Index ahead = n - kPrefetch, next = nextPass<G, H>(stride);
  for (; i + 32 <= n; i += 32) {
    __m512 lo = _mm512_loadu_ps(y + i), hi = _mm512_loadu_ps(y + i + 16);
    for (int c = 0; c < G; ++c) {
      const H* xc = x + c * stride + i;
      if (i < ahead) prefetch(xc);
      if (next) prefetchAt(xc, next);
      lo = _mm512_fmadd_ps(va[c], widen(xc), lo);
      hi = _mm512_fmadd_ps(va[c], widen(xc + 16), hi);
    }
    _mm512_storeu_ps(y + i, lo);
    _mm512_storeu_ps(y + i + 16, hi);
  }
  for (; i < n; ++i)
    for (int c = 0; c < G; ++c) y[i] = std::fma(a[c], float(x[c * stride + i]), y[i]);
}

/// out[c] = sum_i p[i] x_c[i] for G columns x_c = x + c stride: p is read once for G dots.
template <int G, typename H>
SDPA_HALF_TARGET void dot(const float* p, const H* x, Index stride, Index n, float* out) {
  __m512 acc[G];
  for (int c = 0; c < G; ++c) acc[c] = _mm512_setzero_ps();
  Index i = 0;
  const Index ahead = n - kPrefetch, next = nextPass<G, H>(stride);  // as in axpy
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(p + i), hi = _mm512_loadu_ps(p + i + 16);
    for (int c = 0; c < G; ++c) {
      const H* xc = x + c * stride + i;
      if (i < ahead) prefetch(xc);
      if (next) prefetchAt(xc, next);
      acc[c] = _mm512_fmadd_ps(hi, widen(xc + 16), _mm512_fmadd_ps(lo, widen(xc), acc[c]));
    }
  }
  for (int c = 0; c < G; ++c) {
    float sum = laneSum(acc[c]);
    for (Index t = i; t < n; ++t) sum = std::fma(p[t], float(x[c * stride + t]), sum);
    out[c] = sum;
  }
}

/// axpy for Rows rows at once (a GQA group, or the query rows of multi-token decoding): y_r (n)
/// += sum_c a_r[c] x_c over G columns, each packet of x widened once for every row rather than
/// once per row. Each y_r[i] takes axpy's fused multiply-adds in axpy's order: the same bits.
template <int G, int Rows, typename H>
SDPA_HALF_TARGET void axpyRows(const float* const* a, const H* x, Index stride, float* const* y, Index n) {
  Index i = 0;
  const Index ahead = n - kPrefetch, next = nextPass<G, H>(stride);
  for (; i + 32 <= n; i += 32) {
    __m512 acc[Rows][2];
    for (int m = 0; m < Rows; ++m) {
      acc[m][0] = _mm512_loadu_ps(y[m] + i);
      acc[m][1] = _mm512_loadu_ps(y[m] + i + 16);
    }
    for (int c = 0; c < G; ++c) {
      const H* xc = x + c * stride + i;
      if (i < ahead) prefetch(xc);
      if (next) prefetchAt(xc, next);
      const __m512 x0 = widen(xc), x1 = widen(xc + 16);
      for (int m = 0; m < Rows; ++m) {
        const __m512 w = _mm512_set1_ps(a[m][c]);
        acc[m][0] = _mm512_fmadd_ps(w, x0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w, x1, acc[m][1]);
      }
    }
    for (int m = 0; m < Rows; ++m) {
      _mm512_storeu_ps(y[m] + i, acc[m][0]);
      _mm512_storeu_ps(y[m] + i + 16, acc[m][1]);
    }
  }
  for (; i < n; ++i)
    for (int c = 0; c < G; ++c)
      for (int m = 0; m < Rows; ++m) y[m][i] = std::fma(a[m][c], float(x[c * stride + i]), y[m][i]);
}

/**
 * dot for Rows rows and Cols columns at once: out[m][c0 + c] = sum_i p[m][offset + i] x_c[i], each
 * packet of x widened once for every row and each packet of p loaded once for every column, the
 * next pass's Cols columns requested as these are read (as avx2::dotRows). A (row, column) dot is
 * one chain of 2 FMAs a 32-key block: Rows Cols chains keep the two FMA units busy from 8 on
 * (4 rows a column at a time, a GQA group's, left half of their issue slots idle waiting on the
 * chains). Each dot is dot's, to the bit.
 */
template <int Rows, int Cols, typename H>
SDPA_HALF_TARGET void dotRowsPass(const float* const* p, Index offset, const H* x, Index stride, Index c0, Index d,
                                  Index n, float* const* out) {
  const H* xc[Cols];
  for (int c = 0; c < Cols; ++c) xc[c] = x + (c0 + c) * stride;
  // Requested ahead: the next pass's columns (of the d - c0 - Cols left), 2 after a single one.
  const Index next = std::min<Index>(std::max(Cols, 2), d - c0 - Cols);
  __m512 acc[Rows][Cols];
  for (int m = 0; m < Rows; ++m)
    for (int c = 0; c < Cols; ++c) acc[m][c] = _mm512_setzero_ps();
  Index i = 0;
  for (; i + 32 <= n; i += 32) {
    for (Index k = 0; k < next; ++k)  // 32 keys: one line
      _mm_prefetch(reinterpret_cast<const char*>(xc[0] + (Cols + k) * stride + i), _MM_HINT_T0);
    __m512 x0[Cols], x1[Cols];
    for (int c = 0; c < Cols; ++c) {
      x0[c] = widen(xc[c] + i);
      x1[c] = widen(xc[c] + i + 16);
    }
    for (int m = 0; m < Rows; ++m) {
      const float* pm = p[m] + offset + i;
      const __m512 p0 = _mm512_loadu_ps(pm), p1 = _mm512_loadu_ps(pm + 16);
      for (int c = 0; c < Cols; ++c) acc[m][c] = _mm512_fmadd_ps(p1, x1[c], _mm512_fmadd_ps(p0, x0[c], acc[m][c]));
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (int c = 0; c < Cols; ++c) {
      float sum = laneSum(acc[m][c]);
      for (Index t = i; t < n; ++t) sum = std::fma(p[m][offset + t], float(xc[c][t]), sum);
      out[m][c0 + c] = sum;
    }
}

/// out[m][c] = sum_i p[m][offset + i] x_c[i] for Rows rows and the d columns: passes of
/// dotRowsPass over at least 8 chains, the last columns one at a time. 4 rows (a GQA group of 4,
/// as Llama's 32 query heads over 8 kv heads) take 4 columns a pass, 16 chains: each packet of
/// weights then serves 4 columns instead of 2 (fp16 GQA, Heads{32, 8} over 8-head MHA on a
/// Sapphire Rapids Xeon, session 37: 1.23-1.30x -> 1.17-1.19x, one thread).
template <int Rows, typename H>
SDPA_HALF_TARGET void dotRows(const float* const* p, Index offset, const H* x, Index stride, Index d, Index n,
                              float* const* out) {
  constexpr int Cols = Rows == 4 ? 4 : (8 + Rows - 1) / Rows;
  Index c = 0;
  if constexpr (Cols > 1)
    for (; c + Cols <= d; c += Cols) dotRowsPass<Rows, Cols>(p, offset, x, stride, c, d, n, out);
  for (; c < d; ++c) dotRowsPass<Rows, 1>(p, offset, x, stride, c, d, n, out);
}
#undef SDPA_HALF_TARGET
}  // namespace avx512
#endif

#if SDPA_HAS_ISA_DISPATCH || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
namespace avx2 {
#define SDPA_HALF_TARGET __attribute__((target("avx2,fma,f16c")))
/// 8 values widened to float; also decode_cache.hpp's loads on Eigen's packets in AVX2 builds.
SDPA_HALF_TARGET inline __m256 widen(const Eigen::half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
SDPA_HALF_TARGET inline __m256 widen(const Eigen::bfloat16* x) {
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

/// avx512::axpy with 8-lane vectors (the same fused multiply-adds per key).
template <int G, typename H>
SDPA_HALF_TARGET void axpy(const float* a, const H* x, Index stride, float* y, Index n) {
  __m256 va[G];
  for (int c = 0; c < G; ++c) va[c] = _mm256_set1_ps(a[c]);
  Index i = 0;
  const Index ahead = n - kPrefetch, next = nextPass<G, H>(stride);
  for (; i + 32 <= n; i += 32) {
    __m256 y0 = _mm256_loadu_ps(y + i), y1 = _mm256_loadu_ps(y + i + 8), y2 = _mm256_loadu_ps(y + i + 16),
           y3 = _mm256_loadu_ps(y + i + 24);
    for (int c = 0; c < G; ++c) {
      const H* xc = x + c * stride + i;
      if (i < ahead) prefetch(xc);
      if (next) prefetchAt(xc, next);
      y0 = _mm256_fmadd_ps(va[c], widen(xc), y0);
      y1 = _mm256_fmadd_ps(va[c], widen(xc + 8), y1);
      y2 = _mm256_fmadd_ps(va[c], widen(xc + 16), y2);
      y3 = _mm256_fmadd_ps(va[c], widen(xc + 24), y3);
    }
    _mm256_storeu_ps(y + i, y0);
    _mm256_storeu_ps(y + i + 8, y1);
    _mm256_storeu_ps(y + i + 16, y2);
    _mm256_storeu_ps(y + i + 24, y3);
  }
  for (; i < n; ++i)
    for (int c = 0; c < G; ++c) y[i] = std::fma(a[c], float(x[c * stride + i]), y[i]);
}

/// axpy for Rows rows at once (a GQA group, or the query rows of multi-token decoding): y_r (n)
/// += sum_c a_r[c] x_c over G columns, each packet of x widened once for every row rather than
/// once per row. Each y_r[i] takes the same fused multiply-adds in the same order as axpy's (the
/// columns in order; a key past the last 16 one fma per column, as axpy's past the last 32):
/// the same bits.
template <int G, int Rows, typename H>
SDPA_HALF_TARGET void axpyRows(const float* const* a, const H* x, Index stride, float* const* y, Index n) {
  Index i = 0;
  const Index ahead = n - kPrefetch, next = nextPass<G, H>(stride);
  for (; i + 16 <= n; i += 16) {
    __m256 acc[Rows][2];
    for (int m = 0; m < Rows; ++m) {
      acc[m][0] = _mm256_loadu_ps(y[m] + i);
      acc[m][1] = _mm256_loadu_ps(y[m] + i + 8);
    }
    for (int c = 0; c < G; ++c) {
      const H* xc = x + c * stride + i;
      if (i % 32 == 0) {  // a line of each column
        if (i < ahead) prefetch(xc);
        if (next) prefetchAt(xc, next);
      }
      const __m256 x0 = widen(xc), x1 = widen(xc + 8);
      for (int m = 0; m < Rows; ++m) {
        const __m256 w = _mm256_set1_ps(a[m][c]);
        acc[m][0] = _mm256_fmadd_ps(w, x0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w, x1, acc[m][1]);
      }
    }
    for (int m = 0; m < Rows; ++m) {
      _mm256_storeu_ps(y[m] + i, acc[m][0]);
      _mm256_storeu_ps(y[m] + i + 8, acc[m][1]);
    }
  }
  for (; i < n; ++i)
    for (int c = 0; c < G; ++c)
      for (int m = 0; m < Rows; ++m) y[m][i] = std::fma(a[m][c], float(x[c * stride + i]), y[m][i]);
}

/// The 16 lanes of lo then hi (avx512::dot's lanes 0-7 and 8-15) as avx512::laneSum's tree.
SDPA_HALF_TARGET inline float laneSum(__m256 lo, __m256 hi) {
  const __m256 s = _mm256_add_ps(lo, hi);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/// avx512::dot's 16 partial sums per column as two vectors (keys i..i+7 and i+16..i+23 into the
/// first, i+8..i+15 and i+24..i+31 into the second), four columns per pass over p (16 vector
/// registers).
template <int G, typename H>
SDPA_HALF_TARGET void dot(const float* p, const H* x, Index stride, Index n, float* out) {
  constexpr int kPass = G < 4 ? G : 4;
  static_assert(G % kPass == 0, "dot takes 1, 2, 4 or a multiple of 4 columns");
  const Index ahead = n - kPrefetch, next = nextPass<G, H>(stride);
  for (int c0 = 0; c0 < G; c0 += kPass) {
    __m256 lo[kPass], hi[kPass];
    for (int c = 0; c < kPass; ++c) lo[c] = hi[c] = _mm256_setzero_ps();
    Index i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m256 p0 = _mm256_loadu_ps(p + i), p1 = _mm256_loadu_ps(p + i + 8), p2 = _mm256_loadu_ps(p + i + 16),
                   p3 = _mm256_loadu_ps(p + i + 24);
      for (int c = 0; c < kPass; ++c) {
        const H* xc = x + (c0 + c) * stride + i;
        if (i < ahead) prefetch(xc);
        if (next) prefetchAt(xc, next);
        lo[c] = _mm256_fmadd_ps(p2, widen(xc + 16), _mm256_fmadd_ps(p0, widen(xc), lo[c]));
        hi[c] = _mm256_fmadd_ps(p3, widen(xc + 24), _mm256_fmadd_ps(p1, widen(xc + 8), hi[c]));
      }
    }
    for (int c = 0; c < kPass; ++c) {
      float sum = laneSum(lo[c], hi[c]);
      for (Index t = i; t < n; ++t) sum = std::fma(p[t], float(x[(c0 + c) * stride + t]), sum);
      out[c0 + c] = sum;
    }
  }
}

/// dot for Rows rows at once, a column at a time: out[m][c] = sum_i p[m][offset + i] x_c[i] for
/// the d columns, each packet of x widened once for every row; the next two columns' runs
/// requested as this one is read (one column stream at a time, whose runs of a chunk's keys the
/// hardware prefetcher does not cross). Each dot is dot's, to the bit: the same two vectors of
/// partial sums, the same reduction and tail.
template <int Rows, typename H>
SDPA_HALF_TARGET void dotRows(const float* const* p, Index offset, const H* x, Index stride, Index d, Index n,
                              float* const* out) {
  for (Index c = 0; c < d; ++c) {
    const H* xc = x + c * stride;
    const Index next = std::min<Index>(2, d - 1 - c);  // columns after this one to request
    __m256 lo[Rows], hi[Rows];
    for (int m = 0; m < Rows; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
    Index i = 0;
    for (; i + 32 <= n; i += 32) {
      for (Index k = 1; k <= next; ++k)  // 32 keys: one line (H is 2 bytes)
        _mm_prefetch(reinterpret_cast<const char*>(xc + k * stride + i), _MM_HINT_T0);
      const __m256 x0 = widen(xc + i), x1 = widen(xc + i + 8), x2 = widen(xc + i + 16), x3 = widen(xc + i + 24);
      for (int m = 0; m < Rows; ++m) {
        const float* pm = p[m] + offset + i;
        lo[m] = _mm256_fmadd_ps(_mm256_loadu_ps(pm + 16), x2, _mm256_fmadd_ps(_mm256_loadu_ps(pm), x0, lo[m]));
        hi[m] = _mm256_fmadd_ps(_mm256_loadu_ps(pm + 24), x3, _mm256_fmadd_ps(_mm256_loadu_ps(pm + 8), x1, hi[m]));
      }
    }
    for (int m = 0; m < Rows; ++m) {
      float sum = laneSum(lo[m], hi[m]);
      for (Index t = i; t < n; ++t) sum = std::fma(p[m][offset + t], float(xc[t]), sum);
      out[m][c] = sum;
    }
  }
}
#undef SDPA_HALF_TARGET
}  // namespace avx2
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // AVX-512, AVX2 + F16C + FMA or run-time dispatch

/// Which column kernels this process runs: AVX-512 or AVX2 (with F16C, which every AVX2 CPU
/// has) by IsaChoice, AVX-512 in a build for it without run-time dispatch; none elsewhere
/// (the callers then convert columns with halfToFloat).
enum class Path { None, Avx2, Avx512 };
inline Path path() {
#if SDPA_HAS_ISA_DISPATCH
  const Isa isa = IsaChoice::current();
  return int(isa) >= int(Isa::Avx512) ? Path::Avx512 : isa == Isa::Avx2 ? Path::Avx2 : Path::None;
#elif defined(__AVX512F__)
  return Path::Avx512;
#else
  return Path::None;
#endif
}

/// y += sum_c a[c] x_c (G columns, see above) on `path` (not None).
template <int G, typename H>
void axpy(Path path, const float* a, const H* x, Index stride, float* y, Index n) {
#if SDPA_HAS_ISA_DISPATCH
  if (path == Path::Avx2) return avx2::axpy<G>(a, x, stride, y, n);
#endif
#if defined(__AVX512F__) || SDPA_HAS_ISA_DISPATCH
  avx512::axpy<G>(a, x, stride, y, n);
#else
  (void)path, (void)a, (void)x, (void)stride, (void)y, (void)n;
#endif
}

/// out[c] = sum_i p[i] x_c[i] (G columns, see above) on `path` (not None).
template <int G, typename H>
void dot(Path path, const float* p, const H* x, Index stride, Index n, float* out) {
#if SDPA_HAS_ISA_DISPATCH
  if (path == Path::Avx2) return avx2::dot<G>(p, x, stride, n, out);
#endif
#if defined(__AVX512F__) || SDPA_HAS_ISA_DISPATCH
  avx512::dot<G>(p, x, stride, n, out);
#else
  (void)path, (void)p, (void)x, (void)stride, (void)n, (void)out;
#endif
}

/// The d columns of a decoding step, 8 at a time (one at a time where halfColumnByColumn) then
/// one by one: s (n) += sum_c a[c] x_c.
template <typename H>
void axpyAll(Path path, const float* a, const H* x, Index stride, Index d, float* s, Index n) {
  Index c = 0;
  if (!halfColumnByColumn<H>(stride))
    for (; c + 8 <= d; c += 8) axpy<8>(path, a + c, x + c * stride, stride, s, n);
  for (; c < d; ++c) axpy<1>(path, a + c, x + c * stride, stride, s, n);
}

/// f(std::integral_constant<int, rows>) for rows in 1..4.
template <typename F>
void withRows(Index rows, F&& f) {
  switch (rows) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    default:
      return f(std::integral_constant<int, 4>{});
  }
}

/// f(std::integral_constant<int, rows>) for rows in 1..8.
template <typename F>
void withRows8(Index rows, F&& f) {
  switch (rows) {
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 7:
      return f(std::integral_constant<int, 7>{});
    case 8:
      return f(std::integral_constant<int, 8>{});
    default:
      return withRows(rows, f);
  }
}

/// axpyAll for R rows (a[r], s[r]): up to 4 rows at a time through axpyRows (each x packet
/// widened once for them). The same bits as axpyAll row by row.
template <typename H>
void axpyAllRows(Path path, const float* const* a, Index R, const H* x, Index stride, Index d, float* const* s,
                 Index n) {
#if SDPA_HAS_ISA_DISPATCH
  if (path != Path::None && R > 1) {
    const bool close = halfColumnByColumn<H>(stride);
    for (Index r0 = 0; r0 < R; r0 += 4) {
      const float* ar[4];
      withRows(std::min<Index>(4, R - r0), [&](auto rowsC) {
        constexpr int Rows = decltype(rowsC)::value;
        const auto pass = [&](auto columns, const H* xc) {
          constexpr int G = decltype(columns)::value;
          if (path == Path::Avx512)
            avx512::axpyRows<G, Rows>(ar, xc, stride, s + r0, n);
          else
            avx2::axpyRows<G, Rows>(ar, xc, stride, s + r0, n);
        };
        for (Index c = 0; c < d;) {
          const Index g = !close && c + 8 <= d ? 8 : 1;
          for (Index m = 0; m < Rows; ++m) ar[m] = a[r0 + m] + c;
          if (g == 8)
            pass(std::integral_constant<int, 8>{}, x + c * stride);
          else
            pass(std::integral_constant<int, 1>{}, x + c * stride);
          c += g;
        }
      });
    }
    return;
  }
#endif
  for (Index r = 0; r < R; ++r) axpyAll(path, a[r], x, stride, d, s[r], n);
}

/// dots[c] = p . x_c for the d columns, 8 at a time (one at a time where halfColumnByColumn)
/// then one by one.
template <typename H>
void dotAll(Path path, const float* p, const H* x, Index stride, Index d, Index n, float* dots) {
  Index c = 0;
  if (!halfColumnByColumn<H>(stride))
    for (; c + 8 <= d; c += 8) dot<8>(path, p, x + c * stride, stride, n, dots + c);
  for (; c < d; ++c) dot<1>(path, p, x + c * stride, stride, n, dots + c);
}

/// dotAll for R rows (p[r] + offset), into out[r] (d each): up to 8 rows at a time through
/// AVX-512's dotRows, 4 through AVX2's (each x packet widened once for them; a row's dot is one
/// chain of 2 FMAs a 32-key block, so 8 rows keep twice the FMAs in flight: fp16 multi-token
/// decoding of 8 and 16 rows 11% faster than in blocks of 4 on an Emerald Rapids Xeon, session
/// 29; AVX2's 16 registers hold 4). From 8 rows on AVX-512 takes blocks of 4 rows x 4 columns,
/// every row block over each block of columns in turn (x's 4 columns widened once per 4 rows
/// instead of once per 8 rows and column, and read from memory once: 8 and 16 rows 1.05-1.08x
/// faster on a Sapphire Rapids Xeon, session 37). The same bits as dotAll row by row.
template <typename H>
void dotAllRows(Path path, const float* const* p, Index offset, Index R, const H* x, Index stride, Index d, Index n,
                float* const* out) {
#if SDPA_HAS_ISA_DISPATCH
  if (path != Path::None && R > 1) {
    if (path == Path::Avx512 && R >= 8) {
      Index c = 0;
      for (; c + 4 <= d; c += 4)
        for (Index r0 = 0; r0 < R; r0 += 4)
          withRows(std::min<Index>(4, R - r0), [&](auto rowsC) {
            avx512::dotRowsPass<decltype(rowsC)::value, 4>(p + r0, offset, x, stride, c, d, n, out + r0);
          });
      for (; c < d; ++c)
        for (Index r0 = 0; r0 < R; r0 += 8)
          withRows8(std::min<Index>(8, R - r0), [&](auto rowsC) {
            avx512::dotRowsPass<decltype(rowsC)::value, 1>(p + r0, offset, x, stride, c, d, n, out + r0);
          });
    } else if (path == Path::Avx512) {
      for (Index r0 = 0; r0 < R; r0 += 8)
        withRows8(std::min<Index>(8, R - r0), [&](auto rowsC) {
          avx512::dotRows<decltype(rowsC)::value>(p + r0, offset, x, stride, d, n, out + r0);
        });
    } else {
      for (Index r0 = 0; r0 < R; r0 += 4)
        withRows(std::min<Index>(4, R - r0),
                 [&](auto rowsC) { avx2::dotRows<decltype(rowsC)::value>(p + r0, offset, x, stride, d, n, out + r0); });
    }
    return;
  }
#endif
  for (Index r = 0; r < R; ++r) dotAll(path, p[r] + offset, x, stride, d, n, out[r]);
}

}  // namespace half_columns

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_HALF_HPP
