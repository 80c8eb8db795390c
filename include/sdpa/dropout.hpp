/**
 * \file sdpa/dropout.hpp
 * \brief Attention dropout with a counter-based generator (Philox-4x32-10, as PyTorch and
 * FlashAttention use), so that the backward pass regenerates the forward pass's mask from
 * (seed, head, query row, key column) instead of storing n_q x n_k bits.
 */
#ifndef SDPA_DROPOUT_HPP
#define SDPA_DROPOUT_HPP

#include <array>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "internal/macros.hpp"

namespace sdpa {
namespace internal {

/// Philox-4x32 with 10 rounds (Salmon et al., SC'11): a bijection of the 128-bit counter under a
/// 64-bit key whose outputs pass BigCrush; any counter can be evaluated independently.
inline std::array<std::uint32_t, 4> philox4x32(std::array<std::uint32_t, 4> ctr, std::array<std::uint32_t, 2> key) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t(kMul0) * ctr[0], p1 = std::uint64_t(kMul1) * ctr[2];
    ctr = {std::uint32_t(p1 >> 32) ^ ctr[1] ^ key[0], std::uint32_t(p1), std::uint32_t(p0 >> 32) ^ ctr[3] ^ key[1],
           std::uint32_t(p0)};
    key = {key[0] + kWeyl0, key[1] + kWeyl1};
  }
  return ctr;
}

}  // namespace internal

/**
 * \brief Dropout on the attention weights: each weight is kept with probability 1 - p and then
 * scaled by 1 / (1 - p), so the expected output is unchanged. `Dropout{}` (p = 0) is off and
 * costs nothing. The same (p, seed) passed to the forward and the backward pass gives the same
 * mask; the logSumExp is that of the undropped weights.
 */
struct Dropout {
  double p = 0.0;
  std::uint64_t seed = 0;

  bool enabled() const { return p > 0; }
  /// Throws std::invalid_argument unless 0 <= p < 1.
  void check(const char* where) const {
    if (!(p >= 0 && p < 1))
      throw std::invalid_argument(std::string(where) + ": dropout p must be in [0, 1), got " + std::to_string(p));
  }
  /// Whether the weight of (query row i, key column j) of head h is kept. Rows and columns are
  /// global indices in the packed inputs, so batch items draw different masks.
  bool keep(Index i, Index j, Index head) const {
    const auto r = internal::philox4x32(
        {std::uint32_t(j), std::uint32_t(std::uint64_t(j) >> 32), std::uint32_t(i), std::uint32_t(head)},
        {std::uint32_t(seed), std::uint32_t(seed >> 32)});
    // Keep iff a uniform u in [0, 1) satisfies u >= p; 2^-32 resolution.
    return double(r[0]) >= p * 4294967296.0;
  }
  /// The factor applied to kept weights.
  double keepScale() const { return 1.0 / (1.0 - p); }
};

}  // namespace sdpa

#endif  // SDPA_DROPOUT_HPP
