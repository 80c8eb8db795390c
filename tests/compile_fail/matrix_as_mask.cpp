#include <sdpa/sdpa.hpp>
int main() {
  const Eigen::MatrixXf q = Eigen::MatrixXf::Ones(2, 3);
  const Eigen::MatrixXf bias = Eigen::MatrixXf::Zero(2, 2);
  return int(sdpa::attention(q, q, q, sdpa::scale::InvSqrtDk{}, bias).sum());  // wrap it in mask::Bias
}
