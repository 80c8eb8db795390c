// diagnose reports one tau per head; a key-count-dependent scale must be refused at compile time.
#include <sdpa/sdpa.hpp>

int main() {
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(4, 8), k = Eigen::MatrixXf::Random(6, 8);
  return int(sdpa::diagnose(q, k, sdpa::scale::LogN{}).heads.size());
}
