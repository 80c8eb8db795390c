// Shared by the benchmarks: FLOP counters, thread control, and the ceilings every kernel is
// compared with in the same run (SGEMM of the same FLOP count, memory read bandwidth).
#pragma once

#include <benchmark/benchmark.h>

#include <Eigen/Core>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef SDPA_BENCH_OPENBLAS
#include <cblas.h>
#endif

namespace sdpa_bench {

using Index = Eigen::Index;

/// Sets the OpenMP thread count for this benchmark (the kernels read it through Eigen::nbThreads).
/// With EIGEN_USE_BLAS (bench_forward_blas), every sdpa thread calls a one-thread sgemm: an
/// OpenBLAS built on pthreads would otherwise run each tile's product on all cores.
inline void setThreads(int n) {
#ifdef _OPENMP
  omp_set_num_threads(n);
#else
  (void)n;
#endif
#ifdef SDPA_BENCH_OPENBLAS
  openblas_set_num_threads(1);
#endif
}

/// Median of `reps` timings of f() in seconds, after one warm-up call.
template <typename F>
double medianSeconds(F&& f, int reps = 7) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[size_t(reps / 2)];
}

/// GFLOP/s of an SGEMM with the FLOP count of a forward pass of n_q x n_k, head size d:
/// (n_q x 2d) * (2d x n_k) is 2 n_q n_k 2d = 4 n_q n_k d FLOPs. Eigen's, on one thread, measured
/// once per shape and run and cached, so that each kernel reports its ratio to this ceiling.
inline double eigenSgemmGflops(Index nQ, Index nK, Index d) {
  static std::map<std::vector<Index>, double> cache;
  const std::vector<Index> key{nQ, nK, d};
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const Eigen::Index rows = std::min<Index>(nQ, 4096), cols = std::min<Index>(nK, 4096);  // same rate, bounded memory
  const Eigen::MatrixXf a = Eigen::MatrixXf::Random(rows, 2 * d), b = Eigen::MatrixXf::Random(2 * d, cols);
  Eigen::MatrixXf c(rows, cols);
  const int before = Eigen::nbThreads();
  Eigen::setNbThreads(1);
  const double s = medianSeconds([&] { c.noalias() = a * b; });
  Eigen::setNbThreads(before > 0 && before != omp_get_max_threads() ? before : 0);
  benchmark::DoNotOptimize(c.data());
  return cache[key] = 4.0 * double(rows) * double(cols) * double(d) / s * 1e-9;
}

/// The same with OpenBLAS's cblas_sgemm (one thread), or 0 when the benchmarks were built
/// without it. Unset OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE when comparing: they pin OpenBLAS
/// to its AVX2 kernels on this machine.
inline double openblasSgemmGflops(Index nQ, Index nK, Index d) {
#ifdef SDPA_BENCH_OPENBLAS
  static std::map<std::vector<Index>, double> cache;
  const std::vector<Index> key{nQ, nK, d};
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const Eigen::Index rows = std::min<Index>(nQ, 4096), cols = std::min<Index>(nK, 4096);
  const Eigen::MatrixXf a = Eigen::MatrixXf::Random(rows, 2 * d), b = Eigen::MatrixXf::Random(2 * d, cols);
  Eigen::MatrixXf c(rows, cols);
  openblas_set_num_threads(1);
  const double s = medianSeconds([&] {
    cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, int(rows), int(cols), int(2 * d), 1.0f, a.data(), int(rows),
                b.data(), int(2 * d), 0.0f, c.data(), int(rows));
  });
  benchmark::DoNotOptimize(c.data());
  return cache[key] = 4.0 * double(rows) * double(cols) * double(d) / s * 1e-9;
#else
  (void)nQ, (void)nK, (void)d;
  return 0;
#endif
}

/// Wall time of a benchmark's timing loop, to turn its rate into ratios inside the benchmark.
class LoopTimer {
 public:
  LoopTimer() : m_start(std::chrono::steady_clock::now()) {}
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - m_start).count(); }

 private:
  std::chrono::steady_clock::time_point m_start;
};

/**
 * Reports GFLOPS for `flops` per iteration and the ratio of that rate to the one-thread SGEMM
 * ceilings of the same FLOP count measured in this run: "xSGEMM" (Eigen's) and
 * "xSGEMM_openblas". `seconds` is the loop's wall time from a LoopTimer started before it.
 */
/**
 * The machine's fp32 FMA peak of one core in GFLOP/s, measured (not looked up): 12 independent
 * chains of vector FMAs (enough to cover the latency on every x86 core), 2 FLOPs a lane, at the
 * widest width the CPU runs (AVX-512, else AVX2; chosen at run time, as the kernels are). Median
 * of 5, measured once per run. kernels / this = the fraction of the machine a kernel uses
 * (docs/PERFORMANCE.md); 0 where no such ISA exists.
 */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx512f"))) inline float fmaChains512(long iters) {
  __m512 a[12];
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(float(i));
  for (long t = 0; t < iters; ++t) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], x, y);
  }
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);
  return out[0];
}
__attribute__((target("avx2,fma"))) inline float fmaChains256(long iters) {
  __m256 a[12];
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(float(i));
  for (long t = 0; t < iters; ++t) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], x, y);
  }
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0];
}
#endif
/// GFLOP/s of chains(iters), which does `flopsPerIter` FLOPs an iteration: median of 5.
template <typename F>
double chainsGflops(F&& chains, double flopsPerIter) {
  const long iters = 20000000;
  float sink = 0;
  const double s = medianSeconds([&] { sink += chains(iters); }, 5);
  benchmark::DoNotOptimize(sink);
  return flopsPerIter * double(iters) / s * 1e-9;
}
inline double fmaPeakGflops() {
  static double cached = -1;
  if (cached >= 0) return cached;
  cached = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool wide = __builtin_cpu_supports("avx512f");
  if (!wide && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return cached;
  cached = chainsGflops([&](long iters) { return wide ? fmaChains512(iters) : fmaChains256(iters); },
                        12.0 * 2.0 * (wide ? 16 : 8));
#endif
  return cached;
}

/**
 * The bf16 dot-product peak of one core in GFLOP/s (AVX512_BF16's vdpbf16ps on 512 bits: two
 * multiply-adds a 32-bit lane, 4 FLOPs), measured as fmaPeakGflops is; 0 without AVX512_BF16.
 * Over fmaPeakGflops, what bf16 products can gain on this CPU at most.
 */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx512f,avx512bf16"))) inline float dotChainsBf16(long iters) {
  __m512 a[12];
  const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f803f80));  // (1, 1)
  const __m512bh y = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x33d633d6));  // (1e-7, 1e-7)
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(float(i));
  for (long t = 0; t < iters; ++t) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
  }
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);
  return out[0];
}
#endif
inline double bf16DotPeakGflops() {
  static double cached = -1;
  if (cached >= 0) return cached;
  cached = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16")) return cached;
  cached = chainsGflops(dotChainsBf16, 12.0 * 4.0 * 16);
#endif
  return cached;
}

/**
 * The storage-order benchmarks' "xColumnMajor" (BM_ForwardLayout, BM_ForwardHeadsLayout,
 * BM_BackwardLayout; args n, d, threads, rowMajor): the column-major run of a shape, registered
 * first, records its time per call; the row-major and mixed runs of the same shape report their
 * own time over it. `heads` keeps apart the shapes of benchmarks over different head counts.
 */
inline void reportLayoutRatio(benchmark::State& state, double seconds, Index heads = 1) {
  static std::map<std::vector<Index>, double> columnMajor;
  if (state.iterations() == 0) return;
  const std::vector<Index> key{heads, state.range(0), state.range(1), state.range(2)};
  const double perCall = seconds / double(state.iterations());
  if (!state.range(3))
    columnMajor[key] = perCall;
  else if (auto it = columnMajor.find(key); it != columnMajor.end())
    state.counters["xColumnMajor"] = perCall / it->second;
}

inline void reportFlops(benchmark::State& state, double flops, double seconds, Index nQ, Index nK, Index d) {
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  if (state.iterations() == 0 || seconds <= 0) return;
  const double gflops = flops * double(state.iterations()) / seconds * 1e-9;
  state.counters["xSGEMM"] = gflops / eigenSgemmGflops(nQ, nK, d);
  // Per core: a run on t threads is compared with t cores' peak.
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  if (const double peak = fmaPeakGflops(); peak > 0) state.counters["xFMA"] = gflops / (peak * threads);
  if (const double peak = bf16DotPeakGflops(); peak > 0) state.counters["xBF16DOT"] = gflops / (peak * threads);
  if (const double ob = openblasSgemmGflops(nQ, nK, d); ob > 0) state.counters["xSGEMM_openblas"] = gflops / ob;
}

/**
 * fp16 values one core widens to float and multiplies into a sum per second, in G values/s:
 * 12 independent chains of vcvtph2ps (from L1) and a vector FMA, at the widest width the CPU
 * runs (AVX-512, else AVX2 + F16C; chosen at run time, as the kernels are). Median of 5,
 * measured once per run; 0 where neither exists. Decoding from fp16 K/V widens every value once
 * (half.hpp's column kernels do exactly this per value), so 2 n_k d / this is the least time a
 * token can take whatever the memory: where it exceeds the read time, the read-bandwidth target
 * is out of reach (a first-generation EPYC: a 256-bit vcvtph2ps every 3 cycles, session 51).
 */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC 12 warns of an uninitialised value inside its own _mm512_cvtph_ps (as half.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx512f"))) inline float widenChains512(long iters, const std::uint16_t* h) {
  __m512 a[12];
  const __m512 x = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < 12; ++i) a[i] = _mm512_setzero_ps();
  for (long t = 0; t < iters; ++t) {
    __asm__ volatile("" : : "r"(h) : "memory");  // the loads stay in the loop
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i)
      a[i] = _mm512_fmadd_ps(x, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h + 16 * i))), a[i]);
  }
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);
  return out[0];
}
__attribute__((target("avx2,fma,f16c"))) inline float widenChains256(long iters, const std::uint16_t* h) {
  __m256 a[12];
  const __m256 x = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < 12; ++i) a[i] = _mm256_setzero_ps();
  for (long t = 0; t < iters; ++t) {
    __asm__ volatile("" : : "r"(h) : "memory");
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i)
      a[i] = _mm256_fmadd_ps(x, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h + 16 * i))), a[i]);
  }
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0];
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
inline double halfWidenGvalues() {
  static double cached = -1;
  if (cached >= 0) return cached;
  cached = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool wide = __builtin_cpu_supports("avx512f");
  // (Every AVX2 CPU has F16C, as half.hpp assumes; clang cannot ask __builtin_cpu_supports.)
  if (!wide && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return cached;
  // Each chain's 16 halves (32 bytes, 1 + i 2^-10): the same L1 lines every iteration.
  alignas(64) static std::uint16_t h[12 * 16];
  for (int i = 0; i < 12 * 16; ++i) h[i] = std::uint16_t(0x3c00 + (i & 63));
  // chainsGflops's "FLOPs" an iteration: here the values widened, 12 vectors.
  cached = chainsGflops([&](long iters) { return wide ? widenChains512(iters, h) : widenChains256(iters, h); },
                        12.0 * (wide ? 16 : 8));
#endif
  return cached;
}

/**
 * Single-thread memory read bandwidth in GB/s over 512 MiB, far beyond the caches: the larger of
 * a vectorised sum (one stream) and a float matrix-vector product over a 2^20 x 128 column-major
 * matrix (several column streams at once, the access pattern of decoding). Median of 5 passes,
 * measured once per run.
 */
inline double readBandwidthGBs() {
  static double cached = 0;
  if (cached > 0) return cached;
  setThreads(1);
  const int before = Eigen::nbThreads();
  Eigen::setNbThreads(1);
  const Index rows = Index(1) << 20, cols = 128;  // 512 MiB of floats
  Eigen::MatrixXf a = Eigen::MatrixXf::Ones(rows, cols);
  const Eigen::VectorXf x = Eigen::VectorXf::Ones(rows);
  Eigen::VectorXf y(cols);
  float sink = 0;
  const double bytes = double(rows) * double(cols) * sizeof(float);
  const double sum = bytes / medianSeconds([&] { sink += a.sum(); }, 5);
  const double gemv = bytes / medianSeconds([&] { y.noalias() = a.transpose() * x; }, 5);
  Eigen::setNbThreads(before > 0 && before != omp_get_max_threads() ? before : 0);
  benchmark::DoNotOptimize(sink);
  benchmark::DoNotOptimize(y.data());
  return cached = std::max(sum, gemv) * 1e-9;
}

}  // namespace sdpa_bench
