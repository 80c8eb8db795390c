/**
 * \file sdpa/mask.hpp
 * \brief Masks: which keys each query may attend to, and additive biases.
 *
 * A mask acts on the scaled logits S = tau * q k^T (n_q x n_k) after the scale and is never
 * scaled. Hidden positions become -inf by assignment, so whatever q.k was there (even NaN from a
 * NaN in a hidden key) is discarded; a row with no visible key is "fully masked" and gives output
 * 0 and logSumExp -inf.
 *
 * Every mask provides
 * - `check(where, n_q, n_k)`: throws std::invalid_argument naming the shapes if it cannot apply;
 * - `visible(i, j, n_q, n_k)`: whether query i sees key j (the definition, used by tests);
 * - `apply(tile, row0, col0, n_q, n_k)`: applies itself to the tile of S whose top-left entry is
 *   S(row0, col0), so a tiled kernel can mask tile by tile.
 */
#ifndef SDPA_MASK_HPP
#define SDPA_MASK_HPP

#include <algorithm>
#include <limits>
#include <type_traits>

#include "internal/checks.hpp"
#include "internal/macros.hpp"

namespace sdpa::mask {

/// \brief No mask: every query sees every key.
struct None {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = true;
  static constexpr bool HasBias = false;

  void check(const char* /*where*/, Index /*nQ*/, Index /*nK*/) const {}
  bool visible(Index /*i*/, Index /*j*/, Index /*nQ*/, Index /*nK*/) const { return true; }
  template <typename Derived>
  void apply(const Eigen::MatrixBase<Derived>& /*tile*/, Index /*row0*/, Index /*col0*/, Index /*nQ*/,
             Index /*nK*/) const {}
};

/**
 * \brief How a causal mask lines up queries and keys when n_q != n_k. Always spelled out,
 * because the two conventions agree only for square attention.
 */
enum class Align {
  /// Query i sees key j iff j <= i. PyTorch `is_causal=True` (`tril(ones(L, S), 0)`): the first
  /// query is aligned with the first key.
  UpperLeft,
  /// Query i sees key j iff j <= i + n_k - n_q. FlashAttention `causal=True` and KV-cache decoding
  /// (`tril(ones(L, S), S - L)`): the last query is aligned with the last key. With n_q > n_k the
  /// first n_q - n_k queries see no key and are fully masked (output 0).
  LowerRight,
};

/// \brief Causal mask with an explicit alignment: `Causal{Align::UpperLeft}`.
struct Causal {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = false;

  Align align;

  /// Query i sees keys j <= i + diagonalOffset(n_q, n_k).
  Index diagonalOffset(Index nQ, Index nK) const { return align == Align::UpperLeft ? 0 : nK - nQ; }

  void check(const char* /*where*/, Index /*nQ*/, Index /*nK*/) const {}
  bool visible(Index i, Index j, Index nQ, Index nK) const { return j <= i + diagonalOffset(nQ, nK); }

  template <typename Derived>
  void apply(const Eigen::MatrixBase<Derived>& tile_, Index row0, Index col0, Index nQ, Index nK) const {
    using Scalar = typename Derived::Scalar;
    auto& tile = const_cast<Eigen::MatrixBase<Derived>&>(tile_);  // Eigen's idiom to write into blocks
    const Index offset = diagonalOffset(nQ, nK);
    const Index cols = tile.cols();
    for (Index r = 0; r < tile.rows(); ++r) {
      // Keys j > row0 + r + offset are hidden; first hidden column of this tile row:
      const Index firstHidden = std::clamp<Index>(row0 + r + offset + 1 - col0, 0, cols);
      tile.row(r).tail(cols - firstHidden).setConstant(-std::numeric_limits<Scalar>::infinity());
    }
  }
};

/**
 * \brief Boolean keep-mask, n_q x n_k, true = attend (PyTorch's boolean `attn_mask`).
 *
 * Like an Eigen expression it refers to a plain matrix it is given rather than copying it: keep
 * that matrix alive while the mask is used (expressions are stored by value).
 */
template <typename Derived>
class Keep {
 public:
  SDPA_STATIC_ASSERT((std::is_same_v<typename Derived::Scalar, bool>),
                     KEEP_MASK_MUST_BE_A_BOOL_MATRIX__USE_Bias_FOR_AN_ADDITIVE_MASK);
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = false;

  explicit Keep(const Eigen::MatrixBase<Derived>& keep) : m_keep(keep.derived()) {}

  void check(const char* where, Index nQ, Index nK) const {
    if (m_keep.rows() != nQ || m_keep.cols() != nK)
      internal::throwInvalid(where, "the Keep mask is " + internal::shapeString(m_keep.rows(), m_keep.cols()) +
                                        " but the logits are " + internal::shapeString(nQ, nK) + " (n_q x n_k)");
  }
  bool visible(Index i, Index j, Index /*nQ*/, Index /*nK*/) const { return m_keep(i, j); }

  template <typename DerivedS>
  void apply(const Eigen::MatrixBase<DerivedS>& tile_, Index row0, Index col0, Index /*nQ*/, Index /*nK*/) const {
    using Scalar = typename DerivedS::Scalar;
    auto& tile = const_cast<Eigen::MatrixBase<DerivedS>&>(tile_);  // Eigen's idiom to write into blocks
    const auto keep = m_keep.block(row0, col0, tile.rows(), tile.cols());
    tile = keep.array().select(tile, -std::numeric_limits<Scalar>::infinity());
  }

  const Derived& matrix() const { return m_keep; }

 private:
  typename Eigen::internal::ref_selector<Derived>::type m_keep;
};
template <typename Derived>
Keep(const Eigen::MatrixBase<Derived>&) -> Keep<Derived>;

/**
 * \brief Additive mask ("attention bias"), n_q x n_k, added to the scaled logits and never scaled
 * (PyTorch's float `attn_mask`). -inf hides a key. Bias entries at positions that another mask
 * already hides are never read, so NaN there is harmless. Refers to a plain matrix as `Keep` does.
 */
template <typename Derived>
class Bias {
 public:
  SDPA_STATIC_ASSERT(internal::IsSupportedScalar<typename Derived::Scalar>,
                     BIAS_MUST_BE_A_float_OR_double_MATRIX__USE_Keep_FOR_A_BOOLEAN_MASK);
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = true;

  explicit Bias(const Eigen::MatrixBase<Derived>& bias) : m_bias(bias.derived()) {}

  void check(const char* where, Index nQ, Index nK) const {
    if (m_bias.rows() != nQ || m_bias.cols() != nK)
      internal::throwInvalid(where, "the Bias is " + internal::shapeString(m_bias.rows(), m_bias.cols()) +
                                        " but the logits are " + internal::shapeString(nQ, nK) + " (n_q x n_k)");
  }
  bool visible(Index i, Index j, Index /*nQ*/, Index /*nK*/) const {
    return m_bias(i, j) != -std::numeric_limits<typename Derived::Scalar>::infinity();
  }

  template <typename DerivedS>
  void apply(const Eigen::MatrixBase<DerivedS>& tile_, Index row0, Index col0, Index /*nQ*/, Index /*nK*/) const {
    using Scalar = typename DerivedS::Scalar;
    auto& tile = const_cast<Eigen::MatrixBase<DerivedS>&>(tile_);  // Eigen's idiom to write into blocks
    const auto bias = m_bias.block(row0, col0, tile.rows(), tile.cols()).template cast<Scalar>();
    // Positions already hidden stay -inf and their bias is never added (it may be NaN).
    tile = (tile.array() == -std::numeric_limits<Scalar>::infinity()).select(tile, tile + bias);
  }

  const Derived& matrix() const { return m_bias; }

 private:
  typename Eigen::internal::ref_selector<Derived>::type m_bias;
};
template <typename Derived>
Bias(const Eigen::MatrixBase<Derived>&) -> Bias<Derived>;

namespace internal {
template <typename T, typename = void>
struct IsMaskImpl : std::false_type {};
template <typename T>
struct IsMaskImpl<T, std::void_t<decltype(T::IsMask)>> : std::bool_constant<T::IsMask> {};
}  // namespace internal

/// True for the masks above (and user masks that follow the same interface).
template <typename T>
inline constexpr bool IsMask = internal::IsMaskImpl<std::decay_t<T>>::value;

}  // namespace sdpa::mask

#endif  // SDPA_MASK_HPP
