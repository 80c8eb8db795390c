#ifndef SDPA_INTERNAL_KV_QUANT_HPP
#define SDPA_INTERNAL_KV_QUANT_HPP

// Quantised k and v of a KvCache (int8 and 4-bit codes with an fp16 scale per block of 32
// values, the sizes of ggml's q8_0 and q4_0) and the decoding products that read them with the
// dequantisation in registers. A block is 32 consecutive keys of one channel: the cache stores
// each head's k and v column-major (a channel's keys contiguous), the layout the decoding
// kernels stream, and a channel's scale also follows the per-channel outliers of k (KIVI, Liu
// et al. 2024).
//
// A group (32 keys of one head, d channels) is d fp16 scales, then the codes channel by channel:
// q8 32 bytes per channel (int8), q4 16 bytes (byte i: key i in the low nibble, key i + 16 in the
// high one, each code + 8).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu.hpp"
#include "macros.hpp"

#if SDPA_HAS_ISA_DISPATCH
#include <immintrin.h>
#endif

namespace sdpa {
namespace kv {

/// \brief KvCache storage: int8 codes and an fp16 scale per 32 keys of a channel (1.0625 bytes
/// per value, ggml's q8_0 size). Error per value at most half a step, step = max |x| / 127.
struct Q8 {
  static constexpr int Bits = 8;
  static constexpr int MaxCode = 127;
};
/// \brief KvCache storage: 4-bit codes and an fp16 scale per 32 keys of a channel (0.5625 bytes
/// per value, ggml's q4_0 size). Error per value at most half a step, step = max |x| / 7.
struct Q4 {
  static constexpr int Bits = 4;
  static constexpr int MaxCode = 7;
};

}  // namespace kv

namespace internal::quant {

template <typename T>
inline constexpr bool IsQuantised = std::is_same_v<T, kv::Q8> || std::is_same_v<T, kv::Q4>;

/// Keys per group (a scale's block).
inline constexpr Index kGroup = 32;

/// Code bytes of one channel of a group.
template <typename F>
inline constexpr Index kCodeBytes = F::Bits* kGroup / 8;

/// Bytes of a group of d channels: d fp16 scales, then the codes.
template <typename F>
Index groupBytes(Index d) {
  return d * Index(sizeof(std::uint16_t) + kCodeBytes<F>);
}

/// The smallest fp16 scale >= absmax / maxCode: then |x| / scale <= maxCode for every x of the
/// block, no code is clamped and each value's error is at most scale / 2. Throws nothing: the
/// caller checked absmax / maxCode <= 65504 (the largest half).
inline std::uint16_t scaleFor(float absmax, int maxCode) {
  const float want = absmax / float(maxCode);
  Eigen::half h(want);
  if (float(h) < want) h = Eigen::half(std::nextafter(float(h), std::numeric_limits<float>::infinity()));
  // nextafter in float lands between two halves, whose rounding may go back down: step the bits.
  if (float(h) < want)
    h = Eigen::numext::bit_cast<Eigen::half>(std::uint16_t(Eigen::numext::bit_cast<std::uint16_t>(h) + 1));
  return Eigen::numext::bit_cast<std::uint16_t>(h);
}

inline float halfBits(std::uint16_t bits) { return float(Eigen::numext::bit_cast<Eigen::half>(bits)); }

/// The largest |x| a group of format F can hold (its scale is an fp16).
template <typename F>
constexpr float maxMagnitude() {
  return 65504.0f * float(F::MaxCode);
}

/// Writes one group: x holds 32 keys x d channels column-major (channel c at x + c ldx).
template <typename F>
void quantiseGroup(const float* x, Index ldx, Index d, unsigned char* group) {
  auto* scales = group;
  unsigned char* codes = group + d * Index(sizeof(std::uint16_t));
  for (Index c = 0; c < d; ++c) {
    const float* col = x + c * ldx;
    float absmax = 0.0f;
    for (Index i = 0; i < kGroup; ++i) absmax = std::max(absmax, std::abs(col[i]));
    const std::uint16_t bits = scaleFor(absmax, F::MaxCode);
    std::memcpy(scales + c * Index(sizeof bits), &bits, sizeof bits);
    const float scale = halfBits(bits);
    int code[kGroup];
    for (Index i = 0; i < kGroup; ++i) {
      // x / scale rounded, not x * (1 / scale): the bound |x - scale code| <= scale / 2 needs the
      // exact quotient's rounding (and |x / scale| <= MaxCode holds by scaleFor).
      const float t = scale > 0.0f ? col[i] / scale : 0.0f;
      code[i] = std::clamp(int(std::lround(t)), -F::MaxCode, F::MaxCode);
    }
    unsigned char* out = codes + c * kCodeBytes<F>;
    if constexpr (F::Bits == 8) {
      for (Index i = 0; i < kGroup; ++i) out[i] = static_cast<unsigned char>(static_cast<std::int8_t>(code[i]));
    } else {
      for (Index i = 0; i < kGroup / 2; ++i)
        out[i] = static_cast<unsigned char>((code[i] + 8) | ((code[i + kGroup / 2] + 8) << 4));
    }
  }
}

/// The value of key i (< 32), channel c of a group.
template <typename F>
float dequantised(const unsigned char* group, Index d, Index i, Index c) {
  std::uint16_t bits;
  std::memcpy(&bits, group + c * Index(sizeof bits), sizeof bits);
  const unsigned char* codes = group + d * Index(sizeof bits) + c * kCodeBytes<F>;
  int code;
  if constexpr (F::Bits == 8)
    code = int(codes[i]) - (codes[i] >= 128 ? 256 : 0);  // the byte's two's-complement value
  else
    code = (i < kGroup / 2 ? (codes[i] & 0xF) : (codes[i - kGroup / 2] >> 4)) - 8;
  return halfBits(bits) * float(code);
}

/// Reads a group back into x (32 x d column-major, channel c at x + c ldx).
template <typename F>
void dequantiseGroup(const unsigned char* group, Index d, float* x, Index ldx) {
  for (Index c = 0; c < d; ++c)
    for (Index i = 0; i < kGroup; ++i) x[i + c * ldx] = dequantised<F>(group, d, i, c);
}

// ---------------------------------------------------------------------------------------------
// Decoding products over a chunk of groups g = 0..n-1 (anywhere in memory: groups[g]):
//   logits  s[r][32 g + i] += sum_c (a[r][c] scale_gc) code_gic   (channels in order)
//   values  dots[r][c] = sum_g scale_gc sum_i p[r][32 g + i] code_gic
// Every row's arithmetic is the same whatever rows share the pass (a GQA group's heads or one
// head alone), as decodeLogitsRows's. `as` is scratch of R x d floats.

/// The portable kernels (any CPU; the compiler vectorises what it can).
template <typename F>
void logitsGroupsPortable(const float* const* a, Index R, const unsigned char* const* groups, Index n, Index d,
                          float* const* s, float* as) {
  for (Index g = 0; g < n; ++g) {
    const unsigned char* group = groups[g];
    for (Index c = 0; c < d; ++c) {
      std::uint16_t bits;
      std::memcpy(&bits, group + c * Index(sizeof bits), sizeof bits);
      const float scale = halfBits(bits);
      for (Index r = 0; r < R; ++r) as[r * d + c] = a[r][c] * scale;
    }
    const unsigned char* codes = group + d * Index(sizeof(std::uint16_t));
    for (Index r = 0; r < R; ++r) {
      float* out = s[r] + g * kGroup;
      for (Index c = 0; c < d; ++c) {
        const float w = as[r * d + c];
        const unsigned char* cc = codes + c * kCodeBytes<F>;
        if constexpr (F::Bits == 8) {
          for (Index i = 0; i < kGroup; ++i) out[i] += w * float(static_cast<std::int8_t>(cc[i]));
        } else {
          for (Index i = 0; i < kGroup / 2; ++i) {
            out[i] += w * float(int(cc[i] & 0xF) - 8);
            out[i + kGroup / 2] += w * float(int(cc[i] >> 4) - 8);
          }
        }
      }
    }
  }
}

template <typename F>
void valuesGroupsPortable(const float* const* p, Index R, const unsigned char* const* groups, Index n, Index d,
                          float* const* dots) {
  for (Index r = 0; r < R; ++r)
    for (Index c = 0; c < d; ++c) dots[r][c] = 0.0f;
  for (Index g = 0; g < n; ++g) {
    const unsigned char* group = groups[g];
    const unsigned char* codes = group + d * Index(sizeof(std::uint16_t));
    for (Index c = 0; c < d; ++c) {
      std::uint16_t bits;
      std::memcpy(&bits, group + c * Index(sizeof bits), sizeof bits);
      const float scale = halfBits(bits);
      const unsigned char* cc = codes + c * kCodeBytes<F>;
      float x[kGroup];
      if constexpr (F::Bits == 8) {
        for (Index i = 0; i < kGroup; ++i) x[i] = float(static_cast<std::int8_t>(cc[i]));
      } else {
        for (Index i = 0; i < kGroup / 2; ++i) {
          x[i] = float(int(cc[i] & 0xF) - 8);
          x[i + kGroup / 2] = float(int(cc[i] >> 4) - 8);
        }
      }
      for (Index r = 0; r < R; ++r) {
        const float* pr = p[r] + g * kGroup;
        float t = 0.0f;
        for (Index i = 0; i < kGroup; ++i) t += pr[i] * x[i];
        dots[r][c] += scale * t;
      }
    }
  }
}

#if SDPA_HAS_ISA_DISPATCH
// GCC 12 warns of uninitialised values inside its own AVX-512 intrinsics (as forward_fast.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace avx512 {

#define SDPA_QUANT_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))

/// Keys i and i + 16 of a channel's codes as two vectors of 16 floats.
template <typename F>
SDPA_QUANT_TARGET inline void load32(const unsigned char* cc, __m512& x0, __m512& x1) {
  if constexpr (F::Bits == 8) {
    x0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cc))));
    x1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cc + 16))));
  } else {
    // A nibble indexes a table of the 16 values code - 8 (vpermps reads the low 4 bits).
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cc)));
    x0 = _mm512_permutexvar_ps(bytes, table);
    x1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
}

/// Four partial sums per key, over the channels c = 0, 1, 2, 3 (mod 4), added at the end:
/// one fused multiply-add chain per key would wait on the FMA latency (4 cycles) at every
/// channel. Every row's arithmetic is the same whatever Rows.
template <typename F, int Rows>
SDPA_QUANT_TARGET void logitsRows(const float* const* as, Index d, const unsigned char* codes, float* const* out) {
  constexpr int P = 4;
  __m512 acc[Rows][P][2];
  for (int m = 0; m < Rows; ++m)
    for (int t = 0; t < P; ++t) acc[m][t][0] = acc[m][t][1] = _mm512_setzero_ps();
  Index c = 0;
  for (; c + P <= d; c += P)
    for (int t = 0; t < P; ++t) {
      __m512 x0, x1;
      load32<F>(codes + (c + t) * kCodeBytes<F>, x0, x1);
      for (int m = 0; m < Rows; ++m) {
        const __m512 w = _mm512_set1_ps(as[m][c + t]);
        acc[m][t][0] = _mm512_fmadd_ps(w, x0, acc[m][t][0]);
        acc[m][t][1] = _mm512_fmadd_ps(w, x1, acc[m][t][1]);
      }
    }
  for (int t = 0; c < d; ++c, ++t) {
    __m512 x0, x1;
    load32<F>(codes + c * kCodeBytes<F>, x0, x1);
    for (int m = 0; m < Rows; ++m) {
      const __m512 w = _mm512_set1_ps(as[m][c]);
      acc[m][t][0] = _mm512_fmadd_ps(w, x0, acc[m][t][0]);
      acc[m][t][1] = _mm512_fmadd_ps(w, x1, acc[m][t][1]);
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (Index h = 0; h < 2; ++h) {
      const __m512 sum =
          _mm512_add_ps(_mm512_add_ps(acc[m][0][h], acc[m][1][h]), _mm512_add_ps(acc[m][2][h], acc[m][3][h]));
      _mm512_storeu_ps(out[m] + 16 * h, _mm512_add_ps(_mm512_loadu_ps(out[m] + 16 * h), sum));
    }
}

template <typename F>
SDPA_QUANT_TARGET void logitsGroups(const float* const* a, Index R, const unsigned char* const* groups, Index n,
                                    Index d, float* const* s, float* as) {
  constexpr Index kRows = 3;
  const float* asRows[kRows];
  float* out[kRows];
  for (Index g = 0; g < n; ++g) {
    const unsigned char* group = groups[g];
    const auto* scales = reinterpret_cast<const std::uint16_t*>(group);
    // as[r][c] = a[r][c] scale_gc, 16 channels at a time.
    Index c = 0;
    for (; c + 16 <= d; c += 16) {
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + c)));
      for (Index r = 0; r < R; ++r) _mm512_storeu_ps(as + r * d + c, _mm512_mul_ps(_mm512_loadu_ps(a[r] + c), sc));
    }
    for (; c < d; ++c) {
      const float sc = _cvtsh_ss(scales[c]);
      for (Index r = 0; r < R; ++r) as[r * d + c] = a[r][c] * sc;
    }
    const unsigned char* codes = group + d * Index(sizeof(std::uint16_t));
    for (Index r0 = 0; r0 < R; r0 += kRows) {
      const Index rows = std::min(kRows, R - r0);
      for (Index m = 0; m < rows; ++m) {
        asRows[m] = as + (r0 + m) * d;
        out[m] = s[r0 + m] + g * kGroup;
      }
      switch (rows) {
        case 1:
          logitsRows<F, 1>(asRows, d, codes, out);
          break;
        case 2:
          logitsRows<F, 2>(asRows, d, codes, out);
          break;
        default:
          logitsRows<F, 3>(asRows, d, codes, out);
          break;
      }
    }
  }
}

/// dots for Rows rows and Cols channels from c0, over every group.
template <typename F, int Rows, int Cols>
SDPA_QUANT_TARGET void valuesBlock(const float* const* p, const unsigned char* const* groups, Index n, Index d,
                                   Index c0, float* const* dots) {
  __m512 acc[Rows][Cols];
  for (int m = 0; m < Rows; ++m)
    for (int c = 0; c < Cols; ++c) acc[m][c] = _mm512_setzero_ps();
  const Index codeBase = d * Index(sizeof(std::uint16_t));
  for (Index g = 0; g < n; ++g) {
    const unsigned char* group = groups[g];
    const auto* scales = reinterpret_cast<const std::uint16_t*>(group);
    __m512 p0[Rows], p1[Rows];
    for (int m = 0; m < Rows; ++m) {
      p0[m] = _mm512_loadu_ps(p[m] + g * kGroup);
      p1[m] = _mm512_loadu_ps(p[m] + g * kGroup + 16);
    }
    // The block's scales converted at once (a broadcast from memory then costs no shuffle).
    alignas(32) float sc8[8];
    if constexpr (Cols == 8) {
      _mm256_store_ps(sc8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + c0))));
    } else {
      for (int c = 0; c < Cols; ++c) sc8[c] = _cvtsh_ss(scales[c0 + c]);
    }
    for (int c = 0; c < Cols; ++c) {
      __m512 x0, x1;
      load32<F>(group + codeBase + (c0 + c) * kCodeBytes<F>, x0, x1);
      const __m512 sc = _mm512_set1_ps(sc8[c]);
      for (int m = 0; m < Rows; ++m) {
        const __m512 t = _mm512_fmadd_ps(p1[m], x1, _mm512_mul_ps(p0[m], x0));
        acc[m][c] = _mm512_fmadd_ps(sc, t, acc[m][c]);
      }
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (int c = 0; c < Cols; ++c) dots[m][c0 + c] = _mm512_reduce_add_ps(acc[m][c]);
}

template <typename F, int Rows>
SDPA_QUANT_TARGET void valuesRows(const float* const* p, const unsigned char* const* groups, Index n, Index d,
                                  float* const* dots) {
  constexpr int kCols = Rows <= 2 ? 8 : 4;
  Index c0 = 0;
  for (; c0 + kCols <= d; c0 += kCols) valuesBlock<F, Rows, kCols>(p, groups, n, d, c0, dots);
  for (; c0 < d; ++c0) valuesBlock<F, Rows, 1>(p, groups, n, d, c0, dots);
}

template <typename F>
SDPA_QUANT_TARGET void valuesGroups(const float* const* p, Index R, const unsigned char* const* groups, Index n,
                                    Index d, float* const* dots) {
  constexpr Index kRows = 4;
  for (Index r0 = 0; r0 < R; r0 += kRows) {
    switch (std::min(kRows, R - r0)) {
      case 1:
        valuesRows<F, 1>(p + r0, groups, n, d, dots + r0);
        break;
      case 2:
        valuesRows<F, 2>(p + r0, groups, n, d, dots + r0);
        break;
      case 3:
        valuesRows<F, 3>(p + r0, groups, n, d, dots + r0);
        break;
      default:
        valuesRows<F, 4>(p + r0, groups, n, d, dots + r0);
        break;
    }
  }
}

#undef SDPA_QUANT_TARGET

}  // namespace avx512
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

/// The decoding logits over n groups (see above), on the CPU's fastest path.
template <typename F>
void logitsGroups(const float* const* a, Index R, const unsigned char* const* groups, Index n, Index d, float* const* s,
                  float* as) {
#if SDPA_HAS_ISA_DISPATCH
  if (IsaChoice::current() >= Isa::Avx512) return avx512::logitsGroups<F>(a, R, groups, n, d, s, as);
#endif
  logitsGroupsPortable<F>(a, R, groups, n, d, s, as);
}

/// The decoding weighted values over n groups (see above), on the CPU's fastest path.
template <typename F>
void valuesGroups(const float* const* p, Index R, const unsigned char* const* groups, Index n, Index d,
                  float* const* dots) {
#if SDPA_HAS_ISA_DISPATCH
  if (IsaChoice::current() >= Isa::Avx512) return avx512::valuesGroups<F>(p, R, groups, n, d, dots);
#endif
  valuesGroupsPortable<F>(p, R, groups, n, d, dots);
}

}  // namespace internal::quant
}  // namespace sdpa

#endif  // SDPA_INTERNAL_KV_QUANT_HPP
