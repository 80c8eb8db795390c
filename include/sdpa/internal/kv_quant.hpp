#ifndef SDPA_INTERNAL_KV_QUANT_HPP
#define SDPA_INTERNAL_KV_QUANT_HPP

// Quantised k and v of a KvCache (int8 and 4-bit codes with an fp16 scale per block of 32
// values, the sizes of ggml's q8_0 and q4_0) and the decoding products that read them without a
// dequantised copy: logits and weighted sums as exact integer dot products (the float side
// rounded to integers per block), then the same float steps on every path. A block is 32
// consecutive keys of one channel: the cache stores each head's k and v column-major (a
// channel's keys contiguous), the layout the decoding kernels stream, and a channel's scale also
// follows the per-channel outliers of k (KIVI, Liu et al. 2024).
//
// A group (32 keys of one head, d channels) is d fp16 scales, then the codes (q8: int8; q4: code
// + 8 in a nibble, key i < 16 low, key i + 16 high) in the byte order of the integer dot products
// that read them: q8 keys in channel pairs (kPaired: 64 bytes per pair, each key's two codes
// adjacent); q4 keys by quads of channels (kNibbleQuads: a 64-byte line per 4 channels, key i's 4
// codes in bytes 4 (i mod 16) ..); values by quads of keys within blocks of 16 channels (per block
// of w channels, rows of 4 w bytes, row j holding channel c's keys 4 j .. 4 j + 3 in bytes 4 c ..:
// q8 8 rows, q4 4, keys 16 .. 31 in the high nibbles).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

/// Whether a group keeps its codes in nibble quads: q4 keys and values, read by integer dot
/// products of 4 bytes (the file's head; keys' d padded to a multiple of 4 with code 0; values
/// of both formats are in quads of keys).
template <typename F>
inline constexpr bool kNibbleQuads = F::Bits == 4;

/// Channels per block of a group's values (their lanes in the values kernel).
inline constexpr Index kQuadBlock = 16;

/// Bytes of a group of d channels: d fp16 scales, then the codes (of keys, or of values).
template <typename F, bool Keys = false>
Index groupBytes(Index d) {
  if constexpr (kPaired<F, Keys>)
    return d * Index(sizeof(std::uint16_t)) + (d + 1) / 2 * 2 * kGroup;
  else if constexpr (kNibbleQuads<F> && Keys)
    return d * Index(sizeof(std::uint16_t)) + (d + 3) / 4 * 2 * kGroup;
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

/// Where key i (< 32) of channel c has its code byte (q8), or its nibble's byte (q4: the low
/// nibble for i < 16).
template <typename F, bool Keys>
Index codeOffset(Index d, Index i, Index c) {
  const Index base = d * Index(sizeof(std::uint16_t));
  if constexpr (kPaired<F, Keys>) {
    return base + c / 2 * 2 * kGroup + 2 * i + (c & 1);
  } else if constexpr (kNibbleQuads<F> && Keys) {
    return base + c / 4 * 2 * kGroup + 4 * (i % 16) + c % 4;
  } else {
    const Index b = c / kQuadBlock, w = std::min(kQuadBlock, d - b * kQuadBlock);
    const Index row = F::Bits == 8 ? i / 4 : i % (kGroup / 2) / 4;
    return base + b * kQuadBlock * kCodeBytes<F> + row * 4 * w + 4 * (c % kQuadBlock) + i % 4;
  }
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
  // (A paired odd d's padding channel: 0; q4 keys' padding channels: code 0, stored 8.)
  std::memset(group, 0, size_t(groupBytes<F, Keys>(d)));
  if constexpr (F::Bits == 4)
    std::memset(group + d * Index(sizeof(std::uint16_t)), 0x88, size_t(groupBytes<F, Keys>(d) - d * 2));
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
      else if (i < kGroup / 2)
        *out = static_cast<unsigned char>((*out & 0xF0) | (code + 8));
      else
        *out = static_cast<unsigned char>((*out & 0x0F) | ((code + 8) << 4));
    }
  }
}

/// The code of key i (< 32), channel c of a group.
template <typename F, bool Keys = false>
int codeAt(const unsigned char* group, Index d, Index i, Index c) {
  const unsigned char byte = group[codeOffset<F, Keys>(d, i, c)];
  if constexpr (F::Bits == 8)
    return int(byte) - (byte >= 128 ? 256 : 0);  // the byte's two's-complement value
  else
    return (i < kGroup / 2 ? (byte & 0xF) : (byte >> 4)) - 8;
}

/// The value of key i (< 32), channel c of a group.
template <typename F, bool Keys = false>
float dequantised(const unsigned char* group, Index d, Index i, Index c) {
  std::uint16_t bits;
  std::memcpy(&bits, group + c * Index(sizeof bits), sizeof bits);
  return halfBits(bits) * float(codeAt<F, Keys>(group, d, i, c));
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

/// Whether some w[c], c < d, is NaN or +-inf (its exponent all ones): a query row holding one
/// gets NaN logits, as in every other kernel, where rounding it to integers would give finite
/// garbage. An integer test, so that the compiler vectorises it.
inline bool anyNonFinite(const float* w, Index d) {
  std::uint32_t bad = 0;
  for (Index c = 0; c < d; ++c) {
    std::uint32_t bits;
    std::memcpy(&bits, w + c, sizeof bits);
    bad |= static_cast<std::uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
  }
  return bad != 0;
}

/// W (d rounded up to even, the padding 0) and ws of one row of one group (portable; the
/// AVX-512 version computes the same floats); ws NaN, W 0, where some w_c is not finite.
inline float int16Weights(const float* a, const std::uint16_t* scales, Index d, std::int16_t* W, float* w) {
  float m = 0.0f;
  for (Index c = 0; c < d; ++c) {
    w[c] = a[c] * halfBits(scales[c]);
    m = std::max(m, std::abs(w[c]));
  }
  if (anyNonFinite(w, d)) {
    std::fill(W, W + (d + 1) / 2 * 2, std::int16_t(0));
    return std::numeric_limits<float>::quiet_NaN();
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

// ---------------------------------------------------------------------------------------------
// q4 keys and q8 and q4 values as integer dot products of bytes (vpdpbusd: 4 products of an
// unsigned and a signed byte per 32-bit lane), q4 codes unpacked from their nibbles in registers.
// - Keys: a query row's weights of a group, w_c = a_c scale_gc, become W_c = round(w_c / ws),
//   ws = max_c |w_c| / 16383, as two bytes W_c = 128 Wh_c + Wl_c (Wh in [-128, 127], Wl in
//   [0, 127]); a logit is ws times the exact int32 sum_c W_c (u_ic - 8) = 128 sum Wh u + sum Wl u
//   - 8 sum W (u the stored code, 0..15) over blocks of kIntChannels channels, one fused
//   multiply-add per key and block. Each W_c is off by at most ws / 2: a logit by at most
//   d 7 ws / 2 (1/2340 of the keys' own quantisation bound at equal weights).
// - Values: a row's weights over a group, p_i in [0, 1], become P_i = round(p_i / ps),
//   ps = max_i p_i / 65535, as two bytes 256 Ph_i + Pl_i (or, for q8 codes where a pair of
//   products must stay within int16, vpmaddubsw's limit, three of 7, 7 and 2 bits); a channel's
//   sum_i P_i code_ic is exact, and dots_c += (scale_gc ps) float(sum), one fused multiply-add
//   per channel and group. Each P_i is off by at most ps / 2: an output (the dots over the
//   weights' sum, which is at least the sum of the groups' largest weights) by at most
//   max |v| / 4096.
// Every path (AVX-512 with or without VNNI, AVX2, portable) computes the same integers and the
// same float steps: the same bits. A row's NaN or inf weights make its logits (or dots) NaN.

/// ws and the bytes of W (dPad = d rounded up to 4 channels, the padding 0) of one row of one
/// group, and sum W per block of kIntChannels channels; NaN where some w_c is not finite.
inline float q4KeyWeights(const float* a, const std::uint16_t* scales, Index d, std::int8_t* Wh, std::int8_t* Wl,
                          std::int32_t* sumW) {
  const Index dPad = (d + 3) / 4 * 4, blocks = (d + kIntChannels - 1) / kIntChannels;
  float m = 0.0f;
  bool finite = true;
  for (Index c = 0; c < d; ++c) {
    const float w = std::abs(a[c] * halfBits(scales[c]));
    finite = finite && w <= std::numeric_limits<float>::max();
    m = std::max(m, w);
  }
  std::fill(sumW, sumW + blocks, 0);
  std::fill(Wh, Wh + dPad, std::int8_t(0));
  std::fill(Wl, Wl + dPad, std::int8_t(0));
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  const float inv = m > 0.0f ? 16383.0f / m : 0.0f;
  for (Index c = 0; c < d; ++c) {
    const int W = int(std::nearbyint(a[c] * halfBits(scales[c]) * inv));
    Wl[c] = std::int8_t(W & 127);
    Wh[c] = std::int8_t((W - (W & 127)) / 128);
    sumW[c / kIntChannels] += W;
  }
  return m / 16383.0f;
}

/// ps and the bytes of P of one row's 32 weights of a group: ps 0 where every weight is 0 (the
/// group adds nothing), NaN where one is not finite.
inline float intValueWeights(const float* p, std::uint8_t* Ph, std::uint8_t* Pl) {
  float m = 0.0f;
  bool finite = true;
  for (Index i = 0; i < kGroup; ++i) {
    finite = finite && std::abs(p[i]) <= std::numeric_limits<float>::max();
    m = std::max(m, p[i]);
  }
  if (!finite) m = std::numeric_limits<float>::quiet_NaN();
  const float inv = m > 0.0f ? 65535.0f / m : 0.0f;
  for (Index i = 0; i < kGroup; ++i) {
    const int P = m > 0.0f ? int(std::nearbyint(p[i] * inv)) : 0;
    Ph[i] = std::uint8_t(P >> 8);
    Pl[i] = std::uint8_t(P & 255);
  }
  return m / 65535.0f;
}

/// Floats of the logits' scratch `as` (R rows of d channels), for every storage.
inline Index logitsScratch(Index R, Index d) {
  return R * (d + 2) + d + R * ((d + kIntChannels - 1) / kIntChannels + 2) + 16;
}

/// Where q4LogitsRows's rows keep their weights in `as`: ws[R], sumW[R blocks], Wh/Wl bytes.
struct Q4KeyScratch {
  float* ws;
  std::int32_t* sumW;
  std::int8_t* W;
  Index blocks, dPad;
  Q4KeyScratch(float* as, Index R, Index d)
      : ws(as),
        sumW(reinterpret_cast<std::int32_t*>(as + R)),
        W(reinterpret_cast<std::int8_t*>(as + R + R * ((d + kIntChannels - 1) / kIntChannels))),
        blocks((d + kIntChannels - 1) / kIntChannels),
        dPad((d + 3) / 4 * 4) {}
  std::int8_t* high(Index r) const { return W + r * 2 * dPad; }
  std::int8_t* low(Index r) const { return W + r * 2 * dPad + dPad; }
  std::int32_t* sums(Index r) const { return sumW + r * blocks; }
};

/// q4 keys' logits, portable: the AVX-512 and AVX2 kernels' integers and float steps.
inline void q4LogitsPortable(const float* const* a, Index R, const unsigned char* const* groups, Index n, Index d,
                             float* const* s, float* as) {
  const Q4KeyScratch k(as, R, d);
  for (Index g = 0; g < n; ++g) {
    const auto* scales = reinterpret_cast<const std::uint16_t*>(groups[g]);
    const unsigned char* codes = groups[g] + d * Index(sizeof(std::uint16_t));
    for (Index r = 0; r < R; ++r) k.ws[r] = q4KeyWeights(a[r], scales, d, k.high(r), k.low(r), k.sums(r));
    for (Index r = 0; r < R; ++r)
      for (Index b = 0; b < k.blocks; ++b) {
        std::int32_t acc[kGroup] = {};
        for (Index c = b * kIntChannels; c < std::min(k.dPad, (b + 1) * kIntChannels); ++c) {
          const std::int32_t W = 128 * std::int32_t(k.high(r)[c]) + std::int32_t(k.low(r)[c]);
          const unsigned char* q = codes + c / 4 * 2 * kGroup + c % 4;
          for (Index i = 0; i < kGroup / 2; ++i) {
            acc[i] += W * std::int32_t(q[4 * i] & 0xF);
            acc[i + kGroup / 2] += W * std::int32_t(q[4 * i] >> 4);
          }
        }
        float* out = s[r] + g * kGroup;
        for (Index i = 0; i < kGroup; ++i) out[i] = std::fma(k.ws[r], float(acc[i] - 8 * k.sums(r)[b]), out[i]);
      }
  }
}

/// q8 and q4 values' dots, portable: the AVX-512 and AVX2 kernels' integers and float steps.
template <typename F>
void valuesGroupsPortable(const float* const* p, Index R, const unsigned char* const* groups, Index n, Index d,
                          float* const* dots) {
  for (Index r = 0; r < R; ++r) std::fill(dots[r], dots[r] + d, 0.0f);
  std::uint8_t Ph[kGroup], Pl[kGroup];
  for (Index g = 0; g < n; ++g) {
    const auto* scales = reinterpret_cast<const std::uint16_t*>(groups[g]);
    for (Index r = 0; r < R; ++r) {
      const float ps = intValueWeights(p[r] + g * kGroup, Ph, Pl);
      if (ps == 0.0f) continue;
      for (Index c = 0; c < d; ++c) {
        std::int32_t sum = 0;
        for (Index i = 0; i < kGroup; ++i)
          sum += (256 * std::int32_t(Ph[i]) + std::int32_t(Pl[i])) * codeAt<F>(groups[g], d, i, c);
        dots[r][c] = std::fma(halfBits(scales[c]) * ps, float(sum), dots[r][c]);
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
 * q8 keys' logits with AVX2 (every x86 CPU since 2013-2015 that lacks AVX-512, the AMD ones among
 * them): avx512's exact sums (vpmaddwd), so the same bits on every path.
 */
namespace avx2 {

#define SDPA_QUANT_TARGET __attribute__((target("avx2,fma,f16c")))

/// Rows per register block of the logits (16 registers).
inline constexpr Index kRows = 2;

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
  if (anyNonFinite(w, d)) {
    std::fill(W, W + (d + 1) / 2 * 2, std::int16_t(0));
    return std::numeric_limits<float>::quiet_NaN();
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
// The integer kernels of q4 keys and q8/q4 values (kv_quant_bytes.inc): AVX-512 with VNNI
// (vpdpbusd), AVX-512 BW (vpmaddubsw, vpmaddwd and vpaddd: the same integers, with no pair of
// products past int16's range: q4 codes <= 15 against bytes <= 128, bytes <= 255 against q4 codes
// <= 8, 7-bit parts of the weights against q8 codes <= 127), and AVX2 as AVX-512 BW on 8 lanes.
namespace avx512 {

#define SDPA_BYTES_BW __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))

/// kv_quant_bytes.inc's vector operations on 16 lanes (AVX512F and AVX512BW).
struct Ops512 {
  using VI = __m512i;
  using VF = __m512;
  static constexpr int kBytes = 64;
  static constexpr Index kLanes = 16, kRows = 3;
  static constexpr int kSplit = 2;
  /// Whether dot() adds each product into 32 bits (vpdpbusd), or pairs of them into 16 first
  /// (vpmaddubsw: a pair must stay within int16).
  static constexpr bool kWideProducts = false;
  SDPA_BYTES_BW static VF set1(float x) { return _mm512_set1_ps(x); }
  SDPA_BYTES_BW static VF abs(VF x) { return _mm512_abs_ps(x); }
  SDPA_BYTES_BW static VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  SDPA_BYTES_BW static VF max(VF a, VF b) { return _mm512_max_ps(a, b); }
  SDPA_BYTES_BW static VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
  SDPA_BYTES_BW static VF loadF(const float* p) { return _mm512_loadu_ps(p); }
  SDPA_BYTES_BW static void storeF(float* p, VF x) { _mm512_storeu_ps(p, x); }
  SDPA_BYTES_BW static __mmask16 first(Index n) { return __mmask16((1u << n) - 1); }
  SDPA_BYTES_BW static VF loadLanesF(const float* p, Index n) {
    return n == kLanes ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(first(n), p);
  }
  SDPA_BYTES_BW static void storeLanes(float* p, VF x, Index n) {
    if (n == kLanes)
      _mm512_storeu_ps(p, x);
    else
      _mm512_mask_storeu_ps(p, first(n), x);
  }
  SDPA_BYTES_BW static VF halves(const std::uint16_t* h) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  }
  SDPA_BYTES_BW static VF halvesLanes(const std::uint16_t* h, Index n) {
    if (n == kLanes) return halves(h);
    alignas(32) std::uint16_t x[kLanes] = {};
    std::memcpy(x, h, size_t(n) * sizeof *h);
    return halves(x);
  }
  SDPA_BYTES_BW static bool allFinite(VF x) {
    return _mm512_cmp_ps_mask(x, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_LE_OQ) == 0xFFFF;
  }
  SDPA_BYTES_BW static float reduceMax(VF x) { return _mm512_reduce_max_ps(x); }
  SDPA_BYTES_BW static VI round(VF x) { return _mm512_cvtps_epi32(x); }
  SDPA_BYTES_BW static VF toFloat(VI x) { return _mm512_cvtepi32_ps(x); }
  SDPA_BYTES_BW static std::int32_t reduceAdd(VI x) { return _mm512_reduce_add_epi32(x); }
  SDPA_BYTES_BW static void storeBytes(std::int8_t* p, VI x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  SDPA_BYTES_BW static void storeBytesUnsigned(std::uint8_t* p, VI x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  SDPA_BYTES_BW static VI zero() { return _mm512_setzero_si512(); }
  SDPA_BYTES_BW static VI set1Int(std::int32_t x) { return _mm512_set1_epi32(x); }
  SDPA_BYTES_BW static VI addInt(VI a, VI b) { return _mm512_add_epi32(a, b); }
  SDPA_BYTES_BW static VI andInt(VI a, std::int32_t b) { return _mm512_and_si512(a, _mm512_set1_epi32(b)); }
  SDPA_BYTES_BW static VI shiftLeft7(VI x) { return _mm512_slli_epi32(x, 7); }
  SDPA_BYTES_BW static VI shiftLeft8(VI x) { return _mm512_slli_epi32(x, 8); }
  SDPA_BYTES_BW static VI shiftRight8(VI x) { return _mm512_srli_epi32(x, 8); }
  template <int N>
  SDPA_BYTES_BW static VI shiftLeft(VI x) {
    return _mm512_slli_epi32(x, N);
  }
  template <int N>
  SDPA_BYTES_BW static VI shiftRight(VI x) {
    return _mm512_srli_epi32(x, N);
  }
  SDPA_BYTES_BW static VI shiftRightArithmetic7(VI x) { return _mm512_srai_epi32(x, 7); }
  SDPA_BYTES_BW static VI load(const void* p) { return _mm512_loadu_si512(p); }
  SDPA_BYTES_BW static VI loadLanes(const void* p, Index n) {
    return n == kLanes ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(first(n), p);
  }
  SDPA_BYTES_BW static VI lowNibbles(VI x) { return _mm512_and_si512(x, _mm512_set1_epi8(0x0F)); }
  SDPA_BYTES_BW static VI highNibbles(VI x) {
    return _mm512_and_si512(_mm512_srli_epi16(x, 4), _mm512_set1_epi8(0x0F));
  }
  SDPA_BYTES_BW static VI minus8(VI x) { return _mm512_sub_epi8(x, _mm512_set1_epi8(8)); }
  SDPA_BYTES_BW static VI broadcast4(const void* p) {
    std::int32_t x;
    std::memcpy(&x, p, sizeof x);
    return _mm512_set1_epi32(x);
  }
};

namespace bytes_vnni {
#define SDPA_BYTES_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))
struct Ops : Ops512 {
  static constexpr bool kWideProducts = true;
  SDPA_BYTES_TARGET static VI dot(VI acc, VI a, VI b) { return _mm512_dpbusd_epi32(acc, a, b); }
};
#include "kv_quant_bytes.inc"
#undef SDPA_BYTES_TARGET
}  // namespace bytes_vnni

namespace bytes_bw {
#define SDPA_BYTES_TARGET SDPA_BYTES_BW
struct Ops : Ops512 {
  SDPA_BYTES_TARGET static VI dot(VI acc, VI a, VI b) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
  }
};
#include "kv_quant_bytes.inc"
#undef SDPA_BYTES_TARGET
}  // namespace bytes_bw
#undef SDPA_BYTES_BW

}  // namespace avx512

namespace avx2::bytes {

#define SDPA_BYTES_TARGET __attribute__((target("avx2,fma,f16c")))

/// kv_quant_bytes.inc's vector operations on 8 lanes.
struct Ops {
  using VI = __m256i;
  using VF = __m256;
  static constexpr int kBytes = 32;
  static constexpr Index kLanes = 8, kRows = 1;
  static constexpr int kSplit = 1;
  static constexpr bool kWideProducts = false;
  SDPA_BYTES_TARGET static VF set1(float x) { return _mm256_set1_ps(x); }
  SDPA_BYTES_TARGET static VF abs(VF x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  SDPA_BYTES_TARGET static VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  SDPA_BYTES_TARGET static VF max(VF a, VF b) { return _mm256_max_ps(a, b); }
  SDPA_BYTES_TARGET static VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
  SDPA_BYTES_TARGET static VF loadF(const float* p) { return _mm256_loadu_ps(p); }
  SDPA_BYTES_TARGET static void storeF(float* p, VF x) { _mm256_storeu_ps(p, x); }
  SDPA_BYTES_TARGET static __m256i first(Index n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  SDPA_BYTES_TARGET static VF loadLanesF(const float* p, Index n) {
    return n == kLanes ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first(n));
  }
  SDPA_BYTES_TARGET static void storeLanes(float* p, VF x, Index n) {
    if (n == kLanes)
      _mm256_storeu_ps(p, x);
    else
      _mm256_maskstore_ps(p, first(n), x);
  }
  SDPA_BYTES_TARGET static VF halves(const std::uint16_t* h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  }
  SDPA_BYTES_TARGET static VF halvesLanes(const std::uint16_t* h, Index n) {
    if (n == kLanes) return halves(h);
    alignas(16) std::uint16_t x[kLanes] = {};
    std::memcpy(x, h, size_t(n) * sizeof *h);
    return halves(x);
  }
  SDPA_BYTES_TARGET static bool allFinite(VF x) {
    return _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(std::numeric_limits<float>::max()), _CMP_LE_OQ)) == 0xFF;
  }
  SDPA_BYTES_TARGET static float reduceMax(VF x) {
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
  SDPA_BYTES_TARGET static VI round(VF x) { return _mm256_cvtps_epi32(x); }
  SDPA_BYTES_TARGET static VF toFloat(VI x) { return _mm256_cvtepi32_ps(x); }
  SDPA_BYTES_TARGET static std::int32_t reduceAdd(VI x) {
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    const __m128i q = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 1)));
  }
  /// The low byte of each lane (its value in range), 8 bytes.
  template <bool Signed>
  SDPA_BYTES_TARGET static void bytes(void* p, VI x) {
    const __m256i w = _mm256_packs_epi32(x, x);  // 16-bit: lanes 0-3 twice, then 4-7 twice
    const __m256i b = Signed ? _mm256_packs_epi16(w, w) : _mm256_packus_epi16(w, w);
    const std::int32_t lo = _mm_cvtsi128_si32(_mm256_castsi256_si128(b)),
                       hi = _mm_cvtsi128_si32(_mm256_extracti128_si256(b, 1));
    std::memcpy(p, &lo, 4);
    std::memcpy(static_cast<char*>(p) + 4, &hi, 4);
  }
  SDPA_BYTES_TARGET static void storeBytes(std::int8_t* p, VI x) { bytes<true>(p, x); }
  SDPA_BYTES_TARGET static void storeBytesUnsigned(std::uint8_t* p, VI x) { bytes<false>(p, x); }
  SDPA_BYTES_TARGET static VI zero() { return _mm256_setzero_si256(); }
  SDPA_BYTES_TARGET static VI set1Int(std::int32_t x) { return _mm256_set1_epi32(x); }
  SDPA_BYTES_TARGET static VI addInt(VI a, VI b) { return _mm256_add_epi32(a, b); }
  SDPA_BYTES_TARGET static VI andInt(VI a, std::int32_t b) { return _mm256_and_si256(a, _mm256_set1_epi32(b)); }
  SDPA_BYTES_TARGET static VI shiftLeft7(VI x) { return _mm256_slli_epi32(x, 7); }
  SDPA_BYTES_TARGET static VI shiftLeft8(VI x) { return _mm256_slli_epi32(x, 8); }
  SDPA_BYTES_TARGET static VI shiftRight8(VI x) { return _mm256_srli_epi32(x, 8); }
  template <int N>
  SDPA_BYTES_TARGET static VI shiftLeft(VI x) {
    return _mm256_slli_epi32(x, N);
  }
  template <int N>
  SDPA_BYTES_TARGET static VI shiftRight(VI x) {
    return _mm256_srli_epi32(x, N);
  }
  SDPA_BYTES_TARGET static VI shiftRightArithmetic7(VI x) { return _mm256_srai_epi32(x, 7); }
  SDPA_BYTES_TARGET static VI load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  SDPA_BYTES_TARGET static VI loadLanes(const void* p, Index n) {
    return n == kLanes ? load(p) : _mm256_maskload_epi32(static_cast<const int*>(p), first(n));
  }
  SDPA_BYTES_TARGET static VI lowNibbles(VI x) { return _mm256_and_si256(x, _mm256_set1_epi8(0x0F)); }
  SDPA_BYTES_TARGET static VI highNibbles(VI x) {
    return _mm256_and_si256(_mm256_srli_epi16(x, 4), _mm256_set1_epi8(0x0F));
  }
  SDPA_BYTES_TARGET static VI minus8(VI x) { return _mm256_sub_epi8(x, _mm256_set1_epi8(8)); }
  SDPA_BYTES_TARGET static VI broadcast4(const void* p) {
    std::int32_t x;
    std::memcpy(&x, p, sizeof x);
    return _mm256_set1_epi32(x);
  }
  SDPA_BYTES_TARGET static VI dot(VI acc, VI a, VI b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
  }
};

#include "kv_quant_bytes.inc"
#undef SDPA_BYTES_TARGET

}  // namespace avx2::bytes
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

/// The highest intDotIsa a process may use (2); tests lower it to run the AVX512BW path on a
/// CPU with VNNI.
struct IntDotCap {
  static int& value() {
    static int cap = 2;
    return cap;
  }
};

/// 0: no AVX512BW; 1: AVX512BW; 2: AVX512BW and AVX512_VNNI (the integer dot products' paths:
/// q8 keys, q4 keys and values).
inline int intDotIsa() {
#if SDPA_HAS_ISA_DISPATCH
  static const int isa = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bw")) return 0;
    return __builtin_cpu_supports("avx512vnni") ? 2 : 1;
  }();
  return IsaChoice::current() >= Isa::Avx512 ? std::min(isa, IntDotCap::value()) : 0;
#else
  return 0;
#endif
}

/// The decoding logits over n groups of keys (see above), on the CPU's fastest path: q8 keys
/// (paired codes) and q4 keys (nibble quads) as integer dot products. as: scratch of
/// logitsScratch(R, d) floats.
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
  } else if constexpr (kNibbleQuads<F>) {
#if SDPA_HAS_ISA_DISPATCH
    const int isa = intDotIsa();
    if (isa == 2) return avx512::bytes_vnni::logits(a, R, groups, n, d, s, as);
    if (isa == 1) return avx512::bytes_bw::logits(a, R, groups, n, d, s, as);
    if (IsaChoice::current() >= Isa::Avx2) return avx2::bytes::logits(a, R, groups, n, d, s, as);
#endif
    q4LogitsPortable(a, R, groups, n, d, s, as);
  } else {
    static_assert(kPaired<F, true> || kNibbleQuads<F>, "q8 or q4 keys");
  }
}

/// The decoding weighted values over n groups (see above), on the CPU's fastest path: integer
/// dot products of the weights rounded to 16 bits and the codes.
template <typename F>
void valuesGroups(const float* const* p, Index R, const unsigned char* const* groups, Index n, Index d,
                  float* const* dots) {
#if SDPA_HAS_ISA_DISPATCH
  const int isa = intDotIsa();
  if (isa == 2) return avx512::bytes_vnni::values<F>(p, R, groups, n, d, dots);
  if (isa == 1) return avx512::bytes_bw::values<F>(p, R, groups, n, d, dots);
  if (IsaChoice::current() >= Isa::Avx2) return avx2::bytes::values<F>(p, R, groups, n, d, dots);
#endif
  valuesGroupsPortable<F>(p, R, groups, n, d, dots);
}

}  // namespace internal::quant
}  // namespace sdpa

#endif  // SDPA_INTERNAL_KV_QUANT_HPP
