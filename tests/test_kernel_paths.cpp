// The fp32 prefill kernel's instruction-set paths (internal/forward_fast.hpp): AVX-512, AVX2 and
// the portable Eigen kernel, each run on this machine where its CPU has it, against the fp64
// oracle by the FlashAttention rule, with the general kernel's rules for special values.
#include <sdpa/sdpa.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "support/cases.hpp"

using namespace sdpa_test;
using sdpa::Index;
using sdpa::internal::Isa;
using sdpa::internal::IsaChoice;
using sdpa::mask::Align;
namespace mask = sdpa::mask;
namespace kernel = sdpa::kernel;

namespace {

/**
 * Calls f(scale, mask, tau, visible, bias, softcap) for the cases the fast kernel's tests sweep
 * at n_q = L, n_k = S, head size dK (`bias`: the L x S matrix of the Bias case): tau <= 1 (folded
 * into q), unscaled (logits to +-60 at d_k = 256, where the exp's accuracy shows), tau > 1
 * (applied after the product), causal, sliding window, softcap + causal + ALiBi, a bias, and rows
 * past a query length (they see nothing: 0 and -inf).
 */
template <typename F>
void forEachFastCase(Index L, Index S, Index dK, const Mat<float>& bias, F&& f) {
  const long double tau = 1.0L / std::sqrt((long double)dK);
  f(sdpa::scale::InvSqrtDk{}, mask::None{}, tau, allVisible(), noBias(), 0.0L);
  f(sdpa::scale::None{}, mask::None{}, 1.0L, allVisible(), noBias(), 0.0L);
  f(sdpa::scale::Constant{1.5}, mask::None{}, 1.5L, allVisible(), noBias(), 0.0L);
  f(
      sdpa::scale::InvSqrtDk{}, mask::Causal{Align::LowerRight}, tau, [=](Index i, Index j) { return j <= i + S - L; },
      noBias(), 0.0L);
  f(
      sdpa::scale::InvSqrtDk{}, mask::SlidingWindow{40, 0, Align::UpperLeft}, tau,
      [](Index i, Index j) { return j <= i && j >= i - 40; }, noBias(), 0.0L);
  f(
      sdpa::scale::InvSqrtDk{},
      mask::combine(mask::Softcap{3.0}, mask::Causal{Align::UpperLeft}, mask::Alibi{{0.125}, Align::UpperLeft}), tau,
      [](Index i, Index j) { return j <= i; },
      [](Index i, Index j) { return -0.125L * std::abs((long double)(i - j)); }, 3.0L);
  f(
      sdpa::scale::InvSqrtDk{}, mask::Bias{bias}, tau, allVisible(),
      [&](Index i, Index j) { return (long double)bias(i, j); }, 0.0L);
  f(
      sdpa::scale::InvSqrtDk{}, mask::QueryLength{L - 3}, tau, [=](Index i, Index) { return i < L - 3; }, noBias(),
      0.0L);
}

/// checkForwardAgainst under every ISA and both block sizes, the oracle computed once.
template <typename Scale, typename Mask>
void checkEveryIsa(const Mat<float>& q, const Mat<float>& k, const Mat<float>& v, const Scale& scale, const Mask& mask,
                   long double tau, const VisibleFn& visible, const BiasFn& bias, long double softcap = 0) {
  const auto gold = referenceAttention<long double>(q, k, v, tau, visible, bias, softcap);
  const auto naive = referenceAttention<float>(q, k, v, tau, visible, bias, softcap);
  forEachIsa([&](Isa) {
    for (const kernel::Tiled& kern : {kernel::Tiled{}, kernel::Tiled{7, 33}}) {
      INFO("blocks " << kern.blockQ << " x " << kern.blockK);
      checkForwardAgainst<float>(kern, q, k, v, scale, mask, gold, naive);
    }
  });
}

/// The largest |x| over the finite entries of x (0 if none).
double maxFinite(const Vec<double>& x) {
  double r = 0;
  for (Index i = 0; i < x.size(); ++i)
    if (std::isfinite(x(i))) r = std::max(r, std::abs(x(i)));
  return r;
}

/**
 * Half-precision q, k, v through the tiled kernel under every fast ISA and two block sizes, with
 * Products::Fp32: a float output within the float rule of the oracle on the same (exactly
 * converted) inputs, and bitwise that of the float kernel on those inputs; an output in H that,
 * plus one rounding to H (u_H max|gold|).
 */
template <typename H, typename Scale, typename Mask>
void checkHalfEveryIsa(const Mat<H>& q, const Mat<H>& k, const Mat<H>& v, const Scale& scale, const Mask& mask,
                       long double tau, const VisibleFn& visible, const BiasFn& bias, long double softcap = 0) {
  const Mat<double> qd = fromHalf(q), kd = fromHalf(k), vd = fromHalf(v);
  const Mat<float> qf = qd.cast<float>(), kf = kd.cast<float>(), vf = vd.cast<float>();
  const auto gold = referenceAttention<long double>(qd, kd, vd, tau, visible, bias, softcap);
  const auto naive = referenceAttention<float>(qd, kd, vd, tau, visible, bias, softcap);
  const Mat<double> goldOut = gold.output.template cast<double>();
  const Vec<double> goldLse = gold.logSumExp.template cast<double>();
  const double outScale = maxAbs(goldOut), lseScale = maxFinite(goldLse);
  const double outBound = errorBound<float>(maxAbsDiff(naive.output, goldOut), outScale, lseScale);
  const double lseBound = errorBound<float>(maxAbsDiff(naive.logSumExp, goldLse), lseScale);
  forEachIsa([&](Isa isa) {
    if (isa == Isa::Portable) return;  // the Eigen kernel's half path: test_half.cpp
    for (const kernel::Tiled& kern : {kernel::Tiled{}, kernel::Tiled{7, 33}}) {
      INFO("blocks " << kern.blockQ << " x " << kern.blockK);
      const auto f = sdpa::attentionForward<float>(kern, q, k, v, scale, mask);
      CHECK(maxAbsDiff(f.output, goldOut) <= outBound);
      CHECK(maxAbsDiff(f.logSumExp, goldLse) <= lseBound);
      for (Index i = 0; i < goldLse.size(); ++i)
        if (std::isinf(goldLse(i))) {
          CHECK(f.logSumExp(i) == -std::numeric_limits<float>::infinity());
          CHECK((f.output.row(i).array() == 0.0f).all());
        }
      // Every block of a call of more than 32 half query rows is on the fast kernel, its last
      // short one too, and so is the float call's (the shapes here); fewer against many keys
      // are decoding, whose half and float paths are their own.
      const Index rows = q.rows() > 32 ? q.rows() : 0;
      const auto inFloat = sdpa::attentionForward(kern, qf, kf, vf, scale, mask);
      CHECK(f.output.topRows(rows) == inFloat.output.topRows(rows));
      CHECK(f.logSumExp.head(rows) == inFloat.logSumExp.head(rows));
      const auto h = sdpa::attentionForward(kern, q, k, v, scale, mask);
      STATIC_REQUIRE(std::is_same_v<typename decltype(h.output)::Scalar, H>);
      CHECK(maxAbsDiff(fromHalf(h.output), goldOut) <= outBound + unitRoundoff<H>() * outScale);
    }
  });
}

}  // namespace

TEST_CASE("every ISA path of the float prefill kernel matches the fp64 reference  [seed C1]", "[tiled][isa]") {
  using T = float;
  std::uint64_t seed = 4100;
  struct Shape {
    Index nQ, nK, dK, dV;
  };
  // Lanes and keys that are not multiples of the micro-tiles (32 x 8, 16 x 6), d_v not of its
  // columns; 5 rows against 19 keys, too few keys a row for the decoding path (decodes).
  const std::vector<Shape> shapes = {{67, 45, 16, 16}, {130, 257, 64, 64}, {33, 300, 100, 37}, {5, 19, 256, 7}};
  for (const Shape& s : shapes) {
    INFO("n_q " << s.nQ << ", n_k " << s.nK << ", d_k " << s.dK << ", d_v " << s.dV);
    const Mat<T> q = randn<T>(s.nQ, s.dK, ++seed), k = randn<T>(s.nK, s.dK, ++seed), v = randn<T>(s.nK, s.dV, ++seed);
    const Mat<T> bias = randn<T>(s.nQ, s.nK, ++seed, 4.0);
    forEachFastCase(s.nQ, s.nK, s.dK, bias,
                    [&](const auto& scale, const auto& m, long double tau, const VisibleFn& visible, const BiasFn& b,
                        long double softcap) { checkEveryIsa(q, k, v, scale, m, tau, visible, b, softcap); });
  }
}

TEST_CASE("the diagnostics' centred Gram matrices on every ISA path: within float's summation bound", "[tiled][isa]") {
  // moments() of float inputs (a DiagnosticsSink's per-head inputs: Var(q), Var(k) and the
  // centred Gram matrices behind varianceRatioCentred): the fast Gram kernel on AVX2 / AVX-512,
  // Eigen's rank update on the portable path, against double. Each Gram entry sums at most
  // kMomentRows products in float (in lanes, then the blocks in double): with centred entries c,
  // |error| <= (kMomentRows + 2) u sum_i |c_ia| |c_ib|, plus the centring's own error, which
  // moves every entry by n delta_a delta_b (delta: the mean's float error, at most
  // (kMomentRows + 2) u its magnitude) and rounds each c to u |c|. Shapes: one row, fewer rows than
  // a vector, more than a block; widths below, at and past the kernel's tiles; column-major,
  // row-major and a block of a wider matrix.
  constexpr double u = 0x1p-24;
  const double m = double(sdpa::internal::kMomentRows) + 2;
  std::uint64_t seed = 4400;
  for (const auto& shape : std::vector<std::pair<Index, Index>>{{1, 3}, {7, 5}, {37, 24}, {600, 64}, {1100, 100}}) {
    const Index n = shape.first, d = shape.second;
    INFO("n " << n << ", d " << d);
    const Mat<float> wide = (randn<float>(n, d + 3, ++seed).array() + 3.0f).matrix();
    const Mat<double> x = wide.leftCols(d).cast<double>();
    const Eigen::RowVectorXd mean = x.colwise().mean();
    const Mat<double> c = x.rowwise() - mean, gram = c.transpose() * c;
    const Mat<double> bound = (m + 1) * u * (c.cwiseAbs().transpose() * c.cwiseAbs()) +
                              double(n) * (m * u * mean.cwiseAbs().transpose()) * (m * u * mean.cwiseAbs());
    // Var = (tr G + n sum_c (mean_c - mu)^2) / (n d), mu the mean of the means: G's diagonal
    // as above, and each mean_c off by delta_c.
    const double variance = (x.array() - x.mean()).square().mean();
    const Eigen::ArrayXd delta = m * u * mean.cwiseAbs().transpose().array();
    const double varianceBound =
        (bound.trace() +
         double(n) * (4 * (mean.array() - mean.mean()).abs().transpose() * delta + 4 * delta.square()).sum()) /
        double(n * d);
    const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rowMajor = wide.leftCols(d);
    forEachIsa([&](Isa) {
      const auto check = [&](const sdpa::internal::Moments& got, const char* layout) {
        INFO(layout);
        REQUIRE(got.gram.rows() == d);
        REQUIRE(got.gram.cols() == d);
        // The lower triangle is G's, the strict upper one zero (headInputs reads it so).
        const Mat<double> lower = gram.triangularView<Eigen::Lower>();
        CHECK(((got.gram - lower).cwiseAbs().array() <= bound.array()).all());
        CHECK(got.gram.triangularView<Eigen::StrictlyUpper>().toDenseMatrix().isZero(0));
        CHECK(std::abs(got.variance - variance) <= varianceBound);
        CHECK(std::abs(got.trace - gram.trace()) <= bound.trace());
      };
      check(sdpa::internal::moments(Mat<float>(wide.leftCols(d))), "column-major");
      check(sdpa::internal::moments(rowMajor), "row-major");
      check(sdpa::internal::moments(wide.leftCols(d)), "a block of a wider matrix");
    });
  }
}

TEST_CASE("the AVX2 and AVX-512 paths give the same bits", "[tiled][isa]") {
  // Each lane (query row) computes the same operations in the same order on both: the same
  // fused multiply-adds of the products, the same exp, the same running sums.
  if (IsaChoice::detected() < Isa::Avx512) {
    WARN("this CPU has no AVX-512: nothing to compare");
    return;
  }
  const Mat<float> q = randn<float>(77, 64, 1), k = randn<float>(300, 64, 2), v = randn<float>(300, 40, 3);
  const auto causal = mask::Causal{Align::LowerRight};
  IsaChoice::setCap(Isa::Avx2);
  const auto a = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, causal);
  IsaChoice::setCap(Isa::Amx);
  const auto b = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, causal);
  CHECK(a.output == b.output);
  CHECK(a.logSumExp == b.logSumExp);
}

TEST_CASE("special values in the float prefill kernel follow the general kernel's rules", "[tiled][isa][nan]") {
  constexpr float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const Index nQ = 40, nK = 70, d = 16;
  const Mat<float> q = randn<float>(nQ, d, 11), k = randn<float>(nK, d, 12), v = randn<float>(nK, 5, 13);
  forEachIsa([&](Isa) {
    // Hidden positions hold NaN and inf in k and v: no effect on any row, to the bit in the fast
    // kernel (its zero-skipping product keeps the order of its sums), up to the order of the sums
    // in the portable one (test_forward.cpp).
    const mask::KeyLength keys{60};
    const auto clean = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, keys);
    Mat<float> kBad = k, vBad = v;
    kBad.bottomRows(10).setConstant(nan);
    vBad.bottomRows(10).setConstant(inf);
    const auto dirty = sdpa::attentionForward(q, kBad, vBad, sdpa::scale::InvSqrtDk{}, keys);
    if (IsaChoice::current() == Isa::Portable)
      CHECK(maxAbsDiff(dirty.output, clean.output) <= 4 * std::numeric_limits<float>::epsilon());
    else
      CHECK(dirty.output == clean.output);
    CHECK(dirty.logSumExp == clean.logSumExp);

    // A NaN bias at a visible position makes its row NaN; the other rows keep their bits.
    Mat<float> bias = Mat<float>::Zero(nQ, nK);
    const auto plain = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, mask::Bias{bias});
    bias(7, 3) = nan;
    const auto poisoned = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, mask::Bias{bias});
    for (Index i = 0; i < nQ; ++i) {
      if (i == 7) {
        CHECK(poisoned.output.row(i).array().isNaN().all());
        CHECK(std::isnan(poisoned.logSumExp(i)));
      } else {
        CHECK(poisoned.output.row(i) == plain.output.row(i));
        CHECK(poisoned.logSumExp(i) == plain.logSumExp(i));
      }
    }

    // Products beyond the largest float: q.k = +inf in row 2 only. That row is NaN, as the
    // naive kernel's rule says; the others are finite.
    Mat<float> qBig = q;
    qBig.row(2).setConstant(1e30f);
    Mat<float> kBig = k;
    kBig.row(0).setConstant(1e30f);
    const auto big = sdpa::attentionForward(qBig, kBig, v, sdpa::scale::None{});
    const auto naive = sdpa::attentionForward(kernel::Naive{}, qBig, kBig, v, sdpa::scale::None{});
    for (Index i = 0; i < nQ; ++i) {
      INFO("row " << i);
      CHECK(big.output.row(i).hasNaN() == naive.output.row(i).hasNaN());
      CHECK(std::isnan(big.logSumExp(i)) == std::isnan(naive.logSumExp(i)));
    }
    CHECK(big.output.row(2).hasNaN());

    // A value of inf whose weight a later, larger logit turns to exactly 0 has no effect.
    Mat<float> k1 = Mat<float>::Zero(48, 1), v1 = randn<float>(48, 3, 37);
    k1(47, 0) = 1e4f;
    v1(0, 1) = inf;
    v1(20, 2) = nan;
    const Mat<float> q1 = Mat<float>::Ones(9, 1);
    const auto one = sdpa::attentionForward(kernel::Tiled{16, 8}, q1, k1, v1, sdpa::scale::None{});
    for (Index i = 0; i < 9; ++i) CHECK(one.output.row(i) == v1.row(47));

    // Every key hidden from some rows: output 0 and logSumExp -inf there.
    const auto none = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, mask::QueryLength{30});
    CHECK((none.output.bottomRows(10).array() == 0.0f).all());
    CHECK((none.logSumExp.tail(10).array() == -inf).all());
  });
}

TEST_CASE("the kernels' scratch starts on a cache line in any build", "[tiled][isa]") {
  // The kernels chosen at run time load 64-byte vectors from multiples of 64 bytes of their
  // buffers; Eigen's own allocations are aligned to the build's widest vector only (16 bytes
  // without -mavx), where every such load would straddle two lines.
  sdpa::internal::Buffer<float> f;
  sdpa::internal::Buffer<double> d;
  sdpa::internal::Buffer<sdpa::Index> i;
  const auto onLine = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 64 == 0; };
  for (const sdpa::Index n : {0, 1, 3, 17, 1000, 100000}) {
    CHECK(onLine(f.get(n)));
    CHECK(onLine(d.get(n)));
    CHECK(onLine(i.get(n)));
  }
  float* big = f.get(100000);
  CHECK(f.get(5) == big);  // grown, never shrunk
}

TEST_CASE("the float prefill kernel's exp and exp2 are within 1.1 ulp, exactly 0 below the cut", "[tiled][isa]") {
  // softmaxTile's exp (natural logits: Cody-Waite and Cephes' polynomial) and exp2 (base-2
  // tiles: a fitted degree-6 polynomial) over 10^6 arguments spread over (cut, 0], against
  // long double: measured at most 1.009 ulp and 0.952 ulp (NUMERICS.md).
  constexpr float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  forEachIsa([&](Isa isa) {
    if (isa == Isa::Portable) return;
    for (const bool base2 : {false, true}) {
      INFO((base2 ? "exp2" : "exp"));
      const float cut = base2 ? sdpa::internal::fast::kExp2Cut : sdpa::internal::kExpCut<float>;
      const Index n = 1000000;
      std::vector<float> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
      for (Index i = 0; i < n; ++i) x[size_t(i)] = cut * float(i) / float(n);
      sdpa::internal::fast::expArray(base2, x.data(), y.data(), n);
      double worst = 0;
      for (Index i = 0; i < n; ++i) {
        const long double e = base2 ? std::exp2((long double)x[size_t(i)]) : std::exp((long double)x[size_t(i)]);
        const double ulp = double(std::nextafter(float(e), inf) - float(e));
        worst = std::max(worst, double(std::abs((long double)y[size_t(i)] - e)) / ulp);
      }
      CHECK(worst <= 1.1);
      // Exactly 0 at and below the cut, at -inf and NaN; exactly 1 at 0, and 2^-k exact.
      std::vector<float> s = {cut, std::nextafter(cut, -inf), 2 * cut, -1e30f, -inf, nan, 0.0f}, t(s.size());
      sdpa::internal::fast::expArray(base2, s.data(), t.data(), Index(s.size()));
      for (size_t i = 0; i + 1 < s.size(); ++i) CHECK(t[i] == 0.0f);
      CHECK(t.back() == 1.0f);
      if (base2) {
        std::vector<float> k(126), r(126);
        for (size_t i = 0; i < k.size(); ++i) k[i] = -float(i);
        sdpa::internal::fast::expArray(true, k.data(), r.data(), Index(k.size()));
        for (size_t i = 0; i < k.size(); ++i) CHECK(r[i] == std::ldexp(1.0f, -int(i)));
      }
    }
  });
}

TEMPLATE_TEST_CASE("half and bfloat16 inputs take the fast float kernel on every ISA path  [seed C1]",
                   "[tiled][isa][half]", Eigen::half, Eigen::bfloat16) {
  using H = TestType;
  std::uint64_t seed = 5200;
  const std::vector<Shape> shapes = {{67, 45, 16, 16}, {130, 257, 64, 64}, {33, 300, 100, 37}};
  for (const Shape& s : shapes) {
    INFO("n_q " << s.nQ << ", n_k " << s.nK << ", d_k " << s.dK << ", d_v " << s.dV);
    const Mat<H> q = toHalf<H>(randn<float>(s.nQ, s.dK, ++seed)), k = toHalf<H>(randn<float>(s.nK, s.dK, ++seed)),
                 v = toHalf<H>(randn<float>(s.nK, s.dV, ++seed));
    const Mat<float> bias = randn<float>(s.nQ, s.nK, ++seed, 4.0);
    forEachFastCase(s.nQ, s.nK, s.dK, bias,
                    [&](const auto& scale, const auto& m, long double tau, const VisibleFn& visible, const BiasFn& b,
                        long double softcap) { checkHalfEveryIsa(q, k, v, scale, m, tau, visible, b, softcap); });
  }
  // GQA heads and a batch: each (item, kv head)'s k and v converted once, shared by its query
  // heads; bitwise the float kernel's result on the converted inputs.
  const Index nQ = 50, nK = 90, d = 24;
  const Mat<H> q = toHalf<H>(randn<float>(2 * nQ, 4 * d, 71)), k = toHalf<H>(randn<float>(2 * nK, 2 * d, 72)),
               v = toHalf<H>(randn<float>(2 * nK, 2 * d, 73));
  const auto batch = sdpa::BatchLayout::varlen({0, nQ, 2 * nQ}, {0, nK, 2 * nK});
  const Mat<float> qf = q.template cast<float>(), kf = k.template cast<float>(), vf = v.template cast<float>();
  forEachIsa([&](Isa isa) {
    if (isa == Isa::Portable) return;
    const auto h = sdpa::batchedAttentionForward<float>(q, k, v, batch, sdpa::Heads{4, 2}, sdpa::scale::InvSqrtDk{},
                                                        mask::Causal{Align::LowerRight});
    const auto f = sdpa::batchedAttentionForward(qf, kf, vf, batch, sdpa::Heads{4, 2}, sdpa::scale::InvSqrtDk{},
                                                 mask::Causal{Align::LowerRight});
    CHECK(h.output == f.output);
    CHECK(h.logSumExp == f.logSumExp);
  });
}

TEMPLATE_TEST_CASE("bf16 dot products (Products::Bf16): the float bound plus 2^-7 sum_j P_ij |v_jc|, else Fp32",
                   "[tiled][isa][half]", Eigen::half, Eigen::bfloat16) {
  // With AVX512_BF16, q, k, v are the bf16 values of the inputs (fp16 rounded to nearest even)
  // and the weights P are rounded to bf16 for P v: each product moves by at most u = 2^-8 of
  // P_ij |v_jc|, and the row sum stays fp32, so a plain computation that rounds P so has error
  // up to u sum_j P_ij |v_jc| over the float one; the rule allows twice that. Without
  // AVX512_BF16 (or capped below it) the option changes nothing: bitwise Products::Fp32.
  using H = TestType;
  const double u = std::ldexp(1.0, -8);
  const kernel::Products bf16 = kernel::Products::Bf16;
  std::uint64_t seed = 5300;
  const std::vector<Shape> shapes = {{67, 45, 16, 16}, {130, 257, 64, 64}, {33, 301, 99, 37}};
  for (const Shape& s : shapes) {
    INFO("n_q " << s.nQ << ", n_k " << s.nK << ", d_k " << s.dK << ", d_v " << s.dV);
    const Mat<H> q = toHalf<H>(randn<float>(s.nQ, s.dK, ++seed)), k = toHalf<H>(randn<float>(s.nK, s.dK, ++seed)),
                 v = toHalf<H>(randn<float>(s.nK, s.dV, ++seed));
    // The oracle on the values the products see.
    const Mat<double> qd = fromHalf(toHalf<Eigen::bfloat16>(q.template cast<float>())),
                      kd = fromHalf(toHalf<Eigen::bfloat16>(k.template cast<float>())),
                      vd = fromHalf(toHalf<Eigen::bfloat16>(v.template cast<float>()));
    const Index L = s.nQ, S = s.nK;
    const auto check = [&](const auto& scale, const auto& m, long double tau, const VisibleFn& visible,
                           const BiasFn& bias, long double softcap) {
      if (IsaChoice::detected() < Isa::Avx512Bf16) {  // the fallback only: no oracle needed
        forEachIsa([&](Isa) {
          const auto f = sdpa::attentionForward<float>(kernel::Tiled{7, 33, bf16}, q, k, v, scale, m);
          const auto plain = sdpa::attentionForward<float>(kernel::Tiled{7, 33}, q, k, v, scale, m);
          CHECK(f.output == plain.output);
          CHECK(f.logSumExp == plain.logSumExp);
        });
        return;
      }
      const auto gold = referenceAttention<long double>(qd, kd, vd, tau, visible, bias, softcap);
      const auto naive = referenceAttention<float>(qd, kd, vd, tau, visible, bias, softcap);
      const Mat<double> absV = vd.cwiseAbs();
      const Mat<double> weighted = referenceAttention<long double>(qd, kd, absV, tau, visible, bias, softcap)
                                       .output.template cast<double>();  // sum_j P_ij |v_jc|
      const Mat<double> goldOut = gold.output.template cast<double>();
      const Vec<double> goldLse = gold.logSumExp.template cast<double>();
      const double outScale = maxAbs(goldOut), lseScale = maxFinite(goldLse);
      const double outBound = errorBound<float>(maxAbsDiff(naive.output, goldOut), outScale, lseScale);
      const double lseBound = errorBound<float>(maxAbsDiff(naive.logSumExp, goldLse), lseScale);
      forEachIsa(
          [&](Isa isa) {
            for (const kernel::Tiled& kern : {kernel::Tiled{0, 0, bf16}, kernel::Tiled{7, 33, bf16}}) {
              INFO("blocks " << kern.blockQ << " x " << kern.blockK);
              const auto f = sdpa::attentionForward<float>(kern, q, k, v, scale, m);
              if (isa >= Isa::Avx512Bf16) {
                double worst = 0;  // the largest error over its bound, entry by entry
                for (Index c = 0; c < goldOut.cols(); ++c)
                  for (Index i = 0; i < goldOut.rows(); ++i) {
                    const double e = std::abs(double(f.output(i, c)) - goldOut(i, c));
                    worst = std::max(worst, e / (outBound + 2 * u * weighted(i, c)));
                  }
                CHECK(worst <= 1.0);
                CHECK(maxAbsDiff(f.logSumExp, goldLse) <= lseBound);
                CHECK(f.output.allFinite());
              } else {
                const auto plain =
                    sdpa::attentionForward<float>(kernel::Tiled{kern.blockQ, kern.blockK}, q, k, v, scale, m);
                CHECK(f.output == plain.output);
                CHECK(f.logSumExp == plain.logSumExp);
              }
            }
          },
          true);
    };
    const long double tau = 1.0L / std::sqrt((long double)s.dK);
    check(sdpa::scale::InvSqrtDk{}, mask::None{}, tau, allVisible(), noBias(), 0);
    check(sdpa::scale::None{}, mask::None{}, 1.0L, allVisible(), noBias(), 0);
    // A large negative scale: the row maxima of the logits (to about 300) are not the raw
    // products' maxima scaled, and a softmax shifted by anything else overflows.
    check(sdpa::scale::Constant{-8.0}, mask::None{}, -8.0L, allVisible(), noBias(), 0);
    // Logits near 10^29 (finite, no overflow possible): the largest logit of a row has weight 1
    // only if it is rounded before its row maximum is subtracted (half its ulp is 2^71).
    check(sdpa::scale::Constant{std::ldexp(1.0, 93)}, mask::None{}, std::ldexp(1.0L, 93), allVisible(), noBias(), 0);
    check(
        sdpa::scale::InvSqrtDk{}, mask::Causal{Align::LowerRight}, tau,
        [=](Index i, Index j) { return j <= i + S - L; }, noBias(), 0);
    check(
        sdpa::scale::InvSqrtDk{},
        mask::combine(mask::Softcap{3.0}, mask::Causal{Align::UpperLeft}, mask::Alibi{{0.125}, Align::UpperLeft}), tau,
        [](Index i, Index j) { return j <= i; },
        [](Index i, Index j) { return -0.125L * std::abs((long double)(i - j)); }, 3.0L);
  }
}

TEMPLATE_TEST_CASE("bf16 products pack k and v from any storage order, half by the scalar rounding",
                   "[tiled][isa][half]", Eigen::half, Eigen::bfloat16) {
  // The packing of k and v (forward_fast.hpp's packBf16Head: vector paths for column-major
  // storage, the scalar one otherwise) is exact, and half becomes bf16 rounded to nearest even
  // as Eigen rounds it: the result of row-major, strided and column-major inputs is the same to
  // the bit, and so is that of half inputs and of their bf16 values.
  using H = TestType;
  using RowMat = Eigen::Matrix<H, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  if (IsaChoice::detected() < Isa::Avx512Bf16) {
    WARN("this CPU has no AVX512_BF16: the bf16 dot-product kernel does not run here");
    return;
  }
  const kernel::Tiled kern{0, 0, kernel::Products::Bf16};
  std::uint64_t seed = 7100;
  // n_k and d_k past and short of the packing's blocks of 8 keys and 8 pairs, odd d_k.
  for (const Shape& s :
       std::vector<Shape>{{45, 77, 40, 24}, {33, 130, 99, 37}, {64, 300, 16, 16}, {70, 333, 128, 40}}) {
    INFO("n_q " << s.nQ << ", n_k " << s.nK << ", d_k " << s.dK << ", d_v " << s.dV);
    const Mat<H> q = toHalf<H>(randn<float>(s.nQ, s.dK, ++seed)), k = toHalf<H>(randn<float>(s.nK, s.dK, ++seed));
    Mat<H> v = toHalf<H>(randn<float>(s.nK, s.dV, ++seed));
    v(s.nK - 2, s.dV / 2) = H(std::numeric_limits<float>::infinity());  // a tile with a value not finite
    const RowMat qR = q, kR = k, vR = v;
    // Strided: the inputs as blocks of wider matrices.
    Mat<H> kWide = Mat<H>::Zero(s.nK + 5, s.dK + 3), vWide = Mat<H>::Zero(s.nK + 5, s.dV + 3);
    kWide.block(2, 1, s.nK, s.dK) = k;
    vWide.block(2, 1, s.nK, s.dV) = v;
    const mask::KeyLength keys{s.nK - 4};  // the value that is not finite hidden
    forEachIsa(
        [&](Isa isa) {
          if (isa < Isa::Avx512Bf16) return;
          const auto plain = sdpa::attentionForward<float>(kern, q, k, v, sdpa::scale::InvSqrtDk{}, keys);
          REQUIRE(plain.output.allFinite());
          const auto rows = sdpa::attentionForward<float>(kern, qR, kR, vR, sdpa::scale::InvSqrtDk{}, keys);
          CHECK(rows.output == plain.output);
          CHECK(rows.logSumExp == plain.logSumExp);
          const auto mixed = sdpa::attentionForward<float>(kern, q, kR, v, sdpa::scale::InvSqrtDk{}, keys);
          CHECK(mixed.output == plain.output);
          const auto strided = sdpa::attentionForward<float>(
              kern, q, kWide.block(2, 1, s.nK, s.dK), vWide.block(2, 1, s.nK, s.dV), sdpa::scale::InvSqrtDk{}, keys);
          CHECK(strided.output == plain.output);
          CHECK(strided.logSumExp == plain.logSumExp);
          if constexpr (std::is_same_v<H, Eigen::half>) {
            // (Finite values: a tile with a value that is not reads v in place, unrounded.)
            using B = Eigen::bfloat16;
            const Mat<H> vFinite = v.unaryExpr([](H x) { return Eigen::numext::isfinite(x) ? x : H(1.0f); });
            const Mat<B> qB = q.template cast<float>().template cast<B>(),
                         kB = k.template cast<float>().template cast<B>(),
                         vB = vFinite.template cast<float>().template cast<B>();
            const auto half = sdpa::attentionForward<float>(kern, q, k, vFinite, sdpa::scale::InvSqrtDk{}, keys);
            const auto bf = sdpa::attentionForward<float>(kern, qB, kB, vB, sdpa::scale::InvSqrtDk{}, keys);
            CHECK(bf.output == half.output);
            CHECK(bf.logSumExp == half.logSumExp);
          }
        },
        true);
  }
}

namespace {

/// The bf16 kernel's special values under the ISA in force (its vdpbf16ps or AMX products).
void specialValuesInBf16Kernel() {
  using B = Eigen::bfloat16;
  constexpr float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const kernel::Tiled kern{0, 0, kernel::Products::Bf16};
  const Index nQ = 40, nK = 70, d = 16;
  const Mat<B> q = toHalf<B>(randn<float>(nQ, d, 11)), k = toHalf<B>(randn<float>(nK, d, 12)),
               v = toHalf<B>(randn<float>(nK, 5, 13));
  // NaN and inf at hidden keys: the tile that holds them takes the zero-skipping fp32 product,
  // so the output moves by no more than the bf16 rounding of P (2^-8 max|v|); no NaN.
  const mask::KeyLength keys{60};
  const auto clean = sdpa::attentionForward<float>(kern, q, k, v, sdpa::scale::InvSqrtDk{}, keys);
  Mat<B> kBad = k, vBad = v;
  kBad.bottomRows(10).setConstant(B(nan));
  vBad.bottomRows(10).setConstant(B(inf));
  const auto dirty = sdpa::attentionForward<float>(kern, q, kBad, vBad, sdpa::scale::InvSqrtDk{}, keys);
  CHECK(dirty.output.allFinite());
  CHECK(maxAbsDiff(dirty.output, clean.output) <= std::ldexp(1.0, -8) * maxAbs(fromHalf(v)));
  CHECK(dirty.logSumExp == clean.logSumExp);
  // A NaN bias at a visible position makes its row NaN; the other rows keep their bits.
  Mat<float> bias = Mat<float>::Zero(nQ, nK);
  const auto plain = sdpa::attentionForward<float>(kern, q, k, v, sdpa::scale::InvSqrtDk{}, mask::Bias{bias});
  bias(7, 3) = nan;
  const auto poisoned = sdpa::attentionForward<float>(kern, q, k, v, sdpa::scale::InvSqrtDk{}, mask::Bias{bias});
  for (Index i = 0; i < nQ; ++i) {
    INFO("row " << i);
    if (i == 7) {
      CHECK(poisoned.output.row(i).array().isNaN().all());
    } else {
      CHECK(poisoned.output.row(i) == plain.output.row(i));
      CHECK(poisoned.logSumExp(i) == plain.logSumExp(i));
    }
  }
  // Every key hidden from some rows: output 0 and logSumExp -inf there.
  const auto none = sdpa::attentionForward<float>(kern, q, k, v, sdpa::scale::InvSqrtDk{}, mask::QueryLength{30});
  CHECK((none.output.bottomRows(10).array() == 0.0f).all());
  CHECK((none.logSumExp.tail(10).array() == -inf).all());
}

}  // namespace

TEST_CASE("special values in the bf16 dot-product kernel follow the general kernel's rules", "[tiled][isa][nan]") {
  if (IsaChoice::detected() < Isa::Avx512Bf16) {
    WARN("this CPU has no AVX512_BF16: the bf16 dot-product kernel does not run here");
    return;
  }
  forEachIsa(
      [](Isa isa) {
        if (isa >= Isa::Avx512Bf16) specialValuesInBf16Kernel();
      },
      true);
}

namespace {

/**
 * The float backward (internal/backward_fast.hpp on the AVX-512 and AVX2 paths, the general tiles
 * on the portable one) under every ISA and two block sizes, against the fp64 oracle by the
 * FlashAttention rule: the error of dq, dk and dv at most twice that of the plain float
 * computation (referenceBackward<float>) plus the rounding of the logits.
 */
template <typename Scale, typename Mask>
void checkBackwardEveryIsa(const Mat<float>& q, const Mat<float>& k, const Mat<float>& v, const Mat<float>& dO,
                           const Scale& scale, const Mask& mask, long double tau, const VisibleFn& visible,
                           std::initializer_list<kernel::Tiled> kernels = {kernel::Tiled{}, kernel::Tiled{7, 33}},
                           bool fastOnly = false) {
  const auto gold = referenceBackward<double>(q, k, v, dO, tau, visible);
  const auto plain = referenceBackward<float>(q, k, v, dO, tau, visible);
  const double errors[] = {maxAbsDiff(plain.dq, gold.dq), maxAbsDiff(plain.dk, gold.dk), maxAbsDiff(plain.dv, gold.dv)};
  const double scales[] = {maxAbs(gold.dq), maxAbs(gold.dk), maxAbs(gold.dv)};
  forEachIsa([&](Isa isa) {
    if (fastOnly && isa == Isa::Portable) return;
    for (const kernel::Tiled& kern : kernels) {
      INFO("blocks " << kern.blockQ << " x " << kern.blockK);
      const auto fwd = sdpa::attentionForward(kern, q, k, v, scale, mask);
      const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dO, scale, mask);
      const double got[] = {maxAbsDiff(g.dq, gold.dq), maxAbsDiff(g.dk, gold.dk), maxAbsDiff(g.dv, gold.dv)};
      // dL/dtau is one sum over all n_q n_k terms, whose plain float error a single case can make
      // lucky (the general tiles fail this per-case bound too): it is held to the rule summed over
      // seeds in test_backward.cpp ("float gradients where logits are large", "dL/dtau is summed
      // centred"), which runs these paths on such a CPU. Here: dq, dk, dv.
      const char* names[] = {"dq", "dk", "dv"};
      for (int i = 0; i < 3; ++i) {
        INFO(names[i] << ": error " << got[i] << ", plain float " << errors[i]);
        CHECK(got[i] <= errorBound<float>(errors[i], scales[i]));
      }
    }
  });
}

}  // namespace

TEST_CASE("every ISA path of the float backward matches the fp64 reference  [seed C17]", "[tiled][isa][backward]") {
  std::uint64_t seed = 5100;
  struct Shape {
    Index nQ, nK, dK, dV;
  };
  // Rows and keys that are not multiples of the lane groups (32, 16) or micro-tiles, d not of
  // the vector width (the padded dk and dv rows), a head wider than 128.
  const std::vector<Shape> shapes = {{67, 45, 16, 16}, {130, 257, 64, 64}, {33, 300, 100, 37}, {21, 61, 256, 7}};
  for (const Shape& s : shapes) {
    INFO("n_q " << s.nQ << ", n_k " << s.nK << ", d_k " << s.dK << ", d_v " << s.dV);
    const Mat<float> q = randn<float>(s.nQ, s.dK, ++seed), k = randn<float>(s.nK, s.dK, ++seed),
                     v = randn<float>(s.nK, s.dV, ++seed), dO = randn<float>(s.nQ, s.dV, ++seed);
    const long double tau = 1.0L / std::sqrt((long double)s.dK);
    const Index off = s.nK - s.nQ, rows = s.nQ - 3;
    INFO("1 / sqrt(d_k), folded into q");
    checkBackwardEveryIsa(q, k, v, dO, sdpa::scale::InvSqrtDk{}, mask::None{}, tau, allVisible());
    INFO("unscaled: large logits");
    checkBackwardEveryIsa(q, k, v, dO, sdpa::scale::None{}, mask::None{}, 1.0L, allVisible());
    INFO("tau 1.5: applied to the logits, not folded");
    checkBackwardEveryIsa(q, k, v, dO, sdpa::scale::Constant{1.5}, mask::None{}, 1.5L, allVisible());
    INFO("causal, lower right: partial and hidden tiles");
    checkBackwardEveryIsa(q, k, v, dO, sdpa::scale::InvSqrtDk{}, mask::Causal{Align::LowerRight}, tau,
                          [=](Index i, Index j) { return j <= i + off; });
    INFO("sliding window");
    checkBackwardEveryIsa(q, k, v, dO, sdpa::scale::InvSqrtDk{}, mask::SlidingWindow{20, 3, Align::UpperLeft}, tau,
                          [](Index i, Index j) { return j <= i + 3 && j >= i - 20; });
    INFO("rows past a query length see nothing: zero gradients");
    checkBackwardEveryIsa(q, k, v, dO, sdpa::scale::InvSqrtDk{}, mask::QueryLength{rows}, tau,
                          [=](Index i, Index) { return i < rows; });
  }
}

TEST_CASE("the float backward keeps or recomputes a block's tiles: both within the rule", "[tiled][isa][backward]") {
  // A block keeps its logits and dP against every key while 2 x 4 bytes x lanes x n_k fit a
  // budget (fast::backwardCaches: 64 MiB, more than 65536 keys for 128 lanes), lanes its rows
  // rounded up to the lane group (16 on AVX2, 32 on AVX-512). With the budget lowered to 128
  // lanes x 600 keys, 113 rows (128 lanes on both) against 700 keys recompute them in the second
  // pass; the default kernel's blocks halve to 64 rows, which keep them. Keeping them is what
  // every other test runs. (The fast paths only: the general tiles' own recomputation is
  // test_tiled.cpp's.)
  struct Budget {
    Index before = sdpa::internal::fast::backwardCacheBytesSlot().load();
    explicit Budget(Index bytes) { sdpa::internal::fast::setBackwardCacheBytes(bytes); }
    ~Budget() { sdpa::internal::fast::setBackwardCacheBytes(before); }
    Budget(const Budget&) = delete;
    Budget& operator=(const Budget&) = delete;
  } budget(2 * 4 * 128 * 600);
  const Index nQ = 113, nK = 700, d = 3;
  REQUIRE_FALSE(sdpa::internal::fast::backwardCaches(128, nK));
  REQUIRE(sdpa::internal::fast::backwardCaches(64, nK));
  const Mat<float> q = randn<float>(nQ, d, 1, 2.0), k = randn<float>(nK, d, 2), v = randn<float>(nK, d, 3),
                   dO = randn<float>(nQ, d, 4);
  const long double tau = 1.0L / std::sqrt(3.0L);
  checkBackwardEveryIsa(
      q, k, v, dO, sdpa::scale::InvSqrtDk{}, mask::Causal{Align::LowerRight}, tau,
      [=](Index i, Index j) { return j <= i + nK - nQ; }, {kernel::Tiled{128, 128}, kernel::Tiled{}}, true);
}

TEST_CASE("the float backward: the AVX2 and AVX-512 paths give the same bits, GQA and batches included",
          "[tiled][isa][backward]") {
  // Each gradient entry is the same sum in the same order on both: the logits and dP over the
  // head's columns, dq over each tile's keys, dk and dv over the block's rows in order; the
  // same exp. GQA: the query heads of a kv head share its packed tiles and add into its dk, dv.
  // On one thread: with more, dk and dv are sums of per-thread shares whose split varies.
  if (IsaChoice::detected() < Isa::Avx512) {
    WARN("this CPU has no AVX-512: nothing to compare");
    return;
  }
  const sdpa::Heads heads{4, 2};
  const Index n = 150, d = 40;
  const Mat<float> q = randn<float>(n, 4 * d, 11), k = randn<float>(n, 2 * d, 12), v = randn<float>(n, 2 * d, 13),
                   dO = randn<float>(n, 4 * d, 14);
  const auto causal = mask::Causal{Align::LowerRight};
  const auto run = [&] {
    const auto fwd = sdpa::multiHeadAttentionForward(q, k, v, heads, sdpa::scale::InvSqrtDk{}, causal);
    return sdpa::multiHeadAttentionBackward(kernel::Tiled{}, q, k, v, fwd, dO, heads, sdpa::scale::InvSqrtDk{}, causal);
  };
  const int threads = Eigen::nbThreads();
  Eigen::setNbThreads(1);
  IsaChoice::setCap(Isa::Avx2);
  const auto a = run();
  IsaChoice::setCap(Isa::Amx);
  const auto b = run();
  Eigen::setNbThreads(threads);
  CHECK(a.dq == b.dq);
  CHECK(a.dk == b.dk);
  CHECK(a.dv == b.dv);
  CHECK(a.dscale == b.dscale);
  // A query head's dq does not depend on the heads that share its kv head: the single-head
  // call's, to the bit (on any number of threads: its rows are one unit's).
  for (Index h = 0; h < 4; ++h) {
    const Mat<float> qh = q.middleCols(h * d, d), kh = k.middleCols(h / 2 * d, d), vh = v.middleCols(h / 2 * d, d),
                     dOh = dO.middleCols(h * d, d);
    const auto f = sdpa::attentionForward(qh, kh, vh, sdpa::scale::InvSqrtDk{}, causal);
    const auto g = sdpa::attentionBackward(sdpa::kernel::Tiled{}, qh, kh, vh, f, dOh, sdpa::scale::InvSqrtDk{}, causal);
    CHECK(g.dq == b.dq.middleCols(h * d, d));
  }
}
