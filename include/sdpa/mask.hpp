/**
 * \file sdpa/mask.hpp
 * \brief Masks: which keys each query may attend to, additive biases (bias matrices, ALiBi) and
 * the logit softcap, all composable with `mask::combine(...)`.
 *
 * A mask acts on the scaled logits S = tau * q k^T (n_q x n_k, one head) in three stages, in
 * this order whatever the order of composition:
 *  1. transforms of the scaled logits: `Softcap` (c tanh(s / c), Gemma 2);
 *  2. hiding: `Causal`, `SlidingWindow`, `KeyLength`, `QueryLength`, `Keep` set hidden
 *     positions to -inf by assignment, so whatever q.k was there (even NaN) is discarded;
 *  3. additive terms: `Bias`, `Alibi`, added only where the logit is not already -inf, so a
 *     bias entry at a hidden position is never read. They are never scaled.
 * A row with no visible key is "fully masked": output 0, logSumExp -inf.
 *
 * Every mask provides
 * - `check(where, n_q, n_k, heads)`: throws std::invalid_argument naming the shapes;
 * - `visible(i, j, n_q, n_k, head)`: whether query i sees key j (the definition);
 * - `classify(row0, rows, col0, cols, n_q, n_k, head)`: whether a whole tile is Hidden,
 *   Visible (the mask does nothing there) or Partial, so a tiled kernel can skip hidden tiles
 *   and apply the mask only where needed;
 * - `apply(tile, row0, col0, n_q, n_k, head)`: applies itself to the tile of S whose top-left
 *   entry is S(row0, col0). `head` is the query head (0 for single-head calls).
 */
#ifndef SDPA_MASK_HPP
#define SDPA_MASK_HPP

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "internal/checks.hpp"
#include "internal/macros.hpp"
#include "internal/math.hpp"

namespace sdpa::mask {

/// What a mask does to a whole tile of the logits.
enum class Tile {
  Hidden,   ///< every entry hidden: skip the tile
  Visible,  ///< the mask changes nothing in the tile
  Partial,  ///< apply the mask entry by entry
};

/// The stage at which a mask acts (see the file comment).
enum class Stage { Transform = 0, Hide = 1, Add = 2 };

/**
 * \brief How a causal or sliding-window mask lines up queries and keys when n_q != n_k. Always
 * spelled out, because the two conventions agree only for square attention.
 */
enum class Align {
  /// Query i sits at key position i. PyTorch `is_causal=True` (`tril(ones(L, S), 0)`).
  UpperLeft,
  /// Query i sits at key position i + n_k - n_q: the last query is aligned with the last key.
  /// FlashAttention `causal=True` and KV-cache decoding (`tril(ones(L, S), S - L)`). With
  /// n_q > n_k the first n_q - n_k queries see no key under a causal mask (output 0).
  LowerRight,
};

/// Key position of query i under an alignment: i + diagonalOffset(align, n_q, n_k).
inline Index diagonalOffset(Align align, Index nQ, Index nK) { return align == Align::UpperLeft ? 0 : nK - nQ; }

namespace internal {
template <typename Derived>
auto& writable(const Eigen::MatrixBase<Derived>& tile) {
  return const_cast<Eigen::MatrixBase<Derived>&>(tile);  // Eigen's idiom to write into blocks
}

/// Hides, in each row r of the tile, the keys outside [lo(r), hi(r)] (global key indices).
template <typename Derived, typename Lo, typename Hi>
void hideOutside(const Eigen::MatrixBase<Derived>& tile_, Index col0, Lo lo, Hi hi) {
  using Scalar = typename Derived::Scalar;
  auto& tile = writable(tile_);
  const Index cols = tile.cols();
  for (Index r = 0; r < tile.rows(); ++r) {
    const Index first = std::clamp<Index>(lo(r) - col0, 0, cols);        // first visible column
    const Index end = std::clamp<Index>(hi(r) + 1 - col0, first, cols);  // one past the last
    tile.row(r).head(first).setConstant(-std::numeric_limits<Scalar>::infinity());
    tile.row(r).tail(cols - end).setConstant(-std::numeric_limits<Scalar>::infinity());
  }
}

/// Classifies a tile against a band of visible keys [i + lo, i + hi] per query i.
inline Tile classifyBand(Index row0, Index rows, Index col0, Index cols, Index lo, Index hi) {
  // Row i sees [i + lo, i + hi]; over rows [row0, row0 + rows) and cols [col0, col0 + cols):
  const Index colLast = col0 + cols - 1, rowLast = row0 + rows - 1;
  if (colLast < row0 + lo || col0 > rowLast + hi) return Tile::Hidden;  // tile left of / right of every band
  if (col0 >= rowLast + lo && colLast <= row0 + hi) return Tile::Visible;
  return Tile::Partial;
}

constexpr Index kUnbounded = std::numeric_limits<Index>::max() / 4;  // far beyond any shape, no overflow
}  // namespace internal

/// \brief No mask: every query sees every key.
struct None {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = true;
  static constexpr bool HasBias = false;
  static constexpr Stage MaskStage = Stage::Hide;

  void check(const char*, Index, Index, Index = 1) const {}
  bool visible(Index, Index, Index, Index, Index = 0) const { return true; }
  Tile classify(Index, Index, Index, Index, Index, Index, Index = 0) const { return Tile::Visible; }
  template <typename Derived>
  void apply(const Eigen::MatrixBase<Derived>&, Index, Index, Index, Index, Index = 0) const {}
};

/// \brief Causal mask with an explicit alignment: `Causal{Align::UpperLeft}` hides key j from
/// query i when j > i + diagonalOffset.
struct Causal {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = false;
  static constexpr Stage MaskStage = Stage::Hide;

  Align align;

  void check(const char*, Index, Index, Index = 1) const {}
  bool visible(Index i, Index j, Index nQ, Index nK, Index = 0) const { return j <= i + diagonalOffset(align, nQ, nK); }
  Tile classify(Index row0, Index rows, Index col0, Index cols, Index nQ, Index nK, Index = 0) const {
    const Index off = diagonalOffset(align, nQ, nK);
    return internal::classifyBand(row0, rows, col0, cols, -internal::kUnbounded, off);
  }
  template <typename Derived>
  void apply(const Eigen::MatrixBase<Derived>& tile, Index row0, Index col0, Index nQ, Index nK, Index = 0) const {
    const Index off = diagonalOffset(align, nQ, nK);
    internal::hideOutside(
        tile, col0, [](Index) { return Index(0); }, [=](Index r) { return row0 + r + off; });
  }
};

/**
 * \brief Local attention, FlashAttention's `window_size=(left, right)`: query i sees key j iff
 * p - left <= j <= p + right, where p = i + diagonalOffset is the query's key position under the
 * alignment. A negative bound is unbounded (FlashAttention's -1). `SlidingWindow{w, 0, align}`
 * is causal local attention over the last w + 1 keys.
 */
struct SlidingWindow {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = false;
  static constexpr Stage MaskStage = Stage::Hide;

  Index left;
  Index right;
  Align align;

  Index lowOffset() const { return left < 0 ? -internal::kUnbounded : -left; }
  Index highOffset() const { return right < 0 ? internal::kUnbounded : right; }

  void check(const char*, Index, Index, Index = 1) const {}
  bool visible(Index i, Index j, Index nQ, Index nK, Index = 0) const {
    const Index p = i + diagonalOffset(align, nQ, nK);
    return j >= p + lowOffset() && j <= p + highOffset();
  }
  Tile classify(Index row0, Index rows, Index col0, Index cols, Index nQ, Index nK, Index = 0) const {
    const Index off = diagonalOffset(align, nQ, nK);
    return internal::classifyBand(row0, rows, col0, cols, off + lowOffset(), off + highOffset());
  }
  template <typename Derived>
  void apply(const Eigen::MatrixBase<Derived>& tile, Index row0, Index col0, Index nQ, Index nK, Index = 0) const {
    const Index off = diagonalOffset(align, nQ, nK);
    const Index lo = lowOffset(), hi = highOffset();
    internal::hideOutside(
        tile, col0, [=](Index r) { return row0 + r + off + lo; }, [=](Index r) { return row0 + r + off + hi; });
  }
};

/// \brief Key padding: keys j >= length are hidden (JAX `key_value_seq_lengths`).
struct KeyLength {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = false;
  static constexpr Stage MaskStage = Stage::Hide;

  Index length;

  void check(const char* where, Index, Index nK, Index = 1) const {
    if (length < 0 || length > nK)
      sdpa::internal::throwInvalid(
          where, "KeyLength{" + std::to_string(length) + "} is outside [0, n_k = " + std::to_string(nK) + "]");
  }
  bool visible(Index, Index j, Index, Index, Index = 0) const { return j < length; }
  Tile classify(Index, Index, Index col0, Index cols, Index, Index, Index = 0) const {
    return col0 >= length ? Tile::Hidden : (col0 + cols <= length ? Tile::Visible : Tile::Partial);
  }
  template <typename Derived>
  void apply(const Eigen::MatrixBase<Derived>& tile_, Index, Index col0, Index, Index, Index = 0) const {
    auto& tile = internal::writable(tile_);
    if (tile.size() == 0) return;  // an empty tile may have no data: no block of it
    const Index first = std::clamp<Index>(length - col0, 0, tile.cols());
    tile.rightCols(tile.cols() - first).setConstant(-std::numeric_limits<typename Derived::Scalar>::infinity());
  }
};

/// \brief Query padding: query rows i >= length see no key, so their output is 0.
struct QueryLength {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = false;
  static constexpr Stage MaskStage = Stage::Hide;

  Index length;

  void check(const char* where, Index nQ, Index, Index = 1) const {
    if (length < 0 || length > nQ)
      sdpa::internal::throwInvalid(
          where, "QueryLength{" + std::to_string(length) + "} is outside [0, n_q = " + std::to_string(nQ) + "]");
  }
  bool visible(Index i, Index, Index, Index, Index = 0) const { return i < length; }
  Tile classify(Index row0, Index rows, Index, Index, Index, Index, Index = 0) const {
    return row0 >= length ? Tile::Hidden : (row0 + rows <= length ? Tile::Visible : Tile::Partial);
  }
  template <typename Derived>
  void apply(const Eigen::MatrixBase<Derived>& tile_, Index row0, Index, Index, Index, Index = 0) const {
    auto& tile = internal::writable(tile_);
    const Index first = std::clamp<Index>(length - row0, 0, tile.rows());
    tile.bottomRows(tile.rows() - first).setConstant(-std::numeric_limits<typename Derived::Scalar>::infinity());
  }
};

namespace internal {
/// Rows of a per-position matrix (Keep, Bias) used for head h: one n_q x n_k matrix is shared by
/// every head; a (heads * n_q) x n_k matrix holds head h in rows [h n_q, (h + 1) n_q).
template <typename M>
Index headRowBase(const M& m, Index nQ, Index head) {
  return m.rows() == nQ ? 0 : head * nQ;
}
template <typename M>
void checkPerPosition(const char* where, const char* what, const M& m, Index nQ, Index nK, Index heads) {
  const bool shared = m.rows() == nQ && m.cols() == nK;
  const bool perHead = heads > 1 && m.rows() == heads * nQ && m.cols() == nK;
  if (!shared && !perHead)
    sdpa::internal::throwInvalid(
        where, std::string("the ") + what + " is " + sdpa::internal::shapeString(m.rows(), m.cols()) +
                   " but the logits are " + sdpa::internal::shapeString(nQ, nK) + " (n_q x n_k)" +
                   (heads > 1 ? "; per head it must be " + sdpa::internal::shapeString(heads * nQ, nK) +
                                    " (heads * n_q x n_k, head h in rows h * n_q ...)"
                              : std::string()));
}
}  // namespace internal

/**
 * \brief Boolean keep-mask, true = attend (PyTorch's boolean `attn_mask`): n_q x n_k shared by
 * all heads, or (heads * n_q) x n_k with head h in rows [h n_q, (h + 1) n_q).
 *
 * Like an Eigen expression it refers to a plain matrix it is given rather than copying it: keep
 * that matrix alive while the mask is used (expressions are stored by value).
 */
template <typename Derived>
class Keep {
 public:
  SDPA_STATIC_ASSERT((std::is_same_v<typename Derived::Scalar, bool>),
                     KEEP_MASK_MUST_BE_A_BOOL_MATRIX__USE_Bias_FOR_AN_ADDITIVE_MASK);
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = false;
  static constexpr Stage MaskStage = Stage::Hide;

  explicit Keep(const Eigen::MatrixBase<Derived>& keep) : m_keep(keep.derived()) {}

  void check(const char* where, Index nQ, Index nK, Index heads = 1) const {
    internal::checkPerPosition(where, "Keep mask", m_keep, nQ, nK, heads);
  }
  bool visible(Index i, Index j, Index nQ, Index, Index head = 0) const {
    return m_keep(internal::headRowBase(m_keep, nQ, head) + i, j);
  }
  Tile classify(Index, Index, Index, Index, Index, Index, Index = 0) const { return Tile::Partial; }
  template <typename DerivedS>
  void apply(const Eigen::MatrixBase<DerivedS>& tile_, Index row0, Index col0, Index nQ, Index, Index head = 0) const {
    auto& tile = internal::writable(tile_);
    const auto keep = m_keep.block(internal::headRowBase(m_keep, nQ, head) + row0, col0, tile.rows(), tile.cols());
    tile = keep.array().select(tile, -std::numeric_limits<typename DerivedS::Scalar>::infinity());
  }
  const Derived& matrix() const { return m_keep; }

 private:
  typename Eigen::internal::ref_selector<Derived>::type m_keep;
};
template <typename Derived>
Keep(const Eigen::MatrixBase<Derived>&) -> Keep<Derived>;

/**
 * \brief Additive mask ("attention bias", PyTorch's float `attn_mask`), shaped as `Keep`: added
 * to the scaled logits, never scaled; -inf hides a key. Entries at positions another mask hides
 * are never read, so NaN there is harmless. Refers to a plain matrix as `Keep` does.
 */
template <typename Derived>
class Bias {
 public:
  SDPA_STATIC_ASSERT(sdpa::internal::IsSupportedScalar<typename Derived::Scalar>,
                     BIAS_MUST_BE_A_float_OR_double_MATRIX__USE_Keep_FOR_A_BOOLEAN_MASK);
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = true;
  static constexpr Stage MaskStage = Stage::Add;

  explicit Bias(const Eigen::MatrixBase<Derived>& bias) : m_bias(bias.derived()) {}

  void check(const char* where, Index nQ, Index nK, Index heads = 1) const {
    internal::checkPerPosition(where, "Bias", m_bias, nQ, nK, heads);
  }
  bool visible(Index i, Index j, Index nQ, Index, Index head = 0) const {
    return m_bias(internal::headRowBase(m_bias, nQ, head) + i, j) !=
           -std::numeric_limits<typename Derived::Scalar>::infinity();
  }
  Tile classify(Index, Index, Index, Index, Index, Index, Index = 0) const { return Tile::Partial; }
  template <typename DerivedS>
  void apply(const Eigen::MatrixBase<DerivedS>& tile_, Index row0, Index col0, Index nQ, Index, Index head = 0) const {
    using Scalar = typename DerivedS::Scalar;
    auto& tile = internal::writable(tile_);
    const auto bias = m_bias.block(internal::headRowBase(m_bias, nQ, head) + row0, col0, tile.rows(), tile.cols())
                          .template cast<Scalar>();
    tile = (tile.array() == -std::numeric_limits<Scalar>::infinity()).select(tile, tile + bias);
  }
  const Derived& matrix() const { return m_bias; }

 private:
  typename Eigen::internal::ref_selector<Derived>::type m_bias;
};
template <typename Derived>
Bias(const Eigen::MatrixBase<Derived>&) -> Bias<Derived>;

/**
 * \brief The ALiBi slopes of Press et al. for H heads: m_h = 2^(-8h/H), h = 1..H, when H is a
 * power of two; otherwise the slopes of the largest power of two n < H followed by every other
 * slope of 2n, as in the paper's reference code (H = 12: the 8 slopes of 8, then 2^-0.5,
 * 2^-1.5, 2^-2.5, 2^-3.5).
 */
inline std::vector<double> alibiSlopes(Index heads) {
  auto powerOfTwo = [](Index n) {
    std::vector<double> s(static_cast<size_t>(n));
    for (Index h = 1; h <= n; ++h) s[size_t(h - 1)] = std::exp2(-8.0 * double(h) / double(n));
    return s;
  };
  if (heads <= 0) return {};
  Index n = 1;
  while (2 * n <= heads) n *= 2;
  std::vector<double> slopes = powerOfTwo(n);
  if (n == heads) return slopes;
  const std::vector<double> extra = powerOfTwo(2 * n);
  for (Index i = 0; Index(slopes.size()) < heads; i += 2) slopes.push_back(extra[size_t(i)]);
  return slopes;
}

/**
 * \brief ALiBi (Press et al.): adds -m_h |p_i - j| to the logit of query i and key j in head h,
 * where p_i = i + diagonalOffset is the query's key position under the alignment. Usually
 * combined with `Causal` of the same alignment. `Alibi::standard(H, align)` uses alibiSlopes(H).
 */
struct Alibi {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = true;
  static constexpr Stage MaskStage = Stage::Add;

  std::vector<double> slopes;  ///< one per query head
  Align align;

  static Alibi standard(Index heads, Align align) { return Alibi{alibiSlopes(heads), align}; }

  void check(const char* where, Index, Index, Index heads = 1) const {
    if (Index(slopes.size()) != heads)
      sdpa::internal::throwInvalid(
          where, "Alibi has " + std::to_string(slopes.size()) + " slopes for " + std::to_string(heads) + " heads");
  }
  bool visible(Index, Index, Index, Index, Index = 0) const { return true; }
  Tile classify(Index, Index, Index, Index, Index, Index, Index = 0) const { return Tile::Partial; }
  template <typename DerivedS>
  void apply(const Eigen::MatrixBase<DerivedS>& tile_, Index row0, Index col0, Index nQ, Index nK,
             Index head = 0) const {
    using Scalar = typename DerivedS::Scalar;
    auto& tile = internal::writable(tile_);
    const Scalar m = Scalar(slopes[size_t(head)]);
    const Index off = diagonalOffset(align, nQ, nK);
    for (Index r = 0; r < tile.rows(); ++r)
      for (Index c = 0; c < tile.cols(); ++c) {
        Scalar& s = tile.coeffRef(r, c);
        if (s != -std::numeric_limits<Scalar>::infinity()) s -= m * Scalar(std::abs(row0 + r + off - (col0 + c)));
      }
  }
};

/**
 * \brief Logit softcap (Gemma 2): s -> c tanh(s / c) on the scaled logits, before any bias or
 * hiding, bounding every logit to (-c, c). c must be finite and > 0.
 */
struct Softcap {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = false;
  static constexpr bool HasBias = false;
  static constexpr Stage MaskStage = Stage::Transform;

  double cap;

  void check(const char* where, Index, Index, Index = 1) const {
    if (!(cap > 0) || !std::isfinite(cap))
      sdpa::internal::throwInvalid(where, "Softcap{" + std::to_string(cap) + "}: the cap must be finite and > 0");
  }
  bool visible(Index, Index, Index, Index, Index = 0) const { return true; }
  Tile classify(Index, Index, Index, Index, Index, Index, Index = 0) const { return Tile::Partial; }
  template <typename DerivedS>
  void apply(const Eigen::MatrixBase<DerivedS>& tile_, Index, Index, Index, Index, Index = 0) const {
    using Scalar = typename DerivedS::Scalar;
    auto& tile = internal::writable(tile_);
    const Scalar c = Scalar(cap);
    // Not Eigen's tanh: its float version is off by up to 4 ulp (internal/math.hpp).
    if (tile.size() == 0) return;
    if (tile.innerStride() == 1) {
      const Index inner = tile.innerSize();
      for (Index o = 0; o < tile.outerSize(); ++o)
        sdpa::internal::softcapInPlace(&(DerivedS::IsRowMajor ? tile.coeffRef(o, 0) : tile.coeffRef(0, o)), inner, c);
    } else {
      for (Index j = 0; j < tile.cols(); ++j)
        for (Index i = 0; i < tile.rows(); ++i) tile(i, j) = c * sdpa::internal::tanhAccurate(tile(i, j) / c);
    }
  }
};

template <typename... Masks>
class Combined;

namespace internal {
template <typename M>
struct AlignedToLengths;

template <typename T>
struct IsCombined : std::false_type {};
template <typename... M>
struct IsCombined<Combined<M...>> : std::true_type {};
template <typename T>
struct IsAlignedToLengths : std::false_type {};
template <typename M>
struct IsAlignedToLengths<AlignedToLengths<M>> : std::true_type {};
template <typename M>
struct AtPositions;
template <typename T>
struct IsAtPositions : std::false_type {};
template <typename M>
struct IsAtPositions<AtPositions<M>> : std::true_type {};

/// Whether mask M only hides (every part at Stage::Hide, without a bias): it sets entries to
/// -inf and leaves the others alone, so it commutes with any positive scaling of the logits.
template <typename M>
struct OnlyHides : std::bool_constant<M::MaskStage == Stage::Hide && !M::HasBias> {};
template <typename... M>
struct OnlyHides<Combined<M...>> : std::bool_constant<(OnlyHides<M>::value && ...)> {};
template <typename M>
struct OnlyHides<AlignedToLengths<M>> : OnlyHides<M> {};
template <typename M>
struct OnlyHides<AtPositions<M>> : OnlyHides<M> {};

/**
 * Applies the parts of mask m that act at stage S, looking inside combinations at any depth (and
 * through a padded item's alignment), so that every softcap of a nested combination runs before
 * any hiding and every hiding before any additive term, whatever the nesting.
 */
template <Stage S, typename M, typename DerivedS>
void applyStage(const M& m, const Eigen::MatrixBase<DerivedS>& tile, Index row0, Index col0, Index nQ, Index nK,
                Index head) {
  if constexpr (IsCombined<M>::value) {
    std::apply([&](const auto&... part) { (applyStage<S>(part, tile, row0, col0, nQ, nK, head), ...); }, m.parts());
  } else if constexpr (IsAlignedToLengths<M>::value) {
    applyStage<S>(m.mask, tile, row0, col0, nQ, nK + m.shift, head);
  } else if constexpr (IsAtPositions<M>::value) {
    applyStage<S>(m.mask, tile, row0 + m.row, col0 + m.col, m.nQ, m.nK, head + m.head0);
  } else if constexpr (M::MaskStage == S) {
    m.apply(tile, row0, col0, nQ, nK, head);
  }
}

/// A mask's parts as a tuple: a combination's own parts (already flat), any other mask alone.
template <typename M>
auto partsOf(M&& m) {
  if constexpr (IsCombined<std::decay_t<M>>::value)
    return std::forward<M>(m).parts();
  else
    return std::tuple<std::decay_t<M>>(std::forward<M>(m));
}
}  // namespace internal

/**
 * \brief Several masks at once, e.g. `combine(Causal{Align::LowerRight}, SlidingWindow{...},
 * KeyLength{n}, Bias{b})`. A key is visible iff every part lets it through; the parts act in
 * stage order (softcap, hiding, additive), whatever order they are listed in. `combine` flattens
 * a combination passed to it into its parts, and a nested combination built by hand still has its
 * parts run stage by stage (internal::applyStage), so nesting never changes the order.
 */
template <typename... Masks>
class Combined {
 public:
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = (Masks::IsNone && ...);
  static constexpr bool HasBias = (Masks::HasBias || ...);
  static constexpr Stage MaskStage = Stage::Hide;

  explicit Combined(Masks... masks) : m_masks(std::move(masks)...) {}

  void check(const char* where, Index nQ, Index nK, Index heads = 1) const {
    std::apply([&](const auto&... m) { (m.check(where, nQ, nK, heads), ...); }, m_masks);
  }
  bool visible(Index i, Index j, Index nQ, Index nK, Index head = 0) const {
    return std::apply([&](const auto&... m) { return (m.visible(i, j, nQ, nK, head) && ...); }, m_masks);
  }
  Tile classify(Index row0, Index rows, Index col0, Index cols, Index nQ, Index nK, Index head = 0) const {
    bool hidden = false, visible = true;
    std::apply(
        [&](const auto&... m) {
          (
              (void)[&] {
                const Tile t = m.classify(row0, rows, col0, cols, nQ, nK, head);
                hidden = hidden || t == Tile::Hidden;
                visible = visible && t == Tile::Visible;
              }(),
              ...);
        },
        m_masks);
    return hidden ? Tile::Hidden : (visible ? Tile::Visible : Tile::Partial);
  }
  template <typename DerivedS>
  void apply(const Eigen::MatrixBase<DerivedS>& tile, Index row0, Index col0, Index nQ, Index nK,
             Index head = 0) const {
    internal::applyStage<Stage::Transform>(*this, tile, row0, col0, nQ, nK, head);
    internal::applyStage<Stage::Hide>(*this, tile, row0, col0, nQ, nK, head);
    internal::applyStage<Stage::Add>(*this, tile, row0, col0, nQ, nK, head);
  }
  const std::tuple<Masks...>& parts() const& { return m_masks; }
  std::tuple<Masks...>&& parts() && { return std::move(m_masks); }

 private:
  std::tuple<Masks...> m_masks;
};

namespace internal {
template <typename T, typename = void>
struct IsMaskImpl : std::false_type {};
template <typename T>
struct IsMaskImpl<T, std::void_t<decltype(T::IsMask)>> : std::bool_constant<T::IsMask> {};
}  // namespace internal

/// True for the masks above (and user masks that follow the same interface).
template <typename T>
inline constexpr bool IsMask = internal::IsMaskImpl<std::decay_t<T>>::value;

/**
 * \brief Combines masks: `combine(Causal{Align::UpperLeft}, KeyLength{n}, Bias{b})`. A
 * combination among the arguments is spliced in as its parts: `combine(a, combine(b, c))` is
 * `combine(a, b, c)`, of the same type.
 */
template <typename... Masks>
auto combine(Masks&&... masks) {
  SDPA_STATIC_ASSERT((IsMask<Masks> && ...), EVERY_ARGUMENT_OF_combine_MUST_BE_A_MASK_FROM_sdpa_mask);
  SDPA_STATIC_ASSERT(sizeof...(Masks) > 0, combine_NEEDS_AT_LEAST_ONE_MASK__USE_mask_None);
  return std::apply([](auto&&... part) { return Combined<std::decay_t<decltype(part)>...>(std::move(part)...); },
                    std::tuple_cat(internal::partsOf(std::forward<Masks>(masks))...));
}

namespace internal {
/**
 * A mask as a padded batch item sees it: the alignment follows the item's valid lengths, so that
 * the item computes what a call on its valid rows alone would. The positional masks (Causal,
 * SlidingWindow, Alibi) place query i at key i + n_k - n_q under Align::LowerRight; they are
 * handed n_k + shift, shift = (valid n_k - valid n_q) - (n_k - n_q), which puts the last valid
 * query on the last valid key. Matrix masks (Keep, Bias) read n_q only, which is unchanged, and
 * Align::UpperLeft ignores both.
 */
template <typename M>
struct AlignedToLengths {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = M::IsNone;
  static constexpr bool HasBias = M::HasBias;
  static constexpr Stage MaskStage = M::MaskStage;

  const M& mask;
  Index shift;

  void check(const char* where, Index nQ, Index nK, Index heads = 1) const { mask.check(where, nQ, nK, heads); }
  bool visible(Index i, Index j, Index nQ, Index nK, Index head = 0) const {
    return mask.visible(i, j, nQ, nK + shift, head);
  }
  Tile classify(Index row0, Index rows, Index col0, Index cols, Index nQ, Index nK, Index head = 0) const {
    return mask.classify(row0, rows, col0, cols, nQ, nK + shift, head);
  }
  template <typename DerivedS>
  void apply(const Eigen::MatrixBase<DerivedS>& tile, Index row0, Index col0, Index nQ, Index nK,
             Index head = 0) const {
    mask.apply(tile, row0, col0, nQ, nK + shift, head);
  }
};

/**
 * A mask as one block of a larger attention sees it: the block's query i, key j and head h are
 * query row + i, key col + j and head head0 + h of an n_q x n_k attention with `heads` query
 * heads. Context parallelism (distributed.hpp) runs each pair of a query slice and a key slice,
 * and each rank's share of the heads, as such a block, so that every positional mask (causal,
 * window, ALiBi, key lengths) keeps its meaning over the whole sequence.
 */
template <typename M>
struct AtPositions {
  static constexpr bool IsMask = true;
  static constexpr bool IsNone = M::IsNone;
  static constexpr bool HasBias = M::HasBias;
  static constexpr Stage MaskStage = M::MaskStage;

  const M& mask;
  Index row, col;  ///< the block's first query and key in the whole attention
  Index nQ, nK;    ///< the whole attention's lengths
  Index head0, heads;

  void check(const char* where, Index, Index, Index = 1) const { mask.check(where, nQ, nK, heads); }
  bool visible(Index i, Index j, Index, Index, Index head = 0) const {
    return mask.visible(row + i, col + j, nQ, nK, head0 + head);
  }
  Tile classify(Index row0, Index rows, Index col0, Index cols, Index, Index, Index head = 0) const {
    return mask.classify(row + row0, rows, col + col0, cols, nQ, nK, head0 + head);
  }
  template <typename DerivedS>
  void apply(const Eigen::MatrixBase<DerivedS>& tile, Index row0, Index col0, Index, Index, Index head = 0) const {
    mask.apply(tile, row + row0, col + col0, nQ, nK, head0 + head);
  }
};

template <typename T>
struct IsBiasMatrix : std::false_type {};
template <typename D>
struct IsBiasMatrix<Bias<D>> : std::true_type {};
/// rows x cols of the first Bias matrix in a mask (looking inside combine), or {-1, -1}. The
/// backward pass reports the bias gradient in this shape.
template <typename M>
std::pair<Index, Index> biasMatrixShape(const M& m) {
  if constexpr (IsBiasMatrix<M>::value) {
    return {m.matrix().rows(), m.matrix().cols()};
  } else if constexpr (IsAlignedToLengths<M>::value || IsAtPositions<M>::value) {
    return biasMatrixShape(m.mask);
  } else if constexpr (IsCombined<M>::value) {
    std::pair<Index, Index> shape{-1, -1};
    std::apply([&](const auto&... part) { ((shape.first < 0 ? (void)(shape = biasMatrixShape(part)) : (void)0), ...); },
               m.parts());
    return shape;
  } else {
    return {-1, -1};
  }
}

/// The cap of the first Softcap in a mask (looking inside combine), or 0 if it has none.
template <typename M>
double softcapOf(const M& m) {
  if constexpr (std::is_same_v<M, Softcap>) {
    return m.cap;
  } else if constexpr (IsAlignedToLengths<M>::value || IsAtPositions<M>::value) {
    return softcapOf(m.mask);
  } else if constexpr (IsCombined<M>::value) {
    double cap = 0;
    std::apply([&](const auto&... part) { ((cap == 0 ? (void)(cap = softcapOf(part)) : (void)0), ...); }, m.parts());
    return cap;
  } else {
    return 0;
  }
}
}  // namespace internal

}  // namespace sdpa::mask

#endif  // SDPA_MASK_HPP
