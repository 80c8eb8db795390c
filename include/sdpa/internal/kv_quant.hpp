#ifndef SDPA_INTERNAL_KV_QUANT_HPP
#define SDPA_INTERNAL_KV_QUANT_HPP

// Quantised k and v of a KvCache (int8 and 4-bit codes with an fp16 scale per block of 32
// values, the sizes of ggml's q8_0 and q4_0) and the decoding products that read them without a
// dequantised copy: q8 keys' logits as exact integer dot products, the rest widened to fp32 in
// registers. A block is 32 consecutive keys of one channel: the cache stores each head's k and
// v column-major (a channel's keys contiguous), the layout the decoding kernels stream, and a
// channel's scale also follows the per-channel outliers of k (KIVI, Liu et al. 2024).
//
// A group (32 keys of one head, d channels) is d fp16 scales, then the codes channel by channel:
// q8 32 bytes per channel (int8), q4 16 bytes (byte i: key i in the low nibble, key i + 16 in the
// high one, each code + 8); q8 keys in channel pairs instead (kPaired: 64 bytes per pair, each
// key's two codes adjacent).

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

/// Whether a group keeps its codes in channel pairs: q8 keys, whose logits are integer dot
/// products over pairs of channels (each key's codes of channels 2p and 2p + 1 adjacent: 64 bytes
/// per pair, an odd d padded with a zero channel). Else channel by channel.
template <typename F, bool Keys>
inline constexpr bool kPaired = Keys&& F::Bits == 8;

/// Bytes of a group of d channels: d fp16 scales, then the codes (of keys, or of values).
template <typename F, bool Keys = false>
Index groupBytes(Index d) {
  if constexpr (kPaired<F, Keys>)
    return d * Index(sizeof(std::uint16_t)) + (d + 1) / 2 * 2 * kGroup;
  else
    return d * Index(sizeof(std::uint16_t) + kCodeBytes<F>);
}

/// The group the decoding kernels request while they read group g of groups (n): g + 2, where
/// it or g + 1 lies past a jump in memory (the first groups of a paged block, which the hardware
/// prefetcher does not reach: a q8 cache's blocks of 32 keys decoded 1.5-2.6x slower than the
/// contiguous cache without the requests, 1.1x with them); else null (requests in a contiguous
/// run of groups cost 8% there). Its d scales are requested now; the kernels request its codes
/// a line at a time as they read group g's (all at once, the lines queue behind each other and
/// the kernel's own reads wait: decode_cache.hpp's ColumnsAhead).
template <typename F, bool Keys>
const unsigned char* groupAhead(const unsigned char* const* groups, Index g, Index n, Index d) {
  if (g + 2 >= n) return nullptr;
  const Index bytes = groupBytes<F, Keys>(d);
  if (groups[g + 1] == groups[g] + bytes && groups[g + 2] == groups[g + 1] + bytes) return nullptr;
  for (Index b = 0; b < d * Index(sizeof(std::uint16_t)); b += 64) __builtin_prefetch(groups[g + 2] + b, 0, 2);
  return groups[g + 2];
}

/// Where key i (< 32) of channel c has its code byte (q8), or its nibble's byte (q4).
template <typename F, bool Keys>
Index codeOffset(Index d, Index i, Index c) {
  const Index base = d * Index(sizeof(std::uint16_t));
  if constexpr (kPaired<F, Keys>)
    return base + c / 2 * 2 * kGroup + 2 * i + (c & 1);
  else if constexpr (F::Bits == 8)
    return base + c * kCodeBytes<F> + i;
  else
    return base + c * kCodeBytes<F> + i % (kGroup / 2);
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
template <typename F, bool Keys = false>
void quantiseGroup(const float* x, Index ldx, Index d, unsigned char* group) {
  std::memset(group, 0, size_t(groupBytes<F, Keys>(d)));  // (a paired odd d's padding channel: 0)
  for (Index c = 0; c < d; ++c) {
    const float* col = x + c * ldx;
    float absmax = 0.0f;
    for (Index i = 0; i < kGroup; ++i) absmax = std::max(absmax, std::abs(col[i]));
    const std::uint16_t bits = scaleFor(absmax, F::MaxCode);
    std::memcpy(group + c * Index(sizeof bits), &bits, sizeof bits);
    const float scale = halfBits(bits);
    for (Index i = 0; i < kGroup; ++i) {
      // x / scale rounded, not x * (1 / scale): the bound |x - scale code| <= scale / 2 needs the
      // exact quotient's rounding (and |x / scale| <= MaxCode holds by scaleFor).
      const float t = scale > 0.0f ? col[i] / scale : 0.0f;
      const int code = std::clamp(int(std::lround(t)), -F::MaxCode, F::MaxCode);
      unsigned char* out = group + codeOffset<F, Keys>(d, i, c);
      if constexpr (F::Bits == 8)
        *out = static_cast<unsigned char>(code & 0xFF);  // two's complement
      else
        *out = static_cast<unsigned char>(*out | ((code + 8) << (i < kGroup / 2 ? 0 : 4)));
    }
  }
}

/// The value of key i (< 32), channel c of a group.
template <typename F, bool Keys = false>
float dequantised(const unsigned char* group, Index d, Index i, Index c) {
  std::uint16_t bits;
  std::memcpy(&bits, group + c * Index(sizeof bits), sizeof bits);
  const unsigned char byte = group[codeOffset<F, Keys>(d, i, c)];
  int code;
  if constexpr (F::Bits == 8)
    code = int(byte) - (byte >= 128 ? 256 : 0);  // the byte's two's-complement value
  else
    code = (i < kGroup / 2 ? (byte & 0xF) : (byte >> 4)) - 8;
  return halfBits(bits) * float(code);
}

/// Reads a group back into x (32 x d column-major, channel c at x + c ldx).
template <typename F, bool Keys = false>
void dequantiseGroup(const unsigned char* group, Index d, float* x, Index ldx) {
  for (Index c = 0; c < d; ++c)
    for (Index i = 0; i < kGroup; ++i) x[i + c * ldx] = dequantised<F, Keys>(group, d, i, c);
}

// ---------------------------------------------------------------------------------------------
// q8 keys: integer logits. A query row's weights of a group, w_c = a_c scale_gc, become int16
// W_c = round(w_c / ws), ws = max_c |w_c| / 32767; the group's logits are then ws times exact
// int32 sums sum_c W_c code_gic (|sum| <= 32767 127 d < 2^31 for d <= 512: channels in blocks of
// 256), one fused multiply-add per key into s. Against w itself each W_c is off by at most ws / 2,
// a logit by at most d 127 ws / 2 (1/258 of the keys' own quantisation bound at d 1, less per
// channel). The same integers and float steps on every path: bitwise the same results.

/// Channels per block of exact int32 sums.
inline constexpr Index kIntChannels = 256;

/// W (d rounded up to even, the padding 0) and ws of one row of one group (portable; the
/// AVX-512 version computes the same floats).
inline float int16Weights(const float* a, const std::uint16_t* scales, Index d, std::int16_t* W, float* w) {
  float m = 0.0f;
  for (Index c = 0; c < d; ++c) {
    w[c] = a[c] * halfBits(scales[c]);
    m = std::max(m, std::abs(w[c]));
  }
  const float inv = m > 0.0f ? 32767.0f / m : 0.0f;
  for (Index c = 0; c < d; ++c) W[c] = std::int16_t(std::nearbyint(w[c] * inv));
  if (d & 1) W[d] = 0;
  return m / 32767.0f;
}

// ---------------------------------------------------------------------------------------------
// Decoding products over a chunk of groups g = 0..n-1 (anywhere in memory: groups[g]):
//   logits  s[r][32 g + i] += sum_c (a[r][c] scale_gc) code_gic   (channels in order)
//   values  dots[r][c] = sum_g scale_gc sum_i p[r][32 g + i] code_gic
// Every row's arithmetic is the same whatever rows share the pass (a GQA group's heads or one
// head alone), as decodeLogitsRows's. `as` is scratch of R (d + 2) + d floats.

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

/// q8 keys' logits (paired codes), portable: as the AVX-512 kernel, to the bit.
/// as: scratch of R (d + 2) + d floats.
inline void logitsPairedPortable(const float* const* a, Index R, const unsigned char* const* groups, Index n, Index d,
                                 float* const* s, float* as) {
  float* ws = as;
  float* w = as + R;
  auto* W = reinterpret_cast<std::int16_t*>(as + R + d);
  const Index pairs = (d + 1) / 2, dp = 2 * pairs;
  for (Index g = 0; g < n; ++g) {
    const auto* scales = reinterpret_cast<const std::uint16_t*>(groups[g]);
    const unsigned char* codes = groups[g] + d * Index(sizeof(std::uint16_t));
    for (Index r = 0; r < R; ++r) ws[r] = int16Weights(a[r], scales, d, W + r * dp, w);
    for (Index r = 0; r < R; ++r)
      for (Index p0 = 0; p0 < pairs; p0 += kIntChannels / 2) {
        const Index p1 = std::min(pairs, p0 + kIntChannels / 2);
        std::int32_t acc[kGroup] = {};
        for (Index p = p0; p < p1; ++p) {
          const std::int16_t* wp = W + r * dp + 2 * p;
          const unsigned char* cp = codes + p * 2 * kGroup;
          for (Index i = 0; i < kGroup; ++i)
            acc[i] += std::int32_t(wp[0]) * (int(cp[2 * i]) - (cp[2 * i] >= 128 ? 256 : 0)) +
                      std::int32_t(wp[1]) * (int(cp[2 * i + 1]) - (cp[2 * i + 1] >= 128 ? 256 : 0));
        }
        float* out = s[r] + g * kGroup;
        for (Index i = 0; i < kGroup; ++i) out[i] = std::fma(ws[r], float(acc[i]), out[i]);
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
/// channel. Every row's arithmetic is the same whatever Rows. ahead (or null): the codes of the
/// group to request, a line as each line is read (groupAhead).
template <typename F, int Rows>
SDPA_QUANT_TARGET void logitsRows(const float* const* as, Index d, const unsigned char* codes, float* const* out,
                                  const unsigned char* ahead) {
  constexpr int P = 4;
  __m512 acc[Rows][P][2];
  for (int m = 0; m < Rows; ++m)
    for (int t = 0; t < P; ++t) acc[m][t][0] = acc[m][t][1] = _mm512_setzero_ps();
  Index c = 0;
  const auto request = [&](Index channel) {
    if (ahead && (channel * kCodeBytes<F>) % 64 == 0) __builtin_prefetch(ahead + channel * kCodeBytes<F>, 0, 2);
  };
  for (; c + P <= d; c += P) {
    for (int t = 0; t < P; ++t) {
      request(c + t);
      __m512 x0, x1;
      load32<F>(codes + (c + t) * kCodeBytes<F>, x0, x1);
      for (int m = 0; m < Rows; ++m) {
        const __m512 w = _mm512_set1_ps(as[m][c + t]);
        acc[m][t][0] = _mm512_fmadd_ps(w, x0, acc[m][t][0]);
        acc[m][t][1] = _mm512_fmadd_ps(w, x1, acc[m][t][1]);
      }
    }
  }
  // The last d mod P channels into the first partial sums, t a compile-time index (a loop
  // counter as acc's index had GCC keep all of acc on the stack: a load and a store around
  // every multiply-add of the main loop too).
#pragma GCC unroll 4
  for (int t = 0; t < P; ++t) {
    if (c + t >= d) continue;
    request(c + t);
    __m512 x0, x1;
    load32<F>(codes + (c + t) * kCodeBytes<F>, x0, x1);
    for (int m = 0; m < Rows; ++m) {
      const __m512 w = _mm512_set1_ps(as[m][c + t]);
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
    const unsigned char* ahead = groupAhead<F, true>(groups, g, n, d);  // its codes: logitsRows
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
      const unsigned char* codesAhead = r0 == 0 && ahead ? ahead + d * Index(sizeof(std::uint16_t)) : nullptr;
      switch (rows) {
        case 1:
          logitsRows<F, 1>(asRows, d, codes, out, codesAhead);
          break;
        case 2:
          logitsRows<F, 2>(asRows, d, codes, out, codesAhead);
          break;
        default:
          logitsRows<F, 3>(asRows, d, codes, out, codesAhead);
          break;
      }
    }
  }
}

/// dots for Rows rows over every group, group by group: each group read once, in order, with
/// the partial sums of every (row, channel) in memory (acc: Rows d packets, in L1). A loop over
/// channel blocks outside the groups would stride through memory once per block, 256 bytes of
/// each 4 KiB group at a time, which the hardware prefetcher does not follow (0.5 ms of a 0.9 ms
/// q8 decode at n_k 65536, d 128). Per (row, channel) the same sums in the same order.
template <typename F, int Rows>
SDPA_QUANT_TARGET void valuesRows(const float* const* p, const unsigned char* const* groups, Index n, Index d,
                                  float* const* dots, float* acc) {
  for (Index i = 0; i < Rows * d * 16; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
  const Index codeBase = d * Index(sizeof(std::uint16_t));
  for (Index g = 0; g < n; ++g) {
    const unsigned char* group = groups[g];
    const auto* scales = reinterpret_cast<const std::uint16_t*>(group);
    const unsigned char* ahead = groupAhead<F, false>(groups, g, n, d);  // its codes: 8 channels at a time
    __m512 p0[Rows], p1[Rows];
    for (int m = 0; m < Rows; ++m) {
      p0[m] = _mm512_loadu_ps(p[m] + g * kGroup);
      p1[m] = _mm512_loadu_ps(p[m] + g * kGroup + 16);
    }
    for (Index c0 = 0; c0 < d; c0 += 8) {
      const Index cols = std::min<Index>(8, d - c0);
      if (ahead)
        for (Index b = 0; b < cols * kCodeBytes<F>; b += 64)
          __builtin_prefetch(ahead + codeBase + c0 * kCodeBytes<F> + b, 0, 2);
      // Eight scales converted at once (a broadcast from memory then costs no shuffle).
      alignas(32) float sc8[8];
      if (cols == 8)
        _mm256_store_ps(sc8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + c0))));
      else
        for (Index c = 0; c < cols; ++c) sc8[c] = _cvtsh_ss(scales[c0 + c]);
      for (Index c = 0; c < cols; ++c) {
        __m512 x0, x1;
        load32<F>(group + codeBase + (c0 + c) * kCodeBytes<F>, x0, x1);
        const __m512 sc = _mm512_set1_ps(sc8[c]);
        for (int m = 0; m < Rows; ++m) {
          const __m512 t = _mm512_fmadd_ps(p1[m], x1, _mm512_mul_ps(p0[m], x0));
          float* a = acc + (m * d + c0 + c) * 16;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(sc, t, _mm512_loadu_ps(a)));
        }
      }
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (Index c = 0; c < d; ++c) dots[m][c] = _mm512_reduce_add_ps(_mm512_loadu_ps(acc + (m * d + c) * 16));
}

/// acc: scratch of 4 d packets (64 d floats).
template <typename F>
SDPA_QUANT_TARGET void valuesGroups(const float* const* p, Index R, const unsigned char* const* groups, Index n,
                                    Index d, float* const* dots, float* acc) {
  constexpr Index kRows = 4;
  for (Index r0 = 0; r0 < R; r0 += kRows) {
    switch (std::min(kRows, R - r0)) {
      case 1:
        valuesRows<F, 1>(p + r0, groups, n, d, dots + r0, acc);
        break;
      case 2:
        valuesRows<F, 2>(p + r0, groups, n, d, dots + r0, acc);
        break;
      case 3:
        valuesRows<F, 3>(p + r0, groups, n, d, dots + r0, acc);
        break;
      default:
        valuesRows<F, 4>(p + r0, groups, n, d, dots + r0, acc);
        break;
    }
  }
}

#undef SDPA_QUANT_TARGET

// q8 keys' integer logits, compiled twice: AVX512BW (vpmaddwd + vpaddd) and AVX512_VNNI
// (vpdpwssd); each its own target, so that no VNNI instruction reaches a CPU without it.
// clang-format off
#define SDPA_PAIRED_NS bw
#define SDPA_PAIRED_TARGET __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#define SDPA_PAIRED_DOT(acc, x, w) _mm512_add_epi32(acc, _mm512_madd_epi16(x, w))
#include "kv_quant_paired.inc"
#undef SDPA_PAIRED_NS
#undef SDPA_PAIRED_TARGET
#undef SDPA_PAIRED_DOT
#define SDPA_PAIRED_NS vnni
#define SDPA_PAIRED_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))
#define SDPA_PAIRED_DOT(acc, x, w) _mm512_dpwssd_epi32(acc, x, w)
#include "kv_quant_paired.inc"
#undef SDPA_PAIRED_NS
#undef SDPA_PAIRED_TARGET
#undef SDPA_PAIRED_DOT
// clang-format on

}  // namespace avx512

/**
 * The same products with AVX2 (every x86 CPU since 2013-2015 that lacks AVX-512, the AMD ones
 * among them): vectors of 8 floats and 16 registers, so blocks of two rows. q8 keys' integer
 * logits are avx512's exact sums (vpmaddwd), so the same bits on every path; the float paths
 * (q4 keys, values) sum in an order of their own, as the portable ones do.
 */
namespace avx2 {

#define SDPA_QUANT_TARGET __attribute__((target("avx2,fma,f16c")))

/// Rows per register block: 4 vectors of partial sums (32 keys) per row, the codes' 4 vectors.
inline constexpr Index kRows = 2;

/// Keys 8 h .. 8 h + 7 of a channel's codes as x[h], h = 0..3: q8 codes, or q4 codes + 8 (0..15:
/// the kernels subtract 8 once per group and channel, not once per code; see kQ4Offset).
template <typename F>
SDPA_QUANT_TARGET inline void load32(const unsigned char* cc, __m256* x) {
  if constexpr (F::Bits == 8) {
    for (Index h = 0; h < 4; ++h)
      x[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cc + 8 * h))));
  } else {
    // Byte i holds key i (low nibble) and key i + 16 (high), each code + 8.
    const __m256i low = _mm256_set1_epi32(0xF);
    for (Index h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cc + 8 * h)));
      x[h] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low));
      x[h + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }
  }
}

/// What load32 leaves in each code: q4's offset of 8, taken out per group and channel instead
/// (sum_i w (c_i - 8) = sum_i w c_i - 8 w per key and channel of the logits, sum_i p_i (c_i - 8)
/// = sum_i p_i c_i - 8 sum_i p_i per channel of the values): 4 of the 18-20 instructions per
/// channel and 32 keys of each kernel. The sums of codes + 8 (at most 15) against codes (at most
/// 8 in magnitude) cost about one bit of float rounding, far below the quantisation step.
template <typename F>
inline constexpr float kQ4Offset = F::Bits == 4 ? 8.0f : 0.0f;

/// One fused multiply-add chain per (row, vector of 8 keys) over the channels in order: four
/// independent chains per row hide the FMA latency. Every row's arithmetic is the same whatever Rows.
template <typename F, int Rows>
SDPA_QUANT_TARGET void logitsRows(const float* const* as, Index d, const unsigned char* codes, float* const* out,
                                  const float* bias, const unsigned char* ahead) {
  __m256 acc[Rows][4];
  for (int m = 0; m < Rows; ++m)
    for (Index h = 0; h < 4; ++h) {
      acc[m][h] = _mm256_loadu_ps(out[m] + 8 * h);
      if constexpr (kQ4Offset<F> != 0.0f) acc[m][h] = _mm256_add_ps(acc[m][h], _mm256_set1_ps(bias[m]));
    }
  for (Index c = 0; c < d; ++c) {
    if (ahead && (c * kCodeBytes<F>) % 64 == 0) __builtin_prefetch(ahead + c * kCodeBytes<F>, 0, 2);
    __m256 x[4];
    load32<F>(codes + c * kCodeBytes<F>, x);
    for (int m = 0; m < Rows; ++m) {
      const __m256 w = _mm256_set1_ps(as[m][c]);
      for (Index h = 0; h < 4; ++h) acc[m][h] = _mm256_fmadd_ps(w, x[h], acc[m][h]);
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (Index h = 0; h < 4; ++h) _mm256_storeu_ps(out[m] + 8 * h, acc[m][h]);
}

template <typename F>
SDPA_QUANT_TARGET void logitsGroups(const float* const* a, Index R, const unsigned char* const* groups, Index n,
                                    Index d, float* const* s, float* as) {
  const float* asRows[kRows];
  float* out[kRows];
  float* bias = as + R * d;  // per row: -kQ4Offset sum_c as_c
  for (Index g = 0; g < n; ++g) {
    const unsigned char* group = groups[g];
    const auto* scales = reinterpret_cast<const std::uint16_t*>(group);
    const unsigned char* ahead = groupAhead<F, true>(groups, g, n, d);  // its codes: logitsRows
    for (Index r = 0; r < R; ++r) {
      float* ar = as + r * d;
      __m256 sum = _mm256_setzero_ps();
      Index c = 0;
      for (; c + 8 <= d; c += 8) {
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + c)));
        const __m256 w = _mm256_mul_ps(_mm256_loadu_ps(a[r] + c), sc);
        _mm256_storeu_ps(ar + c, w);
        if constexpr (kQ4Offset<F> != 0.0f) sum = _mm256_add_ps(sum, w);
      }
      for (; c < d; ++c) ar[c] = a[r][c] * _cvtsh_ss(scales[c]);
      if constexpr (kQ4Offset<F> != 0.0f) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, sum);
        float total = 0.0f;
        for (const float l : lanes) total += l;
        for (c = d / 8 * 8; c < d; ++c) total += ar[c];
        bias[r] = -kQ4Offset<F> * total;
      }
    }
    const unsigned char* codes = group + d * Index(sizeof(std::uint16_t));
    for (Index r0 = 0; r0 < R; r0 += kRows) {
      const Index rows = std::min(kRows, R - r0);
      for (Index m = 0; m < rows; ++m) {
        asRows[m] = as + (r0 + m) * d;
        out[m] = s[r0 + m] + g * kGroup;
      }
      const unsigned char* codesAhead = r0 == 0 && ahead ? ahead + d * Index(sizeof(std::uint16_t)) : nullptr;
      if (rows == 1)
        logitsRows<F, 1>(asRows, d, codes, out, bias + r0, codesAhead);
      else
        logitsRows<F, 2>(asRows, d, codes, out, bias + r0, codesAhead);
    }
  }
}

/// avx512::valuesRows with 8-lane partial sums per (row, channel) (acc: Rows d 8 floats).
template <typename F, int Rows>
SDPA_QUANT_TARGET void valuesRows(const float* const* p, const unsigned char* const* groups, Index n, Index d,
                                  float* const* dots, float* acc) {
  for (Index i = 0; i < Rows * d * 8; i += 8) _mm256_storeu_ps(acc + i, _mm256_setzero_ps());
  // offset[m d + c] = sum_g scale_gc sum_i p[m][32 g + i] (q4: the codes' offset, taken out at the end)
  float* offset = acc + Rows * d * 8;
  if constexpr (kQ4Offset<F> != 0.0f) std::fill(offset, offset + Rows * d, 0.0f);
  const Index codeBase = d * Index(sizeof(std::uint16_t));
  for (Index g = 0; g < n; ++g) {
    const unsigned char* group = groups[g];
    const auto* scales = reinterpret_cast<const std::uint16_t*>(group);
    const unsigned char* ahead = groupAhead<F, false>(groups, g, n, d);  // its codes: 8 channels at a time
    __m256 pv[Rows][4];
    float psum[Rows];
    for (int m = 0; m < Rows; ++m) {
      for (Index h = 0; h < 4; ++h) pv[m][h] = _mm256_loadu_ps(p[m] + g * kGroup + 8 * h);
      if constexpr (kQ4Offset<F> != 0.0f) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(pv[m][0], pv[m][1]), _mm256_add_ps(pv[m][2], pv[m][3])));
        psum[m] = 0.0f;
        for (const float l : lanes) psum[m] += l;
      }
    }
    for (Index c0 = 0; c0 < d; c0 += 8) {
      const Index cols = std::min<Index>(8, d - c0);
      if (ahead)
        for (Index b = 0; b < cols * kCodeBytes<F>; b += 64)
          __builtin_prefetch(ahead + codeBase + c0 * kCodeBytes<F> + b, 0, 2);
      alignas(32) float sc8[8];
      if (cols == 8)
        _mm256_store_ps(sc8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + c0))));
      else
        for (Index c = 0; c < cols; ++c) sc8[c] = _cvtsh_ss(scales[c0 + c]);
      if constexpr (kQ4Offset<F> != 0.0f) {
        for (int m = 0; m < Rows; ++m) {
          float* o = offset + m * d + c0;
          if (cols == 8)
            _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_load_ps(sc8), _mm256_set1_ps(psum[m]), _mm256_loadu_ps(o)));
          else
            for (Index c = 0; c < cols; ++c) o[c] = std::fma(sc8[c], psum[m], o[c]);
        }
      }
      for (Index c = 0; c < cols; ++c) {
        __m256 x[4];
        load32<F>(group + codeBase + (c0 + c) * kCodeBytes<F>, x);
        const __m256 sc = _mm256_set1_ps(sc8[c]);
        for (int m = 0; m < Rows; ++m) {
          const __m256 t = _mm256_fmadd_ps(
              pv[m][3], x[3],
              _mm256_fmadd_ps(pv[m][2], x[2], _mm256_fmadd_ps(pv[m][1], x[1], _mm256_mul_ps(pv[m][0], x[0]))));
          float* a = acc + (m * d + c0 + c) * 8;
          _mm256_storeu_ps(a, _mm256_fmadd_ps(sc, t, _mm256_loadu_ps(a)));
        }
      }
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (Index c = 0; c < d; ++c) {
      const float* a = acc + (m * d + c) * 8;
      float sum = 0.0f;
      for (int l = 0; l < 8; ++l) sum += a[l];
      if constexpr (kQ4Offset<F> != 0.0f)
        dots[m][c] = std::fma(-kQ4Offset<F>, offset[m * d + c], sum);
      else
        dots[m][c] = sum;
    }
}

/// acc: scratch of kRows d 9 floats.
template <typename F>
SDPA_QUANT_TARGET void valuesGroups(const float* const* p, Index R, const unsigned char* const* groups, Index n,
                                    Index d, float* const* dots, float* acc) {
  for (Index r0 = 0; r0 < R; r0 += kRows) {
    if (R - r0 == 1)
      valuesRows<F, 1>(p + r0, groups, n, d, dots + r0, acc);
    else
      valuesRows<F, 2>(p + r0, groups, n, d, dots + r0, acc);
  }
}

/// int16Weights, 8 channels at a time (the same floats).
SDPA_QUANT_TARGET inline float int16Weights(const float* a, const std::uint16_t* scales, Index d, std::int16_t* W,
                                            float* w) {
  Index c = 0;
  const __m256 noSign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m8 = _mm256_setzero_ps();
  for (; c + 8 <= d; c += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(a + c),
                                   _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + c))));
    _mm256_storeu_ps(w + c, x);
    m8 = _mm256_max_ps(m8, _mm256_and_ps(x, noSign));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  float m = 0.0f;
  for (const float l : lanes) m = std::max(m, l);
  for (; c < d; ++c) {
    w[c] = a[c] * _cvtsh_ss(scales[c]);
    m = std::max(m, std::abs(w[c]));
  }
  const float inv = m > 0.0f ? 32767.0f / m : 0.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (c = 0; c + 8 <= d; c += 8) {
    const __m256i words = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(w + c), vinv));  // to nearest, as nearbyint
    _mm_storeu_si128(reinterpret_cast<__m128i*>(W + c),
                     _mm_packs_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
  }
  for (; c < d; ++c) W[c] = std::int16_t(std::nearbyint(w[c] * inv));
  if (d & 1) W[d] = 0;
  return m / 32767.0f;
}

/// q8 keys' logits of Rows rows over one group's channel pairs: exact int32 sums (vpmaddwd) per
/// block of kIntChannels channels, then one fused multiply-add per key, as avx512's pairedRows.
template <int Rows>
SDPA_QUANT_TARGET void pairedRows(const std::int16_t* const* W, const float* ws, Index d, const unsigned char* codes,
                                  float* const* out, const unsigned char* ahead) {
  const Index pairs = (d + 1) / 2;
  for (Index p0 = 0; p0 < pairs; p0 += kIntChannels / 2) {
    const Index p1 = std::min(pairs, p0 + kIntChannels / 2);
    __m256i acc[Rows][4];
    for (int m = 0; m < Rows; ++m)
      for (Index h = 0; h < 4; ++h) acc[m][h] = _mm256_setzero_si256();
    for (Index p = p0; p < p1; ++p) {
      const unsigned char* cp = codes + p * 2 * kGroup;
      if (ahead) __builtin_prefetch(ahead + p * 2 * kGroup, 0, 2);  // a pair's codes: one line
      __m256i x[4];  // keys 8 h .. 8 h + 7, each its two channels' codes as int16
      for (Index h = 0; h < 4; ++h)
        x[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cp + 16 * h)));
      for (int m = 0; m < Rows; ++m) {
        std::int32_t pair;
        std::memcpy(&pair, W[m] + 2 * p, sizeof pair);
        const __m256i w = _mm256_set1_epi32(pair);
        for (Index h = 0; h < 4; ++h) acc[m][h] = _mm256_add_epi32(acc[m][h], _mm256_madd_epi16(x[h], w));
      }
    }
    for (int m = 0; m < Rows; ++m)
      for (Index h = 0; h < 4; ++h)
        _mm256_storeu_ps(out[m] + 8 * h, _mm256_fmadd_ps(_mm256_set1_ps(ws[m]), _mm256_cvtepi32_ps(acc[m][h]),
                                                         _mm256_loadu_ps(out[m] + 8 * h)));
  }
}

/// logitsPairedPortable's results, with AVX2.
SDPA_QUANT_TARGET inline void logitsPaired(const float* const* a, Index R, const unsigned char* const* groups, Index n,
                                           Index d, float* const* s, float* as) {
  float* ws = as;
  float* w = as + R;
  auto* W = reinterpret_cast<std::int16_t*>(as + R + d);
  const Index dp = (d + 1) / 2 * 2;
  const std::int16_t* rowsW[kRows];
  float* out[kRows];
  for (Index g = 0; g < n; ++g) {
    const auto* scales = reinterpret_cast<const std::uint16_t*>(groups[g]);
    const unsigned char* codes = groups[g] + d * Index(sizeof(std::uint16_t));
    const unsigned char* ahead = groupAhead<kv::Q8, true>(groups, g, n, d);  // its codes: pairedRows
    for (Index r = 0; r < R; ++r) ws[r] = int16Weights(a[r], scales, d, W + r * dp, w);
    for (Index r0 = 0; r0 < R; r0 += kRows) {
      const Index rows = std::min(kRows, R - r0);
      for (Index m = 0; m < rows; ++m) {
        rowsW[m] = W + (r0 + m) * dp;
        out[m] = s[r0 + m] + g * kGroup;
      }
      const unsigned char* codesAhead = r0 == 0 && ahead ? ahead + d * Index(sizeof(std::uint16_t)) : nullptr;
      if (rows == 1)
        pairedRows<1>(rowsW, ws + r0, d, codes, out, codesAhead);
      else
        pairedRows<2>(rowsW, ws + r0, d, codes, out, codesAhead);
    }
  }
}

#undef SDPA_QUANT_TARGET
}  // namespace avx2
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

/// 0: no AVX512BW; 1: AVX512BW; 2: AVX512BW and AVX512_VNNI (the integer key logits' paths).
inline int intDotIsa() {
#if SDPA_HAS_ISA_DISPATCH
  static const int isa = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bw")) return 0;
    return __builtin_cpu_supports("avx512vnni") ? 2 : 1;
  }();
  return IsaChoice::current() >= Isa::Avx512 ? isa : 0;
#else
  return 0;
#endif
}

/// The decoding logits over n groups of keys (see above), on the CPU's fastest path; q8 keys
/// (paired codes) as integer dot products. as: scratch of R (d + 2) + d floats.
template <typename F>
void logitsGroups(const float* const* a, Index R, const unsigned char* const* groups, Index n, Index d, float* const* s,
                  float* as) {
  if constexpr (kPaired<F, true>) {
#if SDPA_HAS_ISA_DISPATCH
    const int isa = intDotIsa();
    if (isa == 2) return avx512::vnni::logitsPaired(a, R, groups, n, d, s, as);
    if (isa == 1) return avx512::bw::logitsPaired(a, R, groups, n, d, s, as);
    if (IsaChoice::current() >= Isa::Avx2) return avx2::logitsPaired(a, R, groups, n, d, s, as);
#endif
    logitsPairedPortable(a, R, groups, n, d, s, as);
  } else {
#if SDPA_HAS_ISA_DISPATCH
    if (IsaChoice::current() >= Isa::Avx512) return avx512::logitsGroups<F>(a, R, groups, n, d, s, as);
    if (IsaChoice::current() == Isa::Avx2) return avx2::logitsGroups<F>(a, R, groups, n, d, s, as);
#endif
    logitsGroupsPortable<F>(a, R, groups, n, d, s, as);
  }
}

/// The decoding weighted values over n groups (see above), on the CPU's fastest path. acc:
/// scratch of 64 d floats.
template <typename F>
void valuesGroups(const float* const* p, Index R, const unsigned char* const* groups, Index n, Index d,
                  float* const* dots, float* acc) {
#if SDPA_HAS_ISA_DISPATCH
  if (IsaChoice::current() >= Isa::Avx512) return avx512::valuesGroups<F>(p, R, groups, n, d, dots, acc);
  if (IsaChoice::current() == Isa::Avx2) return avx2::valuesGroups<F>(p, R, groups, n, d, dots, acc);
#else
  (void)acc;
#endif
  valuesGroupsPortable<F>(p, R, groups, n, d, dots);
}

}  // namespace internal::quant
}  // namespace sdpa

#endif  // SDPA_INTERNAL_KV_QUANT_HPP
