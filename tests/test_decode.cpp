// Decoding: a few query rows against a long key range, split over key ranges and merged by
// their logSumExp, in float, double and over half storage, up to a million keys. The KV cache
// (append, ring, paged, quantised): test_kv_cache.cpp; thread-count independence:
// test_tiled.cpp.
#include <sdpa/sdpa.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "support/cases.hpp"

using namespace sdpa_test;
using sdpa::Index;
using sdpa::internal::Isa;
using sdpa::mask::Align;
namespace mask = sdpa::mask;
namespace scale = sdpa::scale;
namespace kernel = sdpa::kernel;

TEMPLATE_TEST_CASE("decoding: a few queries against a long key range, split over key ranges", "[tiled][decode]", float,
                   double) {
  using T = TestType;
  for (const Index nQ : {1, 3}) {
    const Index nK = 20011, dK = 128;
    INFO("n_q " << nQ << ", n_k " << nK);
    const Mat<T> q = randn<T>(nQ, dK, 1, 3.0), k = randn<T>(nK, dK, 2), v = randn<T>(nK, dK, 3);
    const long double tau = 1.0L / std::sqrt((long double)dK);
    checkForwardWith<T>(kernel::Tiled{}, q, k, v, sdpa::scale::InvSqrtDk{}, mask::None{}, tau, allVisible(), noBias());
    // A KV cache filled to 15000 of its 20011 rows; the rest is stale (NaN) and must not be read.
    Mat<T> kStale = k, vStale = v;
    kStale.bottomRows(nK - 15000).setConstant(std::numeric_limits<T>::quiet_NaN());
    vStale.bottomRows(nK - 15000).setConstant(std::numeric_limits<T>::quiet_NaN());
    checkForwardWith<T>(
        kernel::Tiled{}, q, kStale, vStale, sdpa::scale::InvSqrtDk{}, mask::KeyLength{15000}, tau,
        [](Index, Index j) { return j < 15000; }, noBias());
  }
}

TEMPLATE_TEST_CASE("decoding over half storage: a few queries against a long fp16 or bf16 KV cache",
                   "[tiled][half][decode]", Eigen::half, Eigen::bfloat16) {
  using H = TestType;
  using sdpa::internal::Isa;
  // The decoding path widens k and v in registers with AVX2 or AVX-512 (8 columns at a time,
  // then single columns; 32 keys at a time, then single keys; half_columns in internal/half.hpp),
  // converts them column by column on the portable path; each against the float rule on the
  // exactly converted inputs, and AVX2 and AVX-512 to the bit (their dot products sum in the same
  // order).
  // The last key sits in the ragged end of the last chunk: valid = n_k in the last case.
  for (const auto& [nK, dK, dV, valid] :
       {std::tuple<Index, Index, Index, Index>{5000, 64, 64, 4321}, {4999, 100, 37, 4320}, {777, 13, 9, 777}}) {
    DYNAMIC_SECTION("n_k " << nK << ", d_k " << dK << ", d_v " << dV << ", valid keys " << valid) {
      const Index nQ = 2;
      Mat<H> q = randn<float>(nQ, dK, 71).template cast<H>(), k = randn<float>(nK, dK, 72).template cast<H>(),
             v = randn<float>(nK, dV, 73).template cast<H>();
      v.bottomRows(nK - valid).setConstant(H(std::numeric_limits<float>::quiet_NaN()));  // stale cache rows
      const Mat<double> qd = fromHalf(q), kd = fromHalf(k), vd = fromHalf(v);
      const Index nValid = valid;  // a structured binding cannot be captured in C++17
      const auto visible = [=](Index, Index j) { return j < nValid; };
      const long double tau = 1.0L / std::sqrt((long double)dK);
      const auto gold = referenceAttention<long double>(qd, kd, vd, tau, visible);
      const auto naive = referenceAttention<float>(qd, kd, vd, tau, visible);
      const Mat<double> goldOut = gold.output.template cast<double>();
      Mat<float> avx2;
      forEachIsa([&](Isa isa) {
        const auto out = sdpa::attentionForward<float>(q, k, v, sdpa::scale::InvSqrtDk{}, mask::KeyLength{nValid});
        CHECK(out.output.allFinite());
        CHECK(maxAbsDiff(out.output, goldOut) <=
              errorBound<float>(maxAbsDiff(naive.output, goldOut), goldOut.cwiseAbs().maxCoeff()));
        if (isa == Isa::Avx2) avx2 = out.output;
        if (isa == Isa::Avx512) CHECK((out.output.array() == avx2.array()).all());
      });
    }
  }
}

TEMPLATE_TEST_CASE("multi-token decoding over half storage: 5 to 32 rows, each bitwise alone, every ISA",
                   "[tiled][half][decode]", Eigen::half, Eigen::bfloat16) {
  // Half K/V stored by columns decode up to 32 query rows against at least 4 keys a row where
  // the CPU has the column kernels (AVX2, AVX-512; the portable path prefills from 5 rows): each
  // packet widened once for several rows (axpyAllRows, dotAllRows), every row the bits of its
  // one-row call, and within the float rule of the oracle on the exactly converted inputs. Stored
  // by keys (row-major) the same, through the by-key kernels.
  using H = TestType;
  const Index nK = 3001, dK = 64, dV = 24;
  const Mat<H> k = randn<float>(nK, dK, 92).template cast<H>(), v = randn<float>(nK, dV, 93).template cast<H>();
  const RowMat<H> kr = k, vr = v;
  const auto causal = mask::Causal{Align::LowerRight};
  for (const Index nQ : {5, 6, 7, 8, 13, 16, 32}) {
    INFO("n_q " << nQ);
    const Mat<H> q = randn<float>(nQ, dK, 91).template cast<H>();
    const RowMat<H> qr = q;
    const Mat<double> qd = fromHalf(q), kd = fromHalf(k), vd = fromHalf(v);
    const Index offset = nK - nQ;
    const auto visible = [=](Index i, Index j) { return j <= i + offset; };
    const long double tau = 1.0L / std::sqrt((long double)dK);
    const auto gold = referenceAttention<long double>(qd, kd, vd, tau, visible);
    const auto naive = referenceAttention<float>(qd, kd, vd, tau, visible);
    const Mat<double> goldOut = gold.output.template cast<double>();
    forEachIsa([&](Isa isa) {
      const auto all = sdpa::attentionForward<float>(q, k, v, scale::InvSqrtDk{}, causal);
      const auto allRows = sdpa::attentionForward<float>(qr, kr, vr, scale::InvSqrtDk{}, causal);
      const double bound = errorBound<float>(maxAbsDiff(naive.output, goldOut), goldOut.cwiseAbs().maxCoeff());
      CHECK(maxAbsDiff(all.output, goldOut) <= bound);
      CHECK(maxAbsDiff(allRows.output, goldOut) <= bound);
      if (isa == Isa::Portable) return;  // (the prefill kernel's rows, other bits than decoding's)
      for (Index i = 0; i < nQ; ++i) {
        // Row i alone against the keys it sees under the causal mask: the same keys, chunks and splits.
        const Mat<H> qi = q.row(i);
        const auto one = sdpa::attentionForward<float>(qi, k, v, scale::InvSqrtDk{}, mask::KeyLength{i + offset + 1});
        CHECK(Mat<float>(all.output.row(i)) == one.output);
        CHECK(all.logSumExp(i) == one.logSumExp(0));
        const RowMat<H> qri = qr.row(i);
        const auto oneRow =
            sdpa::attentionForward<float>(qri, kr, vr, scale::InvSqrtDk{}, mask::KeyLength{i + offset + 1});
        CHECK(Mat<float>(allRows.output.row(i)) == oneRow.output);
        CHECK(allRows.logSumExp(i) == oneRow.logSumExp(0));
      }
    });
  }
}

TEST_CASE("a million keys for one query, decoding and naive, against the oracle", "[extreme][decode]") {
  const Index nK = 1000000;
  const Mat<float> q = randn<float>(1, 16, 16), k = randn<float>(nK, 16, 17), v = randn<float>(nK, 8, 18);
  const auto gold = referenceAttention<long double>(q, k, v, 0.25L);
  const auto naive = referenceAttention<float>(q, k, v, 0.25L);
  const Mat<double> goldOut = gold.output.cast<double>();
  const double naiveErr = maxAbsDiff(naive.output, goldOut), scaleOut = goldOut.cwiseAbs().maxCoeff();
  forEachKernel([&](const auto& kern, const char* name) {
    INFO(name);
    const auto fwd = sdpa::attentionForward(kern, q, k, v);
    INFO("error " << maxAbsDiff(fwd.output, goldOut) << ", naive float loop " << naiveErr);
    CHECK(maxAbsDiff(fwd.output, goldOut) <= errorBound<float>(naiveErr, scaleOut));
    const double lse = double(gold.logSumExp(0));
    CHECK(std::abs(double(fwd.logSumExp(0)) - lse) <=
          errorBound<float>(std::abs(double(naive.logSumExp(0)) - lse), std::abs(lse)));
  });
}

TEST_CASE("multi-token decoding: 5 to 32 query rows against many keys, each row bitwise alone, every ISA",
          "[tiled][decode]") {
  // Up to 32 float query rows against at least 4 keys a row take the decoding path (speculative
  // or multi-token decoding; forward_tiled.hpp's decodes), whose wide register blocks take 8
  // rows at a time: every row's arithmetic is its own, so each row equals the one-row call, bit
  // for bit, and the rows and masks that differ by row (causal, sliding window, ALiBi) meet the
  // oracle. 5-7 rows: one rest block (AVX2: a block of 4 and a rest); 13: a wide block and a
  // rest block of 5; 29: three wide blocks and a rest of 5; n_k 2011: tails past every vector
  // width. Row-major q, k and v (read in place by the by-key kernels: blocks of 4 rows and a
  // rest of 1-3 in one pass over the keys) the same, against their own one-row calls.
  const Index nK = 2011, dK = 64, dV = 40;
  const Mat<float> k = randn<float>(nK, dK, 82), v = randn<float>(nK, dV, 83);
  const RowMat<float> kr = k, vr = v;
  const long double tau = 1.0L / std::sqrt((long double)dK);
  for (const Index nQ : {5, 6, 7, 8, 13, 16, 29, 32}) {
    INFO("n_q " << nQ);
    const Mat<float> q = randn<float>(nQ, dK, 81, 2.0);
    const RowMat<float> qr = q;
    forEachIsa([&](Isa) {
      const auto all = sdpa::attentionForward(q, k, v, scale::InvSqrtDk{}, mask::KeyLength{nK - 7});
      const auto allRows = sdpa::attentionForward(qr, kr, vr, scale::InvSqrtDk{}, mask::KeyLength{nK - 7});
      for (Index i = 0; i < nQ; ++i) {
        const Mat<float> qi = q.row(i);
        const auto one = sdpa::attentionForward(qi, k, v, scale::InvSqrtDk{}, mask::KeyLength{nK - 7});
        CHECK(Mat<float>(all.output.row(i)) == one.output);
        CHECK(all.logSumExp(i) == one.logSumExp(0));
        const RowMat<float> qri = qr.row(i);
        const auto oneRow = sdpa::attentionForward(qri, kr, vr, scale::InvSqrtDk{}, mask::KeyLength{nK - 7});
        CHECK(Mat<float>(allRows.output.row(i)) == oneRow.output);
        CHECK(allRows.logSumExp(i) == oneRow.logSumExp(0));
      }
    });
    const Index offset = nK - nQ;  // LowerRight: query i sits at key i + n_k - n_q
    const auto causal = mask::Causal{Align::LowerRight};
    const auto visible = [=](Index i, Index j) { return j <= i + offset; };
    checkForward<float>(q, k, v, scale::InvSqrtDk{}, causal, tau, visible, noBias());
    checkForwardResult<float>(sdpa::attentionForward(qr, kr, vr, scale::InvSqrtDk{}, causal), nQ, dV,
                              referenceAttention<long double>(q, k, v, tau, visible, noBias()),
                              referenceAttention<float>(q, k, v, tau, visible, noBias()));
    const auto windowAlibi =
        mask::combine(mask::SlidingWindow{300, 0, Align::LowerRight}, mask::Alibi{{0.0625}, Align::LowerRight});
    const auto inWindow = [=](Index i, Index j) { return j <= i + offset && j >= i + offset - 300; };
    const auto alibi = [=](Index i, Index j) { return -0.0625L * std::abs((long double)(i + offset - j)); };
    checkForward<float>(q, k, v, scale::InvSqrtDk{}, windowAlibi, tau, inWindow, alibi);
    checkForwardResult<float>(sdpa::attentionForward(qr, kr, vr, scale::InvSqrtDk{}, windowAlibi), nQ, dV,
                              referenceAttention<long double>(q, k, v, tau, inWindow, alibi),
                              referenceAttention<float>(q, k, v, tau, inWindow, alibi));
  }
}

TEST_CASE("one head stored by keys over many chunks: the next reads requested during the products, the same bits",
          "[decode][rowmajor]") {
  // One float head whose k and v are each one run of memory (row-major, row stride d): decoding
  // requests a chunk's values while it computes the chunk's logits, and the next chunk's keys
  // while it computes the values (ByKeyReads, StreamRequests), where other strides read each
  // chunk as they go. Requests change no arithmetic: the bits of the same keys at a wider row
  // stride, within the float rule of the oracle; with a window that hides the first chunks (no
  // request before the first chunk it sees) and a length that ends inside a chunk. d 128: chunks
  // of 1024 keys (decodeKeys), 4 and a part here.
  const Index nK = 4 * 1024 + 77, d = 128, wide = d + 3;
  const Mat<float> k = randn<float>(nK, d, 141), v = randn<float>(nK, d, 142);
  const RowMat<float> kr = k, vr = v;
  RowMat<float> kWide = RowMat<float>::Constant(nK, wide, std::numeric_limits<float>::quiet_NaN()), vWide = kWide;
  kWide.leftCols(d) = k;
  vWide.leftCols(d) = v;
  using Strided = Eigen::Map<const RowMat<float>, 0, Eigen::OuterStride<>>;
  const Strided kStrided(kWide.data(), nK, d, Eigen::OuterStride<>(wide)),
      vStrided(vWide.data(), nK, d, Eigen::OuterStride<>(wide));
  const long double tau = 1.0L / std::sqrt((long double)d);
  for (const Index nQ : {1, 2, 3}) {
    INFO("n_q " << nQ);
    const Mat<float> q = randn<float>(nQ, d, 143);
    const Index offset = nK - nQ;
    const auto window = mask::SlidingWindow{2500, 0, Align::LowerRight};
    const auto inWindow = [=](Index i, Index j) { return j <= i + offset && j >= i + offset - 2500; };
    const auto shorter = mask::KeyLength{nK - 600};
    const auto inLength = [=](Index, Index j) { return j < nK - 600; };
    forEachIsa([&](Isa) {
      const auto check = [&](const auto& m, const auto& visible) {
        const auto runs = sdpa::attentionForward(q, kr, vr, scale::InvSqrtDk{}, m);
        const auto strided = sdpa::attentionForward(q, kStrided, vStrided, scale::InvSqrtDk{}, m);
        CHECK(runs.output == strided.output);
        CHECK(runs.logSumExp == strided.logSumExp);
        checkForwardResult<float>(runs, nQ, d, referenceAttention<long double>(q, k, v, tau, visible, noBias()),
                                  referenceAttention<float>(q, k, v, tau, visible, noBias()));
      };
      check(mask::None{}, allVisible());
      check(window, inWindow);
      check(shorter, inLength);
    });
  }
}

TEST_CASE("decoding with tau > 1 (applied to the logits, not folded into q) matches the oracle", "[tiled][decode]") {
  // A few rows against many keys take the decoding kernel, whose tau > 1 multiplies the logits
  // after the product (foldsScaleIntoQuery); prefill tests do not reach that line.
  const Mat<float> q = randn<float>(2, 16, 31), k = randn<float>(3000, 16, 32), v = randn<float>(3000, 8, 33);
  checkEveryKernel(q, k, v, sdpa::scale::Constant{2.5}, mask::None{}, 2.5L, allVisible(), noBias());
}

/// A float dot product of m terms (x and y at strides, float or half) against double: within
/// gamma_m sum |x_i y_i|, Higham's bound for any order of float multiply-adds (u = 2^-24).
template <typename X, typename Y>
void checkDot(float got, const X* x, Index xStride, const Y* y, Index yStride, Index m) {
  const double u = std::ldexp(1.0, -24), gamma = double(m) * u / (1 - double(m) * u);
  double exact = 0, mass = 0;
  for (Index i = 0; i < m; ++i) {
    const double t = double(float(x[i * xStride])) * double(float(y[i * yStride]));
    exact += t;
    mass += std::abs(t);
  }
  CHECK(std::abs(double(got) - exact) <= gamma * mass);
}

TEST_CASE("decoding's row kernels run on the instance IsaChoice picks, within the float dot-product bound",
          "[decode][isa]") {
  // decode_rows.hpp's kernels are built for AVX-512, AVX2 and the build's own ISA and chosen at
  // run time: a build without -march decodes with AVX-512 where the CPU has it. Rows 1-4 (one
  // pass of that many), 5-9, 12, 14, 16, 24 and 41 (wide blocks of 8 logit rows and 6 value rows
  // where the ISA has 32 registers, up to four logit blocks sharing each block of keys, the rows
  // left as a block of 1-7 in the last group's pass; values' column blocks shared by passes of
  // at most 4 rows after the wide ones; AVX2: blocks of 4), d 37 and 8 (a short column block), n
  // 1037 (a tail past every vector width: rowLogits after the wide blocks) and 37 (no whole
  // block of keys: the tail alone).
  std::mt19937_64 gen(41);
  std::normal_distribution<float> normal;
  for (const auto& shape : {std::pair<Index, Index>{1037, 37}, {1037, 8}, {37, 37}}) {
    const Index n = shape.first, d = shape.second;  // (a structured binding cannot be captured in C++17)
    for (const Index R : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 14, 16, 24, 41}) {
      INFO("n " << n << ", d " << d << ", rows " << R);
      std::vector<float> a(size_t(R * d)), k(size_t(n * d)), p(size_t(R * n)), v(size_t(n * d));
      for (auto* x : {&a, &k, &p, &v})
        for (float& e : *x) e = normal(gen);
      std::vector<const float*> rowsA(static_cast<size_t>(R)), rowsP(static_cast<size_t>(R));
      for (Index r = 0; r < R; ++r) {
        rowsA[size_t(r)] = a.data() + r * d;
        rowsP[size_t(r)] = p.data() + r * n;
      }
      std::vector<float> first;
      forEachIsa([&](Isa isa) {
        Index lanes = 0;
        sdpa::internal::withDecodeSimd([&](auto simd) { lanes = decltype(simd)::kLanes; });
        CHECK(lanes == (isa >= Isa::Avx512 ? 16
                        : isa == Isa::Avx2 ? 8
                                           : Index(Eigen::internal::packet_traits<float>::size)));
        std::vector<float> s(size_t(R * n), 0.0f), dots(size_t(R * d));
        std::vector<float*> rowsS(static_cast<size_t>(R)), rowsD(static_cast<size_t>(R));
        for (Index r = 0; r < R; ++r) {
          rowsS[size_t(r)] = s.data() + r * n;
          rowsD[size_t(r)] = dots.data() + r * d;
        }
        sdpa::internal::decodeLogitsRows(rowsA.data(), R, k.data(), n, d, n, rowsS.data());
        sdpa::internal::decodeValuesRows(rowsP.data(), R, v.data(), n, d, n, rowsD.data());
        // The logits: one multiply-add per column in column order, the same bits whichever rows
        // share a pass (row 0 alone gives row 0's bits), and on AVX2 as on AVX-512 (fused; the
        // portable build's SSE2 rounds the product first).
        // So are the dots, row by row (wide blocks' rows and narrow passes').
        for (Index r = 0; r < R; ++r) {
          std::vector<float> alone(static_cast<size_t>(n), 0.0f), aloneDots(static_cast<size_t>(d));
          float* aloneRow = alone.data();
          float* aloneDot = aloneDots.data();
          sdpa::internal::decodeLogitsRows(rowsA.data() + r, 1, k.data(), n, d, n, &aloneRow);
          sdpa::internal::decodeValuesRows(rowsP.data() + r, 1, v.data(), n, d, n, &aloneDot);
          CHECK(std::equal(alone.begin(), alone.end(), s.begin() + r * n));
          CHECK(std::equal(aloneDots.begin(), aloneDots.end(), dots.begin() + r * d));
        }
        if (isa != Isa::Portable) {
          if (first.empty()) first = s;
          CHECK(s == first);
        }
        // Each logit (d terms) and dot (n terms) against double.
        for (Index r = 0; r < R; ++r) {
          for (Index j = 0; j < n; ++j) checkDot(s[size_t(r * n + j)], a.data() + r * d, 1, k.data() + j, n, d);
          for (Index c = 0; c < d; ++c) checkDot(dots[size_t(r * d + c)], p.data() + r * n, 1, v.data() + c * n, 1, n);
        }
      });
    }
  }
}

TEMPLATE_TEST_CASE(
    "decoding's kernels for K/V stored by keys (row-major) run on every ISA, within the dot-product bound",
    "[decode][isa][rowmajor]", float, Eigen::half, Eigen::bfloat16) {
  // Row-major k and v (numpy's and PyTorch's layout) decode through decode_rows.hpp's by-key
  // kernels, chosen at run time as the column kernels are (half storage widened in registers
  // on AVX2 and AVX-512): each key's logit a vector of partial sums over the columns, reduced;
  // each value column one chain of multiply-adds in key order, the bits of a scalar loop of
  // fused multiply-adds on AVX2 and AVX-512 (the portable instance of a build without FMA rounds
  // each product: within the bound). A key's logit is the same in any block of keys and at any
  // row stride (a head of a packed batch gives the single head's bits); each row is its own.
  // Any number of rows one pass over the keys (blocks of 4 rows, whose 16 or 8 sums one tree
  // reduces, and a rest of 1-3; the values' passes as wide as the fewest rows allow): 1, 2, 3, 4,
  // 5, 7, 8, 16, 17 against each row alone;
  // d 37 (column tails past every vector width), 64 and 8; n 1037 (the values in 17 blocks of
  // keys, the rows ahead requested up to the last) and 3 (fewer keys than a block).
  using T = TestType;
  std::mt19937_64 gen(47);
  std::normal_distribution<float> normal;
  for (const auto& shape : {std::pair<Index, Index>{1037, 37}, {1037, 64}, {1037, 8}, {3, 37}}) {
    const Index n = shape.first, d = shape.second;  // (a structured binding cannot be captured in C++17)
    for (const Index R : {1, 2, 3, 4, 5, 7, 8, 16, 17}) {
      INFO("n " << n << ", d " << d << ", rows " << R);
      const Index wide = d + 5;  // the same keys at another row stride
      std::vector<float> a(size_t(R * d)), p(size_t(R * n));
      std::vector<T> k(size_t(n * d)), v(size_t(n * d));
      for (auto* x : {&a, &p})
        for (float& e : *x) e = normal(gen);
      for (auto* x : {&k, &v})
        for (T& e : *x) e = T(normal(gen));
      std::vector<T> kWide(size_t(n * wide), T(std::numeric_limits<float>::quiet_NaN()));
      for (Index j = 0; j < n; ++j) std::copy_n(k.data() + j * d, d, kWide.data() + j * wide);
      std::vector<const float*> rowsA(static_cast<size_t>(R)), rowsP(static_cast<size_t>(R));
      for (Index r = 0; r < R; ++r) {
        rowsA[size_t(r)] = a.data() + r * d;
        rowsP[size_t(r)] = p.data() + r * n;
      }
      // Each value column: the scalar chain in key order.
      std::vector<float> chain(size_t(R * d));
      for (Index r = 0; r < R; ++r)
        for (Index c = 0; c < d; ++c) {
          float t = 0.0f;
          for (Index j = 0; j < n; ++j) t = std::fma(p[size_t(r * n + j)], float(v[size_t(j * d + c)]), t);
          chain[size_t(r * d + c)] = t;
        }
      forEachIsa([&](Isa isa) {
        bool ran = true;
        const auto run = [&](const float* const* rows, Index count, const T* keys, Index ld, float* s, float* dots) {
          std::vector<float*> rowsS(static_cast<size_t>(count)), rowsD(static_cast<size_t>(count));
          for (Index r = 0; r < count; ++r) {
            rowsS[size_t(r)] = s + r * n;
            rowsD[size_t(r)] = dots + r * d;
          }
          ran = sdpa::internal::decodeLogitsByKey(rows, count, keys, ld, d, n, rowsS.data()) &&
                sdpa::internal::decodeValuesByKey(rowsP.data(), count, v.data(), d, d, n, rowsD.data());
        };
        std::vector<float> s(size_t(R * n), 0.0f), dots(size_t(R * d)), s2(size_t(R * n), 0.0f), dots2(size_t(R * d));
        run(rowsA.data(), R, k.data(), d, s.data(), dots.data());
        // Float always; half wherever the instance widens it in registers (AVX2, AVX-512).
        CHECK(ran == (std::is_same_v<T, float> || isa != Isa::Portable ||
                      sdpa::internal::decode_simd::portable::Simd::kHalfLoads));
        if (!ran) return;
        run(rowsA.data(), R, kWide.data(), wide, s2.data(), dots2.data());
        CHECK(s2 == s);
        if (isa != Isa::Portable) {
          CHECK(dots == chain);
        } else {  // (the portable build's instance may round each product: SSE2 has no FMA)
          for (Index r = 0; r < R; ++r)
            for (Index c = 0; c < d; ++c) checkDot(dots[size_t(r * d + c)], p.data() + r * n, 1, v.data() + c, d, n);
        }
        for (Index r = 0; r < R; ++r) {
          std::vector<float> alone(static_cast<size_t>(n), 0.0f);
          float* aloneRow = alone.data();
          sdpa::internal::decodeLogitsByKey(rowsA.data() + r, 1, k.data(), d, d, n, &aloneRow);
          CHECK(std::equal(alone.begin(), alone.end(), s.begin() + r * n));
          for (Index j = 0; j < n; ++j) checkDot(s[size_t(r * n + j)], a.data() + r * d, 1, k.data() + j * d, 1, d);
        }
      });
    }
  }
}

TEMPLATE_TEST_CASE("decoding's by-key kernels over several kv heads side by side give each head's bits alone",
                   "[decode][isa][rowmajor]", float, Eigen::half, Eigen::bfloat16) {
  // PyTorch's [n, heads x d] layout: each key's row holds every kv head's k (and v). The heads
  // kernels (decodeLogitsByKeyHeads, decodeValuesByKeyHeads) take a block of keys for every head
  // in turn; each head's rows must get exactly the logits and values of a call over that head
  // alone (decodeLogitsByKey, decodeValuesByKey), whatever its number of rows (0 for a head the
  // chunk hides, 1-4, 5 and 17: blocks of 4 and a rest), with keys past the last
  // block (n 1037, 3) and column tails (d 37).
  using T = TestType;
  std::mt19937_64 gen(53);
  std::normal_distribution<float> normal;
  const std::vector<Index> rowsPerHead{1, 0, 4, 5, 2, 17, 3};
  const Index G = Index(rowsPerHead.size());
  std::vector<Index> first{0};
  for (const Index r : rowsPerHead) first.push_back(first.back() + r);
  const Index R = first.back();
  for (const auto& shape : {std::pair<Index, Index>{1037, 37}, {1037, 64}, {3, 64}, {0, 16}}) {
    const Index n = shape.first, d = shape.second;
    INFO("n " << n << ", d " << d);
    const Index ld = G * d + 3;  // the heads side by side, then 3 unused entries a row
    std::vector<float> a(size_t(R * d)), p(size_t(R * std::max<Index>(n, 1)));
    for (auto* x : {&a, &p})
      for (float& e : *x) e = normal(gen);
    // (At least a row: the heads' pointers into an empty vector would offset a null pointer.)
    std::vector<T> k(size_t(std::max<Index>(n, 1) * ld), T(std::numeric_limits<float>::quiet_NaN())), v = k;
    for (Index j = 0; j < n; ++j)
      for (Index c = 0; c < G * d; ++c) {
        k[size_t(j * ld + c)] = T(normal(gen));
        v[size_t(j * ld + c)] = T(normal(gen));
      }
    std::vector<const float*> rowsA(static_cast<size_t>(R)), rowsP(static_cast<size_t>(R));
    std::vector<float> s(size_t(R * n), 0.0f), dots(size_t(R * d), -1.0f);
    std::vector<float*> rowsS(static_cast<size_t>(R)), rowsD(static_cast<size_t>(R));
    for (Index r = 0; r < R; ++r) {
      rowsA[size_t(r)] = a.data() + r * d;
      rowsP[size_t(r)] = p.data() + r * n;
      rowsS[size_t(r)] = s.data() + r * n;
      rowsD[size_t(r)] = dots.data() + r * d;
    }
    std::vector<const T*> kHeads(static_cast<size_t>(G)), vHeads(static_cast<size_t>(G));
    for (Index g = 0; g < G; ++g) {
      kHeads[size_t(g)] = k.data() + g * d;
      vHeads[size_t(g)] = v.data() + g * d;
    }
    forEachIsa([&](Isa) {
      std::fill(s.begin(), s.end(), 0.0f);
      std::fill(dots.begin(), dots.end(), -1.0f);
      const bool ran =
          sdpa::internal::decodeLogitsByKeyHeads(rowsA.data(), first.data(), G, kHeads.data(), ld, d, n,
                                                 rowsS.data()) &&
          sdpa::internal::decodeValuesByKeyHeads(rowsP.data(), first.data(), G, vHeads.data(), ld, d, n, rowsD.data());
      if (!ran) {  // half storage on an instance that does not widen it: as the single-head kernels
        CHECK_FALSE(sdpa::internal::decodeLogitsByKey(rowsA.data(), 1, k.data(), ld, d, n, rowsS.data()));
        return;
      }
      for (Index g = 0; g < G; ++g) {
        const Index r0 = first[size_t(g)], count = rowsPerHead[size_t(g)];
        if (count == 0) continue;
        INFO("head " << g << ", rows " << count);
        std::vector<float> s1(size_t(count * n), 0.0f), dots1(size_t(count * d));
        std::vector<float*> rowsS1(static_cast<size_t>(count)), rowsD1(static_cast<size_t>(count));
        for (Index r = 0; r < count; ++r) {
          rowsS1[size_t(r)] = s1.data() + r * n;
          rowsD1[size_t(r)] = dots1.data() + r * d;
        }
        REQUIRE(
            sdpa::internal::decodeLogitsByKey(rowsA.data() + r0, count, kHeads[size_t(g)], ld, d, n, rowsS1.data()));
        REQUIRE(
            sdpa::internal::decodeValuesByKey(rowsP.data() + r0, count, vHeads[size_t(g)], ld, d, n, rowsD1.data()));
        CHECK(std::equal(s1.begin(), s1.end(), s.begin() + r0 * n));
        CHECK(std::equal(dots1.begin(), dots1.end(), dots.begin() + r0 * d));
      }
    });
  }
}

TEST_CASE("the online softmax's exp pass: the same bits on AVX2 and AVX-512, within 1.1 ulp, NaN and -inf rules",
          "[decode][isa]") {
  // expShiftedSum<float> (OnlineSoftmax::absorb's pass over a row of logits, decoding's softmax)
  // takes the fast kernels' exp on AVX2 and AVX-512 (at most 1.009 ulp measured, NUMERICS.md),
  // its sum in 16 partial sums on both; the portable path is Eigen's pexp (test_softmax.cpp).
  std::mt19937_64 gen(43);
  std::uniform_real_distribution<float> logit(-30.0f, 5.0f);
  constexpr float inf = std::numeric_limits<float>::infinity();
  for (const Index n : {0, 1, 15, 16, 17, 33, 1000, 1037}) {
    INFO("n " << n);
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = logit(gen);
    if (n > 2) x[1] = -inf;  // a hidden key: weight exactly 0
    const float m = n > 0 ? *std::max_element(x.begin(), x.end()) : 0.0f;
    std::vector<float> avx2, avx2Nan;
    float avx2Sum = 0;
    forEachIsa([&](Isa isa) {
      if (isa == Isa::Portable) return;
      std::vector<float> y = x;
      const float sum = sdpa::internal::expShiftedSum(y.data(), n, m);
      double exactSum = 0;
      for (Index j = 0; j < n; ++j) {
        const float z = x[size_t(j)] - m;  // the argument, rounded as the kernel rounds it
        const long double e = z > sdpa::internal::kExpCut<float> ? std::exp((long double)z) : 0.0L;
        exactSum += double(e);
        const double ulp = double(std::nextafter(float(e), inf) - float(e));
        CHECK(std::abs((long double)y[size_t(j)] - e) <= 1.1L * ulp);
      }
      // n weights in (0, 1], each within 1.1 ulp (at most 2.2 u of itself, u = 2^-24), summed in
      // any order: at most gamma_n of their sum more.
      const double u = std::ldexp(1.0, -24), gamma = double(n) * u / (1 - double(n) * u);
      CHECK(std::abs(double(sum) - exactSum) <= (2.2 * u + gamma * (1 + 2.2 * u)) * exactSum);
      if (n > 2) CHECK(y[1] == 0.0f);
      // The weights are the fast kernels' exp, to the bit.
      std::vector<float> z(static_cast<size_t>(n)), e(static_cast<size_t>(n));
      for (Index j = 0; j < n; ++j) z[size_t(j)] = x[size_t(j)] - m;
      sdpa::internal::fast::expArray(false, z.data(), e.data(), n);
      CHECK(y == e);
      if (isa == Isa::Avx2) {
        avx2 = y;
        avx2Sum = sum;
      }
      if (isa == Isa::Avx512) {
        CHECK(y == avx2);
        CHECK(sum == avx2Sum);
      }
      // A NaN logit makes the sum NaN (the caller then scans the row).
      if (n > 0) {
        std::vector<float> w = x;
        w[size_t(n - 1)] = std::numeric_limits<float>::quiet_NaN();
        CHECK(std::isnan(sdpa::internal::expShiftedSum(w.data(), n, m)));
      }
    });
  }
}
