// Allocation-free calls: once a first call on the thread has grown the kernel's scratch, the
// *Into entry points allocate nothing. Counted two ways, in a binary of its own because both
// replace something global: every operator new (std::vector and the like), and every heap
// allocation of Eigen (EIGEN_RUNTIME_NO_MALLOC, whose check is an eigen_assert that counts here
// instead of aborting).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

namespace {
std::atomic<bool> g_counting{false};
std::atomic<long> g_news{0}, g_eigenMallocs{0};
}  // namespace

// Eigen's no-malloc check fails an eigen_assert with this text; any other failed assertion aborts.
inline void sdpaTestEigenAssert(const char* condition, const char* file, int line) {
  if (std::strstr(condition, "heap allocation is forbidden")) {
    ++g_eigenMallocs;
    return;
  }
  std::fprintf(stderr, "%s:%d: Eigen assertion failed: %s\n", file, line, condition);
  std::abort();
}
#define EIGEN_RUNTIME_NO_MALLOC
#define eigen_assert(x)                                                     \
  do {                                                                      \
    if (!static_cast<bool>(x)) sdpaTestEigenAssert(#x, __FILE__, __LINE__); \
  } while (false)

#include <sdpa/sdpa.hpp>

#include "support/cases.hpp"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SDPA_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define SDPA_TEST_ASAN 1
#endif

#ifdef SDPA_TEST_ASAN
// Under AddressSanitizer, whose allocator owns operator new, its allocation hook counts every
// heap allocation instead (malloc, new and Eigen's alike).
extern "C" int __sanitizer_install_malloc_and_free_hooks(void (*onMalloc)(const volatile void*, std::size_t),
                                                         void (*onFree)(const volatile void*));
namespace {
void onMalloc(const volatile void*, std::size_t) {
  if (g_counting) ++g_news;
}
void onFree(const volatile void*) {}
const int g_hooks = __sanitizer_install_malloc_and_free_hooks(onMalloc, onFree);
}  // namespace
constexpr bool kHeapCountsEigen = true;
#else
constexpr bool kHeapCountsEigen = false;
// GCC 12 takes the free() below for one of a pointer from `new` (-Wmismatched-new-delete); here
// every operator new is malloc's.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

void* operator new(std::size_t n) {
  if (g_counting) ++g_news;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (g_counting) ++g_news;
  const std::size_t align = std::max(static_cast<std::size_t>(a), sizeof(void*));
  void* p = nullptr;
  if (posix_memalign(&p, align, n ? n : 1) != 0) throw std::bad_alloc();
  return p;
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#endif

using namespace sdpa_test;
using sdpa::Heads;
using sdpa::mask::Align;

namespace {

/// news: operator new calls (under ASan: every heap allocation, Eigen's included); eigen: Eigen's.
struct Allocations {
  long news, eigen;
  long total() const { return news + eigen; }
};

/// Heap allocations made by f(): by operator new, and by Eigen.
template <typename F>
Allocations countAllocations(F&& f) {
  g_news = 0;
  g_eigenMallocs = 0;
  Eigen::internal::set_is_malloc_allowed(false);
  g_counting = true;
  f();
  g_counting = false;
  Eigen::internal::set_is_malloc_allowed(true);
  return {g_news, g_eigenMallocs};
}
template <typename F>
long allocationsOf(F&& f) {
  return countAllocations(std::forward<F>(f)).total();
}

}  // namespace

TEST_CASE("the counters see an allocation (the test can fail)", "[alloc]") {
  CHECK(allocationsOf([] { std::vector<int> v(100, 1); }) >= 1);
  CHECK(allocationsOf([] {
          Eigen::VectorXf v = Eigen::VectorXf::Ones(100);
          (void)v;
        }) >= 1);
  CHECK(allocationsOf([] {}) == 0);
  // The allocating entry point allocates its result.
  const Mat<float> q = randn<float>(3, 8, 1), k = randn<float>(5, 8, 2), v = randn<float>(5, 4, 3);
  CHECK(allocationsOf([&] { (void)sdpa::attentionForward(q, k, v); }) >= 2);
}

TEMPLATE_TEST_CASE("attentionForwardInto allocates nothing after the first call, decoding and float prefill", "[alloc]",
                   float, double) {
  using T = TestType;
  const OneThread one;
  const auto causal = sdpa::mask::Causal{Align::LowerRight};
  for (const Shape& s : {Shape{1, 5000, 64, 64}, Shape{3, 20000, 32, 16}, Shape{16, 3000, 64, 40},
                         Shape{300, 300, 64, 64}, Shape{129, 700, 16, 24}}) {
    INFO(toString(s));
    const Mat<T> q = randn<T>(s.nQ, s.dK, 1), k = randn<T>(s.nK, s.dK, 2), v = randn<T>(s.nK, s.dV, 3);
    Mat<T> out(s.nQ, s.dV);
    Vec<T> lse(s.nQ);
    const auto call = [&] { sdpa::attentionForwardInto(q, k, v, out, lse, sdpa::scale::InvSqrtDk{}, causal); };
    call();
    // Double prefill is the documented exception: its tile products are Eigen's, whose packing
    // workspace is a heap block per product where it exceeds Eigen's stack limit (128 KiB).
    const bool eigenProducts = std::is_same_v<T, double> && s.nQ > 4;
    const Allocations a = countAllocations(call);
    INFO("operator new " << a.news << ", Eigen " << a.eigen);
    CHECK(a.news == (kHeapCountsEigen ? a.eigen : 0));  // Eigen's, and no other
    if (!eigenProducts) CHECK(a.eigen == 0);
    const auto expected = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, causal);
    CHECK(out == expected.output);
    CHECK(lse == expected.logSumExp);
    // Blocks of larger matrices are written in place.
    Mat<T> wide = Mat<T>::Zero(s.nQ + 2, s.dV + 3);
    Mat<T> lses = Mat<T>::Zero(s.nQ, 2);
    const auto intoBlocks = [&] {
      sdpa::attentionForwardInto(q, k, v, wide.block(1, 2, s.nQ, s.dV), lses.col(1), sdpa::scale::InvSqrtDk{}, causal);
    };
    intoBlocks();
    const Allocations b = countAllocations(intoBlocks);
    CHECK(b.news == (kHeapCountsEigen ? b.eigen : 0));
    if (!eigenProducts) CHECK(b.eigen == 0);
    CHECK(wide.block(1, 2, s.nQ, s.dV) == expected.output);
    CHECK(lses.col(1) == expected.logSumExp);
  }
}

TEST_CASE("multi-head, GQA and batched calls into sized outputs allocate nothing after the first", "[alloc]") {
  const OneThread one;
  const Index H = 8, Hkv = 2, dK = 64, dV = 64;
  SECTION("GQA decoding, one query row per head") {
    const Mat<float> q = randn<float>(1, H * dK, 4), k = randn<float>(9000, Hkv * dK, 5),
                     v = randn<float>(9000, Hkv * dV, 6);
    Mat<float> out(1, H * dV), lse(1, H);
    const auto call = [&] { sdpa::multiHeadAttentionForwardInto(q, k, v, Heads{H, Hkv}, out, lse); };
    call();
    CHECK(allocationsOf(call) == 0);
    CHECK(out == sdpa::multiHeadAttentionForward(q, k, v, Heads{H, Hkv}).output);
  }
  SECTION("a padded batch, prefill, ALiBi") {
    const sdpa::BatchLayout layout = sdpa::BatchLayout::padded(3, 70, 90, {70, 41, 5}, {90, 60, 7});
    const Mat<float> q = randn<float>(210, H * dK, 7), k = randn<float>(270, Hkv * dK, 8),
                     v = randn<float>(270, Hkv * dV, 9);
    const sdpa::mask::Alibi alibi = sdpa::mask::Alibi::standard(H, Align::LowerRight);
    Mat<float> out(210, H * dV), lse(210, H);
    const auto call = [&] {
      sdpa::batchedAttentionForwardInto(q, k, v, layout, Heads{H, Hkv}, out, lse, sdpa::scale::InvSqrtDk{}, alibi);
    };
    call();
    CHECK(allocationsOf(call) == 0);
    const auto expected =
        sdpa::batchedAttentionForward(q, k, v, layout, Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, alibi);
    CHECK(out == expected.output);
    CHECK(lse == expected.logSumExp);
  }
}

TEMPLATE_TEST_CASE("row-major inputs are read in place: no copy, no allocation after the first call", "[alloc]", float,
                   Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const OneThread one;
  const Index H = 4, Hkv = 2, d = 32;
  for (const Index nQ : {Index(1), Index(150)}) {
    INFO("n_q " << nQ);
    const RowMat q = randn<float>(nQ, H * d, 1).cast<T>(), k = randn<float>(2000, Hkv * d, 2).cast<T>(),
                 v = randn<float>(2000, Hkv * d, 3).cast<T>();
    // As numpy or PyTorch hand their buffers over.
    const Eigen::Map<const RowMat> qm(q.data(), q.rows(), q.cols()), km(k.data(), k.rows(), k.cols()),
        vm(v.data(), v.rows(), v.cols());
    Mat<float> out(nQ, H * d), lse(nQ, H);
    const auto call = [&] { sdpa::multiHeadAttentionForwardInto(qm, km, vm, Heads{H, Hkv}, out, lse); };
    call();
    CHECK(allocationsOf(call) == 0);  // a copy of any of them would allocate
    const Mat<T> qc = q, kc = k, vc = v;
    const auto col = sdpa::multiHeadAttentionForward<float>(qc, kc, vc, Heads{H, Hkv});
    CHECK(maxAbsDiff(out, col.output) <= 1e-5);
    // A mix of storage orders (q and v row by row, k column by column): each read in its own.
    const auto mixed = [&] { sdpa::multiHeadAttentionForwardInto(qm, kc, vm, Heads{H, Hkv}, out, lse); };
    mixed();
    CHECK(allocationsOf(mixed) == 0);
    CHECK(maxAbsDiff(out, col.output) <= 1e-5);
  }
}

TEMPLATE_TEST_CASE("half inputs into sized outputs allocate nothing after the first call", "[alloc][half]", Eigen::half,
                   Eigen::bfloat16) {
  using Hf = TestType;
  const OneThread one;
  for (const Shape& s : {Shape{1, 3000, 64, 64}, Shape{200, 260, 64, 32}}) {
    INFO(toString(s));
    const Mat<Hf> q = toHalf<Hf>(randn<float>(s.nQ, s.dK, 1)), k = toHalf<Hf>(randn<float>(s.nK, s.dK, 2)),
                  v = toHalf<Hf>(randn<float>(s.nK, s.dV, 3));
    Mat<float> out(s.nQ, s.dV);
    Vec<float> lse(s.nQ);
    for (const auto products : {sdpa::kernel::Products::Fp32, sdpa::kernel::Products::Bf16}) {
      const sdpa::kernel::Tiled kern{0, 0, products};
      const auto call = [&] { sdpa::attentionForwardInto(kern, q, k, v, out, lse); };
      call();
      CHECK(allocationsOf(call) == 0);
      CHECK(out == sdpa::attentionForward<float>(kern, q, k, v).output);
    }
  }
}

TEST_CASE("Into calls check the outputs' shapes and name them", "[alloc][errors]") {
  const Mat<float> q = randn<float>(3, 8, 1), k = randn<float>(5, 8, 2), v = randn<float>(5, 4, 3);
  Mat<float> out(3, 5);
  Vec<float> lse(3);
  CHECK_THROWS_WITH(sdpa::attentionForwardInto(q, k, v, out, lse),
                    Catch::Matchers::Contains("out is 3x5 but must be 3x4"));
  Mat<float> out2(3, 4);
  Vec<float> lse2(2);
  CHECK_THROWS_WITH(sdpa::attentionForwardInto(q, k, v, out2, lse2),
                    Catch::Matchers::Contains("logSumExp is 2x1 but must be 3x1"));
  Mat<float> lseH(3, 1);
  CHECK_THROWS_WITH(sdpa::multiHeadAttentionForwardInto(q, k, v, Heads{2}, out2, lseH),
                    Catch::Matchers::Contains("logSumExp is 3x1 but must be 3x2"));
}

TEST_CASE("Into calls compute what the allocating calls do: every kernel, LogN, half outputs", "[alloc]") {
  const Mat<float> q = randn<float>(37, 16, 11), k = randn<float>(53, 16, 12), v = randn<float>(53, 8, 13);
  const auto causal = sdpa::mask::Causal{Align::LowerRight};
  forEachKernel([&](const auto& kern, const char* name) {
    INFO("kernel " << name);
    Mat<float> out(37, 8);
    Vec<float> lse(37);
    sdpa::attentionForwardInto(kern, q, k, v, out, lse, sdpa::scale::LogN{}, causal);
    const auto expected = sdpa::attentionForward(kern, q, k, v, sdpa::scale::LogN{}, causal);
    CHECK(out == expected.output);
    CHECK(lse == expected.logSumExp);
    Mat<float> outH(37, 2 * 4), lseH(37, 2);
    sdpa::multiHeadAttentionForwardInto(kern, q, k, v, Heads{2}, outH, lseH, sdpa::scale::InvSqrtDk{}, causal);
    CHECK(outH == sdpa::multiHeadAttentionForward(kern, q, k, v, Heads{2}, sdpa::scale::InvSqrtDk{}, causal).output);
  });
  // A half output from half inputs (the float result rounded once).
  const Mat<Eigen::bfloat16> qb = toHalf<Eigen::bfloat16>(q), kb = toHalf<Eigen::bfloat16>(k),
                             vb = toHalf<Eigen::bfloat16>(v);
  Mat<Eigen::bfloat16> outB(37, 8);
  Vec<float> lseB(37);
  sdpa::attentionForwardInto(qb, kb, vb, outB, lseB, sdpa::scale::LogN{}, causal);
  CHECK(outB == sdpa::attentionForward(qb, kb, vb, sdpa::scale::LogN{}, causal).output);
}

TEST_CASE("backward into sized gradients: what the allocating backward computes, and no allocation after the first",
          "[alloc][backward]") {
  const OneThread one;
  const auto causal = sdpa::mask::Causal{Align::LowerRight};
  SECTION("single head, every kernel, Learnable and LogN accumulate as attentionBackward does") {
    const Mat<float> q = randn<float>(37, 16, 21), k = randn<float>(53, 16, 22), v = randn<float>(53, 8, 23),
                     dO = randn<float>(37, 8, 24);
    forEachKernel([&](const auto& kern, const char* name) {
      INFO("kernel " << name);
      sdpa::scale::LogN logN, logNRef;
      const auto fwd = sdpa::attentionForward(kern, q, k, v, logN, causal);
      Mat<float> dq(37, 16), dk(53, 16), dv(53, 8);
      const float dc =
          sdpa::attentionBackwardInto(kern, q, k, v, fwd.output, fwd.logSumExp, dO, dq, dk, dv, logN, causal);
      const auto g = sdpa::attentionBackward(kern, q, k, v, fwd, dO, logNRef, causal);
      CHECK(dq == g.dq);
      CHECK(dk == g.dk);
      CHECK(dv == g.dv);
      CHECK(dc == g.dscale);
      CHECK(logN.grad() == logNRef.grad());
    });
  }
  SECTION("GQA, a padded batch: the packed gradients and dscale per head") {
    const Index H = 4, Hkv = 2, dK = 32, dV = 32;
    const sdpa::BatchLayout layout = sdpa::BatchLayout::padded(2, 150, 170, {150, 90}, {170, 100});
    const Mat<float> q = randn<float>(300, H * dK, 31), k = randn<float>(340, Hkv * dK, 32),
                     v = randn<float>(340, Hkv * dV, 33), dO = randn<float>(300, H * dV, 34);
    Mat<float> out(300, H * dV), lse(300, H), dq(300, H * dK), dk(340, Hkv * dK), dv(340, Hkv * dV);
    Vec<float> dscale(H);
    sdpa::scale::PerHead<sdpa::scale::Learnable<float>> taus(H), tausRef(H);
    const auto step = [&] {
      sdpa::batchedAttentionForwardInto(q, k, v, layout, Heads{H, Hkv}, out, lse, taus, causal);
      sdpa::batchedAttentionBackwardInto(sdpa::kernel::Tiled{}, q, k, v, out, lse, dO, layout, Heads{H, Hkv}, dq, dk,
                                         dv, dscale, taus, causal);
    };
    step();
    // d_k 32 and tiles of 128 x 256: every product's packing fits Eigen's stack limit.
    const Allocations a = countAllocations(step);
    INFO("operator new " << a.news << ", Eigen " << a.eigen);
    CHECK(a.total() == 0);
    const auto fwd = sdpa::batchedAttentionForward(q, k, v, layout, Heads{H, Hkv}, tausRef, causal);
    const auto g = sdpa::batchedAttentionBackward(q, k, v, fwd, dO, layout, Heads{H, Hkv}, tausRef, causal);
    CHECK(dq == g.dq);
    CHECK(dk == g.dk);
    CHECK(dv == g.dv);
    CHECK(dscale == g.dscale);
    for (Index h = 0; h < H; ++h) CHECK(taus.head(h).grad() == 2 * tausRef.head(h).grad());  // two steps
  }
  SECTION("multi-head: the packed gradients of multiHeadAttentionBackward, a PerHead LogN accumulating per head") {
    const Mat<float> q = randn<float>(29, 2 * 16, 41), k = randn<float>(45, 16, 42), v = randn<float>(45, 8, 43),
                     dO = randn<float>(29, 2 * 8, 44);
    sdpa::scale::PerHead<sdpa::scale::LogN> logN(2), logNRef(2);
    const auto fwd = sdpa::multiHeadAttentionForward(q, k, v, Heads{2, 1}, logN, causal);
    Mat<float> dq(29, 32), dk(45, 16), dv(45, 8);
    Vec<float> dscale(2);
    sdpa::multiHeadAttentionBackwardInto(sdpa::kernel::Tiled{}, q, k, v, fwd.output, fwd.logSumExp, dO, Heads{2, 1}, dq,
                                         dk, dv, dscale, logN, causal);
    const auto g = sdpa::multiHeadAttentionBackward(q, k, v, fwd, dO, Heads{2, 1}, logNRef, causal);
    CHECK(dq == g.dq);
    CHECK(dk == g.dk);
    CHECK(dv == g.dv);
    CHECK(dscale == g.dscale);
    for (Index h = 0; h < 2; ++h) CHECK(logN.head(h).grad() == logNRef.head(h).grad());
  }
  SECTION("the forward's output and logSumExp are only checked: row-major ones are not copied") {
    const Mat<float> q = randn<float>(40, 16, 51), k = randn<float>(60, 16, 52), v = randn<float>(60, 16, 53),
                     dO = randn<float>(40, 16, 54);
    const auto fwd = sdpa::attentionForward(q, k, v);
    const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> outRows = fwd.output;
    Mat<float> dq(40, 16), dk(60, 16), dv(60, 16);
    const auto call = [&] {
      sdpa::attentionBackwardInto(q, k, v, outRows, fwd.logSumExp, dO, dq, dk, dv, sdpa::scale::InvSqrtDk{});
    };
    call();
    CHECK(allocationsOf(call) == 0);  // a copy of the 40 x 16 output would allocate
    const auto g = sdpa::attentionBackward(q, k, v, fwd, dO);
    CHECK(dq == g.dq);
    CHECK(dk == g.dk);
    CHECK(dv == g.dv);
  }
  SECTION("row-major q, k, v and dO are read in place: no copy, no allocation after the first call") {
    using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const RowMat q = randn<float>(40, 4 * 16, 61), k = randn<float>(200, 2 * 16, 62), v = randn<float>(200, 2 * 16, 63),
                 dO = randn<float>(40, 4 * 16, 64);
    const Eigen::Map<const RowMat> qm(q.data(), q.rows(), q.cols()), km(k.data(), k.rows(), k.cols()),
        vm(v.data(), v.rows(), v.cols()), dOm(dO.data(), dO.rows(), dO.cols());
    const auto fwd = sdpa::multiHeadAttentionForward(qm, km, vm, Heads{4, 2}, sdpa::scale::InvSqrtDk{}, causal);
    Mat<float> dq(40, 64), dk(200, 32), dv(200, 32);
    Vec<float> dscale(4);
    // Without dropout the fast kernel, with it the general tiles: both read the inputs in place.
    for (const double p : {0.0, 0.1}) {
      INFO("dropout " << p);
      const sdpa::Dropout dropout{p, 7};
      const auto call = [&] {
        sdpa::multiHeadAttentionBackwardInto(sdpa::kernel::Tiled{}, qm, km, vm, fwd.output, fwd.logSumExp, dOm,
                                             Heads{4, 2}, dq, dk, dv, dscale, sdpa::scale::InvSqrtDk{}, causal,
                                             dropout);
      };
      call();
      CHECK(allocationsOf(call) == 0);  // a copy of any input would allocate
      const Mat<float> qc = q, kc = k, vc = v, dOc = dO;
      const auto g = sdpa::multiHeadAttentionBackward(qc, kc, vc, fwd, dOc, Heads{4, 2}, sdpa::scale::InvSqrtDk{},
                                                      causal, dropout);
      // (The general tiles' products may sum in another order for row-major operands: a few
      // roundings of sums of at most 200 terms; test_backward.cpp holds both to the FlashAttention rule.)
      const double tol = p == 0 ? 0.0 : 64 * double(std::numeric_limits<float>::epsilon());
      CHECK(maxAbsDiff(dq, g.dq) <= tol * maxAbs(g.dq));
      CHECK(maxAbsDiff(dk, g.dk) <= tol * maxAbs(g.dk));
      CHECK(maxAbsDiff(dv, g.dv) <= tol * maxAbs(g.dv));
      // A mix of storage orders (q and v row by row, k and dO column by column): each read in
      // its own.
      const auto mixed = [&] {
        sdpa::multiHeadAttentionBackwardInto(sdpa::kernel::Tiled{}, qm, kc, vm, fwd.output, fwd.logSumExp, dOc,
                                             Heads{4, 2}, dq, dk, dv, dscale, sdpa::scale::InvSqrtDk{}, causal,
                                             dropout);
      };
      mixed();
      CHECK(allocationsOf(mixed) == 0);
      CHECK(maxAbsDiff(dq, g.dq) <= tol * maxAbs(g.dq));
      CHECK(maxAbsDiff(dk, g.dk) <= tol * maxAbs(g.dk));
      CHECK(maxAbsDiff(dv, g.dv) <= tol * maxAbs(g.dv));
    }
  }
  SECTION("the gradients' shapes are checked and named") {
    const Mat<float> q = randn<float>(3, 8, 1), k = randn<float>(5, 8, 2), v = randn<float>(5, 4, 3),
                     dO = randn<float>(3, 4, 4);
    const auto fwd = sdpa::attentionForward(q, k, v);
    Mat<float> dq(3, 8), dk(5, 7), dv(5, 4);
    CHECK_THROWS_WITH(
        sdpa::attentionBackwardInto(q, k, v, fwd.output, fwd.logSumExp, dO, dq, dk, dv, sdpa::scale::InvSqrtDk{}),
        Catch::Matchers::Contains("dk is 5x7 but must be 5x8"));
  }
}
