#ifndef SDPA_INTERNAL_PARALLEL_HPP
#define SDPA_INTERNAL_PARALLEL_HPP

#include <algorithm>
#include <cstddef>
#include <exception>
#include <memory>
#include <new>
#include <type_traits>

#include "macros.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace sdpa::internal {

/**
 * Threads a kernel may use: Eigen::nbThreads(), which is omp_get_max_threads() (so
 * omp_set_num_threads and OMP_NUM_THREADS) unless Eigen::setNbThreads overrides it, and 1 when
 * compiled without OpenMP or when already inside a parallel region (no nested teams).
 */
inline int maxThreads() {
#ifdef _OPENMP
  if (omp_in_parallel()) return 1;
  return std::max(1, Eigen::nbThreads());
#else
  return 1;
#endif
}

/// The calling thread's index inside parallelFor, in [0, maxThreads()).
inline int threadIndex() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/**
 * Calls f(i) for i in [0, n) on up to `threads` threads, dynamically scheduled (work units differ:
 * masked tiles are skipped). An exception thrown by f is rethrown on the calling thread after
 * the loop (OpenMP forbids it to leave the parallel region).
 */
template <typename F>
void parallelFor(Index n, int threads, F&& f) {
#ifdef _OPENMP
  const int t = int(std::min<Index>(n, threads));
  if (t > 1) {
    std::exception_ptr error;
#pragma omp parallel for num_threads(t) schedule(dynamic, 1)
    for (Index i = 0; i < n; ++i) {
      try {
        f(i);
      } catch (...) {
#pragma omp critical(sdpa_parallel_error)
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#else
  (void)threads;
#endif
  for (Index i = 0; i < n; ++i) f(i);
}

/// Bytes of a cache line: the alignment of the kernels' scratch and of a KvCache's pool.
inline constexpr std::size_t kLineBytes = 64;

/**
 * An allocator of storage on a cache line. The kernels chosen at run time load 64-byte vectors
 * at multiples of 64 bytes of their buffers; Eigen's allocations are aligned to the build's
 * widest vector (16 bytes without -mavx), where every such load would straddle two lines.
 */
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(kLineBytes))); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t(kLineBytes)); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const noexcept {
    return false;
  }
};

/// A growable flat buffer on a cache line (LineAllocator): scratch that is allocated once and
/// then reused by every call (first touch of fresh pages is expensive; see docs/PERFORMANCE.md).
/// Its elements are not initialised, as Eigen leaves a plain scalar matrix's.
template <typename T>
class Buffer {
  static_assert(std::is_trivially_destructible_v<T>, "Buffer holds scalars and indices");

 public:
  /// At least n elements, never a null pointer (a 0-column Map over null data would make its
  /// row() offset a null pointer, undefined behaviour). Growing drops the contents.
  T* get(Index n) {
    n = std::max<Index>(n, 1);
    if (m_size < n) {
      m_data.reset();  // before the new allocation, which may throw: then empty, not stale
      m_size = 0;
      m_data.reset(LineAllocator<T>().allocate(std::size_t(n)));
      m_size = n;
    }
    return m_data.get();
  }

 private:
  struct Free {
    void operator()(T* p) const noexcept { LineAllocator<T>().deallocate(p, 0); }
  };
  std::unique_ptr<T, Free> m_data;
  Index m_size = 0;
};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_PARALLEL_HPP
