// Fits a learnable softmax temperature with sdpa's backward pass: a teacher attends with a known
// tau* = 1 / (2 sqrt(d_k)) (temperature T = 2 sqrt(d_k), seed C10); a student with a
// scale::Learnable starts at 1/sqrt(d_k) (the library's default, seed C17) or at 1 (unscaled)
// and follows plain gradient descent on the mean squared difference of the outputs.
//
//   cmake --preset dev && cmake --build --preset dev && build/dev/examples/learn_temperature
#include <sdpa/sdpa.hpp>

#include <cmath>
#include <cstdio>
#include <exception>
#include <random>

namespace {

Eigen::MatrixXd randn(Eigen::Index rows, Eigen::Index cols, std::mt19937_64& gen) {
  std::normal_distribution<double> dist(0.0, 1.0);
  Eigen::MatrixXd m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = dist(gen);
  return m;
}

}  // namespace

static int run() {
  constexpr Eigen::Index dK = 64, nQ = 32, nK = 64, dV = 8, steps = 200;
  constexpr double learningRate = 0.05;
  std::mt19937_64 gen(17);
  const Eigen::MatrixXd q = randn(nQ, dK, gen), k = randn(nK, dK, gen), v = randn(nK, dV, gen);
  const double tauStar = 1.0 / (2.0 * std::sqrt(double(dK)));
  const sdpa::mask::Causal causal{sdpa::mask::Align::LowerRight};
  const Eigen::MatrixXd target = sdpa::attention(q, k, v, sdpa::scale::Constant{tauStar}, causal);
  std::printf("teacher tau* = %.6f (T = 2 sqrt(d_k) = %.1f), d_k = %ld, %ld queries x %ld keys, causal\n\n", tauStar,
              2.0 * std::sqrt(double(dK)), long(dK), long(nQ), long(nK));

  sdpa::scale::Learnable<double> fromDefault;   // starts at 1/sqrt(d_k)
  sdpa::scale::Learnable<double> fromOne{1.0};  // the unscaled start the seed warns about
  std::printf("%5s  %12s %12s %12s   %12s %12s %12s\n", "step", "tau", "loss", "dL/dtau", "tau", "loss", "dL/dtau");
  std::printf("%5s  %38s   %38s\n", "", "---- start 1/sqrt(d_k) = 0.125 -----", "------------ start 1 ------------");
  for (Eigen::Index step = 0; step <= steps; ++step) {
    double loss[2], grad[2], value[2];
    int i = 0;
    for (sdpa::scale::Learnable<double>* tau : {&fromDefault, &fromOne}) {
      value[i] = tau->value(dK);
      const auto fwd = sdpa::attentionForward(q, k, v, *tau, causal);
      const Eigen::MatrixXd diff = fwd.output - target;
      loss[i] = diff.squaredNorm() / double(diff.size());
      tau->zeroGrad();
      sdpa::attentionBackward(q, k, v, fwd, 2.0 * diff / double(diff.size()), *tau, causal);  // accumulates
      grad[i] = tau->grad();
      tau->setValue(value[i] - learningRate * grad[i]);
      ++i;
    }
    if (step % 20 == 0 || step < 5)
      std::printf("%5ld  %12.6f %12.3e %12.3e   %12.6f %12.3e %12.3e\n", long(step), value[0], loss[0], grad[0],
                  value[1], loss[1], grad[1]);
  }
  std::printf("\nfinal: %.6f from 1/sqrt(d_k), %.6f from 1 (target %.6f)\n", fromDefault.value(), fromOne.value(),
              tauStar);
  return 0;
}

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
