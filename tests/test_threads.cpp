// Thread safety (NUMERICS.md, "Thread safety"): concurrent calls from several threads on shared
// inputs with distinct outputs give the results of serial calls, while each call also runs its
// own OpenMP team. Built into its own test binary so that the `tsan` preset (ThreadSanitizer,
// with LLVM's OpenMP runtime and its Archer tool) can check it without rebuilding every test.
#include <sdpa/sdpa.hpp>

#include <thread>
#include <vector>

#include "support/cases.hpp"

using namespace sdpa_test;
using sdpa::Index;
namespace mask = sdpa::mask;
namespace kernel = sdpa::kernel;

namespace {

constexpr int kCallers = 4;

/// Runs f(i) on kCallers threads at once.
template <typename F>
void concurrently(F&& f) {
  std::vector<std::thread> threads;
  threads.reserve(kCallers);
  for (int i = 0; i < kCallers; ++i) threads.emplace_back([&f, i] { f(i); });
  for (auto& t : threads) t.join();
}

}  // namespace

TEMPLATE_TEST_CASE("concurrent forward calls on shared inputs equal serial calls, bitwise", "[threads]", float,
                   double) {
  using T = TestType;
  // Batched GQA prefill (2 items, 4 query heads on 2 kv heads) and a decode call (1 query
  // against 20000 keys, split over key ranges), both threaded inside.
  const auto layout = sdpa::BatchLayout::padded(2, 150, 150, {}, {120, 150});
  const sdpa::Heads heads{4, 2};
  const Mat<T> q = randn<T>(300, 4 * 16, 1), k = randn<T>(300, 2 * 16, 2), v = randn<T>(300, 2 * 8, 3);
  const Mat<T> qd = randn<T>(1, 32, 4), kd = randn<T>(20000, 32, 5), vd = randn<T>(20000, 8, 6);
  const auto causal = mask::Causal{mask::Align::LowerRight};
  const auto serial = sdpa::batchedAttentionForward(q, k, v, layout, heads, sdpa::scale::InvSqrtDk{}, causal);
  const auto serialDecode = sdpa::attentionForward(qd, kd, vd);

  std::vector<sdpa::MultiHeadForwardResult<T>> results(kCallers);
  std::vector<sdpa::ForwardResult<T>> decodes(kCallers);
  concurrently([&](int i) {
    results[size_t(i)] = sdpa::batchedAttentionForward(q, k, v, layout, heads, sdpa::scale::InvSqrtDk{}, causal);
    decodes[size_t(i)] = sdpa::attentionForward(kernel::Tiled{}, qd, kd, vd);
  });
  for (int i = 0; i < kCallers; ++i) {
    CHECK(results[size_t(i)].output == serial.output);
    CHECK(results[size_t(i)].logSumExp == serial.logSumExp);
    CHECK(decodes[size_t(i)].output == serialDecode.output);
  }
}

TEMPLATE_TEST_CASE("concurrent backward calls on shared inputs equal serial calls", "[threads]", float, double) {
  using T = TestType;
  const Mat<T> q = randn<T>(200, 2 * 16, 7), k = randn<T>(260, 2 * 16, 8), v = randn<T>(260, 2 * 8, 9);
  const Mat<T> dOut = randn<T>(200, 2 * 8, 10);
  const sdpa::Heads heads{2};
  const auto fwd = sdpa::multiHeadAttentionForward(q, k, v, heads);
  const auto serial = sdpa::multiHeadAttentionBackward(q, k, v, fwd, dOut, heads, sdpa::scale::InvSqrtDk{});
  std::vector<sdpa::MultiHeadGradients<T>> grads(kCallers);
  concurrently([&](int i) {
    grads[size_t(i)] = sdpa::multiHeadAttentionBackward(q, k, v, fwd, dOut, heads, sdpa::scale::InvSqrtDk{});
  });
  // Per-thread dq buffers are summed at the end: equal up to rounding (NUMERICS.md), here
  // within 64 ulps of the gradient scale, as test_tiled.cpp checks across thread counts.
  const double tol = 64 * double(std::numeric_limits<T>::epsilon()) *
                     std::max(1.0, double(serial.dq.cwiseAbs().maxCoeff() + serial.dk.cwiseAbs().maxCoeff()));
  for (const auto& g : grads) {
    CHECK(maxAbsDiff(g.dq, serial.dq) <= tol);
    CHECK(maxAbsDiff(g.dk, serial.dk) <= tol);
    CHECK(maxAbsDiff(g.dv, serial.dv) <= tol);
  }
}

TEST_CASE("concurrent calls with their own learnable scales accumulate their own gradients", "[threads]") {
  const Mat<double> q = randn<double>(64, 16, 11), k = randn<double>(64, 16, 12), v = randn<double>(64, 4, 13);
  const Mat<double> dOut = randn<double>(64, 4, 14);
  sdpa::scale::Learnable<double> reference{0.3};
  const auto fwd = sdpa::attentionForward(q, k, v, reference);
  sdpa::attentionBackward(q, k, v, fwd, dOut, reference);
  std::vector<sdpa::scale::Learnable<double>> taus(kCallers, sdpa::scale::Learnable<double>{0.3});
  concurrently([&](int i) {
    auto& tau = taus[size_t(i)];
    const auto f = sdpa::attentionForward(q, k, v, tau);
    sdpa::attentionBackward(q, k, v, f, dOut, tau);
  });
  for (const auto& tau : taus)
    CHECK(std::abs(tau.grad() - reference.grad()) <= 64 * 1e-16 * std::max(1.0, std::abs(reference.grad())));
}
