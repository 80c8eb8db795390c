#ifndef SDPA_INTERNAL_MATH_HPP
#define SDPA_INTERNAL_MATH_HPP

#include <cmath>
#include <type_traits>

#include "macros.hpp"

namespace sdpa::internal {

/**
 * tanh of W floats in one packet, to about 1 ulp (measured over every float in [-20, 20] by
 * tests/test_softmax.cpp: at most 1.5 ulp). Eigen's fast float tanh, a rational approximation,
 * is off by up to 4 ulp, enough to make a softcap's logits (c tanh(s / c), c around 30-50) the
 * largest error of a float forward pass. Two regimes:
 * - |x| >= 0.625: 1 - 2 / (exp(2|x|) + 1); 2 / (...) <= 0.45, so exp's rounding enters the
 *   result at half its weight and nothing cancels;
 * - |x| <  0.625: x + x^3 P(x^2), P of degree 5 fitted to tanh's relative error (1.7e-10 on the
 *   interval, below float's 6e-8).
 * NaN stays NaN, +-inf gives +-1.
 */
// GCC 12 reports -Wuninitialized inside its own AVX-512 intrinsics (_mm512_undefined_ps) once
// Eigen's pexp is inlined here: a false positive of the header, not of this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
template <typename Packet>
Packet ptanhAccurate(const Packet& x) {
  namespace ei = Eigen::internal;
  using S = typename ei::unpacket_traits<Packet>::type;
  const Packet a = ei::pabs(x);
  const Packet one = ei::pset1<Packet>(S(1)), two = ei::pset1<Packet>(S(2));
  // Large |x|: exp(2a) overflows to inf from a = 44.4 on, and 2 / inf = 0 gives exactly 1.
  const Packet big = ei::psub(one, ei::pdiv(two, ei::padd(ei::pexp(ei::padd(a, a)), one)));
  // Small |x|: coefficients of P(u), u = x^2, lowest first.
  const Packet u = ei::pmul(a, a);
  Packet p = ei::pset1<Packet>(S(0.00213822629));
  p = ei::pmadd(p, u, ei::pset1<Packet>(S(-0.00817178842)));
  p = ei::pmadd(p, u, ei::pset1<Packet>(S(0.0216982104)));
  p = ei::pmadd(p, u, ei::pset1<Packet>(S(-0.0539462529)));
  p = ei::pmadd(p, u, ei::pset1<Packet>(S(0.133332014)));
  p = ei::pmadd(p, u, ei::pset1<Packet>(S(-0.333333313)));
  const Packet small = ei::pmadd(ei::pmul(a, u), p, a);
  const Packet r = ei::pselect(ei::pcmp_lt(a, ei::pset1<Packet>(S(0.625))), small, big);
  // The sign of x back on: tanh is odd. (A NaN compares false and keeps r = NaN.)
  return ei::pselect(ei::pcmp_lt(x, ei::pset1<Packet>(S(0))), ei::pnegate(r), r);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/**
 * x[i] = out tanh(x[i] / c) for n contiguous values (a softcap is out = c): float by
 * ptanhAccurate (the last partial packet through a padded copy, so that every position gets
 * bitwise the same function), double by std::tanh (within an ulp already).
 */
template <typename S>
void tanhInPlace(S* x, Index n, S c, S out) {
  if constexpr (std::is_same_v<S, float>) {
    namespace ei = Eigen::internal;
    using Packet = typename ei::packet_traits<S>::type;
    constexpr Index W = ei::packet_traits<S>::size;
    const Packet pc = ei::pset1<Packet>(c), po = ei::pset1<Packet>(out);
    Index i = 0;
    for (; i + W <= n; i += W) ei::pstoreu(x + i, ei::pmul(po, ptanhAccurate(ei::pdiv(ei::ploadu<Packet>(x + i), pc))));
    if (i < n) {
      S lanes[W] = {};
      for (Index j = i; j < n; ++j) lanes[j - i] = x[j];
      ei::pstoreu(lanes, ei::pmul(po, ptanhAccurate(ei::pdiv(ei::ploadu<Packet>(lanes), pc))));
      for (Index j = i; j < n; ++j) x[j] = lanes[j - i];
    }
  } else {
    for (Index i = 0; i < n; ++i) x[i] = out * std::tanh(x[i] / c);
  }
}

/// x = c tanh(x / c): the softcap of n contiguous logits.
template <typename S>
void softcapInPlace(S* x, Index n, S c) {
  tanhInPlace(x, n, c, c);
}

/// tanh(x) of one value by the same function as softcapInPlace (bitwise), for tests and the
/// scalar paths.
template <typename S>
S tanhAccurate(S x) {
  if constexpr (std::is_same_v<S, float>) {
    namespace ei = Eigen::internal;
    using Packet = typename ei::packet_traits<S>::type;
    constexpr Index W = ei::packet_traits<S>::size;
    S lanes[W] = {};
    lanes[0] = x;
    ei::pstoreu(lanes, ptanhAccurate(ei::ploadu<Packet>(lanes)));
    return lanes[0];
  } else {
    return std::tanh(x);
  }
}

/**
 * sum_j w_j (g_j - c) over the j with w_j != 0, for n contiguous w and g: g may be inf or NaN
 * where w is 0 (a hidden key's logit), and such terms are left out, not multiplied by 0. One pass
 * with Eigen's packets: a compare mask ANDed with the term zeroes it, whatever its value.
 */
template <typename S>
S centredDotSkippingZeros(const S* w, const S* g, Index n, S c) {
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<S>::type;
  constexpr Index W = ei::packet_traits<S>::size;
  const Packet pc = ei::pset1<Packet>(c), zero = ei::pset1<Packet>(S(0));
  Packet total = zero;
  Index j = 0;
  for (; j + W <= n; j += W) {
    const Packet pw = ei::ploadu<Packet>(w + j);
    const Packet term = ei::pmul(pw, ei::psub(ei::ploadu<Packet>(g + j), pc));
    total = ei::padd(total, ei::pandnot(term, ei::pcmp_eq(pw, zero)));
  }
  S sum = ei::predux(total);
  for (; j < n; ++j)
    if (w[j] != S(0)) sum += w[j] * (g[j] - c);
  return sum;
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_MATH_HPP
