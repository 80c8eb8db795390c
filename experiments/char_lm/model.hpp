/**
 * \file char_lm/model.hpp
 * \brief A one-layer decoder Transformer for characters (seed C11), its attention from sdpa:
 *
 *     x0 = wte[tokens] + wpe[positions]                         N x C   (N = B T tokens)
 *     x1 = x0 + Attn(LN1(x0)) wo + bo       causal, H heads of d_k = C / H, scale policy S
 *     x2 = x1 + GELU(LN2(x1) w1 + b1) w2 + b2                   hidden 4C
 *     logits = LNf(x2) wout + bout                              N x V
 *
 * Attn is `sdpa::batchedAttentionForward` over B sequences of T tokens with q = h wq + bq,
 * k = h wk + bk, v = h wv + bv; its backward is `sdpa::batchedAttentionBackward`, which also
 * gives dL/dtau for a learnable scale (seed C17). Initialisation is PyTorch's default
 * (nn.Linear uniform +-1/sqrt(fan_in), nn.Embedding N(0, 1), LayerNorm g = 1, b = 0): what the
 * article's experiment most likely used, and not tuned here.
 */
#ifndef SDPA_EXPERIMENTS_CHAR_LM_MODEL_HPP
#define SDPA_EXPERIMENTS_CHAR_LM_MODEL_HPP

#include <sdpa/sdpa.hpp>

#include <type_traits>
#include <vector>

#include "layers.hpp"

namespace char_lm {

struct ModelConfig {
  Index vocab = 0, seqLen = 64, dModel = 128, heads = 8;
  /// Multiplies the initial wq and wk. PyTorch's init gives q and k components of variance 1/3
  /// (uniform +-1/sqrt(fan_in) on unit-variance LayerNorm outputs); sqrt(3) makes it 1, the
  /// premise of the article's variance argument (C3), so unscaled logits start with std sqrt(d_k).
  double qkGain = 1.0;
  Index hidden() const { return 4 * dModel; }
  Index headDim() const { return dModel / heads; }
};

/// \brief Parameters, activations of the last forward pass, and the scale policy.
template <typename Scalar, typename Scale>
class Model {
 public:
  static constexpr bool IsLearnable = Scale::IsLearnable;

  Model(const ModelConfig& config, Scale scale, std::mt19937_64& gen) : m_config(config), m_scale(std::move(scale)) {
    const Index c = config.dModel, v = config.vocab, f = config.hidden();
    auto linear = [&](const char* name, Index in, Index out) {
      m_params.emplace_back(std::string(name) + ".w", uniformInit<Scalar>(in, out, in, gen), true);
      m_params.emplace_back(std::string(name) + ".b", uniformInit<Scalar>(1, out, in, gen), false);
    };
    auto norm = [&](const char* name) {
      m_params.emplace_back(std::string(name) + ".g", Matrix<Scalar>::Ones(1, c), false);
      m_params.emplace_back(std::string(name) + ".b", Matrix<Scalar>::Zero(1, c), false);
    };
    m_params.emplace_back("wte", normalInit<Scalar>(v, c, gen), false);
    m_params.emplace_back("wpe", normalInit<Scalar>(config.seqLen, c, gen), false);
    norm("ln1");
    linear("wq", c, c);
    linear("wk", c, c);
    linear("wv", c, c);
    linear("wo", c, c);
    norm("ln2");
    linear("w1", c, f);
    linear("w2", f, c);
    norm("lnf");
    linear("wout", c, v);
    m_params[kWq].value *= Scalar(config.qkGain);
    m_params[kWk].value *= Scalar(config.qkGain);
  }

  const ModelConfig& config() const { return m_config; }
  std::vector<Param<Scalar>>& params() { return m_params; }
  Scale& scale() { return m_scale; }
  const Scale& scale() const { return m_scale; }
  /// The tau the attention uses now.
  double tau() const { return double(m_scale.value(m_config.headDim())); }

  /// Forward pass over B = tokens / T sequences; returns the mean cross-entropy against targets.
  double forward(const std::vector<int>& tokens, const std::vector<int>& targets) {
    const Index n = Index(tokens.size()), t = m_config.seqLen;
    m_tokens = tokens;
    m_layout = sdpa::BatchLayout::padded(n / t, t, t, {}, {});
    embeddingForward(tokens, t, p(kWte), p(kWpe), m_x0);
    layerNormForward(m_x0, p(kLn1g), p(kLn1b), m_h1, m_ln1);
    linearForward(m_h1, p(kWq), p(kBq), m_q);
    linearForward(m_h1, p(kWk), p(kBk), m_k);
    linearForward(m_h1, p(kWv), p(kBv), m_v);
    m_attn = sdpa::batchedAttentionForward(m_q, m_k, m_v, m_layout, heads(), m_scale, causal());
    linearForward(m_attn.output, p(kWo), p(kBo), m_x1);
    m_x1 += m_x0;
    layerNormForward(m_x1, p(kLn2g), p(kLn2b), m_h2, m_ln2);
    linearForward(m_h2, p(kW1), p(kB1), m_u);
    geluForward(m_u, m_g);
    linearForward(m_g, p(kW2), p(kB2), m_x2);
    m_x2 += m_x1;
    layerNormForward(m_x2, p(kLnfg), p(kLnfb), m_hf, m_lnf);
    linearForward(m_hf, p(kWout), p(kBout), m_logits);
    return crossEntropy(m_logits, targets, &m_dlogits);
  }

  /// Loss only (no gradient buffers kept).
  /**
   * Logits (n x V) of one sequence of tokens, position t's embedding wpe[t mod T] (as training's
   * windows), attention over the whole sequence under `mask` (Causal, or a SlidingWindow of T
   * keys for sequences longer than the T positions the model was trained on): the reference
   * that decodeStep's token-by-token computation must give.
   */
  template <typename Mask>
  Matrix<Scalar> sequenceLogits(const std::vector<int>& tokens, const Mask& mask) const {
    Matrix<Scalar> x0, h1, q, k, v;
    LayerNormCache<Scalar> ln;
    embeddingForward(tokens, m_config.seqLen, p(kWte), p(kWpe), x0);
    layerNormForward(x0, p(kLn1g), p(kLn1b), h1, ln);
    linearForward(h1, p(kWq), p(kBq), q);
    linearForward(h1, p(kWk), p(kBk), k);
    linearForward(h1, p(kWv), p(kBv), v);
    return afterAttention(x0, sdpa::multiHeadAttention(q, k, v, heads(), m_scale, mask));
  }

  /**
   * One token of decoding: appends its k and v to `cache` (this layer's, sequence `seq`), attends
   * its query to the cache under `mask` (LowerRight-aligned: the token is the cache's newest
   * position) and returns its logits (1 x V). O(cache length) per token instead of
   * sequenceLogits's O(n^2). `trace`, if not null, receives the token's q, k, v rows (1 x C) and
   * its attention output (1 x C), as the cache computed it.
   */
  struct StepTrace {
    Matrix<Scalar> q, k, v, attention;
  };
  template <typename Storage, typename Mask>
  Matrix<Scalar> decodeStep(int token, sdpa::KvCache<Storage>& cache, Index seq, const Mask& mask,
                            StepTrace* trace = nullptr) const {
    const Index pos = cache.length(seq);
    Matrix<Scalar> x0 = p(kWte).row(token) + p(kWpe).row(pos % m_config.seqLen), h1, q, k, v;
    LayerNormCache<Scalar> ln;
    layerNormForward(x0, p(kLn1g), p(kLn1b), h1, ln);
    linearForward(h1, p(kWq), p(kBq), q);
    linearForward(h1, p(kWk), p(kBk), k);
    linearForward(h1, p(kWv), p(kBv), v);
    cache.append(seq, k, v);
    const auto attn = sdpa::cachedAttention(q, cache.sequence(seq), heads(), m_scale, mask);
    if (trace) *trace = {q, k, v, attn.template cast<Scalar>()};
    return afterAttention(x0, attn.template cast<Scalar>());
  }

  double loss(const std::vector<int>& tokens, const std::vector<int>& targets) {
    forward(tokens, targets);
    return crossEntropy<Scalar>(m_logits, targets, nullptr);
  }

  /// Backward pass of the last forward: accumulates every parameter's grad (and the learnable
  /// scale's, through sdpa).
  void backward() {
    const Index t = m_config.seqLen;
    Matrix<Scalar> dhf, dx2, dx1, dh, dg, du, da, tmp;
    // logits = hf wout + bout
    linearBackward(m_hf, p(kWout), m_dlogits, g(kWout), g(kBout), &dhf);
    // hf = LNf(x2)
    layerNormBackward(dhf, p(kLnfg), m_lnf, g(kLnfg), g(kLnfb), dx2);
    // x2 = x1 + g w2 + b2
    linearBackward(m_g, p(kW2), dx2, g(kW2), g(kB2), &dg);
    // g = GELU(u)
    geluBackward(m_u, dg, du);
    // u = h2 w1 + b1
    linearBackward(m_h2, p(kW1), du, g(kW1), g(kB1), &dh);
    // h2 = LN2(x1); x2 = x1 + ...
    layerNormBackward(dh, p(kLn2g), m_ln2, g(kLn2g), g(kLn2b), dx1);
    dx1 += dx2;
    // x1 = x0 + attn wo + bo
    linearBackward(m_attn.output, p(kWo), dx1, g(kWo), g(kBo), &da);
    // attn = softmax(tau q k^T + causal) v, per head and sequence
    auto grads = sdpa::batchedAttentionBackward(m_q, m_k, m_v, m_attn, da, m_layout, heads(), m_scale, causal());
    // q = h1 wq + bq, k = h1 wk + bk, v = h1 wv + bv
    linearBackward(m_h1, p(kWq), grads.dq, g(kWq), g(kBq), &dh);
    linearBackward(m_h1, p(kWk), grads.dk, g(kWk), g(kBk), &tmp);
    dh += tmp;
    linearBackward(m_h1, p(kWv), grads.dv, g(kWv), g(kBv), &tmp);
    dh += tmp;
    // h1 = LN1(x0); x1 = x0 + ...
    layerNormBackward(dh, p(kLn1g), m_ln1, g(kLn1g), g(kLn1b), tmp);
    tmp += dx1;
    // x0 = wte[tokens] + wpe[positions]
    embeddingBackward(m_tokens, t, tmp, g(kWte), g(kWpe));
  }

  void zeroGrad() {
    for (auto& prm : m_params) prm.grad.setZero();
    if constexpr (IsLearnable) m_scale.zeroGrad();
  }

  /// The activations the attention saw in the last forward: q, k (N x C) and the output.
  const Matrix<Scalar>& queries() const { return m_q; }
  const Matrix<Scalar>& keys() const { return m_k; }
  const Matrix<Scalar>& logits() const { return m_logits; }

  sdpa::Heads heads() const { return sdpa::Heads{m_config.heads}; }
  static sdpa::mask::Causal causal() { return sdpa::mask::Causal{sdpa::mask::Align::UpperLeft}; }

 private:
  // Parameter order, as the constructor creates them.
  enum : int {
    kWte,
    kWpe,
    kLn1g,
    kLn1b,
    kWq,
    kBq,
    kWk,
    kBk,
    kWv,
    kBv,
    kWo,
    kBo,
    kLn2g,
    kLn2b,
    kW1,
    kB1,
    kW2,
    kB2,
    kLnfg,
    kLnfb,
    kWout,
    kBout
  };
  const Matrix<Scalar>& p(int i) const { return m_params[size_t(i)].value; }

  /// forward's lines after the attention (without the caches the backward needs): the logits.
  Matrix<Scalar> afterAttention(const Matrix<Scalar>& x0, const Matrix<Scalar>& attn) const {
    Matrix<Scalar> x1, h2, u, gl, x2, hf, logits;
    LayerNormCache<Scalar> ln;
    linearForward(attn, p(kWo), p(kBo), x1);
    x1 += x0;
    layerNormForward(x1, p(kLn2g), p(kLn2b), h2, ln);
    linearForward(h2, p(kW1), p(kB1), u);
    geluForward(u, gl);
    linearForward(gl, p(kW2), p(kB2), x2);
    x2 += x1;
    layerNormForward(x2, p(kLnfg), p(kLnfb), hf, ln);
    linearForward(hf, p(kWout), p(kBout), logits);
    return logits;
  }
  Matrix<Scalar>& g(int i) { return m_params[size_t(i)].grad; }

  ModelConfig m_config;
  Scale m_scale;
  std::vector<Param<Scalar>> m_params;

  std::vector<int> m_tokens;
  sdpa::BatchLayout m_layout;
  Matrix<Scalar> m_x0, m_h1, m_q, m_k, m_v, m_x1, m_h2, m_u, m_g, m_x2, m_hf, m_logits, m_dlogits;
  LayerNormCache<Scalar> m_ln1, m_ln2, m_lnf;
  sdpa::MultiHeadForwardResult<Scalar> m_attn;
};

}  // namespace char_lm

#endif  // SDPA_EXPERIMENTS_CHAR_LM_MODEL_HPP
