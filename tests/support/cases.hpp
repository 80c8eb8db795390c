// Shapes, policies and masks that every kernel test sweeps, written out once.
#pragma once

#include <sdpa/sdpa.hpp>

#include <cmath>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"

namespace sdpa_test {

/// x rounded to H (Eigen::half or Eigen::bfloat16), and H's values back, exactly.
template <typename H>
Mat<H> toHalf(const Mat<float>& x) {
  return x.cast<H>();
}
template <typename H>
Mat<double> fromHalf(const Mat<H>& x) {
  return x.template cast<float>().template cast<double>();
}

/// The unit roundoff of a half type's storage: 2^-11 (half), 2^-8 (bfloat16). Not
/// NumTraits<half>::epsilon(), which is 2^-13 in Eigen 3.4.
template <typename H>
double unitRoundoff() {
  return std::is_same_v<H, Eigen::half> ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
}

struct Shape {
  Index nQ, nK, dK, dV;
};
inline std::string toString(const Shape& s) {
  return std::to_string(s.nQ) + "q x " + std::to_string(s.nK) + "k, d_k " + std::to_string(s.dK) + ", d_v " +
         std::to_string(s.dV);
}

/// 1x1; n_q < n_k and d_k != d_v; n_q > n_k; sizes that are not powers of two; a square 64.
inline std::vector<Shape> standardShapes() {
  return {{1, 1, 1, 1}, {3, 5, 4, 2}, {7, 3, 5, 6}, {17, 33, 13, 9}, {64, 64, 64, 64}, {31, 100, 20, 7}};
}

/// Calls f(kernel, name) for the reference kernel, the tiled kernel with its own block sizes, and
/// tiled kernels with tiny blocks, so that small shapes still cross many tile boundaries (and
/// masks produce hidden, visible and partial tiles).
template <typename F>
void forEachKernel(F&& f) {
  f(sdpa::kernel::Naive{}, "Naive");
  f(sdpa::kernel::Tiled{}, "Tiled{}");
  f(sdpa::kernel::Tiled{2, 3}, "Tiled{2, 3}");
  f(sdpa::kernel::Tiled{5, 16}, "Tiled{5, 16}");
}

/// Calls f(policy, tau, name) for every scale policy, with tau computed independently of the
/// library in long double.
template <typename T, typename F>
void forEachPolicy(Index dK, F&& f) {
  const long double invSqrt = dK > 0 ? 1.0L / std::sqrt((long double)dK) : 1.0L;
  f(sdpa::scale::InvSqrtDk{}, invSqrt, "InvSqrtDk");
  f(sdpa::scale::None{}, 1.0L, "None");
  f(sdpa::scale::Constant{0.37}, (long double)(T)0.37, "Constant{0.37}");
  f(sdpa::scale::Temperature{2.5}, 1.0L / 2.5L, "Temperature{2.5}");
  f(sdpa::scale::Learnable<T>{}, invSqrt, "Learnable{}");
  f(sdpa::scale::Learnable<T>{T(0.2)}, (long double)T(0.2), "Learnable{0.2}");
}

/**
 * Checks a forward result of `rows` query rows and `cols` value columns against the long-double
 * oracle with the FlashAttention rule (output and logSumExp); fully masked rows must give
 * exactly 0 and -inf.
 */
template <typename T, typename Result>
void checkForwardResult(const Result& fwd, Index rows, Index cols, const RefResult<long double>& gold,
                        const RefResult<T>& naive) {
  REQUIRE(fwd.output.rows() == rows);
  REQUIRE(fwd.output.cols() == cols);
  REQUIRE(fwd.logSumExp.size() == rows);
  const Mat<double> goldOut = gold.output.template cast<double>();
  const Vec<double> goldLse = gold.logSumExp.template cast<double>();

  double lseScale = 0;
  for (Index i = 0; i < goldLse.size(); ++i)
    if (std::isfinite(goldLse(i))) lseScale = std::max(lseScale, std::abs(goldLse(i)));

  const double outScale = goldOut.size() ? goldOut.cwiseAbs().maxCoeff() : 0.0;
  const double errOut = maxAbsDiff(fwd.output, goldOut);
  const double naiveOut = maxAbsDiff(naive.output, goldOut);
  INFO("output error " << errOut << ", naive error in the same precision " << naiveOut);
  CHECK(errOut <= errorBound<T>(naiveOut, outScale, lseScale));
  const double errLse = maxAbsDiff(fwd.logSumExp, goldLse);
  const double naiveLse = maxAbsDiff(naive.logSumExp, goldLse);
  INFO("logSumExp error " << errLse << ", naive error " << naiveLse);
  CHECK(errLse <= errorBound<T>(naiveLse, lseScale));

  for (Index i = 0; i < rows; ++i) {
    if (std::isinf(goldLse(i))) {  // fully masked row
      CHECK(fwd.logSumExp(i) == -std::numeric_limits<T>::infinity());
      CHECK((fwd.output.row(i).array() == T(0)).all());
    }
  }
  CHECK(fwd.output.allFinite());
}

/// Runs the library forward pass and checks it against the oracle (checkForwardResult).
template <typename T, typename Kernel, typename Scale, typename Mask>
void checkForwardAgainst(const Kernel& kernel, const Mat<T>& q, const Mat<T>& k, const Mat<T>& v, const Scale& scale,
                         const Mask& mask, const RefResult<long double>& gold, const RefResult<T>& naive) {
  checkForwardResult<T>(sdpa::attentionForward(kernel, q, k, v, scale, mask), q.rows(), v.cols(), gold, naive);
}

/// checkForwardAgainst the oracle of (tau, visible, bias, softcap), computed here.
template <typename T, typename Kernel, typename Scale, typename Mask>
void checkForwardWith(const Kernel& kernel, const Mat<T>& q, const Mat<T>& k, const Mat<T>& v, const Scale& scale,
                      const Mask& mask, long double tau, const VisibleFn& visible, const BiasFn& bias,
                      long double softcap = 0) {
  checkForwardAgainst<T>(kernel, q, k, v, scale, mask,
                         referenceAttention<long double>(q, k, v, tau, visible, bias, softcap),
                         referenceAttention<T>(q, k, v, tau, visible, bias, softcap));
}

/// checkForwardAgainst for every kernel of forEachKernel, the oracle computed once.
template <typename T, typename Scale, typename Mask>
void checkEveryKernel(const Mat<T>& q, const Mat<T>& k, const Mat<T>& v, const Scale& scale, const Mask& mask,
                      long double tau, const VisibleFn& visible, const BiasFn& bias, long double softcap = 0) {
  const auto gold = referenceAttention<long double>(q, k, v, tau, visible, bias, softcap);
  const auto naive = referenceAttention<T>(q, k, v, tau, visible, bias, softcap);
  forEachKernel([&](const auto& kern, const char* kernelName) {
    INFO("kernel " << kernelName);
    checkForwardAgainst<T>(kern, q, k, v, scale, mask, gold, naive);
  });
}

/// checkForwardAgainst for several tiled block sizes, the oracle computed once.
template <typename T, typename Scale, typename Mask>
void checkTiledKernels(std::initializer_list<sdpa::kernel::Tiled> kernels, const Mat<T>& q, const Mat<T>& k,
                       const Mat<T>& v, const Scale& scale, const Mask& mask, long double tau, const VisibleFn& visible,
                       const BiasFn& bias, long double softcap = 0) {
  const auto gold = referenceAttention<long double>(q, k, v, tau, visible, bias, softcap);
  const auto naive = referenceAttention<T>(q, k, v, tau, visible, bias, softcap);
  for (const sdpa::kernel::Tiled& kern : kernels) {
    INFO("blocks " << kern.blockQ << " x " << kern.blockK);
    checkForwardAgainst<T>(kern, q, k, v, scale, mask, gold, naive);
  }
}

/// checkForwardWith the default kernel.
template <typename T, typename Scale, typename Mask>
void checkForward(const Mat<T>& q, const Mat<T>& k, const Mat<T>& v, const Scale& scale, const Mask& mask,
                  long double tau, const VisibleFn& visible, const BiasFn& bias, long double softcap = 0) {
  checkForwardWith<T>(sdpa::kernel::Tiled{}, q, k, v, scale, mask, tau, visible, bias, softcap);
}

/// One thread for the scope: which worker runs which unit then never changes from call to call.
/// With several, a worker's scratch grows on the first call it takes part in (allocation
/// counts), and the backward's dk and dv are sums of per-thread shares whose split varies (bits).
struct OneThread {
  int saved = Eigen::nbThreads();
  OneThread() { Eigen::setNbThreads(1); }
  ~OneThread() { Eigen::setNbThreads(saved); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;
};

/// The name of an instruction-set path, for test messages.
inline const char* isaName(sdpa::internal::Isa isa) {
  using sdpa::internal::Isa;
  return isa == Isa::Amx          ? "AVX-512 + BF16 + AMX"
         : isa == Isa::Avx512Bf16 ? "AVX-512 + BF16"
         : isa == Isa::Avx512     ? "AVX-512"
         : isa == Isa::Avx2       ? "AVX2"
                                  : "portable";
}

/// Calls f() under every ISA this CPU runs (the cap restored after), f(isa) told which;
/// Avx512Bf16 and Amx (the same fp32 kernels as Avx512) only where `bf16` asks for them.
template <typename F>
void forEachIsa(F&& f, bool bf16 = false) {
  using sdpa::internal::Isa;
  using sdpa::internal::IsaChoice;
  for (const Isa cap : {Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx}) {
    if (int(cap) > int(IsaChoice::detected()) || (cap >= Isa::Avx512Bf16 && !bf16)) continue;
    IsaChoice::setCap(cap);
    INFO("ISA " << isaName(IsaChoice::current()));
    f(cap);
  }
  IsaChoice::setCap(Isa::Amx);
}

}  // namespace sdpa_test
