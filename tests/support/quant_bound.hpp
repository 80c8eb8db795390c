// The error bound of attention over a quantised KvCache (q8_0 / q4_0-like storage, kv_quant.hpp)
// against the exact computation, derived from the quantisation step and float rounding; shared by
// test_kv_cache.cpp and the generation test of test_char_lm.cpp.
#ifndef SDPA_TESTS_SUPPORT_QUANT_BOUND_HPP
#define SDPA_TESTS_SUPPORT_QUANT_BOUND_HPP

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

namespace sdpa_test {

/**
 * For one query row of one head (q: d_k, as given to the cache's call) against the keys
 * [from, to) of a sequence of L positions (k: L x d_k and v: L x d_v of that kv head, the values
 * appended), returns per value column the largest error the quantised cache (Storage F) may give
 * against the exact attention in real arithmetic:
 * - a full group of 32 positions holds codes: a value's error is at most step / 2, step = (max |x|
 *   of its channel in the group) / MaxCode rounded up to an fp16 (relative 2^-10); the keys'
 *   integer logits also round the query row's weights to M = 32767 (q8) or 16383 (q4) steps of
 *   their largest, w_max: at most d_k MaxCode (w_max / M) (1/2 + M u) more (kv_quant.hpp).
 *   The newest positions of a group not yet full stay float.
 * - A logit's error is then at most delta = tau sum_c |q_c| step_kc / 2 (+ the int16 term), plus
 *   float rounding of the dot product and of its inputs (gamma(d_k + 2) tau max_j sum_c |q_c k_jc|,
 *   gamma(n) = n u / (1 - n u), u = 2^-24). The weights move by factors within e^{+-2 delta}, so
 *   an output moves by at most (e^{2 delta} - 1) (range of its visible values) / 2;
 * - plus the values' own error, at most max step_v / 2, and the float rounding of the weights
 *   (exp, their sum: gamma(n) + 4 u relative) and of the weighted sum (gamma(n)): (2 gamma(n) +
 *   4 u) max |v| over the n visible keys; the values' integer sums round each group's weights to
 *   65535 steps of the group's largest, p_max (1/2 + 2 65535 u steps off each): with the weights'
 *   sum at least the sum of the groups' p_max, at most 32 (1/2 + 2 65535 u) / 65535 of the
 *   largest |code value| more.
 */
template <typename F>
Eigen::VectorXd quantisedAttentionBound(const Eigen::VectorXd& q, const Eigen::MatrixXd& k, const Eigen::MatrixXd& v,
                                        Eigen::Index from, Eigen::Index to, double tau) {
  using Eigen::Index;
  constexpr Index kGroup = 32;
  const Index dK = k.cols(), dV = v.cols(), L = k.rows(), n = to - from;
  // rel: the scale rounded up to an fp16, from values that may have been rounded to float first.
  const double u = std::ldexp(1.0, -24), rel = (1.0 + std::ldexp(1.0, -10)) * (1.0 + 2 * u);
  const auto gamma = [&](double m) { return m * u / (1.0 - m * u); };
  const Index fullGroups = L / kGroup;
  double delta = 0, dotScale = 0;
  for (Index j = from; j < to; ++j)
    dotScale = std::max(dotScale, (q.cwiseAbs().array() * k.row(j).transpose().cwiseAbs().array()).sum());
  Eigen::VectorXd vStep = Eigen::VectorXd::Zero(dV);
  for (Index g = from / kGroup; g < fullGroups && g * kGroup < to; ++g) {
    double d = 0, wMax = 0;
    for (Index c = 0; c < dK; ++c) {
      const double step = k.block(g * kGroup, c, kGroup, 1).cwiseAbs().maxCoeff() / F::MaxCode * rel;
      d += std::abs(q(c)) * step / 2;
      wMax = std::max(wMax, tau * std::abs(q(c)) * step);
    }
    const double M = F::Bits == 8 ? 32767.0 : 16383.0;
    const double intRounding = double(dK) * F::MaxCode * (wMax / M) * (0.5 + M * u) * rel;
    delta = std::max(delta, tau * d + intRounding);
    for (Index c = 0; c < dV; ++c)
      vStep(c) = std::max(vStep(c), v.block(g * kGroup, c, kGroup, 1).cwiseAbs().maxCoeff() / F::MaxCode * rel);
  }
  delta += gamma(double(dK + 2)) * tau * dotScale;
  Eigen::VectorXd bound(dV);
  for (Index c = 0; c < dV; ++c) {
    const auto col = v.col(c).segment(from, n);
    const double range = col.maxCoeff() - col.minCoeff(), largest = col.cwiseAbs().maxCoeff() + vStep(c) / 2;
    const double weightRounding = 32 * (0.5 + 2 * 65535.0 * u) / 65535.0 * largest;
    bound(c) =
        std::expm1(2 * delta) * range / 2 + vStep(c) / 2 + (2 * gamma(double(n)) + 4 * u) * largest + weightRounding;
  }
  return bound;
}

}  // namespace sdpa_test

#endif  // SDPA_TESTS_SUPPORT_QUANT_BOUND_HPP
