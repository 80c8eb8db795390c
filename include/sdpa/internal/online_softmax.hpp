#ifndef SDPA_INTERNAL_ONLINE_SOFTMAX_HPP
#define SDPA_INTERNAL_ONLINE_SOFTMAX_HPP

#include <cmath>
#include <limits>
#include <vector>

#include "../softmax.hpp"
#include "macros.hpp"
#include "parallel.hpp"

namespace sdpa::internal {

/**
 * The running softmax of a block of query rows while blocks of keys stream past (Milakov and
 * Gimelshein's online softmax, as FlashAttention-2 keeps it). For each row i, over the keys seen
 * so far: m_i = max_j s_ij, l_i = sum_j exp(s_ij - m_i) and acc_i = sum_j exp(s_ij - m_i) v_j
 * (rows x d_v). The output is acc_i / l_i and the logSumExp m_i + log l_i. A row with a NaN or
 * +inf visible logit is marked bad and finishes as NaN (the naive kernel's rule), a row that saw
 * no visible key finishes as output 0, logSumExp -inf. Buffers grow once and are then reused.
 */
template <typename Acc>
class OnlineSoftmax {
 public:
  using RowsMap = Eigen::Map<RowMajorMatrix<Acc>>;
  using VecMap = Eigen::Map<Vector<Acc>>;

  void start(Index rows, Index dV) {
    m_rows = rows;
    m_dV = dV;
    acc().setZero();
    max().setConstant(-kInf);
    sum().setZero();
    m_bad.assign(size_t(rows), 0);
  }
  Index rows() const { return m_rows; }
  RowsMap acc() { return RowsMap(m_acc.get(m_rows * m_dV), m_rows, m_dV); }
  VecMap max() { return VecMap(m_max.get(m_rows), m_rows); }
  VecMap sum() { return VecMap(m_sum.get(m_rows), m_rows); }

  /**
   * Takes in a tile of logits s (rows x b_k, this state's rows) and turns it into the tile's
   * weights exp(s - m_new), rescaling acc and l by exp(m_old - m_new); the caller then adds
   * s v_tile to acc(). Hidden (-inf) entries become exactly 0: Eigen's vectorised exp does not
   * promise exp(-inf) = 0.
   */
  void absorb(RowsMap s) {
    auto a = acc();
    auto m = max();
    auto l = sum();
    for (Index i = 0; i < m_rows; ++i) {
      auto row = s.row(i).array();
      const Acc tileMax = row.template maxCoeff<Eigen::PropagateNaN>();
      if (!(tileMax < kInf)) m_bad[size_t(i)] = 1;  // NaN or +inf: no finite softmax
      const Acc mNew = m(i) > tileMax ? m(i) : tileMax;
      if (m_bad[size_t(i)] || mNew == -kInf) {  // bad, or nothing visible yet
        row.setZero();
        continue;
      }
      row = expHidingMinusInf(row - mNew);
      const Acc alpha = std::exp(m(i) - mNew);  // 0 at the first visible tile, 1 if the max held
      l(i) = alpha * l(i) + row.sum();
      if (alpha != Acc(1)) a.row(i) *= alpha;
      m(i) = mNew;
    }
  }

  /// Folds in the state of the same rows over another key range (a split of the keys).
  void merge(OnlineSoftmax& other) {
    auto a = acc(), b = other.acc();
    auto m = max(), mo = other.max();
    auto l = sum(), lo = other.sum();
    for (Index i = 0; i < m_rows; ++i) {
      m_bad[size_t(i)] |= other.m_bad[size_t(i)];
      const Acc mNew = std::max(m(i), mo(i));
      if (mNew == -kInf) continue;
      const Acc x = std::exp(m(i) - mNew), y = std::exp(mo(i) - mNew);
      l(i) = x * l(i) + y * lo(i);
      a.row(i) = x * a.row(i) + y * b.row(i);
      m(i) = mNew;
    }
  }

  /// out (rows x d_v) = acc / l, lse (rows) = m + log l.
  template <typename DOut, typename DLse>
  void finish(const Eigen::MatrixBase<DOut>& out_, const Eigen::MatrixBase<DLse>& lse_) {
    auto& out = const_cast<Eigen::MatrixBase<DOut>&>(out_);  // Eigen's idiom to write into blocks
    auto& lse = const_cast<Eigen::MatrixBase<DLse>&>(lse_);
    using Out = typename DOut::Scalar;
    using Lse = typename DLse::Scalar;
    auto a = acc();
    auto m = max();
    auto l = sum();
    const bool hasOut = out.cols() > 0;  // d_v = 0: out may be a null block, no row() of it
    for (Index i = 0; i < m_rows; ++i) {
      if (m_bad[size_t(i)]) {
        if (hasOut) out.row(i).setConstant(Out(std::numeric_limits<Acc>::quiet_NaN()));
        lse(i) = std::numeric_limits<Lse>::quiet_NaN();
      } else if (m(i) == -kInf) {
        if (hasOut) out.row(i).setZero();
        lse(i) = -std::numeric_limits<Lse>::infinity();
      } else {
        if (hasOut) out.row(i) = (a.row(i) * (Acc(1) / l(i))).template cast<Out>();
        lse(i) = Lse(m(i) + std::log(l(i)));
      }
    }
  }

 private:
  static constexpr Acc kInf = std::numeric_limits<Acc>::infinity();
  Index m_rows = 0, m_dV = 0;
  Buffer<Acc> m_acc, m_max, m_sum;
  std::vector<unsigned char> m_bad;
};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_ONLINE_SOFTMAX_HPP
