// Scale policies: their tau, the Learnable parameter, and tau as a temperature (seed C7, C10, C17).
#include <sdpa/sdpa.hpp>

#include <cmath>
#include <stdexcept>

#include "support/cases.hpp"

using namespace sdpa_test;
namespace scale = sdpa::scale;

static_assert(scale::IsPolicy<scale::InvSqrtDk> && scale::IsPolicy<scale::None> && scale::IsPolicy<scale::Constant> &&
              scale::IsPolicy<scale::Temperature> && scale::IsPolicy<scale::Learnable<float>>);
static_assert(!scale::IsPolicy<float> && !scale::IsPolicy<sdpa::mask::None>);
static_assert(sdpa::mask::IsMask<sdpa::mask::Causal> && !sdpa::mask::IsMask<scale::None>);
static_assert(scale::None::IsIdentity && !scale::InvSqrtDk::IsIdentity && scale::Learnable<double>::IsLearnable);

TEST_CASE("each policy's tau", "[scale]") {
  CHECK(scale::InvSqrtDk{}.value<double>(64) == 0.125);
  CHECK(scale::InvSqrtDk{}.value<float>(16) == 0.25f);
  CHECK(scale::InvSqrtDk{}.value<double>(0) == 1.0);  // d_k = 0: logits are 0, keep them finite
  CHECK(scale::None{}.value<double>(64) == 1.0);
  CHECK(scale::Constant{0.3}.value<double>(64) == 0.3);
  CHECK(scale::Constant{-2.0}.value<float>(1) == -2.0f);
  CHECK(scale::Temperature{4.0}.value<double>(7) == 0.25);
  CHECK(scale::Temperature{std::sqrt(64.0)}.value<double>(64) == scale::InvSqrtDk{}.value<double>(64));  // C10
}

TEST_CASE("invalid policy values are rejected at construction", "[scale][errors]") {
  CHECK_THROWS_AS(scale::Constant{std::nan("")}, std::invalid_argument);
  CHECK_THROWS_AS(scale::Constant{INFINITY}, std::invalid_argument);
  CHECK_THROWS_AS(scale::Temperature{0.0}, std::invalid_argument);
  CHECK_THROWS_AS(scale::Temperature{-1.0}, std::invalid_argument);
  CHECK_THROWS_AS(scale::Temperature{INFINITY}, std::invalid_argument);
  CHECK_THROWS_AS(scale::Learnable<float>{NAN}, std::invalid_argument);
  CHECK_THROWS_WITH(scale::Temperature{0.0}, Catch::Matchers::Contains("finite and > 0"));
}

TEMPLATE_TEST_CASE("Learnable starts at 1/sqrt(d_k) and accumulates its gradient  [seed C17]", "[scale][learnable]",
                   float, double) {
  using T = TestType;
  scale::Learnable<T> tau;
  CHECK_FALSE(tau.hasValue());
  CHECK(tau.template value<T>(64) == T(0.125));
  CHECK(tau.template value<T>(16) == T(0.25));
  CHECK_THROWS_AS(tau.value(), std::logic_error);
  CHECK(scale::Learnable<T>::forHeadDim(16).value() == T(0.25));
  CHECK(scale::Learnable<T>{T(1)}.template value<T>(64) == T(1));  // the start the seed warns about

  CHECK(tau.grad() == 0);
  tau.accumulateGrad(T(0.5));
  tau.accumulateGrad(T(-0.25));
  CHECK(tau.grad() == T(0.25));
  tau.setValue(tau.template value<T>(64) - T(0.1) * tau.grad());  // one SGD step
  CHECK(tau.hasValue());
  CHECK(tau.value() == T(0.125) - T(0.1) * T(0.25));
  tau.zeroGrad();
  CHECK(tau.grad() == 0);
  // A Learnable computes exactly what the Constant of its value does.
  const Mat<T> q = randn<T>(3, 64, 1), k = randn<T>(4, 64, 2), v = randn<T>(4, 2, 3);
  CHECK(sdpa::attention(q, k, v, scale::Learnable<T>{}) == sdpa::attention(q, k, v, scale::InvSqrtDk{}));
  CHECK(sdpa::attention(q, k, v, tau) == sdpa::attention(q, k, v, scale::Constant{double(tau.value())}));
}

TEMPLATE_TEST_CASE("tau multiplies q k^T; the mask is added after it and never scaled", "[scale]", float, double) {
  using T = TestType;
  const Mat<T> q = randn<T>(4, 9, 1), k = randn<T>(5, 9, 2);
  const Mat<T> bias = randn<T>(4, 5, 3);
  const Mat<T> raw = q * k.transpose();
  for (const double c : {0.1, 1.0, 3.0}) {
    const Mat<T> s = sdpa::attentionLogits(q, k, scale::Constant{c}, sdpa::mask::Bias{bias});
    const Mat<T> expected = T(c) * raw + bias;
    CHECK(maxAbsDiff(s, expected) <= 8 * std::numeric_limits<T>::epsilon() * (1 + expected.cwiseAbs().maxCoeff()));
  }
}

TEST_CASE("a higher temperature flattens the attention, a lower one sharpens it  [seed C10]", "[scale][seed]") {
  const Mat<double> q = randn<double>(32, 64, 1), k = randn<double>(128, 64, 2);
  double previous = -1;
  for (const double t : {0.5, 1.0, 2.0, 8.0, 32.0, 1e6}) {
    const Mat<double> p = sdpa::attentionWeights(q, k, scale::Temperature{t});
    double h = 0;
    for (Index i = 0; i < p.rows(); ++i) h += sdpa::softmaxEntropy(Eigen::RowVectorXd(p.row(i)));
    h /= double(p.rows());
    INFO("T = " << t << ": mean entropy " << h);
    CHECK(h > previous);
    previous = h;
  }
  CHECK(std::abs(previous - std::log(128.0)) < 1e-6);  // T -> inf: uniform over 128 keys
}
