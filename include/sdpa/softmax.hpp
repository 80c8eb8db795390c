/**
 * \file sdpa/softmax.hpp
 * \brief Numerically stable softmax, logSumExp, the softmax Jacobian and its vector-Jacobian
 * product (seed C2, C5, C13).
 *
 * Every softmax subtracts the maximum first, so logits of 1e4 stay finite although exp
 * overflows above 88.72 in fp32 (C13). A row whose entries are all -inf (fully masked) gives
 * probabilities 0 and logSumExp -inf, never NaN; a NaN entry makes its whole row NaN.
 */
#ifndef SDPA_SOFTMAX_HPP
#define SDPA_SOFTMAX_HPP

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "internal/checks.hpp"
#include "internal/macros.hpp"

namespace sdpa {
namespace internal {

template <typename Derived>
void assertFloatingVector() {
  SDPA_STATIC_ASSERT(IsSupportedScalar<typename Derived::Scalar>, SOFTMAX_INPUT_MUST_BE_float_OR_double__USE_cast);
  SDPA_STATIC_ASSERT(Derived::IsVectorAtCompileTime,
                     THIS_FUNCTION_TAKES_A_VECTOR__USE_rowSoftmax_OR_rowLogSumExp_FOR_A_MATRIX);
}

/// Arguments at or below this give weight exactly 0: the logarithm of the smallest normal
/// number (exp(kExpCut) is just above it). Below it Eigen's vectorised exp does not round to the
/// subnormal it should but clamps (exp(-106.9f) comes out as 2.9e-39, 10^8 times too large, and
/// exp(-inf) as 1e-39), and such a weight times a dP of inf made a gradient NaN that a plain
/// computation gives finite (found by the fuzzer). The cut-off of expHidingMinusInf, of the
/// online softmax's exp pass and of the backward's weights: an absolute error of at most the
/// smallest normal number per weight, as before, but now exactly 0.
template <typename S>
inline constexpr S kExpCut = std::is_same_v<S, float> ? S(-87.33) : S(-708.39);

/**
 * exp(z) elementwise, exactly 0 at or below kExpCut (so at -inf), vectorised. Eigen 3.4's
 * select() is not vectorised (20x slower than exp), so those entries are zeroed arithmetically:
 * the ramp clamp(2^20 (z - cut), 0, 1) is 0 up to the cut and 1 from a millionth above it (a
 * weight near the smallest normal number in between).
 */
template <typename Derived>
auto expHidingMinusInf(const Eigen::ArrayBase<Derived>& z) {
  using S = typename Derived::Scalar;
  constexpr S cut = kExpCut<S>;
  return z.max(cut).exp() * ((z - cut) * S(1 << 20)).max(S(0)).min(S(1));
}

/**
 * The softmax of one row of logits as the backward pass keeps it: the row maximum m and
 * l = sum_j exp(L_j - m), never folded into one logSumExp m + log l. Rounded to float, that sum
 * is off by half an ulp of |m| (2e-6 at |L| = 60), an error that every weight exp(L - lse) would
 * take on while a plain softmax, exp(L - m) / l, has none of it (NUMERICS.md). m is NaN for a row
 * with a NaN or +inf visible logit and -inf for a row with nothing visible (then l = 0).
 */
template <typename Scalar>
struct RowSoftmax {
  Scalar max, sum;
};

/**
 * The weights P = exp(L - m) / l of one row from its RowSoftmax, written into p (may alias l):
 * hidden entries (-inf) and a row with nothing visible (m = -inf) give exactly 0; a row with a
 * NaN or +inf logit (m NaN) gives NaN at its visible entries only, so that the NaN does not
 * reach the gradients of keys the row never saw.
 */
template <typename DL, typename DP, typename Scalar>
void weightsFromRowSoftmax(const Eigen::ArrayBase<DL>& l, const Eigen::ArrayBase<DP>& p_, RowSoftmax<Scalar> row) {
  auto& p = const_cast<Eigen::ArrayBase<DP>&>(p_);  // Eigen's idiom to write into blocks
  constexpr Scalar inf = std::numeric_limits<Scalar>::infinity();
  if (row.max == -inf)
    p.setZero();
  else if (std::isnan(row.max))
    for (Index j = 0; j < p.size(); ++j) p(j) = l(j) == -inf ? Scalar(0) : std::numeric_limits<Scalar>::quiet_NaN();
  else {
    p = expHidingMinusInf(l - row.max);
    p /= row.sum;
  }
}

/**
 * Replaces a row of logits L (hidden entries -inf) by its weights P = exp(L - m) / l, as the
 * backward pass needs them (see RowSoftmax), and returns m, with the index of the maximum in
 * *argmax when m is finite. A row with nothing visible gives 0 and m = -inf; a row with a NaN or
 * +inf visible logit gives NaN at its visible entries only, 0 at hidden ones, and m = NaN.
 */
template <typename Derived>
typename Derived::Scalar backwardSoftmaxInPlace(const Eigen::MatrixBase<Derived>& x_, Index* argmax) {
  using Scalar = typename Derived::Scalar;
  auto& x = const_cast<Eigen::MatrixBase<Derived>&>(x_);  // Eigen's idiom to write into blocks
  constexpr Scalar inf = std::numeric_limits<Scalar>::infinity();
  if (x.size() == 0) return -inf;
  const Scalar m = x.template maxCoeff<Eigen::PropagateNaN>();
  if (m == -inf) {
    x.setZero();
    return -inf;
  }
  if (!(m < inf)) {
    for (Index j = 0; j < x.size(); ++j) x(j) = x(j) == -inf ? Scalar(0) : std::numeric_limits<Scalar>::quiet_NaN();
    return std::numeric_limits<Scalar>::quiet_NaN();
  }
  x.maxCoeff(argmax);
  x = expHidingMinusInf(x.array() - m).matrix();
  x /= x.sum();
  return m;
}

/**
 * Replaces x (a row or vector of logits) by softmax(x) and returns logSumExp(x).
 * All -inf (or empty): x becomes 0, returns -inf. Any NaN: x becomes NaN, returns NaN.
 */
template <typename Derived>
typename Derived::Scalar softmaxInPlace(const Eigen::MatrixBase<Derived>& x_) {
  using Scalar = typename Derived::Scalar;
  auto& x = const_cast<Eigen::MatrixBase<Derived>&>(x_);  // Eigen's idiom to write into blocks
  constexpr Scalar inf = std::numeric_limits<Scalar>::infinity();
  if (x.size() == 0) return -inf;
  const Scalar m = x.template maxCoeff<Eigen::PropagateNaN>();
  if (m == -inf) {
    x.setZero();
    return -inf;
  }
  if (!(m < inf)) {  // a NaN, or +inf: an infinite logit has no finite softmax
    x.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
    return std::numeric_limits<Scalar>::quiet_NaN();
  }
  // Hidden entries must get weight exactly 0 (1e-309 * inf = inf would leak a hidden value).
  x = expHidingMinusInf(x.array() - m).matrix();
  const Scalar sum = x.sum();  // >= 1: the maximum contributes exp(0)
  x /= sum;
  return m + std::log(sum);
}

}  // namespace internal

/**
 * \brief softmax(x)_i = exp(x_i - logSumExp(x)) of a vector (seed C2: softmax([0,1,2]) =
 * [0.0900, 0.2447, 0.6652]). Same shape as x. For a matrix, use rowSoftmax.
 */
template <typename Derived>
typename Derived::PlainObject softmax(const Eigen::MatrixBase<Derived>& x) {
  internal::assertFloatingVector<Derived>();
  typename Derived::PlainObject p = x;
  internal::softmaxInPlace(p);
  return p;
}

/// \brief log sum_i exp(x_i) of a vector, computed as m + log sum exp(x_i - m). -inf when empty
/// or all -inf.
template <typename Derived>
typename Derived::Scalar logSumExp(const Eigen::MatrixBase<Derived>& x) {
  internal::assertFloatingVector<Derived>();
  typename Derived::PlainObject p = x;
  return internal::softmaxInPlace(p);
}

/// \brief Softmax of every row of an n x m matrix (each row a distribution over m entries).
template <typename Derived>
Matrix<typename Derived::Scalar> rowSoftmax(const Eigen::MatrixBase<Derived>& x) {
  SDPA_STATIC_ASSERT(internal::IsSupportedScalar<typename Derived::Scalar>,
                     SOFTMAX_INPUT_MUST_BE_float_OR_double__USE_cast);
  internal::RowMajorMatrix<typename Derived::Scalar> p = x;
  for (Index i = 0; i < p.rows(); ++i) internal::softmaxInPlace(p.row(i));
  return p;
}

/// \brief logSumExp of every row of an n x m matrix: an n-vector.
template <typename Derived>
Vector<typename Derived::Scalar> rowLogSumExp(const Eigen::MatrixBase<Derived>& x) {
  SDPA_STATIC_ASSERT(internal::IsSupportedScalar<typename Derived::Scalar>,
                     SOFTMAX_INPUT_MUST_BE_float_OR_double__USE_cast);
  internal::RowMajorMatrix<typename Derived::Scalar> p = x;
  Vector<typename Derived::Scalar> lse(p.rows());
  for (Index i = 0; i < p.rows(); ++i) lse(i) = internal::softmaxInPlace(p.row(i));
  return lse;
}

/**
 * \brief The softmax Jacobian J = diag(p) - p p^T, n x n, for probabilities p = softmax(x)
 * (seed C5): J_ij = dp_i/dx_j = p_i (delta_ij - p_j). Symmetric; every entry tends to 0 as p
 * tends to one-hot, which is how a saturated softmax kills the gradient without any NaN.
 */
template <typename Derived>
Matrix<typename Derived::Scalar> softmaxJacobian(const Eigen::MatrixBase<Derived>& p) {
  internal::assertFloatingVector<Derived>();
  const auto pc = p.reshaped();  // n-vector whatever p's orientation
  Matrix<typename Derived::Scalar> jac = -pc * pc.transpose();
  jac.diagonal() += pc;
  return jac;
}

/**
 * \brief J^T g for J = softmaxJacobian(p), in O(n) without forming J: (J^T g)_j = p_j (g_j - p.g).
 * The step of every attention backward pass that turns dL/dP into dL/dS. Same shape as p.
 */
template <typename DerivedP, typename DerivedG>
typename DerivedP::PlainObject softmaxJacobianVjp(const Eigen::MatrixBase<DerivedP>& p,
                                                  const Eigen::MatrixBase<DerivedG>& g) {
  internal::assertFloatingVector<DerivedP>();
  internal::assertFloatingVector<DerivedG>();
  if (p.size() != g.size())
    internal::throwInvalid("sdpa::softmaxJacobianVjp",
                           "p has " + std::to_string(p.size()) + " entries but g has " + std::to_string(g.size()));
  const auto pc = p.reshaped();
  const auto gc = g.reshaped();
  const typename DerivedP::Scalar pg = pc.dot(gc);
  typename DerivedP::PlainObject out = p;
  out.reshaped() = (pc.array() * (gc.array() - pg)).matrix();
  return out;
}

/// \brief Entropy -sum p_i log p_i in nats of a distribution p (0 log 0 = 0). log n for uniform,
/// 0 for one-hot (seed C18: a very low attention entropy means a scale mismatch).
template <typename Derived>
typename Derived::Scalar softmaxEntropy(const Eigen::MatrixBase<Derived>& p) {
  internal::assertFloatingVector<Derived>();
  using Scalar = typename Derived::Scalar;
  Scalar h = 0;
  for (Index i = 0; i < p.size(); ++i) {
    const Scalar pi = p.coeff(i);
    if (pi > 0) h -= pi * std::log(pi);
  }
  return h;
}

namespace internal {

/**
 * ||diag(p) - p p^T||_F^2 in O(n). The closed form sum p^2 - 2 sum p^3 + (sum p^2)^2 is exact
 * enough while max p < 1/2, but cancels (1 - 2 + 1) as p nears one-hot; there the largest entry
 * p_m is split off and o = sum_{j != m} p_j stands for 1 - p_m:
 *   sum_i p_i^2 (1 - p_i)^2 = p_m^2 o^2 + sum_{j != m} p_j^2 (1 - p_j)^2,
 *   sum_{i != j} p_i^2 p_j^2 = 2 p_m^2 r + (r^2 - sum_{j != m} p_j^4),  r = sum_{j != m} p_j^2.
 * pMax may be passed when known (< 0 to compute it).
 */
template <typename Derived>
double jacobianNormSquared(const Eigen::MatrixBase<Derived>& p, double pMax = -1) {
  if (p.size() == 0) return 0;
  if (pMax < 0) pMax = double(p.maxCoeff());
  if (pMax < 0.5) {
    const double s2 = double(p.squaredNorm()), s3 = double(p.array().cube().sum());
    return std::max(0.0, s2 - 2 * s3 + s2 * s2);
  }
  Index m = 0;
  const double pm = double(p.maxCoeff(&m));
  Eigen::ArrayXd rest = p.template cast<double>().array();  // the entries other than p_m
  rest(m) = 0;
  const double o = rest.sum(), r = rest.square().sum();
  const double diag = (rest.square() * (1 - rest).square()).sum(), r4 = rest.square().square().sum();
  return pm * pm * o * o + diag + 2 * pm * pm * r + std::max(0.0, r * r - r4);
}

}  // namespace internal

/**
 * \brief Frobenius norm of diag(p) - p p^T in O(n) (seed C5): near 0 means a dead gradient.
 * Equal to sqrt(sum p^2 - 2 sum p^3 + (sum p^2)^2), evaluated without that form's cancellation
 * when p is nearly one-hot.
 */
template <typename Derived>
typename Derived::Scalar softmaxJacobianNorm(const Eigen::MatrixBase<Derived>& p) {
  internal::assertFloatingVector<Derived>();
  return typename Derived::Scalar(std::sqrt(internal::jacobianNormSquared(p)));
}

}  // namespace sdpa

#endif  // SDPA_SOFTMAX_HPP
