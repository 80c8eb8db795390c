/**
 * \file sdpa/kv_cache.hpp
 * \brief A layer's key/value cache for decoding (contiguous, sliding-window ring, paged blocks;
 * float, double, fp16, bf16, q8 or q4 storage) and attention of new query rows against it.
 */
#ifndef SDPA_KV_CACHE_HPP
#define SDPA_KV_CACHE_HPP

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "forward.hpp"
#include "internal/checks.hpp"
#include "internal/decode_cache.hpp"
#include "internal/kv_quant.hpp"
#include "layout.hpp"
#include "mask.hpp"
#include "multihead.hpp"
#include "scale.hpp"

namespace sdpa {

/// \brief How a KvCache places positions: one block of `capacity` rows, a ring of the last
/// positions, or fixed-size blocks from a pool with a block table per sequence (vLLM's layout).
enum class CacheMode { Contiguous, Ring, Paged };

/// \brief One layer's cache shape: kv heads and each head's d_k and d_v.
struct CacheShape {
  Index kvHeads = 1, dK = 0, dV = 0;
};

template <typename Storage_>
class KvCache;

/// \brief A sequence of a KvCache, as cachedAttention reads it (a handle: the cache must outlive it).
template <typename Storage>
struct KvSequence {
  const KvCache<Storage>* cache;
  Index id;
};

/**
 * \brief The keys and values of one layer, H_kv heads packed as column blocks as in
 * multiHeadAttention (k rows x (H_kv d_k), v rows x (H_kv d_v)), for decoding: `append` new rows
 * (a token, or a chunk), then cachedAttention(q, cache, Heads{H, H_kv}, scale, mask) for the
 * query rows of the newest positions. Positions are logical: position p is the p-th row ever
 * appended to the sequence (minus those truncated), and masks (causal LowerRight, ALiBi, sliding
 * window, key lengths, bias columns) see a sequence of length() keys.
 *
 * Modes:
 * - contiguous(shape, capacity): one sequence of at most `capacity` positions;
 * - ring(shape, window, maxQueryRows): one sequence of any length that keeps its last
 *   window + maxQueryRows - 1 positions in place, so that up to maxQueryRows query rows under a
 *   mask::SlidingWindow of `window` keys get exactly the attention of the whole sequence;
 * - paged(shape, blockRows, blocks): a pool of blocks and a block table per sequence; fork()
 *   shares a sequence's blocks (a prompt prefix) without copying, a shared block is copied only
 *   when one of its sequences writes to it.
 *
 * Storage: float, double, Eigen::half, Eigen::bfloat16, or quantised kv::Q8 / kv::Q4 (an fp16
 * scale per 32 keys of a channel; the newest positions of a group not yet full stay in float
 * until it fills; quantised storage needs finite values, |x| <= 65504 MaxCode). Errors (bad
 * shapes, a full pool or capacity, an unknown sequence) throw std::invalid_argument and leave the
 * cache unchanged. Threads: any number of cachedAttention calls may read a cache at once; append,
 * truncate, fork and release need the cache to themselves. Memory: the pool is allocated once, by
 * the constructor, on a cache line; float-like storage keeps each head's channel as a column of
 * the block's rows, its columns a whole number of cache lines apart (rows rounded up to 16
 * floats, 32 halves or 8 doubles; a column shorter than a line to a power of two of bytes), so
 * that the decoding kernels' vector loads do not straddle two lines.
 */
template <typename Storage_ = float>
class KvCache {
 public:
  using Storage = Storage_;
  static constexpr bool IsQuantised = internal::quant::IsQuantised<Storage>;
  /// Element type of the float-like parts (a quantised cache's newest, partial group is float).
  using Plain = std::conditional_t<IsQuantised, float, Storage>;
  /// What cachedAttention computes and returns: double for double storage, float otherwise.
  using Scalar = internal::Accumulator<Plain>;
  SDPA_STATIC_ASSERT((internal::IsSupportedScalar<Storage> || internal::IsHalfScalar<Storage> || IsQuantised),
                     KVCACHE_STORAGE_MUST_BE_float_double_Eigen_half_Eigen_bfloat16_sdpa_kv_Q8_OR_sdpa_kv_Q4);

  static KvCache contiguous(const CacheShape& shape, Index capacity) {
    const char* where = "sdpa::KvCache::contiguous";
    checkShape(where, shape);
    if (capacity < 0) internal::throwInvalid(where, "capacity " + std::to_string(capacity) + " is negative");
    return KvCache(CacheMode::Contiguous, shape, roundRows(std::max<Index>(capacity, 1)), 1, capacity, 0);
  }

  static KvCache ring(const CacheShape& shape, Index window, Index maxQueryRows = 16) {
    const char* where = "sdpa::KvCache::ring";
    checkShape(where, shape);
    if (window < 1 || maxQueryRows < 1)
      internal::throwInvalid(where, "window " + std::to_string(window) + " and maxQueryRows " +
                                        std::to_string(maxQueryRows) + " must be at least 1");
    const Index held = window + maxQueryRows - 1;
    return KvCache(CacheMode::Ring, shape, roundRows(held), 1, held, window);
  }

  static KvCache paged(const CacheShape& shape, Index blockRows, Index blocks) {
    const char* where = "sdpa::KvCache::paged";
    checkShape(where, shape);
    if (blockRows < 1 || blocks < 1)
      internal::throwInvalid(where, "blockRows " + std::to_string(blockRows) + " and blocks " + std::to_string(blocks) +
                                        " must be at least 1");
    if (IsQuantised && blockRows % internal::quant::kGroup != 0)
      internal::throwInvalid(where, "blockRows " + std::to_string(blockRows) +
                                        " must be a multiple of 32 for quantised storage (a scale's group)");
    return KvCache(CacheMode::Paged, shape, blockRows, blocks, blockRows * blocks, 0);
  }

  CacheMode mode() const { return m_mode; }
  const CacheShape& shape() const { return m_shape; }
  /// Positions a contiguous cache can hold, a ring keeps, or the pool's blocks hold in all.
  Index capacity() const { return m_capacity; }
  /// A ring's sliding window (0 for the other modes).
  Index window() const { return m_window; }
  /// Rows per block (a contiguous cache or a ring is one block).
  Index blockRows() const { return m_rows; }
  Index blocks() const { return Index(m_refs.size()); }
  Index freeBlocks() const { return Index(m_free.size()); }
  /// Bytes of storage per block (every head's k and v).
  Index blockBytes() const { return m_pageBytes; }

  /// \brief A new empty sequence (paged mode; the other modes have the one sequence 0).
  Index addSequence() {
    requirePaged("sdpa::KvCache::addSequence");
    return newSequence();
  }

  /// \brief A new sequence with the positions of `seq` (paged): its blocks are shared, not
  /// copied; the tail of a quantised sequence (< 32 rows) is copied.
  Index fork(Index seq) {
    requirePaged("sdpa::KvCache::fork");
    checkSequence("sdpa::KvCache::fork", seq);
    const Index id = newSequence();
    Sequence& to = m_seqs[size_t(id)];
    const Sequence& from = m_seqs[size_t(seq)];
    to.table = from.table;
    to.length = from.length;
    to.first = from.first;
    to.tailK = from.tailK;
    to.tailV = from.tailV;
    for (Index b : to.table) ++m_refs[size_t(b)];
    return id;
  }

  /// \brief Frees a sequence (paged): its blocks return to the pool unless another shares them.
  void release(Index seq) {
    requirePaged("sdpa::KvCache::release");
    checkSequence("sdpa::KvCache::release", seq);
    Sequence& s = m_seqs[size_t(seq)];
    dropBlocks(s, 0);
    s = Sequence{};
  }

  bool isLive(Index seq) const { return seq >= 0 && seq < Index(m_seqs.size()) && m_seqs[size_t(seq)].live; }
  /// Positions of the sequence (rows appended minus rows truncated).
  Index length(Index seq = 0) const {
    checkSequence("sdpa::KvCache::length", seq);
    return m_seqs[size_t(seq)].length;
  }
  /// The first position the sequence still holds (a ring forgets the older ones; else 0).
  Index firstPosition(Index seq = 0) const {
    checkSequence("sdpa::KvCache::firstPosition", seq);
    return m_seqs[size_t(seq)].first;
  }
  /// The blocks of a paged sequence, in position order (block b holds positions b blockRows...).
  const std::vector<Index>& blockTable(Index seq) const {
    checkSequence("sdpa::KvCache::blockTable", seq);
    return m_seqs[size_t(seq)].table;
  }

  KvSequence<Storage> sequence(Index seq) const {
    checkSequence("sdpa::KvCache::sequence", seq);
    return {this, seq};
  }

  /// \brief Appends rows to sequence 0: k rows x (H_kv d_k), v rows x (H_kv d_v).
  template <typename DK, typename DV>
  void append(const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v) {
    append(0, k, v);
  }

  /// \brief Appends rows to a sequence: k rows x (H_kv d_k), v rows x (H_kv d_v), any scalar.
  /// O(rows); a paged sequence takes blocks from the pool as it grows.
  template <typename DK, typename DV>
  void append(Index seq, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v) {
    const char* where = "sdpa::KvCache::append";
    checkSequence(where, seq);
    const Index H = m_shape.kvHeads, n = k.rows();
    if (k.cols() != H * m_shape.dK || v.cols() != H * m_shape.dV || v.rows() != n)
      internal::throwInvalid(where, "k is " + internal::shapeString(k.rows(), k.cols()) + " and v is " +
                                        internal::shapeString(v.rows(), v.cols()) + ": the cache takes rows x " +
                                        std::to_string(H * m_shape.dK) + " keys and rows x " +
                                        std::to_string(H * m_shape.dV) + " values (" + std::to_string(H) +
                                        " kv heads of d_k " + std::to_string(m_shape.dK) + ", d_v " +
                                        std::to_string(m_shape.dV) + ")");
    if constexpr (IsQuantised) {
      const double limit = double(internal::quant::maxMagnitude<Storage>());
      const auto bad = [&](const auto& x) {
        for (Index c = 0; c < x.cols(); ++c)
          for (Index r = 0; r < x.rows(); ++r) {
            const double y = double(x(r, c));
            if (!(std::abs(y) <= limit)) return true;
          }
        return false;
      };
      if (bad(k.derived()) || bad(v.derived()))
        internal::throwInvalid(where, "quantised storage takes finite values of magnitude at most " +
                                          std::to_string(limit) + " (a NaN or inf would spoil its 32-key group)");
    }
    Sequence& s = m_seqs[size_t(seq)];
    const Index L = s.length;
    if (m_mode == CacheMode::Contiguous && L + n > m_capacity)
      internal::throwInvalid(where, "appending " + std::to_string(n) + " rows to " + std::to_string(L) +
                                        " would pass the capacity of " + std::to_string(m_capacity) + " positions");
    if (m_mode == CacheMode::Paged) {
      const Index need = blocksNeeded(s, L + n);
      if (need > freeBlocks())
        internal::throwInvalid(where, "appending " + std::to_string(n) + " rows needs " + std::to_string(need) +
                                          " free blocks; the pool has " + std::to_string(freeBlocks()) + " of " +
                                          std::to_string(blocks()));
    }
    // Checked: from here nothing throws but allocation of the sequence's table.
    if constexpr (IsQuantised) {
      constexpr Index G = internal::quant::kGroup;
      const Index dK = m_shape.dK, dV = m_shape.dV;
      for (Index i = 0; i < n; ++i) {
        const Index pos = s.length, t = pos % G;
        for (Index c = 0; c < H * dK; ++c) s.tailK[size_t(c * G + t)] = float(k(i, c));
        for (Index c = 0; c < H * dV; ++c) s.tailV[size_t(c * G + t)] = float(v(i, c));
        s.length = pos + 1;
        if (t == G - 1) {  // the group is full: quantised into its block
          unsigned char* page = writablePage(s, pos - t);
          const Index slot = (pos - t) % m_rows;
          for (Index h = 0; h < H; ++h) {
            internal::quant::quantiseGroup<Storage, true>(s.tailK.data() + h * dK * G, G, dK, kGroupAt(page, h, slot));
            internal::quant::quantiseGroup<Storage>(s.tailV.data() + h * dV * G, G, dV, vGroupAt(page, h, slot));
          }
        }
      }
    } else {
      const Index first = m_mode == CacheMode::Ring ? std::max<Index>(0, n - m_capacity) : 0;
      for (Index i = first; i < n; ++i) {
        const Index pos = L + i;
        unsigned char* page = writablePage(s, pos);
        const Index slot = pos % m_rows;
        for (Index h = 0; h < H; ++h) {
          Storage* kd = reinterpret_cast<Storage*>(page + h * m_headBytes) + slot;
          Storage* vd = reinterpret_cast<Storage*>(page + h * m_headBytes + m_kBytes) + slot;
          for (Index c = 0; c < m_shape.dK; ++c) kd[c * m_ld] = Storage(k(i, h * m_shape.dK + c));
          for (Index c = 0; c < m_shape.dV; ++c) vd[c * m_ld] = Storage(v(i, h * m_shape.dV + c));
        }
      }
      s.length = L + n;
    }
    if (m_mode == CacheMode::Ring) s.first = std::max(s.first, s.length - m_capacity);
  }

  /// \brief Drops the positions from `length` on (speculative decoding's rejected tokens).
  void truncate(Index length) { truncate(0, length); }
  void truncate(Index seq, Index length) {
    const char* where = "sdpa::KvCache::truncate";
    checkSequence(where, seq);
    Sequence& s = m_seqs[size_t(seq)];
    if (length < s.first || length > s.length)
      internal::throwInvalid(where, "length " + std::to_string(length) + " is outside [" + std::to_string(s.first) +
                                        ", " + std::to_string(s.length) + "] (positions the sequence holds)");
    if constexpr (IsQuantised) {
      constexpr Index G = internal::quant::kGroup;
      const Index full = s.length / G * G, keep = length / G * G;
      if (length < full && length > keep) {
        // The group of `length` was quantised: its kept rows come back to the float tail (as
        // the cache holds them: they stay within the quantisation bound, not the fp32 values).
        const unsigned char* page = pageOf(s, keep);
        const Index slot = keep % m_rows;
        const Index H = m_shape.kvHeads, dK = m_shape.dK, dV = m_shape.dV;
        for (Index h = 0; h < H; ++h) {
          internal::quant::dequantiseGroup<Storage, true>(kGroupAt(page, h, slot), dK, s.tailK.data() + h * dK * G, G);
          internal::quant::dequantiseGroup<Storage>(vGroupAt(page, h, slot), dV, s.tailV.data() + h * dV * G, G);
        }
      }
    }
    s.length = length;
    if (m_mode == CacheMode::Paged) {
      const Index keepPositions = IsQuantised ? length / internal::quant::kGroup * internal::quant::kGroup : length;
      dropBlocks(s, (keepPositions + m_rows - 1) / m_rows);
    }
  }

  /// The kernel's view of a sequence: its pieces in position order (internal).
  void pieces(Index seq, std::vector<internal::cache::Piece>& out) const {
    using internal::cache::Piece;
    out.clear();
    const Sequence& s = m_seqs[size_t(seq)];
    constexpr Index G = IsQuantised ? internal::quant::kGroup : 1;
    const Index stored = s.length / G * G;  // positions in blocks (quantised: whole groups)
    Index pos = s.first / G * G;
    while (pos < stored) {
      const Index slot = pos % m_rows;
      const Index n = std::min(stored - pos, m_rows - slot);  // to the block's (or ring's) end
      const unsigned char* page = pageOf(s, pos);
      Piece p;
      p.pos = pos;
      p.count = n;
      p.kHead = p.vHead = m_headBytes;
      if constexpr (IsQuantised) {
        p.k = kGroupAt(page, 0, slot);
        p.v = vGroupAt(page, 0, slot);
        p.quantised = true;
      } else {
        p.k = page + slot * Index(sizeof(Storage));
        p.v = page + m_kBytes + slot * Index(sizeof(Storage));
        p.ld = m_ld;
      }
      out.push_back(p);
      pos += n;
    }
    if constexpr (IsQuantised) {
      if (s.length > stored) {
        Piece p;
        p.pos = stored;
        p.count = s.length - stored;
        p.k = reinterpret_cast<const unsigned char*>(s.tailK.data());
        p.v = reinterpret_cast<const unsigned char*>(s.tailV.data());
        p.kHead = m_shape.dK * G * Index(sizeof(float));
        p.vHead = m_shape.dV * G * Index(sizeof(float));
        p.ld = G;
        out.push_back(p);
      }
    }
  }

 private:
  struct Sequence {
    bool live = false;
    Index length = 0, first = 0;
    std::vector<Index> table;         // paged: block of positions [b B, (b + 1) B)
    std::vector<float> tailK, tailV;  // quantised: the partial group, 32 x (H d) column-major
  };

  KvCache(CacheMode mode, const CacheShape& shape, Index rows, Index blocks, Index capacity, Index window)
      : m_mode(mode), m_shape(shape), m_rows(rows), m_capacity(capacity), m_window(window) {
    if constexpr (IsQuantised) {
      m_kBytes = rows / internal::quant::kGroup * internal::quant::groupBytes<Storage, true>(shape.dK);
      m_vBytes = rows / internal::quant::kGroup * internal::quant::groupBytes<Storage>(shape.dV);
    } else {
      // Columns a whole number of cache lines apart, or a column shorter than a line a power of
      // two of bytes (fp16 blocks of 16 keys: 32): with the pool on a line (LineAllocator), no
      // column straddles two lines where it need not. (rows >= 1: every factory asks for one.)
      constexpr Index line = Index(internal::kLineBytes);
      const Index size = Index(sizeof(Storage)), bytes = rows * size;
      Index stride = line;
      if (bytes > line)
        stride = (bytes + line - 1) / line * line;
      else
        while (stride / 2 >= bytes) stride /= 2;
      m_ld = stride / size;
      m_kBytes = m_ld * shape.dK * size;
      m_vBytes = m_ld * shape.dV * size;
    }
    m_headBytes = (m_kBytes + m_vBytes + 63) / 64 * 64;
    m_pageBytes = m_headBytes * shape.kvHeads;
    m_pool.resize(size_t(m_pageBytes * blocks + 64));
    m_refs.assign(size_t(blocks), 0);
    for (Index b = blocks; b-- > 0;) m_free.push_back(b);
    if (mode != CacheMode::Paged) {
      const Index id = newSequence();
      m_seqs[size_t(id)].table.push_back(takeBlock());
    }
  }

  static void checkShape(const char* where, const CacheShape& shape) {
    if (shape.kvHeads < 1 || shape.dK < 1 || shape.dV < 1)
      internal::throwInvalid(where, "kvHeads " + std::to_string(shape.kvHeads) + ", dK " + std::to_string(shape.dK) +
                                        " and dV " + std::to_string(shape.dV) + " must be at least 1");
  }
  /// Rows of a contiguous block or ring: whole groups for quantised storage.
  static Index roundRows(Index rows) {
    if constexpr (IsQuantised)
      return (rows + internal::quant::kGroup - 1) / internal::quant::kGroup * internal::quant::kGroup;
    else
      return rows;
  }

  void requirePaged(const char* where) const {
    if (m_mode != CacheMode::Paged)
      internal::throwInvalid(where, "only a paged cache has several sequences (this one has sequence 0)");
  }
  void checkSequence(const char* where, Index seq) const {
    if (!isLive(seq))
      internal::throwInvalid(where, "sequence " + std::to_string(seq) + " does not exist (the cache has " +
                                        std::to_string(m_seqs.size()) + " sequence slots)");
  }

  Index newSequence() {
    Index id = 0;
    while (id < Index(m_seqs.size()) && m_seqs[size_t(id)].live) ++id;
    if (id == Index(m_seqs.size())) m_seqs.emplace_back();
    Sequence& s = m_seqs[size_t(id)];
    s = Sequence{};
    s.live = true;
    if constexpr (IsQuantised) {
      s.tailK.assign(size_t(internal::quant::kGroup * m_shape.kvHeads * m_shape.dK), 0.0f);
      s.tailV.assign(size_t(internal::quant::kGroup * m_shape.kvHeads * m_shape.dV), 0.0f);
    }
    return id;
  }

  Index takeBlock() {
    const Index b = m_free.back();
    m_free.pop_back();
    m_refs[size_t(b)] = 1;
    return b;
  }
  void unref(Index b) {
    if (--m_refs[size_t(b)] == 0) m_free.push_back(b);
  }
  /// Keeps the first `keep` blocks of a paged sequence's table.
  void dropBlocks(Sequence& s, Index keep) {
    if (m_mode != CacheMode::Paged) return;
    while (Index(s.table.size()) > keep) {
      unref(s.table.back());
      s.table.pop_back();
    }
  }

  /// Blocks a paged sequence must take from the pool to reach `length` positions: new blocks,
  /// and a copy of the shared block it would write into.
  Index blocksNeeded(const Sequence& s, Index length) const {
    constexpr Index G = IsQuantised ? internal::quant::kGroup : 1;
    const Index stored = s.length / G * G, target = length / G * G;  // positions in blocks
    if (target <= stored) return 0;
    const Index have = Index(s.table.size()), want = (target + m_rows - 1) / m_rows;
    Index need = std::max<Index>(0, want - have);
    const Index firstBlock = stored / m_rows;
    if (firstBlock < have && m_refs[size_t(s.table[size_t(firstBlock)])] > 1) ++need;
    return need;
  }

  const unsigned char* pageOf(const Sequence& s, Index pos) const {
    const Index b = m_mode == CacheMode::Paged ? s.table[size_t(pos / m_rows)] : s.table[0];
    return m_pool.data() + b * m_pageBytes;
  }
  /// The block that holds `pos`, taken from the pool or copied from a shared one first.
  unsigned char* writablePage(Sequence& s, Index pos) {
    if (m_mode == CacheMode::Paged) {
      const Index i = pos / m_rows;
      if (i == Index(s.table.size())) s.table.push_back(takeBlock());
      Index& b = s.table[size_t(i)];
      if (m_refs[size_t(b)] > 1) {
        const Index copy = takeBlock();
        std::memcpy(m_pool.data() + copy * m_pageBytes, m_pool.data() + b * m_pageBytes, size_t(m_pageBytes));
        unref(b);
        b = copy;
      }
      return m_pool.data() + b * m_pageBytes;
    }
    return m_pool.data() + s.table[0] * m_pageBytes;
  }

  template <typename Page>
  Page* kGroupAt(Page* page, Index h, Index slot) const {
    return page + h * m_headBytes +
           slot / internal::quant::kGroup * internal::quant::groupBytes<Storage, true>(m_shape.dK);
  }
  template <typename Page>
  Page* vGroupAt(Page* page, Index h, Index slot) const {
    return page + h * m_headBytes + m_kBytes +
           slot / internal::quant::kGroup * internal::quant::groupBytes<Storage>(m_shape.dV);
  }

  CacheMode m_mode;
  CacheShape m_shape;
  Index m_rows, m_capacity, m_window;
  Index m_ld = 0;  // float-like storage: a column's stride, m_rows rounded up (constructor)
  Index m_kBytes = 0, m_vBytes = 0, m_headBytes = 0, m_pageBytes = 0;
  std::vector<unsigned char, internal::LineAllocator<unsigned char>> m_pool;
  std::vector<Index> m_refs, m_free;
  std::vector<Sequence> m_seqs;
};

namespace internal {

template <typename Storage, typename Scale, typename Mask>
void checkCached(const char* where, Index qRows, Index qCols, const KvSequence<Storage>& seq, const Heads& heads,
                 const Scale& scale, const Mask& mask) {
  const KvCache<Storage>& cache = *seq.cache;
  const CacheShape& sh = cache.shape();
  if (heads.keyValue != sh.kvHeads || heads.query < 1 || heads.query % heads.keyValue != 0)
    throwInvalid(where, "Heads{" + std::to_string(heads.query) + ", " + std::to_string(heads.keyValue) +
                            "} against a cache of " + std::to_string(sh.kvHeads) +
                            " kv heads: the kv heads must match and divide the query heads");
  if (qCols != heads.query * sh.dK)
    throwInvalid(where, "q is " + shapeString(qRows, qCols) + ": " + std::to_string(heads.query) +
                            " query heads of d_k " + std::to_string(sh.dK) + " need " +
                            std::to_string(heads.query * sh.dK) + " columns");
  checkScaleHeads(where, scale, heads.query);
  const Index L = cache.length(seq.id), first = cache.firstPosition(seq.id);
  if (cache.mode() == CacheMode::Ring && first > 0 && qRows > L - first - cache.window() + 1)
    throwInvalid(where, std::to_string(qRows) + " query rows over a window of " + std::to_string(cache.window()) +
                            " need the last " + std::to_string(qRows + cache.window() - 1) +
                            " positions; the ring holds " + std::to_string(L - first) +
                            " (make it with a larger maxQueryRows)");
  mask.check(where, qRows, L, heads.query);
}

}  // namespace internal

/**
 * \brief Attention of query rows against a sequence of a KvCache, into outputs the caller sized:
 * out n_q x (H d_v), logSumExp n_q x H. The n_q rows are the sequence's last n_q positions (append
 * their keys and values first): mask::Causal{mask::Align::LowerRight} makes each see the keys up
 * to its own. Each kv head's keys stream once for its GQA group's query heads and rows. A
 * key-count scale (scale::LogN) takes for each row the positions it sees of those the sequence
 * holds (a ring: the last ones), and is not allocation-free (a scaled copy of q). Otherwise
 * allocation-free once a call of the same shape has run on the thread.
 */
template <typename DQ, typename Storage, typename DOut, typename DLse, typename Scale = scale::InvSqrtDk,
          typename Mask = mask::None>
void cachedAttentionForwardInto(const Eigen::MatrixBase<DQ>& q, const KvSequence<Storage>& seq, const Heads& heads,
                                const Scale& scale, const Mask& mask, Eigen::MatrixBase<DOut>& out,
                                Eigen::MatrixBase<DLse>& logSumExp) {
  using Acc = typename KvCache<Storage>::Scalar;
  internal::assertPolicyTypes<Scale, Mask>();
  SDPA_STATIC_ASSERT((std::is_same_v<typename DOut::Scalar, Acc> && std::is_same_v<typename DLse::Scalar, Acc>),
                     THE_OUTPUTS_OF_cachedAttentionForwardInto_ARE_float__double_FOR_A_double_CACHE);
  const char* where = "sdpa::cachedAttention";
  internal::checkCached(where, q.rows(), q.cols(), seq, heads, scale, mask);
  const CacheShape& sh = seq.cache->shape();
  if (out.rows() != q.rows() || out.cols() != heads.query * sh.dV || logSumExp.rows() != q.rows() ||
      logSumExp.cols() != heads.query)
    internal::throwInvalid(where, "out is " + internal::shapeString(out.rows(), out.cols()) + " and logSumExp " +
                                      internal::shapeString(logSumExp.rows(), logSumExp.cols()) + "; they must be " +
                                      internal::shapeString(q.rows(), heads.query * sh.dV) + " and " +
                                      internal::shapeString(q.rows(), heads.query));
  thread_local std::vector<internal::cache::Piece> pieces;
  seq.cache->pieces(seq.id, pieces);
  const internal::cache::SequenceView view{&pieces, seq.cache->length(seq.id), seq.cache->firstPosition(seq.id)};
  const internal::HeadTaus<Acc> taus(scale, heads.query, sh.dK);
  const auto run = [&](const internal::ConstRef<Acc>& qa) {
    internal::cache::decode_cache_impl<Storage>::run(qa, view, heads, sh.dK, sh.dV, taus, mask, out.derived(),
                                                     logSumExp.derived());
  };
  if constexpr (scale::DependsOnKeyCount<Scale>) {
    // tau_i = value(d_k) r(n_i), n_i the positions row i sees of those the cache holds: the same
    // call on q' = r q (internal/key_count_scale.hpp).
    Matrix<double> factors;
    const Matrix<Acc> qs = internal::rowScaledQuery<Acc, Scale>(q, internal::singleItem(q.rows(), view.length), heads,
                                                                sh.dK, mask, factors, view.first);
    run(internal::ConstRef<Acc>(qs));
  } else if constexpr (std::is_same_v<typename DQ::Scalar, Acc>) {
    run(internal::ConstRef<Acc>(q));
  } else {
    const Matrix<Acc> qa = q.template cast<Acc>();
    run(internal::ConstRef<Acc>(qa));
  }
}

/// \brief cachedAttentionForwardInto, allocating its result (output and logSumExp).
template <typename DQ, typename Storage, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
MultiHeadForwardResult<typename KvCache<Storage>::Scalar> cachedAttentionForward(const Eigen::MatrixBase<DQ>& q,
                                                                                 const KvSequence<Storage>& seq,
                                                                                 const Heads& heads,
                                                                                 const Scale& scale = Scale(),
                                                                                 const Mask& mask = Mask()) {
  using Acc = typename KvCache<Storage>::Scalar;
  internal::checkCached("sdpa::cachedAttention", q.rows(), q.cols(), seq, heads, scale, mask);
  MultiHeadForwardResult<Acc> r{Matrix<Acc>(q.rows(), heads.query * seq.cache->shape().dV),
                                Matrix<Acc>(q.rows(), heads.query)};
  cachedAttentionForwardInto(q, seq, heads, scale, mask, r.output, r.logSumExp);
  return r;
}

/// \brief cachedAttentionForward on sequence 0 (a contiguous cache or a ring).
template <typename DQ, typename Storage, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
MultiHeadForwardResult<typename KvCache<Storage>::Scalar> cachedAttentionForward(const Eigen::MatrixBase<DQ>& q,
                                                                                 const KvCache<Storage>& cache,
                                                                                 const Heads& heads,
                                                                                 const Scale& scale = Scale(),
                                                                                 const Mask& mask = Mask()) {
  return cachedAttentionForward(q, cache.sequence(0), heads, scale, mask);
}

/// \brief Attention against a sequence of a KvCache, the output only: n_q x (H d_v).
template <typename DQ, typename Storage, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
Matrix<typename KvCache<Storage>::Scalar> cachedAttention(const Eigen::MatrixBase<DQ>& q,
                                                          const KvSequence<Storage>& seq, const Heads& heads,
                                                          const Scale& scale = Scale(), const Mask& mask = Mask()) {
  return cachedAttentionForward(q, seq, heads, scale, mask).output;
}

/// \brief cachedAttention on sequence 0 (a contiguous cache or a ring).
template <typename DQ, typename Storage, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
Matrix<typename KvCache<Storage>::Scalar> cachedAttention(const Eigen::MatrixBase<DQ>& q, const KvCache<Storage>& cache,
                                                          const Heads& heads, const Scale& scale = Scale(),
                                                          const Mask& mask = Mask()) {
  return cachedAttentionForward(q, cache.sequence(0), heads, scale, mask).output;
}

}  // namespace sdpa

#endif  // SDPA_KV_CACHE_HPP
