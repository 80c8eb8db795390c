#include <sdpa/sdpa.hpp>

#include <cstdio>

int main() {
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(4, 16), k = Eigen::MatrixXf::Random(6, 16),
                        v = Eigen::MatrixXf::Random(6, 8);
  const Eigen::MatrixXf o = sdpa::scaledDotProductAttention(q, k, v, sdpa::mask::Causal{sdpa::mask::Align::LowerRight});
  std::printf("sdpa %d consumer: output %ldx%ld\n", SDPA_VERSION, long(o.rows()), long(o.cols()));
  return (o.rows() == 4 && o.cols() == 8 && o.allFinite()) ? 0 : 1;
}
