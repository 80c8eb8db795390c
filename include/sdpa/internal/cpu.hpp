#ifndef SDPA_INTERNAL_CPU_HPP
#define SDPA_INTERNAL_CPU_HPP

#include <atomic>
#include <cstdlib>
#include <cstring>

/// SDPA_HAS_ISA_DISPATCH: the compiler can build functions for an instruction set the translation
/// unit was not compiled for (GCC and clang's target attribute) and ask the CPU at run time
/// (__builtin_cpu_supports): x86-64 only. Elsewhere the kernels keep their portable paths.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SDPA_NO_ISA_DISPATCH)
#define SDPA_HAS_ISA_DISPATCH 1
#else
#define SDPA_HAS_ISA_DISPATCH 0
#endif

namespace sdpa::internal {

/// The instruction sets the tile kernels are built for, best last. Avx512Bf16 runs the fp32
/// kernels of Avx512 and adds the bf16 dot-product kernel for bf16 (and, where allowed, fp16)
/// inputs.
enum class Isa : int { Portable = 0, Avx2 = 1, Avx512 = 2, Avx512Bf16 = 3 };

/// What this CPU runs: AVX-512 (F, with FMA; with BW, VL and BF16 the bf16 kernel too) or AVX2 +
/// FMA, else the portable path.
inline Isa detectIsa() {
#if SDPA_HAS_ISA_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16"))
    return Isa::Avx512Bf16;
  if (__builtin_cpu_supports("avx512f")) return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
#endif
  return Isa::Portable;
}

/// The ISA a kernel uses: detected once, capped by the environment variable SDPA_ISA
/// (`portable`, `avx2`, `avx512`, `avx512bf16`: to measure or test a slower path on a faster
/// machine) and by setCap (tests). Never above what the CPU supports.
class IsaChoice {
 public:
  static Isa current() {
    const Isa cap = Isa(capSlot().load(std::memory_order_relaxed));
    const Isa cpu = detected();
    return int(cap) < int(cpu) ? cap : cpu;
  }
  /// Caps the ISA of later calls (not thread-safe against running kernels; tests only).
  static void setCap(Isa cap) { capSlot().store(int(cap), std::memory_order_relaxed); }
  static Isa detected() {
    static const Isa isa = [] {
      const Isa cpu = detectIsa();
      const char* env = std::getenv("SDPA_ISA");  // NOLINT(concurrency-mt-unsafe): read once
      if (!env) return cpu;
      Isa want = cpu;
      if (std::strcmp(env, "portable") == 0) want = Isa::Portable;
      if (std::strcmp(env, "avx2") == 0) want = Isa::Avx2;
      if (std::strcmp(env, "avx512") == 0) want = Isa::Avx512;
      if (std::strcmp(env, "avx512bf16") == 0) want = Isa::Avx512Bf16;
      return int(want) < int(cpu) ? want : cpu;
    }();
    return isa;
  }

 private:
  static std::atomic<int>& capSlot() {
    static std::atomic<int> cap{int(Isa::Avx512Bf16)};
    return cap;
  }
};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_CPU_HPP
