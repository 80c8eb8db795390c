#pragma once
// Central finite differences in double, the yardstick of every analytic gradient in the tests.

#include <Eigen/Core>

namespace sdpa_test {

/**
 * dF/dx by central differences at every entry of x (rows x cols, like x): each entry is moved
 * by +-h in place and restored. Truncation error O(h^2 f'''), rounding O(eps |f| / h).
 */
template <typename F>
Eigen::MatrixXd finiteDifferences(Eigen::MatrixXd& x, F&& f, double h = 1e-6) {
  Eigen::MatrixXd g(x.rows(), x.cols());
  for (Eigen::Index i = 0; i < x.size(); ++i) {
    const double x0 = x.data()[i];
    x.data()[i] = x0 + h;
    const double up = f();
    x.data()[i] = x0 - h;
    const double down = f();
    x.data()[i] = x0;
    g.data()[i] = (up - down) / (2 * h);
  }
  return g;
}

}  // namespace sdpa_test
