// One head over a long sequence with the tiled kernel, whose memory does not grow with n^2:
// the naive kernel would hold an n x n float matrix (16 GiB at n = 65536). Prints the time and
// the bytes of the inputs and output, to compare with the peak resident memory:
//
//   /usr/bin/time -v build/release/examples/long_sequence 65536 64   # "Maximum resident set size"
//
// Arguments: n (= n_q = n_k, default 65536), d (= d_k = d_v, default 64); a causal mask with
// "causal" as third argument.
#include <sdpa/sdpa.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

static int run(int argc, char** argv) {
  const Eigen::Index n = argc > 1 ? std::atol(argv[1]) : 65536, d = argc > 2 ? std::atol(argv[2]) : 64;
  const bool causal = argc > 3 && std::string(argv[3]) == "causal";
  if (n < 1 || d < 1) {
    std::fprintf(stderr, "usage: long_sequence [n] [d] [causal]\n");
    return 2;
  }
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(n, d), k = Eigen::MatrixXf::Random(n, d),
                        v = Eigen::MatrixXf::Random(n, d);
  const auto start = std::chrono::steady_clock::now();
  const auto fwd = causal
                       ? sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{},
                                                sdpa::mask::combine(sdpa::mask::Causal{sdpa::mask::Align::UpperLeft}))
                       : sdpa::attentionForward(q, k, v);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double mib = 1.0 / (1 << 20);
  const double inputs = 3.0 * double(n) * double(d) * sizeof(float) * mib;
  const double output = (double(n) * double(d) + double(n)) * sizeof(float) * mib;
  std::printf("n = %ld, d = %ld%s: %.3f s, %.1f GFLOP/s on %d thread(s)\n", long(n), long(d), causal ? ", causal" : "",
              seconds, 4.0 * double(n) * double(n) * double(d) / seconds * 1e-9 / (causal ? 2 : 1), Eigen::nbThreads());
  std::printf("inputs %.1f MiB + output and logSumExp %.1f MiB = %.1f MiB; an n x n float matrix would be %.1f MiB\n",
              inputs, output, inputs + output, double(n) * double(n) * sizeof(float) * mib);
  std::printf("output checksum %.6f, all finite: %s\n", double(fwd.output.sum()),
              fwd.output.allFinite() ? "yes" : "no");
  return fwd.output.allFinite() ? 0 : 1;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
