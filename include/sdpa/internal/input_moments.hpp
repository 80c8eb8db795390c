#ifndef SDPA_INTERNAL_INPUT_MOMENTS_HPP
#define SDPA_INTERNAL_INPUT_MOMENTS_HPP

/*
 * What the diagnostics read of a head's q and k besides its rows (HeadInputs): the variance of
 * their entries, the traces of their centred Gram matrices and <Gq, Gk>_F. The last takes the
 * Gram matrices themselves, O(n d_k^2) work (a tenth of the forward's at n = 1024, d_k = 128,
 * even on the fast kernels' Gram product, forward_fast_isa.inc's gramLower), unless the sink's
 * rows give it (streamedInner: O(n d_k), where every row saw every key).
 */

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "diagnostics_rows.hpp"
#include "forward_fast.hpp"
#include "macros.hpp"

namespace sdpa::internal {

/// Rows per block of the moments' float sums: short enough that a block's float sums keep a
/// relative error of a few hundred u, long enough to amortise the per-block double sums.
constexpr Index kMomentRows = 512;

/// x's column means (1 x d): double inputs in double; float and half inputs summed in float over
/// blocks of kMomentRows rows (vectorised, where a cast to double per entry was not: 1.3 ns an
/// entry), the blocks in double.
template <typename D>
Eigen::RowVectorXd columnMeans(const Eigen::MatrixBase<D>& x) {
  if constexpr (std::is_same_v<Accumulator<typename D::Scalar>, double>) {
    return x.template cast<double>().colwise().mean();
  } else {
    Eigen::RowVectorXd sum = Eigen::RowVectorXd::Zero(x.cols());
    for (Index i0 = 0; i0 < x.rows(); i0 += kMomentRows) {
      const Index rows = std::min(kMomentRows, x.rows() - i0);
      sum += x.middleRows(i0, rows).template cast<float>().colwise().sum().template cast<double>();
    }
    return sum / double(x.rows());
  }
}

/**
 * out's first rows x d entries = x's rows i0.. minus mu, row by row (out has its Gram kernel's
 * padded width; called where fast::gramRows() > 0). A column-major float x is transposed 8 x 8 in
 * registers: Eigen's assignment across storage orders took 2.6 ns an entry, longer than the Gram
 * product at d_k = 64.
 */
template <typename D>
void centredRows(const Eigen::MatrixBase<D>& x, Index i0, Index rows, const Eigen::RowVectorXf& mu,
                 RowMajorMatrix<float>& out) {
#if SDPA_HAS_ISA_DISPATCH
  if constexpr (std::is_same_v<typename D::Scalar, float> && !bool(D::Flags & Eigen::RowMajorBit) &&
                bool(D::Flags & Eigen::DirectAccessBit)) {
    if (x.derived().innerStride() == 1) {
      fast::centredTranspose(x.derived().data() + i0, x.derived().outerStride(), rows, x.cols(), mu.data(), out.data(),
                             out.cols());
      return;
    }
  }
#endif
  out.topLeftCorner(rows, x.cols()) = x.middleRows(i0, rows).template cast<float>().rowwise() - mu;
}

/**
 * The lower triangle of G = (x - mean)^T (x - mean) (d x d, x n x d, mean its column means; the
 * strict upper triangle zero: the symmetric copy cost a fifth of the whole at d_k = 128), in
 * blocks of kMomentRows rows: each block centred and multiplied in the accumulation type (float
 * for float and half inputs), the blocks' lower triangles summed in double. Float: the fast Gram
 * kernel on a row-major centred copy of the block, its columns padded with zeros to the kernel's
 * tile; on the portable path, and for double, Eigen's rank update. No n x d copy: a sink on a
 * long sequence would otherwise touch fresh pages on every call.
 */
template <typename D>
Eigen::MatrixXd centredGram(const Eigen::MatrixBase<D>& x, const Eigen::RowVectorXd& mean) {
  using Acc = Accumulator<typename D::Scalar>;
  const Index n = x.rows(), d = x.cols();
  if constexpr (std::is_same_v<Acc, float>) {
    if (const Index m = fast::gramRows(); m > 0 && n > 0 && d > 0) {
      const Index dPad = (d + m - 1) / m * m;
      thread_local RowMajorMatrix<float> block;  // a block's centred rows; padding columns zero
      thread_local Matrix<float> part;           // its Gram matrix, dPad x dPad
      block.resize(std::min(kMomentRows, n), dPad);
      block.rightCols(dPad - d).setZero();
      part.resize(dPad, dPad);
      Eigen::MatrixXd g = Eigen::MatrixXd::Zero(d, d);
      const Eigen::RowVectorXf mu = mean.cast<float>();
      for (Index i0 = 0; i0 < n; i0 += kMomentRows) {
        const Index rows = std::min(kMomentRows, n - i0);
        centredRows(x, i0, rows, mu, block);
        part.setZero();
        fast::gramLower(block.data(), rows, dPad, part.data());
        g.template triangularView<Eigen::Lower>() += part.topLeftCorner(d, d).template cast<double>();
      }
      return g;
    }
  }
  Eigen::MatrixXd g = Eigen::MatrixXd::Zero(d, d);
  Matrix<Acc> block, part(d, d);
  for (Index i0 = 0; i0 < n; i0 += kMomentRows) {
    const Index rows = std::min(kMomentRows, n - i0);
    block = x.middleRows(i0, rows).template cast<Acc>().rowwise() - mean.template cast<Acc>();
    part.setZero();
    part.template selfadjointView<Eigen::Lower>().rankUpdate(block.transpose());
    g += part.template cast<double>();  // part's strict upper triangle stays zero
  }
  return g;
}

/// What the summaries read of one head's q or k (n x d): its column means, the variance of its
/// entries, tr G and, where asked for, the Gram matrix G of its columns centred on their means
/// (its lower triangle, the rest zero; empty otherwise).
struct Moments {
  double variance = 0, trace = 0;
  Eigen::RowVectorXd mean;
  Eigen::MatrixXd gram;
};

/// tr G = sum of x's centred entries squared (x n x d, mean its column means), O(n d): in the
/// accumulation type over blocks of kMomentRows rows, the blocks in double.
template <typename D>
double centredTrace(const Eigen::MatrixBase<D>& x, const Eigen::RowVectorXd& mean) {
  using Acc = Accumulator<typename D::Scalar>;
  double trace = 0;
  for (Index i0 = 0; i0 < x.rows(); i0 += kMomentRows) {
    const Index rows = std::min(kMomentRows, x.rows() - i0);
    for (Index c = 0; c < x.cols(); ++c)
      trace += double((x.col(c).segment(i0, rows).template cast<Acc>().array() - Acc(mean(c))).square().sum());
  }
  return trace;
}

/**
 * x's Moments: one pass for the column means, one for tr G (O(n d)) and, withGram, one for the Gram
 * matrix (O(n d^2)). The variance of all n d entries is (tr G + n sum_c (mean_c - mean)^2) / (n d),
 * mean the mean of the means.
 */
template <typename D>
Moments moments(const Eigen::MatrixBase<D>& x, bool withGram = true) {
  Moments out;
  if (x.size() == 0) return out;
  out.mean = columnMeans(x);
  out.trace = centredTrace(x, out.mean);
  if (withGram) out.gram = centredGram(x, out.mean);
  const double n = double(x.rows()), mu = out.mean.mean();
  out.variance = (out.trace + n * (out.mean.array() - mu).square().sum()) / (n * double(x.cols()));
  return out;
}

/// <Gq, Gk>_F from the Gram matrices' lower triangles (the strict ones count twice).
inline double gramInner(const Moments& q, const Moments& k) {
  return 2 * q.gram.cwiseProduct(k.gram).sum() - q.gram.diagonal().dot(k.gram.diagonal());
}

/// sum_i (x_i . v)^2 over x's rows (x n x d, v 1 x d): each block of kMomentRows rows' dots a
/// matrix-vector product in the accumulation type (half inputs widened a block at a time), their
/// squares summed in double.
template <typename D>
double sumSquaredDots(const Eigen::MatrixBase<D>& x, const Eigen::RowVectorXd& v) {
  using Acc = Accumulator<typename D::Scalar>;
  const Vector<Acc> va = v.transpose().cast<Acc>();
  thread_local Vector<Acc> dots;
  thread_local Matrix<Acc> widened;  // half inputs only
  dots.resize(std::min(kMomentRows, x.rows()));
  double sum = 0;
  for (Index i0 = 0; i0 < x.rows(); i0 += kMomentRows) {
    const Index rows = std::min(kMomentRows, x.rows() - i0);
    if constexpr (std::is_same_v<typename D::Scalar, Acc>) {
      dots.head(rows).noalias() = x.middleRows(i0, rows) * va;
    } else {
      widened = x.middleRows(i0, rows).template cast<Acc>();
      dots.head(rows).noalias() = widened * va;
    }
    sum += dots.head(rows).template cast<double>().squaredNorm();
  }
  return sum;
}

/**
 * <Gq, Gk>_F without either Gram matrix, from the sum over every (query, key) pair of the raw
 * logit squared, sumR2 = sum_ij r_ij^2 with r_ij = q_i . k_j (a DiagnosticsSink's rows sum it
 * beside the softmax): Qc Kc^T is r with its row means a_i = q_i . kbar, its column means
 * b_j = qbar . k_j and its mean c = qbar . kbar taken out, so <Gq, Gk>_F = ||Qc Kc^T||_F^2 =
 * sumR2 - n_k sum a^2 - n_q sum b^2 + n_q n_k c^2 (two-way analysis of variance). O((n_q + n_k) d)
 * where the Gram matrices take O((n_q + n_k) d^2). The subtraction loses what the means carry:
 * returns NaN where more than kStreamedLoss of sumR2 goes (sumR2 > kStreamedLoss x the result)
 * or where it is not finite, which then needs the Gram matrices; below that, sumR2's own
 * rounding (a few hundred u of it) stays under a few thousand u of the result.
 */
constexpr double kStreamedLoss = 16;

template <typename DQ, typename DK>
double streamedInner(double sumR2, const Eigen::MatrixBase<DQ>& q, const Moments& mq, const Eigen::MatrixBase<DK>& k,
                     const Moments& mk) {
  const double nQ = double(q.rows()), nK = double(k.rows()), c = mq.mean.dot(mk.mean);
  const double inner = sumR2 - nK * sumSquaredDots(q, mk.mean) - nQ * sumSquaredDots(k, mq.mean) + nQ * nK * c * c;
  const bool kept = inner > 0 && std::isfinite(inner) && sumR2 <= kStreamedLoss * inner;
  return kept ? inner : std::numeric_limits<double>::quiet_NaN();
}

/// The per-head inputs of the summaries, given <Gq, Gk>_F (q n_q x d_k, k n_k x d_k).
inline HeadInputs headInputs(const Moments& q, const Moments& k, double inner, Index dK, Index nQ, Index nK,
                             double tau) {
  HeadInputs in{dK, nK, tau, q.variance, k.variance};
  const double norm = q.trace * k.trace;
  if (nQ > 1 && nK > 1 && norm > 0) in.centredRatio = double(dK) * inner / norm;
  return in;
}

/// The per-head inputs of the summaries from q's and k's Moments with their Gram matrices.
inline HeadInputs headInputs(const Moments& q, const Moments& k, Index dK, Index nQ, Index nK, double tau) {
  return headInputs(q, k, nQ > 1 && nK > 1 ? gramInner(q, k) : 0.0, dK, nQ, nK, tau);
}

/// Records the per-head inputs of the summaries: d_k, n_k, tau and Var(q), Var(k) of the head.
template <typename DQ, typename DK>
HeadInputs headInputs(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, double tau) {
  return headInputs(moments(q), moments(k), q.cols(), q.rows(), k.rows(), tau);
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_INPUT_MOMENTS_HPP
