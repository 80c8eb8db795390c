/**
 * \file sdpa/kernel.hpp
 * \brief Which kernel computes a pass: `sdpa::kernel::Tiled` (the default) or the reference
 * `sdpa::kernel::Naive`. Every entry point takes a kernel as an optional first argument, as the
 * standard algorithms take an execution policy: `sdpa::attention(sdpa::kernel::Naive{}, q, k, v)`.
 */
#ifndef SDPA_KERNEL_HPP
#define SDPA_KERNEL_HPP

#include <type_traits>

#include "internal/macros.hpp"

namespace sdpa::kernel {

/**
 * \brief The reference kernel: materialises the n_q x n_k logits of one head, a single-pass
 * softmax, then P v. Memory O(n_q n_k); serial. Kept as the oracle the tiled kernel is tested
 * against and for readers who want the textbook computation. The only kernel that feeds a
 * DiagnosticsSink (the row statistics need each row whole), so a sink selects it.
 */
struct Naive {
  static constexpr bool IsKernel = true;
};

/**
 * \brief FlashAttention-2 style tiled kernel: blocks of query rows stream blocks of keys and
 * values with an online softmax; never materialises n_q x n_k (memory O(threads x blockQ x
 * blockK)); skips tiles a mask hides entirely; threads with OpenMP over (batch item, head, query
 * block) and, when those are fewer than the threads (decoding), over key ranges merged by their
 * logSumExp. Block sizes 0 mean "chosen for d_k" (docs/PERFORMANCE.md gives the table).
 */
struct Tiled {
  static constexpr bool IsKernel = true;
  Index blockQ = 0;  ///< query rows per block, 0 = automatic
  Index blockK = 0;  ///< keys per block, 0 = automatic
};

/// True for the kernels above.
template <typename T, typename = void>
inline constexpr bool IsKernel = false;
template <typename T>
inline constexpr bool IsKernel<T, std::void_t<decltype(std::decay_t<T>::IsKernel)>> = std::decay_t<T>::IsKernel;

}  // namespace sdpa::kernel

#endif  // SDPA_KERNEL_HPP
