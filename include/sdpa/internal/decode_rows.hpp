#ifndef SDPA_INTERNAL_DECODE_ROWS_HPP
#define SDPA_INTERNAL_DECODE_ROWS_HPP

// Decoding's row kernels: a few query rows (at most 4 per pass: one head, a GQA group's heads, a
// few tokens) against keys stored column by column (key j, channel c at j + c ld), each column
// block loaded once for all the rows; from 5 rows on, wide register blocks (decode_cache_isa.inc,
// built here too). Both decoding paths use them: over plain matrices (forward_tiled.hpp's
// streamDecode) and over a KvCache's pieces (decode_cache.hpp, which adds its span-wise values
// and its short pieces).
//
// Every kernel is built once per instruction set (decode_rows_isa.inc, decode_cache_isa.inc):
// AVX-512 and AVX2 + FMA through the target attribute, chosen at run time by IsaChoice as the
// tile kernels are (withDecodeSimd), and the build's own ISA on Eigen's packets as the portable
// fallback. Until session 31 they were on Eigen's packets only, so a build without -march decoded
// with SSE2: one fp32 token over 65536 keys (d 128) 1.45x the time, 16 query rows 3.6x.

#include <algorithm>
#include <cmath>

#include "cpu.hpp"
#include "decode_pieces.hpp"
#include "half.hpp"
#include "macros.hpp"

namespace sdpa::internal {

/**
 * Requests a range that a later pass reads into L2 (prefetcht1), a few cache lines a step of the
 * pass running now, as 8 sequential streams side by side (the range in 8 parts, each requested
 * in order, as streamIntoL2 reads them): the next pass's keys then come from memory while this
 * one computes, where reading them first waits for them. One float head stored by keys, 65536
 * keys of d 128, one thread of a first-generation EPYC (session 49): a test program's own
 * kernels took 4.1-4.5 ms so against 5.5-5.6 read first and 5.9-6.6 with the hardware
 * prefetchers alone (16 GB/s of k and v: the read probe's rate); bench_decode's one-row call
 * 6.2-6.3 -> 5.3 ms, two rows 7.8 -> 6.5-6.6 (stored by columns 4.6-4.8 and 5.2-5.3).
 */
class StreamRequests {
 public:
  StreamRequests() = default;
  /// `bytes` from x (none for null) over `steps` calls of step().
  StreamRequests(const void* x, Index bytes, Index steps)
      : base_(static_cast<const char*>(x)),
        bytes_(x ? bytes : 0),
        lines_((bytes_ + kStreams * kLine - 1) / (kStreams * kLine)),
        steps_(std::max<Index>(steps, 1)) {}
  /// Each stream's next lines: after k calls, about k / steps of the range (no division: the
  /// kernels call it once a key or a block of keys).
  void step() {
    if (done_ == lines_) return;
    for (credit_ += lines_; credit_ > 0 && done_ < lines_; credit_ -= steps_, ++done_)
      for (Index g = 0; g < kStreams; ++g) {
        const Index at = (g * lines_ + done_) * kLine;
        if (at < bytes_) __builtin_prefetch(base_ + at, 0, 2);
      }
  }

 private:
  static constexpr Index kStreams = 8, kLine = 64;
  const char* base_ = nullptr;
  Index bytes_ = 0, lines_ = 0, steps_ = 1, credit_ = 0, done_ = 0;
};

/**
 * How a by-key pass over one run of float keys (one head stored by keys) reads them: `requested`,
 * whether the pass before requested them (StreamRequests), else they are read into L2 first; and
 * the range the pass after this one reads (`next`, `nextBytes`; none: null), requested as this
 * one goes. Other storage ignores them.
 */
struct ByKeyReads {
  bool requested = false;
  const void* next = nullptr;
  Index nextBytes = 0;
};

}  // namespace sdpa::internal

namespace sdpa::internal::decode_simd {

// The vector operations of each instance. Simd is the instance's tag: the dispatched entry points
// take it as their first argument (found by argument-dependent lookup), and it carries the
// instance's lanes per vector, vector registers and whether it loads half / bfloat16 in place.

/// The build's ISA on Eigen's packets (SSE2 without -march on x86-64; NEON, ...), with half and
/// bfloat16 loads where the build has AVX-512, or AVX2 with F16C.
namespace portable {
using V = Eigen::internal::packet_traits<float>::type;
struct Simd {
  static constexpr Index kLanes = Eigen::internal::packet_traits<float>::size;
  static constexpr int kRegisters = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
  static constexpr bool kHalfLoads = true;
#else
  static constexpr bool kHalfLoads = false;
#endif
};
inline V vzero() { return Eigen::internal::pset1<V>(0.0f); }
inline V vset1(float x) { return Eigen::internal::pset1<V>(x); }
inline V vload(const float* x) { return Eigen::internal::ploadu<V>(x); }
#if defined(__AVX512F__)
inline V vload(const Eigen::half* x) { return half_columns::avx512::widen(x); }
inline V vload(const Eigen::bfloat16* x) { return half_columns::avx512::widen(x); }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)  // (Eigen's packets: 8 floats)
inline V vload(const Eigen::half* x) { return half_columns::avx2::widen(x); }
inline V vload(const Eigen::bfloat16* x) { return half_columns::avx2::widen(x); }
#endif
inline void vstore(float* p, V x) { Eigen::internal::pstoreu(p, x); }
inline V vfma(V a, V b, V c) { return Eigen::internal::pmadd(a, b, c); }
inline float vsum(V x) { return Eigen::internal::predux(x); }
/// vsums's lane order (see avx512::vsums) from one vsum per vector: the same sums as vsum's.
inline V vsums(const V* x) {
  constexpr Index kLanes = Simd::kLanes, kBlocks = kLanes >= 4 ? kLanes / 4 : 1;
  float out[kLanes];
  for (Index lane = 0; lane < kLanes; ++lane) out[lane] = vsum(x[kBlocks * (lane % 4) + lane / 4]);
  return vload(out);
}
/// s[m][j + i] += w's lane (kLanes / 4) m + i, for m < 4 (a block's sums from vsums).
inline void vaddQuarters(V w, float* const* s, Index j) {
  constexpr Index kQuarter = Simd::kLanes >= 4 ? Simd::kLanes / 4 : 1;
  float t[Simd::kLanes];
  vstore(t, w);
  for (int m = 0; m < 4; ++m)
    for (Index i = 0; i < kQuarter; ++i) s[m][j + i] += t[kQuarter * m + i];
}
/// Keeps a loaded vector in a register for all the multiply-adds that use it. Without this GCC
/// folds the load into each of them (a memory operand per FMA): the multi-row decoding kernels
/// then issue a load per FMA, as many as the load ports take, and ran at 0.3-0.45 of the FMA peak
/// on an AVX2 EPYC (session 25) where one load per vector lets them reach 0.65-0.8. The asm takes
/// a copy: given an array element itself (the kernels' V x[J], pm[Rows]), GCC 12 also stored the
/// element to the stack after every asm, dead stores of one vector each (session 37).
inline void vkeep(V& x) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  if constexpr (sizeof(V) >= 16) {
    V t = x;
#if defined(__AVX512F__)
    __asm__("" : "+v"(t));
#else
    __asm__("" : "+x"(t));
#endif
    x = t;
  }
#else
  (void)x;
#endif
}
}  // namespace portable

#if SDPA_HAS_ISA_DISPATCH
/// The instances' target attributes (kept defined: decode_cache.hpp builds its instances with them).
#define SDPA_DECODE_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define SDPA_DECODE_AVX2 __attribute__((target("avx2,fma,f16c")))

/// 16 lanes, 32 registers; half and bfloat16 widened by half_columns' loads.
namespace avx512 {
#define SDPA_DECODE_TARGET SDPA_DECODE_AVX512
using V = __m512;
struct Simd {
  static constexpr Index kLanes = 16;
  static constexpr int kRegisters = 32;
  static constexpr bool kHalfLoads = true;
};
SDPA_DECODE_TARGET inline V vzero() { return _mm512_setzero_ps(); }
SDPA_DECODE_TARGET inline V vset1(float x) { return _mm512_set1_ps(x); }
SDPA_DECODE_TARGET inline V vload(const float* x) { return _mm512_loadu_ps(x); }
SDPA_DECODE_TARGET inline V vload(const Eigen::half* x) { return half_columns::avx512::widen(x); }
SDPA_DECODE_TARGET inline V vload(const Eigen::bfloat16* x) { return half_columns::avx512::widen(x); }
SDPA_DECODE_TARGET inline void vstore(float* p, V x) { _mm512_storeu_ps(p, x); }
SDPA_DECODE_TARGET inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
SDPA_DECODE_TARGET inline float vsum(V x) { return half_columns::avx512::laneSum(x); }
/**
 * The 16 lane sums of x[0..15] at once, each by vsum's tree (lanes i and i + 8, then i + 4,
 * i + 2, i + 1), so each the same bits: lane 4 k + i holds vsum(x[4 i + k]). 30 shuffles and 15
 * adds where 16 vsums take 64 and 64; each level adds the halves of two vectors' partial sums
 * in one instruction.
 */
SDPA_DECODE_TARGET inline V vsums(const V* x) {
  V a[8], b[4], c[2];
#pragma GCC unroll 8
  for (Index p = 0; p < 8; ++p)  // [x_2p's 8 sums of lanes i, i + 8 | x_2p+1's]
    a[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0xEE));
#pragma GCC unroll 4
  for (Index p = 0; p < 4; ++p)  // 128-bit block b: x_4p+b's 4 sums of lanes i, i + 4
    b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xDD));
#pragma GCC unroll 2
  for (Index p = 0; p < 2; ++p)  // block b: x_8p+b's 2 sums of lanes i, i + 2, then x_8p+4+b's
    c[p] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * p], b[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * p], b[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
/// s[m][j + i] += w's lane 4 m + i (m, i < 4): a 4 x 4 block's sums (vsums) into its 4 rows.
SDPA_DECODE_TARGET inline void vaddQuarters(V w, float* const* s, Index j) {
  const __m128 q[4] = {_mm512_extractf32x4_ps(w, 0), _mm512_extractf32x4_ps(w, 1), _mm512_extractf32x4_ps(w, 2),
                       _mm512_extractf32x4_ps(w, 3)};
  for (int m = 0; m < 4; ++m) _mm_storeu_ps(s[m] + j, _mm_add_ps(_mm_loadu_ps(s[m] + j), q[m]));
}
SDPA_DECODE_TARGET inline void vkeep(V& x) {
  V t = x;
  __asm__("" : "+v"(t));
  x = t;
}
#undef SDPA_DECODE_TARGET
}  // namespace avx512

/// 8 lanes, 16 registers (every AVX2 CPU has F16C, as half_columns assumes).
namespace avx2 {
#define SDPA_DECODE_TARGET SDPA_DECODE_AVX2
using V = __m256;
struct Simd {
  static constexpr Index kLanes = 8;
  static constexpr int kRegisters = 16;
  static constexpr bool kHalfLoads = true;
};
SDPA_DECODE_TARGET inline V vzero() { return _mm256_setzero_ps(); }
SDPA_DECODE_TARGET inline V vset1(float x) { return _mm256_set1_ps(x); }
SDPA_DECODE_TARGET inline V vload(const float* x) { return _mm256_loadu_ps(x); }
SDPA_DECODE_TARGET inline V vload(const Eigen::half* x) { return half_columns::avx2::widen(x); }
SDPA_DECODE_TARGET inline V vload(const Eigen::bfloat16* x) { return half_columns::avx2::widen(x); }
SDPA_DECODE_TARGET inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x); }
SDPA_DECODE_TARGET inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
/// The 8 lanes' sum as a tree: lanes i and i + 4, then i + 2, i + 1.
SDPA_DECODE_TARGET inline float vsum(V x) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
/// The 8 lane sums of x[0..7] at once by vsum's tree (avx512::vsums's scheme): lane 4 k + i
/// holds vsum(x[2 i + k]).
SDPA_DECODE_TARGET inline V vsums(const V* x) {
  V a[4], b[2];
#pragma GCC unroll 4
  for (Index p = 0; p < 4; ++p)  // [x_2p's 4 sums of lanes i, i + 4 | x_2p+1's]
    a[p] = _mm256_add_ps(_mm256_permute2f128_ps(x[2 * p], x[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(x[2 * p], x[2 * p + 1], 0x31));
#pragma GCC unroll 2
  for (Index p = 0; p < 2; ++p)
    b[p] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
/// s[m][j + i] += w's lane 2 m + i (m < 4, i < 2): a 4 x 2 block's sums (vsums) into its 4 rows.
SDPA_DECODE_TARGET inline void vaddQuarters(V w, float* const* s, Index j) {
  const __m128 lo = _mm256_castps256_ps128(w), hi = _mm256_extractf128_ps(w, 1);
  const __m128 q[4] = {lo, _mm_movehl_ps(lo, lo), hi, _mm_movehl_ps(hi, hi)};
  for (int m = 0; m < 4; ++m) {
    auto* x = reinterpret_cast<__m64*>(s[m] + j);  // (__m64 may alias a float)
    _mm_storel_pi(x, _mm_add_ps(_mm_loadl_pi(_mm_setzero_ps(), x), q[m]));
  }
}
SDPA_DECODE_TARGET inline void vkeep(V& x) {
  V t = x;
  __asm__("" : "+x"(t));
  x = t;
}
#undef SDPA_DECODE_TARGET
}  // namespace avx2
#endif

#define SDPA_DECODE_KERNELS "decode_rows_isa.inc"
#include "decode_instances.inc"
#undef SDPA_DECODE_KERNELS
// The wide multi-row blocks and the KvCache's kernels over pieces and spans, which use the row
// kernels above.
#define SDPA_DECODE_KERNELS "decode_cache_isa.inc"
#include "decode_instances.inc"
#undef SDPA_DECODE_KERNELS

}  // namespace sdpa::internal::decode_simd

namespace sdpa::internal {

/**
 * f(simd) with the tag of the decoding kernels this process runs: AVX-512 or AVX2 (by IsaChoice,
 * capped as the tile kernels are), else the portable instance. A kernel's bits depend on the
 * instance only where its sums run over lanes (the values' partial sums over keys: 16, 8 or the
 * build's packet width of them); the logits are the same bits on every instance.
 */
template <typename F>
void withDecodeSimd(F&& f) {
#if SDPA_HAS_ISA_DISPATCH
  const Isa isa = IsaChoice::current();
  if (int(isa) >= int(Isa::Avx512)) return f(decode_simd::avx512::Simd{});
  if (isa == Isa::Avx2) return f(decode_simd::avx2::Simd{});
#endif
  f(decode_simd::portable::Simd{});
}

/**
 * withDecodeSimd for kernels that read T: float on every instance, half and bfloat16 where the
 * instance widens them in registers (Simd::kHalfLoads: AVX2, AVX-512); returns whether f ran.
 */
template <typename T, typename F>
bool withDecodeSimdReading(F&& f) {
  bool done = false;
  withDecodeSimd([&](auto simd) {
    if constexpr (std::is_same_v<T, float> || decltype(simd)::kHalfLoads) {
      f(simd);
      done = true;
    }
  });
  return done;
}

/**
 * Decoding's logits for R query rows over n keys of column-major float k (column stride ldk):
 * s[r][j] += sum_c a[r][c] k[j + c ldk], by one fused multiply-add per column in the order
 * c = 0..d-1 for every (row, key), whatever R and whichever rows share a pass. So a query head's
 * logits are the same computed alone or beside the other heads of its GQA group (or the other
 * tokens of multi-token decoding), which then read each block of k once for up to four rows, or
 * eight in the wide blocks (matrixLogits): a column block (8 columns) of a packet of keys is
 * loaded once, each row's partial sums stay in a register across it.
 */
inline void decodeLogitsRows(const float* const* a, Index R, const float* k, Index ldk, Index d, Index n,
                             float* const* s) {
  withDecodeSimd([&](auto simd) { matrixLogits(simd, a, R, k, ldk, d, n, s); });
}

/**
 * decodeLogitsRows's wide blocks (8 rows at a time and the rest in the same pass, from 5 rows
 * on) for column-major half or bfloat16 k, widened in registers where the ISA instance loads
 * them (AVX2, AVX-512); returns the rows it took (all of them, or 0 for fewer rows and
 * elsewhere). The same arithmetic as half_columns' kernels, which take the other calls: each
 * packet of keys widened once for up to 8 rows instead of 4, the partial sums over 32 columns
 * in registers instead of loaded and stored every 8.
 */
template <typename H>
Index decodeHalfLogitsWide(const float* const* a, Index R, const H* k, Index ldk, Index d, Index n, float* const* s) {
  Index done = 0;
  withDecodeSimdReading<H>([&](auto simd) { done = matrixLogitsWide(simd, a, R, k, ldk, d, n, s); });
  return done;
}

/**
 * Decoding's weighted values for R rows of weights p over n keys of column-major float v (column
 * stride ldv): dots[r][c] = sum_j p[r][j] v[j + c ldv], each a packet of partial sums over the
 * keys in order, reduced, then the last keys one by one: whatever R, as decodeLogitsRows. A
 * packet of each of four columns is loaded once for up to four rows, or six in the wide blocks
 * (matrixValues).
 */
inline void decodeValuesRows(const float* const* p, Index R, const float* v, Index ldv, Index dV, Index n,
                             float* const* dots) {
  withDecodeSimd([&](auto simd) { matrixValues(simd, p, R, v, ldv, dV, n, dots); });
}

/**
 * Decoding's logits for R query rows over n keys of row-major k (key j's d values at k + j ldk):
 * s[r][j] += q_r . k_j, each key's dot in vector partial sums over the columns, reduced,
 * whatever R, the key's place in a block or the stride (a head of a packed batch gives the
 * single head's bits). Dispatched as the column kernels: Eigen's matrix-vector product runs at
 * the build's ISA (a build without -march decoded row-major float K/V 2.7x slower on a
 * Sapphire Rapids Xeon, session 38). T: float, or half / bfloat16 widened in registers where the
 * ISA instance loads them (AVX2, AVX-512); returns whether it ran (not for half elsewhere).
 */
template <typename T>
bool decodeLogitsByKey(const float* const* a, Index R, const T* k, Index ldk, Index d, Index n, float* const* s) {
  return withDecodeSimdReading<T>([&](auto simd) { logitsByKey(simd, a, R, k, ldk, d, n, s); });
}

/**
 * Decoding's weighted values for R rows of weights p over n keys of row-major v (key j's values
 * at v + j ldv): dots[r][c] = sum_j p[r][j] v[j ldv + c], each a chain of fused multiply-adds
 * in key order (the same bits on AVX2 and AVX-512); T and the result as decodeLogitsByKey's.
 */
template <typename T>
bool decodeValuesByKey(const float* const* p, Index R, const T* v, Index ldv, Index dV, Index n, float* const* dots) {
  return withDecodeSimdReading<T>([&](auto simd) { valuesByKey(simd, p, R, v, ldv, dV, n, dots); });
}

/**
 * decodeLogitsByKey for the rows of G kv heads whose rows lie side by side in k's rows: rows
 * [rows[g], rows[g + 1]) read head g's k at k[g] (stride ldk). The keys in blocks, each for every
 * head in turn (a block's rows read whole, in address order); one head as decodeLogitsByKey.
 * Each (row, key) the bits of decodeLogitsByKey; T and the result as its.
 */
template <typename T>
bool decodeLogitsByKeyHeads(const float* const* a, const Index* rows, Index G, const T* const* k, Index ldk, Index d,
                            Index n, float* const* s, const ByKeyReads& reads = {}) {
  return withDecodeSimdReading<T>([&](auto simd) {
    if (G == 1)  // (its chunk read first or requested before, or its requests of the keys ahead)
      logitsByKey(simd, a + rows[0], rows[1] - rows[0], k[0], ldk, d, n, s + rows[0], reads);
    else
      logitsByKeyHeads(simd, a, rows, G, k, ldk, d, n, s);
  });
}

/// decodeValuesByKey for the rows of G kv heads side by side in v's rows (as
/// decodeLogitsByKeyHeads's k): the bits of decodeValuesByKey. `reads` as decodeLogitsByKeyHeads's.
template <typename T>
bool decodeValuesByKeyHeads(const float* const* p, const Index* rows, Index G, const T* const* v, Index ldv, Index dV,
                            Index n, float* const* dots, const ByKeyReads& reads = {}) {
  return withDecodeSimdReading<T>([&](auto simd) {
    if (G == 1)
      valuesByKey(simd, p + rows[0], rows[1] - rows[0], v[0], ldv, dV, n, dots + rows[0], reads);
    else
      valuesByKeyHeads(simd, p, rows, G, v, ldv, dV, n, dots);
  });
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_DECODE_ROWS_HPP
