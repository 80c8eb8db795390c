// Softmax, logSumExp, the softmax Jacobian and its vector-Jacobian product (seed C2, C4, C5, C13).
#include <sdpa/sdpa.hpp>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "support/cases.hpp"

using namespace sdpa_test;

TEST_CASE("softmax of [0,1,2] and [0,10,20] equals the article's figures  [seed C2]", "[softmax][seed]") {
  const Eigen::Vector3d p1 = sdpa::softmax(Eigen::Vector3d(0, 1, 2));
  const Eigen::Vector3d p2 = sdpa::softmax(Eigen::Vector3d(0, 10, 20));
  // Exact values: e^x_i / sum_j e^x_j.
  const double z1 = 1 + std::exp(1.0) + std::exp(2.0), z2 = 1 + std::exp(10.0) + std::exp(20.0);
  CHECK(std::abs(p1(0) - 1 / z1) <= 1e-16);
  CHECK(std::abs(p1(2) - std::exp(2.0) / z1) <= 2e-16);
  CHECK(std::abs(p2(0) - 1 / z2) <= 1e-24);
  // The figures of CLAIMS.md, to the digits printed there.
  CHECK(std::abs(p1(0) - 0.0900) < 0.5e-4);
  CHECK(std::abs(p1(1) - 0.2447) < 0.5e-4);
  CHECK(std::abs(p1(2) - 0.6652) < 0.5e-4);
  CHECK(std::abs(p2(0) - 2.06e-9) < 0.005e-9);
  CHECK(std::abs(p2(1) - 4.54e-5) < 0.005e-5);
  CHECK(std::abs(p2(2) - 0.99995) < 0.5e-5);
  // Scaling the input up turns a soft distribution into a near one-hot one.
  CHECK(sdpa::softmaxEntropy(p2) < 0.001);
  CHECK(sdpa::softmaxEntropy(p1) > 0.8);
  CHECK(p2.maxCoeff() > 0.9999);
}

TEST_CASE("exp(+-24) at 3 sigma of d_k = 64 logits  [seed C4]", "[softmax][seed]") {
  CHECK(std::abs(std::exp(24.0) / 2.65e10 - 1) < 0.005 / 2.65);
  CHECK(std::abs(std::exp(-24.0) / 3.78e-11 - 1) < 0.005 / 3.78);
  // One key 24 above the rest among 255 others at 0 takes almost all the weight.
  Eigen::VectorXd x = Eigen::VectorXd::Zero(256);
  x(0) = 24;
  CHECK(sdpa::softmax(x)(0) > 1 - 1e-8);
}

TEST_CASE("fp32 exp overflows above 88.72, fp16 above 11.09; the library's softmax does not  [seed C13]",
          "[softmax][seed]") {
  CHECK(std::isfinite(std::exp(88.72f)));
  CHECK(std::isinf(std::exp(88.73f)));
  CHECK(std::abs(std::log(FLT_MAX) - 88.7228) < 1e-4);
  CHECK(std::abs(std::log(65504.0) - 11.0898) < 1e-4);  // largest finite fp16

  const Eigen::VectorXf x = (Eigen::VectorXf(5) << 1e4f, 0.f, -1e4f, 88.8f, 1e4f - 1.f).finished();
  const Eigen::VectorXf p = sdpa::softmax(x);
  CHECK(p.allFinite());
  CHECK(std::abs(p.sum() - 1.f) <= 2 * FLT_EPSILON);
  CHECK(std::abs(p(0) - 1.f / (1.f + std::exp(-1.f))) <= 4 * FLT_EPSILON);
  CHECK(p(1) == 0.f);
  const float lse = sdpa::logSumExp(Eigen::Vector2f(1e4f, 1e4f));
  CHECK(std::abs(lse - (1e4f + std::log(2.f))) <= 1e4f * FLT_EPSILON);
}

TEMPLATE_TEST_CASE("softmax edge cases: all -inf, NaN, empty, one entry", "[softmax][edge]", float, double) {
  using T = TestType;
  constexpr T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  const Vec<T> masked = Vec<T>::Constant(4, -inf);
  CHECK(sdpa::softmax(masked) == Vec<T>::Zero(4));
  CHECK(sdpa::logSumExp(masked) == -inf);
  CHECK(sdpa::logSumExp(Vec<T>(0)) == -inf);
  CHECK(sdpa::softmax(Vec<T>(0)).size() == 0);
  const Vec<T> withNan = (Vec<T>(3) << 1, nan, 2).finished();
  CHECK(sdpa::softmax(withNan).array().isNaN().all());
  CHECK(std::isnan(sdpa::logSumExp(withNan)));
  CHECK(sdpa::softmax(Vec<T>::Constant(1, T(-3))) == Vec<T>::Ones(1));
  CHECK(sdpa::softmax((Vec<T>(3) << -inf, 1, -inf).finished()) == (Vec<T>(3) << 0, 1, 0).finished());
  // Row vectors keep their orientation.
  const Eigen::Matrix<T, 1, Eigen::Dynamic> row = Eigen::Matrix<T, 1, Eigen::Dynamic>::LinSpaced(5, 0, 1);
  CHECK(sdpa::softmax(row).rows() == 1);
}

TEMPLATE_TEST_CASE("softmax and logSumExp agree with the long-double reference", "[softmax]", float, double) {
  using T = TestType;
  for (const Index n : {1, 7, 16, 1000}) {
    const Vec<T> x = randn<T>(n, 1, 42 + std::uint64_t(n), 5.0);
    long double m = -INFINITY, s = 0;
    for (Index i = 0; i < n; ++i) m = std::max<long double>(m, x(i));
    for (Index i = 0; i < n; ++i) s += std::exp((long double)x(i) - m);
    const Vec<T> p = sdpa::softmax(x);
    double err = 0;
    for (Index i = 0; i < n; ++i) err = std::max<double>(err, std::abs(p(i) - std::exp((long double)x(i) - m) / s));
    INFO("n = " << n << " error " << err);
    // exp of a max-subtracted logit and a normalised sum: a few ulps of 1, plus n ulps of summation.
    CHECK(err <= (8 + 2 * double(n)) * std::numeric_limits<T>::epsilon());
    CHECK(std::abs(sdpa::logSumExp(x) - (m + std::log(s))) <=
          8 * std::numeric_limits<T>::epsilon() * (1 + std::abs(m)));
  }
  const Mat<T> xs = randn<T>(6, 9, 3);
  const Mat<T> ps = sdpa::rowSoftmax(xs);
  const Vec<T> lses = sdpa::rowLogSumExp(xs);
  // Same computation on differently aligned storage: equal up to the vectorised exp's last bit.
  for (Index i = 0; i < 6; ++i) {
    const Eigen::Matrix<T, 1, Eigen::Dynamic> row = xs.row(i);
    CHECK(maxAbsDiff(ps.row(i), sdpa::softmax(row)) <= 2 * std::numeric_limits<T>::epsilon());
    CHECK(std::abs(lses(i) - sdpa::logSumExp(row)) <= 4 * std::numeric_limits<T>::epsilon() * (1 + std::abs(lses(i))));
  }
}

TEST_CASE("softmax Jacobian is p_j (delta_ij - p_i) and equals central finite differences  [seed C5]",
          "[softmax][jacobian][seed]") {
  const Eigen::VectorXd x = randn<double>(7, 1, 5, 2.0);
  const Eigen::VectorXd p = sdpa::softmax(x);
  const Eigen::MatrixXd jac = sdpa::softmaxJacobian(p);
  REQUIRE(jac.rows() == 7);
  REQUIRE(jac.cols() == 7);
  for (Index i = 0; i < 7; ++i)
    for (Index j = 0; j < 7; ++j) CHECK(std::abs(jac(i, j) - p(j) * ((i == j ? 1.0 : 0.0) - p(i))) <= 2 * DBL_EPSILON);
  CHECK(jac == jac.transpose());
  CHECK(jac.rowwise().sum().cwiseAbs().maxCoeff() <= 4 * DBL_EPSILON);  // sum_i p_i = 1 is invariant

  // Central differences, h = 1e-5: truncation O(h^2) ~ 1e-10, rounding O(eps / h) ~ 1e-11.
  const double h = 1e-5;
  for (Index j = 0; j < 7; ++j) {
    Eigen::VectorXd xp = x, xm = x;
    xp(j) += h;
    xm(j) -= h;
    const Eigen::VectorXd fd = (sdpa::softmax(xp) - sdpa::softmax(xm)) / (2 * h);
    INFO("column " << j);
    CHECK((fd - jac.col(j)).cwiseAbs().maxCoeff() <= 1e-9);
  }
}

TEMPLATE_TEST_CASE("softmaxJacobianVjp equals J^T g in O(n)", "[softmax][jacobian]", float, double) {
  using T = TestType;
  const Vec<T> p = sdpa::softmax(Vec<T>(randn<T>(11, 1, 8)));
  const Vec<T> g = randn<T>(11, 1, 9);
  const Vec<T> viaJ = sdpa::softmaxJacobian(p).transpose() * g;
  const Vec<T> vjp = sdpa::softmaxJacobianVjp(p, g);
  CHECK(maxAbsDiff(vjp, viaJ) <= 16 * std::numeric_limits<T>::epsilon() * (1 + g.cwiseAbs().maxCoeff()));
  // Row-vector inputs give a row vector.
  const Eigen::Matrix<T, 1, Eigen::Dynamic> pr = p.transpose(), gr = g.transpose();
  CHECK(sdpa::softmaxJacobianVjp(pr, gr).rows() == 1);
  CHECK(maxAbsDiff(sdpa::softmaxJacobianVjp(pr, gr).transpose(), vjp) == 0);
}

TEST_CASE("Jacobian norm and entropy: closed forms and the saturated limit  [seed C5, C18]",
          "[softmax][jacobian][seed]") {
  const Eigen::VectorXd p = sdpa::softmax(Eigen::VectorXd(randn<double>(50, 1, 10, 3.0)));
  CHECK(std::abs(sdpa::softmaxJacobianNorm(p) - sdpa::softmaxJacobian(p).norm()) <= 1e-15);
  for (const Index n : {1, 2, 10, 256}) {
    const Eigen::VectorXd uniform = Eigen::VectorXd::Constant(n, 1.0 / double(n));
    CHECK(std::abs(sdpa::softmaxEntropy(uniform) - std::log(double(n))) <= 1e-13);
    CHECK(std::abs(sdpa::softmaxJacobianNorm(uniform) - std::sqrt(1.0 / n - 1.0 / (double(n) * n))) <= 1e-15);
  }
  Eigen::VectorXd oneHot = Eigen::VectorXd::Zero(8);
  oneHot(3) = 1;
  CHECK(sdpa::softmaxEntropy(oneHot) == 0);
  CHECK(sdpa::softmaxJacobianNorm(oneHot) == 0);
  CHECK(sdpa::softmaxJacobian(oneHot).isZero(0));
  // Sharpening the logits first raises the norm (leaving uniform, two keys can share the weight)
  // and then, once one key dominates, drives it to 0: the vanishing gradient of C5.
  const Eigen::VectorXd x = randn<double>(64, 1, 11);
  double previous = INFINITY;
  bool dominated = false;
  for (double scale = 1; scale <= 1 << 16; scale *= 2) {
    const Eigen::VectorXd p = sdpa::softmax(Eigen::VectorXd(scale * x));
    const double norm = sdpa::softmaxJacobianNorm(p);
    INFO("logit scale " << scale << ": max p " << p.maxCoeff() << ", Jacobian norm " << norm);
    if (dominated) CHECK((norm < previous || norm == 0));
    dominated = dominated || p.maxCoeff() > 0.9;
    previous = norm;
  }
  CHECK(dominated);
  CHECK(previous < 1e-12);
}

TEST_CASE("softmaxJacobianNorm stays accurate for nearly one-hot p", "[softmax][jacobian]") {
  // The closed form sum p^2 - 2 sum p^3 + (sum p^2)^2 cancels to rounding noise here.
  for (const double gap : {5.0, 15.0, 30.0, 60.0}) {
    Eigen::VectorXd x = Eigen::VectorXd::Zero(20);
    x(7) = gap;
    const Eigen::VectorXd p = sdpa::softmax(x);
    // Reference: the Jacobian of the exact softmax of x, entry by entry in long double, with
    // 1 - p_m written as the sum of the other entries (as 1 - p_m itself would cancel too).
    std::vector<long double> pl(20);
    const long double z = 19 + std::exp((long double)gap);
    for (Index i = 0; i < 20; ++i) pl[size_t(i)] = std::exp((long double)x(i)) / z;
    long double direct = 0;
    for (Index i = 0; i < 20; ++i)
      for (Index j = 0; j < 20; ++j) {
        const long double e =
            i == j ? pl[size_t(i)] * (i == 7 ? 19 / z : 1 - pl[size_t(i)]) : -pl[size_t(i)] * pl[size_t(j)];
        direct += e * e;
      }
    INFO("gap " << gap << ": direct " << double(std::sqrt(direct)) << ", library " << sdpa::softmaxJacobianNorm(p));
    CHECK(std::abs(sdpa::softmaxJacobianNorm(p) / double(std::sqrt(direct)) - 1) <= 1e-13);
  }
}

TEST_CASE("the softcap's float tanh is within 1.5 ulp of tanh", "[softmax][softcap]") {
  // Every 997th float in [0, 20] (about 1.3 10^6 values, both signs), against tanh in double
  // rounded once: NUMERICS.md states 1.4 ulp, measured over every float in [-20, 20].
  const auto ulps = [](float got, double exact) {
    const float e = float(exact);
    const double ulp = double(std::nextafter(std::fabs(e), INFINITY)) - double(std::fabs(e));
    return std::fabs(double(got) - exact) / ulp;
  };
  std::vector<float> x;
  for (std::uint32_t bits = 0;; bits += 997) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    if (!(f <= 20.0f)) break;
    x.push_back(f);
    x.push_back(-f);
  }
  std::vector<float> y = x;
  sdpa::internal::tanhInPlace(y.data(), Index(y.size()), 1.0f, 1.0f);
  double worst = 0;
  float at = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double e = ulps(y[i], std::tanh(double(x[i])));
    if (e > worst) worst = e, at = x[i];
  }
  INFO("worst " << worst << " ulp at " << at << " over " << x.size() << " values");
  CHECK(worst <= 1.5);
  // One value at a time (the scalar paths) is bitwise the packet path.
  for (const size_t i : {size_t(1), size_t(17), x.size() / 3, x.size() - 1})
    CHECK(sdpa::internal::tanhAccurate(x[i]) == y[i]);
  // Special values: tanh(+-inf) = +-1, NaN stays NaN, and a softcap bounds every logit by c.
  float s[] = {INFINITY, -INFINITY, NAN, 1e30f, -1e30f, 0.0f};
  sdpa::internal::softcapInPlace(s, 6, 30.0f);
  CHECK(s[0] == 30.0f);
  CHECK(s[1] == -30.0f);
  CHECK(std::isnan(s[2]));
  CHECK(s[3] == 30.0f);
  CHECK(s[4] == -30.0f);
  CHECK(s[5] == 0.0f);
}
