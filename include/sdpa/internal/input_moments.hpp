#ifndef SDPA_INTERNAL_INPUT_MOMENTS_HPP
#define SDPA_INTERNAL_INPUT_MOMENTS_HPP

/*
 * What the diagnostics read of a head's q and k besides its rows (HeadInputs): the variance of
 * their entries and the Gram matrices of their columns centred on their means. O(n d_k^2) work,
 * up to a tenth of the forward's at n = 1024 unless the products run near the FMA rate, so float
 * and half inputs take the fast kernels' Gram product (forward_fast_isa.inc's gramLower) where
 * the CPU has one.
 */

#include <algorithm>
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

/// What the summaries read of one head's q or k (n x d): the variance of its entries and the
/// Gram matrix of its columns centred on their means (its lower triangle, the rest zero).
struct Moments {
  double variance = 0;
  Eigen::MatrixXd gram;
};

/// x's Moments in one pass for the column means and one for the Gram matrix: the variance of
/// all n d entries is (tr G + n sum_c (mean_c - mean)^2) / (n d), mean the mean of the means.
template <typename D>
Moments moments(const Eigen::MatrixBase<D>& x) {
  Moments out;
  if (x.size() == 0) return out;
  const Eigen::RowVectorXd mean = columnMeans(x);
  out.gram = centredGram(x, mean);
  const double n = double(x.rows()), mu = mean.mean();
  out.variance = (out.gram.trace() + n * (mean.array() - mu).square().sum()) / (n * double(x.cols()));
  return out;
}

/// The per-head inputs of the summaries from q's and k's Moments (q n_q x d_k, k n_k x d_k).
inline HeadInputs headInputs(const Moments& q, const Moments& k, Index dK, Index nQ, Index nK, double tau) {
  HeadInputs in{dK, nK, tau, q.variance, k.variance};
  if (nQ > 1 && nK > 1) {
    const double norm = q.gram.trace() * k.gram.trace();
    // <Gq, Gk>_F from the lower triangles: the strict ones count twice.
    const double inner = 2 * q.gram.cwiseProduct(k.gram).sum() - q.gram.diagonal().dot(k.gram.diagonal());
    if (norm > 0) in.centredRatio = double(dK) * inner / norm;
  }
  return in;
}

/// Records the per-head inputs of the summaries: d_k, n_k, tau and Var(q), Var(k) of the head.
template <typename DQ, typename DK>
HeadInputs headInputs(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, double tau) {
  return headInputs(moments(q), moments(k), q.cols(), q.rows(), k.rows(), tau);
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_INPUT_MOMENTS_HPP
