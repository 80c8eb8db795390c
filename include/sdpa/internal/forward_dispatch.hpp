#ifndef SDPA_INTERNAL_FORWARD_DISPATCH_HPP
#define SDPA_INTERNAL_FORWARD_DISPATCH_HPP

/*
 * The route of every forward entry point (single-head, multi-head, batched; sdpa/forward.hpp and
 * sdpa/multihead.hpp): the run-time checks of a call, then batchedForwardInto, the one place that
 * reduces the scale policy to per-head taus (HeadTaus), folds a key-count scale into q, and picks
 * the kernel: tiled (internal/forward_tiled.hpp, which picks its fast, general and decoding
 * paths) or naive (internal/forward_naive.hpp, the reference). A single head is Heads{1} of one
 * item.
 */

#include <algorithm>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../diagnostics_sink.hpp"
#include "../dropout.hpp"
#include "../kernel.hpp"
#include "../layout.hpp"
#include "../mask.hpp"
#include "../scale.hpp"
#include "checks.hpp"
#include "forward_naive.hpp"
#include "forward_tiled.hpp"
#include "input_moments.hpp"
#include "key_count_scale.hpp"
#include "macros.hpp"
#include "parallel.hpp"

namespace sdpa::internal {

/// The checks every single-head entry point makes before computing anything.
template <typename Mask>
void checkForward(const char* where, Index qRows, Index qCols, Index kRows, Index kCols, Index vRows, Index vCols,
                  const Mask& mask) {
  checkAttentionShapes(where, qRows, qCols, kRows, kCols, vRows, vCols);
  mask.check(where, qRows, kRows);
}

/// A DiagnosticsSink's state between startSink and finishSink: each query head's rows, which
/// the kernel fills, and the O(n d_k) moments of each query head's q, then each kv head's k.
struct SinkStart {
  std::vector<RowStats*> rows;
  std::vector<Moments> moments;
};

/// f of SinkStart::moments[i]'s head block: q's of query head i for i < H, else k's of kv head
/// i - H (n x d_k).
template <typename DQ, typename DK, typename F>
auto onMomentBlock(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Heads& heads, Index dK,
                   Index i, F&& f) {
  if (i < heads.query) return f(q.middleCols(i * dK, dK));
  return f(k.middleCols((i - heads.query) * dK, dK));
}

/// Sizes `sink` for a call of `heads` query heads over q's rows; the moments are taken on the
/// threads the forward will use.
template <typename DQ, typename DK>
SinkStart startSink(DiagnosticsSink& sink, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Heads& heads, Index dK) {
  sink.start(heads.query, q.rows());
  SinkStart s{std::vector<RowStats*>(size_t(heads.query)), std::vector<Moments>(size_t(heads.query + heads.keyValue))};
  parallelFor(Index(s.moments.size()), maxThreads(), [&](Index i) {
    s.moments[size_t(i)] = onMomentBlock(q, k, heads, dK, i, [](const auto& x) { return moments(x, false); });
  });
  for (Index h = 0; h < heads.query; ++h) s.rows[size_t(h)] = sink.rows(h).data();
  return s;
}

/**
 * Records each head's inputs of the summaries (HeadInputs) once the kernel has filled its rows.
 * <Gq, Gk>_F comes from the rows' raw sums (streamedInner, O(n d_k)) where every row saw every
 * key and the means do not dominate; else from the centred Gram matrices (O(n d_k^2) a head,
 * a tenth of the forward's work at n = 1024, d_k = 128), each kv head's once for its group.
 */
template <typename DQ, typename DK, typename Acc>
void finishSink(DiagnosticsSink& sink, SinkStart& s, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                const Heads& heads, Index dK, const HeadTaus<Acc>& taus) {
  const Index nQ = q.rows(), nK = k.rows();
  const auto kvOf = [&](Index h) { return heads.query + h / heads.groupSize(); };
  std::vector<double> inner(size_t(heads.query), 0.0);
  std::vector<Index> grams;  // the moments whose Gram matrix a head needs
  for (Index h = 0; h < heads.query && nQ > 1 && nK > 1; ++h) {
    const std::vector<RowStats>& rows = sink.rows(h);
    double& x = inner[size_t(h)];
    x = std::numeric_limits<double>::quiet_NaN();
    if (std::all_of(rows.begin(), rows.end(), [&](const RowStats& r) { return r.visible == nK; })) {
      double sumR2 = 0;
      for (const RowStats& r : rows) sumR2 += r.rawSumSq;
      const Index g = kvOf(h);
      x = streamedInner(sumR2, q.middleCols(h * dK, dK), s.moments[size_t(h)], k.middleCols((g - heads.query) * dK, dK),
                        s.moments[size_t(g)]);
    }
    if (!(x >= 0)) grams.insert(grams.end(), {h, kvOf(h)});
  }
  std::sort(grams.begin(), grams.end());
  grams.erase(std::unique(grams.begin(), grams.end()), grams.end());
  parallelFor(Index(grams.size()), maxThreads(), [&](Index j) {
    Moments& m = s.moments[size_t(grams[size_t(j)])];
    m.gram = onMomentBlock(q, k, heads, dK, grams[size_t(j)], [&](const auto& x) { return centredGram(x, m.mean); });
  });
  for (Index h = 0; h < heads.query; ++h) {
    const Moments &mq = s.moments[size_t(h)], &mk = s.moments[size_t(kvOf(h))];
    if (!(inner[size_t(h)] >= 0)) inner[size_t(h)] = gramInner(mq, mk);
    sink.inputs(h) = headInputs(mq, mk, inner[size_t(h)], dK, nQ, nK, double(taus.tau(h)));
  }
}

/// Checks the packed shapes against the head layout and returns each head's d_k and d_v.
inline HeadDims checkHeads(const char* where, const Heads& heads, Index qRows, Index qCols, Index kRows, Index kCols,
                           Index vRows, Index vCols) {
  const auto n = [](Index x) { return std::to_string(x); };
  if (heads.query < 1 || heads.keyValue < 1 || heads.query % heads.keyValue != 0)
    throwInvalid(where, "Heads{" + n(heads.query) + ", " + n(heads.keyValue) +
                            "}: need H >= 1 query heads and H_kv >= 1 kv heads with H_kv dividing H");
  if (qCols % heads.query != 0)
    throwInvalid(where, "q is " + shapeString(qRows, qCols) + ": its " + n(qCols) + " columns do not split into " +
                            n(heads.query) + " heads");
  const Index dK = qCols / heads.query;
  if (kCols != heads.keyValue * dK)
    throwInvalid(where, "q is " + shapeString(qRows, qCols) + " (" + n(heads.query) + " heads of d_k = " + n(dK) +
                            ") so k must have " + n(heads.keyValue) + " x " + n(dK) + " = " + n(heads.keyValue * dK) +
                            " columns, but k is " + shapeString(kRows, kCols));
  if (vCols % heads.keyValue != 0)
    throwInvalid(where, "v is " + shapeString(vRows, vCols) + ": its " + n(vCols) + " columns do not split into " +
                            n(heads.keyValue) + " kv heads");
  if (kRows != vRows)
    throwInvalid(where, "k is " + shapeString(kRows, kCols) + " and v is " + shapeString(vRows, vCols) +
                            ": k and v must have the same number of rows (n_k)");
  return {dK, vCols / heads.keyValue};
}

template <typename Scale>
void checkScaleHeads(const char* where, const Scale& scale, Index heads) {
  if constexpr (scale::IsPerHead<Scale>) {
    if (scale.size() != heads)
      throwInvalid(where, "the PerHead scale has " + std::to_string(scale.size()) + " policies for " +
                              std::to_string(heads) + " heads");
  }
}

template <typename Scalar, typename Mask>
void multiHeadForward(const ConstRef<Scalar>& q, const ConstRef<Scalar>& k, const ConstRef<Scalar>& v,
                      const Heads& heads, const HeadDims& dims, const HeadTaus<Scalar>& taus, const Mask& mask,
                      const Dropout& dropout, const BatchLayout& layout, Eigen::Ref<Matrix<Scalar>> out,
                      Eigen::Ref<Matrix<Scalar>> lse, DiagnosticsSink* sink) {
  typename forward_naive_impl<Scalar>::Scratch scratch;
  SinkStart started;
  if (sink) started = startSink(*sink, q, k, heads, dims.dK);
  forEachItemHead(layout, heads, [&](const ItemHead& u) {
    forward_naive_impl<Scalar>::run(
        headBlock(q, u.q0, u.head * dims.dK, u.nQ, dims.dK), headBlock(k, u.k0, u.kvHead * dims.dK, u.nK, dims.dK),
        headBlock(v, u.k0, u.kvHead * dims.dV, u.nK, dims.dV), taus.tau(u.head), itemMask(mask, u), dropout, u.head,
        u.q0, u.k0, headBlock(out, u.q0, u.head * dims.dV, u.nQ, dims.dV), lse.col(u.head).segment(u.q0, u.nQ), scratch,
        sink ? &sink->rows(u.head) : nullptr);
  });
  if (sink) finishSink(*sink, started, q, k, heads, dims.dK, taus);
}

inline void checkLayout(const char* where, const BatchLayout& l, Index qRows, Index kRows) {
  const auto n = [](Index x) { return std::to_string(x); };
  const size_t items = l.qOffsets.size();
  if (items < 1 || l.kOffsets.size() != items)
    throwInvalid(where, "the batch layout needs B + 1 query and key offsets, got " + n(Index(l.qOffsets.size())) +
                            " and " + n(Index(l.kOffsets.size())));
  if (l.qOffsets.front() != 0 || l.kOffsets.front() != 0) throwInvalid(where, "the batch offsets must start at 0");
  for (size_t b = 0; b + 1 < items; ++b)
    if (l.qOffsets[b + 1] < l.qOffsets[b] || l.kOffsets[b + 1] < l.kOffsets[b])
      throwInvalid(where, "the batch offsets must not decrease (item " + n(Index(b)) + ")");
  if (l.qOffsets.back() != qRows || l.kOffsets.back() != kRows)
    throwInvalid(where, "the batch offsets end at " + n(l.qOffsets.back()) + " query and " + n(l.kOffsets.back()) +
                            " key rows, but q has " + n(qRows) + " rows and k has " + n(kRows));
  const size_t b = items - 1;
  if (!l.queryLengths.empty() && l.queryLengths.size() != b)
    throwInvalid(where,
                 "queryLengths has " + n(Index(l.queryLengths.size())) + " entries for " + n(Index(b)) + " items");
  if (!l.keyLengths.empty() && l.keyLengths.size() != b)
    throwInvalid(where, "keyLengths has " + n(Index(l.keyLengths.size())) + " entries for " + n(Index(b)) + " items");
  for (size_t i = 0; i < b; ++i) {
    if (!l.queryLengths.empty() && (l.queryLengths[i] < 0 || l.queryLengths[i] > l.qOffsets[i + 1] - l.qOffsets[i]))
      throwInvalid(where, "queryLengths[" + n(Index(i)) + "] = " + n(l.queryLengths[i]) + " is outside [0, " +
                              n(l.qOffsets[i + 1] - l.qOffsets[i]) + "]");
    if (!l.keyLengths.empty() && (l.keyLengths[i] < 0 || l.keyLengths[i] > l.kOffsets[i + 1] - l.kOffsets[i]))
      throwInvalid(where, "keyLengths[" + n(Index(i)) + "] = " + n(l.keyLengths[i]) + " is outside [0, " +
                              n(l.kOffsets[i + 1] - l.kOffsets[i]) + "]");
  }
}

/// Every run-time check of a multi-head or batched call; returns each head's d_k and d_v.
template <typename Scale, typename Mask>
HeadDims checkBatch(const char* where, Index qRows, Index qCols, Index kRows, Index kCols, Index vRows, Index vCols,
                    const BatchLayout& layout, const Heads& heads, const Scale& scale, const Mask& mask,
                    const Dropout& dropout) {
  const HeadDims dims = checkHeads(where, heads, qRows, qCols, kRows, kCols, vRows, vCols);
  checkScaleHeads(where, scale, heads.query);
  checkLayout(where, layout, qRows, kRows);
  for (Index b = 0; b < layout.size(); ++b)
    mask.check(where, layout.qOffsets[size_t(b) + 1] - layout.qOffsets[size_t(b)],
               layout.kOffsets[size_t(b) + 1] - layout.kOffsets[size_t(b)], heads.query);
  dropout.check(where);
  return dims;
}

/// The multi-head and batched forward of either kernel (a sink's rows from either) into
/// sized outputs, after checkBatch: out (sum n_q) x (H d_v), lse (sum n_q) x H.
template <typename Out, typename Kernel, typename DQ, typename DK, typename DV, typename Scale, typename Mask>
void batchedForwardInto(const char* where, const Kernel& kern, const Eigen::MatrixBase<DQ>& q,
                        const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v, const BatchLayout& layout,
                        const Heads& heads, const HeadDims& dims, const Scale& scale, const Mask& mask,
                        const Dropout& dropout, DiagnosticsSink* sink, Eigen::Ref<Matrix<Out>> out,
                        Eigen::Ref<Matrix<Accumulator<typename DQ::Scalar>>> lse) {
  using In = typename DQ::Scalar;
  using Acc = Accumulator<In>;
  const HeadTaus<Acc> taus(scale, heads.query, dims.dK);
  if constexpr (scale::DependsOnKeyCount<Scale>) {
    // tau_i = tau_h r(n_i): the same call on q' = r q with the per-head taus.
    forwardRowScaled<Scale>(where, sink != nullptr, q, k, v, layout, heads, dims.dK, mask, out,
                            [&](const auto& qs, const auto& kx, const auto& vx, auto o) {
                              batchedForwardInto<typename decltype(o)::Scalar>(
                                  where, kern, qs, kx, vx, layout, heads, dims, taus, mask, dropout, nullptr, o, lse);
                            });
  } else {
    if constexpr (std::is_same_v<Kernel, kernel::Tiled>) {
      SinkStart started;
      if (sink) started = startSink(*sink, q, k, heads, dims.dK);
      withInputViews<In>(
          [&](const auto& qv, const auto& kv, const auto& vv) {
            forwardTiled<In, Out, std::decay_t<decltype(qv)>, std::decay_t<decltype(kv)>, std::decay_t<decltype(vv)>>(
                kern, qv, kv, vv, layout, heads, dims, taus, mask, dropout, out, lse,
                sink ? started.rows.data() : nullptr);
          },
          q, k, v);
      if (sink) finishSink(*sink, started, q, k, heads, dims.dK, taus);
    } else if constexpr (std::is_same_v<Out, Acc>) {
      multiHeadForward<Acc>(q.template cast<Acc>(), k.template cast<Acc>(), v.template cast<Acc>(), heads, dims, taus,
                            mask, dropout, layout, out, lse, sink);
    } else {
      Matrix<Acc> outAcc(out.rows(), out.cols());
      multiHeadForward<Acc>(q.template cast<Acc>(), k.template cast<Acc>(), v.template cast<Acc>(), heads, dims, taus,
                            mask, dropout, layout, outAcc, lse, sink);
      out = outAcc.template cast<Out>();
    }
  }
}

/**
 * The single-head forward into sized outputs (output n_q x d_v, lse n_q), after the checks: one
 * item of one head (Heads{1}) on the route of every other forward.
 */
template <typename Out, typename Kernel, typename DQ, typename DK, typename DV, typename Scale, typename Mask>
void forwardInto(const char* where, const Kernel& kern, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Scale& scale, const Mask& mask, const Dropout& dropout,
                 DiagnosticsSink* sink, Eigen::Ref<Matrix<Out>> output,
                 Eigen::Ref<Vector<Accumulator<typename DQ::Scalar>>> lse) {
  Eigen::Map<Matrix<Accumulator<typename DQ::Scalar>>> lseColumn(lse.data(), lse.size(), 1);
  batchedForwardInto<Out>(where, kern, q, k, v, singleItem(q.rows(), k.rows()), Heads{1}, HeadDims{q.cols(), v.cols()},
                          scale, mask, dropout, sink, output, lseColumn);
}

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_FORWARD_DISPATCH_HPP
