// Writes q.npy and k.npy for the sdpa_check command-line tests: 2 heads of d_k = 64 (3-D
// (H, n, d) for q, packed 2-D for k), 128 positions, N(0, 1) entries; q_short.npy: q's first 32
// positions, packed 2-D (32, 2 x 64), for causal alignment with fewer queries than keys.
#include <fstream>
#include <random>

#include <sdpa/npy.hpp>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  std::mt19937_64 gen(64);
  std::normal_distribution<double> dist;
  std::vector<double> q(2 * 128 * 64), k(128 * 128);
  for (double& x : q) x = dist(gen);
  for (double& x : k) x = dist(gen);
  std::ofstream(dir + "/q.npy", std::ios::binary) << sdpa::npy::bytes({2, 128, 64}, q);
  std::ofstream(dir + "/k.npy", std::ios::binary) << sdpa::npy::bytes({128, 128}, k);
  std::vector<double> qShort(32 * 128);
  for (int i = 0; i < 32; ++i)
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 64; ++c) qShort[size_t(i * 128 + h * 64 + c)] = q[size_t(h * 128 * 64 + i * 64 + c)];
  std::ofstream(dir + "/q_short.npy", std::ios::binary) << sdpa::npy::bytes({32, 128}, qShort);
  std::ofstream(dir + "/bad.npy", std::ios::binary) << "not a numpy file";
  return 0;
}
