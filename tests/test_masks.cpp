// Every mask and combination against the long-double oracle, with the PyTorch / FlashAttention /
// JAX / ALiBi / Gemma definitions written out here as plain predicates; tile classification;
// values at hidden positions; the published ALiBi slopes.
#include <sdpa/sdpa.hpp>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "support/cases.hpp"

using namespace sdpa_test;
namespace mask = sdpa::mask;
using Catch::Matchers::Contains;
using mask::Align;

namespace {

/// n_q < n_k, n_q > n_k, n_q = n_k; sizes that are not powers of two.
std::vector<Shape> maskShapes() { return {{5, 13, 8, 3}, {13, 5, 8, 3}, {11, 11, 6, 4}, {1, 7, 4, 2}, {7, 1, 4, 2}}; }

// The definitions, as their projects write them (L = n_q, S = n_k).
bool upperLeft(Index i, Index j) { return j <= i; }                             // tril(ones(L, S), 0)
bool lowerRight(Index i, Index j, Index L, Index S) { return j <= i + S - L; }  // tril(ones(L, S), S - L)
/// FlashAttention window_size=(left, right), -1 = infinite, aligned bottom-right:
/// key j is visible iff i + S - L - left <= j <= i + S - L + right.
bool window(Index i, Index j, Index L, Index S, Index left, Index right, bool bottomRight) {
  const Index p = bottomRight ? i + S - L : i;
  return (left < 0 || j >= p - left) && (right < 0 || j <= p + right);
}

}  // namespace

TEMPLATE_TEST_CASE("every mask and combination matches the reference definitions", "[mask]", float, double) {
  using T = TestType;
  constexpr T inf = std::numeric_limits<T>::infinity();
  std::uint64_t seed = 500;
  forEachKernel([&](const auto& kern, const char* kernelName) {
    INFO("kernel " << kernelName);
    for (const Shape& sh : maskShapes()) {
      INFO("shape " << toString(sh));
      const Index L = sh.nQ, S = sh.nK;
      const Mat<T> q = randn<T>(L, sh.dK, ++seed, 2.0), k = randn<T>(S, sh.dK, ++seed), v = randn<T>(S, sh.dV, ++seed);
      Mat<T> bias = randn<T>(L, S, ++seed);
      bias(0, 0) = -inf;
      const long double tau = 1.0L / std::sqrt((long double)sh.dK);
      const sdpa::scale::InvSqrtDk scale;
      const auto biasFn = [&](Index i, Index j) { return bias(i, j) == -inf ? 0.0L : (long double)bias(i, j); };
      const auto biasVisible = [&](Index i, Index j) { return bias(i, j) != -inf; };

      for (const Index left : {Index(-1), Index(0), Index(2)})
        for (const Index right : {Index(-1), Index(0), Index(1)}) {
          INFO("window (" << left << ", " << right << ")");
          checkForwardWith<T>(
              kern, q, k, v, scale, mask::SlidingWindow{left, right, Align::LowerRight}, tau,
              [=](Index i, Index j) { return window(i, j, L, S, left, right, true); }, noBias());
          checkForwardWith<T>(
              kern, q, k, v, scale, mask::SlidingWindow{left, right, Align::UpperLeft}, tau,
              [=](Index i, Index j) { return window(i, j, L, S, left, right, false); }, noBias());
        }
      for (Index len = 0; len <= S; len += std::max<Index>(1, S / 3)) {
        INFO("KeyLength " << len);
        checkForwardWith<T>(
            kern, q, k, v, scale, mask::KeyLength{len}, tau, [=](Index, Index j) { return j < len; }, noBias());
      }
      for (Index len = 0; len <= L; len += std::max<Index>(1, L / 3)) {
        INFO("QueryLength " << len);
        checkForwardWith<T>(
            kern, q, k, v, scale, mask::QueryLength{len}, tau, [=](Index i, Index) { return i < len; }, noBias());
      }
      {
        INFO("Alibi, one head of slope 0.25, bottom-right: -m |i + S - L - j|");
        checkForwardWith<T>(kern, q, k, v, scale, mask::Alibi{{0.25}, Align::LowerRight}, tau, allVisible(),
                            [=](Index i, Index j) { return -0.25L * std::abs((long double)(i + S - L - j)); });
      }
      {
        INFO("Softcap 2.5: 2.5 tanh(s / 2.5) before the mask");
        checkForwardWith<T>(kern, q, k, v, scale, mask::Softcap{2.5}, tau, allVisible(), noBias(), 2.5L);
      }
      {
        INFO("causal (bottom-right) + window (3, 0) + key length + bias");
        const Index len = std::max<Index>(1, S - 2);
        checkForwardWith<T>(
            kern, q, k, v, scale,
            mask::combine(mask::Causal{Align::LowerRight}, mask::SlidingWindow{3, 0, Align::LowerRight},
                          mask::KeyLength{len}, mask::Bias{bias}),
            tau,
            [&, len](Index i, Index j) {
              return lowerRight(i, j, L, S) && window(i, j, L, S, 3, 0, true) && j < len && biasVisible(i, j);
            },
            biasFn);
      }
      {
        INFO("bias listed before softcap: the softcap still applies first");
        checkForwardWith<T>(
            kern, q, k, v, scale, mask::combine(mask::Bias{bias}, mask::Softcap{1.5}, mask::Causal{Align::UpperLeft}),
            tau, [&](Index i, Index j) { return upperLeft(i, j) && biasVisible(i, j); }, biasFn, 1.5L);
      }
      {
        INFO("causal (top-left) + ALiBi (top-left)");
        checkForwardWith<T>(kern, q, k, v, scale,
                            mask::combine(mask::Causal{Align::UpperLeft}, mask::Alibi{{0.5}, Align::UpperLeft}), tau,
                            upperLeft, [](Index i, Index j) { return -0.5L * std::abs((long double)(i - j)); });
      }
    }
  });
}

TEMPLATE_TEST_CASE("NaN and inf at hidden positions of k, v and the bias leave the output unchanged", "[mask]", float,
                   double) {
  using T = TestType;
  constexpr T nan = std::numeric_limits<T>::quiet_NaN(), inf = std::numeric_limits<T>::infinity();
  const Index L = 6, S = 10;
  const Mat<T> q = randn<T>(L, 8, 1), k = randn<T>(S, 8, 2), v = randn<T>(S, 5, 3);
  Mat<T> bias = randn<T>(L, S, 4);
  // Keys 8 and 9 are padding, hidden from every query; the causal mask hides (i, j) for j > i + 4.
  const auto m = [&](const Mat<T>& b) {
    return mask::combine(mask::Causal{Align::LowerRight}, mask::KeyLength{8}, mask::Bias{b});
  };
  const auto clean = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, m(bias));
  Mat<T> kBad = k, vBad = v, biasBad = bias;
  kBad.row(8).setConstant(nan);
  kBad(9, 0) = inf;
  vBad.row(9).setConstant(-inf);
  vBad(8, 2) = nan;
  biasBad.col(9).setConstant(nan);
  biasBad(0, 6) = nan;  // hidden from query 0 by the causal mask (6 > 0 + 4)
  biasBad(1, 7) = inf;  // hidden from query 1 (7 > 1 + 4)
  const auto dirty = sdpa::attentionForward(q, kBad, vBad, sdpa::scale::InvSqrtDk{}, m(biasBad));
  CHECK(dirty.output.allFinite());
  CHECK(maxAbsDiff(dirty.output, clean.output) <= 4 * std::numeric_limits<T>::epsilon());
  CHECK(dirty.logSumExp == clean.logSumExp);
  // The same with a Keep mask hiding a NaN bias entry.
  Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic> keep =
      Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic>::Constant(L, S, true);
  keep(2, 3) = false;
  Mat<T> bias2 = bias;
  bias2(2, 3) = nan;
  const auto a =
      sdpa::attentionForward(q, k, v, sdpa::scale::None{}, mask::combine(mask::Keep{keep}, mask::Bias{bias}));
  const auto b =
      sdpa::attentionForward(q, k, v, sdpa::scale::None{}, mask::combine(mask::Bias{bias2}, mask::Keep{keep}));
  CHECK(a.output == b.output);
}

TEST_CASE("tile classification agrees with the masks' definitions", "[mask][tiles]") {
  const Mat<double> bias = Mat<double>::Zero(9, 12);
  const auto check = [](const auto& m, Index L, Index S, const char* name) {
    INFO(name << " " << L << "x" << S);
    for (Index r0 = 0; r0 < L; ++r0)
      for (Index rows = 1; r0 + rows <= L; rows += 2)
        for (Index c0 = 0; c0 < S; ++c0)
          for (Index cols = 1; c0 + cols <= S; cols += 3) {
            const mask::Tile t = m.classify(r0, rows, c0, cols, L, S, 0);
            bool any = false, all = true;
            for (Index i = r0; i < r0 + rows; ++i)
              for (Index j = c0; j < c0 + cols; ++j) {
                any = any || m.visible(i, j, L, S, 0);
                all = all && m.visible(i, j, L, S, 0);
              }
            INFO("tile rows [" << r0 << ", " << r0 + rows << ") cols [" << c0 << ", " << c0 + cols << ")");
            if (t == mask::Tile::Hidden) CHECK_FALSE(any);
            if (t == mask::Tile::Visible) CHECK(all);
            // Exact for structural masks: a tile is Partial only if it really is mixed.
            if (t == mask::Tile::Partial && !std::decay_t<decltype(m)>::HasBias) CHECK((any && !all));
          }
  };
  for (const auto& [L, S] : {std::pair<Index, Index>{9, 12}, {12, 9}, {10, 10}}) {
    check(mask::Causal{Align::UpperLeft}, L, S, "causal UL");
    check(mask::Causal{Align::LowerRight}, L, S, "causal LR");
    check(mask::SlidingWindow{2, 1, Align::LowerRight}, L, S, "window (2,1) LR");
    check(mask::SlidingWindow{-1, 0, Align::UpperLeft}, L, S, "window (-1,0) UL");
    check(mask::SlidingWindow{3, -1, Align::UpperLeft}, L, S, "window (3,-1) UL");
    check(mask::KeyLength{S / 2}, L, S, "key length");
    check(mask::QueryLength{L / 3}, L, S, "query length");
    check(mask::combine(mask::Causal{Align::LowerRight}, mask::KeyLength{S - 3}), L, S, "combined");
  }
  CHECK(mask::combine(mask::Causal{Align::UpperLeft}, mask::Bias{bias}).classify(0, 3, 8, 3, 9, 12, 0) ==
        mask::Tile::Hidden);
  CHECK(mask::combine(mask::Causal{Align::UpperLeft}, mask::Bias{bias}).classify(5, 3, 0, 3, 9, 12, 0) ==
        mask::Tile::Partial);  // visible to causal, but the bias must still be added
}

TEST_CASE("ALiBi slopes for 8 and 12 heads equal the published values", "[mask][alibi]") {
  // Press et al., get_slopes(8) = [1/2, 1/4, ..., 1/256]; get_slopes(12) = get_slopes(8) followed
  // by get_slopes(16)[0::2][:4] = 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
  const std::vector<double> h8 = mask::alibiSlopes(8);
  const std::vector<double> expected8 = {0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625};
  CHECK(h8 == expected8);
  const std::vector<double> h12 = mask::alibiSlopes(12);
  const std::vector<double> expected12 = {0.5,
                                          0.25,
                                          0.125,
                                          0.0625,
                                          0.03125,
                                          0.015625,
                                          0.0078125,
                                          0.00390625,
                                          0.7071067811865476,
                                          0.35355339059327373,
                                          0.17677669529663687,
                                          0.08838834764831843};
  REQUIRE(h12.size() == 12);
  for (size_t i = 0; i < 12; ++i) CHECK(std::abs(h12[i] - expected12[i]) <= 1e-16);
  CHECK(mask::alibiSlopes(1) == std::vector<double>{1.0 / 256});
  CHECK(mask::alibiSlopes(0).empty());
  CHECK(mask::Alibi::standard(12, Align::UpperLeft).slopes == h12);
}

TEST_CASE("softcap bounds every logit to (-c, c)", "[mask][softcap]") {
  const Mat<double> q = randn<double>(5, 64, 1, 3.0), k = randn<double>(7, 64, 2, 3.0);
  const Mat<double> s = sdpa::attentionLogits(q, k, sdpa::scale::None{}, mask::Softcap{30.0});
  CHECK(s.cwiseAbs().maxCoeff() < 30.0);
  const Mat<double> raw = q * k.transpose();
  CHECK(raw.cwiseAbs().maxCoeff() > 30.0);  // the cap was needed
  CHECK(maxAbsDiff(s, (30.0 * (raw.array() / 30.0).tanh()).matrix()) <= 1e-13);
}

TEST_CASE("mask arguments are validated with clear messages", "[mask][errors]") {
  const Mat<float> q = Mat<float>::Ones(3, 4), k = Mat<float>::Ones(5, 4), v = Mat<float>::Ones(5, 2);
  CHECK_THROWS_WITH(sdpa::attention(q, k, v, sdpa::scale::None{}, mask::KeyLength{6}),
                    Contains("KeyLength{6} is outside [0, n_k = 5]"));
  CHECK_THROWS_WITH(sdpa::attention(q, k, v, sdpa::scale::None{}, mask::QueryLength{-1}),
                    Contains("QueryLength{-1} is outside [0, n_q = 3]"));
  CHECK_THROWS_WITH(sdpa::attention(q, k, v, sdpa::scale::None{}, mask::Softcap{0.0}),
                    Contains("the cap must be finite and > 0"));
  CHECK_THROWS_WITH(sdpa::attention(q, k, v, sdpa::scale::None{}, mask::Alibi::standard(2, Align::UpperLeft)),
                    Contains("Alibi has 2 slopes for 1 heads"));
  const Mat<float> bias = Mat<float>::Zero(3, 4);
  CHECK_THROWS_WITH(
      sdpa::attention(q, k, v, sdpa::scale::None{}, mask::combine(mask::Causal{Align::UpperLeft}, mask::Bias{bias})),
      Contains("the Bias is 3x4 but the logits are 3x5"));
}
