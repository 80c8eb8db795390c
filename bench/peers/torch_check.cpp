// bench/peers/torch_check.py's driver: reads q, k, v, dO (and a mask) as .npy (rows are
// positions, heads side by side), runs sdpa's multi-head forward and backward in float with the
// default kernel, writes out, dq, dk, dv as .npy into the same directory.
//   torch_check DIR H H_KV none|causal-ul|causal-lr|bool|float TAU   (TAU 0: 1/sqrt(d_k))
#include <sdpa/npy.hpp>
#include <sdpa/sdpa.hpp>
#include <string>
using Eigen::MatrixXf;
static MatrixXf rd(const std::string& p) { return sdpa::npy::matrix(sdpa::npy::read(p)).cast<float>(); }
static void wr(const std::string& p, const MatrixXf& m) {
  std::vector<double> d(size_t(m.size()));
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j) d[size_t(i * m.cols() + j)] = m(i, j);
  sdpa::npy::write(p, {m.rows(), m.cols()}, d);
}
template <typename Mask>
void run(const std::string& dir, sdpa::Heads heads, float tau, const Mask& mask) {
  MatrixXf q = rd(dir + "/q.npy"), k = rd(dir + "/k.npy"), v = rd(dir + "/v.npy"), dO = rd(dir + "/dO.npy");
  auto go = [&](auto scale) {
    auto f = sdpa::multiHeadAttentionForward(q, k, v, heads, scale, mask);
    auto g = sdpa::multiHeadAttentionBackward(q, k, v, f, dO, heads, scale, mask);
    wr(dir + "/out.npy", f.output);
    wr(dir + "/dq.npy", g.dq);
    wr(dir + "/dk.npy", g.dk);
    wr(dir + "/dv.npy", g.dv);
  };
  if (tau > 0)
    go(sdpa::scale::Constant{tau});
  else
    go(sdpa::scale::InvSqrtDk{});
}
int main(int argc, char** argv) {
  const std::string dir = argv[1], mask = argv[4];
  const sdpa::Heads heads{std::stol(argv[2]), std::stol(argv[3])};
  const float tau = std::stof(argv[5]);
  using namespace sdpa::mask;
  if (mask == "none")
    run(dir, heads, tau, None{});
  else if (mask == "causal-ul")
    run(dir, heads, tau, Causal{Align::UpperLeft});
  else if (mask == "causal-lr")
    run(dir, heads, tau, Causal{Align::LowerRight});
  else if (mask == "bool") {
    Eigen::Matrix<bool, -1, -1> m = (rd(dir + "/mask.npy").array() > 0.5f);
    run(dir, heads, tau, Keep{m});
  } else if (mask == "float") {
    MatrixXf b = rd(dir + "/mask.npy");
    run(dir, heads, tau, Bias{b});
  } else
    return 2;
}
