// Multi-head attention as a model uses it: a packed batch of two sequences of different lengths,
// 8 query heads sharing 2 key/value heads (GQA), causal + sliding window + ALiBi + softcap, and
// why every head is scaled by its own d_k rather than d_model (seed C16).
//
//   cmake --preset dev && cmake --build --preset dev && build/dev/examples/multi_head
#include <sdpa/sdpa.hpp>

#include <cmath>
#include <cstdio>
#include <exception>
#include <random>

namespace {

Eigen::MatrixXf randn(Eigen::Index rows, Eigen::Index cols, std::mt19937_64& gen) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Eigen::MatrixXf m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = dist(gen);
  return m;
}

/// Mean row entropy of a head's attention, as a fraction of log(keys seen): 1 = uniform.
template <typename Scale, typename Mask>
double meanEntropyFraction(const Eigen::MatrixXf& q, const Eigen::MatrixXf& k, const Scale& scale, const Mask& mask) {
  const Eigen::MatrixXf p = sdpa::attentionWeights(q, k, scale, mask);
  double sum = 0;
  int rows = 0;
  for (Eigen::Index i = 0; i < p.rows(); ++i) {
    const Eigen::Index seen = (p.row(i).array() > 0).count();
    if (seen < 2) continue;  // a row that sees one key has entropy 0 whatever the scale
    sum += sdpa::softmaxEntropy(Eigen::RowVectorXf(p.row(i))) / std::log(double(seen));
    ++rows;
  }
  return rows ? sum / rows : 0.0;
}

}  // namespace

static int run() {
  std::mt19937_64 gen(7);
  constexpr Eigen::Index H = 8, hKv = 2, dK = 16, dV = 16, dModel = H * dK;

  // Two sequences packed row-wise (FlashAttention's varlen layout): 5 and 12 tokens.
  const std::vector<Eigen::Index> cuSeqlens = {0, 5, 17};
  const Eigen::MatrixXf q = randn(17, H * dK, gen);    // 17 x 128: 8 query heads
  const Eigen::MatrixXf k = randn(17, hKv * dK, gen);  // 17 x 32: 2 kv heads (GQA, 4 query heads each)
  const Eigen::MatrixXf v = randn(17, hKv * dV, gen);
  const auto layout = sdpa::BatchLayout::varlen(cuSeqlens, cuSeqlens);
  const sdpa::Heads heads{H, hKv};

  using sdpa::mask::Align;
  const auto mask = sdpa::mask::combine(sdpa::mask::Causal{Align::LowerRight},               // decoder
                                        sdpa::mask::SlidingWindow{4, 0, Align::LowerRight},  // last 5 keys
                                        sdpa::mask::Alibi::standard(H, Align::LowerRight),   // position bias
                                        sdpa::mask::Softcap{50.0});                          // Gemma 2 style
  const auto fwd = sdpa::batchedAttentionForward(q, k, v, layout, heads, sdpa::scale::InvSqrtDk{}, mask);
  std::printf("batched GQA forward: q %ldx%ld, k %ldx%ld -> output %ldx%ld, logSumExp %ldx%ld\n", long(q.rows()),
              long(q.cols()), long(k.rows()), long(k.cols()), long(fwd.output.rows()), long(fwd.output.cols()),
              long(fwd.logSumExp.rows()), long(fwd.logSumExp.cols()));
  std::printf("ALiBi slopes for %ld heads:", long(H));
  for (const double m : sdpa::mask::alibiSlopes(H)) std::printf(" %.5g", m);
  std::printf("\n\n");

  // Seed C16: each head divides by sqrt(its own d_k) = 4, not sqrt(d_model) = 11.3.
  const Eigen::MatrixXf qLong = randn(256, H * dK, gen), kLong = randn(256, H * dK, gen);
  const sdpa::mask::Causal causal{Align::UpperLeft};
  std::printf("head  logit std (1/sqrt(d_k))  (1/sqrt(d_model))  entropy/log(n) (d_k)  (d_model)\n");
  for (Eigen::Index h = 0; h < H; h += 3) {
    const Eigen::MatrixXf qh = qLong.middleCols(h * dK, dK), kh = kLong.middleCols(h * dK, dK);
    const sdpa::scale::Constant perModel{1.0 / std::sqrt(double(dModel))};
    const auto logitStd = [&](const auto& scale) {
      const Eigen::MatrixXf s = sdpa::attentionLogits(qh, kh, scale);
      return std::sqrt((s.array() - s.mean()).square().mean());
    };
    std::printf("%4ld  %24.3f  %17.3f  %20.3f  %9.3f\n", long(h), logitStd(sdpa::scale::InvSqrtDk{}),
                logitStd(perModel), meanEntropyFraction(qh, kh, sdpa::scale::InvSqrtDk{}, causal),
                meanEntropyFraction(qh, kh, perModel, causal));
  }
  std::printf(
      "\nDividing by sqrt(d_model) shrinks every head's logits by sqrt(H) = %.2f: std %.2f instead of 1,\n"
      "and the attention drifts towards uniform.\n",
      std::sqrt(double(H)), 1.0 / std::sqrt(double(H)));
  return 0;
}

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
