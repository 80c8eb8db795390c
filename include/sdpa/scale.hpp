/**
 * \file sdpa/scale.hpp
 * \brief Scale policies: the tau in softmax(tau * q k^T + mask) v.
 *
 * The scale is a type, not a bare float, because the right value depends on the head dimension
 * d_k (seed C3/C7: Var(q.k) = d_k, so tau = 1/sqrt(d_k) restores unit variance) and a bare
 * float silently goes stale when d_k changes. Every policy answers `value<Scalar>(d_k)`.
 *
 * | policy              | tau                     | seed |
 * |---------------------|-------------------------|------|
 * | `InvSqrtDk{}`       | 1/sqrt(d_k) (default)   | C1, C7, C9 |
 * | `None{}`            | 1                       | C4, C8 |
 * | `Constant{c}`       | c                       |      |
 * | `Temperature{T}`    | 1/T                     | C10  |
 * | `Learnable<S>`      | a parameter with a gradient, starts at 1/sqrt(d_k) | C17 |
 * | `LogN{c}`           | c ln(n_i) / sqrt(d_k) for a row that sees n_i keys; c learnable | C10, C17 |
 */
#ifndef SDPA_SCALE_HPP
#define SDPA_SCALE_HPP

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "internal/macros.hpp"

namespace sdpa::scale {

/**
 * \brief tau = 1/sqrt(d_k), the scale of "Attention Is All You Need" and of every pretrained model
 * (seed C1, C9). The default everywhere.
 *
 * For d_k = 0 every logit is an empty sum, 0, and tau is irrelevant; it is defined as 1 there so
 * that 0 * tau stays 0 instead of 0 * inf = NaN.
 */
struct InvSqrtDk {
  static constexpr bool IsScalePolicy = true;
  /// Holds a parameter and accumulates dL/dtau.
  static constexpr bool IsLearnable = false;

  template <typename Scalar = double>
  Scalar value(Index headDim) const {
    return headDim > 0 ? Scalar(1) / std::sqrt(Scalar(headDim)) : Scalar(1);
  }
};

/// \brief tau = 1: plain (unscaled) dot-product attention. The case the seed article warns about
/// (C4: with d_k = 64 the logits have std 8 and the softmax saturates).
struct None {
  static constexpr bool IsScalePolicy = true;
  static constexpr bool IsLearnable = false;

  template <typename Scalar = double>
  Scalar value(Index /*headDim*/) const {
    return Scalar(1);
  }
};

/// \brief tau = c, a runtime constant (for example a model's `softmax_scale`). Must be finite.
struct Constant {
  static constexpr bool IsScalePolicy = true;
  static constexpr bool IsLearnable = false;

  explicit Constant(double c) : m_value(c) {
    if (!std::isfinite(c))
      throw std::invalid_argument("sdpa::scale::Constant: the scale must be finite, got " + std::to_string(c));
  }
  template <typename Scalar = double>
  Scalar value(Index /*headDim*/) const {
    return Scalar(m_value);
  }
  double constant() const { return m_value; }

 private:
  double m_value;
};

/**
 * \brief tau = 1/T, a softmax temperature (seed C10): T > 1 flattens the attention, T < 1
 * sharpens it. `Temperature{std::sqrt(d_k)}` equals `InvSqrtDk{}`. T must be finite and > 0.
 */
struct Temperature {
  static constexpr bool IsScalePolicy = true;
  static constexpr bool IsLearnable = false;

  explicit Temperature(double t) : m_temperature(t) {
    if (!(t > 0) || !std::isfinite(t))
      throw std::invalid_argument("sdpa::scale::Temperature: the temperature must be finite and > 0, got " +
                                  std::to_string(t));
  }
  template <typename Scalar = double>
  Scalar value(Index /*headDim*/) const {
    return Scalar(1) / Scalar(m_temperature);
  }
  double temperature() const { return m_temperature; }

 private:
  double m_temperature;
};

/**
 * \brief A learnable tau: a parameter with an accumulated gradient dL/dtau (seed C17).
 *
 * Default-constructed it starts at 1/sqrt(d_k) of the head it scales: the seed's lesson is that
 * a learnable scale started at 1 (unscaled) collapses early while one started at 1/sqrt(d_k) is
 * stable. `Learnable<float>{1.0f}` starts elsewhere on purpose; `forHeadDim(d_k)` pins the start
 * to a known head dimension so that `value()` can be read before the first forward pass.
 *
 * The backward pass adds to the gradient with `accumulateGrad`; an optimiser reads `grad()`,
 * writes `setValue()` and calls `zeroGrad()`.
 */
template <typename Scalar_>
class Learnable {
 public:
  using Scalar = Scalar_;
  SDPA_STATIC_ASSERT(internal::IsSupportedScalar<Scalar>, LEARNABLE_SCALE_PARAMETER_MUST_BE_float_OR_double);

  static constexpr bool IsScalePolicy = true;
  static constexpr bool IsLearnable = true;

  /// Starts at 1/sqrt(d_k) of the head it first scales (no value stored until `setValue`).
  Learnable() = default;
  /// Starts at `start`, which must be finite.
  explicit Learnable(Scalar start) { setValue(start); }
  /// Starts at 1/sqrt(headDim), stored now.
  static Learnable forHeadDim(Index headDim) { return Learnable(InvSqrtDk{}.value<Scalar>(headDim)); }

  template <typename S = Scalar>
  S value(Index headDim) const {
    return m_hasValue ? S(m_value) : InvSqrtDk{}.value<S>(headDim);
  }
  /// Whether a value is stored; if not, tau is 1/sqrt(d_k) of the call.
  bool hasValue() const { return m_hasValue; }
  /// The stored value; throws std::logic_error if none is stored yet (use value(d_k)).
  Scalar value() const {
    if (!m_hasValue)
      throw std::logic_error(
          "sdpa::scale::Learnable::value(): no value stored yet; it is 1/sqrt(d_k) until set, read value(d_k)");
    return m_value;
  }
  void setValue(Scalar v) {
    if (!std::isfinite(v))
      throw std::invalid_argument("sdpa::scale::Learnable: the value must be finite, got " + std::to_string(v));
    m_value = v;
    m_hasValue = true;
  }

  /// Accumulated dL/dtau since the last zeroGrad().
  Scalar grad() const { return m_grad; }
  void accumulateGrad(Scalar g) { m_grad += g; }
  void zeroGrad() { m_grad = Scalar(0); }

 private:
  Scalar m_value = Scalar(0);
  Scalar m_grad = Scalar(0);
  bool m_hasValue = false;
};

/**
 * \brief Log-length scaling: query row i is scaled by tau_i = c ln(n_i) / sqrt(d_k), n_i the keys
 * that row sees, and c is a learnable parameter.
 *
 * With a fixed tau a row's weights spread as the context grows: over n_i logits of a fixed spread
 * the entropy grows like ln(n_i) (a temperature that no longer fits, seed C10), and a key whose
 * logit stands out by a fixed margin is diluted among the n_i - 1 others. Multiplying the logits
 * by ln(n_i) lets such a key keep its weight at any length: Scalable-Softmax (SSMax, Nakanishi
 * 2025) learns s in softmax(s ln(n) z), and Qwen's "logn" attention scales q by log_L(n) beyond
 * its training length L. Here tau_i = c ln(n_i) / sqrt(d_k): c = 1 / ln(L) gives exactly
 * 1/sqrt(d_k) at n_i = L (`LogN::matching(L)`); the default is `matching(512)`.
 *
 * n_i counts the keys row i can see: n_k without a mask, fewer under a causal or sliding-window
 * mask (its row's prefix or window), a Keep matrix, -inf Bias entries or padding (a batch
 * item's key length). A row that sees a single key has tau_i = 0 (its one weight is 1 anyway);
 * a row that sees none is fully masked. `value(d_k)` is the row-independent part c / sqrt(d_k);
 * the kernels fold ln(n_i) into the query rows (a scaled copy of q per call, O(n_q d_k)).
 *
 * The backward pass reports dL/dc (not dL/dtau, which differs per row) in `dscale` and, for a
 * non-const policy, accumulates it: dL/dc = sum_i ln(n_i) / sqrt(d_k) dL/dtau_i.
 */
class LogN {
 public:
  using Scalar = double;
  static constexpr bool IsScalePolicy = true;
  static constexpr bool IsLearnable = true;
  /// tau differs per query row with the number of keys the row sees.
  static constexpr bool DependsOnKeyCount = true;

  /// c = 1 / ln(512): tau = 1/sqrt(d_k) where a row sees 512 keys.
  LogN() : LogN(1.0 / std::log(512.0)) {}
  /// c, which must be finite.
  explicit LogN(double c) { setValue(c); }
  /// c = 1 / ln(keys): the plain 1/sqrt(d_k) at `keys` visible keys (a model's training length),
  /// larger beyond it, smaller before it. keys must be >= 2.
  static LogN matching(Index keys) {
    if (keys < 2)
      throw std::invalid_argument("sdpa::scale::LogN::matching: need a length >= 2 (ln 1 = 0), got " +
                                  std::to_string(keys));
    return LogN(1.0 / std::log(double(keys)));
  }

  /// The factor of every row of a head, c / sqrt(d_k) (c for d_k = 0, as InvSqrtDk).
  template <typename S = double>
  S value(Index headDim) const {
    return S(m_c * InvSqrtDk{}.value<double>(headDim));
  }
  /// The row's own factor: tau_i = value(d_k) * rowFactor(n_i) = value(d_k) ln(n_i), and 0 for
  /// n_i <= 1.
  static double rowFactor(Index visibleKeys) { return visibleKeys > 1 ? std::log(double(visibleKeys)) : 0.0; }
  /// d value(d_k) / dc = 1 / sqrt(d_k): the backward's dL/dc = slope * dL/d(value).
  static double valueSlope(Index headDim) { return InvSqrtDk{}.value<double>(headDim); }

  /// The parameter c.
  double value() const { return m_c; }
  void setValue(double c) {
    if (!std::isfinite(c)) throw std::invalid_argument("sdpa::scale::LogN: c must be finite, got " + std::to_string(c));
    m_c = c;
  }

  /// Accumulated dL/dc since the last zeroGrad().
  double grad() const { return m_grad; }
  void accumulateGrad(double g) { m_grad += g; }
  void zeroGrad() { m_grad = 0; }

 private:
  double m_c = 0;
  double m_grad = 0;
};

namespace internal {
template <typename T, typename = void>
struct DependsOnKeyCountImpl : std::false_type {};
template <typename T>
struct DependsOnKeyCountImpl<T, std::void_t<decltype(T::DependsOnKeyCount)>>
    : std::bool_constant<T::DependsOnKeyCount> {};
}  // namespace internal

/**
 * \brief One scale policy per query head, for the multi-head entry points: a learnable
 * temperature per head (`PerHead<Learnable<float>>(H)`) or per-head constants
 * (`PerHead<Constant>::constants({...})`). Head h is scaled by `head(h).value(d_k)` with the
 * head's own d_k (seed C16).
 */
template <typename Policy_>
class PerHead {
 public:
  using Policy = Policy_;
  SDPA_STATIC_ASSERT(Policy::IsScalePolicy, PerHead_HOLDS_SCALE_POLICIES__FOR_EXAMPLE_PerHead_OF_Learnable_float);
  static constexpr bool IsScalePolicy = true;
  static constexpr bool IsPerHead = true;
  static constexpr bool IsLearnable = Policy::IsLearnable;
  static constexpr bool DependsOnKeyCount = internal::DependsOnKeyCountImpl<Policy>::value;

  explicit PerHead(std::vector<Policy> heads) : m_heads(std::move(heads)) {}
  /// H default-constructed policies (for Learnable: each starts at 1/sqrt(d_k)).
  explicit PerHead(Index heads) : m_heads(static_cast<size_t>(heads)) {}
  /// Per-head constants tau_h = c_h.
  static PerHead constants(const std::vector<double>& values) {
    std::vector<Policy> heads;
    for (const double c : values) heads.emplace_back(c);
    return PerHead(std::move(heads));
  }

  Index size() const { return Index(m_heads.size()); }
  const Policy& head(Index h) const { return m_heads[size_t(h)]; }
  Policy& head(Index h) { return m_heads[size_t(h)]; }

 private:
  std::vector<Policy> m_heads;
};

namespace internal {
template <typename T, typename = void>
struct IsPerHeadImpl : std::false_type {};
template <typename T>
struct IsPerHeadImpl<T, std::void_t<decltype(T::IsPerHead)>> : std::bool_constant<T::IsPerHead> {};

template <typename T, typename = void>
struct IsPolicyImpl : std::false_type {};
template <typename T>
struct IsPolicyImpl<T, std::void_t<decltype(T::IsScalePolicy)>> : std::bool_constant<T::IsScalePolicy> {};
}  // namespace internal

/// True for the scale policies above (and user policies that follow the same interface).
template <typename T>
inline constexpr bool IsPolicy = internal::IsPolicyImpl<std::decay_t<T>>::value;

/// True for policies whose tau depends on the keys a row sees (LogN, PerHead<LogN>).
template <typename T>
inline constexpr bool DependsOnKeyCount = internal::DependsOnKeyCountImpl<std::decay_t<T>>::value;

/// True for PerHead<...>: one policy per query head.
template <typename T>
inline constexpr bool IsPerHead = internal::IsPerHeadImpl<std::decay_t<T>>::value;

}  // namespace sdpa::scale

#endif  // SDPA_SCALE_HPP
