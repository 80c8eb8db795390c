// Token-by-token decoding through a KvCache: each step appends the new token's keys and values,
// then attends its query to the whole cache. One attention layer of a GQA model (Heads{8, 2},
// d 64, ALiBi, causal), its projections random: the point is the loop and its check. Every
// `check` steps the step's output is compared with recomputing causal attention over the whole
// sequence (multiHeadAttention on all rows so far), for a contiguous fp32 cache, a sliding-window
// ring, a paged cache (two sequences sharing a prompt) and q8 / q4 caches (within their
// quantisation error). Prints the largest difference per cache; exits 1 if one is off.
//
// Arguments: steps (default 600), check every (default 50).
#include <sdpa/sdpa.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>

namespace {

using Eigen::Index;
using Eigen::MatrixXf;

constexpr Index kHeads = 8, kKvHeads = 2, kD = 64, kModel = 128, kWindow = 256, kPrompt = 100;

struct Layer {
  MatrixXf wq = MatrixXf::Random(kModel, kHeads* kD) * 0.2f;
  MatrixXf wk = MatrixXf::Random(kModel, kKvHeads* kD) * 0.2f;
  MatrixXf wv = MatrixXf::Random(kModel, kKvHeads* kD);
};

int run(int argc, char** argv) {
  const Index steps = argc > 1 ? std::atol(argv[1]) : 600, every = argc > 2 ? std::atol(argv[2]) : 50;
  if (steps < 1 || every < 1) {
    std::fprintf(stderr, "usage: decode_loop [steps] [check every]\n");
    return 2;
  }
  const Layer layer;
  const Index total = kPrompt + steps;
  const MatrixXf x = MatrixXf::Random(total, kModel);  // the tokens' hidden states
  const MatrixXf q = x * layer.wq, k = x * layer.wk, v = x * layer.wv;
  const sdpa::Heads heads{kHeads, kKvHeads};
  const auto lr = sdpa::mask::Align::LowerRight;
  const auto causal = sdpa::mask::combine(sdpa::mask::Causal{lr}, sdpa::mask::Alibi::standard(kHeads, lr));
  const auto window =
      sdpa::mask::combine(sdpa::mask::SlidingWindow{kWindow - 1, 0, lr}, sdpa::mask::Alibi::standard(kHeads, lr));
  const sdpa::CacheShape shape{kKvHeads, kD, kD};

  auto contiguous = sdpa::KvCache<float>::contiguous(shape, total);
  auto ring = sdpa::KvCache<float>::ring(shape, kWindow);
  auto paged = sdpa::KvCache<Eigen::half>::paged(shape, 16, 2 * (total / 16 + 2));
  auto q8 = sdpa::KvCache<sdpa::kv::Q8>::contiguous(shape, total);
  auto q4 = sdpa::KvCache<sdpa::kv::Q4>::contiguous(shape, total);
  // The prompt: appended at once (its own attention would be a prefill call, not shown here).
  const auto prompt = [&](auto& cache, Index seq) { cache.append(seq, k.topRows(kPrompt), v.topRows(kPrompt)); };
  prompt(contiguous, 0);
  prompt(ring, 0);
  prompt(q8, 0);
  prompt(q4, 0);
  const Index a = paged.addSequence();
  prompt(paged, a);
  const Index b = paged.fork(a);  // a second continuation of the same prompt: its blocks shared

  double worst[5] = {0, 0, 0, 0, 0};
  for (Index t = kPrompt; t < total; ++t) {
    const auto kt = k.middleRows(t, 1), vt = v.middleRows(t, 1);
    contiguous.append(kt, vt);
    ring.append(kt, vt);
    q8.append(kt, vt);
    q4.append(kt, vt);
    paged.append(a, kt, vt);
    paged.append(b, kt * 0.5f, vt);  // sequence b diverges from the prompt on
    const auto qt = q.middleRows(t, 1);
    const MatrixXf o = sdpa::cachedAttention(qt, contiguous, heads, sdpa::scale::InvSqrtDk{}, causal);
    if ((t - kPrompt) % every != 0 && t + 1 != total) continue;
    const MatrixXf whole = sdpa::multiHeadAttention(q.topRows(t + 1), k.topRows(t + 1), v.topRows(t + 1), heads,
                                                    sdpa::scale::InvSqrtDk{}, causal)
                               .bottomRows(1);
    const MatrixXf windowed = sdpa::multiHeadAttention(q.topRows(t + 1), k.topRows(t + 1), v.topRows(t + 1), heads,
                                                       sdpa::scale::InvSqrtDk{}, window)
                                  .bottomRows(1);
    const MatrixXf half =
        sdpa::multiHeadAttention(q.topRows(t + 1), MatrixXf(k.topRows(t + 1).cast<Eigen::half>().cast<float>()),
                                 MatrixXf(v.topRows(t + 1).cast<Eigen::half>().cast<float>()), heads,
                                 sdpa::scale::InvSqrtDk{}, causal)
            .bottomRows(1);
    const auto diff = [](const MatrixXf& x1, const MatrixXf& x2) { return double((x1 - x2).cwiseAbs().maxCoeff()); };
    const double d[5] = {
        diff(o, whole), diff(sdpa::cachedAttention(qt, ring, heads, sdpa::scale::InvSqrtDk{}, window), windowed),
        diff(sdpa::cachedAttention(qt, paged.sequence(a), heads, sdpa::scale::InvSqrtDk{}, causal), half),
        diff(sdpa::cachedAttention(qt, q8, heads, sdpa::scale::InvSqrtDk{}, causal), whole),
        diff(sdpa::cachedAttention(qt, q4, heads, sdpa::scale::InvSqrtDk{}, causal), whole)};
    for (int i = 0; i < 5; ++i) worst[i] = std::max(worst[i], d[i]);
  }
  // Sanity limits (|o| is a few units here): float rounding; q8 and q4 quantisation (measured
  // 0.013 and 0.24 at 600 steps).
  const double limit[5] = {1e-4, 1e-4, 1e-4, 0.05, 0.5};
  const char* names[5] = {"contiguous fp32", "ring fp32 (window 256)", "paged fp16 (blocks of 16, forked)",
                          "contiguous q8", "contiguous q4"};
  bool ok = true;
  std::printf("%ld tokens after a prompt of %ld, GQA %ld/%ld heads, d %ld; largest |difference| from recomputing:\n",
              long(steps), long(kPrompt), long(kHeads), long(kKvHeads), long(kD));
  for (int i = 0; i < 5; ++i) {
    std::printf("  %-36s %.3g%s\n", names[i], worst[i], worst[i] <= limit[i] ? "" : "  <- too large");
    ok = ok && worst[i] <= limit[i];
  }
  std::printf("paged pool: %ld of %ld blocks in use for two sequences of %ld positions\n",
              long(paged.blocks() - paged.freeBlocks()), long(paged.blocks()), long(total));
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decode_loop: %s\n", e.what());
    return 1;
  }
}
