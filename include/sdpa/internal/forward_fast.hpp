#ifndef SDPA_INTERNAL_FORWARD_FAST_HPP
#define SDPA_INTERNAL_FORWARD_FAST_HPP

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <optional>
#include <type_traits>

#include "../mask.hpp"
#include "../softmax.hpp"
#include "cpu.hpp"
#include "diagnostics_rows.hpp"
#include "forward_naive.hpp"
#include "macros.hpp"
#include "parallel.hpp"

#if SDPA_HAS_ISA_DISPATCH
#include <immintrin.h>
#endif

namespace sdpa::internal {

/**
 * The fp32 prefill kernel with its own register-blocked tile products, built for AVX-512 and for
 * AVX2 + FMA whatever the flags of the translation unit, and chosen at run time (cpu.hpp).
 *
 * It works on the transposed tiles: S^T = k_tile (tau q_block)^T is b_k x b_q with the query
 * rows as vector lanes, so that
 * - q^T's rows are the columns of a column-major q (one scaled copy per query block), and k's
 *   and v's entries are broadcast where they lie: k and v are never packed or copied, in either
 *   storage order (the strides say which);
 * - the online softmax is lane-wise: a row's running maximum, sum and rescaling are one vector
 *   operation for W rows, with no horizontal reduction;
 * - the accumulator acc^T (d_v x b_q) is the output's transpose: a column-major output block is
 *   written column by column.
 * The products have no zeroing pass (the logits micro-tile starts from 0 in registers) and read
 * q^T from L1, k or v from their streams. It takes float prefill blocks (more than a few query
 * rows) without dropout. Special values keep the general kernel's rules: NaN or inf at hidden
 * positions of q, k, v or a bias has no effect (hidden logits are set to -inf, a v tile that is
 * not finite takes a zero-skipping product), and a row with a NaN or +inf visible logit (a NaN
 * bias, an overflowing product) is NaN, the other rows of its block unaffected to the bit.
 */
namespace fast {

/// kExpCut in units of ln 2: 2^x at or below it is exactly 0, as exp at or below kExpCut.
constexpr float kExp2Cut = float(double(kExpCut<float>) * 1.4426950408889634);

/// The figures softmaxTile (its Stats) and statsBeforeSoftmax write per lane (a DiagnosticsSink's
/// TileSums; kBelow: the largest logit under the maximum, kArg: the tile's first key at it,
/// kAlpha: the factor the lane's earlier weights took), and after them the two more a lane keeps
/// (addStats).
enum TileFigure : int {
  kVisible,
  kSum,
  kSumSq,
  kEs,
  kAtMax,
  kO1,
  kO2,
  kO3,
  kMin,
  kBelow,
  kArg,
  kAlpha,
  kRawSum,
  kRawSumSq,
  kOver16,
  kOver32,
  kTileFigures,
  kM = kTileFigures,
  kArgmax,
  kLaneFigures
};
/// kKeyIndices.at[j] = j: a key's index as a float, for a broadcast that a masked min folds in
/// (softmaxTile's keys at the maximum), where a counter took an add a key.
constexpr Index kKeyTable = 2048;
struct KeyIndices {
  float at[kKeyTable];
  constexpr KeyIndices() : at() {
    for (Index j = 0; j < kKeyTable; ++j) at[j] = float(j);
  }
};
inline constexpr KeyIndices kKeyIndices{};

/// softmaxTile's Stats: none, or a DiagnosticsSink's figures of a tile whose logits in range are
/// all finite, or of any tile.
enum : int { kNoStats, kStatsVisible, kStatsAny };

namespace amx {
constexpr Index kKeys = 32;   // keys (and value columns) per block of 2 x 2 tiles
constexpr Index kPairs = 16;  // bf16 pairs along the products' sum per tile
/// Whole tiles: n rounded up to a multiple of m.
constexpr Index roundUp(Index n, Index m) { return (n + m - 1) / m * m; }
}  // namespace amx

#if SDPA_HAS_ISA_DISPATCH
// GCC 12 reports -Wuninitialized / -Wmaybe-uninitialized inside its own AVX-512 intrinsics
// (_mm512_undefined_ps in roundscale and scalef) once they are inlined: a false positive of the
// compiler's header, as in math.hpp.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// clang-format off
#define SDPA_FAST_NS avx512
#define SDPA_FAST_TARGET __attribute__((target("avx512f,avx512dq,avx2,fma")))
#define SDPA_FAST_WIDTH 16
#define SDPA_FAST_KEYS 12
#define SDPA_FAST_COLS 12
#define SDPA_FAST_FILL 8
#include "forward_fast_isa.inc"
#undef SDPA_FAST_NS
#undef SDPA_FAST_TARGET
#undef SDPA_FAST_WIDTH
#undef SDPA_FAST_KEYS
#undef SDPA_FAST_COLS
#undef SDPA_FAST_FILL
#define SDPA_FAST_NS avx2
#define SDPA_FAST_TARGET __attribute__((target("avx2,fma")))
#define SDPA_FAST_WIDTH 8
#define SDPA_FAST_KEYS 6
#define SDPA_FAST_COLS 6
#define SDPA_FAST_FILL 6
#include "forward_fast_isa.inc"
#undef SDPA_FAST_NS
#undef SDPA_FAST_TARGET
#undef SDPA_FAST_WIDTH
#undef SDPA_FAST_KEYS
#undef SDPA_FAST_COLS
#undef SDPA_FAST_FILL
// clang-format on
#include "forward_fast_bf16.inc"
// (The AMX kernels use the bf16 kernels' pair store.)
#include "forward_fast_amx.inc"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

/// Whether this build and CPU have a fast kernel (the ISA in force is not the portable one).
inline bool available() {
#if SDPA_HAS_ISA_DISPATCH
  return IsaChoice::current() != Isa::Portable;
#else
  return false;
#endif
}

/**
 * y = exp(x) (base2: 2^x) for n floats x <= 0 as the kernel's softmax computes them under the
 * ISA in force (exactly 0 at or below kExpCut, and for -inf and NaN), for the tests; the
 * portable path has no such function and takes the AVX2 one's place only where the CPU has it.
 */
inline void expArray(bool base2, const float* x, float* y, Index n) {
#if SDPA_HAS_ISA_DISPATCH
  if (IsaChoice::current() >= Isa::Avx512)
    return base2 ? avx512::expArray<true>(x, y, n) : avx512::expArray<false>(x, y, n);
  if (IsaChoice::current() == Isa::Avx2) return base2 ? avx2::expArray<true>(x, y, n) : avx2::expArray<false>(x, y, n);
#endif
  for (Index i = 0; i < n; ++i)
    y[i] = base2 ? (x[i] > kExp2Cut ? std::exp2(x[i]) : 0.0f) : (x[i] > kExpCut<float> ? std::exp(x[i]) : 0.0f);
}

/**
 * expShiftedSum (online_softmax.hpp) for float under the ISA in force (SDPA_FAST_NS::
 * expShiftedSumRow): the weights and their sum, or NaN; false where there is no such kernel
 * (the portable path: Eigen's packets instead).
 */
inline bool expShiftedSum(float* x, Index n, float m, float& sum) {
#if SDPA_HAS_ISA_DISPATCH
  if (IsaChoice::current() >= Isa::Avx512) return sum = avx512::expShiftedSumRow(x, n, m), true;
  if (IsaChoice::current() == Isa::Avx2) return sum = avx2::expShiftedSumRow(x, n, m), true;
#endif
  (void)x, (void)n, (void)m, (void)sum;
  return false;
}

/// The padding of the Gram kernel's order under the ISA in force (gramLower's kGramRows); 0
/// where there is no such kernel (the portable path: Eigen's product instead).
inline Index gramRows() {
#if SDPA_HAS_ISA_DISPATCH
  if (IsaChoice::current() >= Isa::Avx512) return avx512::kGramRows;
  if (IsaChoice::current() == Isa::Avx2) return avx2::kGramRows;
#endif
  return 0;
}

/// g += x^T x on its lower tiles (SDPA_FAST_NS::gramLower) under the ISA in force; gramRows() > 0.
inline void gramLower(const float* x, Index rows, Index dPad, float* g) {
#if SDPA_HAS_ISA_DISPATCH
  if (IsaChoice::current() >= Isa::Avx512) return avx512::gramLower(x, rows, dPad, g);
  if (IsaChoice::current() == Isa::Avx2) return avx2::gramLower(x, rows, dPad, g);
#endif
  (void)x, (void)rows, (void)dPad, (void)g;  // not called: gramRows() is 0
}

#if SDPA_HAS_ISA_DISPATCH
/// The 8 x 8 transpose of m (row j in m[j]) into o (row i of the transpose in o[i]).
__attribute__((target("avx2"))) inline void transpose8x8(const __m256* m, __m256* o) {
  __m256 t[8], u[8];
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(m[j], m[j + 1]);
    t[j + 1] = _mm256_unpackhi_ps(m[j], m[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {
    u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
    u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xee);
    u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
    u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    o[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    o[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

/**
 * out (row-major, row stride ldo) rows 0..rows, columns 0..d = x (column-major, column stride
 * ldx) minus mu (d), in 8 x 8 blocks transposed in registers (a scalar loop of strided stores
 * took as long as the Gram product it feeds at d_k = 64).
 */
__attribute__((target("avx2"))) inline void centredTranspose(const float* x, Index ldx, Index rows, Index d,
                                                             const float* mu, float* out, Index ldo) {
  Index r0 = 0;
  for (; r0 + 8 <= rows; r0 += 8) {
    Index c0 = 0;
    for (; c0 + 8 <= d; c0 += 8) {
      __m256 m[8], o[8];
      for (Index j = 0; j < 8; ++j)
        m[j] = _mm256_sub_ps(_mm256_loadu_ps(x + (c0 + j) * ldx + r0), _mm256_set1_ps(mu[c0 + j]));
      transpose8x8(m, o);
      for (Index i = 0; i < 8; ++i) _mm256_storeu_ps(out + (r0 + i) * ldo + c0, o[i]);
    }
    for (; c0 < d; ++c0)
      for (Index r = r0; r < r0 + 8; ++r) out[r * ldo + c0] = x[c0 * ldx + r] - mu[c0];
  }
  for (; r0 < rows; ++r0)
    for (Index c = 0; c < d; ++c) out[r0 * ldo + c] = x[c * ldx + r0] - mu[c];
}
#endif

#if SDPA_HAS_ISA_DISPATCH
/**
 * maxFiniteAbs's scan of `outer` runs of n floats, `stride` apart, 8 at a time (compilers leave
 * the plain loop scalar: a compare and two conditional moves per entry, 5% of a call at n = 1024,
 * d = 64): top = max(top, the largest finite |x|'s bits), bad |= whether some x is inf or NaN.
 * One reduction of the lanes for all the runs: a head stored by keys is n_k runs of d_k (a
 * reduction per run took 4% of a multi-head call at d 64, against 1.5% by columns).
 */
__attribute__((target("avx2"))) inline void scanFiniteBits(const float* x, Index n, Index outer, Index stride,
                                                           std::uint32_t& top, bool& bad) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), exponent = _mm256_set1_epi32(0x7f800000);
  __m256i t = _mm256_setzero_si256(), b = _mm256_setzero_si256();
  for (Index o = 0; o < outer; ++o, x += stride) {
    Index i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i a = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), magnitude);
      const __m256i nonFinite = _mm256_cmpgt_epi32(a, _mm256_sub_epi32(exponent, _mm256_set1_epi32(1)));
      t = _mm256_max_epi32(t, _mm256_andnot_si256(nonFinite, a));  // magnitudes are >= 0 as int32
      b = _mm256_or_si256(b, nonFinite);
    }
    for (; i < n; ++i) {
      const std::uint32_t a = Eigen::numext::bit_cast<std::uint32_t>(x[i]) & 0x7fffffffu;
      bad = bad || a >= 0x7f800000u;
      top = a >= 0x7f800000u ? top : std::max(top, a);
    }
  }
  alignas(32) std::uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), t);
  bad = bad || !_mm256_testz_si256(b, b);
  for (const std::uint32_t v : lanes) top = std::max(top, v);
}

/**
 * The same for runs of n 16-bit floats (bfloat16 or half: `exponent` their exponent bits), 16 at a time
 * (GCC 12 leaves the plain loop scalar: 11% of a bf16 call on AMX at n 4096, d 128).
 */
__attribute__((target("avx2"))) inline void scanFiniteBits(const std::uint16_t* x, Index n, Index outer, Index stride,
                                                           std::uint16_t exponent, std::uint16_t& top, bool& bad) {
  const __m256i magnitude = _mm256_set1_epi16(0x7fff), e = _mm256_set1_epi16(std::int16_t(exponent));
  __m256i t = _mm256_setzero_si256(), b = _mm256_setzero_si256();
  for (Index o = 0; o < outer; ++o, x += stride) {
    Index i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i a = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), magnitude);
      const __m256i nonFinite = _mm256_cmpeq_epi16(_mm256_and_si256(a, e), e);
      t = _mm256_max_epu16(t, _mm256_andnot_si256(nonFinite, a));
      b = _mm256_or_si256(b, nonFinite);
    }
    for (; i < n; ++i) {
      const auto a = static_cast<std::uint16_t>(x[i] & 0x7fffu);
      const bool nonFinite = (a & exponent) == exponent;
      bad = bad || nonFinite;
      top = nonFinite ? top : std::max(top, a);
    }
  }
  alignas(32) std::uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), t);
  bad = bad || !_mm256_testz_si256(b, b);
  for (const std::uint16_t v : lanes) top = std::max(top, v);
}
#endif

/// Largest |x| over the finite entries of m (0 if none); allFinite: whether every entry is finite.
template <typename D>
float maxFiniteAbs(const Eigen::MatrixBase<D>& m, bool& allFinite) {
  using S = typename D::Scalar;
  constexpr bool kHalf = std::is_same_v<S, Eigen::bfloat16> || std::is_same_v<S, Eigen::half>;
  if constexpr ((kHalf || std::is_same_v<S, float>)&&bool(D::Flags & Eigen::DirectAccessBit)) {
    if (m.derived().innerStride() == 1) {
      // A float's magnitude orders as its bits without the sign, and it is finite unless every
      // exponent bit is set: an integer scan, which vectorises (converting each 16-bit entry to
      // float took 6% of a bf16 call at n = 4096, d = 128; the float loop with its branches on
      // finiteness, 2% of a float call).
      using Bits = std::conditional_t<kHalf, std::uint16_t, std::uint32_t>;
      constexpr Bits exponent = std::is_same_v<S, Eigen::bfloat16> ? 0x7f80u
                                : std::is_same_v<S, Eigen::half>   ? 0x7c00u
                                                                   : 0x7f800000u;
      constexpr Bits magnitude = Bits(~Bits(0)) >> 1;
      // (Eight independent maxima: GCC 12's -O2 does not vectorise the plain loop, whose one
      // running maximum is then a chain of a compare and a move per entry.)
      constexpr int kWays = 8;
      Bits top[kWays] = {}, bad[kWays] = {};
      const auto visit = [&](int w, S x) {
        const auto a = static_cast<Bits>(Eigen::numext::bit_cast<Bits>(x) & magnitude);
        const bool nonFinite = (a & exponent) == exponent;
        top[w] = std::max(top[w], nonFinite ? Bits(0) : a);
        bad[w] = static_cast<Bits>(bad[w] | (nonFinite ? 1u : 0u));
      };
      // Columns of column-major storage, rows of row-major.
      const Index inner = m.derived().innerSize();
#if SDPA_HAS_ISA_DISPATCH
      if constexpr (std::is_same_v<S, float>) {
        if (IsaChoice::current() >= Isa::Avx2) {
          std::uint32_t t = 0;
          bool b = false;
          scanFiniteBits(m.derived().data(), inner, m.derived().outerSize(), m.derived().outerStride(), t, b);
          allFinite = !b;
          return Eigen::numext::bit_cast<float>(t);
        }
      } else if (IsaChoice::current() >= Isa::Avx2) {
        std::uint16_t t = 0;
        bool b = false;
        scanFiniteBits(reinterpret_cast<const std::uint16_t*>(m.derived().data()), inner, m.derived().outerSize(),
                       m.derived().outerStride(), exponent, t, b);
        allFinite = !b;
        return float(Eigen::numext::bit_cast<S>(t));
      }
#endif
      for (Index c = 0; c < m.derived().outerSize(); ++c) {
        const S* col = m.derived().data() + c * m.derived().outerStride();
        Index i = 0;
        for (; i + kWays <= inner; i += kWays)
          for (int w = 0; w < kWays; ++w) visit(w, col[i + w]);
        for (; i < inner; ++i) visit(0, col[i]);
      }
      for (int w = 1; w < kWays; ++w) {
        top[0] = std::max(top[0], top[w]);
        bad[0] = static_cast<Bits>(bad[0] | bad[w]);
      }
      allFinite = bad[0] == 0;
      return float(Eigen::numext::bit_cast<S>(top[0]));
    }
  }
  float r = 0.0f;
  bool all = true;
  for (Index c = 0; c < m.cols(); ++c)
    for (Index i = 0; i < m.rows(); ++i) {
      const float x = std::abs(float(m(i, c)));
      const bool finite = x <= std::numeric_limits<float>::max();  // false for inf and NaN
      r = finite ? std::max(r, x) : r;
      all = all && finite;
    }
  allFinite = all;
  return r;
}

/// What a head's q, k and tau allow the kernel (logitBounds).
struct LogitBounds {
  /// No logit tau q.k can overflow, whatever the order of its sums, and q, k are finite: only a
  /// mask can bring NaN or inf into a tile, and tiles the mask leaves alone need no check.
  bool bounded = false;
  /// Neither tau log2(e) q nor the logits in units of ln 2 can overflow where the natural ones
  /// do not (judged by the finite entries only, so that NaN or inf at hidden positions change
  /// no bit): base-2 tiles are allowed.
  bool base2 = false;
};

/// |q_i . k_j| <= d_k max|q| max|k|, with room for the rounding.
template <typename DQ, typename DK>
LogitBounds logitBounds(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, float tau) {
  if (q.size() == 0 || k.size() == 0) return {true, true};
  constexpr double log2e = 1.4426950408889634, limit = 0.25 * double(std::numeric_limits<float>::max());
  bool qFinite = false, kFinite = false;
  const double qMax = double(maxFiniteAbs(q, qFinite)) * std::abs(double(tau)), kMax = double(maxFiniteAbs(k, kFinite));
  const double bound = double(q.cols()) * qMax * kMax;
  LogitBounds b;
  b.bounded = bound < limit && qFinite && kFinite;
  b.base2 = bound * log2e < limit && qMax * log2e < limit;
  return b;
}

/**
 * values() for a v tile that holds NaN or inf (over each lane group's key range, as there): a value of weight 0 must
 * have no effect (0 * inf is NaN), so such terms are skipped. The other terms are the micro-kernel's, in its order (a
 * tile sum from 0 by fused multiply-adds, then added to acc): where the skipped values are
 * finite, fma(0, v, a) = a, so the result is bitwise that of the same inputs with finite values
 * there (a NaN at a hidden key leaves the output unchanged, to the bit).
 */
template <typename T>
void valuesSkippingZeros(const float* pT, Index lanes, Index bq, Index bk, const Index* begin, const Index* end,
                         Index group, const T* v, Index vRs, Index vCs, Index dV, float* accT) {
  for (Index c = 0; c < dV; ++c)
    for (Index i = 0; i < bq; ++i) {
      float a = 0.0f;
      const Index jb = begin ? begin[i / group] : 0, je = end ? end[i / group] : bk;
      for (Index j = jb; j < je; ++j) {
        const float p = pT[j * lanes + i];
        if (p != 0.0f) a = std::fma(p, float(v[j * vRs + c * vCs]), a);
      }
      accT[c * lanes + i] += a;
    }
}

/// The bf16 bits of x: exact for bfloat16, rounded to nearest even for half (AllowFp16).
inline std::uint32_t bf16Bits(Eigen::bfloat16 x) { return Eigen::numext::bit_cast<std::uint16_t>(x); }
inline std::uint32_t bf16Bits(Eigen::half x) {
  return Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(float(x)));
}
/// Whether bf16 bits encode inf or NaN (every exponent bit set).
inline bool bf16NotFinite(std::uint32_t bits) { return (bits & 0x7f80u) == 0x7f80u; }

/**
 * Words from one column of a tile or packed head to the next: `n` rounded up to an odd number of
 * cache lines. At a power-of-two stride (n_k = 4096 floats: 16 KiB) every column a micro-tile
 * reads falls in one L1 set and they evict each other.
 */
inline Index oddLineStride(Index n) { return ((n + 15) / 16 | 1) * 16; }

/**
 * K and V of one (batch item, kv head) in the bf16 kernel's pair layouts (forward_fast_bf16.inc),
 * packed once per call and read by every query block: kP ceil(d_k / 2) x n_k (column stride
 * kLd), vP d_v x ceil(n_k / 2) (column stride vLd), and for each key tile of `bk` keys whether
 * its values are all finite. For the AMX products (`amx`, forward_fast_amx.inc) k is row-major
 * instead, kP n_k x ceil(d_k / 2) (row stride kLd, a multiple of 16 pairs; n_k rounded up to 32
 * rows), and vP has d_v rounded up to 32 columns; every padding entry is +0.
 */
struct Bf16Head {
  const std::uint32_t* kP = nullptr;
  const std::uint32_t* vP = nullptr;
  const unsigned char* vFinite = nullptr;
  Index kLd = 0, vLd = 0;
  bool amx = false;
};

/**
 * k (n_k x d_k) and v (n_k x d_v), bfloat16 or half, converted (exactly) to float once per call
 * into `kF` (n_k x d_k) and `vF` (n_k x d_v), column-major: the fp32 kernel's inputs for
 * Products::Fp32.
 */
template <typename DK, typename DV>
void convertHead(const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v, float* kF, float* vF) {
  Eigen::Map<Matrix<float>>(kF, k.rows(), k.cols()) = k.template cast<float>();
  Eigen::Map<Matrix<float>>(vF, v.rows(), v.cols()) = v.template cast<float>();
}

/// The sizes of a Bf16Head's layout (and of the q and acc tiles the AMX products pad to match).
struct Bf16Layout {
  Index dK2 = 0;     // pairs of k's columns
  Index dK2p = 0;    // the same, padded to whole AMX tiles (16 pairs)
  Index dVp = 0;     // v's columns, padded to whole AMX blocks (32)
  Index kLd = 0;     // kP's column stride (row stride for AMX)
  Index vLd = 0;     // vP's column stride
  Index kWords = 0;  // kP's words
  Bf16Layout(Index nK, Index dK, Index dV, bool amx)
      : dK2((dK + 1) / 2),
        dK2p(amx ? amx::roundUp(dK2, amx::kPairs) : dK2),
        dVp(amx ? amx::roundUp(dV, amx::kKeys) : dV),
        kLd(amx ? dK2p : oddLineStride(nK)),
        vLd(oddLineStride((nK + 1) / 2)),
        kWords(amx ? amx::roundUp(nK, amx::kKeys) * kLd : dK2 * kLd) {}
};

/// Words a Bf16Head of these dimensions takes (its finite flags counted in words too).
inline Index bf16HeadWords(Index nK, Index dK, Index dV, Index bk, bool amx) {
  const Bf16Layout lay(nK, dK, dV, amx);
  return lay.kWords + lay.dVp * lay.vLd + ((nK + bk - 1) / bk + 3) / 4;
}

namespace pack {

/// Whether n bf16 values (bits) are all finite.
inline bool bf16Finite(const std::uint16_t* x, Index n) {
#if SDPA_HAS_ISA_DISPATCH
  if (IsaChoice::current() >= Isa::Avx2) {
    std::uint16_t top = 0;
    bool bad = false;
    scanFiniteBits(x, n, 1, n, 0x7f80u, top, bad);
    return !bad;
  }
#endif
  std::uint16_t bad = 0;
  for (Index i = 0; i < n; ++i) bad = static_cast<std::uint16_t>(bad | ((x[i] & 0x7f80u) == 0x7f80u));
  return bad == 0;
}

#if SDPA_HAS_ISA_DISPATCH
// The vector packings run where the bf16 products do (AVX512_BF16, which has AVX2 and F16C).
#define SDPA_PACK_TARGET __attribute__((target("avx2,f16c,avx512f,avx512vl,avx512bf16")))

/// Eight consecutive entries of a column as bf16 bits, 16 bits each (half: rounded to nearest
/// even from its exact float, as bf16Bits; every half is a normal float).
template <typename S>
SDPA_PACK_TARGET inline __m128i bf16x8(const S* x) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  if constexpr (std::is_same_v<S, Eigen::bfloat16>) {
    return raw;
  } else {
    return reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(_mm256_cvtph_ps(raw)));
  }
}

/**
 * kP rows [j0, j0 + 8) x pair columns [c0, c0 + 8) (row-major, kLd words a row) from k stored by
 * columns (col(c) = k's column c at keys j0..): each column pair's 8 words built in a vector,
 * then an 8 x 8 transpose of 32-bit words in registers (the scalar transpose read 2 d_k columns
 * 16 keys at a time and waited on its loads: a quarter of packBf16Head's samples at n 4096,
 * d 128, one load instruction).
 */
template <typename S>
SDPA_PACK_TARGET inline void keyPairs8x8(const S* k, Index kCs, Index c0, std::uint32_t* kP, Index kLd) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) {
    const __m256i lo = _mm256_cvtepu16_epi32(bf16x8(k + 2 * (c0 + i) * kCs));
    const __m256i hi = _mm256_cvtepu16_epi32(bf16x8(k + (2 * (c0 + i) + 1) * kCs));
    r[i] = _mm256_castsi256_ps(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)));
  }
  __m256 o[8];
  transpose8x8(r, o);
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(reinterpret_cast<float*>(kP + j * kLd + c0), o[j]);
}

/// n entries of a column as bf16 bits into out (16-bit), 8 at a time.
template <typename S>
SDPA_PACK_TARGET inline void bf16Column(const S* x, Index n, std::uint16_t* out) {
  Index i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bf16x8(x + i));
  for (; i < n; ++i) out[i] = static_cast<std::uint16_t>(bf16Bits(x[i]));
}
#undef SDPA_PACK_TARGET
#endif

}  // namespace pack

/// Packs k (n_k x d_k) and v (n_k x d_v), bfloat16 or half, into `words` (bf16HeadWords).
template <typename DK, typename DV>
Bf16Head packBf16Head(const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v, Index bk, bool amx,
                      std::uint32_t* words) {
  static_assert(bool(DK::Flags & Eigen::DirectAccessBit) && bool(DV::Flags & Eigen::DirectAccessBit),
                "packBf16Head reads k and v through their strides");
  using S = typename DK::Scalar;
  const Index nK = k.rows(), dK = k.cols(), dV = v.cols(), nK2 = (nK + 1) / 2;
  const Bf16Layout lay(nK, dK, dV, amx);
  const Index dK2 = lay.dK2, kLd = lay.kLd, vLd = lay.vLd, kWords = lay.kWords, dVp = lay.dVp;
  std::uint32_t* kP = words;
  std::uint32_t* vP = kP + kWords;
  auto* finite = reinterpret_cast<unsigned char*>(vP + dVp * vLd);
  const S* kD = k.derived().data();
  const S* vD = v.derived().data();
  const Index kRs = k.derived().rowStride(), kCs = k.derived().colStride();
  const Index vRs = v.derived().rowStride(), vCs = v.derived().colStride();
  // The pair (column 2 c2, 2 c2 + 1) of k's row j; a missing partner 0.
  const auto keyPair = [&](Index j, Index c2) {
    const S* x = kD + j * kRs + 2 * c2 * kCs;
    return bf16Bits(x[0]) | (2 * c2 + 1 < dK ? bf16Bits(x[kCs]) << 16 : 0u);
  };
#if SDPA_HAS_ISA_DISPATCH
  const bool vector = IsaChoice::current() >= Isa::Avx512Bf16;
#endif
  if (amx) {
    // A transpose into rows of kLd words, every word past the pairs 0.
    Index j0 = 0;
#if SDPA_HAS_ISA_DISPATCH
    if (vector && kRs == 1)
      for (; j0 + 8 <= nK; j0 += 8) {
        Index c2 = 0;
        if (dK % 2 == 0)
          for (; c2 + 8 <= dK2; c2 += 8) pack::keyPairs8x8(kD + j0, kCs, c2, kP + j0 * kLd, kLd);
        for (Index j = j0; j < j0 + 8; ++j) {
          for (Index c = c2; c < dK2; ++c) kP[j * kLd + c] = keyPair(j, c);
          std::fill(kP + j * kLd + dK2, kP + (j + 1) * kLd, 0u);
        }
      }
#endif
    for (; j0 < nK; ++j0) {
      for (Index c2 = 0; c2 < dK2; ++c2) kP[j0 * kLd + c2] = keyPair(j0, c2);
      std::fill(kP + j0 * kLd + dK2, kP + (j0 + 1) * kLd, 0u);
    }
    std::fill(kP + nK * kLd, kP + kWords, 0u);
  } else {
    for (Index c2 = 0; c2 < dK2; ++c2) {
      std::uint32_t* row = kP + c2 * kLd;
      for (Index j = 0; j < nK; ++j) row[j] = keyPair(j, c2);
    }
  }
  // v's columns: pairs of consecutive keys, that is a column's own bf16 values in order.
  for (Index c = 0; c < dV; ++c) {
    std::uint32_t* col = vP + c * vLd;
    auto* col16 = reinterpret_cast<std::uint16_t*>(col);
    const S* x = vD + c * vCs;
#if SDPA_HAS_ISA_DISPATCH
    if (vector && vRs == 1) {
      pack::bf16Column(x, nK, col16);
    } else
#endif
    {
      for (Index j = 0; j < nK; ++j) col16[j] = static_cast<std::uint16_t>(bf16Bits(x[j * vRs]));
    }
    if (nK % 2 != 0) col16[nK] = 0;  // the missing partner
    // The AMX products read blocks of 32 keys (16 pairs) up to the column's end.
    if (amx) std::fill(col + nK2, col + vLd, 0u);
  }
  if (amx) std::fill(vP + dV * vLd, vP + dVp * vLd, 0u);
  // Each key tile's values finite: bk is even, so a tile is whole pairs.
  const Index tiles = (nK + bk - 1) / bk;
  std::fill(finite, finite + tiles, static_cast<unsigned char>(1));
  for (Index c = 0; c < dV; ++c) {
    const auto* col16 = reinterpret_cast<const std::uint16_t*>(vP + c * vLd);
    for (Index t = 0; t < tiles; ++t)
      if (finite[t] != 0 && !pack::bf16Finite(col16 + t * bk, std::min(bk, nK - t * bk))) finite[t] = 0;
  }
  return {kP, vP, finite, kLd, vLd, amx};
}

/**
 * The keys of a partial tile (rows [i0, i0 + bq) x keys [j0, j0 + cols)) that each group of
 * `group` rows sees: every key outside [begin[g], end[g]) (offsets in the tile) is hidden from
 * all rows of group g, found in chunks of 16 keys; begin = end where it sees none. A causal
 * diagonal tile of 256 x 256 keeps 56% of its entries with groups of 32 rows.
 */
template <typename Mask>
void groupKeyRanges(const Mask& mask, Index i0, Index bq, Index j0, Index cols, Index nQ, Index nK, Index head,
                    Index group, Index groups, Index* begin, Index* end) {
  constexpr Index chunk = 16;
  for (Index g = 0; g < groups; ++g) {
    const Index r0 = i0 + g * group, rows = std::min(group, bq - g * group);
    Index b = cols, e = 0;
    if (rows > 0)
      for (Index c = 0; c < cols; c += chunk) {
        const Index w = std::min(chunk, cols - c);
        if (mask.classify(r0, rows, j0 + c, w, nQ, nK, head) == mask::Tile::Hidden) continue;
        b = std::min(b, c);
        e = c + w;
      }
    begin[g] = b;
    end[g] = std::max(b, e);
  }
}

/// Per-thread buffers: q^T, S^T and acc^T of one query block; m, l, a tile's maxima, bad rows;
/// the key range of each lane group in a partial tile.
struct Scratch {
  Buffer<float> qT, sT, accT, max, sum, top, bad;
  Buffer<float> rawT, figures;  // a DiagnosticsSink's: the products, a tile's figures
  Buffer<double> laneStats;     // its lanes' running figures (addStats)
  Buffer<Index> keyBegin, keyEnd;
  Buffer<float> kTile, vTile;    // the fp32 kernel's k and v tiles, packed (packKeys, packValues)
  Buffer<std::uint32_t> qP, pP;  // the bf16 kernel's q^T and weights, in pairs
  static Scratch& thread() {
    thread_local Scratch scratch;
    return scratch;
  }
};

/**
 * Query rows [i0, i0 + bq) of one head (q n_q x d_k, k n_k x d_k, v n_k x d_v, any strides)
 * against every key, in tiles of bk keys, written to out (bq x d_v) and lse (bq): the result of
 * forward_tiled_impl's stream + finish on such inputs. `bounds` (logitBounds of the head): where
 * a logit may overflow, the tiles are checked and a row that meets a NaN or +inf logit is NaN
 * (the general kernel's rule); where they allow it and the mask only hides, base-2 tiles.
 * Float k and v take fp32 products (`fold`: tau folded into q), q float or half (converted,
 * exactly, block by block). bfloat16 or half k and v (packed in `bf`, bk even) take the bf16
 * products, tau applied to the fp32 logits. Everything after the logits is the same code.
 * `stats` (bq rows, or null): a DiagnosticsSink's rows, streamed from each tile's logits (the
 * weights then go to a buffer of their own, so the output is the same to the bit).
 */
template <typename DQ, typename DK, typename DV, typename Mask, typename DOut, typename DLse>
void forwardBlock(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                  float tau, bool fold, LogitBounds bounds, const Mask& mask, Index head, Index i0, Index bq, Index bk,
                  const Eigen::MatrixBase<DOut>& out_, const Eigen::MatrixBase<DLse>& lse_,
                  const Bf16Head* bf = nullptr, RowStats* stats = nullptr) {
#if SDPA_HAS_ISA_DISPATCH
  using In = typename DK::Scalar;  // k and v's: what the products take
  constexpr bool Bf16 = !std::is_same_v<In, float>;
  static_assert(!Bf16 || std::is_same_v<In, Eigen::bfloat16> || std::is_same_v<In, Eigen::half>,
                "the fast kernel takes float, bfloat16 or half k and v");
  auto& out = const_cast<Eigen::MatrixBase<DOut>&>(out_);  // Eigen's idiom to write into blocks
  auto& lse = const_cast<Eigen::MatrixBase<DLse>&>(lse_);
  const Isa isa = IsaChoice::current();
  const Index nQ = q.rows(), nK = k.rows(), dK = q.cols(), dV = v.cols();
  const Index step = isa >= Isa::Avx512 ? avx512::L : avx2::L;
  const Index lanes = (bq + step - 1) / step * step;
  // The fp32 kernel takes each key tile one lane group at a time (its logits, softmax and values
  // products for `step` query rows), so that the group's logits (b_k x step) stay in L1 from one
  // to the next instead of a whole b_q x b_k tile passing through L2 three times (n 4096, d 128:
  // the products' rate 175 -> 200 GFLOP/s). Its q^T and acc^T are packed by group: lane i of row
  // r at (i - i % gl) rows + r gl + i % gl, each group's slice contiguous (no power-of-two stride
  // between its rows). The bf16 kernel does the same (n 4096, d 128, AMX, one thread: 17-18 ->
  // 14-14.6 ms), its q pairs packed once for all lanes (qP: dK2p x lanes), read group by group.
  const Index gl = step;  // lanes per group: the row stride within its slice
  Scratch& sc = Scratch::thread();
  // Base-2 tiles: where the mask only hides (it commutes with scaling), log2(e) joins the scale
  // and the softmax takes exp2, whose reduction is cheaper than exp's (vexp2): the logits, their
  // maxima m and the weights are those of the natural tile in units of ln 2, and lse = m ln 2 +
  // log l. Not where q tau log2(e) might overflow a float that q tau does not.
  const bool base2 = mask.onlyHides() && bounds.base2;
  const float unit = base2 ? 1.44269504088896341f : 1.0f;
  // q^T (d_k x lanes), the scale folded in where foldsScaleIntoQuery says so; lanes past bq are
  // 0 (their logits are 0, never read back). The bf16 kernel's q^T holds pairs of q's own bf16
  // values (ceil(d_k / 2) x lanes, a missing partner 0) and its products apply the scale.
  if constexpr (Bf16) fold = true;  // the logits leave the products scaled
  const float qScale = fold ? tau * unit : 1.0f, tileScale = fold ? 1.0f : tau * unit;
  float* qT = nullptr;
  std::uint32_t* qP = nullptr;
  // The AMX products read whole tiles: q's pairs and acc's columns padded with zeros (to 16
  // pairs, 32 columns).
  const bool amx = Bf16 && bf->amx;
  const Bf16Layout lay(nK, dK, dV, amx);
  const Index dK2 = lay.dK2, dK2p = lay.dK2p, dVp = lay.dVp;
  std::optional<amx::Session> tileUnit;
  if (amx) tileUnit.emplace();
  if constexpr (Bf16) {
    qP = sc.qP.get(dK2p * lanes);
    std::fill(qP + dK2 * lanes, qP + dK2p * lanes, 0u);
    for (Index c2 = 0; c2 < dK2; ++c2) {
      std::uint32_t* row = qP + c2 * lanes;
      for (Index i = 0; i < bq; ++i) row[i] = bf16Bits(q(i0 + i, 2 * c2));
      if (2 * c2 + 1 < dK)
        for (Index i = 0; i < bq; ++i) row[i] |= bf16Bits(q(i0 + i, 2 * c2 + 1)) << 16;
      std::fill(row + bq, row + lanes, 0u);
    }
  } else {
    qT = sc.qT.get(dK * lanes);
    for (Index g = 0; g < lanes; g += gl) {
      const Index rows = std::min(gl, bq - g);
      for (Index c = 0; c < dK; ++c) {
        float* row = qT + g * dK + c * gl;
        for (Index i = 0; i < rows; ++i)
          row[i] = qScale == 1.0f ? float(q(i0 + g + i, c)) : qScale * float(q(i0 + g + i, c));
        std::fill(row + rows, row + gl, 0.0f);
      }
    }
  }
  float* sT = sc.sT.get(bk * gl);  // one group's logits
  // With a sink, the raw q.k is the product / (tau unit) where a softcap or a bias keeps it from
  // being the logit / tau.
  const bool rawNeeded = stats && !rawIsLogitOverTau(mask, tau);
  float* rawT = rawNeeded ? sc.rawT.get(bk * gl) : nullptr;
  float* figures = stats ? sc.figures.get(kTileFigures * gl) : nullptr;
  // Each group's running figures (kLaneFigures x gl) at g kLaneFigures, as q^T's slices.
  double* laneStats = stats ? sc.laneStats.get(kLaneFigures * lanes) : nullptr;
  if (stats) {
    std::fill(laneStats, laneStats + kLaneFigures * lanes, 0.0);
    for (Index g = 0; g < lanes; g += gl) {
      double* f = laneStats + g * kLaneFigures;
      std::fill(f + kMin * gl, f + (kMin + 1) * gl, std::numeric_limits<double>::infinity());
      for (const int x : {int(kBelow), int(kM)})
        std::fill(f + x * gl, f + (x + 1) * gl, -std::numeric_limits<double>::infinity());
    }
  }
  const float limit16 = float(11.089866488461016 * unit), limit32 = float(88.72283905206835 * unit);
  const double toNatural = base2 ? 0.6931471805599453 : 1.0;
  std::uint32_t* pP = Bf16 ? sc.pP.get((bk + 1) / 2 * lanes) : nullptr;
  float* accT = sc.accT.get(dVp * lanes);
  float* m = sc.max.get(lanes);
  float* l = sc.sum.get(lanes);
  float* top = sc.top.get(lanes);
  float* bad = sc.bad.get(lanes);
  std::fill(bad, bad + lanes, 0.0f);
  std::fill(accT, accT + dVp * lanes, 0.0f);
  std::fill(m, m + lanes, -std::numeric_limits<float>::infinity());
  std::fill(l, l + lanes, 0.0f);
  // The fp32 kernel's k and v tiles, packed in the micro-tiles' panels (packKeys, packValues),
  // from either storage order. Read in place, a micro-tile's broadcasts come from a stream per
  // key or column (a pointer register each), and at n_k = 4096 the columns of a column-major
  // head lie 16 KiB apart, so those a micro-tile reads share one L1 set and evict each other.
  // Packed: n 4096, one thread, logits 200 -> 228 GFLOP/s at d 256, 215 -> 230 at d 128 (the
  // micro-kernels alone). A copy costs (d_k + d_v) loads and stores per key against 4 b_q d FLOPs.
  float* kTile = Bf16 ? nullptr : sc.kTile.get(bk * dK);
  float* vTile = Bf16 ? nullptr : sc.vTile.get(bk * dV);
  // A partial tile's corners: per lane group, the keys outside [begin, end) hidden from all its
  // rows are neither multiplied nor exponentiated (groupKeyRanges).
  const Index group = step, groups = lanes / step;
  Index* keyBegin = sc.keyBegin.get(groups);
  Index* keyEnd = sc.keyEnd.get(groups);
  for (Index j0 = 0; j0 < nK; j0 += bk) {
    const Index cols = std::min(bk, nK - j0);
    const mask::Tile t = mask.classify(i0, bq, j0, cols, nQ, nK, head);
    if (t == mask::Tile::Hidden) continue;
    const bool ranged = t == mask::Tile::Partial;
    if (ranged) groupKeyRanges(mask, i0, bq, j0, cols, nQ, nK, head, group, groups, keyBegin, keyEnd);
    const Index* rb = ranged ? keyBegin : nullptr;
    const Index* re = ranged ? keyEnd : nullptr;
    // The products' epilogue finds the maxima where the logits are final there: no mask to
    // apply, no scale to multiply by.
    const bool plain = t == mask::Tile::Visible && fold;
    if (plain) std::fill(top, top + lanes, -std::numeric_limits<float>::infinity());
    bool vFinite = true;
    if constexpr (Bf16) {
      vFinite = bf->vFinite[j0 / bk] != 0;
    } else {
      const float* kSrc = k.derived().data() + j0 * k.derived().rowStride();
      const float* vSrc = v.derived().data() + j0 * v.derived().rowStride();
      const Index kRs = k.derived().rowStride(), kCs = k.derived().colStride();
      const Index vRs = v.derived().rowStride(), vCs = v.derived().colStride();
      if (isa >= Isa::Avx512) {
        avx512::packKeys(kSrc, kRs, kCs, cols, dK, kTile);
        avx512::packValues(vSrc, vRs, vCs, cols, dV, vTile);
      } else {
        avx2::packKeys(kSrc, kRs, kCs, cols, dK, kTile);
        avx2::packValues(vSrc, vRs, vCs, cols, dV, vTile);
      }
      vFinite = allFiniteVectorised(Eigen::Map<const Eigen::VectorXf>(vTile, cols * dV));
    }
    // A mask may bring NaN or +inf (its bias), and so may products that can overflow.
    const bool checked = !bounds.bounded || t == mask::Tile::Partial;
    // A sink's figures: those the softmax cannot give first (the logits then become weights),
    // the rest from inside the softmax's pass.
    const int statsMode = !stats ? kNoStats : t == mask::Tile::Visible && !checked ? kStatsVisible : kStatsAny;
    const float rawScale = 1.0f / (fold ? tau * unit : 1.0f);
    for (Index g = 0; g < lanes; g += gl) {
      const Index rows = std::min(gl, bq - g);
      // The group's key ranges (KeyRanges: each ISA has its own, built at the calls).
      const Index* kb = rb ? rb + g / group : nullptr;
      const Index* ke = re ? re + g / group : nullptr;
      float* tileMax = plain ? top + g : nullptr;
      float* accG = accT + g * dVp;
      if constexpr (Bf16) {
        if (amx) {
          amx::logits(qP + g, lanes, gl, dK2p, bf->kP + j0 * bf->kLd, bf->kLd, {kb, ke, cols}, sT);
          // A tile of finite logits, all visible, no figures to take, finite values: its
          // softmax straight into the weights' pairs.
          if (t == mask::Tile::Visible && !checked && !stats && vFinite) {
            if (base2)
              amx::softmaxPairs<true>(sT, gl, cols, tau * unit, m + g, l + g, accG, dV, pP);
            else
              amx::softmaxPairs<false>(sT, gl, cols, tau * unit, m + g, l + g, accG, dV, pP);
            amx::values(pP, gl, {kb, ke, cols}, bf->vP + j0 / 2, bf->vLd, dVp, accG);
            continue;
          }
          amx::scaleAndMax(sT, gl, {kb, ke, cols}, tau * unit, tileMax);
        } else {
          avx512bf16::logits(qP + g, lanes, gl, dK2, bf->kP + j0, bf->kLd, tau * unit, {kb, ke, cols}, sT, tileMax);
        }
      } else {
        if (isa >= Isa::Avx512)
          avx512::logits(qT + g * dK, gl, dK, kTile, {kb, ke, cols}, sT, tileMax);
        else
          avx2::logits(qT + g * dK, gl, dK, kTile, {kb, ke, cols}, sT, tileMax);
      }
      if (rawNeeded) std::copy(sT, sT + cols * gl, rawT);
      // The group's tile as the masks see it: rows x cols, S(i, j) at sT[j gl + i].
      Eigen::Map<Matrix<float>, 0, Eigen::OuterStride<>> s(sT, rows, cols, Eigen::OuterStride<>(gl));
      // Entries out of range are hidden and never read by the softmax; the scale and a mask that
      // does more than hide read every entry, so there they are given a value first.
      if (ranged && (!fold || !mask.onlyHides()))
        for (Index h = 0; h < rows; h += group) {
          const Index n = std::min(group, rows - h), b = keyBegin[(g + h) / group], e = keyEnd[(g + h) / group];
          s.block(h, 0, n, b).setConstant(-std::numeric_limits<float>::infinity());
          s.block(h, e, n, cols - e).setConstant(-std::numeric_limits<float>::infinity());
        }
      if (!fold) s *= tileScale;
      if (t == mask::Tile::Partial) mask.apply(s, i0 + g, j0, nQ, nK, head);
      double* laneStatsG = stats ? laneStats + g * kLaneFigures : nullptr;
      bool counted = false;  // any logit past exp's fp16 range (statsBeforeSoftmax)
      if (isa >= Isa::Avx512) {
        if (stats)
          counted =
              avx512::statsBeforeSoftmax(sT, rawT, rawScale, gl, {kb, ke, cols}, tileMax, limit16, limit32, figures);
        if (base2)
          avx512::softmaxTileWith<true>(statsMode, sT, gl, {kb, ke, cols}, tileMax, checked, m + g, l + g, accG, dV,
                                        bad + g, figures);
        else
          avx512::softmaxTileWith<false>(statsMode, sT, gl, {kb, ke, cols}, tileMax, checked, m + g, l + g, accG, dV,
                                         bad + g, figures);
        if (stats) avx512::addStats(figures, m + g, gl, j0, rawNeeded, counted, laneStatsG);
      } else {
        if (stats)
          counted =
              avx2::statsBeforeSoftmax(sT, rawT, rawScale, gl, {kb, ke, cols}, tileMax, limit16, limit32, figures);
        if (base2)
          avx2::softmaxTileWith<true>(statsMode, sT, gl, {kb, ke, cols}, tileMax, checked, m + g, l + g, accG, dV,
                                      bad + g, figures);
        else
          avx2::softmaxTileWith<false>(statsMode, sT, gl, {kb, ke, cols}, tileMax, checked, m + g, l + g, accG, dV,
                                       bad + g, figures);
        if (stats) avx2::addStats(figures, m + g, gl, j0, rawNeeded, counted, laneStatsG);
      }
      if (!vFinite) {  // reads v in place
        const Index vRs = v.derived().rowStride(), vCs = v.derived().colStride();
        valuesSkippingZeros(sT, gl, rows, cols, kb, ke, group, v.derived().data() + j0 * vRs, vRs, vCs, dV, accG);
      } else if constexpr (Bf16) {
        if (amx) {
          avx512bf16::weightPairs(sT, gl, {kb, ke, cols}, pP, amx::kKeys);
          amx::values(pP, gl, {kb, ke, cols}, bf->vP + j0 / 2, bf->vLd, dVp, accG);
        } else {
          avx512bf16::weightPairs(sT, gl, {kb, ke, cols}, pP);
          avx512bf16::values(pP, gl, {kb, ke, cols}, bf->vP + j0 / 2, bf->vLd, dV, accG);
        }
      } else if (isa >= Isa::Avx512) {
        avx512::values(sT, gl, {kb, ke, cols}, vTile, dV, accG);
      } else {
        avx2::values(sT, gl, {kb, ke, cols}, vTile, dV, accG);
      }
    }
  }
  // OnlineSoftmax::finish: out = acc / l by the reciprocal, 0 and -inf for a row that saw nothing.
  constexpr float minusInf = -std::numeric_limits<float>::infinity();
  float* r = sc.sum.get(lanes);  // l, turned into 1 / l in place
  // A row that met a NaN or +inf logit is NaN, as the naive kernel's rule says.
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  for (Index i = 0; i < bq; ++i) {
    const float top = base2 ? float(double(m[i]) * 0.6931471805599453) : m[i];  // m ln 2, one rounding
    lse(i) = bad[i] != 0.0f ? nan : m[i] == minusInf ? minusInf : top + std::log(l[i]);
    r[i] = bad[i] != 0.0f ? nan : m[i] == minusInf ? 0.0f : 1.0f / l[i];
  }
  using OutScalar = typename DOut::Scalar;
  for (Index g = 0; g < bq; g += gl)
    for (Index c = 0; c < dV; ++c) {
      const float* a = accT + g * dVp + c * gl;
      for (Index i = g; i < std::min(bq, g + gl); ++i) out(i, c) = OutScalar(bad[i] != 0.0f ? nan : r[i] * a[i - g]);
    }
  for (Index i = 0; stats && i < bq; ++i) {
    const auto lane = [&](int x) { return laneStats[(i - i % gl) * kLaneFigures + x * gl + i % gl]; };
    RowStream row;
    row.m = lane(kM);
    TileSums& x = row.t;
    x.visible = lane(kVisible), x.sum = lane(kSum), x.sumSq = lane(kSumSq), x.es = lane(kEs), x.atMax = lane(kAtMax);
    x.o1 = lane(kO1), x.o2 = lane(kO2), x.o3 = lane(kO3), x.min = lane(kMin);
    x.top = row.m;  // the softmax's maximum is the row's largest logit
    x.second = x.atMax >= 2 ? row.m : lane(kBelow);
    x.argmax = Index(lane(kArgmax)), x.rawSum = lane(kRawSum), x.rawSumSq = lane(kRawSumSq);
    x.over16 = lane(kOver16), x.over32 = lane(kOver32);
    stats[i] = row.finish(double(lse(i)), toNatural, rawNeeded ? 0.0 : tau);
  }
#else
  (void)q, (void)k, (void)v, (void)tau, (void)fold, (void)bounds, (void)mask, (void)head, (void)i0, (void)bq, (void)bk;
  (void)out_, (void)lse_, (void)bf, (void)stats;
#endif
}

}  // namespace fast
}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_FORWARD_FAST_HPP
