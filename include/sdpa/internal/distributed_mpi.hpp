#ifndef SDPA_INTERNAL_DISTRIBUTED_MPI_HPP
#define SDPA_INTERNAL_DISTRIBUTED_MPI_HPP

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "checks.hpp"
#include "macros.hpp"

namespace sdpa::internal::mpi {

template <typename Scalar>
MPI_Datatype datatype() {
  return std::is_same_v<Scalar, double> ? MPI_DOUBLE : MPI_FLOAT;
}

/// Throws if an MPI call failed (the caller's error handler may return instead of aborting).
inline void check(int code, const char* where, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw std::runtime_error(std::string(where) + ": " + call + " failed: " + std::string(text, size_t(length)));
}

/// A message's element count as MPI's int, or a clear error (MPI counts are int).
inline int count(const char* where, Index n) {
  if (n < 0 || n > Index(INT_MAX))
    throwInvalid(where, "a message of " + std::to_string(n) + " elements exceeds MPI's int count; use more ranks");
  return int(n);
}

/// A private duplicate of the caller's communicator for one call, so that the call's messages
/// never match the caller's own (the convention of MPI libraries); freed by the destructor.
class Duplicate {
 public:
  Duplicate(MPI_Comm comm, const char* where) { check(MPI_Comm_dup(comm, &m_comm), where, "MPI_Comm_dup"); }
  ~Duplicate() { MPI_Comm_free(&m_comm); }
  Duplicate(const Duplicate&) = delete;
  Duplicate& operator=(const Duplicate&) = delete;
  MPI_Comm get() const { return m_comm; }
  int rank() const {
    int r = 0;
    MPI_Comm_rank(m_comm, &r);
    return r;
  }
  int size() const {
    int p = 0;
    MPI_Comm_size(m_comm, &p);
    return p;
  }

 private:
  MPI_Comm m_comm = MPI_COMM_NULL;
};

/**
 * Collective validation: every rank hands in the message of its own failed checks ("" if none)
 * and the numbers every rank must agree on; every rank then throws the same
 * std::invalid_argument (the first failing rank's message, or the first disagreement), or none
 * throws. So a rank with a bad shape never leaves the others waiting in a receive.
 */
inline void agree(MPI_Comm comm, const char* where, const std::string& localError,
                  const std::vector<std::int64_t>& mustAgree, const std::vector<std::string>& names) {
  int p = 0, rank = 0;
  MPI_Comm_size(comm, &p);
  MPI_Comm_rank(comm, &rank);
  const int n = int(mustAgree.size());
  std::vector<std::int64_t> local(mustAgree);
  local.push_back(std::int64_t(localError.size()));
  std::vector<std::int64_t> all(size_t(p) * size_t(n + 1));
  check(MPI_Allgather(local.data(), n + 1, MPI_INT64_T, all.data(), n + 1, MPI_INT64_T, comm), where, "MPI_Allgather");
  std::vector<int> lengths(static_cast<size_t>(p)), offsets(static_cast<size_t>(p));
  int total = 0;
  for (int r = 0; r < p; ++r) {
    lengths[size_t(r)] = int(all[size_t(r) * size_t(n + 1) + size_t(n)]);
    offsets[size_t(r)] = total;
    total += lengths[size_t(r)];
  }
  if (total > 0) {
    std::vector<char> text(static_cast<size_t>(total));
    check(MPI_Allgatherv(localError.data(), int(localError.size()), MPI_CHAR, text.data(), lengths.data(),
                         offsets.data(), MPI_CHAR, comm),
          where, "MPI_Allgatherv");
    for (int r = 0; r < p; ++r)
      if (lengths[size_t(r)] > 0)
        throw std::invalid_argument(std::string(where) + ": on rank " + std::to_string(r) + " of " + std::to_string(p) +
                                    ": " + std::string(text.data() + offsets[size_t(r)], size_t(lengths[size_t(r)])));
  }
  for (int i = 0; i < n; ++i)
    for (int r = 1; r < p; ++r) {
      const std::int64_t a = all[size_t(i)], b = all[size_t(r) * size_t(n + 1) + size_t(i)];
      if (a != b)
        throw std::invalid_argument(std::string(where) + ": the ranks disagree on " + names[size_t(i)] +
                                    ": rank 0 has " + std::to_string(a) + ", rank " + std::to_string(r) + " has " +
                                    std::to_string(b) +
                                    " (every rank must pass the same heads, splits, head dimensions and types)");
    }
}

/// Runs `checks` (which throws std::invalid_argument on bad input) and returns its message
/// without the "<where>: " prefix, or "" when it passes: a rank's local checks, for agree().
template <typename F>
std::string localErrors(const char* where, F&& checks) {
  try {
    checks();
  } catch (const std::invalid_argument& e) {
    std::string what = e.what();
    const std::string prefix = std::string(where) + ": ";
    if (what.compare(0, prefix.size(), prefix) == 0) what.erase(0, prefix.size());
    return what.empty() ? std::string("invalid argument") : what;
  }
  return {};
}

/// FNV-1a over integers: a fingerprint of a split for agree().
inline std::int64_t fingerprint(const std::vector<Index>& values) {
  std::uint64_t h = 1469598103934665603ull;
  for (Index v : values) {
    h ^= std::uint64_t(v);
    h *= 1099511628211ull;
  }
  return std::int64_t(h >> 1);
}

}  // namespace sdpa::internal::mpi

#endif  // SDPA_INTERNAL_DISTRIBUTED_MPI_HPP
