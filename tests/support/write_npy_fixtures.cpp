// Writes q.npy and k.npy for the sdpa_check command-line tests: 2 heads of d_k = 64 (3-D
// (H, n, d) for q, packed 2-D for k), 128 positions, N(0, 1) entries.
#include <fstream>
#include <random>

#include "../../tools/npy.hpp"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  std::mt19937_64 gen(64);
  std::normal_distribution<double> dist;
  std::vector<double> q(2 * 128 * 64), k(128 * 128);
  for (double& x : q) x = dist(gen);
  for (double& x : k) x = dist(gen);
  std::ofstream(dir + "/q.npy", std::ios::binary) << sdpa_tools::npyBytes({2, 128, 64}, q);
  std::ofstream(dir + "/k.npy", std::ios::binary) << sdpa_tools::npyBytes({128, 128}, k);
  std::ofstream(dir + "/bad.npy", std::ios::binary) << "not a numpy file";
  return 0;
}
