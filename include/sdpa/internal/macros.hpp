#ifndef SDPA_INTERNAL_MACROS_HPP
#define SDPA_INTERNAL_MACROS_HPP

#include <Eigen/Core>
#include <type_traits>

/// Compile-time check whose message is an upper-case sentence telling the user what to do, as
/// Eigen's EIGEN_STATIC_ASSERT: `SDPA_STATIC_ASSERT(cond, SCALE_POLICY_MUST_PROVIDE_VALUE)`.
#define SDPA_STATIC_ASSERT(COND, MSG) static_assert(COND, #MSG)

namespace sdpa {

/// Index type of every shape in the library (Eigen's, signed).
using Index = Eigen::Index;

/// The matrices the public functions return: column-major, dynamic (Eigen::MatrixX<Scalar>).
template <typename Scalar>
using Matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
/// The vectors the public functions return (a logSumExp, a dscale per head).
template <typename Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

namespace internal {

/// Scalars the kernels compute in.
template <typename T>
inline constexpr bool IsSupportedScalar = std::is_same_v<T, float> || std::is_same_v<T, double>;

/// Half-precision storage types the tiled forward reads (computing in float).
template <typename T>
inline constexpr bool IsHalfScalar = std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;

/// The type logits, softmax and sums are computed in: float for half, bfloat16 and float
/// inputs, double for double.
template <typename T>
using Accumulator = std::conditional_t<std::is_same_v<T, double>, double, float>;

using sdpa::Matrix;
using sdpa::Vector;
template <typename Scalar>
using RowMajorMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

}  // namespace internal
}  // namespace sdpa

#endif  // SDPA_INTERNAL_MACROS_HPP
