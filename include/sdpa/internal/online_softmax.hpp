#ifndef SDPA_INTERNAL_ONLINE_SOFTMAX_HPP
#define SDPA_INTERNAL_ONLINE_SOFTMAX_HPP

#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../softmax.hpp"
#include "forward_fast.hpp"
#include "macros.hpp"
#include "parallel.hpp"

namespace sdpa::internal {

/**
 * x[j] = exp(x[j] - m) for n contiguous logits whose finite maximum is m (a NaN among them may
 * have been skipped), in one pass (as Eigen expressions: exp, a -inf ramp and a sum, three
 * passes). Returns the sum of the weights, or NaN if some x[j] is NaN: the sum of the arguments,
 * all <= 0 otherwise, is NaN exactly then. An argument at or below `cut` gives exactly 0: -inf (a
 * hidden key) and anything whose weight is below the smallest normal number, as in
 * expHidingMinusInf (kExpCut: the vectorised exp clamps there). Float takes the fast kernels'
 * exp under the ISA in force (AVX-512 or AVX2, the same bits on both: fast::expShiftedSum);
 * double, and float on the portable path, Eigen's packets of the build's ISA. (Until session 31
 * float was on Eigen's packets too: a build without -march took SSE2's, and decoding 16 query
 * rows over 65536 keys spent a third of its time here.)
 */
template <typename Acc>
Acc expShiftedSum(Acc* x, Index n, Acc m) {
  if constexpr (std::is_same_v<Acc, float>) {
    float sum;
    if (fast::expShiftedSum(x, n, m, sum)) return sum;
  }
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<Acc>::type;
  constexpr Index W = ei::packet_traits<Acc>::size;
  constexpr Acc cut = kExpCut<Acc>;
  const Packet pm = ei::pset1<Packet>(m), pcut = ei::pset1<Packet>(cut);
  Packet total = ei::pset1<Packet>(Acc(0)), args = total;
  Index j = 0;
  for (; j + W <= n; j += W) {
    const Packet z = ei::psub(ei::ploadu<Packet>(x + j), pm);
    const Packet e = ei::pand(ei::pexp(z), ei::pcmp_lt(pcut, z));
    ei::pstoreu(x + j, e);
    total = ei::padd(total, e);
    args = ei::padd(args, z);
  }
  Acc sum = ei::predux(total), argSum = ei::predux(args);
  for (; j < n; ++j) {
    const Acc z = x[j] - m;
    x[j] = z > cut ? std::exp(z) : Acc(0);
    sum += x[j];
    argSum += z;
  }
  return std::isnan(argSum) ? argSum : sum;
}

/**
 * The weights of one row in one pass: p[j] = exp(x[j] - m) / l, exactly 0 where x[j] - m is at or
 * below the cut (hidden keys), for a row whose maximum m is finite (expShiftedSum's exp).
 */
template <typename Acc>
void expDivided(const Acc* x, Acc* p, Index n, Acc m, Acc l) {
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<Acc>::type;
  constexpr Index W = ei::packet_traits<Acc>::size;
  const Packet pm = ei::pset1<Packet>(m), pcut = ei::pset1<Packet>(kExpCut<Acc>), pl = ei::pset1<Packet>(l);
  Index j = 0;
  for (; j + W <= n; j += W) {
    const Packet z = ei::psub(ei::ploadu<Packet>(x + j), pm);
    ei::pstoreu(p + j, ei::pdiv(ei::pand(ei::pexp(z), ei::pcmp_lt(pcut, z)), pl));
  }
  for (; j < n; ++j) {
    const Acc z = x[j] - m;
    p[j] = z > kExpCut<Acc> ? std::exp(z) / l : Acc(0);
  }
}

/**
 * The backward's second pass over one row of a tile, in one sweep, for a row with a finite
 * maximum m, sum l and D = d, whose every 4 dp[j] is finite (the first pass's finding: dp - d
 * cannot overflow):
 *   p[j]  = exp(x[j] - m) / l (expDivided's weights; 0 at or below the cut),
 *   dL_j  = p[j] (dp[j] - d),              returned: sum_j dL_j (f[j] - c) over the j with dL_j != 0
 *   dp[j] = dL_j tau                       (f may be -inf where the weight is 0: a hidden key)
 * The same values as expDivided, then p (dp - d), centredDotSkippingZeros and dp *= tau, without
 * reading and writing the row four times.
 */
template <typename Acc>
Acc softmaxGradientRow(const Acc* x, const Acc* f, Acc* p, Acc* dp, Index n, Acc m, Acc l, Acc d, Acc c, Acc tau) {
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<Acc>::type;
  constexpr Index W = ei::packet_traits<Acc>::size;
  const Packet pm = ei::pset1<Packet>(m), pcut = ei::pset1<Packet>(kExpCut<Acc>), pl = ei::pset1<Packet>(l),
               pd = ei::pset1<Packet>(d), pc = ei::pset1<Packet>(c), ptau = ei::pset1<Packet>(tau),
               zero = ei::pset1<Packet>(Acc(0));
  Packet total = zero;
  Index j = 0;
  for (; j + W <= n; j += W) {
    const Packet z = ei::psub(ei::ploadu<Packet>(x + j), pm);
    const Packet w = ei::pdiv(ei::pand(ei::pexp(z), ei::pcmp_lt(pcut, z)), pl);
    ei::pstoreu(p + j, w);
    const Packet dl = ei::pmul(w, ei::psub(ei::ploadu<Packet>(dp + j), pd));
    const Packet term = ei::pmul(dl, ei::psub(ei::ploadu<Packet>(f + j), pc));
    total = ei::padd(total, ei::pandnot(term, ei::pcmp_eq(dl, zero)));
    ei::pstoreu(dp + j, ei::pmul(dl, ptau));
  }
  Acc sum = ei::predux(total);
  for (; j < n; ++j) {
    const Acc z = x[j] - m;
    p[j] = z > kExpCut<Acc> ? std::exp(z) / l : Acc(0);
    const Acc dl = p[j] * (dp[j] - d);
    if (dl != Acc(0)) sum += dl * (f[j] - c);
    dp[j] = dl * tau;
  }
  return sum;
}

/// What expShiftedSumDot returns.
template <typename Acc>
struct ExpSumDot {
  Acc sum, dot;
  bool wHeadroom;  ///< every 4 w[j] is finite (whatever its weight): |w| <= max / 4, no inf or NaN
};

/**
 * expShiftedSum without storing the weights, also returning dot = sum_j e_j w[j], e_j =
 * exp(x[j] - m), over the j whose weight is not 0 (w may be inf or NaN elsewhere), and whether
 * every 4 w[j] is finite (the backward's dP: a GEMM may read it, and dP - D may be formed at
 * every key, only then; see allWithHeadroom). sum is NaN if some x[j] is NaN.
 */
template <typename Acc>
ExpSumDot<Acc> expShiftedSumDot(const Acc* x, const Acc* w, Index n, Acc m) {
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<Acc>::type;
  constexpr Index W = ei::packet_traits<Acc>::size;
  const Packet pm = ei::pset1<Packet>(m), pcut = ei::pset1<Packet>(kExpCut<Acc>), four = ei::pset1<Packet>(Acc(4));
  Packet total = ei::pset1<Packet>(Acc(0)), args = total, dot = total, wZero = total;
  Index j = 0;
  for (; j + W <= n; j += W) {
    const Packet z = ei::psub(ei::ploadu<Packet>(x + j), pm);
    const Packet e = ei::pand(ei::pexp(z), ei::pcmp_lt(pcut, z));
    const Packet pw = ei::ploadu<Packet>(w + j);
    total = ei::padd(total, e);
    args = ei::padd(args, z);
    wZero = ei::padd(wZero, ei::pmul(ei::pmul(pw, four), ei::pzero(pw)));  // NaN iff some 4 w is not finite
    // A weight that is 0 (hidden, or exp underflowed) adds nothing, not 0 * w.
    dot = ei::padd(dot, ei::pandnot(ei::pmul(e, pw), ei::pcmp_eq(e, ei::pzero(e))));
  }
  Acc sum = ei::predux(total), argSum = ei::predux(args), d = ei::predux(dot), zero = ei::predux(wZero);
  for (; j < n; ++j) {
    const Acc z = x[j] - m;
    const Acc e = z > kExpCut<Acc> ? std::exp(z) : Acc(0);
    sum += e;
    if (e != Acc(0)) d += e * w[j];
    zero += w[j] * Acc(4) * Acc(0);
    argSum += z;
  }
  return {std::isnan(argSum) ? argSum : sum, d, !std::isnan(zero)};
}

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
      // The plain maximum (maxCoeff<PropagateNaN> blends every packet: 10% of a forward). A
      // NaN it misses makes expShiftedSum's sum NaN, or, if it saw only -inf, the scan below.
      const Acc tileMax = row.maxCoeff();
      const Acc mNew = m(i) > tileMax ? m(i) : tileMax;
      // NaN or +inf: no finite softmax. Then, or with nothing visible yet, the weights are 0.
      if (!(tileMax < kInf) || (mNew == -kInf && row.hasNaN())) m_bad[size_t(i)] = 1;
      if (m_bad[size_t(i)] || mNew == -kInf) {
        row.setZero();
        continue;
      }
      const Acc tileSum = expShiftedSum(s.row(i).data(), s.cols(), mNew);
      if (std::isnan(tileSum)) {
        m_bad[size_t(i)] = 1;
        row.setZero();
        continue;
      }
      const Acc alpha = std::exp(m(i) - mNew);  // 0 at the first visible tile, 1 if the max held
      l(i) = alpha * l(i) + tileSum;
      // alpha = 0: the earlier keys' weights are exactly 0 now, and a weight of 0 has no effect
      // even on a non-finite value (acc *= 0 would turn an inf from an earlier tile into NaN).
      if (alpha == Acc(0))
        a.row(i).setZero();
      else if (alpha != Acc(1))
        a.row(i) *= alpha;
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
      // A side whose factor is 0 has all its weights exactly 0 in the merged softmax: it is left
      // out, not multiplied by 0 (its acc may hold the inf of a value no longer weighted). One
      // factor is exp(0) = 1, so y = 0 leaves a as it is.
      if (x == Acc(0))
        a.row(i) = y * b.row(i);
      else if (y != Acc(0))
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
    // out is a block of a column-major n_q x (H d_v) matrix: written row by row, each element
    // would land in another page (4% of a forward at n = 8192). So the rows are scaled as one
    // block, written in out's own order, and the rare bad or empty rows overwritten after.
    const bool hasOut = out.cols() > 0;  // d_v = 0: out may be a null block, no row() of it
    VecMap r(m_scale.get(m_rows), m_rows);
    for (Index i = 0; i < m_rows; ++i) r(i) = m_bad[size_t(i)] || m(i) == -kInf ? Acc(0) : Acc(1) / l(i);
    if (hasOut) out = (r.asDiagonal() * a).template cast<Out>();
    for (Index i = 0; i < m_rows; ++i) {
      if (m_bad[size_t(i)]) {
        if (hasOut) out.row(i).setConstant(Out(std::numeric_limits<Acc>::quiet_NaN()));
        lse(i) = std::numeric_limits<Lse>::quiet_NaN();
      } else if (m(i) == -kInf) {
        if (hasOut) out.row(i).setZero();
        lse(i) = -std::numeric_limits<Lse>::infinity();
      } else {
        lse(i) = Lse(m(i) + std::log(l(i)));
      }
    }
  }

 private:
  static constexpr Acc kInf = std::numeric_limits<Acc>::infinity();
  Index m_rows = 0, m_dV = 0;
  Buffer<Acc> m_acc, m_max, m_sum, m_scale;
  std::vector<unsigned char> m_bad;
};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_ONLINE_SOFTMAX_HPP
