#include <sdpa/sdpa.hpp>
int main() {
  const Eigen::MatrixXf q = Eigen::MatrixXf::Ones(2, 3);
  const Eigen::MatrixXd k = Eigen::MatrixXd::Ones(2, 3);
  return int(sdpa::attention(q, k, k).sum());
}
