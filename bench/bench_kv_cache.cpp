// Decoding from a KvCache (issue #19): one token (or a few) against n_k cached positions, by
// storage (fp32, fp16, bf16, q8, q4), mode (contiguous, paged blocks) and head layout (GQA).
// Memory-bound: "GBps" is the cache's bytes read per second (k and v once per kv head, at the
// storage's bytes per value), "xReadBandwidth" its ratio to the single-thread read bandwidth
// measured in the same run, "xFloat" the speed-up over the fp32 cache of the same shape in the
// same run, "xContiguous" a paged cache's time over the contiguous cache's, "xMHA" GQA's time over
// 8-head MHA's over the same K/V, "xOneRow" n_q rows' time over one row's. fp16 K/V also report
// "xWiden": the least time that widening every value to float takes on the call's cores (2 n_k d
// over BM_HalfWiden's one-core rate in the same run, over the threads) over the call's time.
// xReadBandwidth and xWiden together say which bound holds: 1 where a token runs at it.
//
//   cmake --preset bench && cmake --build --preset bench && build/bench/bench/bench_kv_cache
#include <sdpa/kv_cache.hpp>

#include <map>
#include <string>

#include "common.hpp"

namespace {

using sdpa_bench::Index;

std::map<std::vector<Index>, double>& seconds(const std::string& table) {
  static std::map<std::string, std::map<std::vector<Index>, double>> m;
  return m[table];
}

template <typename Storage>
double bytesPerValue() {
  if constexpr (std::is_same_v<Storage, sdpa::kv::Q8>)
    return 34.0 / 32.0;
  else if constexpr (std::is_same_v<Storage, sdpa::kv::Q4>)
    return 18.0 / 32.0;
  else
    return double(sizeof(Storage));
}

template <typename Storage>
sdpa::KvCache<Storage> filled(Index nK, Index Hkv, Index d, Index blockRows) {
  std::srand(3);
  auto cache = blockRows ? sdpa::KvCache<Storage>::paged({Hkv, d, d}, blockRows, (nK + blockRows - 1) / blockRows)
                         : sdpa::KvCache<Storage>::contiguous({Hkv, d, d}, nK);
  const Index seq = blockRows ? cache.addSequence() : 0;
  for (Index i = 0; i < nK; i += 4096) {
    const Index n = std::min<Index>(4096, nK - i);
    cache.append(seq, Eigen::MatrixXf::Random(n, Hkv * d), Eigen::MatrixXf::Random(n, Hkv * d));
  }
  return cache;
}

/// Times cachedAttentionForwardInto of n_q rows of H query heads; returns seconds per call.
template <typename Storage>
double timeDecode(benchmark::State& state, const sdpa::KvCache<Storage>& cache, Index seq, Index nQ, Index H) {
  const Index d = cache.shape().dK;
  std::srand(5);
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(nQ, H * d);
  Eigen::MatrixXf out(nQ, H * d), lse(nQ, H);
  const sdpa::Heads heads{H, cache.shape().kvHeads};
  const auto mask = sdpa::mask::Causal{sdpa::mask::Align::LowerRight};
  sdpa::cachedAttentionForwardInto(q, cache.sequence(seq), heads, sdpa::scale::InvSqrtDk{}, mask, out, lse);
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    sdpa::cachedAttentionForwardInto(q, cache.sequence(seq), heads, sdpa::scale::InvSqrtDk{}, mask, out, lse);
    benchmark::DoNotOptimize(out.data());
  }
  return state.iterations() ? timer.seconds() / double(state.iterations()) : 0.0;
}

/// A token's K/V reads of one head (n_k x d each) in perCall seconds on `threads` threads: GBps,
/// xReadBandwidth and, for fp16, xWiden (the file's header).
template <typename Storage>
void reportReads(benchmark::State& state, Index nK, Index d, double perCall, Index threads) {
  const double bytes = 2.0 * double(nK) * double(d) * bytesPerValue<Storage>();
  state.counters["GBps"] = bytes / perCall * 1e-9;
  state.counters["xReadBandwidth"] = bytes / perCall * 1e-9 / sdpa_bench::readBandwidthGBs();
  if constexpr (std::is_same_v<Storage, Eigen::half>)
    if (const double rate = sdpa_bench::halfWidenGvalues(); rate > 0)
      state.counters["xWiden"] = 2.0 * double(nK) * double(d) / (rate * 1e9 * double(threads)) / perCall;
}

/// One token, one head, contiguous cache. args: n_k, d, threads
template <typename Storage>
void BM_CacheDecode(benchmark::State& state) {
  const Index nK = state.range(0), d = state.range(1);
  sdpa_bench::setThreads(int(state.range(2)));
  const auto cache = filled<Storage>(nK, 1, d, 0);
  const double perCall = timeDecode(state, cache, 0, 1, 1);
  if (perCall == 0) return;
  reportReads<Storage>(state, nK, d, perCall, state.range(2));
  const std::vector<Index> key{nK, d, state.range(2)};
  if constexpr (std::is_same_v<Storage, float>)
    seconds("float")[key] = perCall;
  else if (auto it = seconds("float").find(key); it != seconds("float").end())
    state.counters["xFloat"] = it->second / perCall;
}

/// One token, one head, paged cache of `blockRows`; "xContiguous" over BM_CacheDecode's time of
/// the same storage and shape. args: n_k, d, blockRows
template <typename Storage>
void BM_CachePaged(benchmark::State& state) {
  const Index nK = state.range(0), d = state.range(1), B = state.range(2);
  sdpa_bench::setThreads(1);
  const std::string table = "paged" + std::to_string(sizeof(Storage));
  const std::vector<Index> key{nK, d};
  if (B == 0) {
    const auto cache = filled<Storage>(nK, 1, d, 0);
    seconds(table)[key] = timeDecode(state, cache, 0, 1, 1);
    return;
  }
  const auto cache = filled<Storage>(nK, 1, d, B);
  const double perCall = timeDecode(state, cache, 0, 1, 1);
  if (perCall == 0) return;
  state.counters["GBps"] = 2.0 * double(nK) * double(d) * bytesPerValue<Storage>() / perCall * 1e-9;
  if (auto it = seconds(table).find(key); it != seconds(table).end())
    state.counters["xContiguous"] = perCall / it->second;
}

/**
 * One token, one head, through `layers` caches in turn (a model's layers: between two reads of one
 * layer's K/V the others are read, so none is left in L3, where BM_CacheDecode and BM_CachePaged
 * read one cache again and again). "xContiguous" a paged cache's time over the contiguous
 * caches' in the same run. On a first-generation EPYC the two settings ranked some changes
 * differently (PERFORMANCE.md, session 51). args: n_k, d, blockRows (0: contiguous), layers
 */
template <typename Storage>
void BM_CacheLayers(benchmark::State& state) {
  const Index nK = state.range(0), d = state.range(1), B = state.range(2), L = state.range(3);
  sdpa_bench::setThreads(1);
  std::vector<sdpa::KvCache<Storage>> caches;
  for (Index l = 0; l < L; ++l) caches.push_back(filled<Storage>(nK, 1, d, B));
  std::srand(5);
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(1, d);
  Eigen::MatrixXf out(1, d), lse(1, 1);
  const auto mask = sdpa::mask::Causal{sdpa::mask::Align::LowerRight};
  const auto call = [&](Index layer) {
    sdpa::cachedAttentionForwardInto(q, caches[size_t(layer % L)].sequence(0), sdpa::Heads{1}, sdpa::scale::InvSqrtDk{},
                                     mask, out, lse);
  };
  for (Index l = 0; l < L; ++l) call(l);
  Index next = 0;
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    call(next++);
    benchmark::DoNotOptimize(out.data());
  }
  const double perCall = state.iterations() ? timer.seconds() / double(state.iterations()) : 0.0;
  if (perCall == 0) return;
  reportReads<Storage>(state, nK, d, perCall, 1);
  const std::vector<Index> key{nK, d, L};
  const std::string table = "layers" + std::to_string(sizeof(Storage));
  if (B == 0)
    seconds(table)[key] = perCall;
  else if (auto it = seconds(table).find(key); it != seconds(table).end())
    state.counters["xContiguous"] = perCall / it->second;
}

/// GQA: Heads{H, 8} against Heads{8} over the same cache of 8 kv heads, d 128 (table: where the
/// storage's MHA time is kept). args: n_k, H, threads
template <typename Storage>
void cacheHeads(benchmark::State& state, const std::string& table) {
  const Index nK = state.range(0), H = state.range(1), Hkv = 8, d = 128;
  sdpa_bench::setThreads(int(state.range(2)));
  const auto cache = filled<Storage>(nK, Hkv, d, 0);
  const double perCall = timeDecode(state, cache, 0, 1, H);
  if (perCall == 0) return;
  state.counters["GBps"] = 2.0 * double(nK) * double(Hkv * d) * bytesPerValue<Storage>() / perCall * 1e-9;
  const std::vector<Index> key{nK, state.range(2)};
  if (H == Hkv)
    seconds(table)[key] = perCall;
  else if (auto it = seconds(table).find(key); it != seconds(table).end())
    state.counters["xMHA"] = perCall / it->second;
}
void BM_CacheHeads(benchmark::State& state) { cacheHeads<float>(state, "mha"); }
/// The same with fp16 K/V.
void BM_CacheHeadsHalf(benchmark::State& state) { cacheHeads<Eigen::half>(state, "mha-half"); }
/// The same with q8 and q4 K/V (their logits' integer products take up to 3 rows a pass).
void BM_CacheHeadsQ8(benchmark::State& state) { cacheHeads<sdpa::kv::Q8>(state, "mha-q8"); }
void BM_CacheHeadsQ4(benchmark::State& state) { cacheHeads<sdpa::kv::Q4>(state, "mha-q4"); }

/// Multi-token decoding: n_q rows (speculative decoding's drafts) against one head of fp32 or
/// fp16 K/V. args: n_k, n_q. At n_k 65536 (64 MiB of fp32 K/V) the cache may stay in a large L3
/// between iterations (260 MiB on the Xeon of sessions 28-31); at 524288 (512 MiB) it is read from
/// memory, as a model's decoding reads each layer's cache (the layers together outgrow the L3).
template <typename Storage>
void BM_CacheQueryRows(benchmark::State& state) {
  const Index nK = state.range(0), nQ = state.range(1), d = 128;
  sdpa_bench::setThreads(1);
  const auto cache = filled<Storage>(nK, 1, d, 0);
  const double perCall = timeDecode(state, cache, 0, nQ, 1);
  if (perCall == 0) return;
  const std::string table = "rows" + std::to_string(sizeof(Storage));
  if (nQ == 1)
    seconds(table)[{nK}] = perCall;
  else if (auto it = seconds(table).find({nK}); it != seconds(table).end())
    state.counters["xOneRow"] = perCall / it->second;
}

/// Appending one token to a cache already holding n_k positions (then truncating it again):
/// O(1) whatever n_k. args: n_k, mode (0 contiguous, 1 ring of n_k, 2 paged of 64-row blocks)
template <typename Storage>
void BM_CacheAppend(benchmark::State& state) {
  const Index nK = state.range(0), d = 128, Hkv = 8;
  const int mode = int(state.range(1));
  auto cache = mode == 0   ? sdpa::KvCache<Storage>::contiguous({Hkv, d, d}, nK + 64)
               : mode == 1 ? sdpa::KvCache<Storage>::ring({Hkv, d, d}, nK)
                           : sdpa::KvCache<Storage>::paged({Hkv, d, d}, 64, nK / 64 + 2);
  const Index seq = mode == 2 ? cache.addSequence() : 0;
  const Eigen::MatrixXf rows = Eigen::MatrixXf::Random(64, Hkv * d);
  for (Index i = 0; i < nK; i += 64) cache.append(seq, rows, rows);
  Index i = 0;
  for (auto _ : state) {
    cache.append(seq, rows.row(i % 64), rows.row(i % 64));
    if (++i % 64 == 0) cache.truncate(seq, cache.length(seq) - 64);
  }
}

void BM_ReadBandwidth(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(sdpa_bench::readBandwidthGBs());
  state.counters["GBps"] = sdpa_bench::readBandwidthGBs();
}

/// fp16 values widened and multiplied into sums per second by one core, from L1
/// (sdpa_bench::halfWidenGvalues): the ceiling of decoding from fp16 K/V whatever the memory.
void BM_HalfWiden(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(sdpa_bench::halfWidenGvalues());
  state.counters["GValuesps"] = sdpa_bench::halfWidenGvalues();
}

}  // namespace

BENCHMARK(BM_ReadBandwidth)->Iterations(1);
BENCHMARK(BM_HalfWiden)->Iterations(1);
#define SDPA_CACHE_DECODE(T)                        \
  BENCHMARK(BM_CacheDecode<T>)                      \
      ->ArgNames({"nk", "d", "threads"})            \
      ->ArgsProduct({{8192, 65536}, {128}, {1, 2}}) \
      ->UseRealTime()                               \
      ->Unit(benchmark::kMicrosecond)
SDPA_CACHE_DECODE(float);
SDPA_CACHE_DECODE(Eigen::half);
SDPA_CACHE_DECODE(Eigen::bfloat16);
SDPA_CACHE_DECODE(sdpa::kv::Q8);
SDPA_CACHE_DECODE(sdpa::kv::Q4);
BENCHMARK(BM_CachePaged<float>)
    ->ArgNames({"nk", "d", "block"})
    ->ArgsProduct({{65536}, {128}, {0, 16, 32, 64, 256}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CachePaged<Eigen::half>)
    ->ArgNames({"nk", "d", "block"})
    ->ArgsProduct({{65536}, {128}, {0, 16, 64, 256, 512}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CachePaged<sdpa::kv::Q8>)
    ->ArgNames({"nk", "d", "block"})
    ->ArgsProduct({{65536}, {128}, {0, 32, 256}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CachePaged<sdpa::kv::Q4>)
    ->ArgNames({"nk", "d", "block"})
    ->ArgsProduct({{65536}, {128}, {0, 32, 256}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CacheLayers<float>)
    ->ArgNames({"nk", "d", "block", "layers"})
    ->ArgsProduct({{65536}, {128}, {0, 16, 64, 256}, {4}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CacheLayers<Eigen::half>)
    ->ArgNames({"nk", "d", "block", "layers"})
    ->ArgsProduct({{65536}, {128}, {0, 16, 256}, {4}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CacheHeads)
    ->ArgNames({"nk", "H", "threads"})
    ->ArgsProduct({{8192, 65536}, {8, 32}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CacheHeadsHalf)
    ->ArgNames({"nk", "H", "threads"})
    ->ArgsProduct({{8192, 65536}, {8, 32}, {1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CacheHeadsQ8)
    ->ArgNames({"nk", "H", "threads"})
    ->ArgsProduct({{8192, 65536}, {8, 32}, {1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CacheHeadsQ4)
    ->ArgNames({"nk", "H", "threads"})
    ->ArgsProduct({{8192, 65536}, {8, 32}, {1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CacheQueryRows<float>)
    ->ArgNames({"nk", "nq"})
    ->ArgsProduct({{65536, 524288}, {1, 4, 5, 6, 8, 16}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CacheQueryRows<Eigen::half>)
    ->ArgNames({"nk", "nq"})
    ->ArgsProduct({{65536}, {1, 4, 5, 6, 8, 16}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CacheAppend<float>)->ArgNames({"nk", "mode"})->ArgsProduct({{4096, 65536}, {0, 1, 2}});
BENCHMARK(BM_CacheAppend<sdpa::kv::Q8>)->ArgNames({"nk", "mode"})->ArgsProduct({{4096, 65536}, {0, 1, 2}});

BENCHMARK_MAIN();
