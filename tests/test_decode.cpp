// Decoding: a few query rows against a long key range, split over key ranges and merged by
// their logSumExp, in float, double and over half storage, up to a million keys. The KV cache
// (append, ring, paged, quantised): test_kv_cache.cpp; thread-count independence:
// test_tiled.cpp.
#include <sdpa/sdpa.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "support/cases.hpp"

using namespace sdpa_test;
using sdpa::Index;
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

TEST_CASE("decoding with tau > 1 (applied to the logits, not folded into q) matches the oracle", "[tiled][decode]") {
  // A few rows against many keys take the decoding kernel, whose tau > 1 multiplies the logits
  // after the product (foldsScaleIntoQuery); prefill tests do not reach that line.
  const Mat<float> q = randn<float>(2, 16, 31), k = randn<float>(3000, 16, 32), v = randn<float>(3000, 8, 33);
  checkEveryKernel(q, k, v, sdpa::scale::Constant{2.5}, mask::None{}, 2.5L, allVisible(), noBias());
}
