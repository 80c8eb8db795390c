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

TEMPLATE_TEST_CASE("nested combinations act in stage order at any depth, forward and backward", "[mask][combine]",
                   float, double) {
  // Issue #15's defect: a combination inside another ran as one hiding stage, so in
  // combine(Causal, combine(Softcap{5})) the softcap ran after hiding and turned -inf into -5
  // (keys above the diagonal got weight). `combine` now flattens, and a nesting built by hand
  // still runs its parts stage by stage.
  using T = TestType;
  using mask::Align;
  using mask::Causal;
  using mask::Combined;
  using mask::Softcap;
  static_assert(std::is_same_v<decltype(mask::combine(Causal{Align::UpperLeft}, mask::combine(Softcap{5.0}))),
                               Combined<Causal, Softcap>>,
                "combine flattens a combination among its arguments");
  static_assert(std::is_same_v<decltype(mask::combine(mask::combine(mask::KeyLength{1}, mask::combine(Softcap{5.0})),
                                                      Causal{Align::UpperLeft})),
                               Combined<mask::KeyLength, Softcap, Causal>>,
                "combine flattens at any depth");

  const Index L = 9, S = 12, dK = 8, dV = 5;
  const Mat<T> q = randn<T>(L, dK, 71, 3.0), k = randn<T>(S, dK, 72), v = randn<T>(S, dV, 73), dO = randn<T>(L, dV, 74);
  const Mat<T> bias = randn<T>(L, S, 75);
  const long double tau = 1.0L / std::sqrt((long double)dK);
  const sdpa::scale::InvSqrtDk scale;
  const auto causalUL = [](Index i, Index j) { return j <= i; };
  const auto biasFn = [&](Index i, Index j) {
    return (long double)bias(i, j) - 0.25L * std::abs((long double)(i - j));
  };
  const mask::Alibi alibi{{0.25}, Align::UpperLeft};
  // The flat reference combination, and the same parts nested in every way that matters: the
  // softcap inside a combination listed after the hiding, at depth 2 and 3, built by combine
  // and by hand (the latter is not flattened), with bias and ALiBi at other depths.
  const auto flatBiasFirst = mask::combine(Softcap{5.0}, Causal{Align::UpperLeft}, mask::Bias{bias}, alibi);
  const auto viaCombine =
      mask::combine(Causal{Align::UpperLeft}, mask::combine(mask::Bias{bias}, mask::combine(Softcap{5.0})), alibi);
  using Inner = Combined<mask::Bias<Mat<T>>, Combined<Softcap, mask::Alibi>>;
  const Combined<Causal, Inner> byHand(Causal{Align::UpperLeft},
                                       Inner(mask::Bias{bias}, Combined<Softcap, mask::Alibi>(Softcap{5.0}, alibi)));
  const Combined<Combined<mask::Alibi, Combined<Causal>>, Combined<mask::Bias<Mat<T>>, Softcap>> byHandOtherOrder(
      Combined<mask::Alibi, Combined<Causal>>(alibi, Combined<Causal>(Causal{Align::UpperLeft})),
      Combined<mask::Bias<Mat<T>>, Softcap>(mask::Bias{bias}, Softcap{5.0}));

  // Additive terms add in listing order (floating-point addition is not associative), so each
  // nesting is compared with the flat combination of its parts in its listing order.
  const auto flatAlibiFirst = mask::combine(alibi, Causal{Align::UpperLeft}, mask::Bias{bias}, Softcap{5.0});
  const auto checkOne = [&](const auto& m, const auto& flat, const char* name) {
    INFO("mask " << name);
    forEachKernel([&](const auto& kern, const char* kernelName) {
      INFO("kernel " << kernelName);
      checkForwardWith<T>(kern, q, k, v, scale, m, tau, causalUL, biasFn, 5.0L);
      // The nesting computes what the flat combination does: the forward bit for bit (the same
      // operations in the same order, for any thread count), the backward to rounding (its
      // threads sum dk, dv and dtau in the order they take work units). The flat one's gradients
      // are checked against finite differences in test_backward.cpp.
      const auto fwd = sdpa::attentionForward(kern, q, k, v, scale, m);
      const auto fwdFlat = sdpa::attentionForward(kern, q, k, v, scale, flat);
      CHECK(fwd.output == fwdFlat.output);
      CHECK(fwd.logSumExp == fwdFlat.logSumExp);
      const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dO, scale, m);
      const auto gFlat = sdpa::attentionBackward(kern, q, k, v, fwdFlat, dO, scale, flat);
      const auto close = [](const auto& a, const auto& b) {
        return maxAbsDiff(a, b) <= 16 * std::numeric_limits<T>::epsilon() * std::max(1.0, maxAbs(b));
      };
      CHECK(g.dq == gFlat.dq);  // each dq row is owned by one work unit
      CHECK(close(g.dk, gFlat.dk));
      CHECK(close(g.dv, gFlat.dv));
      CHECK(std::abs(g.dscale - gFlat.dscale) <=
            16 * std::numeric_limits<T>::epsilon() * std::max(T(1), std::abs(gFlat.dscale)));
      CHECK(g.dbias == gFlat.dbias);
      // Hidden keys (above the diagonal) have no gradient.
      for (Index i = 0; i < L; ++i)
        for (Index j = i + 1; j < S; ++j) CHECK(g.dbias(i, j) == T(0));
    });
  };
  checkOne(viaCombine, flatBiasFirst, "combine(Causal, combine(Bias, combine(Softcap)), Alibi)");
  checkOne(byHand, flatBiasFirst, "Combined<Causal, Combined<Bias, Combined<Softcap, Alibi>>> by hand");
  checkOne(byHandOtherOrder, flatAlibiFirst,
           "Combined<Combined<Alibi, Combined<Causal>>, Combined<Bias, Softcap>> by hand");

  // The defect's own example, as the issue measured it: 3 keys, causal above a softcap of 5.
  const Mat<T> q3 = randn<T>(3, 4, 76), k3 = randn<T>(3, 4, 77), v3 = Mat<T>::Identity(3, 3);
  forEachKernel([&](const auto& kern, const char*) {
    const auto out = sdpa::attentionForward(kern, q3, k3, v3, scale,
                                            mask::combine(Causal{Align::UpperLeft}, mask::combine(Softcap{5.0})))
                         .output;
    CHECK(out(0, 1) == T(0));
    CHECK(out(0, 2) == T(0));
    CHECK(out(1, 2) == T(0));
  });
}

TEMPLATE_TEST_CASE("a nested combination in a padded batch aligns to each item's lengths", "[mask][combine][batch]",
                   float, double) {
  // AlignedToLengths wraps the caller's mask: its stages must still run in order inside it.
  using T = TestType;
  const Index dK = 6, dV = 4;
  const Mat<T> q = randn<T>(10, dK, 81, 3.0), k = randn<T>(14, dK, 82), v = randn<T>(14, dV, 83);
  const auto layout = sdpa::BatchLayout::padded(2, 5, 7, {4, 5}, {6, 7});
  const auto nested = mask::combine(mask::Causal{Align::LowerRight}, mask::combine(mask::Softcap{4.0}));
  const auto flat = mask::combine(mask::Softcap{4.0}, mask::Causal{Align::LowerRight});
  const auto a = sdpa::batchedAttentionForward(q, k, v, layout, sdpa::Heads{1, 1}, sdpa::scale::InvSqrtDk{}, nested);
  const auto b = sdpa::batchedAttentionForward(q, k, v, layout, sdpa::Heads{1, 1}, sdpa::scale::InvSqrtDk{}, flat);
  CHECK(a.output == b.output);
  // Against one call per item on its valid rows.
  for (Index item = 0; item < 2; ++item) {
    const Index lq = item == 0 ? 4 : 5, lk = item == 0 ? 6 : 7;
    const Mat<T> qi = q.middleRows(item * 5, lq), ki = k.middleRows(item * 7, lk), vi = v.middleRows(item * 7, lk);
    const auto one = sdpa::attentionForward(qi, ki, vi, sdpa::scale::InvSqrtDk{}, flat);
    CHECK(maxAbsDiff(a.output.middleRows(item * 5, lq), one.output) <= 8 * std::numeric_limits<T>::epsilon());
  }
}
