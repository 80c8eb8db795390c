#ifndef SDPA_INTERNAL_CPU_HPP
#define SDPA_INTERNAL_CPU_HPP

#include <atomic>
#include <cstddef>
#include <cstdint>
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

#if SDPA_HAS_ISA_DISPATCH
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace sdpa::internal {

/// The instruction sets the tile kernels are built for, best last. Avx512Bf16 runs the fp32
/// kernels of Avx512 and adds the bf16 dot-product kernel for bf16 (and, where allowed, fp16)
/// inputs; Amx takes that kernel's two tile products to the AMX tile unit (TDPBF16PS).
enum class Isa : int { Portable = 0, Avx2 = 1, Avx512 = 2, Avx512Bf16 = 3, Amx = 4 };

/// Whether this process may use AMX tiles: the CPU has AMX-TILE and AMX-BF16, the OS saves tile
/// state (XCR0 bits 17 and 18) and Linux granted the process its tile data (arch_prctl
/// ARCH_REQ_XCOMP_PERM, once per process: without it the first tile instruction faults).
inline bool amxUsable() {
#if SDPA_HAS_ISA_DISPATCH && defined(__linux__) && defined(SYS_arch_prctl)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
  if ((d & kAmxBf16) == 0 || (d & kAmxTile) == 0) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || (c & (1u << 27)) == 0) return false;  // OSXSAVE: xgetbv
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  constexpr unsigned kTileState = (1u << 17) | (1u << 18);  // XTILECFG, XTILEDATA
  if ((lo & kTileState) != kTileState) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;  // NOLINT(cppcoreguidelines-pro-type-vararg)
#else
  return false;
#endif
}

/// What this CPU runs: AVX-512 (F and DQ, with FMA; with BW, VL and BF16 the bf16 kernel too)
/// or AVX2 + FMA, else the portable path.
inline Isa detectIsa() {
#if SDPA_HAS_ISA_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16"))
    return amxUsable() ? Isa::Amx : Isa::Avx512Bf16;
  // DQ: the fp32 tile kernels' exp2 splits with vreduceps. Every AVX-512 CPU but Xeon Phi has it.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
#endif
  return Isa::Portable;
}

/// The ISA a kernel uses: detected once, capped by the environment variable SDPA_ISA
/// (`portable`, `avx2`, `avx512`, `avx512bf16`, `amx`: to measure or test a slower path on a faster
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
      if (std::strcmp(env, "amx") == 0) want = Isa::Amx;
      return int(want) < int(cpu) ? want : cpu;
    }();
    return isa;
  }

 private:
  static std::atomic<int>& capSlot() {
    static std::atomic<int> cap{int(Isa::Amx)};
    return cap;
  }
};

/**
 * How decoding reads memory: the order measured best on Intel's cores, on AMD's, or on the first
 * or third generation of AMD's Zen cores. Software requests ahead of the kernels (decode_cache.hpp's
 * ColumnsAhead and ChunkPrefetch) and the column order of short columns (half.hpp's
 * halfColumnByColumn) went opposite ways on the two vendors' prefetchers. First-generation Zen
 * (`znver1`: family 23, models below 0x30) takes AMD's order except three requests that cost it
 * (session 50, KvCache decoding, d 128, 65536 keys, one thread): the narrow logits passes' requests
 * of the next columns (one token 5.5-5.6 -> 4.5 ms, 8 heads 41-46 -> 34 ms; they had paid on Zen 4
 * and an Emerald Rapids Xeon), the next chunk's (8 rows 16.6 -> 13.1-13.3 ms, 16 rows 28.3 ->
 * 24.4-24.8) and those of paged blocks up to 32 keys, which are read several at once instead (fp32
 * blocks of 16 6.6-6.8 -> 4.7 ms, fp16 6.0-6.2 -> 4.0; blocks of 64 kept their requests: fp32 6.4
 * ms with, 7.2-7.5 without). Its blocks of more than 32 keys (float; half ones below the half
 * column kernels' 256) are read four at once, column by column (longPiecesAtOnce): one at a time, a
 * block of 64-256 keys was a single stream in address order, which its prefetcher followed page by
 * page; fp32 blocks of 64 / 256 took 1.35-1.38 / 1.41-1.44x the contiguous cache's time, now
 * 1.14-1.16 / 1.05-1.07, and through four caches in turn 1.26-1.29 / 1.28-1.36x, now 1.00-1.03 /
 * 0.97-0.98; fp16 blocks of 64 1.12-1.16 -> 1.05-1.11 (session 52). Third-generation Zen
 * (`znver3`) reads as the first does but keeps the multi-row blocks' chunk requests (session 53,
 * medians of 12 alternated runs, AMD's order -> this one: one fp32 token 6.3 -> 5.4 ms, fp32 paged
 * blocks of 16-64 7.2-7.4 -> 5.0-5.3 ms, of 256 7.8 -> 8.0, fp16 blocks of 16 5.4 -> 3.0, 8 heads
 * over 65536 keys 51 -> 43 ms; 8 query rows 13.9 ms in AMD's order, 15.6 in the first Zen's, which
 * does not request the next chunk). The CPU's own order, asked once; setOrder overrides it (tests:
 * every order gives the same bits, and the tests run each on any CPU). Without run-time dispatch,
 * AMD's order.
 */
class CpuVendor {
 public:
  enum class Order : int { Intel = 0, Amd = 1, FirstZen = 2, Zen3 = 3 };
  static Order order() {
    const int forced = slot().load(std::memory_order_relaxed);
    return forced < 0 ? detected() : Order(forced);
  }
  static bool intel() { return order() == Order::Intel; }
  /// The first-generation Zen's reads (first and third generation): no column requests, short
  /// pieces several at once, long ones four at once.
  static bool zenReads() {
    const Order o = order();
    return o == Order::FirstZen || o == Order::Zen3;
  }
  /// Whether the narrow logits passes over long columns request the next columns (rowLogits' Ahead).
  static bool columnRequests() { return !zenReads(); }
  /// Whether the multi-row blocks request the next chunk while they compute (ChunkPrefetch).
  static bool chunkRequests() {
    const Order o = order();
    return o == Order::Amd || o == Order::Zen3;
  }
  /// The most keys of the short pieces (a paged sequence's blocks) whose runs alike are read
  /// several at once without requests ahead, rather than one at a time with the piece after next
  /// requested (ColumnsAhead): any in Intel's order, 32 in first- and third-generation Zen's, none
  /// in AMD's.
  static std::ptrdiff_t groupedPieceKeys() {
    if (order() == Order::Intel) return PTRDIFF_MAX;
    return zenReads() ? 32 : 0;
  }
  /// How many long pieces (a paged sequence's blocks of more than groupedPieceKeys keys, columns
  /// close; half ones only where the half column kernels do not take them) the narrow decoding
  /// passes read at once, column by column: 4 in first- and third-generation Zen's orders (on the
  /// first, 2: blocks of 64 1.20x the contiguous cache, 8: no faster than 4), 1 in the others (not
  /// measured there).
  static std::ptrdiff_t longPiecesAtOnce() { return zenReads() ? 4 : 1; }
  /// Forces the order of later calls (-1: the CPU's own; not thread-safe against running
  /// kernels; tests only).
  static void setOrder(int forced) { slot().store(forced, std::memory_order_relaxed); }
  static void setOrder(Order forced) { setOrder(int(forced)); }

 private:
  static Order detected() {
#if SDPA_HAS_ISA_DISPATCH
    static const Order order = [] {
      __builtin_cpu_init();
      if (__builtin_cpu_is("intel")) return Order::Intel;
      if (__builtin_cpu_is("znver1")) return Order::FirstZen;
      return __builtin_cpu_is("znver3") ? Order::Zen3 : Order::Amd;
    }();
    return order;
#else
    return Order::Amd;
#endif
  }
  static std::atomic<int>& slot() {
    static std::atomic<int> forced{-1};
    return forced;
  }
};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_CPU_HPP
