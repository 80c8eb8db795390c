#include <sdpa/sdpa.hpp>
int main() {
  const Eigen::MatrixXf q = Eigen::MatrixXf::Ones(2, 3);
  return int(sdpa::attention(q, q, q, 0.125f).sum());  // a bare float is not a scale policy
}
