/**
 * \file sdpa/distributed.hpp
 * \brief Context parallelism over MPI: one sequence's attention split across the ranks of a
 * communicator by positions, as ring attention (K/V blocks travel around the ring) or as
 * DeepSpeed Ulysses (all-to-all from sequence to head sharding and back); forward and backward.
 *
 * Optional: this header needs MPI (`<mpi.h>`), the rest of sdpa does not. In CMake link
 * `sdpa::mpi` (created when `find_package(MPI)` finds MPI) instead of `sdpa::sdpa`.
 *
 * Each rank holds the rows of its slice of the sequence, packed as multiHeadAttention packs
 * them: q n_r x (H d_k), k n_r' x (H_kv d_k), v n_r' x (H_kv d_v), where a `Split` says which
 * global positions each rank's rows are (contiguous, uneven, or Megatron's zigzag that balances
 * causal work). Masks keep their meaning over the whole sequence: `Causal` (both alignments),
 * `SlidingWindow`, `Alibi`, `KeyLength`, `QueryLength` and `Softcap` see global positions and the
 * global lengths n_q and n_k; `Keep` and `Bias` read the whole n_q x n_k matrix, which every rank
 * must then hold. Every rank passes the same heads, splits, scale and mask.
 *
 * Communicators are the caller's; each call duplicates it (so that its messages never meet the
 * caller's) and makes every MPI call from the calling thread, so MPI_THREAD_FUNNELED suffices
 * (the kernels' OpenMP threads never call MPI). Bad input is found collectively: a rank with a
 * bad shape and every other rank throw the same std::invalid_argument, none waits in a receive.
 */
#ifndef SDPA_DISTRIBUTED_HPP
#define SDPA_DISTRIBUTED_HPP

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "backward.hpp"
#include "internal/backward_tiled.hpp"
#include "internal/distributed_mpi.hpp"
#include "mask.hpp"
#include "multihead.hpp"
#include "scale.hpp"

namespace sdpa::distributed {

/// Rows [global, global + rows) of the sequence, held at the rank's local rows [local, local + rows).
struct Segment {
  Index global, local, rows;
};

/**
 * \brief Which positions of a sequence each rank holds: per rank, its segments in local order.
 * `contiguous` and `sizes` give each rank one run of positions, in rank order; `zigzag` cuts the
 * sequence into 2P chunks and gives rank r chunks r and 2P - 1 - r (Megatron-LM's split for
 * causal attention, where a late chunk has more keys to see than an early one). A rank may hold
 * no rows.
 */
class Split {
 public:
  /// `rows` positions over `ranks` ranks, rank r holding [r rows / P, (r + 1) rows / P).
  static Split contiguous(Index rows, int ranks) {
    check(rows, ranks, "contiguous");
    std::vector<Index> sizes;
    sizes.reserve(size_t(ranks));
    for (int r = 0; r < ranks; ++r) sizes.push_back((Index(r) + 1) * rows / ranks - Index(r) * rows / ranks);
    return Split::sizes(sizes);
  }
  /// One run per rank, of the given lengths (any may be 0), in rank order.
  static Split sizes(const std::vector<Index>& rowsPerRank) {
    if (rowsPerRank.empty()) throw std::invalid_argument("sdpa::distributed::Split::sizes: need at least one rank");
    Split s;
    for (Index n : rowsPerRank) {
      if (n < 0)
        throw std::invalid_argument("sdpa::distributed::Split::sizes: a rank's row count is negative (" +
                                    std::to_string(n) + ")");
      s.m_segments.push_back(n > 0 ? std::vector<Segment>{{s.m_rows, 0, n}} : std::vector<Segment>{});
      s.m_rows += n;
    }
    return s;
  }
  /// 2P chunks of rows / 2P positions (the first ones one longer where it does not divide),
  /// rank r holding chunks r and 2P - 1 - r, in that order.
  static Split zigzag(Index rows, int ranks) {
    check(rows, ranks, "zigzag");
    const Index chunks = 2 * Index(ranks);
    const auto start = [&](Index c) { return c * rows / chunks; };
    Split s;
    s.m_rows = rows;
    for (int r = 0; r < ranks; ++r) {
      std::vector<Segment> segs;
      Index local = 0;
      for (Index c : {Index(r), chunks - 1 - Index(r)}) {
        const Index n = start(c + 1) - start(c);
        if (n > 0) segs.push_back({start(c), local, n});
        local += n;
      }
      s.m_segments.push_back(std::move(segs));
    }
    return s;
  }

  Index rows() const { return m_rows; }
  int ranks() const { return int(m_segments.size()); }
  const std::vector<Segment>& segments(int rank) const { return m_segments.at(size_t(rank)); }
  Index localRows(int rank) const {
    Index n = 0;
    for (const Segment& s : segments(rank)) n += s.rows;
    return n;
  }
  /// Every segment's numbers in order: two splits are the same iff these are.
  std::vector<Index> describe() const {
    std::vector<Index> d{m_rows, Index(m_segments.size())};
    for (const auto& segs : m_segments) {
      d.push_back(Index(segs.size()));
      for (const Segment& s : segs) d.insert(d.end(), {s.global, s.local, s.rows});
    }
    return d;
  }

 private:
  Split() = default;
  static void check(Index rows, int ranks, const char* what) {
    if (rows < 0 || ranks < 1)
      throw std::invalid_argument(std::string("sdpa::distributed::Split::") + what +
                                  ": need rows >= 0 and ranks >= 1, got " + std::to_string(rows) + " rows and " +
                                  std::to_string(ranks) + " ranks");
  }
  std::vector<std::vector<Segment>> m_segments;
  Index m_rows = 0;
};

namespace internal {
using sdpa::internal::ConstRef;
using sdpa::internal::HeadDims;

template <typename Scalar, typename Scale, typename Mask>
void assertDistributed() {
  SDPA_STATIC_ASSERT(sdpa::internal::IsSupportedScalar<Scalar>,
                     CONTEXT_PARALLEL_ATTENTION_TAKES_float_OR_double_INPUTS__CONVERT_HALF_INPUTS_FIRST);
  sdpa::internal::assertPolicyTypes<std::decay_t<Scale>, Mask>();
  SDPA_STATIC_ASSERT(!scale::DependsOnKeyCount<Scale>,
                     A_KEY_COUNT_SCALE_SUCH_AS_LogN_IS_NOT_SUPPORTED_ACROSS_RANKS__USE_A_FIXED_OR_LEARNABLE_SCALE);
}

/// The shapes and the split of one call, checked collectively (distributed::internal::agree).
struct Call {
  const char* where;
  MPI_Comm comm;
  int ranks, rank;
  const Split &qSplit, &kvSplit;
  Heads heads;
  HeadDims dims;
};

/**
 * Every check of a call on every rank, collectively: the rank's own shapes against the head
 * layout and its slices, its scale and mask against the global lengths; then that every rank
 * passed the same heads, head dimensions, scalar type and splits. Returns the head dimensions.
 */
template <typename Scalar, typename Scale, typename Mask>
HeadDims checkCall(const char* where, MPI_Comm comm, int ranks, int rank, Index qRows, Index qCols, Index kRows,
                   Index kCols, Index vRows, Index vCols, const Index* dOutShape, const Heads& heads,
                   const Split& qSplit, const Split& kvSplit, const Scale& scale, const Mask& mask,
                   const std::function<void()>& extra = {}) {
  HeadDims dims{0, 0};
  const std::string error = sdpa::internal::mpi::localErrors(where, [&] {
    using sdpa::internal::shapeString;
    using sdpa::internal::throwInvalid;
    if (qSplit.ranks() != ranks || kvSplit.ranks() != ranks)
      throwInvalid(where, "the splits are for " + std::to_string(qSplit.ranks()) + " and " +
                              std::to_string(kvSplit.ranks()) + " ranks but the communicator has " +
                              std::to_string(ranks));
    dims = sdpa::internal::checkHeads(where, heads, qRows, qCols, kRows, kCols, vRows, vCols);
    if (qRows != qSplit.localRows(rank))
      throwInvalid(where, "q is " + shapeString(qRows, qCols) + " but the query split gives this rank " +
                              std::to_string(qSplit.localRows(rank)) + " rows");
    if (kRows != kvSplit.localRows(rank))
      throwInvalid(where, "k is " + shapeString(kRows, kCols) + " but the key split gives this rank " +
                              std::to_string(kvSplit.localRows(rank)) + " rows");
    if (dOutShape && (dOutShape[0] != qRows || dOutShape[1] != heads.query * dims.dV))
      throwInvalid(where, "dOut is " + shapeString(dOutShape[0], dOutShape[1]) + " but the output is " +
                              shapeString(qRows, heads.query * dims.dV));
    sdpa::internal::checkScaleHeads(where, scale, heads.query);
    mask.check(where, qSplit.rows(), kvSplit.rows(), heads.query);
    if (extra) extra();
  });
  sdpa::internal::mpi::agree(
      comm, where, error,
      {heads.query, heads.keyValue, dims.dK, dims.dV, Index(sizeof(Scalar)),
       sdpa::internal::mpi::fingerprint(qSplit.describe()), sdpa::internal::mpi::fingerprint(kvSplit.describe())},
      {"the query heads H", "the kv heads H_kv", "d_k", "d_v", "the scalar type's size", "the query split",
       "the key split"});
  return dims;
}

/// The mask of the block of query segment sq and key segment sk (global positions).
template <typename Mask>
mask::internal::AtPositions<Mask> blockMask(const Mask& mask, const Segment& sq, const Segment& sk, const Call& c,
                                            Index head0 = 0) {
  return {mask, sq.global, sk.global, c.qSplit.rows(), c.kvSplit.rows(), head0, c.heads.query};
}

/// Whether the mask hides every (query, key) of the two segments for every head.
template <typename Mask>
bool hidden(const Mask& mask, const Segment& sq, const Segment& sk, const Call& c) {
  if (sq.rows == 0 || sk.rows == 0) return true;
  for (Index h = 0; h < c.heads.query; ++h)
    if (mask.classify(sq.global, sq.rows, sk.global, sk.rows, c.qSplit.rows(), c.kvSplit.rows(), h) !=
        mask::Tile::Hidden)
      return false;
  return true;
}

/**
 * The ring's schedule, the same on every rank: needs[r P + b] says whether rank r's queries see
 * a key of rank b's slice; block b (rank b's K/V) is at rank (b + s) mod P at step s and travels
 * while a later rank needs it: reach[b] = 1 + the last step whose rank needs it (at least 1).
 * A block nobody further on needs is not sent (a sliding window's distant slices).
 */
struct Ring {
  int ranks;
  std::vector<char> needs;
  std::vector<int> reach;

  template <typename Mask>
  Ring(const Call& c, const Mask& mask) : ranks(c.ranks), needs(size_t(c.ranks) * size_t(c.ranks), 0) {
    for (int r = 0; r < ranks; ++r)
      for (int b = 0; b < ranks; ++b)
        for (const Segment& sq : c.qSplit.segments(r))
          for (const Segment& sk : c.kvSplit.segments(b))
            if (!hidden(mask, sq, sk, c)) needs[at(r, b)] = 1;
    reach.assign(size_t(ranks), 1);
    for (int b = 0; b < ranks; ++b)
      for (int s = 0; s < ranks; ++s)
        if (needs[at((b + s) % ranks, b)]) reach[size_t(b)] = s + 1;
  }
  size_t at(int r, int b) const { return size_t(r) * size_t(ranks) + size_t(b); }
  bool need(int r, int b) const { return needs[at(r, b)] != 0; }
};

inline int ringMod(int x, int p) { return ((x % p) + p) % p; }

/**
 * Runs one turn of the ring. `own` is this rank's block, its K and V side by side (n_r x
 * (H_kv d_k + H_kv d_v)); at step s the rank holds block b = (r - s) mod P and calls
 * compute(b, block, grad), grad being null or, with `gradients`, a zeroed matrix shaped like the
 * block for this rank's share of dK and dV. The next block's transfer is in flight meanwhile
 * (MPI_Irecv / MPI_Isend posted before the computation). With `gradients` the accumulated dK
 * and dV of each block travel behind it (each rank adds its share and passes it on, the last
 * rank sends it home), and `ownGrad` receives this rank's block's total.
 */
template <typename Scalar, typename Compute>
void ringTurn(const Call& c, const Ring& ring, const Matrix<Scalar>& own, bool gradients, Compute&& compute,
              Matrix<Scalar>* ownGrad, const std::vector<Matrix<Scalar>>* preloaded = nullptr) {
  namespace mpi = sdpa::internal::mpi;
  if (preloaded) {
    // The benchmark's baseline: the same computation on every block, which this rank already
    // holds (all of them), with no message sent.
    Matrix<Scalar> part;
    for (int s = 0; s < c.ranks; ++s) {
      const int b = ringMod(c.rank - s, c.ranks);
      if (s >= ring.reach[size_t(b)] || !ring.need(c.rank, b)) continue;
      const Matrix<Scalar>& blk = (*preloaded)[size_t(b)];
      if (gradients) part.setZero(blk.rows(), blk.cols());
      compute(b, Eigen::Map<const Matrix<Scalar>>(blk.data(), blk.rows(), blk.cols()), gradients ? &part : nullptr);
      if (gradients && b == c.rank) *ownGrad = part;
    }
    return;
  }
  const int P = c.ranks, r = c.rank, next = ringMod(r + 1, P), prev = ringMod(r - 1, P);
  const Index cols = own.cols();
  const MPI_Datatype type = mpi::datatype<Scalar>();
  const auto rowsOf = [&](int b) { return c.kvSplit.localRows(b); };
  const auto n = [&](int b) { return mpi::count(c.where, rowsOf(b) * cols); };
  const auto ok = [&](int code, const char* call) { mpi::check(code, c.where, call); };
  Matrix<Scalar> received[2], part[2], incoming[2];
  // partSent[i]: the send of part[i], passed on or home, waited before part[i] is reused.
  MPI_Request partSent[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  MPI_Request incomingReq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  MPI_Request homeReq = MPI_REQUEST_NULL;
  if (gradients) {
    ownGrad->setZero(rowsOf(r), cols);
    const int reach = ring.reach[size_t(r)];
    if (reach > 1)
      ok(MPI_Irecv(ownGrad->data(), n(r), type, ringMod(r + reach - 1, P), 3 * r + 2, c.comm, &homeReq), "MPI_Irecv");
  }
  const Scalar* current = own.data();
  for (int s = 0; s < P; ++s) {
    const int b = ringMod(r - s, P), bNext = ringMod(r - s - 1, P);
    const bool holds = s < ring.reach[size_t(b)];
    const bool holdsNext = s + 1 < P && s + 1 < ring.reach[size_t(bNext)];
    MPI_Request kv[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    Matrix<Scalar>& into = received[s % 2];
    if (holdsNext) {
      into.resize(rowsOf(bNext), cols);
      ok(MPI_Irecv(into.data(), n(bNext), type, prev, 3 * bNext, c.comm, &kv[0]), "MPI_Irecv");
      if (gradients) {  // bNext's accumulated gradient, sent by prev after its share
        incoming[(s + 1) % 2].resize(rowsOf(bNext), cols);
        ok(MPI_Irecv(incoming[(s + 1) % 2].data(), n(bNext), type, prev, 3 * bNext + 1, c.comm,
                     &incomingReq[(s + 1) % 2]),
           "MPI_Irecv");
      }
    }
    if (holds && s + 1 < ring.reach[size_t(b)])
      ok(MPI_Isend(current, n(b), type, next, 3 * b, c.comm, &kv[1]), "MPI_Isend");
    if (holds) {
      const Eigen::Map<const Matrix<Scalar>> block(current, rowsOf(b), cols);
      Matrix<Scalar>* mine = nullptr;
      if (gradients) {
        ok(MPI_Wait(&partSent[s % 2], MPI_STATUS_IGNORE), "MPI_Wait");  // the buffer's send two steps ago
        part[s % 2].setZero(rowsOf(b), cols);
        mine = &part[s % 2];
      }
      if (ring.need(r, b)) compute(b, block, mine);
      if (gradients) {
        if (s > 0) {
          ok(MPI_Wait(&incomingReq[s % 2], MPI_STATUS_IGNORE), "MPI_Wait");
          *mine += incoming[s % 2];
        }
        if (s + 1 < ring.reach[size_t(b)])
          ok(MPI_Isend(mine->data(), n(b), type, next, 3 * b + 1, c.comm, &partSent[s % 2]), "MPI_Isend");
        else if (b != r)
          ok(MPI_Isend(mine->data(), n(b), type, b, 3 * b + 2, c.comm, &partSent[s % 2]), "MPI_Isend");
        else
          *ownGrad = *mine;
      }
    }
    ok(MPI_Waitall(2, kv, MPI_STATUSES_IGNORE), "MPI_Waitall");
    if (holdsNext) current = into.data();
  }
  // part[] stays alive until its last sends (passed on or home) are done.
  ok(MPI_Waitall(2, partSent, MPI_STATUSES_IGNORE), "MPI_Waitall");
  ok(MPI_Wait(&homeReq, MPI_STATUS_IGNORE), "MPI_Wait");
}

/// This rank's K and V side by side, the block that travels.
template <typename Scalar, typename DK, typename DV>
Matrix<Scalar> packBlock(const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v) {
  Matrix<Scalar> block(k.rows(), k.cols() + v.cols());
  block.leftCols(k.cols()) = k;
  block.rightCols(v.cols()) = v;
  return block;
}

/**
 * Folds a partial result (o_b, lse_b: the attention of some rows over some keys) into the
 * running one over the keys seen so far, in double: lse = log(e^lse_a + e^lse_b) and
 * o = (e^(lse_a - lse) o_a + e^(lse_b - lse) o_b). A row that sees no key in a part (lse -inf)
 * takes nothing from it; NaN spreads as in one call.
 */
template <typename DO, typename DL>
void mergeInto(Eigen::Ref<Matrix<double>> o, Eigen::Ref<Matrix<double>> lse, const Eigen::MatrixBase<DO>& ob,
               const Eigen::MatrixBase<DL>& lseB, Index dV) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  for (Index h = 0; h < lse.cols(); ++h)
    for (Index i = 0; i < lse.rows(); ++i) {
      const double a = lse(i, h), b = double(lseB(i, h));
      auto oa = o.block(i, h * dV, 1, dV);
      const auto obRow = ob.block(i, h * dV, 1, dV).template cast<double>();
      if (std::isnan(b) || std::isnan(a)) {
        lse(i, h) = std::numeric_limits<double>::quiet_NaN();
        oa.setConstant(std::numeric_limits<double>::quiet_NaN());
        continue;
      }
      if (b == -inf) continue;
      if (a == -inf) {
        lse(i, h) = b;
        oa = obRow;
        continue;
      }
      const double m = std::max(a, b), wa = std::exp(a - m), wb = std::exp(b - m), sum = wa + wb;
      oa = (wa / sum) * oa + (wb / sum) * obRow;
      lse(i, h) = m + std::log(sum);
    }
}

/// Query heads [h0, h0 + count) of a scale policy as per-head constants, in precision S.
template <typename S, typename Scale>
sdpa::internal::HeadTaus<S> headSubset(const Scale& scale, Index heads, Index dK, Index h0, Index count) {
  return sdpa::internal::HeadTaus<S>::subset(sdpa::internal::HeadTaus<S>(scale, heads, dK), h0, count);
}

/**
 * Ulysses' first all-to-all: this rank's rows of every head (x: n_r x (P w), rank t's heads in
 * columns [t w, (t + 1) w)) become the whole sequence of this rank's heads (N x w, rows in
 * global order, placed by the split's segments).
 */
template <typename Scalar>
Matrix<Scalar> toHeads(const Call& c, const Split& split, const Matrix<Scalar>& x, Index w) {
  namespace mpi = sdpa::internal::mpi;
  const int P = c.ranks;
  const size_t np = static_cast<size_t>(P);
  std::vector<int> sendCounts(np), sendOffsets(np), recvCounts(np), recvOffsets(np);
  Index at = 0;
  for (int t = 0; t < P; ++t) {
    sendCounts[size_t(t)] = mpi::count(c.where, x.rows() * w);
    sendOffsets[size_t(t)] = mpi::count(c.where, Index(t) * x.rows() * w);
    recvCounts[size_t(t)] = mpi::count(c.where, split.localRows(t) * w);
    recvOffsets[size_t(t)] = mpi::count(c.where, at);
    at += split.localRows(t) * w;
  }
  Vector<Scalar> received(at);
  mpi::check(MPI_Alltoallv(x.data(), sendCounts.data(), sendOffsets.data(), mpi::datatype<Scalar>(), received.data(),
                           recvCounts.data(), recvOffsets.data(), mpi::datatype<Scalar>(), c.comm),
             c.where, "MPI_Alltoallv");
  Matrix<Scalar> y(split.rows(), w);
  for (int t = 0; t < P; ++t) {
    const Eigen::Map<const Matrix<Scalar>> from(received.data() + recvOffsets[size_t(t)], split.localRows(t), w);
    for (const Segment& sg : split.segments(t)) y.middleRows(sg.global, sg.rows) = from.middleRows(sg.local, sg.rows);
  }
  return y;
}

/// Ulysses' second all-to-all, the inverse of toHeads: y (N x w, this rank's heads) becomes
/// this rank's rows of every head, n_r x (P w).
template <typename Scalar>
Matrix<Scalar> toSequence(const Call& c, const Split& split, const Matrix<Scalar>& y, Index w) {
  namespace mpi = sdpa::internal::mpi;
  const int P = c.ranks;
  const Index mine = split.localRows(c.rank);
  const size_t np = static_cast<size_t>(P);
  std::vector<int> sendCounts(np), sendOffsets(np), recvCounts(np), recvOffsets(np);
  Vector<Scalar> packed(split.rows() * w);
  Index at = 0;
  for (int t = 0; t < P; ++t) {
    const Index n = split.localRows(t);
    Eigen::Map<Matrix<Scalar>> to(packed.data() + at, n, w);
    for (const Segment& sg : split.segments(t)) to.middleRows(sg.local, sg.rows) = y.middleRows(sg.global, sg.rows);
    sendCounts[size_t(t)] = mpi::count(c.where, n * w);
    sendOffsets[size_t(t)] = mpi::count(c.where, at);
    recvCounts[size_t(t)] = mpi::count(c.where, mine * w);
    recvOffsets[size_t(t)] = mpi::count(c.where, Index(t) * mine * w);
    at += n * w;
  }
  Matrix<Scalar> x(mine, Index(P) * w);
  mpi::check(MPI_Alltoallv(packed.data(), sendCounts.data(), sendOffsets.data(), mpi::datatype<Scalar>(), x.data(),
                           recvCounts.data(), recvOffsets.data(), mpi::datatype<Scalar>(), c.comm),
             c.where, "MPI_Alltoallv");
  return x;
}

/// Ulysses' extra condition: the heads shard evenly over the ranks (checked on every rank alike).
inline void checkHeadsShard(const char* where, const Heads& heads, int ranks) {
  if (heads.query % ranks != 0 || heads.keyValue % ranks != 0)
    sdpa::internal::throwInvalid(where, "Heads{" + std::to_string(heads.query) + ", " + std::to_string(heads.keyValue) +
                                            "} do not shard over " + std::to_string(ranks) +
                                            " ranks: Ulysses needs H and H_kv divisible by the rank count (use "
                                            "ringAttention* otherwise)");
}

}  // namespace internal

namespace internal {
/// ringAttentionForward; with `preloaded` (every rank's K/V block, packed) the same computation
/// without a message: the benchmark's measure of what the communication costs.
template <typename DQ, typename DK, typename DV, typename Scale, typename Mask>
MultiHeadForwardResult<typename DQ::Scalar> ringForward(
    MPI_Comm comm, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Heads& heads, const Split& qSplit, const Split& kvSplit, const Scale& scale, const Mask& mask,
    const std::vector<Matrix<typename DQ::Scalar>>* preloaded = nullptr) {
  using Scalar = typename DQ::Scalar;
  internal::assertDistributed<Scalar, Scale, Mask>();
  sdpa::internal::assertForwardScalars<DQ, DK, DV>();
  constexpr const char* where = "sdpa::distributed::ringAttentionForward";
  const sdpa::internal::mpi::Duplicate dup(comm, where);
  internal::Call c{where, dup.get(), dup.size(), dup.rank(), qSplit, kvSplit, heads, {0, 0}};
  c.dims = internal::checkCall<Scalar>(where, c.comm, c.ranks, c.rank, q.rows(), q.cols(), k.rows(), k.cols(), v.rows(),
                                       v.cols(), nullptr, heads, qSplit, kvSplit, scale, mask);
  const sdpa::internal::HeadDims dims = c.dims;
  const Index H = heads.query, cK = heads.keyValue * dims.dK;
  const internal::Ring ring(c, mask);
  const Matrix<Scalar> own = internal::packBlock<Scalar>(k, v);
  // q in place in either storage order (k and v travel packed: own). (A copy only for an expression.)
  const sdpa::internal::InputView<Scalar, DQ> qm(q);
  Matrix<double> o = Matrix<double>::Zero(q.rows(), H * dims.dV);
  Matrix<double> lse = Matrix<double>::Constant(q.rows(), H, -std::numeric_limits<double>::infinity());
  Matrix<Scalar> partOut;
  Matrix<Scalar> partLse;
  internal::ringTurn<Scalar>(
      c, ring, own, false,
      [&](int b, const Eigen::Map<const Matrix<Scalar>>& block, Matrix<Scalar>*) {
        for (const Segment& sq : qSplit.segments(c.rank))
          for (const Segment& sk : kvSplit.segments(b)) {
            if (internal::hidden(mask, sq, sk, c)) continue;
            partOut.resize(sq.rows, H * dims.dV);
            partLse.resize(sq.rows, H);
            const auto mk = internal::blockMask(mask, sq, sk, c);
            sdpa::internal::batchedForwardInto<Scalar>(
                where, kernel::Tiled{}, qm.middleRows(sq.local, sq.rows), block.block(sk.local, 0, sk.rows, cK),
                block.block(sk.local, cK, sk.rows, block.cols() - cK), sdpa::internal::singleItem(sq.rows, sk.rows),
                heads, dims, scale, mk, Dropout(), nullptr, Eigen::Ref<Matrix<Scalar>>(partOut),
                Eigen::Ref<Matrix<Scalar>>(partLse));
            internal::mergeInto(o.middleRows(sq.local, sq.rows), lse.middleRows(sq.local, sq.rows), partOut, partLse,
                                dims.dV);
          }
      },
      nullptr, preloaded);
  return {o.cast<Scalar>(), lse.cast<Scalar>()};
}
}  // namespace internal

/**
 * \brief Ring attention, forward: this rank's output rows and logSumExp of
 * multiHeadAttention over the whole sequence.
 *
 * Each rank computes its queries against its own K/V and then against every other rank's, which
 * travel around the ring (rank r sends to r + 1) while the block in hand is computed; the
 * partial results merge by their logSumExp. (query slice, key slice) pairs that the mask hides
 * entirely are skipped, and a block is not sent on once no later rank needs it.
 *
 * \param comm the ranks that share the sequence (the caller's communicator; collective)
 * \param q, k, v this rank's rows, packed heads: n_r x (H d_k), n_r' x (H_kv d_k), n_r' x (H_kv d_v)
 * \param heads Heads{H} or Heads{H, H_kv}
 * \param qSplit, kvSplit the positions of every rank's query and key rows (kvSplit may differ:
 *        n_k != n_q, e.g. cached keys before the queries)
 * \param scale, mask as multiHeadAttention's, over global positions (not a key-count scale)
 * \returns output n_r x (H d_v) and logSumExp n_r x H, in the precision of the inputs.
 * \throws std::invalid_argument on every rank if any rank's shapes or arguments are bad.
 */
template <typename DQ, typename DK, typename DV, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
MultiHeadForwardResult<typename DQ::Scalar> ringAttentionForward(MPI_Comm comm, const Eigen::MatrixBase<DQ>& q,
                                                                 const Eigen::MatrixBase<DK>& k,
                                                                 const Eigen::MatrixBase<DV>& v, const Heads& heads,
                                                                 const Split& qSplit, const Split& kvSplit,
                                                                 const Scale& scale = Scale(),
                                                                 const Mask& mask = Mask()) {
  return internal::ringForward(comm, q, k, v, heads, qSplit, kvSplit, scale, mask);
}

namespace internal {
/// ringAttentionBackward; `preloaded` as for ringForward (the gradients are then not complete).
template <typename DQ, typename DK, typename DV, typename DO, typename Scale, typename Mask>
MultiHeadGradients<typename DQ::Scalar> ringBackward(
    MPI_Comm comm, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DO>& dOut, const Heads& heads, const Split& qSplit, const Split& kvSplit, Scale&& scale,
    const Mask& mask, const std::vector<Matrix<typename DQ::Scalar>>* preloaded = nullptr) {
  using Scalar = typename DQ::Scalar;
  using Impl = sdpa::internal::backward_tiled_impl<Scalar>;
  internal::assertDistributed<Scalar, std::decay_t<Scale>, Mask>();
  sdpa::internal::assertBackwardTypes<kernel::Tiled, DQ, DK, DV, DO, std::decay_t<Scale>, Mask>();
  constexpr const char* where = "sdpa::distributed::ringAttentionBackward";
  const sdpa::internal::mpi::Duplicate dup(comm, where);
  const Index dOutShape[2] = {dOut.rows(), dOut.cols()};
  internal::Call c{where, dup.get(), dup.size(), dup.rank(), qSplit, kvSplit, heads, {0, 0}};
  c.dims = internal::checkCall<Scalar>(where, c.comm, c.ranks, c.rank, q.rows(), q.cols(), k.rows(), k.cols(), v.rows(),
                                       v.cols(), dOutShape, heads, qSplit, kvSplit, scale, mask);
  const sdpa::internal::HeadDims dims = c.dims;
  const Index H = heads.query, n = q.rows(), cK = heads.keyValue * dims.dK;
  const sdpa::internal::HeadTaus<Scalar> taus(scale, H, dims.dK);
  const internal::Ring ring(c, mask);
  const Matrix<Scalar> own = internal::packBlock<Scalar>(k, v);
  // q and dO in place in either storage order (k and v travel packed: own). (Copies only for
  // expressions.)
  using QView = sdpa::internal::InputView<Scalar, DQ>;
  using OView = sdpa::internal::InputView<Scalar, DO>;
  const QView qm(q);
  const OView dOm(dOut);
  const auto& segs = qSplit.segments(c.rank);

  // Each query segment's rows (rows x 4H, the layout of BackwardRows): maxima, sums, D and
  // centres, H columns each.
  std::vector<Matrix<Scalar>> rows(segs.size()), part(segs.size());
  const auto rowsView = [&](Matrix<Scalar>& m, Index h) {
    return typename Impl::Rows{m.col(h), m.col(H + h), m.col(2 * H + h), m.col(3 * H + h)};
  };
  for (size_t i = 0; i < segs.size(); ++i) {
    rows[i].setZero(segs[i].rows, 4 * H);
    rows[i].leftCols(H).setConstant(-std::numeric_limits<Scalar>::infinity());
  }
  Matrix<Scalar> none;
  Vector<Scalar> noScale = Vector<Scalar>::Zero(H), dscale = Vector<Scalar>::Zero(H);
  const auto blockCall = [&](const Segment& sq, const Segment& sk, const Eigen::Map<const Matrix<Scalar>>& block,
                             const auto& f) {
    const auto mk = internal::blockMask(mask, sq, sk, c);
    using Ref = sdpa::internal::ConstRef<Scalar>;
    f(QView(qm.middleRows(sq.local, sq.rows)), Ref(block.block(sk.local, 0, sk.rows, cK)),
      Ref(block.block(sk.local, cK, sk.rows, block.cols() - cK)), OView(dOm.middleRows(sq.local, sq.rows)), mk);
  };

  // Turn 1: the rows' sums over every key block.
  internal::ringTurn<Scalar>(
      c, ring, own, false,
      [&](int b, const Eigen::Map<const Matrix<Scalar>>& block, Matrix<Scalar>*) {
        for (size_t i = 0; i < segs.size(); ++i)
          for (const Segment& sk : kvSplit.segments(b)) {
            const Segment& sq = segs[i];
            if (internal::hidden(mask, sq, sk, c)) continue;
            part[i].resize(sq.rows, 4 * H);
            blockCall(sq, sk, block,
                      [&](const auto& qs, const auto& ks, const auto& vs, const auto& dOs, const auto& mk) {
                        using Ref = sdpa::internal::ConstRef<Scalar>;
                        sdpa::internal::backwardTiled<Scalar, QView, Ref, Ref, OView>(
                            kernel::Tiled{}, qs, ks, vs, dOs, sdpa::internal::singleItem(sq.rows, sk.rows), heads, dims,
                            taus, mk, Dropout(), none, none, none, noScale, nullptr,
                            {sdpa::internal::BackwardRows::Collect, part[i].data()});
                      });
            for (Index h = 0; h < H; ++h) Impl::mergeRows(rowsView(rows[i], h), rowsView(part[i], h));
          }
      },
      nullptr, preloaded);
  const Scalar cap = Scalar(mask::internal::softcapOf(mask));
  for (size_t i = 0; i < segs.size(); ++i)
    for (Index h = 0; h < H; ++h) Impl::finishRows(rowsView(rows[i], h), 0, segs[i].rows, cap);

  // Turn 2: the gradients of every block from those rows; dK and dV travel behind the blocks.
  MultiHeadGradients<Scalar> g{
      Matrix<Scalar>::Zero(n, q.cols()), Matrix<Scalar>(), Matrix<Scalar>(), Vector<Scalar>::Zero(H), {}};
  Matrix<Scalar> ownGrad;
  internal::ringTurn<Scalar>(
      c, ring, own, true,
      [&](int b, const Eigen::Map<const Matrix<Scalar>>& block, Matrix<Scalar>* grad) {
        for (size_t i = 0; i < segs.size(); ++i)
          for (const Segment& sk : kvSplit.segments(b)) {
            const Segment& sq = segs[i];
            if (internal::hidden(mask, sq, sk, c)) continue;
            auto dq = g.dq.middleRows(sq.local, sq.rows);
            auto dk = grad->block(sk.local, 0, sk.rows, cK);
            auto dv = grad->block(sk.local, cK, sk.rows, grad->cols() - cK);
            blockCall(sq, sk, block,
                      [&](const auto& qs, const auto& ks, const auto& vs, const auto& dOs, const auto& mk) {
                        using Ref = sdpa::internal::ConstRef<Scalar>;
                        sdpa::internal::backwardTiled<Scalar, QView, Ref, Ref, OView>(
                            kernel::Tiled{}, qs, ks, vs, dOs, sdpa::internal::singleItem(sq.rows, sk.rows), heads, dims,
                            taus, mk, Dropout(), Eigen::Ref<Matrix<Scalar>>(dq), Eigen::Ref<Matrix<Scalar>>(dk),
                            Eigen::Ref<Matrix<Scalar>>(dv), Eigen::Ref<Vector<Scalar>>(dscale), nullptr,
                            {sdpa::internal::BackwardRows::Given, rows[i].data()});
                      });
          }
      },
      &ownGrad, preloaded);
  if (ownGrad.rows() != k.rows()) ownGrad.setZero(k.rows(), own.cols());  // (preloaded: a rank that needs no key)
  g.dk = ownGrad.leftCols(cK);
  g.dv = ownGrad.rightCols(ownGrad.cols() - cK);
  sdpa::internal::mpi::check(
      MPI_Allreduce(dscale.data(), g.dscale.data(), int(H), sdpa::internal::mpi::datatype<Scalar>(), MPI_SUM, c.comm),
      where, "MPI_Allreduce");
  if constexpr (sdpa::internal::AccumulatesInto<Scale>) sdpa::internal::accumulateScaleGrad(scale, g.dscale);
  return g;
}
}  // namespace internal

/**
 * \brief Ring attention, backward: this rank's dq, dk, dv and the whole sequence's dscale.
 *
 * Two turns of the ring. The first gathers each query row's softmax statistics over every key
 * block (the backward's first pass, merged as OnlineSoftmax states merge); the second computes
 * every block's gradients from those rows, dK and dV accumulating behind the travelling block
 * and returning to its rank. The softmax is recomputed from q and k, as in
 * multiHeadAttentionBackward (NUMERICS.md), so the forward's results are not needed. dscale is
 * summed over the ranks (one all-reduce) and a non-const Learnable accumulates it on every rank.
 *
 * \param comm, q, k, v, heads, qSplit, kvSplit as for ringAttentionForward
 * \param dOut dL/dO of this rank's output rows, n_r x (H d_v)
 * \param scale the forward's policy; a non-const Learnable accumulates the all-reduced dscale
 * \param mask the forward's mask
 * \returns this rank's dq (n_r x (H d_k)), dk and dv (its key rows) and dscale (H, every rank's sum).
 */
template <typename DQ, typename DK, typename DV, typename DO, typename Scale, typename Mask = mask::None>
MultiHeadGradients<typename DQ::Scalar> ringAttentionBackward(MPI_Comm comm, const Eigen::MatrixBase<DQ>& q,
                                                              const Eigen::MatrixBase<DK>& k,
                                                              const Eigen::MatrixBase<DV>& v,
                                                              const Eigen::MatrixBase<DO>& dOut, const Heads& heads,
                                                              const Split& qSplit, const Split& kvSplit, Scale&& scale,
                                                              const Mask& mask = Mask()) {
  return internal::ringBackward(comm, q, k, v, dOut, heads, qSplit, kvSplit, std::forward<Scale>(scale), mask);
}

/**
 * \brief DeepSpeed Ulysses, forward: the same results as ringAttentionForward by another route.
 * One all-to-all turns the sequence-sharded q, k, v into the whole sequence of H / P query heads
 * (and H_kv / P kv heads) per rank, the ordinary kernel runs on them, and a second all-to-all
 * returns the output (and logSumExp) to this rank's rows. H and H_kv must divide by the rank
 * count (a clear error otherwise). Moves 4 n d (H + 2 H_kv) / H bytes per rank for
 * float instead of the ring's (P - 1) K/V blocks; needs the whole sequence of its heads in memory.
 */
template <typename DQ, typename DK, typename DV, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
MultiHeadForwardResult<typename DQ::Scalar> ulyssesAttentionForward(MPI_Comm comm, const Eigen::MatrixBase<DQ>& q,
                                                                    const Eigen::MatrixBase<DK>& k,
                                                                    const Eigen::MatrixBase<DV>& v, const Heads& heads,
                                                                    const Split& qSplit, const Split& kvSplit,
                                                                    const Scale& scale = Scale(),
                                                                    const Mask& mask = Mask()) {
  using Scalar = typename DQ::Scalar;
  internal::assertDistributed<Scalar, Scale, Mask>();
  sdpa::internal::assertForwardScalars<DQ, DK, DV>();
  constexpr const char* where = "sdpa::distributed::ulyssesAttentionForward";
  const sdpa::internal::mpi::Duplicate dup(comm, where);
  internal::Call c{where, dup.get(), dup.size(), dup.rank(), qSplit, kvSplit, heads, {0, 0}};
  c.dims = internal::checkCall<Scalar>(where, c.comm, c.ranks, c.rank, q.rows(), q.cols(), k.rows(), k.cols(), v.rows(),
                                       v.cols(), nullptr, heads, qSplit, kvSplit, scale, mask,
                                       [&] { internal::checkHeadsShard(where, heads, c.ranks); });
  const sdpa::internal::HeadDims dims = c.dims;
  const Index hp = heads.query / c.ranks, hkvp = heads.keyValue / c.ranks;
  const Matrix<Scalar> qh = internal::toHeads<Scalar>(c, qSplit, q, hp * dims.dK);
  const Matrix<Scalar> kh = internal::toHeads<Scalar>(c, kvSplit, k, hkvp * dims.dK);
  const Matrix<Scalar> vh = internal::toHeads<Scalar>(c, kvSplit, v, hkvp * dims.dV);
  const auto taus = internal::headSubset<Scalar>(scale, heads.query, dims.dK, c.rank * hp, hp);
  const mask::internal::AtPositions<Mask> mk{mask, 0, 0, qSplit.rows(), kvSplit.rows(), c.rank * hp, heads.query};
  Matrix<Scalar> out(qSplit.rows(), hp * dims.dV), lse(qSplit.rows(), hp);
  sdpa::internal::batchedForwardInto<Scalar>(
      where, kernel::Tiled{}, qh, kh, vh, sdpa::internal::singleItem(qSplit.rows(), kvSplit.rows()), Heads{hp, hkvp},
      dims, taus, mk, Dropout(), nullptr, Eigen::Ref<Matrix<Scalar>>(out), Eigen::Ref<Matrix<Scalar>>(lse));
  return {internal::toSequence<Scalar>(c, qSplit, out, hp * dims.dV), internal::toSequence<Scalar>(c, qSplit, lse, hp)};
}

/**
 * \brief DeepSpeed Ulysses, backward: q, k, v and dOut go to head sharding by all-to-all, the
 * ordinary backward runs on this rank's heads over the whole sequence, and dq, dk, dv return
 * to this rank's rows. dscale is gathered over the ranks (each computes its own heads') and a
 * non-const Learnable accumulates it on every rank.
 */
template <typename DQ, typename DK, typename DV, typename DO, typename Scale, typename Mask = mask::None>
MultiHeadGradients<typename DQ::Scalar> ulyssesAttentionBackward(MPI_Comm comm, const Eigen::MatrixBase<DQ>& q,
                                                                 const Eigen::MatrixBase<DK>& k,
                                                                 const Eigen::MatrixBase<DV>& v,
                                                                 const Eigen::MatrixBase<DO>& dOut, const Heads& heads,
                                                                 const Split& qSplit, const Split& kvSplit,
                                                                 Scale&& scale, const Mask& mask = Mask()) {
  using Scalar = typename DQ::Scalar;
  internal::assertDistributed<Scalar, std::decay_t<Scale>, Mask>();
  sdpa::internal::assertBackwardTypes<kernel::Tiled, DQ, DK, DV, DO, std::decay_t<Scale>, Mask>();
  constexpr const char* where = "sdpa::distributed::ulyssesAttentionBackward";
  const sdpa::internal::mpi::Duplicate dup(comm, where);
  const Index dOutShape[2] = {dOut.rows(), dOut.cols()};
  internal::Call c{where, dup.get(), dup.size(), dup.rank(), qSplit, kvSplit, heads, {0, 0}};
  c.dims = internal::checkCall<Scalar>(where, c.comm, c.ranks, c.rank, q.rows(), q.cols(), k.rows(), k.cols(), v.rows(),
                                       v.cols(), dOutShape, heads, qSplit, kvSplit, scale, mask,
                                       [&] { internal::checkHeadsShard(where, heads, c.ranks); });
  const sdpa::internal::HeadDims dims = c.dims;
  const Index H = heads.query, hp = H / c.ranks, hkvp = heads.keyValue / c.ranks;
  const Matrix<Scalar> qh = internal::toHeads<Scalar>(c, qSplit, q, hp * dims.dK);
  const Matrix<Scalar> kh = internal::toHeads<Scalar>(c, kvSplit, k, hkvp * dims.dK);
  const Matrix<Scalar> vh = internal::toHeads<Scalar>(c, kvSplit, v, hkvp * dims.dV);
  const Matrix<Scalar> dOh = internal::toHeads<Scalar>(c, qSplit, dOut, hp * dims.dV);
  const auto taus = internal::headSubset<Scalar>(scale, H, dims.dK, c.rank * hp, hp);
  const mask::internal::AtPositions<Mask> mk{mask, 0, 0, qSplit.rows(), kvSplit.rows(), c.rank * hp, H};
  Matrix<Scalar> dq = Matrix<Scalar>::Zero(qh.rows(), qh.cols()), dk = Matrix<Scalar>::Zero(kh.rows(), kh.cols()),
                 dv = Matrix<Scalar>::Zero(vh.rows(), vh.cols());
  Vector<Scalar> dscale = Vector<Scalar>::Zero(H);
  auto mine = dscale.segment(c.rank * hp, hp);
  sdpa::internal::batchedBackwardInto<Scalar>(
      kernel::Tiled{}, qh, kh, vh, dOh, sdpa::internal::singleItem(qSplit.rows(), kvSplit.rows()), Heads{hp, hkvp},
      dims, taus, mk, Dropout(), dq, dk, dv, Eigen::Ref<Vector<Scalar>>(mine), nullptr);
  MultiHeadGradients<Scalar> g{internal::toSequence<Scalar>(c, qSplit, dq, hp * dims.dK),
                               internal::toSequence<Scalar>(c, kvSplit, dk, hkvp * dims.dK),
                               internal::toSequence<Scalar>(c, kvSplit, dv, hkvp * dims.dV),
                               Vector<Scalar>(H),
                               {}};
  sdpa::internal::mpi::check(
      MPI_Allreduce(dscale.data(), g.dscale.data(), int(H), sdpa::internal::mpi::datatype<Scalar>(), MPI_SUM, c.comm),
      where, "MPI_Allreduce");
  if constexpr (sdpa::internal::AccumulatesInto<Scale>) sdpa::internal::accumulateScaleGrad(scale, g.dscale);
  return g;
}

}  // namespace sdpa::distributed

#endif  // SDPA_DISTRIBUTED_HPP
