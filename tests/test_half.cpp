// Half-precision inputs (fp16, bf16) on the tiled kernel: fp32 accumulation within the
// storage epsilon's bound, and fp16 logits that would overflow in half but are computed in float
// (seed C13, C15). Decoding over half storage: test_decode.cpp; the fast kernels' half and bf16
// paths ISA by ISA, and bf16 dot products: test_kernel_paths.cpp.
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

TEMPLATE_TEST_CASE("half and bfloat16 inputs: fp32 accumulation, bounded by the storage epsilon", "[tiled][half]",
                   Eigen::half, Eigen::bfloat16) {
  using H = TestType;
  // The output is within the float rule of a float run on the same (exactly converted) inputs,
  // plus one rounding to H: |out_H - gold| <= 2 err_float + 8 eps_f max|gold| + (eps_H / 2) max|gold|.
  // eps = 2^-10 (half), 2^-7 (bfloat16); not NumTraits<half>::epsilon(), which is 2^-13 in Eigen 3.4.
  const double epsH = std::is_same_v<H, Eigen::half> ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
  const Index nQ = 70, nK = 300, dK = 64;
  const Mat<H> q = toHalf<H>(randn<float>(nQ, dK, 41)), k = toHalf<H>(randn<float>(nK, dK, 42)),
               v = toHalf<H>(randn<float>(nK, dK, 43));
  const Mat<double> qd = fromHalf(q), kd = fromHalf(k), vd = fromHalf(v);
  const long double tau = 0.125L;
  const auto gold = referenceAttention<long double>(qd, kd, vd, tau, [](Index i, Index j) { return j <= i + 230; });
  const auto naive = referenceAttention<float>(qd, kd, vd, tau, [](Index i, Index j) { return j <= i + 230; });
  const Mat<double> goldOut = gold.output.template cast<double>();
  const double scale = goldOut.cwiseAbs().maxCoeff();
  const double errFloat = maxAbsDiff(naive.output, goldOut);

  const auto inH = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, mask::Causal{Align::LowerRight});
  STATIC_REQUIRE(std::is_same_v<typename decltype(inH.output)::Scalar, H>);
  STATIC_REQUIRE(std::is_same_v<typename decltype(inH.logSumExp)::Scalar, float>);
  const double errH = maxAbsDiff(fromHalf(inH.output), goldOut);
  INFO("error of the " << sizeof(H) * 8 << "-bit output " << errH << ", float naive error " << errFloat);
  CHECK(errH <= errorBound<float>(errFloat, scale) + 0.5 * epsH * scale);

  const auto inFloat =
      sdpa::attentionForward<float>(q, k, v, sdpa::scale::InvSqrtDk{}, mask::Causal{Align::LowerRight});
  STATIC_REQUIRE(std::is_same_v<typename decltype(inFloat.output)::Scalar, float>);
  CHECK(maxAbsDiff(inFloat.output, goldOut) <= errorBound<float>(errFloat, scale));
  CHECK(maxAbsDiff(inFloat.logSumExp, gold.logSumExp.template cast<double>()) <=
        errorBound<float>(maxAbsDiff(naive.logSumExp, gold.logSumExp.template cast<double>()),
                          gold.logSumExp.cwiseAbs().template cast<double>().maxCoeff()));

  const auto naiveKernel = sdpa::attentionForward<float>(kernel::Naive{}, q, k, v, sdpa::scale::InvSqrtDk{},
                                                         mask::Causal{Align::LowerRight});
  CHECK(maxAbsDiff(naiveKernel.output, goldOut) <= errorBound<float>(errFloat, scale));

  const auto multi = sdpa::multiHeadAttentionForward<float>(q, k, v, sdpa::Heads{2}, sdpa::scale::InvSqrtDk{});
  const auto multiGold =
      sdpa::multiHeadAttentionForward(kernel::Naive{}, qd, kd, vd, sdpa::Heads{2}, sdpa::scale::InvSqrtDk{});
  CHECK(maxAbsDiff(multi.output, multiGold.output) <= 1e-5);
}

TEST_CASE("unscaled fp16 inputs whose fp16 logits overflow still give the finite result  [seed C13][seed C15]",
          "[tiled][half]") {
  // Entries of standard deviation 60 and d_k = 64: q.k has standard deviation 60 * 60 * 8 = 28800
  // and reaches beyond fp16's 65504. The logits are computed in float, so the output is the
  // (nearly one-hot) softmax of the reference.
  const Index nQ = 16, nK = 40, dK = 64;
  const Mat<Eigen::half> q = (60.0f * randn<float>(nQ, dK, 51)).cast<Eigen::half>(),
                         k = (60.0f * randn<float>(nK, dK, 52)).cast<Eigen::half>(),
                         v = randn<float>(nK, 8, 53).cast<Eigen::half>();
  const Mat<double> qd = fromHalf(q), kd = fromHalf(k), vd = fromHalf(v);
  const auto logits = (qd * kd.transpose()).cwiseAbs();
  REQUIRE(logits.maxCoeff() > 65504.0);
  const auto out = sdpa::attentionForward<float>(q, k, v, sdpa::scale::None{});
  const auto gold = referenceAttention<long double>(qd, kd, vd, 1.0L);
  CHECK(out.output.allFinite());
  CHECK(out.logSumExp.allFinite());
  CHECK(maxAbsDiff(out.output, gold.output.cast<double>()) <= 1e-5);
  const auto outH = sdpa::attentionForward(q, k, v, sdpa::scale::None{});
  CHECK(fromHalf(outH.output).allFinite());
}
