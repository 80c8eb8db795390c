/**
 * \file sdpa/internal/erased_mask.hpp
 * \brief The kernels' one mask type: a mask of any type behind a table of its operations.
 */
#ifndef SDPA_INTERNAL_ERASED_MASK_HPP
#define SDPA_INTERNAL_ERASED_MASK_HPP

#include <type_traits>

#include "../layout.hpp"
#include "../mask.hpp"
#include "forward_naive.hpp"
#include "macros.hpp"

namespace sdpa::internal {

/**
 * A mask as the tiled kernels and KvCache decoding see it: its classify and apply behind one
 * table of functions per mask type, its compile-time properties (none, only hides, has a bias,
 * its softcap) as values. The kernels are then compiled once per precision and input layout, not
 * once per mask type: every mask, combination and wrapper (padded items, context parallelism's
 * blocks) used to instantiate them whole (issue #15's template fan-out: the forward test group's
 * tiled forward 63 instantiations, now 8; its compile 10-14% shorter, the tiled, backward and
 * fuzz groups' 18-22%). A tile costs one indirect call to classify and, when it is partial, one to
 * apply, against its O(tile d) products (the fast kernels' row groups of a partial tile classify
 * 16 keys a call: about 6 ns more a call than inlined, a causal forward's 0.3%); the mask's own
 * code is still compiled for its type, and its stages still run in the order Combined gives
 * them. `itemMask` gives the mask a padded item sees (the same AlignedToLengths, QueryLength and
 * KeyLength as for any mask, rebuilt from three values inside each call). Holds a pointer to the
 * mask: valid while the caller's mask lives. It has no IsNone, HasBias or MaskStage: a kernel
 * that asks at compile time does not compile.
 */
template <typename Acc>
class ErasedMask {
 public:
  /// The tiles the kernels mask: row-major (the tiled kernels' tiles), column-major with a
  /// stride (the fast kernels' row groups). S(i, j) is the logit of the tile's query i, key j.
  using RowTile = Eigen::Map<RowMajorMatrix<Acc>>;
  using ColumnTile = Eigen::Map<Matrix<Acc>, 0, Eigen::OuterStride<>>;

  template <typename M>
  explicit ErasedMask(const M& m)
      : m_mask(&m),
        m_ops(&kOps<M>),
        m_none(M::IsNone),
        m_onlyHides(mask::internal::OnlyHides<M>::value),
        m_hasBias(M::HasBias),
        m_softcap(mask::internal::softcapOf(m)) {
    static_assert(!std::is_same_v<M, ErasedMask>, "an ErasedMask is copied, not erased again");
  }

  /// The mask hides nothing and adds nothing (mask::None).
  bool none() const { return m_none; }
  /// Every part hides (sets logits to -inf) and nothing else: it commutes with a positive scale.
  bool onlyHides() const { return m_onlyHides; }
  bool hasBias() const { return m_hasBias; }
  /// The cap of its first Softcap, or 0.
  double softcap() const { return m_softcap; }

  mask::Tile classify(Index row0, Index rows, Index col0, Index cols, Index nQ, Index nK, Index head = 0) const {
    return m_ops->classify(*this, row0, rows, col0, cols, nQ, nK, head);
  }
  void apply(RowTile tile, Index row0, Index col0, Index nQ, Index nK, Index head = 0) const {
    m_ops->applyRows(*this, tile, row0, col0, nQ, nK, head);
  }
  void apply(ColumnTile tile, Index row0, Index col0, Index nQ, Index nK, Index head = 0) const {
    m_ops->applyColumns(*this, tile, row0, col0, nQ, nK, head);
  }

  /// The mask item u of a packed batch sees (layout.hpp's itemMask of the caller's mask; m is the
  /// caller's whole mask, not an item's).
  friend ErasedMask itemMask(const ErasedMask& m, const ItemHead& u) {
    ErasedMask item = m;
    item.m_item = true;
    item.m_shift = itemShift(u);
    item.m_queryLength = u.queryLength;
    item.m_keyLength = u.keyLength;
    return item;
  }
  /// Whether a sink's raw q.k is the logit over tau (forward_naive.hpp's, for any mask).
  template <typename Scalar>
  friend bool rawIsLogitOverTau(const ErasedMask& m, Scalar tau) {
    return rawIsLogitOverTau(m.hasBias(), m.softcap(), tau);
  }

 private:
  struct Ops {
    mask::Tile (*classify)(const ErasedMask&, Index, Index, Index, Index, Index, Index, Index);
    void (*applyRows)(const ErasedMask&, RowTile&, Index, Index, Index, Index, Index);
    void (*applyColumns)(const ErasedMask&, ColumnTile&, Index, Index, Index, Index, Index);
  };

  /// The mask of type M as the item it was restricted to sees it; a whole call's mask is the
  /// item mask of lengths n_q, n_k (which restricts nothing), so each operation has one path.
  template <typename M>
  static auto itemOf(const ErasedMask& e, Index nQ, Index nK) {
    const M& m = *static_cast<const M*>(e.m_mask);
    return e.m_item ? itemMask(m, e.m_shift, e.m_queryLength, e.m_keyLength) : itemMask(m, 0, nQ, nK);
  }
  template <typename M>
  static mask::Tile classifyAs(const ErasedMask& e, Index row0, Index rows, Index col0, Index cols, Index nQ, Index nK,
                               Index head) {
    return itemOf<M>(e, nQ, nK).classify(row0, rows, col0, cols, nQ, nK, head);
  }
  template <typename M, typename Tile>
  static void applyAs(const ErasedMask& e, Tile& tile, Index row0, Index col0, Index nQ, Index nK, Index head) {
    itemOf<M>(e, nQ, nK).apply(tile, row0, col0, nQ, nK, head);
  }
  /// The column tiles are the fast kernels', which are float's only.
  template <typename M>
  static constexpr auto applyColumnsAs() {
    if constexpr (std::is_same_v<Acc, float>)
      return &applyAs<M, ColumnTile>;
    else
      return decltype(Ops::applyColumns){nullptr};
  }
  template <typename M>
  static constexpr Ops kOps{&classifyAs<M>, &applyAs<M, RowTile>, applyColumnsAs<M>()};

  const void* m_mask;
  const Ops* m_ops;
  bool m_none, m_onlyHides, m_hasBias;
  double m_softcap;
  bool m_item = false;  // restricted to a padded item: itemMask(mask, shift, lengths)
  Index m_shift = 0, m_queryLength = 0, m_keyLength = 0;
};

template <typename T>
struct IsErasedMask : std::false_type {};
template <typename Acc>
struct IsErasedMask<ErasedMask<Acc>> : std::true_type {};

}  // namespace sdpa::internal

#endif  // SDPA_INTERNAL_ERASED_MASK_HPP
