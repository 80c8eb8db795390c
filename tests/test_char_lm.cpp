// Gradient checks of the experiment's layers (experiments/char_lm, seed C11): each backward
// against central finite differences in double, then the whole model, whose attention is sdpa's,
// under each scale policy the experiment trains with (including dL/dtau of a learnable scale).
#include <catch2/catch.hpp>

#include <char_lm/layers.hpp>
#include <char_lm/model.hpp>

#include "support/finite_differences.hpp"
#include "support/quant_bound.hpp"

#include <functional>
#include <random>

namespace {

using Mat = Eigen::MatrixXd;
using char_lm::Index;

Mat randn(Index rows, Index cols, std::mt19937_64& gen, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  Mat m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = dist(gen);
  return m;
}

// Central differences with step h: truncation error ~ h^2 |f'''| / 6 (1e-10 here for O(1)
// third derivatives), rounding ~ eps |f| / h (1e-11): a 1e-7 tolerance leaves a wide margin
// and still catches any wrong term, whose error is O(1).
constexpr double kStep = 1e-5;
constexpr double kTolerance = 1e-7;

/// The decoding tests' model: 29 characters, T = 48 positions, 4 heads of d_k 8.
char_lm::ModelConfig decodingConfig() {
  char_lm::ModelConfig cfg;
  cfg.vocab = 29;
  cfg.seqLen = 48;
  cfg.dModel = 32;
  cfg.heads = 4;
  return cfg;
}

/// Checks `analytic` = d loss / d x entry by entry against central differences.
void checkGradient(const std::function<double()>& loss, Mat& x, const Mat& analytic, const char* what) {
  INFO(what);
  REQUIRE(analytic.rows() == x.rows());
  REQUIRE(analytic.cols() == x.cols());
  const Mat numeric = sdpa_test::finiteDifferences(x, loss, kStep);
  for (Index i = 0; i < x.size(); ++i) {
    INFO("entry " << i << ": analytic " << analytic.data()[i] << ", numeric " << numeric.data()[i]);
    CHECK(std::abs(analytic.data()[i] - numeric.data()[i]) <= kTolerance * std::max(1.0, std::abs(numeric.data()[i])));
  }
}

}  // namespace

TEST_CASE("char_lm: linear layer gradients  [seed C11]") {
  std::mt19937_64 gen(1);
  Mat x = randn(5, 4, gen), w = randn(4, 3, gen), b = randn(1, 3, gen);
  const Mat r = randn(5, 3, gen);  // loss = sum(r .* y), so dL/dy = r
  Mat y;
  auto loss = [&] {
    char_lm::linearForward(x, w, b, y);
    return (r.array() * y.array()).sum();
  };
  Mat dw = Mat::Zero(4, 3), db = Mat::Zero(1, 3), dx;
  char_lm::linearBackward(x, w, r, dw, db, &dx);
  checkGradient(loss, x, dx, "dx");
  checkGradient(loss, w, dw, "dw");
  checkGradient(loss, b, db, "db");
}

TEST_CASE("char_lm: LayerNorm gradients  [seed C11]") {
  std::mt19937_64 gen(2);
  Mat x = randn(6, 8, gen, 3.0), g = randn(1, 8, gen), b = randn(1, 8, gen);
  x.row(2).array() += 50.0;  // a large mean must not matter
  const Mat r = randn(6, 8, gen);
  Mat y;
  char_lm::LayerNormCache<double> cache;
  auto loss = [&] {
    char_lm::layerNormForward(x, g, b, y, cache);
    return (r.array() * y.array()).sum();
  };
  loss();
  CHECK(cache.xhat.rowwise().mean().cwiseAbs().maxCoeff() < 1e-12);
  // The biased variance, as PyTorch: each normalised row has mean square var / (var + eps).
  CHECK(std::abs(cache.xhat.row(0).squaredNorm() / 8 - 1) < 1e-4);
  Mat dg = Mat::Zero(1, 8), db = Mat::Zero(1, 8), dx;
  char_lm::layerNormBackward(r, g, cache, dg, db, dx);
  checkGradient(loss, x, dx, "dx");
  checkGradient(loss, g, dg, "dg");
  checkGradient(loss, b, db, "db");
}

TEST_CASE("char_lm: GELU gradient  [seed C11]") {
  std::mt19937_64 gen(3);
  Mat x = randn(4, 7, gen, 2.0);
  x(0, 0) = 0;
  x(0, 1) = -6;
  x(0, 2) = 6;
  const Mat r = randn(4, 7, gen);
  Mat y;
  auto loss = [&] {
    char_lm::geluForward(x, y);
    return (r.array() * y.array()).sum();
  };
  loss();
  CHECK(y(0, 0) == 0.0);
  CHECK(std::abs(y(0, 2) - 6.0) < 1e-9);  // GELU(x) -> x for large x (1 - tanh(12.5) ~ 3e-11), -> 0 below
  CHECK(std::abs(y(0, 1)) < 1e-9);
  Mat dx;
  char_lm::geluBackward(x, r, dx);
  checkGradient(loss, x, dx, "dx");
}

TEST_CASE("char_lm: embedding gradients  [seed C11]") {
  std::mt19937_64 gen(4);
  const std::vector<int> tokens{3, 0, 3, 1, 2, 3};  // two sequences of 3, token 3 repeated
  Mat wte = randn(4, 5, gen), wpe = randn(3, 5, gen);
  const Mat r = randn(6, 5, gen);
  Mat x;
  auto loss = [&] {
    char_lm::embeddingForward(tokens, 3, wte, wpe, x);
    return (r.array() * x.array()).sum();
  };
  Mat dwte = Mat::Zero(4, 5), dwpe = Mat::Zero(3, 5);
  char_lm::embeddingBackward(tokens, 3, r, dwte, dwpe);
  checkGradient(loss, wte, dwte, "dwte");
  checkGradient(loss, wpe, dwpe, "dwpe");
}

TEST_CASE("char_lm: cross-entropy value and gradient  [seed C11]") {
  std::mt19937_64 gen(5);
  Mat logits = randn(5, 6, gen, 2.0);
  logits(1, 2) = 80;  // a saturated row: the max-shift keeps it finite
  const std::vector<int> targets{0, 2, 5, 1, 1};
  Mat dlogits;
  const double value = char_lm::crossEntropy(logits, targets, &dlogits);
  double expected = 0;
  for (Index t = 0; t < 5; ++t) {
    const double mx = logits.row(t).maxCoeff();
    expected += std::log((logits.row(t).array() - mx).exp().sum()) + mx - logits(t, targets[size_t(t)]);
  }
  CHECK(std::abs(value - expected / 5) < 1e-14 * std::max(1.0, value));
  // Uniform logits give log(V).
  CHECK(std::abs(char_lm::crossEntropy<double>(Mat::Zero(2, 6), {1, 4}, nullptr) - std::log(6.0)) < 1e-15);
  checkGradient([&] { return char_lm::crossEntropy<double>(logits, targets, nullptr); }, logits, dlogits, "dlogits");
}

TEST_CASE("char_lm: AdamW follows the PyTorch update rule") {
  char_lm::Param<double> p("w", Mat::Constant(2, 2, 1.0), true);
  p.grad << 0.5, -2.0, 1e-3, 0.0;
  char_lm::AdamWConfig c;
  c.lr = 0.1;
  c.weightDecay = 0.5;
  char_lm::adamWStep(p, c, 1);
  // Step 1: m_hat = g, v_hat = g^2, so w <- w (1 - lr wd) - lr g / (|g| + eps).
  Mat expected(2, 2);
  for (Index i = 0; i < 4; ++i) {
    const double g = p.grad.data()[i];
    expected.data()[i] = 1.0 * (1 - 0.05) - 0.1 * g / (std::abs(g) + c.eps);
  }
  CHECK((p.value - expected).cwiseAbs().maxCoeff() < 1e-15);
  char_lm::Param<double> bias("b", Mat::Constant(1, 1, 1.0), false);
  bias.grad(0, 0) = 0;
  char_lm::adamWStep(bias, c, 1);
  CHECK(bias.value(0, 0) == 1.0);  // no decay for biases, no move without gradient
}

TEMPLATE_TEST_CASE("char_lm: whole-model gradients through sdpa's attention  [seed C11][seed C17]", "",
                   sdpa::scale::InvSqrtDk, sdpa::scale::None, sdpa::scale::Learnable<double>) {
  char_lm::ModelConfig cfg;
  cfg.vocab = 7;
  cfg.seqLen = 5;
  cfg.dModel = 8;
  cfg.heads = 2;
  std::mt19937_64 gen(6);
  TestType scale{};
  if constexpr (TestType::IsLearnable) scale.setValue(0.7);
  char_lm::Model<double, TestType> model(cfg, scale, gen);
  const std::vector<int> tokens{1, 4, 4, 0, 6, 2, 2, 5, 3, 0}, targets{4, 4, 0, 6, 2, 2, 5, 3, 0, 1};
  model.zeroGrad();
  model.forward(tokens, targets);
  model.backward();
  auto loss = [&] { return model.loss(tokens, targets); };
  for (auto& p : model.params()) {
    const Mat analytic = p.grad;
    checkGradient(loss, p.value, analytic, p.name.c_str());
  }
  if constexpr (TestType::IsLearnable) {
    const double tau = model.tau(), analytic = model.scale().grad();
    model.scale().setValue(tau + kStep);
    const double up = loss();
    model.scale().setValue(tau - kStep);
    const double down = loss();
    model.scale().setValue(tau);
    const double numeric = (up - down) / (2 * kStep);
    INFO("dL/dtau analytic " << analytic << ", numeric " << numeric);
    CHECK(std::abs(analytic - numeric) <= kTolerance * std::max(1.0, std::abs(numeric)));
    CHECK(analytic != 0.0);
  }
}

TEST_CASE("char_lm: generating through a KvCache gives the tokens and logits of recomputing every step") {
  // Greedy decoding of a (randomly initialised) model, token by token through each cache mode,
  // against sequenceLogits over the whole sequence. 300 positions, beyond the model's T = 48
  // (positions wrap, as in training's windows): the ring holds the last T keys, its reference is
  // a sliding window of T keys; the others attend to the whole sequence. Under these masks row t
  // of the whole sequence's logits depends on tokens 0..t only, so it is what recomputing the
  // sequence at step t gives: one recomputation of all the tokens serves every step, and a
  // prefix recomputed at a few steps checks that equivalence itself.
  const char_lm::ModelConfig cfg = decodingConfig();
  std::mt19937_64 gen(3);
  const char_lm::Model<double, sdpa::scale::InvSqrtDk> model(cfg, sdpa::scale::InvSqrtDk{}, gen);
  const Index prompt = 12, total = 300, dK = cfg.headDim();
  const sdpa::CacheShape shape{cfg.heads, dK, dK};
  const auto lr = sdpa::mask::Align::LowerRight, ul = sdpa::mask::Align::UpperLeft;
  const auto relative = [](const Mat& a, const Mat& b) {
    return (a - b).cwiseAbs().maxCoeff() / std::max(1.0, b.cwiseAbs().maxCoeff());
  };
  for (const auto mode : {sdpa::CacheMode::Contiguous, sdpa::CacheMode::Ring, sdpa::CacheMode::Paged}) {
    const bool ring = mode == sdpa::CacheMode::Ring;
    DYNAMIC_SECTION((ring ? "ring" : mode == sdpa::CacheMode::Paged ? "paged" : "contiguous")) {
      auto cache = mode == sdpa::CacheMode::Contiguous ? sdpa::KvCache<double>::contiguous(shape, total)
                   : ring                              ? sdpa::KvCache<double>::ring(shape, cfg.seqLen, 1)
                                                       : sdpa::KvCache<double>::paged(shape, 16, total / 16 + 1);
      const Index seq = mode == sdpa::CacheMode::Paged ? cache.addSequence() : 0;
      const auto recompute = [&](const std::vector<int>& tokens) {
        return ring ? model.sequenceLogits(tokens, sdpa::mask::SlidingWindow{cfg.seqLen - 1, 0, ul})
                    : model.sequenceLogits(tokens, sdpa::mask::Causal{ul});
      };
      std::vector<int> tokens;
      Mat steps(total, cfg.vocab);
      for (Index t = 0; t < total; ++t) {
        int next = int((t * 7) % cfg.vocab);  // the prompt
        if (t >= prompt) steps.row(t - 1).maxCoeff(&next);
        tokens.push_back(next);
        steps.row(t) = ring ? model.decodeStep(next, cache, seq, sdpa::mask::SlidingWindow{cfg.seqLen - 1, 0, lr})
                            : model.decodeStep(next, cache, seq, sdpa::mask::Causal{lr});
      }
      const Mat whole = recompute(tokens);
      for (const Index t : {Index(0), prompt, Index(49), Index(127), Index(255), total - 1}) {
        INFO("step " << t);
        const std::vector<int> prefix(tokens.begin(), tokens.begin() + t + 1);
        CHECK(relative(whole.row(t), recompute(prefix).bottomRows(1)) < 1e-12);
      }
      double worst = 0;
      for (Index t = 0; t < total; ++t) {
        worst = std::max(worst, relative(steps.row(t), whole.row(t)));
        Index a = 0, b = 0;
        steps.row(t).maxCoeff(&a);
        whole.row(t).maxCoeff(&b);
        INFO("step " << t);
        REQUIRE(a == b);  // the same greedy token
      }
      INFO("largest logit difference, relative: " << worst);
      // Double precision: the two computations differ by rounding only (sums in another order).
      CHECK(worst < 1e-12);
      CHECK(cache.length(seq) == total);
      if (ring) CHECK(cache.firstPosition() == total - cfg.seqLen);
    }
  }
}

namespace {

/// Greedy generation of `total` tokens through a quantised cache (sequence seq): at every step
/// the token's attention output, head by head, against the exact attention in double over the
/// same tokens' keys and values (the rows decodeStep computed), within the bound of the
/// quantisation step and float rounding (support/quant_bound.hpp). window > 0: a sliding window
/// of that many keys (a ring), else causal over the whole sequence.
template <typename Storage, typename Model>
void checkQuantisedGeneration(const Model& model, sdpa::KvCache<Storage>& cache, Index seq, Index total, Index window) {
  const auto& cfg = model.config();
  const Index C = cfg.dModel, H = cfg.heads, d = cfg.headDim(), prompt = 12;
  const double tau = model.tau();
  const auto lr = sdpa::mask::Align::LowerRight;
  Mat k(total, C), v(total, C), logits;
  typename Model::StepTrace trace;
  double worst = 0;  // the largest error over its bound where quantised keys are seen
  std::vector<int> tokens;
  for (Index t = 0; t < total; ++t) {
    int next = int((t * 7) % cfg.vocab);
    if (t >= prompt) logits.row(0).maxCoeff(&next);
    tokens.push_back(next);
    logits = window > 0 ? model.decodeStep(next, cache, seq, sdpa::mask::SlidingWindow{window - 1, 0, lr}, &trace)
                        : model.decodeStep(next, cache, seq, sdpa::mask::Causal{lr}, &trace);
    k.row(t) = trace.k;
    v.row(t) = trace.v;
    const Index from = window > 0 ? std::max<Index>(0, t + 1 - window) : 0, to = t + 1;
    for (Index h = 0; h < H; ++h) {
      const Eigen::VectorXd q = trace.q.row(0).segment(h * d, d).transpose();
      const auto kh = k.topRows(to).middleCols(h * d, d);
      const auto vh = v.topRows(to).middleCols(h * d, d);
      Eigen::VectorXd s = tau * (kh.middleRows(from, to - from) * q);
      const Eigen::VectorXd w = (s.array() - s.maxCoeff()).exp();
      const Eigen::VectorXd exact = vh.middleRows(from, to - from).transpose() * (w / w.sum());
      const Eigen::VectorXd bound = sdpa_test::quantisedAttentionBound<Storage>(q, kh, vh, from, to, tau);
      for (Index c = 0; c < d; ++c) {
        const double err = std::abs(trace.attention(0, h * d + c) - exact(c));
        INFO("step " << t << ", head " << h << ", column " << c << ": error " << err << ", bound " << bound(c));
        REQUIRE(err <= bound(c));
        if (to / 32 * 32 > from) worst = std::max(worst, err / bound(c));  // quantised keys among them
      }
    }
  }
  CHECK(cache.length(seq) == total);
  WARN(Storage::Bits << "-bit K/V, " << total << " tokens: the attention error reached " << worst << " of its bound");
}

}  // namespace

TEST_CASE("char_lm: generating through a q8 or q4 KvCache stays within the quantisation bound") {
  // 300 positions through a q8 ring (a sliding window of T = 48 keys) and a paged q4 cache (causal
  // over all): each step's attention against the exact attention over the same keys and values.
  const char_lm::ModelConfig cfg = decodingConfig();
  std::mt19937_64 gen(5);
  const char_lm::Model<double, sdpa::scale::InvSqrtDk> model(cfg, sdpa::scale::InvSqrtDk{}, gen);
  const Index total = 300, dK = cfg.headDim();
  const sdpa::CacheShape shape{cfg.heads, dK, dK};
  SECTION("q8 ring") {
    auto ring = sdpa::KvCache<sdpa::kv::Q8>::ring(shape, cfg.seqLen, 1);
    checkQuantisedGeneration(model, ring, 0, total, cfg.seqLen);
  }
  SECTION("q4 paged") {
    auto paged = sdpa::KvCache<sdpa::kv::Q4>::paged(shape, 32, total / 32 + 1);
    const Index seq = paged.addSequence();
    checkQuantisedGeneration(model, paged, seq, total, 0);
  }
}
