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
 * against and for readers who want the textbook computation. A DiagnosticsSink reads its rows
 * whole; the tiled kernel streams the same figures beside its online softmax.
 */
struct Naive {
  static constexpr bool IsKernel = true;
};

/**
 * \brief What the tiled kernel's tile products compute in, for half-precision (bfloat16, half)
 * inputs. Float and double inputs always multiply in their own precision.
 */
enum class Products {
  /// The inputs' values (exact in fp32) multiplied and summed in fp32, the attention weights P
  /// fp32 too: the float kernel's accuracy (the FlashAttention rule of the float computation).
  Fp32,
  /// On a CPU with AVX512_BF16, bf16 dot products (`vdpbf16ps`: two bf16 products added into each
  /// fp32 lane), fp16 inputs rounded to bf16 (8 significant bits of their 11), and the weights P
  /// rounded to bf16 for the product P v: each output moves by at most 2^-8 sum_j P_ij |v_jc|
  /// more (docs/NUMERICS.md), as in PyTorch's bf16 CPU attention. The logits, the softmax and
  /// the accumulation stay fp32. Elsewhere, Fp32; decoding (a few query rows against many keys:
  /// up to 4, or 32 against 4 keys a row or more) too, its half K/V read in place. Faster only
  /// where the CPU runs `vdpbf16ps` at least at fp32 FMA's instruction rate (docs/PERFORMANCE.md:
  /// not every AVX512_BF16 CPU does).
  Bf16,
};

/**
 * \brief FlashAttention-2 style tiled kernel: blocks of query rows stream blocks of keys and
 * values with an online softmax; never materialises n_q x n_k (scratch per thread
 * O(blockQ x blockK + (blockQ + blockK) d)); skips tiles a mask hides entirely; threads with
 * OpenMP over (batch item, head, query block) and, when those are fewer than the threads
 * (decoding), over key ranges merged by their logSumExp. Block sizes 0 mean "chosen per call"
 * (by d_k, the mask and the threads: docs/PERFORMANCE.md, "Block sizes").
 */
struct Tiled {
  static constexpr bool IsKernel = true;
  Index blockQ = 0;                    ///< query rows per block, 0 = automatic
  Index blockK = 0;                    ///< keys per block, 0 = automatic (Products::Bf16 rounds an odd one up)
  Products products = Products::Fp32;  ///< what half-precision inputs are multiplied in
};

/// True for the kernels above.
template <typename T, typename = void>
inline constexpr bool IsKernel = false;
template <typename T>
inline constexpr bool IsKernel<T, std::void_t<decltype(std::decay_t<T>::IsKernel)>> = std::decay_t<T>::IsKernel;

}  // namespace sdpa::kernel

#endif  // SDPA_KERNEL_HPP
