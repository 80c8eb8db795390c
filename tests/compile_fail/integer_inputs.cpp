#include <sdpa/sdpa.hpp>
int main() {
  const Eigen::MatrixXi q = Eigen::MatrixXi::Ones(2, 3);
  return int(sdpa::attention(q, q, q).sum());
}
