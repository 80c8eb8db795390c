// Multi-head (MHA, GQA, MQA) and batched attention against loops of single-head calls.
#include <sdpa/sdpa.hpp>

#include <array>
#include <cmath>
#include <limits>

#include "support/cases.hpp"

using namespace sdpa_test;
namespace mask = sdpa::mask;
namespace scale = sdpa::scale;
using Catch::Matchers::Contains;
using mask::Align;

namespace {

/// Repeats each of the H_kv column blocks of width d group times: the MHA equivalent of GQA.
template <typename T>
Mat<T> repeatHeads(const Mat<T>& x, Index hKv, Index group) {
  const Index d = x.cols() / hKv;
  Mat<T> out(x.rows(), x.cols() * group);
  for (Index g = 0; g < hKv; ++g)
    for (Index r = 0; r < group; ++r) out.middleCols((g * group + r) * d, d) = x.middleCols(g * d, d);
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("multi-head equals a loop of single-head calls, each head scaled by its own d_k  [seed C16]",
                   "[multihead][seed]", float, double) {
  using T = TestType;
  const Index H = 4, dK = 16, dV = 8, L = 7, S = 11;
  const Mat<T> q = randn<T>(L, H * dK, 1), k = randn<T>(S, H * dK, 2), v = randn<T>(S, H * dV, 3);
  Mat<T> perHeadBias = randn<T>(H * L, S, 4);  // (H n_q) x n_k, head h in rows [h L, (h + 1) L)
  const auto alibi = mask::Alibi::standard(H, Align::LowerRight);
  const auto m = mask::combine(mask::Causal{Align::LowerRight}, alibi, mask::Bias{perHeadBias});
  const auto mh = sdpa::multiHeadAttentionForward(q, k, v, sdpa::Heads{H}, scale::InvSqrtDk{}, m);
  REQUIRE(mh.output.rows() == L);
  REQUIRE(mh.output.cols() == H * dV);
  REQUIRE(mh.logSumExp.cols() == H);
  for (Index h = 0; h < H; ++h) {
    const Mat<T> bh = perHeadBias.middleRows(h * L, L);
    const auto single = sdpa::attentionForward(
        q.middleCols(h * dK, dK), k.middleCols(h * dK, dK), v.middleCols(h * dV, dV), scale::InvSqrtDk{},
        mask::combine(mask::Causal{Align::LowerRight}, mask::Alibi{{alibi.slopes[size_t(h)]}, Align::LowerRight},
                      mask::Bias{bh}));
    INFO("head " << h);
    CHECK(mh.output.middleCols(h * dV, dV) == single.output);
    CHECK(mh.logSumExp.col(h) == single.logSumExp);
  }
  // Scaling by 1/sqrt(d_model) instead would be a different (wrong) result.
  const Mat<T> wrong = sdpa::multiHeadAttention(q, k, v, sdpa::Heads{H}, scale::Constant{1.0 / std::sqrt(64.0)}, m);
  CHECK(maxAbsDiff(wrong, mh.output) > 1e-3);
}

TEMPLATE_TEST_CASE("GQA and MQA equal MHA with the k, v heads repeated", "[multihead][gqa]", float, double) {
  using T = TestType;
  const Index H = 6, dK = 5, dV = 3, L = 9, S = 8;
  for (const Index hKv : {Index(1), Index(2), Index(3), Index(6)}) {
    INFO("H_kv = " << hKv);
    const Mat<T> q = randn<T>(L, H * dK, 10 + hKv), k = randn<T>(S, hKv * dK, 20 + hKv),
                 v = randn<T>(S, hKv * dV, 30 + hKv);
    const auto m = mask::combine(mask::Causal{Align::UpperLeft}, mask::Softcap{5.0});
    const auto gqa = sdpa::multiHeadAttentionForward(q, k, v, sdpa::Heads{H, hKv}, scale::InvSqrtDk{}, m);
    const auto mha = sdpa::multiHeadAttentionForward(q, repeatHeads(k, hKv, H / hKv), repeatHeads(v, hKv, H / hKv),
                                                     sdpa::Heads{H}, scale::InvSqrtDk{}, m);
    CHECK(gqa.output == mha.output);
    CHECK(gqa.logSumExp == mha.logSumExp);
  }
}

TEMPLATE_TEST_CASE("per-head scales: constants and learnable temperatures", "[multihead][scale]", float, double) {
  using T = TestType;
  const Index H = 3, dK = 4, L = 5, S = 6;
  const Mat<T> q = randn<T>(L, H * dK, 1), k = randn<T>(S, H * dK, 2), v = randn<T>(S, H * 2, 3);
  const auto constants = scale::PerHead<scale::Constant>::constants({0.1, 1.0, 3.0});
  const Mat<T> out = sdpa::multiHeadAttention(q, k, v, sdpa::Heads{H}, constants);
  scale::PerHead<scale::Learnable<T>> learnable(H);
  learnable.head(1).setValue(T(1.0));
  const Mat<T> outL = sdpa::multiHeadAttention(q, k, v, sdpa::Heads{H}, learnable);
  for (Index h = 0; h < H; ++h) {
    const double c = h == 0 ? 0.1 : (h == 1 ? 1.0 : 3.0);
    CHECK(out.middleCols(h * 2, 2) == sdpa::attention(q.middleCols(h * dK, dK), k.middleCols(h * dK, dK),
                                                      v.middleCols(h * 2, 2), scale::Constant{c}));
    // Learnable heads 0 and 2 start at 1/sqrt(d_k) = 0.5; head 1 was set to 1.
    const double tau = h == 1 ? 1.0 : 0.5;
    CHECK(outL.middleCols(h * 2, 2) == sdpa::attention(q.middleCols(h * dK, dK), k.middleCols(h * dK, dK),
                                                       v.middleCols(h * 2, 2), scale::Constant{tau}));
  }
  CHECK_THROWS_WITH(
      sdpa::multiHeadAttention(q, k, v, sdpa::Heads{H}, scale::PerHead<scale::Constant>::constants({1.0})),
      Contains("the PerHead scale has 1 policies for 3 heads"));
}

TEMPLATE_TEST_CASE("batched varlen and padded layouts equal per-item calls", "[multihead][batch]", float, double) {
  using T = TestType;
  const Index H = 2, hKv = 1, dK = 6, dV = 4;
  SECTION("varlen: items of different lengths, causal aligned per item") {
    const std::vector<Index> cuQ = {0, 3, 3, 10}, cuK = {0, 5, 7, 13};  // item 1 has no queries
    const Mat<T> q = randn<T>(10, H * dK, 1), k = randn<T>(13, hKv * dK, 2), v = randn<T>(13, hKv * dV, 3);
    const auto m = mask::Causal{Align::LowerRight};
    const auto batch = sdpa::batchedAttentionForward(q, k, v, sdpa::BatchLayout::varlen(cuQ, cuK), sdpa::Heads{H, hKv},
                                                     scale::InvSqrtDk{}, m);
    for (size_t b = 0; b < 3; ++b) {
      const Index q0 = cuQ[b], nQ = cuQ[b + 1] - q0, k0 = cuK[b], nK = cuK[b + 1] - k0;
      const auto item = sdpa::multiHeadAttentionForward(
          q.middleRows(q0, nQ), k.middleRows(k0, nK), v.middleRows(k0, nK), sdpa::Heads{H, hKv}, scale::InvSqrtDk{}, m);
      INFO("item " << b);
      CHECK(batch.output.middleRows(q0, nQ) == item.output);
      CHECK(batch.logSumExp.middleRows(q0, nQ) == item.logSumExp);
    }
  }
  SECTION("padded: keys beyond the length are hidden, padded query rows give 0, padding never leaks") {
    const Index B = 3, nQ = 4, nK = 6;
    const std::vector<Index> qLen = {4, 2, 0}, kLen = {6, 3, 1};
    Mat<T> q = randn<T>(B * nQ, H * dK, 4), k = randn<T>(B * nK, hKv * dK, 5), v = randn<T>(B * nK, hKv * dV, 6);
    for (Index b = 0; b < B; ++b) {  // poison the padding
      k.middleRows(b * nK + kLen[size_t(b)], nK - kLen[size_t(b)]).setConstant(std::numeric_limits<T>::quiet_NaN());
      v.middleRows(b * nK + kLen[size_t(b)], nK - kLen[size_t(b)]).setConstant(std::numeric_limits<T>::infinity());
      q.middleRows(b * nQ + qLen[size_t(b)], nQ - qLen[size_t(b)]).setConstant(std::numeric_limits<T>::quiet_NaN());
    }
    const auto batch =
        sdpa::batchedAttentionForward(q, k, v, sdpa::BatchLayout::padded(B, nQ, nK, qLen, kLen), sdpa::Heads{H, hKv});
    CHECK(batch.output.allFinite());
    for (Index b = 0; b < B; ++b) {
      const Index ql = qLen[size_t(b)], kl = kLen[size_t(b)];
      INFO("item " << b);
      const Mat<T> expected = sdpa::multiHeadAttention(q.middleRows(b * nQ, ql), k.middleRows(b * nK, kl),
                                                       v.middleRows(b * nK, kl), sdpa::Heads{H, hKv});
      CHECK(maxAbsDiff(batch.output.middleRows(b * nQ, ql), expected) <= 4 * std::numeric_limits<T>::epsilon());
      CHECK(batch.output.middleRows(b * nQ + ql, nQ - ql).isZero(0));
      CHECK((batch.logSumExp.middleRows(b * nQ + ql, nQ - ql).array() == -std::numeric_limits<T>::infinity()).all());
    }
  }
}

TEMPLATE_TEST_CASE("a padded item computes what a call on its valid rows computes, whatever the alignment",
                   "[multihead][batch][backward]", float, double) {
  // LowerRight puts the last valid query on the last valid key of each item (FlashAttention's
  // varlen convention), not the last padded ones: items 1 and 3 have other paddings than item 0.
  using T = TestType;
  const Index B = 4, H = 2, hKv = 1, dK = 5, dV = 3, nQ = 4, nK = 7;
  const std::vector<Index> qLen = {4, 2, 3, 1}, kLen = {7, 5, 3, 6};
  const Mat<T> q = randn<T>(B * nQ, H * dK, 11), k = randn<T>(B * nK, hKv * dK, 12), v = randn<T>(B * nK, hKv * dV, 13),
               dO = randn<T>(B * nQ, H * dV, 14);
  const auto layout = sdpa::BatchLayout::padded(B, nQ, nK, qLen, kLen);
  const sdpa::Heads heads{H, hKv};
  const T tol = 16 * std::numeric_limits<T>::epsilon();
  const auto check = [&](const auto& kern, const auto& m) {
    const auto f = sdpa::batchedAttentionForward(kern, q, k, v, layout, heads, scale::InvSqrtDk{}, m);
    const auto g = sdpa::batchedAttentionBackward(kern, q, k, v, f, dO, layout, heads, scale::InvSqrtDk{}, m);
    for (Index b = 0; b < B; ++b) {
      INFO("item " << b);
      const Index ql = qLen[size_t(b)], kl = kLen[size_t(b)];
      const Mat<T> iq = q.middleRows(b * nQ, ql), ik = k.middleRows(b * nK, kl), iv = v.middleRows(b * nK, kl);
      const auto fi = sdpa::multiHeadAttentionForward(kern, iq, ik, iv, heads, scale::InvSqrtDk{}, m);
      const auto gi = sdpa::multiHeadAttentionBackward(kern, iq, ik, iv, fi, Mat<T>(dO.middleRows(b * nQ, ql)), heads,
                                                       scale::InvSqrtDk{}, m);
      CHECK(maxAbsDiff(f.output.middleRows(b * nQ, ql), fi.output) <= tol);
      CHECK(maxAbsDiff(f.logSumExp.middleRows(b * nQ, ql), fi.logSumExp) <= tol * 8);
      CHECK(maxAbsDiff(g.dq.middleRows(b * nQ, ql), gi.dq) <= tol);
      CHECK(maxAbsDiff(g.dk.middleRows(b * nK, kl), gi.dk) <= tol);
      CHECK(maxAbsDiff(g.dv.middleRows(b * nK, kl), gi.dv) <= tol);
    }
  };
  const auto everyKernel = [&](const auto& m) {
    check(sdpa::kernel::Naive{}, m);
    check(sdpa::kernel::Tiled{}, m);
    check(sdpa::kernel::Tiled{1, 2}, m);  // decoding blocks and tiles that end inside the padding
  };
  SECTION("causal, lower right") { everyKernel(mask::Causal{Align::LowerRight}); }
  SECTION("causal, upper left") { everyKernel(mask::Causal{Align::UpperLeft}); }
  SECTION("sliding window, lower right") { everyKernel(mask::SlidingWindow{2, 0, Align::LowerRight}); }
  SECTION("ALiBi and causal, lower right") {
    everyKernel(mask::combine(mask::Causal{Align::LowerRight}, mask::Alibi::standard(H, Align::LowerRight)));
  }
}

TEST_CASE("head layouts and batch layouts are validated with clear messages", "[multihead][errors]") {
  const Mat<float> q = Mat<float>::Ones(3, 12), k = Mat<float>::Ones(5, 6), v = Mat<float>::Ones(5, 4);
  CHECK_THROWS_WITH(sdpa::multiHeadAttention(q, k, v, sdpa::Heads{5}), Contains("do not split into 5 heads"));
  CHECK_THROWS_WITH(sdpa::multiHeadAttention(q, k, v, sdpa::Heads{4, 3}), Contains("H_kv dividing H"));
  CHECK_THROWS_WITH(sdpa::multiHeadAttention(q, k, v, sdpa::Heads{4}),
                    Contains("4 heads of d_k = 3) so k must have 4 x 3 = 12 columns, but k is 5x6"));
  CHECK_THROWS_WITH(sdpa::multiHeadAttention(q, k, Mat<float>::Ones(5, 3), sdpa::Heads{4, 2}),
                    Contains("do not split into 2 kv heads"));
  const Mat<float> bias = Mat<float>::Zero(4, 5);
  CHECK_THROWS_WITH(sdpa::multiHeadAttention(q, k, v, sdpa::Heads{4, 2}, scale::None{}, mask::Bias{bias}),
                    Contains("per head it must be 12x5"));
  CHECK_THROWS_WITH(sdpa::batchedAttention(q, k, v, sdpa::BatchLayout::varlen({0, 2}, {0, 5}), sdpa::Heads{4, 2}),
                    Contains("end at 2 query and 5 key rows, but q has 3 rows"));
  CHECK_THROWS_WITH(
      sdpa::batchedAttention(q, k, v, sdpa::BatchLayout::varlen({0, 2, 1, 3}, {0, 1, 2, 5}), sdpa::Heads{4, 2}),
      Contains("must not decrease"));
  CHECK_THROWS_WITH(sdpa::batchedAttention(q, k, v, sdpa::BatchLayout::padded(1, 3, 5, {}, {6}), sdpa::Heads{4, 2}),
                    Contains("keyLengths[0] = 6 is outside [0, 5]"));
}

TEMPLATE_TEST_CASE("GQA with a distinct scale per query head: forward, backward and diagnostics, every kernel",
                   "[multihead][gqa][scale]", float, double) {
  // Each query head h reads kv head h / group and is scaled by its own tau_h: a kernel that took
  // the scale of the kv head (or the kv head of h % H_kv) computes another attention. Scales
  // above 1 too (the tiled kernels multiply the logits there instead of folding tau into q).
  using T = TestType;
  const Index H = 4, hKv = 2, group = H / hKv, dK = 5, dV = 3, L = 7, S = 9;
  const Mat<T> q = randn<T>(L, H * dK, 41), k = randn<T>(S, hKv * dK, 42), v = randn<T>(S, hKv * dV, 43),
               dO = randn<T>(L, H * dV, 44);
  const std::vector<double> taus = {0.2, 0.45, 0.7, 1.3};
  const auto scales = scale::PerHead<scale::Constant>::constants(taus);
  const auto m = mask::Causal{Align::LowerRight};
  const auto close = [](const auto& a, const auto& b) {
    return maxAbsDiff(a, b) <= 64 * std::numeric_limits<T>::epsilon() * std::max(1.0, maxAbs(b));
  };
  forEachKernel([&](const auto& kern, const char* kernelName) {
    INFO("kernel " << kernelName);
    const auto fwd = sdpa::multiHeadAttentionForward(kern, q, k, v, sdpa::Heads{H, hKv}, scales, m);
    const auto g = sdpa::multiHeadAttentionBackward(kern, q, k, v, fwd, dO, sdpa::Heads{H, hKv}, scales, m);
    Mat<T> dk = Mat<T>::Zero(S, hKv * dK), dv = Mat<T>::Zero(S, hKv * dV);
    for (Index h = 0; h < H; ++h) {
      INFO("head " << h << ", tau " << taus[size_t(h)]);
      const Index kvh = h / group;
      const Mat<T> qh = q.middleCols(h * dK, dK), kh = k.middleCols(kvh * dK, dK), vh = v.middleCols(kvh * dV, dV),
                   dOh = dO.middleCols(h * dV, dV);
      const scale::Constant tau{taus[size_t(h)]};
      const auto one = sdpa::attentionForward(kern, qh, kh, vh, tau, m);
      CHECK(fwd.output.middleCols(h * dV, dV) == one.output);  // bitwise: NUMERICS.md
      CHECK(fwd.logSumExp.col(h) == one.logSumExp);
      const auto gOne = sdpa::attentionBackward(kern, qh, kh, vh, one, dOh, tau, m);
      CHECK(close(g.dq.middleCols(h * dK, dK), gOne.dq));
      CHECK(std::abs(g.dscale(h) - gOne.dscale) <=
            64 * std::numeric_limits<T>::epsilon() * std::max(T(1), std::abs(gOne.dscale)));
      dk.middleCols(kvh * dK, dK) += gOne.dk;
      dv.middleCols(kvh * dV, dV) += gOne.dv;
    }
    CHECK(close(g.dk, dk));
    CHECK(close(g.dv, dv));
  });

  // diagnose: head h's figures are those of q_h against k_{h / group} at tau_h.
  const auto d = sdpa::diagnose(q, k, sdpa::Heads{H, hKv}, scales, m);
  REQUIRE(d.heads.size() == size_t(H));
  for (Index h = 0; h < H; ++h) {
    INFO("diagnose, head " << h);
    const auto one = sdpa::diagnose(Mat<T>(q.middleCols(h * dK, dK)), Mat<T>(k.middleCols((h / group) * dK, dK)),
                                    scale::Constant{taus[size_t(h)]}, m)
                         .heads.front();
    const auto& mh = d.heads[size_t(h)];
    CHECK(mh.tau == Approx(taus[size_t(h)]));
    CHECK(mh.logitStd == Approx(one.logitStd).epsilon(1e-5));
    CHECK(mh.entropy.mean == Approx(one.entropy.mean).epsilon(1e-5));
    CHECK(mh.maxWeight.mean == Approx(one.maxWeight.mean).epsilon(1e-5));
    CHECK(mh.rawStd == Approx(one.rawStd).epsilon(1e-5));
  }
}

TEMPLATE_TEST_CASE("decoding one key: a batch item and a head are bitwise the single-head call", "[multihead][decode]",
                   float, double) {
  // With one key, Eigen turned the product of the one-row key block into a dot product whose code
  // depended on the block's stride (a contiguous row in the single-head call, a row of the packed
  // batch), and under -march=native the FMA rounding did too (found by the fuzz corpus replayed
  // in the native build). Scale None: q enters the products unscaled.
  using T = TestType;
  for (const Index nQ : {Index(1), Index(2), Index(4)})
    for (const Index dK : {Index(3), Index(8), Index(33)}) {
      INFO("n_q " << nQ << ", d_k " << dK);
      const Mat<T> q = randn<T>(nQ, dK, 90 + dK, 2.0), k = randn<T>(1, dK, 91 + dK), v = randn<T>(1, 4, 92);
      Mat<T> q2(2 * nQ, dK), k2(2, dK), v2(2, 4);
      q2 << q, q;
      k2 << k, k;
      v2 << v, v;
      for (const sdpa::kernel::Tiled kern : {sdpa::kernel::Tiled{}, sdpa::kernel::Tiled{2, 3}}) {
        const auto one = sdpa::attentionForward(kern, q, k, v, scale::None{}, mask::KeyLength{1});
        const auto batch =
            sdpa::batchedAttentionForward(kern, q2, k2, v2, sdpa::BatchLayout::varlen({0, nQ, 2 * nQ}, {0, 1, 2}),
                                          sdpa::Heads{1}, scale::None{}, mask::KeyLength{1});
        CHECK(batch.logSumExp.col(0).head(nQ) == one.logSumExp);
        CHECK(batch.logSumExp.col(0).tail(nQ) == one.logSumExp);
        CHECK(batch.output.topRows(nQ) == one.output);
        Mat<T> qh(nQ, 2 * dK), kh(1, 2 * dK), vh(1, 8);
        qh << q, q;
        kh << k, k;
        vh << v, v;
        const auto heads =
            sdpa::multiHeadAttentionForward(kern, qh, kh, vh, sdpa::Heads{2}, scale::None{}, mask::KeyLength{1});
        CHECK(heads.logSumExp.col(1) == one.logSumExp);
      }
    }
}

TEMPLATE_TEST_CASE("GQA decoding, a kv head's query heads run split by split together: bitwise each head alone",
                   "[multihead][gqa][decode]", float, double, Eigen::bfloat16) {
  // The heads that share a kv head form one work item whose key splits run for every head in
  // turn (forward_tiled.hpp); each head's arithmetic is its own, so on any thread count every
  // head equals the single-head call on its q and its kv head, bit for bit.
  using T = TestType;
  using Out = sdpa::OutputScalar<void, T>;
  const int saved = Eigen::nbThreads();
  // Splits of one chunk (d 16: 4 splits of 1250 keys) and of several (d 128: 8 splits of over
  // 1024 keys, in chunks of 1024 float, 512 double keys); groups of 2 (GQA) and 3 (MQA), and MHA;
  // one query row, three and twelve (a group's rows in the wide register blocks of multi-token
  // decoding). (d 128 takes 25x the time of d 16 under the sanitizers: there GQA and MQA with
  // three rows, whose every row is a decoding row of the same unit, on two threads: the splits
  // are the same on one.) Float k and v stored by keys: a work item also takes the next kv
  // heads (an equal share per thread: Heads{8, 4} two kv heads a thread, {4, 4} two, {4, 2} one;
  // on one thread all), whose rows the heads kernels read a block of keys at a time.
  for (const auto& [dK, dV, nK] : {std::array<Index, 3>{16, 8, 5000}, {128, 128, 8700}}) {
    // randn draws column after column, so hKv kv heads are the first columns of the widest draw
    // so far: drawn again only when a wider group comes (the draws were a fifth of this test).
    Mat<float> kAll, vAll;
    for (const auto& [H, hKv] : {std::pair<Index, Index>{4, 2}, {3, 1}, {2, 2}, {8, 4}, {4, 4}})
      for (const Index nQ : {Index(1), Index(3), Index(12)}) {
        const Mat<float> qAll = randn<float>(nQ, H * dK, 70 + H);
        for (const int threads : {1, 2}) {
          if (dK == 128 && (H == hKv || nQ != 3 || threads == 1)) continue;
          INFO("d " << dK << ", n_k " << nK << ", Heads{" << H << ", " << hKv << "}, n_q " << nQ << ", " << threads
                    << " threads");
          Eigen::setNbThreads(threads);
          if (kAll.cols() < hKv * dK) {
            kAll = randn<float>(nK, hKv * dK, 71);
            vAll = randn<float>(nK, hKv * dV, 72);
          }
          const Mat<T> q = qAll.template cast<T>(), k = kAll.leftCols(hKv * dK).template cast<T>(),
                       v = vAll.leftCols(hKv * dV).template cast<T>();
          const auto m = mask::Causal{Align::LowerRight};
          const auto all = sdpa::multiHeadAttentionForward(q, k, v, sdpa::Heads{H, hKv}, scale::InvSqrtDk{}, m);
          for (Index h = 0; h < H; ++h) {
            const Index g = h / (H / hKv);
            const Mat<T> qh = q.middleCols(h * dK, dK), kh = k.middleCols(g * dK, dK), vh = v.middleCols(g * dV, dV);
            const auto one = sdpa::attentionForward(qh, kh, vh, scale::InvSqrtDk{}, m);
            CHECK(Mat<Out>(all.output.middleCols(h * dV, dV)) == one.output);
            CHECK(all.logSumExp.col(h) == one.logSumExp);
          }
          if constexpr (std::is_same_v<T, float>) {
            // Stored by keys (PyTorch's [n, heads x d]): the group's rows through the by-key
            // kernels at once, each head the single-head call on its blocks of the same buffers.
            const RowMat<T> qr = q, kr = k, vr = v;
            const auto allRows =
                sdpa::multiHeadAttentionForward(qr, kr, vr, sdpa::Heads{H, hKv}, scale::InvSqrtDk{}, m);
            for (Index h = 0; h < H; ++h) {
              const Index g = h / (H / hKv);
              const auto one = sdpa::attentionForward(qr.middleCols(h * dK, dK), kr.middleCols(g * dK, dK),
                                                      vr.middleCols(g * dV, dV), scale::InvSqrtDk{}, m);
              CHECK(Mat<Out>(allRows.output.middleCols(h * dV, dV)) == one.output);
              CHECK(allRows.logSumExp.col(h) == one.logSumExp);
            }
          }
        }
      }
  }
  Eigen::setNbThreads(saved);
}

TEST_CASE("decoding a varlen batch over K/V stored by keys: each item bitwise its own call, on any thread count",
          "[multihead][gqa][decode][batch]") {
  // Float k and v stored by keys (PyTorch's [n, heads x d]) decode an item's kv heads together;
  // on several threads the threads deal out the key splits of every item's group (items with
  // 4, 1 and 2 splits here, and 1, 3 and 2 query rows), merged per head after. Each item must be
  // its own call's bits, each head its single-head call's, on one thread and on two.
  const Index H = 8, hKv = 4, dK = 16, dV = 8;
  const std::vector<Index> cuQ = {0, 1, 4, 6}, cuK = {0, 5000, 5003, 7600};
  const RowMat<float> q = randn<float>(6, H * dK, 81), k = randn<float>(7600, hKv * dK, 82),
                      v = randn<float>(7600, hKv * dV, 83);
  const auto m = mask::Causal{Align::LowerRight};
  const int saved = Eigen::nbThreads();
  for (const int threads : {1, 2}) {
    Eigen::setNbThreads(threads);
    const auto batch = sdpa::batchedAttentionForward(q, k, v, sdpa::BatchLayout::varlen(cuQ, cuK), sdpa::Heads{H, hKv},
                                                     scale::InvSqrtDk{}, m);
    for (size_t b = 0; b < 3; ++b) {
      const Index q0 = cuQ[b], nQ = cuQ[b + 1] - q0, k0 = cuK[b], nK = cuK[b + 1] - k0;
      INFO(threads << " threads, item " << b);
      const auto item = sdpa::multiHeadAttentionForward(
          q.middleRows(q0, nQ), k.middleRows(k0, nK), v.middleRows(k0, nK), sdpa::Heads{H, hKv}, scale::InvSqrtDk{}, m);
      CHECK(batch.output.middleRows(q0, nQ) == item.output);
      CHECK(batch.logSumExp.middleRows(q0, nQ) == item.logSumExp);
      for (Index h = 0; h < H; ++h) {
        const Index g = h / (H / hKv);
        const auto one = sdpa::attentionForward(q.block(q0, h * dK, nQ, dK), k.block(k0, g * dK, nK, dK),
                                                v.block(k0, g * dV, nK, dV), scale::InvSqrtDk{}, m);
        CHECK(batch.output.block(q0, h * dV, nQ, dV) == one.output);
        CHECK(batch.logSumExp.block(q0, h, nQ, 1) == one.logSumExp);
      }
    }
  }
  Eigen::setNbThreads(saved);
}
