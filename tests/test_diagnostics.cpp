// Diagnostics of the scale: every statistic against a direct computation on the materialised P
// in long double; the streaming sink against the materialised path; known cases (uniform,
// one-hot, the seed's d_k = 64 unscaled case, identical heads); temperature calibration.
#include <sdpa/sdpa.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "support/cases.hpp"

using namespace sdpa_test;
namespace mask = sdpa::mask;
namespace scale = sdpa::scale;
using Catch::Matchers::Contains;
using mask::Align;

namespace {

bool anyContains(const std::vector<std::string>& lines, const std::string& s) {
  return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(s) != std::string::npos; });
}

}  // namespace

TEST_CASE("each statistic equals a direct computation on the materialised P", "[diagnostics]") {
  const Index L = 40, S = 50, d = 16;
  const Mat<double> q = randn<double>(L, d, 1, 1.5), k = randn<double>(S, d, 2, 2.0);
  Mat<double> bias = randn<double>(L, S, 3);
  const double tau = 0.7;
  const auto m = mask::combine(mask::Causal{Align::LowerRight}, mask::Bias{bias});
  const sdpa::HeadDiagnostics h = sdpa::diagnose(q, k, scale::Constant{tau}, m).heads.at(0);

  // Direct: visible iff j <= i + S - L; s = tau q.k + b; p = exp(s - max) / sum.
  long double sum = 0, sumSq = 0, rawSum = 0, rawSumSq = 0, mn = INFINITY, mx = -INFINITY;
  Index visible = 0, over16 = 0;
  std::vector<double> pMax, entropy, jac, frac;
  for (Index i = 0; i < L; ++i) {
    std::vector<long double> s, raw;
    for (Index j = 0; j <= std::min(S - 1, i + S - L); ++j) {
      const long double r = (long double)q.row(i).dot(k.row(j));
      raw.push_back(r);
      s.push_back(tau * r + bias(i, j));
    }
    for (size_t j = 0; j < s.size(); ++j) {
      sum += s[j], sumSq += s[j] * s[j], rawSum += raw[j], rawSumSq += raw[j] * raw[j];
      mn = std::min(mn, s[j]), mx = std::max(mx, s[j]);
      over16 += s[j] > std::log(65504.0L) ? 1 : 0;
    }
    visible += Index(s.size());
    if (s.size() < 2) continue;
    const long double m0 = *std::max_element(s.begin(), s.end());
    long double z = 0;
    for (const long double x : s) z += std::exp(x - m0);
    long double h0 = 0, jj = 0;
    std::vector<long double> p;
    for (const long double x : s) p.push_back(std::exp(x - m0) / z);
    for (size_t a = 0; a < p.size(); ++a) {
      if (p[a] > 0) h0 -= p[a] * std::log(p[a]);
      for (size_t b = 0; b < p.size(); ++b) {  // ||diag(p) - p p^T||_F^2 entry by entry
        const long double e = (a == b ? p[a] : 0.0L) - p[a] * p[b];
        jj += e * e;
      }
    }
    pMax.push_back(double(1 / z));
    entropy.push_back(double(h0));
    jac.push_back(double(std::sqrt(jj)));
    frac.push_back(double(h0 / std::log((long double)s.size())));
  }
  const auto mean = [](const std::vector<double>& x) {
    double t = 0;
    for (const double v : x) t += v;
    return t / double(x.size());
  };
  const double n = double(visible);
  CHECK(h.visibleLogits == visible);
  CHECK(h.singleKeyRows == 0);  // LowerRight with S - L = 10: query 0 already sees 11 keys
  CHECK(std::abs(h.logitMean - double(sum / n)) <= 1e-12);
  CHECK(std::abs(h.logitStd - std::sqrt(double(sumSq / n - (sum / n) * (sum / n)))) <= 1e-10);
  CHECK(h.logitMin == Approx(double(mn)).epsilon(1e-14));
  CHECK(h.logitMax == Approx(double(mx)).epsilon(1e-14));
  CHECK(h.rawStd == Approx(std::sqrt(double(rawSumSq / n - (rawSum / n) * (rawSum / n)))).epsilon(1e-10));
  CHECK(h.invSqrtDkStd == Approx(h.rawStd / 4).epsilon(1e-14));
  CHECK(h.overflowFp16 == over16);
  CHECK(h.maxWeight.mean == Approx(mean(pMax)).epsilon(1e-12));
  CHECK(h.entropy.mean == Approx(mean(entropy)).epsilon(1e-10));
  CHECK(h.jacobianNorm.mean == Approx(mean(jac)).epsilon(1e-12));
  CHECK(h.entropyFraction.mean == Approx(mean(frac)).epsilon(1e-10));
  std::sort(entropy.begin(), entropy.end());
  // lse - sum p s: absolute error a few ulps of the largest logit (|s| < 40 here).
  CHECK(std::abs(h.entropy.min - entropy.front()) <= 1e-13);
  CHECK(std::abs(h.entropy.max - entropy.back()) <= 1e-13);
  // The usual median: the middle value, or the mean of the two middle values of an even count.
  const size_t mid = entropy.size() / 2;
  const double medianEntropy = entropy.size() % 2 ? entropy[mid] : 0.5 * (entropy[mid - 1] + entropy[mid]);
  CHECK(std::abs(h.entropy.median - medianEntropy) <= 1e-13);
  std::sort(jac.begin(), jac.end());
  CHECK(h.jacobianNorm.min == Approx(jac.front()).epsilon(1e-12));  // relative, even for the smallest
  // Variance check: d_k Var(q) Var(k) from the entries of q and k.
  const double vq = (q.array() - q.mean()).square().mean(), vk = (k.array() - k.mean()).square().mean();
  CHECK(h.variancePredicted == Approx(16 * vq * vk).epsilon(1e-12));
}

TEST_CASE("the streaming sink gives the same figures as the materialised path", "[diagnostics][sink]") {
  const Index H = 3, dK = 8, L = 30, S = 30;
  const Mat<double> q = randn<double>(L, H * dK, 1), k = randn<double>(S, dK, 2), v = randn<double>(S, 4, 3);
  const auto m = mask::combine(mask::Causal{Align::UpperLeft}, mask::Softcap{6.0});
  sdpa::DiagnosticsSink sink;
  const auto fwd =
      sdpa::multiHeadAttentionForward(sdpa::kernel::Naive{}, q, k, v, sdpa::Heads{H, 1}, scale::None{}, m, {}, &sink);
  CHECK(fwd.output == sdpa::multiHeadAttention(sdpa::kernel::Naive{}, q, k, v, sdpa::Heads{H, 1}, scale::None{},
                                               m));  // sink is passive
  const sdpa::Diagnostics streamed = sdpa::diagnostics(sink);
  const sdpa::Diagnostics direct = sdpa::diagnose(q, k, sdpa::Heads{H, 1}, scale::None{}, m);
  REQUIRE(streamed.heads.size() == size_t(H));
  for (Index h = 0; h < H; ++h) {
    const auto& a = streamed.heads[size_t(h)];
    const auto& b = direct.heads[size_t(h)];
    CHECK(a.logitMean == b.logitMean);
    CHECK(a.logitStd == b.logitStd);
    CHECK(a.rawStd == b.rawStd);
    CHECK(a.entropy.mean == b.entropy.mean);
    CHECK(a.maxWeight.median == b.maxWeight.median);
    CHECK(a.jacobianNorm.min == b.jacobianNorm.min);
    CHECK(a.saturatedFraction == b.saturatedFraction);
    CHECK(a.overflowFp16 == b.overflowFp16);
    CHECK(a.variancePredicted == b.variancePredicted);
    CHECK(a.singleKeyRows == 1);  // query 0 sees key 0 only
  }
  CHECK(streamed.verdicts == direct.verdicts);
  // Single head through attentionForward.
  sdpa::DiagnosticsSink one;
  sdpa::attentionForward(sdpa::kernel::Naive{}, q.leftCols(dK), k, v, scale::InvSqrtDk{}, mask::None{}, {}, &one);
  CHECK(sdpa::diagnostics(one).heads.at(0).entropy.mean == sdpa::diagnose(q.leftCols(dK), k).heads.at(0).entropy.mean);
}

namespace {

/// The tiled kernel's sink rows against the naive kernel's (which reads each row whole), row by
/// row: counts, argmax exactly (unless two logits are within rounding), the rest within `tol`
/// of the figure's scale. Both kernels compute their logits in T, in their own order.
void checkSameRows(const sdpa::DiagnosticsSink& tiled, const sdpa::DiagnosticsSink& naive, double tol) {
  REQUIRE(tiled.heads() == naive.heads());
  for (Index h = 0; h < naive.heads(); ++h) {
    REQUIRE(tiled.rows(h).size() == naive.rows(h).size());
    for (size_t i = 0; i < naive.rows(h).size(); ++i) {
      const auto& a = tiled.rows(h)[i];
      const auto& b = naive.rows(h)[i];
      INFO("head " << h << ", row " << i);
      REQUIRE(a.visible == b.visible);
      if (b.visible == 0) continue;
      const double top = 1 + std::abs(b.logitMax), spread = std::sqrt(double(b.visible) * b.logitSumSq) + 1;
      if (b.gap > tol * top) CHECK(a.argmax == b.argmax);
      CHECK(std::abs(a.logitMax - b.logitMax) <= tol * top);
      CHECK(std::abs(a.logitMin - b.logitMin) <= tol * (1 + std::abs(b.logitMin)));
      if (std::isinf(b.gap))
        CHECK(a.gap == b.gap);
      else
        CHECK(std::abs(a.gap - b.gap) <= 2 * tol * top);
      CHECK(std::abs(a.logitSum - b.logitSum) <= tol * spread);
      CHECK(std::abs(a.logitSumSq - b.logitSumSq) <= tol * (b.logitSumSq + 1));
      const double rawSpread = std::sqrt(double(b.visible) * b.rawSumSq) + 1;
      CHECK(std::abs(a.rawSum - b.rawSum) <= tol * rawSpread);
      CHECK(std::abs(a.rawSumSq - b.rawSumSq) <= tol * (b.rawSumSq + 1));
      CHECK(std::abs(a.overFp16 - b.overFp16) <= (tol > 1e-9 ? 1 : 0));
      CHECK(std::abs(a.overFp32 - b.overFp32) <= (tol > 1e-9 ? 1 : 0));
      CHECK(std::abs(a.lse - b.lse) <= tol * top);
      CHECK(std::abs(a.pMax - b.pMax) <= tol * top);
      CHECK(std::abs(a.entropy - b.entropy) <= tol * top);
      CHECK(std::abs(a.jacobianNorm - b.jacobianNorm) <= tol * top);
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("the tiled kernel streams a sink's rows: the naive kernel's figures, the same output",
                   "[diagnostics][sink]", float, double) {
  using T = TestType;
  const double tol = std::is_same_v<T, float> ? 2e-4 : 1e-10;
  const Index H = 4, G = 2, dK = 24, dV = 8;
  const auto run = [&](const auto& kern, Index nQ, Index nK, const auto& scale, const auto& m, double sd,
                       sdpa::DiagnosticsSink& sink) {
    const Mat<T> q = randn<double>(nQ, H * dK, 11, sd).cast<T>(), k = randn<double>(nK, G * dK, 12, sd).cast<T>(),
                 v = randn<double>(nK, G * dV, 13).cast<T>();
    return sdpa::multiHeadAttentionForward(kern, q, k, v, sdpa::Heads{H, G}, scale, m, {}, &sink).output;
  };
  const auto compare = [&](Index nQ, Index nK, const auto& scale, const auto& m, double sd) {
    sdpa::DiagnosticsSink naive;
    run(sdpa::kernel::Naive{}, nQ, nK, scale, m, sd, naive);
    forEachKernel([&](const auto& kern, const char* name) {
      if (std::is_same_v<std::decay_t<decltype(kern)>, sdpa::kernel::Naive>) return;
      INFO(name << ", " << nQ << " x " << nK);
      sdpa::DiagnosticsSink tiled;
      const Mat<T> out = run(kern, nQ, nK, scale, m, sd, tiled);
      checkSameRows(tiled, naive, tol);
      // The sink is passive: the same output as the same call without one, to the bit (but for
      // tau = 0, whose float prefill takes the general kernel with a sink).
      const Mat<T> q = randn<double>(nQ, H * dK, 11, sd).cast<T>(), k = randn<double>(nK, G * dK, 12, sd).cast<T>(),
                   v = randn<double>(nK, G * dV, 13).cast<T>();
      if (scale.template value<double>(dK) != 0 || std::is_same_v<T, double>)
        CHECK(out == sdpa::multiHeadAttention(kern, q, k, v, sdpa::Heads{H, G}, scale, m));
    });
  };
  for (const auto& [nQ, nK] : std::vector<std::pair<Index, Index>>{{37, 300}, {70, 45}, {3, 200}, {1, 1}}) {
    SECTION("no mask, " + std::to_string(nQ) + " x " + std::to_string(nK)) {
      compare(nQ, nK, scale::InvSqrtDk{}, mask::None{}, 1.0);
      compare(nQ, nK, scale::None{}, mask::None{}, 1.5);  // large logits: nearly one-hot rows, fp16 overflow counts
    }
    SECTION("causal and window, " + std::to_string(nQ) + " x " + std::to_string(nK)) {
      compare(nQ, nK, scale::InvSqrtDk{}, mask::Causal{Align::LowerRight}, 1.0);
      compare(nQ, nK, scale::InvSqrtDk{}, mask::Causal{Align::UpperLeft}, 1.0);  // fully masked rows when n_q > n_k
      compare(nQ, nK, scale::Constant{0.5}, mask::SlidingWindow{7, 3, Align::LowerRight}, 1.0);
    }
    SECTION("softcap and ALiBi (raw q.k apart from the logits), " + std::to_string(nQ) + " x " + std::to_string(nK)) {
      compare(nQ, nK, scale::None{}, mask::combine(mask::Causal{Align::LowerRight}, mask::Softcap{5.0}), 1.0);
      compare(nQ, nK, scale::InvSqrtDk{}, mask::Alibi{{0.5, 0.25, 0.125, 0.0625}, Align::LowerRight}, 1.0);
    }
    SECTION("tau = 0: every logit 0, the raw q.k from a product of its own") {
      compare(nQ, nK, scale::Constant{0.0}, mask::None{}, 1.0);
    }
  }
}

TEST_CASE("a sink's rows do not depend on the thread count", "[diagnostics][sink][threads]") {
  // One head of 600 query rows: one block of 600 on one thread, blocks of 256, 256 and 88 rows
  // on two. A row's figures come from its own keys in an order no block boundary changes (a lane
  // group's choice of how to follow the keys at the maximum gives the same bits either way): the
  // same figures to the bit, with a mask and without.
  const Index H = 1, dK = 32, nQ = 600, nK = 700;
  const Mat<float> q = randn<double>(nQ, H * dK, 31).cast<float>(), k = randn<double>(nK, H * dK, 32).cast<float>(),
                   v = randn<double>(nK, H * dK, 33).cast<float>();
  const auto run = [&](int threads, const auto& m) {
    sdpa::DiagnosticsSink sink;
#ifdef _OPENMP
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
    sdpa::multiHeadAttentionForward(q, k, v, sdpa::Heads{H}, scale::InvSqrtDk{}, m, {}, &sink);
#ifdef _OPENMP
    omp_set_num_threads(before);
#endif
    return sink;
  };
  const auto same = [&](const auto& m) {
    const sdpa::DiagnosticsSink one = run(1, m), two = run(2, m);
    for (Index h = 0; h < H; ++h)
      for (size_t i = 0; i < size_t(nQ); ++i) {
        const auto &a = one.rows(h)[i], &b = two.rows(h)[i];
        INFO("head " << h << ", row " << i);
        CHECK(a.visible == b.visible);
        CHECK(a.argmax == b.argmax);
        for (const auto f :
             {&sdpa::internal::RowStats::logitSum, &sdpa::internal::RowStats::logitSumSq,
              &sdpa::internal::RowStats::logitMin, &sdpa::internal::RowStats::logitMax,
              &sdpa::internal::RowStats::rawSum, &sdpa::internal::RowStats::rawSumSq, &sdpa::internal::RowStats::lse,
              &sdpa::internal::RowStats::pMax, &sdpa::internal::RowStats::entropy,
              &sdpa::internal::RowStats::jacobianNorm, &sdpa::internal::RowStats::gap})
          CHECK(a.*f == b.*f);
      }
  };
  same(mask::None{});
  same(mask::Causal{Align::LowerRight});
}

TEST_CASE("a sink on the tiled kernel: half inputs, a padded batch, and the folded diagnostics",
          "[diagnostics][sink]") {
  const Index H = 2, dK = 32, nQ = 40, nK = 90;
  const Mat<float> q = randn<double>(nQ, H * dK, 21).cast<float>(), k = randn<double>(nK, H * dK, 22).cast<float>(),
                   v = randn<double>(nK, H * dK, 23).cast<float>();
  SECTION("bfloat16 and half inputs: the figures of the logits the kernel computed (fp32 products)") {
    sdpa::DiagnosticsSink tiled, naive;
    const Mat<Eigen::bfloat16> qb = q.cast<Eigen::bfloat16>(), kb = k.cast<Eigen::bfloat16>(),
                               vb = v.cast<Eigen::bfloat16>();
    sdpa::multiHeadAttentionForward(qb, kb, vb, sdpa::Heads{H}, scale::InvSqrtDk{}, mask::None{}, {}, &tiled);
    sdpa::multiHeadAttentionForward(sdpa::kernel::Naive{}, qb, kb, vb, sdpa::Heads{H}, scale::InvSqrtDk{}, mask::None{},
                                    {}, &naive);
    checkSameRows(tiled, naive, 2e-4);
    const Mat<Eigen::half> qh = q.cast<Eigen::half>(), kh = k.cast<Eigen::half>(), vh = v.cast<Eigen::half>();
    sdpa::multiHeadAttentionForward(qh, kh, vh, sdpa::Heads{H}, scale::InvSqrtDk{}, mask::Causal{Align::LowerRight}, {},
                                    &tiled);
    sdpa::multiHeadAttentionForward(sdpa::kernel::Naive{}, qh, kh, vh, sdpa::Heads{H}, scale::InvSqrtDk{},
                                    mask::Causal{Align::LowerRight}, {}, &naive);
    checkSameRows(tiled, naive, 2e-4);
  }
  SECTION("a padded batch: each item's rows, its padding hidden") {
    const auto layout = sdpa::BatchLayout::padded(2, nQ / 2, nK / 2, {20, 13}, {45, 30});
    sdpa::DiagnosticsSink tiled, naive;
    const auto m = mask::Causal{Align::LowerRight};
    sdpa::batchedAttentionForward(q, k, v, layout, sdpa::Heads{H}, scale::InvSqrtDk{}, m, {}, &tiled);
    sdpa::batchedAttentionForward(sdpa::kernel::Naive{}, q, k, v, layout, sdpa::Heads{H}, scale::InvSqrtDk{}, m, {},
                                  &naive);
    checkSameRows(tiled, naive, 2e-4);
  }
  SECTION("ties at the maximum: the first key, a gap of 0, the Jacobian of two equal weights") {
    // Rows of q = 0 (every logit 0) and keys repeated (each logit twice): ties at every level.
    // Integer entries, so that every logit is exact whatever order its sum takes (the portable
    // path's Eigen products sum a key at one column of a tile and its repeat at another in
    // different orders) and the repeated keys' logits tie to the bit.
    Mat<float> qt = q.array().round().matrix();
    qt.topRows(5).setZero();
    // Keys kt (each repeated: the second half equals the first) in tiles of bk keys.
    const auto check = [&](const Mat<float>& kt, const Mat<float>& vt, Index bk) {
      const Index n = kt.rows();
      sdpa::DiagnosticsSink tiled, naive;
      sdpa::multiHeadAttentionForward(sdpa::kernel::Tiled{8, bk}, qt, kt, vt, sdpa::Heads{H}, scale::None{},
                                      mask::None{}, {}, &tiled);
      sdpa::multiHeadAttentionForward(sdpa::kernel::Naive{}, qt, kt, vt, sdpa::Heads{H}, scale::None{}, mask::None{},
                                      {}, &naive);
      checkSameRows(tiled, naive, 2e-4);
      for (Index h = 0; h < H; ++h)
        for (size_t i = 0; i < size_t(nQ); ++i) {
          const auto& r = tiled.rows(h)[i];
          CHECK(r.gap == 0);
          CHECK(r.argmax < n / 2);  // the first of the two equal keys
          if (i < 5) CHECK(r.argmax == 0);
        }
    };
    Mat<float> kt = k.array().round().matrix();
    kt.bottomRows(nK / 2) = kt.topRows(nK / 2);
    check(kt, v, 16);
    // One tile of 2100 keys: past the 2048 whose indices the fast kernel reads from a table and
    // whose ties at the maximum it counts from its sums, so it counts them key by key there.
    const Index nLong = 2100;
    Mat<float> kl = randn<double>(nLong, H * dK, 24).array().round().cast<float>().matrix();
    kl.bottomRows(nLong / 2) = kl.topRows(nLong / 2);
    check(kl, randn<double>(nLong, H * dK, 25).cast<float>(), 2304);
  }
  SECTION("the folded Diagnostics agree") {
    sdpa::DiagnosticsSink tiled, naive;
    sdpa::multiHeadAttentionForward(q, k, v, sdpa::Heads{H}, scale::None{}, mask::None{}, {}, &tiled);
    sdpa::multiHeadAttentionForward(sdpa::kernel::Naive{}, q, k, v, sdpa::Heads{H}, scale::None{}, mask::None{}, {},
                                    &naive);
    const sdpa::Diagnostics a = sdpa::diagnostics(tiled), b = sdpa::diagnostics(naive);
    REQUIRE(a.heads.size() == b.heads.size());
    for (size_t h = 0; h < a.heads.size(); ++h) {
      CHECK(a.heads[h].entropy.mean == Approx(b.heads[h].entropy.mean).epsilon(1e-4));
      CHECK(a.heads[h].maxWeight.median == Approx(b.heads[h].maxWeight.median).epsilon(1e-4));
      CHECK(a.heads[h].jacobianNorm.mean == Approx(b.heads[h].jacobianNorm.mean).epsilon(1e-4));
      CHECK(a.heads[h].logitStd == Approx(b.heads[h].logitStd).epsilon(1e-4));
      CHECK(a.heads[h].saturatedFraction == b.heads[h].saturatedFraction);
    }
    CHECK(a.verdicts == b.verdicts);
  }
}

TEMPLATE_TEST_CASE(
    "a sink's centred variance ratio: from the rows' raw sums where every row sees every key, "
    "else from the Gram matrices  [seed C3]",
    "[diagnostics][sink]", float, double) {
  using T = TestType;
  const Index H = 4, G = 2, dK = 24, nQ = 70, nK = 300;
  const double u = std::numeric_limits<T>::epsilon() / 2;
  // Means of 0.4 in q and 0.3 in k: the streamed form's terms of the means matter (a tenth of
  // sum r^2) and it is taken (sum r^2 under kStreamedLoss x <Gq, Gk>).
  const Mat<double> qd = (randn<double>(nQ, H * dK, 31).array() + 0.4).matrix();
  const Mat<double> kd = (randn<double>(nK, G * dK, 32).array() + 0.3).matrix(), vd = randn<double>(nK, G * 8, 33);
  const Mat<T> q = qd.cast<T>(), k = kd.cast<T>(), v = vd.cast<T>();
  // The streamed form: sum r^2 summed in T over a row's keys and d_k products, the subtraction
  // losing up to kStreamedLoss of it; the Gram matrices' entries: kMomentRows products in T.
  const double steps = double(nK + sdpa::internal::kMomentRows + dK + 2);
  const auto head = [&](const Mat<double>& x, Index h) { return Mat<double>(x.middleCols(h * dK, dK)); };
  const auto check = [&](const sdpa::DiagnosticsSink& sink, const Mat<double>& qx, const Mat<double>& kx) {
    for (Index h = 0; h < H; ++h) {
      const auto [want, spread] = centredRatioOf(head(qx, h), head(kx, h / (H / G)));
      INFO("head " << h << ": " << sink.inputs(h).centredRatio << " against " << want);
      CHECK(std::abs(sink.inputs(h).centredRatio - want) <=
            sdpa::internal::kStreamedLoss * steps * u * spread * std::abs(want));
    }
  };
  const auto gramRatio = [&](const Mat<T>& qx, const Mat<T>& kx, Index h) {
    const Mat<T> qh = qx.middleCols(h * dK, dK), kh = kx.middleCols(h / (H / G) * dK, dK);
    return sdpa::internal::headInputs(qh, kh, 1.0).centredRatio;
  };
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    SECTION("every row sees every key: the rows' raw sums") {
      for (Index h = 0; h < H; ++h) {
        const Mat<T> qh = q.middleCols(h * dK, dK), kh = k.middleCols(h / (H / G) * dK, dK);
        const Mat<double> qdh = head(qd, h), kdh = head(kd, h / (H / G));
        double sumR2 = 0;
        for (Index i = 0; i < nQ; ++i)
          for (Index j = 0; j < nK; ++j) sumR2 += std::pow(qdh.row(i).dot(kdh.row(j)), 2);
        CHECK(std::isfinite(sdpa::internal::streamedInner(sumR2, qh, sdpa::internal::moments(qh, false), kh,
                                                          sdpa::internal::moments(kh, false))));
      }
      sdpa::DiagnosticsSink sink;
      sdpa::multiHeadAttentionForward(kern, q, k, v, sdpa::Heads{H, G}, scale::InvSqrtDk{}, mask::None{}, {}, &sink);
      check(sink, qd, kd);
      if constexpr (std::is_same_v<T, float>) {  // half inputs, widened a block at a time
        const Mat<Eigen::half> qh = qd.cast<Eigen::half>(), kh = kd.cast<Eigen::half>(), vh = vd.cast<Eigen::half>();
        sdpa::multiHeadAttentionForward(kern, qh, kh, vh, sdpa::Heads{H, G}, scale::InvSqrtDk{}, mask::None{}, {},
                                        &sink);
        check(sink, qh.cast<double>(), kh.cast<double>());
      }
      // A softcap and a bias: the raw sums are the products', not the logits / tau.
      const Mat<T> bias = randn<double>(nQ, nK, 34).cast<T>();
      sdpa::multiHeadAttentionForward(kern, q, k, v, sdpa::Heads{H, G}, scale::InvSqrtDk{},
                                      mask::combine(mask::Softcap{3.0}, mask::Bias{bias}), {}, &sink);
      check(sink, qd, kd);
    }
    SECTION("a mask, a batch of two, or means that carry most of r: the Gram matrices") {
      sdpa::DiagnosticsSink sink;
      sdpa::multiHeadAttentionForward(kern, q, k, v, sdpa::Heads{H, G}, scale::InvSqrtDk{},
                                      mask::Causal{Align::LowerRight}, {}, &sink);
      check(sink, qd, kd);
      for (Index h = 0; h < H; ++h) CHECK(sink.inputs(h).centredRatio == gramRatio(q, k, h));
      // Two items: the pairs across them are no row's, and the ratio is the whole inputs'.
      sdpa::batchedAttentionForward(kern, q, k, v, sdpa::BatchLayout::varlen({0, 30, nQ}, {0, 100, nK}),
                                    sdpa::Heads{H, G}, scale::InvSqrtDk{}, mask::None{}, {}, &sink);
      check(sink, qd, kd);
      for (Index h = 0; h < H; ++h) CHECK(sink.inputs(h).centredRatio == gramRatio(q, k, h));
      // k's mean of 4 in every column: sum r^2 is hundreds of times <Gq, Gk>.
      const Mat<double> kShifted = (kd.array() + 3.7).matrix();
      const Mat<T> ks = kShifted.cast<T>();
      sdpa::multiHeadAttentionForward(kern, q, ks, v, sdpa::Heads{H, G}, scale::InvSqrtDk{}, mask::None{}, {}, &sink);
      check(sink, qd, kShifted);
      for (Index h = 0; h < H; ++h) CHECK(sink.inputs(h).centredRatio == gramRatio(q, ks, h));
      // An infinite entry of q: no ratio (NaN), as the Gram route gives, not an infinite one.
      Mat<T> qInf = q;
      qInf(5, 3) = std::numeric_limits<T>::infinity();
      sdpa::multiHeadAttentionForward(kern, qInf, k, v, sdpa::Heads{H, G}, scale::InvSqrtDk{}, mask::None{}, {}, &sink);
      CHECK(std::isnan(sink.inputs(0).centredRatio));
      CHECK(std::isfinite(sink.inputs(1).centredRatio));  // the other heads' as before
    }
  });
}

TEST_CASE("known cases: uniform attention, one-hot attention, identical heads  [seed C5, C6, C18]", "[diagnostics]") {
  SECTION("q = 0: every logit 0, uniform attention, H = log n") {
    const auto d = sdpa::diagnose(Mat<double>::Zero(5, 4), randn<double>(20, 4, 1));
    const auto& h = d.heads.at(0);
    CHECK(h.entropy.mean == Approx(std::log(20.0)).epsilon(1e-14));
    CHECK(h.entropyFraction.min == Approx(1.0).epsilon(1e-14));
    CHECK(h.effectiveKeys.mean == Approx(20.0).epsilon(1e-13));
    CHECK(h.maxWeight.max == Approx(0.05).epsilon(1e-14));
    CHECK(h.uniformFraction == 1.0);
    CHECK(h.saturatedFraction == 0.0);
    CHECK(anyContains(d.verdicts, "near uniform"));
  }
  SECTION("one key far above the rest: one-hot, H = 0, Jacobian 0") {
    Mat<double> k = Mat<double>::Zero(10, 2);
    k(3, 0) = 1000;
    const auto d = sdpa::diagnose(Mat<double>::Ones(4, 2), k, scale::None{});
    const auto& h = d.heads.at(0);
    CHECK(h.entropy.max <= 1e-300);
    CHECK(h.jacobianNorm.max == 0);
    CHECK(h.maxWeight.min == 1.0);
    CHECK(h.saturatedFraction == 1.0);
    CHECK(h.overflowFp32 == 4);  // 1000 > 88.72 in every row
    CHECK(h.logitGap.min == 1000);
    CHECK(h.underflowFraction == 1.0);  // exp(-1000) is below fp32's smallest normal
    CHECK(anyContains(d.verdicts, "every other weight underflows in fp32"));
    CHECK(anyContains(d.verdicts, "note: 4 logits exceed 88.72"));
  }
  SECTION("identical heads have similarity 1; independent ones much less") {
    const Mat<double> qh = randn<double>(16, 8, 2), k = randn<double>(24, 8, 3);
    Mat<double> q(16, 24);
    q << qh, qh, qh;
    const auto same = sdpa::diagnose(q, k, sdpa::Heads{3, 1});
    CHECK(same.headSimilarity == Approx(1.0).epsilon(1e-12));
    CHECK(anyContains(same.verdicts, "head collapse"));
    const auto different = sdpa::diagnose(randn<double>(16, 24, 4), k, sdpa::Heads{3, 1});
    CHECK(different.headSimilarity < 0.9);
    CHECK_FALSE(anyContains(different.verdicts, "head collapse"));
    CHECK(different.pairwiseSimilarity.rows() == 3);
    CHECK(different.pairwiseSimilarity(0, 1) == different.pairwiseSimilarity(1, 0));
  }
}

TEST_CASE("the seed's d_k = 64 case: unscaled is flagged, scaled is healthy  [seed C4, C5, C13, C14]",
          "[diagnostics][seed]") {
  const Mat<float> q = randn<float>(256, 64, 1), k = randn<float>(256, 64, 2);
  const auto unscaled = sdpa::diagnose(q, k, scale::None{});
  const auto scaled = sdpa::diagnose(q, k);
  INFO(unscaled.toString() << scaled.toString());
  CHECK(anyContains(unscaled.verdicts, "the scale looks missing"));
  CHECK(anyContains(unscaled.verdicts, "saturated"));
  CHECK(anyContains(unscaled.verdicts, "exceed 11.09"));
  CHECK(unscaled.heads[0].logitStd == Approx(8.0).epsilon(0.08));
  CHECK(unscaled.stage == sdpa::ModelStage::Init);  // independent Gaussian q and k: C3's premise
  CHECK(unscaled.warnings() >= 2);
  CHECK(scaled.healthy());
  CHECK(scaled.findings.empty());
  CHECK(scaled.verdicts ==
        std::vector<std::string>{"healthy: no warning at the init stage (fp32, max-subtracted softmax)"});
  CHECK(scaled.heads[0].logitStd == Approx(1.0).epsilon(0.08));
  // A learnable tau started at 1 is flagged (C17); one at 1/sqrt(d_k) is not.
  CHECK(anyContains(sdpa::diagnose(q, k, scale::Learnable<float>{1.0f}).verdicts, "risks collapse"));
  CHECK_FALSE(anyContains(sdpa::diagnose(q, k, scale::Learnable<float>{}).verdicts, "risks collapse"));
  // The report and the JSON carry the figures and verdicts.
  CHECK_THAT(unscaled.toString(), Contains("verdict: ") && Contains("logit std"));
  const std::string json = unscaled.toJson();
  CHECK(json.front() == '{');
  CHECK(json.back() == '}');
  CHECK_THAT(json, Contains("\"verdicts\":[\"") && Contains("\"overflow\":{\"fp16\":"));
}

TEST_CASE("calibrateTemperature finds the tau of a target entropy or logit std  [seed C10]", "[diagnostics]") {
  const Mat<double> q = randn<double>(64, 32, 1), k = randn<double>(128, 32, 2);
  for (const double target : {0.5, 0.8, 0.95}) {
    const double tau = sdpa::calibrateTemperature(q, k, sdpa::CalibrationTarget::entropyFraction(target));
    const double reached = sdpa::diagnose(q, k, scale::Constant{tau}).heads[0].entropyFraction.mean;
    INFO("target " << target << " tau " << tau << " reached " << reached);
    CHECK(std::abs(reached - target) < 1e-6);
  }
  const double tau1 = sdpa::calibrateTemperature(q, k, sdpa::CalibrationTarget::logitStd(1.0));
  CHECK(sdpa::diagnose(q, k, scale::Constant{tau1}).heads[0].logitStd == Approx(1.0).epsilon(1e-6));
  // Unit-variance q and k: tau for std 1 is close to 1/sqrt(d_k) (seed C7).
  CHECK(std::abs(tau1 * std::sqrt(32.0) - 1) < 0.1);
  CHECK_THROWS_WITH(sdpa::calibrateTemperature(q, k, sdpa::CalibrationTarget::entropyFraction(1.5)),
                    Contains("entropy fraction in (0, 1)"));
}

TEST_CASE("the saturation and near-uniform thresholds, with rows on both sides of each", "[diagnostics]") {
  // Two keys with logits x and 0 (d_k = 1, q = x, k = (1, 0), tau = 1): p_max = 1 / (1 + e^-x),
  // and the entropy fraction H / log 2 follows. Rows are placed just above and below
  // kSaturated = 0.99 (p_max) and kNearUniform = 0.99 (entropy fraction), and at 0.95, between a
  // looser threshold of 0.9 and the real one.
  const auto logitFor = [](double pMax) { return std::log(pMax / (1 - pMax)); };
  const auto fraction = [](double p) { return -(p * std::log(p) + (1 - p) * std::log(1 - p)) / std::log(2.0); };
  const std::vector<double> pMax = {0.5, 0.55, 0.57, 0.95, 0.985, 0.995, 0.9999};
  // Entropy fractions: 1, 0.9928, 0.9858, 0.286, ...: two rows above 0.99; p_max above 0.99: two.
  REQUIRE(fraction(0.55) > sdpa::kNearUniform);
  REQUIRE(fraction(0.57) < sdpa::kNearUniform);
  REQUIRE(fraction(0.57) > 0.98);
  Mat<double> q(Index(pMax.size()), 1), k(2, 1);
  for (size_t i = 0; i < pMax.size(); ++i) q(Index(i), 0) = logitFor(pMax[i]);
  k << 1, 0;
  const auto d = sdpa::diagnose(q, k, scale::Constant{1.0});
  const auto& h = d.heads.at(0);
  CHECK(h.maxWeight.max == Approx(0.9999).epsilon(1e-12));
  CHECK(h.saturatedFraction == Approx(2.0 / 7).epsilon(1e-15));
  CHECK(h.uniformFraction == Approx(2.0 / 7).epsilon(1e-15));
  // Below the saturation threshold everywhere: no saturated row, none near uniform.
  const Mat<double> qMid = q.middleRows(3, 2);  // p_max 0.95 and 0.985
  const auto mid = sdpa::diagnose(qMid, k, scale::Constant{1.0}).heads.at(0);
  CHECK(mid.saturatedFraction == 0.0);
  CHECK(mid.uniformFraction == 0.0);
}

TEST_CASE("the stage: auto reads C3's premise from the data and says how it decided  [seed C3]", "[diagnostics]") {
  // Independent isotropic q and k: the centred variance ratio is 1 within sqrt(2 / (n_q n_k)).
  const Mat<double> q = randn<double>(64, 16, 1), k = randn<double>(80, 16, 2);
  const auto independent = sdpa::diagnose(q, k);
  CHECK(independent.stage == sdpa::ModelStage::Init);
  CHECK_THAT(independent.stageReason, Contains("auto:") && Contains("C3's premise"));
  CHECK(std::abs(independent.heads[0].varianceRatioCentred - 1) < 4 * std::sqrt(2.0 / (64 * 80)));
  // q and k stretched along the same two directions (what training does to a head): the ratio is
  // d <Gq, Gk> / (tr Gq tr Gk) = 16 (2 * 16^2 + 14) / 46^2 = 3.98 in expectation.
  Mat<double> qa = q, ka = k;
  qa.leftCols(2) *= 4;
  ka.leftCols(2) *= 4;
  const auto aligned = sdpa::diagnose(qa, ka);
  CHECK(aligned.stage == sdpa::ModelStage::Trained);
  CHECK(aligned.heads[0].varianceRatioCentred == Approx(3.98).epsilon(0.15));
  CHECK_THAT(aligned.stageReason, Contains("1 of 1 heads break C3's premise"));
  // Given, not decided.
  sdpa::DiagnoseOptions trained;
  trained.stage = sdpa::ModelStage::Trained;
  const auto given = sdpa::diagnose(q, k, scale::InvSqrtDk{}, mask::None{}, trained);
  CHECK(given.stage == sdpa::ModelStage::Trained);
  CHECK(given.stageReason == "set by the caller");
  const std::string json = given.toJson();
  CHECK_THAT(json,
             Contains("\"stage\":\"trained\"") && Contains("\"level\":\"healthy\"") && Contains("\"centred_ratio\":"));
}

TEST_CASE("a sharp head is a note when trained, a warning at init; a positional head is named  [seed C5]",
          "[diagnostics]") {
  // Row i puts logit 10 on key i - 1 (row 0 on key 0), 0 elsewhere: p_max = e^10 / (e^10 + 7).
  const Index n = 8;
  Mat<double> q = Mat<double>::Zero(n, n), k = Mat<double>::Identity(n, n);
  for (Index i = 0; i < n; ++i) q(i, std::max<Index>(0, i - 1)) = 10;
  for (const auto stage : {sdpa::ModelStage::Init, sdpa::ModelStage::Trained}) {
    sdpa::DiagnoseOptions o;
    o.stage = stage;
    const auto d = sdpa::diagnose(q, k, scale::None{}, mask::None{}, o);
    INFO(d.toString());
    const auto& h = d.heads.at(0);
    CHECK(h.saturatedFraction == 1.0);
    CHECK(h.modeOffset == -1);
    CHECK(h.modeOffsetShare == Approx(7.0 / 8).epsilon(1e-15));
    CHECK(h.logitGap.max == 10);
    if (stage == sdpa::ModelStage::Init) {
      CHECK(anyContains(d.verdicts, "warning: 100% of rows are saturated"));
    } else {
      CHECK(d.healthy());
      CHECK(anyContains(d.verdicts, "note: a sharp head"));
      CHECK(anyContains(d.verdicts, "offset -1 for 88% of rows (a positional head)"));
    }
  }
}

TEST_CASE(
    "precision and softmax form: underflow and overflow are warnings only where they happen  [seed C5, C13, "
    "C15]",
    "[diagnostics]") {
  // Two keys, logits x and 0 in every row (d_k = 1, q = x, k = (1, 0)).
  const auto run = [](double x, sdpa::Precision p, sdpa::SoftmaxForm f) {
    sdpa::DiagnoseOptions o;
    o.stage = sdpa::ModelStage::Trained;
    o.precision = p;
    o.softmax = f;
    Mat<double> q = Mat<double>::Constant(4, 1, x), k(2, 1);
    k << 1, 0;
    return sdpa::diagnose(q, k, scale::None{}, mask::None{}, o);
  };
  using P = sdpa::Precision;
  using F = sdpa::SoftmaxForm;
  // A lead of 12: exp(-12) = 6e-6 is below fp16's smallest normal (6.1e-5), not fp32's.
  const auto fp16 = run(12, P::Fp16, F::MaxSubtracted), fp32 = run(12, P::Fp32, F::MaxSubtracted);
  CHECK(fp16.heads[0].underflowFraction == 1.0);
  CHECK(anyContains(fp16.verdicts,
                    "warning: 100% of rows lead their second logit by more than 9.7: every other "
                    "weight underflows in fp16"));
  CHECK(fp32.heads[0].underflowFraction == 0.0);
  CHECK(fp32.healthy());
  CHECK(anyContains(fp32.verdicts, "note: 4 logits (50.00%) exceed 11.09"));
  // Logits above 11.09: a warning only for a plain fp16 softmax.
  CHECK(run(9.5, P::Fp16, F::Plain).healthy());  // 9.5 < 11.09, and exp(-9.5) > 2^-14
  CHECK(anyContains(run(11.5, P::Fp16, F::Plain).verdicts, "warning: 4 logits (50.00%) exceed 11.09"));
  CHECK(run(11.5, P::Fp32, F::Plain).healthy());
  CHECK(run(11.5, P::Fp16, F::MaxSubtracted).warnings() == 1);  // the underflow, not the overflow
  // Above 88.72: a plain softmax overflows in every precision.
  CHECK(anyContains(run(90, P::Fp32, F::Plain).verdicts, "warning: 4 logits exceed 88.72"));
  CHECK(anyContains(run(90, P::Fp32, F::MaxSubtracted).verdicts, "note: 4 logits exceed 88.72"));
}

TEST_CASE("quantiles interpolate as NumPy's percentile; the median of an even count is the usual one",
          "[diagnostics]") {
  const sdpa::Quantiles q = sdpa::internal::quantiles({4, 1, 3, 2});
  CHECK(q.median == 2.5);
  CHECK(q.p05 == Approx(1.15).epsilon(1e-15));
  CHECK(q.p95 == Approx(3.85).epsilon(1e-15));
  CHECK(q.mean == 2.5);
  CHECK(sdpa::internal::quantiles({5, 1, 3}).median == 3);
}
