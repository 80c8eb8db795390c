/**
 * \file char_lm/layers.hpp
 * \brief The non-attention layers of the character-level language model, written with Eigen:
 * embedding, linear, LayerNorm, GELU, softmax cross-entropy, and the AdamW optimiser.
 *
 * Each layer is a forward function and a backward function that quotes the forward line it
 * differentiates (llm.c style). Rows are token positions, columns are features, as in sdpa.
 * Everything is templated on the scalar: the model trains in float, the tests check every
 * backward against central finite differences in double (tests/test_char_lm.cpp).
 */
#ifndef SDPA_EXPERIMENTS_CHAR_LM_LAYERS_HPP
#define SDPA_EXPERIMENTS_CHAR_LM_LAYERS_HPP

#include <Eigen/Core>

#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace char_lm {

using Index = Eigen::Index;
template <typename Scalar>
using Matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
template <typename Scalar>
using RowVector = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;

/// \brief A trainable tensor with its gradient and the AdamW moments.
template <typename Scalar>
struct Param {
  std::string name;
  Matrix<Scalar> value, grad, m, v;
  bool decay = true;  ///< weight decay applies to matrices, not to biases, gains or embeddings

  Param() = default;
  Param(std::string n, Matrix<Scalar> init, bool decays)
      : name(std::move(n)),
        value(std::move(init)),
        grad(Matrix<Scalar>::Zero(value.rows(), value.cols())),
        m(Matrix<Scalar>::Zero(value.rows(), value.cols())),
        v(Matrix<Scalar>::Zero(value.rows(), value.cols())),
        decay(decays) {}
};

/// PyTorch's nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
template <typename Scalar>
Matrix<Scalar> uniformInit(Index rows, Index cols, Index fanIn, std::mt19937_64& gen) {
  const double bound = 1.0 / std::sqrt(double(fanIn));
  std::uniform_real_distribution<double> dist(-bound, bound);
  Matrix<Scalar> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = Scalar(dist(gen));
  return m;
}

/// PyTorch's nn.Embedding default: N(0, 1).
template <typename Scalar>
Matrix<Scalar> normalInit(Index rows, Index cols, std::mt19937_64& gen) {
  std::normal_distribution<double> dist(0.0, 1.0);
  Matrix<Scalar> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = Scalar(dist(gen));
  return m;
}

// ---------------------------------------------------------------------------------------------
// Embedding: x[t] = wte[token[t]] + wpe[t mod T]; tokens N, x N x C.

template <typename Scalar>
void embeddingForward(const std::vector<int>& tokens, Index seqLen, const Matrix<Scalar>& wte,
                      const Matrix<Scalar>& wpe, Matrix<Scalar>& x) {
  const Index n = Index(tokens.size());
  x.resize(n, wte.cols());
  for (Index t = 0; t < n; ++t) x.row(t) = wte.row(tokens[size_t(t)]) + wpe.row(t % seqLen);
}

template <typename Scalar>
void embeddingBackward(const std::vector<int>& tokens, Index seqLen, const Matrix<Scalar>& dx, Matrix<Scalar>& dwte,
                       Matrix<Scalar>& dwpe) {
  // x.row(t) = wte.row(tokens[t]) + wpe.row(t % seqLen)
  for (Index t = 0; t < dx.rows(); ++t) {
    dwte.row(tokens[size_t(t)]) += dx.row(t);
    dwpe.row(t % seqLen) += dx.row(t);
  }
}

// ---------------------------------------------------------------------------------------------
// Linear: y = x w + b; x N x I, w I x O, b 1 x O, y N x O.

template <typename Scalar>
void linearForward(const Matrix<Scalar>& x, const Matrix<Scalar>& w, const Matrix<Scalar>& b, Matrix<Scalar>& y) {
  y.noalias() = x * w;
  y.rowwise() += b.row(0);
}

/// Accumulates dw, db; writes dx unless it is null.
template <typename Scalar>
void linearBackward(const Matrix<Scalar>& x, const Matrix<Scalar>& w, const Matrix<Scalar>& dy, Matrix<Scalar>& dw,
                    Matrix<Scalar>& db, Matrix<Scalar>* dx) {
  // y = x w + b
  dw.noalias() += x.transpose() * dy;
  db.row(0) += dy.colwise().sum();
  if (dx) dx->noalias() = dy * w.transpose();
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over the features of each row: y = (x - mean) / sqrt(var + eps) * g + b.

template <typename Scalar>
struct LayerNormCache {
  Matrix<Scalar> xhat;                ///< N x C, the normalised input
  Eigen::Matrix<Scalar, -1, 1> rstd;  ///< N, 1 / sqrt(var + eps)
};

inline constexpr double kLayerNormEps = 1e-5;

template <typename Scalar>
void layerNormForward(const Matrix<Scalar>& x, const Matrix<Scalar>& g, const Matrix<Scalar>& b, Matrix<Scalar>& y,
                      LayerNormCache<Scalar>& cache) {
  const Index n = x.rows(), c = x.cols();
  cache.xhat.resize(n, c);
  cache.rstd.resize(n);
  y.resize(n, c);
  for (Index i = 0; i < n; ++i) {
    const Scalar mean = x.row(i).mean();
    const Scalar var = (x.row(i).array() - mean).square().mean();  // biased, as PyTorch
    const Scalar rstd = Scalar(1) / std::sqrt(var + Scalar(kLayerNormEps));
    cache.rstd(i) = rstd;
    cache.xhat.row(i) = (x.row(i).array() - mean) * rstd;
  }
  y = cache.xhat.array().rowwise() * g.row(0).array();
  y.rowwise() += b.row(0);
}

template <typename Scalar>
void layerNormBackward(const Matrix<Scalar>& dy, const Matrix<Scalar>& g, const LayerNormCache<Scalar>& cache,
                       Matrix<Scalar>& dg, Matrix<Scalar>& db, Matrix<Scalar>& dx) {
  // y = xhat * g + b
  dg.row(0) += (dy.array() * cache.xhat.array()).colwise().sum().matrix();
  db.row(0) += dy.colwise().sum();
  const Matrix<Scalar> dxhat = dy.array().rowwise() * g.row(0).array();
  // xhat = (x - mean) * rstd: dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))
  dx.resize(dy.rows(), dy.cols());
  for (Index i = 0; i < dy.rows(); ++i) {
    const Scalar meanD = dxhat.row(i).mean();
    const Scalar meanDX = (dxhat.row(i).array() * cache.xhat.row(i).array()).mean();
    dx.row(i) = cache.rstd(i) * (dxhat.row(i).array() - meanD - cache.xhat.row(i).array() * meanDX);
  }
}

// ---------------------------------------------------------------------------------------------
// GELU, tanh approximation (GPT-2): y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

inline constexpr double kGeluA = 0.044715;
inline constexpr double kSqrt2OverPi = 0.7978845608028654;

template <typename Scalar>
void geluForward(const Matrix<Scalar>& x, Matrix<Scalar>& y) {
  const auto u = Scalar(kSqrt2OverPi) * (x.array() + Scalar(kGeluA) * x.array().cube());
  y = Scalar(0.5) * x.array() * (Scalar(1) + u.tanh());
}

template <typename Scalar>
void geluBackward(const Matrix<Scalar>& x, const Matrix<Scalar>& dy, Matrix<Scalar>& dx) {
  // y = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + a x^3)
  const auto xa = x.array();
  const Eigen::Array<Scalar, -1, -1> th = (Scalar(kSqrt2OverPi) * (xa + Scalar(kGeluA) * xa.cube())).tanh();
  const auto du = Scalar(kSqrt2OverPi) * (Scalar(1) + Scalar(3 * kGeluA) * xa.square());
  dx = dy.array() * (Scalar(0.5) * (Scalar(1) + th) + Scalar(0.5) * xa * (Scalar(1) - th.square()) * du);
}

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy, mean over rows: loss = mean_t -log softmax(logits[t])[target[t]].

/// Returns the mean loss; writes dlogits = (softmax - onehot) / N (the gradient of that mean).
template <typename Scalar>
double crossEntropy(const Matrix<Scalar>& logits, const std::vector<int>& targets, Matrix<Scalar>* dlogits) {
  const Index n = logits.rows();
  double loss = 0;
  if (dlogits) dlogits->resize(n, logits.cols());
  for (Index t = 0; t < n; ++t) {
    const Scalar mx = logits.row(t).maxCoeff();
    const RowVector<Scalar> e = (logits.row(t).array() - mx).exp().matrix();
    const Scalar sum = e.sum();
    const int y = targets[size_t(t)];
    loss += double(std::log(sum) - (logits(t, y) - mx));
    if (dlogits) {
      dlogits->row(t) = e / (sum * Scalar(n));
      (*dlogits)(t, y) -= Scalar(1) / Scalar(n);
    }
  }
  return loss / double(n);
}

// ---------------------------------------------------------------------------------------------
// AdamW (Loshchilov & Hutter; PyTorch's torch.optim.AdamW): decoupled weight decay.

struct AdamWConfig {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weightDecay = 0.01;
};

/// One update of p from p.grad at step t (1-based).
template <typename Scalar>
void adamWStep(Param<Scalar>& p, const AdamWConfig& c, long t) {
  const double bc1 = 1.0 - std::pow(c.beta1, double(t)), bc2 = 1.0 - std::pow(c.beta2, double(t));
  if (p.decay) p.value *= Scalar(1.0 - c.lr * c.weightDecay);
  p.m = Scalar(c.beta1) * p.m + Scalar(1.0 - c.beta1) * p.grad;
  p.v = Scalar(c.beta2) * p.v + Scalar(1.0 - c.beta2) * p.grad.cwiseAbs2();
  p.value.array() -= Scalar(c.lr) * (p.m.array() / Scalar(bc1)) / ((p.v.array() / Scalar(bc2)).sqrt() + Scalar(c.eps));
}

}  // namespace char_lm

#endif  // SDPA_EXPERIMENTS_CHAR_LM_LAYERS_HPP
