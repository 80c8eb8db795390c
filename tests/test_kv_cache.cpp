// KvCache (contiguous, ring, paged; float, double, half, bf16, q8, q4 storage) and
// cachedAttention against multiHeadAttention over the same logical keys.
#include <sdpa/kv_cache.hpp>

#include <cstdint>
#include <random>

#include "support/cases.hpp"
#include "support/quant_bound.hpp"

namespace {

using sdpa::CacheShape;
using sdpa::Heads;
using sdpa::Index;
using sdpa::KvCache;
using sdpa_test::Mat;

Mat<float> kvRows(Index rows, Index cols, std::mt19937_64& gen, float sd = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sd);
  Mat<float> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = dist(gen);
  return m;
}

/// The values a cache of `Storage` keeps for float input (rounded to half, bf16; else as given).
template <typename Storage>
Mat<float> kvStored(const Mat<float>& x) {
  if constexpr (std::is_same_v<Storage, Eigen::half> || std::is_same_v<Storage, Eigen::bfloat16>)
    return x.cast<Storage>().template cast<float>();
  else
    return x;
}

/// cachedAttention of q (the last n_q positions) against a sequence holding k, v (all of the
/// sequence's positions) checked against multiHeadAttention over k, v, by the FlashAttention rule
/// (twice the error of the plain float computation against the double oracle, plus rounding).
/// For double storage the plain computation is in double. Every storage but double (Eigen's
/// products, whatever the ISA) is read on every ISA path this CPU has (the decoding kernels of
/// decode_rows.hpp, the column kernels of half.hpp, the quantised kernels), against references
/// computed once.
template <typename Storage, typename Scale, typename Mask>
void checkAgainstWhole(const sdpa::KvSequence<Storage>& seq, const Mat<float>& q, const Mat<float>& k,
                       const Mat<float>& v, const Heads& heads, const Scale& scale, const Mask& mask) {
  using Acc = typename KvCache<Storage>::Scalar;
  const Mat<float> ks = kvStored<Storage>(k), vs = kvStored<Storage>(v);
  const auto gold = sdpa::multiHeadAttentionForward(sdpa::kernel::Naive{}, q.cast<double>(), ks.cast<double>(),
                                                    vs.cast<double>(), heads, scale, mask);
  const auto plain = sdpa::multiHeadAttentionForward(sdpa::kernel::Naive{}, q.cast<Acc>(), ks.cast<Acc>(),
                                                     vs.cast<Acc>(), heads, scale, mask);
  double lseScale = 0;
  for (Index i = 0; i < gold.logSumExp.size(); ++i)
    if (std::isfinite(gold.logSumExp.data()[i])) lseScale = std::max(lseScale, std::abs(gold.logSumExp.data()[i]));
  const double outScale = sdpa_test::maxAbs(gold.output);
  const double naive = sdpa_test::maxAbsDiff(plain.output, gold.output);
  sdpa_test::forEachIsa([&](sdpa::internal::Isa isa) {
    if (std::is_same_v<Storage, double> && isa != sdpa::internal::Isa::Portable) return;
    const auto got = sdpa::cachedAttentionForward(q.cast<Acc>(), seq, heads, scale, mask);
    REQUIRE(got.output.rows() == q.rows());
    REQUIRE(got.output.cols() == gold.output.cols());
    const double err = sdpa_test::maxAbsDiff(got.output, gold.output);
    INFO("output error " << err << ", plain computation's " << naive);
    CHECK(err <= sdpa_test::errorBound<Acc>(naive, outScale, lseScale));
    for (Index i = 0; i < gold.logSumExp.size(); ++i) {
      const double g = gold.logSumExp.data()[i], c = double(got.logSumExp.data()[i]);
      if (std::isinf(g)) {
        CHECK(c == -std::numeric_limits<double>::infinity());
      } else {
        CHECK(std::abs(c - g) <= sdpa_test::errorBound<Acc>(std::abs(double(plain.logSumExp.data()[i]) - g), lseScale));
      }
    }
    CHECK(got.output.allFinite());
  });
}

/// The same keys (k, v: n rows of Hkv heads of d) in a contiguous cache and in a paged one's
/// sequence seq (blocks of `block` keys).
template <typename Storage>
struct BothCaches {
  KvCache<Storage> contiguous, paged;
  Index seq;
  BothCaches(const Mat<float>& k, const Mat<float>& v, Index Hkv, Index d, Index block)
      : contiguous(KvCache<Storage>::contiguous({Hkv, d, d}, k.rows())),
        paged(KvCache<Storage>::paged({Hkv, d, d}, block, k.rows() / block + 1)),
        seq(paged.addSequence()) {
    contiguous.append(k, v);
    paged.append(seq, k, v);
  }
};

/// Appends rows [from, to) of k and v to a sequence in chunks of the given sizes, cycling.
template <typename Storage>
void appendInChunks(KvCache<Storage>& cache, Index seq, const Mat<float>& k, const Mat<float>& v, Index from, Index to,
                    std::initializer_list<Index> sizes) {
  Index i = from;
  for (size_t c = 0; i < to; ++c) {
    const Index n = std::min(*(sizes.begin() + c % sizes.size()), to - i);
    cache.append(seq, k.middleRows(i, n), v.middleRows(i, n));
    i += n;
  }
}

}  // namespace

TEMPLATE_TEST_CASE("KvCache contiguous: cachedAttention equals multiHeadAttention over the same keys", "[kvcache]",
                   float, double, Eigen::half, Eigen::bfloat16) {
  using Storage = TestType;
  std::mt19937_64 gen(7);
  struct Case {
    Heads heads;
    Index dK, dV, n, nQ;
  };
  const Case cases[] = {{Heads{1}, 8, 8, 1, 1},        {Heads{4, 2}, 16, 12, 300, 1},   {Heads{3}, 5, 7, 77, 3},
                        {Heads{8, 1}, 32, 32, 700, 4}, {Heads{4, 2}, 16, 16, 2100, 16}, {Heads{2, 1}, 8, 4, 90, 20}};
  for (const Case& cs : cases) {
    const Index H = cs.heads.query, Hkv = cs.heads.keyValue;
    DYNAMIC_SECTION("H " << H << "/" << Hkv << " d " << cs.dK << "/" << cs.dV << " n " << cs.n << " n_q " << cs.nQ) {
      const Mat<float> k = kvRows(cs.n, Hkv * cs.dK, gen), v = kvRows(cs.n, Hkv * cs.dV, gen);
      const Mat<float> q = kvRows(cs.nQ, H * cs.dK, gen, 2.0f);
      auto cache = KvCache<Storage>::contiguous(CacheShape{Hkv, cs.dK, cs.dV}, cs.n + 5);
      appendInChunks(cache, 0, k, v, 0, cs.n, {1, 5, 37, 2});
      REQUIRE(cache.length() == cs.n);
      const auto seq = cache.sequence(0);
      const auto lr = sdpa::mask::Align::LowerRight;
      checkAgainstWhole(seq, q, k, v, cs.heads, sdpa::scale::InvSqrtDk{}, sdpa::mask::None{});
      checkAgainstWhole(seq, q, k, v, cs.heads, sdpa::scale::None{}, sdpa::mask::Causal{lr});
      checkAgainstWhole(seq, q, k, v, cs.heads, sdpa::scale::InvSqrtDk{},
                        sdpa::mask::combine(sdpa::mask::Causal{lr}, sdpa::mask::Alibi::standard(H, lr)));
      checkAgainstWhole(seq, q, k, v, cs.heads, sdpa::scale::Temperature{0.5}, sdpa::mask::SlidingWindow{40, 0, lr});
      checkAgainstWhole(seq, q, k, v, cs.heads, sdpa::scale::InvSqrtDk{},
                        sdpa::mask::combine(sdpa::mask::Softcap{5.0}, sdpa::mask::Causal{lr}));
      // A key-count scale: each row's tau follows the keys it sees in the cache (C10).
      checkAgainstWhole(seq, q, k, v, cs.heads, sdpa::scale::LogN::matching(64), sdpa::mask::None{});
      checkAgainstWhole(seq, q, k, v, cs.heads, sdpa::scale::LogN::matching(64), sdpa::mask::Causal{lr});
      checkAgainstWhole(seq, q, k, v, cs.heads, sdpa::scale::LogN{0.3}, sdpa::mask::SlidingWindow{40, 0, lr});
    }
  }
}

TEST_CASE("KvCache: a query head of a GQA group gets the bits of its head alone", "[kvcache]") {
  // The group's rows (group size x n_q) run in the multi-row blocks: 8 (2 x 4), 12 (8 + 4 rows
  // of logits, two blocks of 6 of values), 16 and 64 rows.
  std::mt19937_64 gen(11);
  const Index dK = 64, dV = 64, n = 5000;
  for (const auto& [heads, nQ] :
       {std::pair<Heads, Index>{Heads{8, 2}, 2}, {Heads{8, 2}, 3}, {Heads{16, 2}, 2}, {Heads{8, 1}, 8}}) {
    const Index H = heads.query, Hkv = heads.keyValue, G = heads.groupSize();
    INFO("Heads{" << H << ", " << Hkv << "}, n_q " << nQ);
    const Mat<float> k = kvRows(n, Hkv * dK, gen), v = kvRows(n, Hkv * dV, gen), q = kvRows(nQ, H * dK, gen);
    auto group = KvCache<float>::contiguous({Hkv, dK, dV}, n);
    group.append(k, v);
    const auto all = sdpa::cachedAttention(q, group, heads);
    for (Index h = 0; h < H; ++h) {
      const Index kv = h / G;
      auto alone = KvCache<float>::contiguous({1, dK, dV}, n);
      alone.append(k.middleCols(kv * dK, dK), v.middleCols(kv * dV, dV));
      const auto one = sdpa::cachedAttention(q.middleCols(h * dK, dK), alone, Heads{1});
      CHECK((one.array() == all.middleCols(h * dV, dV).array()).all());
    }
  }
}

TEMPLATE_TEST_CASE("KvCache: each query row of a multi-token call gets the bits of its row alone", "[kvcache]", float,
                   double, Eigen::half, Eigen::bfloat16, sdpa::kv::Q8, sdpa::kv::Q4) {
  // Multi-token decoding (several drafted tokens verified in one call): each row's products are
  // its own (matrix-vector kernels in register blocks of several rows, the next chunk prefetched
  // from 8 rows on), so over the same keys every row equals the call on that row alone, bit for
  // bit, whatever the row count (1 to 16 per head) and the group (rows of a GQA group's heads
  // share the blocks; 5, 6 and 7 rows a kv head: one block of the wide kernels' rest).
  // Several chunks of keys (1600 keys: 1 to 7 chunks by storage and d; float at d 128: 2), contiguous and
  // paged. d 37: the value kernels' last block of columns is short (37 = 9 x 4 + 1).
  std::mt19937_64 gen(31);
  const Index n = 1600;
  for (const auto& [heads, d] :
       {std::pair<Heads, Index>{Heads{1}, 128}, {Heads{8, 2}, 64}, {Heads{3, 1}, 40}, {Heads{2, 1}, 37}}) {
    const Index H = heads.query, Hkv = heads.keyValue;
    const Mat<float> k = kvRows(n, Hkv * d, gen), v = kvRows(n, Hkv * d, gen), q = kvRows(16, H * d, gen, 2.0f);
    BothCaches<TestType> caches(k, v, Hkv, d, 32);
    const auto &contiguous = caches.contiguous, &paged = caches.paged;
    const Index seq = caches.seq;
    for (const Index nQ : {3, 5, 16}) {
      INFO("Heads{" << H << ", " << Hkv << "}, d " << d << ", n_q " << nQ);
      const Mat<float> qs = q.topRows(nQ);
      const auto all =
          sdpa::cachedAttentionForward(qs, contiguous, heads, sdpa::scale::InvSqrtDk{}, sdpa::mask::None{});
      const auto allPaged =
          sdpa::cachedAttentionForward(qs, paged.sequence(seq), heads, sdpa::scale::InvSqrtDk{}, sdpa::mask::None{});
      for (Index i = 0; i < nQ; ++i) {
        const auto one =
            sdpa::cachedAttentionForward(qs.row(i), contiguous, heads, sdpa::scale::InvSqrtDk{}, sdpa::mask::None{});
        const auto onePaged = sdpa::cachedAttentionForward(qs.row(i), paged.sequence(seq), heads,
                                                           sdpa::scale::InvSqrtDk{}, sdpa::mask::None{});
        CHECK((all.output.row(i).array() == one.output.array()).all());
        CHECK((all.logSumExp.row(i).array() == one.logSumExp.array()).all());
        CHECK((allPaged.output.row(i).array() == onePaged.output.array()).all());
      }
    }
  }
}

TEMPLATE_TEST_CASE("KvCache: fp16/bf16 K/V give the same bits on the AVX2 and AVX-512 column kernels", "[kvcache][isa]",
                   Eigen::half, Eigen::bfloat16) {
  // Long half pieces run the column kernels of internal/half.hpp: one query row at a time, or up
  // to 4 rows at once (a GQA group, multi-token decoding) widening each packet once for them;
  // both ISAs sum in the same order (half.hpp), so every ISA this CPU has gives the first one's
  // bits. Row counts 1-12 per kv head (blocks of 4, 3, 2 and 1 rows), d 64 (8-column passes) and
  // 40 (8 + one by one), contiguous and paged. The paged sequence fills whole blocks of 256: a
  // chunk with a shorter piece takes the float kernels (decode_rows.hpp), whose values sum 16 or
  // 8 lanes of keys as the ISA's vectors hold (their bits depend on the ISA).
  std::mt19937_64 gen(37);
  const Index n = 3072;
  for (const auto& [group, d] : {std::pair<Heads, Index>{Heads{8, 2}, 64}, {Heads{6, 2}, 40}}) {
    const Heads heads = group;  // (a structured binding cannot be captured in C++17)
    const Index H = heads.query, Hkv = heads.keyValue;
    const Mat<float> k = kvRows(n, Hkv * d, gen), v = kvRows(n, Hkv * d, gen), q = kvRows(3, H * d, gen, 2.0f);
    BothCaches<TestType> caches(k, v, Hkv, d, 256);
    const auto &contiguous = caches.contiguous, &paged = caches.paged;
    const Index seq = caches.seq;
    for (const Index nQ : {1, 2, 3}) {
      INFO("Heads{" << H << ", " << Hkv << "}, d " << d << ", n_q " << nQ);
      const Mat<float> qs = q.topRows(nQ);
      Mat<float> first, firstPaged;
      sdpa_test::forEachIsa([&](sdpa::internal::Isa isa) {
        if (isa == sdpa::internal::Isa::Portable) return;
        const Mat<float> got = sdpa::cachedAttention(qs, contiguous, heads),
                         gotPaged = sdpa::cachedAttention(qs, paged.sequence(seq), heads);
        if (first.size() == 0) {
          first = got;
          firstPaged = gotPaged;
        }
        CHECK((got.array() == first.array()).all());
        CHECK((gotPaged.array() == firstPaged.array()).all());
      });
    }
  }
}

TEMPLATE_TEST_CASE("KvCache ring: attention over the ring equals the sliding window over the whole sequence",
                   "[kvcache]", float, Eigen::half, sdpa::kv::Q8) {
  using Storage = TestType;
  std::mt19937_64 gen(3);
  const Index H = 4, Hkv = 2, dK = 16, dV = 8, window = 45, maxQ = 4, total = 460;
  const Mat<float> k = kvRows(total, Hkv * dK, gen), v = kvRows(total, Hkv * dV, gen);
  auto ring = KvCache<Storage>::ring({Hkv, dK, dV}, window, maxQ);
  const auto lr = sdpa::mask::Align::LowerRight;
  const auto windowMask = sdpa::mask::SlidingWindow{window - 1, 0, lr};
  const auto alibi = sdpa::mask::combine(windowMask, sdpa::mask::Alibi::standard(H, lr));
  Index L = 0, step = 0;
  while (L < total) {
    const Index n = std::min<Index>(total - L, 1 + (step++ % maxQ));
    ring.append(k.middleRows(L, n), v.middleRows(L, n));
    L += n;
    REQUIRE(ring.length() == L);
    CHECK(ring.firstPosition() == std::max<Index>(0, L - (window + maxQ - 1)));
    if (step % 7 != 0 && L < total) continue;
    const Mat<float> q = kvRows(n, H * dK, gen);
    INFO("length " << L << ", " << n << " query rows");
    if constexpr (sdpa::internal::quant::IsQuantised<Storage>) {
      // Against a contiguous cache of the same storage holding the whole sequence under the
      // window mask: the same positions' codes and scales (groups of 32 positions in both), so
      // only float rounding may differ (another chunking); the quantisation error itself is
      // checked against its bound below.
      auto whole = KvCache<Storage>::contiguous({Hkv, dK, dV}, total);
      whole.append(k.topRows(L), v.topRows(L));
      const auto a = sdpa::cachedAttention(q, ring, Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, alibi);
      const auto b = sdpa::cachedAttention(q, whole, Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, alibi);
      CHECK(sdpa_test::maxAbsDiff(a, b) <= sdpa_test::errorBound<float>(0.0, sdpa_test::maxAbs(b)));
    } else {
      checkAgainstWhole(ring.sequence(0), q, k.topRows(L), v.topRows(L), Heads{H, Hkv}, sdpa::scale::InvSqrtDk{},
                        windowMask);
      checkAgainstWhole(ring.sequence(0), q, k.topRows(L), v.topRows(L), Heads{H, Hkv}, sdpa::scale::InvSqrtDk{},
                        alibi);
      checkAgainstWhole(ring.sequence(0), q, k.topRows(L), v.topRows(L), Heads{H, Hkv}, sdpa::scale::LogN::matching(32),
                        alibi);
      // Without a window mask the rows see every position the ring holds, [first, L): a
      // key-count scale counts those.
      const Index first = ring.firstPosition();
      checkAgainstWhole(ring.sequence(0), q, k.middleRows(first, L - first), v.middleRows(first, L - first),
                        Heads{H, Hkv}, sdpa::scale::LogN::matching(32), sdpa::mask::None{});
    }
  }
  // More query rows than the ring keeps for its window: a clear error.
  const Mat<float> q = kvRows(maxQ + 1, H * dK, gen);
  CHECK_THROWS_WITH(sdpa::cachedAttention(q, ring, Heads{H, Hkv}),
                    Catch::Contains("5 query rows over a window of 45 need the last 49 positions"));
}

TEMPLATE_TEST_CASE("KvCache paged: sequences, shared prefixes and copy on write", "[kvcache]", float, Eigen::bfloat16,
                   sdpa::kv::Q4) {
  using Storage = TestType;
  constexpr bool kQ = sdpa::internal::quant::IsQuantised<Storage>;
  std::mt19937_64 gen(5);
  const Index H = 4, Hkv = 4, dK = 32, dV = 16;
  for (const Index B : {Index(32), Index(64)}) {
    DYNAMIC_SECTION("block rows " << B) {
      auto cache = KvCache<Storage>::paged({Hkv, dK, dV}, B, 40);
      const Mat<float> prefix = kvRows(150, Hkv * dK, gen), prefixV = kvRows(150, Hkv * dV, gen);
      const Index a = cache.addSequence();
      appendInChunks(cache, a, prefix, prefixV, 0, 150, {7, 1, 64});
      const Index used = cache.blocks() - cache.freeBlocks();
      CHECK(used == (kQ ? 128 / B + (128 % B != 0) : (150 + B - 1) / B));
      const Index b = cache.fork(a);
      CHECK(cache.blocks() - cache.freeBlocks() == used);  // shared, not copied
      CHECK(cache.blockTable(b) == cache.blockTable(a));
      // The sequences diverge: each its own continuation.
      const Mat<float> ka = kvRows(70, Hkv * dK, gen), va = kvRows(70, Hkv * dV, gen);
      const Mat<float> kb = kvRows(90, Hkv * dK, gen), vb = kvRows(90, Hkv * dV, gen);
      appendInChunks(cache, a, ka, va, 0, 70, {3, 16});
      appendInChunks(cache, b, kb, vb, 0, 90, {1});
      Mat<float> wholeA(220, Hkv * dK), wholeVA(220, Hkv * dV), wholeB(240, Hkv * dK), wholeVB(240, Hkv * dV);
      wholeA << prefix, ka;
      wholeVA << prefixV, va;
      wholeB << prefix, kb;
      wholeVB << prefixV, vb;
      const Mat<float> q = kvRows(2, H * dK, gen);
      const auto causal = sdpa::mask::Causal{sdpa::mask::Align::LowerRight};
      if constexpr (kQ) {
        // Against contiguous caches of the same storage: the same codes and scales (groups of 32
        // positions in both), so only float rounding may differ.
        auto fa = KvCache<Storage>::contiguous({Hkv, dK, dV}, 220),
             fb = KvCache<Storage>::contiguous({Hkv, dK, dV}, 240);
        fa.append(wholeA, wholeVA);
        fb.append(wholeB, wholeVB);
        for (const auto& [seq, flat] : {std::pair{a, &fa}, std::pair{b, &fb}}) {
          const Mat<float> want = sdpa::cachedAttention(q, *flat, Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, causal);
          const Mat<float> got =
              sdpa::cachedAttention(q, cache.sequence(seq), Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, causal);
          CHECK(sdpa_test::maxAbsDiff(got, want) <= sdpa_test::errorBound<float>(0.0, sdpa_test::maxAbs(want)));
        }
      } else {
        checkAgainstWhole(cache.sequence(a), q, wholeA, wholeVA, Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, causal);
        checkAgainstWhole(cache.sequence(b), q, wholeB, wholeVB, Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, causal);
      }
      // The shared prefix's whole blocks are still shared.
      const Index sharedBlocks = (kQ ? 128 : 150) / B;
      for (Index i = 0; i < sharedBlocks; ++i) CHECK(cache.blockTable(a)[size_t(i)] == cache.blockTable(b)[size_t(i)]);
      Index own = 0;  // b's blocks that a does not hold
      for (const Index blk : cache.blockTable(b))
        own += std::count(cache.blockTable(a).begin(), cache.blockTable(a).end(), blk) == 0;
      const Index before = cache.freeBlocks();
      cache.release(b);
      CHECK(cache.freeBlocks() == before + own);
      CHECK_FALSE(cache.isLive(b));
    }
  }
}

TEMPLATE_TEST_CASE("KvCache: truncation drops rejected tokens (speculative decoding)", "[kvcache]", float, double) {
  std::mt19937_64 gen(9);
  const Index dK = 8, dV = 8;
  const Mat<float> k = kvRows(100, dK, gen), v = kvRows(100, dV, gen), junk = kvRows(6, dK, gen);
  for (const auto mode : {sdpa::CacheMode::Contiguous, sdpa::CacheMode::Ring, sdpa::CacheMode::Paged}) {
    auto cache = mode == sdpa::CacheMode::Contiguous ? KvCache<TestType>::contiguous({1, dK, dV}, 120)
                 : mode == sdpa::CacheMode::Ring     ? KvCache<TestType>::ring({1, dK, dV}, 30, 10)
                                                     : KvCache<TestType>::paged({1, dK, dV}, 16, 10);
    const Index seq = mode == sdpa::CacheMode::Paged ? cache.addSequence() : 0;
    const auto lr = sdpa::mask::Align::LowerRight;
    const auto check = [&](Index L) {
      const Mat<float> q = kvRows(3, dK, gen);
      if (mode == sdpa::CacheMode::Ring)
        checkAgainstWhole(cache.sequence(seq), q, k.topRows(L), v.topRows(L), Heads{1}, sdpa::scale::InvSqrtDk{},
                          sdpa::mask::SlidingWindow{29, 0, lr});
      else
        checkAgainstWhole(cache.sequence(seq), q, k.topRows(L), v.topRows(L), Heads{1}, sdpa::scale::InvSqrtDk{},
                          sdpa::mask::Causal{lr});
    };
    // Rejected rows (NaN, so that any read of them shows) stay in slots past the length.
    const Mat<float> nan = Mat<float>::Constant(6, dK, std::numeric_limits<float>::quiet_NaN());
    cache.append(seq, k.topRows(60), v.topRows(60));
    cache.append(seq, nan, nan);
    cache.truncate(seq, 60);
    CHECK(cache.length(seq) == 60);
    check(60);
    cache.append(seq, k.middleRows(60, 3), v.middleRows(60, 3));
    cache.append(seq, nan.topRows(2), nan.topRows(2));
    cache.truncate(seq, 63);
    cache.append(seq, k.middleRows(63, 37), v.middleRows(63, 37));
    check(100);
  }
}

TEST_CASE("KvCache: NaN in slots a mask hides or the sequence no longer holds never reaches the output", "[kvcache]") {
  std::mt19937_64 gen(13);
  const Index dK = 16, dV = 16, n = 300;
  Mat<float> k = kvRows(n, dK, gen), v = kvRows(n, dV, gen);
  // Keys and values 0..99 NaN: outside a sliding window of the last 64 keys.
  k.topRows(100).setConstant(std::numeric_limits<float>::quiet_NaN());
  v.topRows(100).setConstant(std::numeric_limits<float>::infinity());
  const auto lr = sdpa::mask::Align::LowerRight;
  auto cache = KvCache<float>::contiguous({1, dK, dV}, n);
  cache.append(k, v);
  const Mat<float> q = kvRows(1, dK, gen);
  const auto out =
      sdpa::cachedAttention(q, cache, Heads{1}, sdpa::scale::InvSqrtDk{}, sdpa::mask::SlidingWindow{63, 0, lr});
  CHECK(out.allFinite());
  checkAgainstWhole(cache.sequence(0), q, k.bottomRows(200), v.bottomRows(200), Heads{1}, sdpa::scale::InvSqrtDk{},
                    sdpa::mask::SlidingWindow{63, 0, lr});
  // A fully hidden row: output 0, logSumExp -inf.
  const auto none =
      sdpa::cachedAttentionForward(q, cache, Heads{1}, sdpa::scale::InvSqrtDk{}, sdpa::mask::KeyLength{0});
  CHECK((none.output.array() == 0.0f).all());
  CHECK(none.logSumExp(0) == -std::numeric_limits<float>::infinity());
  // An empty cache: the same.
  auto empty = KvCache<float>::contiguous({1, dK, dV}, 4);
  const auto e = sdpa::cachedAttentionForward(q, empty, Heads{1});
  CHECK((e.output.array() == 0.0f).all());
  CHECK(e.logSumExp(0) == -std::numeric_limits<float>::infinity());
}

TEMPLATE_TEST_CASE("KvCache: a query row holding NaN or inf gets NaN, over every storage and ISA path", "[kvcache]",
                   float, Eigen::half, sdpa::kv::Q8, sdpa::kv::Q4) {
  // As attentionForward's rows: a NaN or inf in q makes the row's logits NaN or +-inf, and the
  // row's output NaN; the quantised keys' integer logits round q to integers, which must not
  // turn it into finite garbage. The other rows and heads keep their values.
  std::mt19937_64 gen(43);
  const Index d = 40, n = 96;  // three groups of 32 keys, no float tail (its logits would be NaN too)
  const Mat<float> k = kvRows(n, 2 * d, gen), v = kvRows(n, 2 * d, gen);
  auto cache = KvCache<TestType>::contiguous({2, d, d}, n);
  cache.append(k, v);
  Mat<float> q = kvRows(3, 4 * d, gen);
  const Mat<float> clean = sdpa::cachedAttention(q, cache, Heads{4, 2});
  sdpa_test::forEachIsa([&](sdpa::internal::Isa) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      Mat<float> qb = q;
      qb(1, d + 5) = bad;  // row 1 of query head 1 (kv head 0)
      const Mat<float> out = sdpa::cachedAttention(qb, cache, Heads{4, 2});
      INFO("bad entry " << bad);
      CHECK(out.block(1, d, 1, d).array().isNaN().all());
      Mat<float> rest = out, restClean = clean;
      rest.block(1, d, 1, d).setZero();
      restClean.block(1, d, 1, d).setZero();
      CHECK(sdpa_test::maxAbsDiff(rest, restClean) < 1e-5);
    }
  });
}

TEST_CASE("KvCache: bad input is a clear error and leaves the cache unchanged", "[kvcache][errors]") {
  std::mt19937_64 gen(17);
  auto cache = KvCache<float>::contiguous({2, 4, 3}, 10);
  const Mat<float> k = kvRows(8, 8, gen), v = kvRows(8, 6, gen);
  cache.append(k, v);
  CHECK_THROWS_WITH(cache.append(k.leftCols(7), v), Catch::Contains("k is 8x7 and v is 8x6"));
  CHECK_THROWS_WITH(cache.append(k, v), Catch::Contains("would pass the capacity of 10 positions"));
  CHECK(cache.length() == 8);
  CHECK_THROWS_WITH(cache.truncate(9), Catch::Contains("outside [0, 8]"));
  CHECK_THROWS_WITH(cache.addSequence(), Catch::Contains("only a paged cache has several sequences"));
  CHECK_THROWS_WITH(sdpa::cachedAttention(kvRows(1, 7, gen), cache, Heads{2}),
                    Catch::Contains("q is 1x7: 2 query heads of d_k 4 need 8 columns"));
  CHECK_THROWS_WITH(sdpa::cachedAttention(kvRows(1, 12, gen), cache, Heads{3}),
                    Catch::Contains("Heads{3, 3} against a cache of 2 kv heads"));
  CHECK_THROWS_WITH(sdpa::cachedAttention(kvRows(1, 12, gen), cache, Heads{3, 2}),
                    Catch::Contains("the kv heads must match and divide the query heads"));

  auto paged = KvCache<float>::paged({1, 4, 4}, 16, 3);
  const Index s = paged.addSequence();
  const Mat<float> rows = kvRows(40, 4, gen);
  paged.append(s, rows, rows);
  CHECK(paged.freeBlocks() == 0);
  CHECK_THROWS_WITH(paged.append(s, rows.topRows(9), rows.topRows(9)),
                    Catch::Contains("needs 1 free blocks; the pool has 0 of 3"));
  CHECK(paged.length(s) == 40);
  CHECK_THROWS_WITH(paged.length(5), Catch::Contains("sequence 5 does not exist"));
  const Index t = paged.fork(s);
  // Writing into the shared last block needs a copy, and the pool is empty.
  CHECK_THROWS_WITH(paged.append(t, rows.topRows(1), rows.topRows(1)), Catch::Contains("needs 1 free blocks"));
  CHECK(paged.length(t) == 40);
  CHECK_THROWS_WITH(KvCache<sdpa::kv::Q8>::paged({1, 4, 4}, 16, 3), Catch::Contains("multiple of 32"));

  auto q8 = KvCache<sdpa::kv::Q8>::contiguous({1, 4, 4}, 64);
  Mat<float> bad = kvRows(3, 4, gen);
  bad(1, 2) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH(q8.append(bad, bad), Catch::Contains("quantised storage takes finite values"));
  CHECK(q8.length() == 0);
}

TEMPLATE_TEST_CASE("KvCache: every column of its storage starts on a cache line", "[kvcache]", float, double,
                   Eigen::half, Eigen::bfloat16) {
  // The decoding kernels load a column's keys in packets of 64 bytes from multiples of 64 bytes:
  // each packet in one line only if the column starts on one (the pool was once 16 bytes off a
  // line, and a capacity of 1000 floats put every column but the first off one too). A column
  // shorter than a line (fp16 blocks of 16 keys: 32 bytes) starts on a multiple of its length,
  // a power of two, and so lies in one line.
  std::mt19937_64 gen(23);
  constexpr Index H = 2, dK = 5, dV = 3, size = Index(sizeof(TestType));
  std::vector<sdpa::internal::cache::Piece> pieces;
  const auto check = [&](const KvCache<TestType>& cache, Index seq) {
    cache.pieces(seq, pieces);
    REQUIRE(!pieces.empty());
    for (const auto& p : pieces) {
      const Index slot = p.pos % cache.blockRows(), stride = p.ld * size, bytes = cache.blockRows() * size;
      CHECK(p.ld >= cache.blockRows());
      CHECK((stride % 64 == 0 || 64 % stride == 0));
      // No more padding than that takes: under a line, or (a short column) under its own length.
      CHECK(stride - bytes < (bytes >= 64 ? 64 : bytes));
      const auto onLine = [&](const unsigned char* column) {
        return reinterpret_cast<std::uintptr_t>(column) % std::uintptr_t(std::min<Index>(64, stride)) == 0;
      };
      for (Index h = 0; h < H; ++h) {
        for (Index c = 0; c < dK; ++c) CHECK(onLine(p.k + (h * p.kHead + (c * p.ld - slot) * size)));
        for (Index c = 0; c < dV; ++c) CHECK(onLine(p.v + (h * p.vHead + (c * p.ld - slot) * size)));
      }
    }
  };
  const Mat<float> k = kvRows(90, H * dK, gen), v = kvRows(90, H * dV, gen);
  auto contiguous = KvCache<TestType>::contiguous({H, dK, dV}, 1000);
  contiguous.append(k, v);
  check(contiguous, 0);
  auto ring = KvCache<TestType>::ring({H, dK, dV}, 37, 3);
  ring.append(k, v);  // wrapped: two pieces
  check(ring, 0);
  auto paged = KvCache<TestType>::paged({H, dK, dV}, 16, 12);
  const Index s = paged.addSequence();
  paged.append(s, k, v);
  const Index t = paged.fork(s);
  paged.append(t, k.topRows(3), v.topRows(3));  // a copied block
  check(paged, s);
  check(paged, t);
  auto one = KvCache<TestType>::contiguous({H, dK, dV}, 1);  // columns of one value
  one.append(k.topRows(1), v.topRows(1));
  check(one, 0);
}

TEMPLATE_TEST_CASE("KvCache quantised: the error stays within the bound of the quantisation step", "[kvcache]",
                   sdpa::kv::Q8, sdpa::kv::Q4) {
  using F = TestType;
  std::mt19937_64 gen(21);
  const Index H = 4, Hkv = 2, dK = 64, dV = 64, n = 1000;
  const Mat<float> k = kvRows(n, Hkv * dK, gen), v = kvRows(n, Hkv * dV, gen);
  const Mat<float> q = kvRows(3, H * dK, gen);
  auto cache = KvCache<F>::contiguous({Hkv, dK, dV}, n);
  appendInChunks(cache, 0, k, v, 0, n - 13, {1, 100});  // 13 rows of a partial group stay float
  appendInChunks(cache, 0, k, v, n - 13, n, {13});
  const double tau = 1.0 / std::sqrt(double(dK));
  const auto got = sdpa::cachedAttentionForward(q, cache, Heads{H, Hkv});
  const auto exact = sdpa::multiHeadAttentionForward(sdpa::kernel::Naive{}, q.cast<double>(), k.cast<double>(),
                                                     v.cast<double>(), Heads{H, Hkv});
  // The bound of the quantisation step and float rounding (support/quant_bound.hpp).
  const Eigen::MatrixXd kd = k.cast<double>(), vd = v.cast<double>();
  for (Index h = 0; h < H; ++h) {
    const Index kv = h / (H / Hkv);
    for (Index i = 0; i < q.rows(); ++i) {
      const Eigen::VectorXd bound =
          sdpa_test::quantisedAttentionBound<F>(q.row(i).segment(h * dK, dK).transpose().cast<double>(),
                                                kd.middleCols(kv * dK, dK), vd.middleCols(kv * dV, dV), 0, n, tau);
      for (Index c = 0; c < dV; ++c) {
        const double err = std::abs(double(got.output(i, h * dV + c)) - exact.output(i, h * dV + c));
        INFO("head " << h << " row " << i << " column " << c << ": error " << err << ", bound " << bound(c));
        CHECK(err <= bound(c));
      }
    }
  }
  // Beside fp16 storage of the same data (for the docs: q8 is within a few times fp16's error).
  auto half = KvCache<Eigen::half>::contiguous({Hkv, dK, dV}, n);
  half.append(k, v);
  const double errQ = sdpa_test::maxAbsDiff(got.output, exact.output);
  const double errH = sdpa_test::maxAbsDiff(sdpa::cachedAttention(q, half, Heads{H, Hkv}), exact.output);
  INFO("max error: " << F::Bits << "-bit " << errQ << ", fp16 " << errH);
  CHECK(errH < errQ);
  WARN(F::Bits << "-bit K/V max |error| " << errQ << " vs fp16 K/V " << errH << " (d 64, 1000 keys, N(0, 1) data)");
}

TEST_CASE("KvCache quantised: the portable kernels give the dispatched kernels' results", "[kvcache]") {
  std::mt19937_64 gen(23);
  const Index dK = 41, dV = 24, n = 777;  // channels not a multiple of 16, an odd d_k (a padded pair)
  const Mat<float> k = kvRows(n, 2 * dK, gen), v = kvRows(n, 2 * dV, gen), q = kvRows(5, 6 * dK, gen);
  auto q8 = KvCache<sdpa::kv::Q8>::contiguous({2, dK, dV}, n);
  auto q4 = KvCache<sdpa::kv::Q4>::contiguous({2, dK, dV}, n);
  q8.append(k, v);
  q4.append(k, v);
  using sdpa::internal::Isa;
  using sdpa::internal::IsaChoice;
  IsaChoice::setCap(Isa::Portable);
  const Mat<float> b8 = sdpa::cachedAttention(q, q8, Heads{6, 2}), b4 = sdpa::cachedAttention(q, q4, Heads{6, 2});
  // Every path this CPU has (AVX2, AVX-512 with and without VNNI's integer dot products): the same
  // codes and scales; only the order of float additions differs (the float tail, the softmax, q8
  // values; the next test checks that the integer kernels give the same bits).
  using sdpa::internal::quant::IntDotCap;
  sdpa_test::forEachIsa(
      [&](Isa isa) {
        for (const int cap : {2, 1}) {
          if (cap == 1 && isa < Isa::Avx512) continue;
          IntDotCap::value() = cap;
          INFO("integer dot products' path cap " << cap);
          const Mat<float> a8 = sdpa::cachedAttention(q, q8, Heads{6, 2}),
                           a4 = sdpa::cachedAttention(q, q4, Heads{6, 2});
          CHECK(sdpa_test::maxAbsDiff(a8, b8) < 1e-5);
          CHECK(sdpa_test::maxAbsDiff(a4, b4) < 1e-5);
        }
        IntDotCap::value() = 2;
      },
      true);
}

TEST_CASE("KvCache q8/q4: the integer kernels give the same bits on every path, and the exact sums' value",
          "[kvcache][isa]") {
  // The q4 keys' logits (in nibble quads) and the q8 and q4 values' dots (in key quads within
  // blocks of 16 channels) are exact integer sums and the same float steps on every path (kv_quant.hpp):
  // the portable kernels' bits on AVX2 and AVX-512 with and without VNNI, for any row count
  // (a row's bits its own), channel counts off the quads and blocks (1, 5, 24, 41) and over
  // several blocks of exact sums (300 > 256); and within the weights' rounding of the sums over
  // the dequantised codes in double.
  namespace quant = sdpa::internal::quant;
  using sdpa::internal::Isa;
  using sdpa::internal::IsaChoice;
  using Q4 = sdpa::kv::Q4;
  using Q8 = sdpa::kv::Q8;
  std::mt19937_64 gen(41);
  for (const Index d : {1, 5, 24, 41, 300}) {
    const Index groups = 5, R = 5;
    const Mat<float> x = kvRows(groups * quant::kGroup, 2 * d, gen);
    std::vector<std::vector<unsigned char>> keys(groups), values(groups), values8(groups);
    std::vector<const unsigned char*> kp, vp, vp8;
    for (Index g = 0; g < groups; ++g) {
      keys[size_t(g)].resize(size_t(quant::groupBytes<Q4, true>(d)));
      values[size_t(g)].resize(size_t(quant::groupBytes<Q4>(d)));
      values8[size_t(g)].resize(size_t(quant::groupBytes<Q8>(d)));
      quant::quantiseGroup<Q4, true>(x.data() + g * quant::kGroup, x.rows(), d, keys[size_t(g)].data());
      quant::quantiseGroup<Q4>(x.data() + d * x.rows() + g * quant::kGroup, x.rows(), d, values[size_t(g)].data());
      quant::quantiseGroup<Q8>(x.data() + d * x.rows() + g * quant::kGroup, x.rows(), d, values8[size_t(g)].data());
      kp.push_back(keys[size_t(g)].data());
      vp.push_back(values[size_t(g)].data());
      vp8.push_back(values8[size_t(g)].data());
    }
    // Rows of queries (one NaN: its logits NaN) and of weights in [0, 1] (a group of zeros: it
    // adds nothing; one row with a NaN weight: its dots NaN).
    Mat<float> a = kvRows(R, d, gen), p = Mat<float>::Random(R, groups * quant::kGroup).cwiseAbs();
    a(3, d / 2) = std::numeric_limits<float>::quiet_NaN();
    p.row(1).segment(quant::kGroup, quant::kGroup).setZero();
    p(2, 70) = std::numeric_limits<float>::quiet_NaN();
    const auto run = [&](Index rows, Mat<float>& s, Mat<float>& dots, Mat<float>& dots8) {
      s.setZero(rows, groups * quant::kGroup);
      dots.setZero(rows, d);
      dots8.setZero(rows, d);
      std::vector<Eigen::VectorXf> aRows, pRows;
      std::vector<const float*> ap, pp;
      std::vector<float*> sp, dp, dp8;
      Mat<float> sT = s.transpose(), dT = dots.transpose(), d8T = dots8.transpose();  // a row's entries contiguous
      for (Index r = 0; r < rows; ++r) {
        aRows.emplace_back(a.row(r).transpose());
        pRows.emplace_back(p.row(r).transpose());
      }
      for (Index r = 0; r < rows; ++r) {
        ap.push_back(aRows[size_t(r)].data());
        pp.push_back(pRows[size_t(r)].data());
        sp.push_back(sT.col(r).data());
        dp.push_back(dT.col(r).data());
        dp8.push_back(d8T.col(r).data());
      }
      std::vector<float> as(size_t(quant::logitsScratch(rows, d)));
      quant::logitsGroups<Q4>(ap.data(), rows, kp.data(), groups, d, sp.data(), as.data());
      quant::valuesGroups<Q4>(pp.data(), rows, vp.data(), groups, d, dp.data());
      quant::valuesGroups<Q8>(pp.data(), rows, vp8.data(), groups, d, dp8.data());
      s = sT.transpose();
      dots = dT.transpose();
      dots8 = d8T.transpose();
    };
    const auto same = [](const Mat<float>& u, const Mat<float>& v) {
      return ((u.array() == v.array()) || (u.array().isNaN() && v.array().isNaN())).all();
    };
    IsaChoice::setCap(Isa::Portable);
    Mat<float> s0, d0, e0;
    run(R, s0, d0, e0);
    CHECK(s0.row(3).array().isNaN().all());
    CHECK(d0.row(2).array().isNaN().all());
    CHECK(e0.row(2).array().isNaN().all());
    CHECK(!s0.row(0).array().isNaN().any());
    CHECK(!d0.row(1).array().isNaN().any());
    CHECK(!e0.row(1).array().isNaN().any());
    // Against the dequantised sums in double: the weights' rounding (kv_quant.hpp) bounds each.
    for (Index r : {0, 1, 4}) {
      for (Index g = 0; g < groups; ++g) {
        double wMax = 0, pMax = 0;
        for (Index c = 0; c < d; ++c) {
          std::uint16_t bits;
          std::memcpy(&bits, kp[size_t(g)] + 2 * c, 2);
          wMax = std::max(wMax, std::abs(double(a(r, c)) * double(quant::halfBits(bits))));
        }
        for (Index i = 0; i < quant::kGroup; ++i) pMax = std::max(pMax, double(p(r, g * quant::kGroup + i)));
        for (Index i = 0; i < quant::kGroup; ++i) {
          double exact = 0, scale = 0;
          for (Index c = 0; c < d; ++c) {
            const double k = quant::dequantised<Q4, true>(kp[size_t(g)], d, i, c);
            exact += double(a(r, c)) * k;
            scale += std::abs(double(a(r, c)) * k);
          }
          const double bound = double(d) * 7 * wMax / 16383 * 0.51 + 1e-6 * scale + 1e-30;
          CHECK(std::abs(double(s0(r, g * quant::kGroup + i)) - exact) <= bound);
        }
      }
      for (Index c = 0; c < d; ++c) {
        double exact = 0, exact8 = 0, bound = 1e-30, bound8 = 1e-30;
        for (Index g = 0; g < groups; ++g) {
          double pMax = 0, vMax = 0, vMax8 = 0;
          for (Index i = 0; i < quant::kGroup; ++i) {
            const double v = quant::dequantised<Q4>(vp[size_t(g)], d, i, c), w = p(r, g * quant::kGroup + i);
            const double v8 = quant::dequantised<Q8>(vp8[size_t(g)], d, i, c);
            exact += w * v;
            exact8 += w * v8;
            pMax = std::max(pMax, w);
            vMax = std::max(vMax, std::abs(v));
            vMax8 = std::max(vMax8, std::abs(v8));
            bound += 1e-6 * std::abs(w * v);
            bound8 += 1e-6 * std::abs(w * v8);
          }
          bound += 32 * 0.51 * pMax / 65535 * vMax;
          bound8 += 32 * 0.51 * pMax / 65535 * vMax8;
        }
        CHECK(std::abs(double(d0(r, c)) - exact) <= bound);
        CHECK(std::abs(double(e0(r, c)) - exact8) <= bound8);
      }
    }
    sdpa_test::forEachIsa(
        [&](Isa isa) {
          for (const int cap : {2, 1}) {
            if (cap == 1 && isa < Isa::Avx512) continue;
            quant::IntDotCap::value() = cap;
            INFO("d " << d << ", integer dot products' path cap " << cap);
            for (const Index rows : {Index(1), Index(2), Index(3), R}) {
              Mat<float> s, dots, dots8;
              run(rows, s, dots, dots8);
              CHECK(same(s, s0.topRows(rows)));
              CHECK(same(dots, d0.topRows(rows)));
              CHECK(same(dots8, e0.topRows(rows)));
            }
          }
          quant::IntDotCap::value() = 2;
        },
        true);
  }
}

TEMPLATE_TEST_CASE("KvCache: results do not depend on the thread count", "[kvcache][threads]", float, Eigen::half,
                   sdpa::kv::Q8) {
  std::mt19937_64 gen(29);
  const Index dK = 32, dV = 32, n = 20000;  // several chunks, so several key splits
  const Mat<float> k = kvRows(n, 2 * dK, gen), v = kvRows(n, 2 * dV, gen), q = kvRows(3, 8 * dK, gen);
  auto paged = KvCache<TestType>::paged({2, dK, dV}, 64, n / 64 + 1);
  const Index seq = paged.addSequence();
  paged.append(seq, k, v);
  const auto mask = sdpa::mask::combine(sdpa::mask::Causal{sdpa::mask::Align::LowerRight},
                                        sdpa::mask::Alibi::standard(8, sdpa::mask::Align::LowerRight));
  Eigen::setNbThreads(1);
  const auto one = sdpa::cachedAttentionForward(q, paged.sequence(seq), Heads{8, 2}, sdpa::scale::InvSqrtDk{}, mask);
  Eigen::setNbThreads(2);
  const auto two = sdpa::cachedAttentionForward(q, paged.sequence(seq), Heads{8, 2}, sdpa::scale::InvSqrtDk{}, mask);
  Eigen::setNbThreads(0);
  CHECK((one.output.array() == two.output.array()).all());
  CHECK((one.logSumExp.array() == two.logSumExp.array()).all());
}

TEMPLATE_TEST_CASE("KvCache: Intel's, AMD's, first- and third-generation Zen's memory orders give the same bits",
                   "[kvcache][isa]", float, Eigen::half, Eigen::bfloat16, sdpa::kv::Q8, sdpa::kv::Q4) {
  // CpuVendor picks how decoding walks memory: requests ahead of short pieces and of the next
  // chunk (ColumnsAhead, ChunkPrefetch: made off Intel; first-generation Zen requests no chunk
  // and reads blocks of up to 32 keys several at once, as Intel), close half columns one at a
  // time or eight side by side (halfColumnByColumn: one at a time off Intel), the narrow logits
  // passes' requests of the next columns (not on first-generation Zen; third-generation Zen reads as
  // the first but requests the next chunk). Requests and order change no sum, so all four give the
  // CPU's own order's bits, on every ISA path; the other tests check that
  // order against the reference. Blocks of 16-64 keys (short pieces, their successors
  // requested; q8/q4 from 32, a group), 100, 256 and 512 (fp16/bf16: the long-piece column
  // kernels over close columns; on first-generation Zen four long pieces at once, column by
  // column, float and half below 256 keys; 100 with keys past the last whole packet), the
  // contiguous cache; 1, 4 (a GQA group) and 16 query rows per kv head (16: the wide blocks and
  // the chunk requests, over 3 chunks of float keys at d 64).
  using sdpa::internal::CpuVendor;
  std::mt19937_64 gen(37);
  const Index d = 64, n = 5000;
  const Mat<float> k = kvRows(n, 2 * d, gen), v = kvRows(n, 2 * d, gen), q = kvRows(16, 8 * d, gen, 2.0f);
  const auto mask = sdpa::mask::Causal{sdpa::mask::Align::LowerRight};
  for (const Index block : {0, 16, 32, 64, 100, 256, 512}) {
    if (sdpa::internal::quant::IsQuantised<TestType> && block % 32 != 0) continue;  // whole groups
    auto cache =
        block ? KvCache<TestType>::paged({2, d, d}, block, n / block + 1) : KvCache<TestType>::contiguous({2, d, d}, n);
    const Index seq = block ? cache.addSequence() : 0;
    cache.append(seq, k, v);
    for (const auto& shape : {std::pair<Heads, Index>{Heads{2}, 1}, {Heads{8, 2}, 1}, {Heads{2}, 16}}) {
      const Heads heads = shape.first;  // (a lambda cannot capture a structured binding in C++17)
      const Index nQ = shape.second;
      INFO("block " << block << ", Heads{" << heads.query << ", " << heads.keyValue << "}, n_q " << nQ);
      const Mat<float> qs = q.topLeftCorner(nQ, heads.query * d);
      sdpa_test::forEachIsa([&](sdpa::internal::Isa) {
        CpuVendor::setOrder(CpuVendor::Order::Intel);
        const auto intel = sdpa::cachedAttentionForward(qs, cache.sequence(seq), heads, sdpa::scale::InvSqrtDk{}, mask);
        for (const auto order : {CpuVendor::Order::Amd, CpuVendor::Order::FirstZen, CpuVendor::Order::Zen3}) {
          INFO("order " << int(order));
          CpuVendor::setOrder(order);
          const auto other =
              sdpa::cachedAttentionForward(qs, cache.sequence(seq), heads, sdpa::scale::InvSqrtDk{}, mask);
          CHECK((intel.output.array() == other.output.array()).all());
          CHECK((intel.logSumExp.array() == other.logSumExp.array()).all());
        }
        CpuVendor::setOrder(-1);
      });
    }
  }
}
