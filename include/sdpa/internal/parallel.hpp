#ifndef SDPA_INTERNAL_PARALLEL_HPP
#define SDPA_INTERNAL_PARALLEL_HPP

#include <algorithm>
#include <exception>

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

/// A growable flat buffer: scratch that is allocated once and then reused by every call (first
/// touch of fresh pages is expensive; see docs/PERFORMANCE.md).
template <typename T>
class Buffer {
 public:
  /// At least n elements, never a null pointer (a 0-column Map over null data would make its
  /// row() offset a null pointer, undefined behaviour).
  T* get(Index n) {
    if (m_data.size() < std::max<Index>(n, 1)) m_data.resize(std::max<Index>(n, 1));
    return m_data.data();
  }

 private:
  Eigen::Matrix<T, Eigen::Dynamic, 1> m_data;
};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_PARALLEL_HPP
