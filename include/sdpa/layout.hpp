/**
 * \file sdpa/layout.hpp
 * \brief How heads and batch items are packed into one matrix: `Heads` and `BatchLayout`.
 */
#ifndef SDPA_LAYOUT_HPP
#define SDPA_LAYOUT_HPP

#include <array>
#include <utility>
#include <vector>

#include "internal/macros.hpp"
#include "mask.hpp"
#include "scale.hpp"

namespace sdpa {

/// \brief The head layout: H query heads sharing H_kv key/value heads. `Heads{8}` is MHA,
/// `Heads{8, 2}` GQA, `Heads{8, 1}` MQA.
struct Heads {
  Index query;
  Index keyValue;

  explicit Heads(Index h) : query(h), keyValue(h) {}
  Heads(Index h, Index hKv) : query(h), keyValue(hKv) {}
  /// Query heads per kv head.
  Index groupSize() const { return query / keyValue; }
};

/**
 * \brief Sequences of different lengths in one packed matrix, FlashAttention's varlen layout:
 * item b owns query rows [qOffsets[b], qOffsets[b+1]) and key/value rows [kOffsets[b],
 * kOffsets[b+1]). Optional valid lengths mark padding inside an item: keys at or beyond
 * keyLengths[b] are hidden, query rows at or beyond queryLengths[b] give output 0. An item
 * computes what a call on its valid rows alone computes: `mask::Align::LowerRight` aligns the
 * last valid query with the last valid key (not the last padded ones).
 */
struct BatchLayout {
  std::vector<Index> qOffsets;      ///< B + 1 cumulative query row offsets, from 0
  std::vector<Index> kOffsets;      ///< B + 1 cumulative key row offsets, from 0
  std::vector<Index> queryLengths;  ///< empty, or B valid query lengths
  std::vector<Index> keyLengths;    ///< empty, or B valid key lengths

  /// FlashAttention's `cu_seqlens_q`, `cu_seqlens_k`.
  static BatchLayout varlen(std::vector<Index> cuSeqlensQ, std::vector<Index> cuSeqlensK) {
    return BatchLayout{std::move(cuSeqlensQ), std::move(cuSeqlensK), {}, {}};
  }
  /// B items padded to n_q query and n_k key rows each, with their valid lengths (JAX
  /// `query_seq_lengths`, `key_value_seq_lengths`); an empty list means no padding there.
  static BatchLayout padded(Index batch, Index nQ, Index nK, std::vector<Index> queryLengths,
                            std::vector<Index> keyLengths) {
    BatchLayout l;
    for (Index b = 0; b <= batch; ++b) {
      l.qOffsets.push_back(b * nQ);
      l.kOffsets.push_back(b * nK);
    }
    l.queryLengths = std::move(queryLengths);
    l.keyLengths = std::move(keyLengths);
    return l;
  }
  Index size() const { return qOffsets.empty() ? 0 : Index(qOffsets.size()) - 1; }
};

namespace internal {

struct HeadDims {
  Index dK, dV;
};

/// The scale policy of query head h: its own entry of a PerHead, or the shared policy.
template <typename Scale>
const auto& headScale(const Scale& scale, Index h) {
  if constexpr (scale::IsPerHead<Scale>)
    return scale.head(h);
  else
    return scale;
}

/// A scale policy reduced to its value for every query head (HeadTaus; FixedTau for one), in the
/// kernels' precision S, computed once per call by the policy itself (`policy.value<S>(d_k)`, so
/// every value is the one the policy defines). HeadTaus' constructor is the one place a policy
/// becomes a number: every entry point builds one, and the kernels (naive, tiled, decoding,
/// forward and backward) take these plain per-head values, so they are compiled once per
/// precision and mask, not once more per policy type. A key-count scale (LogN) is reduced to
/// its row-independent part here and its row factors are folded into q (key_count_scale.hpp).
/// A tau of exactly 1 (None) skips its multiply at run time.
template <typename S>
struct FixedTau {
  static constexpr bool IsScalePolicy = true;
  static constexpr bool IsLearnable = false;
  S tau;
  template <typename T = double>
  T value(Index /*headDim*/) const {
    return T(tau);
  }
};
template <typename S>
class HeadTaus {
 public:
  static constexpr bool IsScalePolicy = true;
  static constexpr bool IsPerHead = true;
  static constexpr bool IsLearnable = false;
  /// `scale` must have been checked against `heads` (checkScaleHeads).
  template <typename Scale>
  HeadTaus(const Scale& scale, Index heads, Index dK) : m_size(heads) {
    FixedTau<S>* taus = storage();
    for (Index h = 0; h < heads; ++h) taus[h] = {headScale(scale, h).template value<S>(dK)};
  }
  /// Heads [h0, h0 + count) of `all` (context parallelism's share of the heads).
  static HeadTaus subset(const HeadTaus& all, Index h0, Index count) { return HeadTaus(all, h0, count, 0); }
  Index size() const { return m_size; }
  const FixedTau<S>& head(Index h) const { return m_size > kInline ? m_more[size_t(h)] : m_inline[size_t(h)]; }
  S tau(Index h) const { return head(h).tau; }

 private:
  static constexpr Index kInline = 64;
  HeadTaus(const HeadTaus& all, Index h0, Index count, int /*subset*/) : m_size(count) {
    FixedTau<S>* taus = storage();
    for (Index h = 0; h < count; ++h) taus[h] = all.head(h0 + h);
  }
  /// Room for m_size taus: up to kInline without a heap allocation (an allocation-free call
  /// stays one).
  FixedTau<S>* storage() {
    if (m_size <= kInline) return m_inline.data();
    m_more.resize(size_t(m_size));
    return m_more.data();
  }
  Index m_size;
  std::array<FixedTau<S>, kInline> m_inline{};
  std::vector<FixedTau<S>> m_more;
};

/// One (batch item, query head) pair: the unit of parallel work. Rows q0..q0+nQ of q and
/// k0..k0+nK of k/v belong to the item; kvHead is the k/v column block the query head reads.
struct ItemHead {
  Index item, head, kvHead;
  Index q0, nQ, k0, nK;
  Index queryLength, keyLength;  ///< valid rows inside the item (padding beyond)
};

/// Calls f(ItemHead) for every (item, head) pair of a packed batch, items outer.
template <typename F>
void forEachItemHead(const BatchLayout& layout, const Heads& heads, F&& f) {
  for (Index b = 0; b < layout.size(); ++b) {
    const Index q0 = layout.qOffsets[size_t(b)], nQ = layout.qOffsets[size_t(b) + 1] - q0;
    const Index k0 = layout.kOffsets[size_t(b)], nK = layout.kOffsets[size_t(b) + 1] - k0;
    const Index qLen = layout.queryLengths.empty() ? nQ : layout.queryLengths[size_t(b)];
    const Index kLen = layout.keyLengths.empty() ? nK : layout.keyLengths[size_t(b)];
    for (Index h = 0; h < heads.query; ++h) f(ItemHead{b, h, h / heads.groupSize(), q0, nQ, k0, nK, qLen, kLen});
  }
}

/**
 * x.block(row, col, rows, cols) of a packed matrix, except that a block without columns starts
 * at row 0: a matrix without columns (d_k or d_v = 0) may have no data, and Eigen forms
 * data() + offset, undefined behaviour on null. The two blocks are equally empty.
 */
template <typename X>
auto headBlock(X&& x, Index row, Index col, Index rows, Index cols) {
  return x.block(cols == 0 ? 0 : row, col, rows, cols);
}

/// The user's mask restricted to the valid rows and keys of a padded item, its alignment
/// following the valid lengths (mask::internal::AlignedToLengths).
template <typename Mask>
auto itemMask(const Mask& mask, Index shift, Index queryLength, Index keyLength) {
  return mask::combine(mask::internal::AlignedToLengths<Mask>{mask, shift}, mask::QueryLength{queryLength},
                       mask::KeyLength{keyLength});
}
/// The shift of AlignedToLengths for item u: its valid lengths' diagonal against its rows'.
inline Index itemShift(const ItemHead& u) { return (u.keyLength - u.queryLength) - (u.nK - u.nQ); }
template <typename Mask>
auto itemMask(const Mask& mask, const ItemHead& u) {
  return itemMask(mask, itemShift(u), u.queryLength, u.keyLength);
}

/// The layout of a plain multi-head call: one item spanning every row. The calling thread's own
/// layout, rewritten by each call (no allocation after the first): valid until the thread's next
/// singleItem with other sizes, which within one entry point's call is never.
inline const BatchLayout& singleItem(Index qRows, Index kRows) {
  thread_local BatchLayout layout = BatchLayout::varlen({0, 0}, {0, 0});
  layout.qOffsets[1] = qRows;
  layout.kOffsets[1] = kRows;
  return layout;
}

}  // namespace internal
}  // namespace sdpa

#endif  // SDPA_LAYOUT_HPP
