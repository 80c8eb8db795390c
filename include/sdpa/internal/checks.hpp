#ifndef SDPA_INTERNAL_CHECKS_HPP
#define SDPA_INTERNAL_CHECKS_HPP

#include <stdexcept>
#include <string>

#include "macros.hpp"

namespace sdpa::internal {

inline std::string shapeString(Index rows, Index cols) { return std::to_string(rows) + "x" + std::to_string(cols); }

/// Throws std::invalid_argument "<where>: <what>". Kept out of line of the callers' hot paths.
[[noreturn]] inline void throwInvalid(const char* where, const std::string& what) {
  throw std::invalid_argument(std::string(where) + ": " + what);
}

/// The shape contract of one attention head: q n_q x d_k, k n_k x d_k, v n_k x d_v.
/// Always on (release builds too): a wrong shape must never turn into an out-of-bounds read.
inline void checkAttentionShapes(const char* where, Index qRows, Index qCols, Index kRows, Index kCols, Index vRows,
                                 Index vCols) {
  if (qCols != kCols)
    throwInvalid(where, "q is " + shapeString(qRows, qCols) + " and k is " + shapeString(kRows, kCols) +
                            ": q and k must have the same number of columns (d_k)");
  if (kRows != vRows)
    throwInvalid(where, "k is " + shapeString(kRows, kCols) + " and v is " + shapeString(vRows, vCols) +
                            ": k and v must have the same number of rows (n_k)");
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_CHECKS_HPP
