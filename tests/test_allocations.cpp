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
#define eigen_assert(x)                                                \
  do {                                                                 \
    if (!static_cast<bool>(x)) sdpaTestEigenAssert(#x, __FILE__, __LINE__); \
  } while (false)

#include <sdpa/sdpa.hpp>

#include "support/cases.hpp"

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

using namespace sdpa_test;
using sdpa::Heads;
using sdpa::mask::Align;

namespace {

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

/// One thread: which worker runs which unit then never changes from call to call (with several,
/// a worker's scratch grows on the first call it takes part in).
struct OneThread {
  int saved = Eigen::nbThreads();
  OneThread() { Eigen::setNbThreads(1); }
  ~OneThread() { Eigen::setNbThreads(saved); }
};

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

TEMPLATE_TEST_CASE("attentionForwardInto allocates nothing after the first call, decoding and float prefill",
                   "[alloc]", float, double) {
  using T = TestType;
  const OneThread one;
  const auto causal = sdpa::mask::Causal{Align::LowerRight};
  for (const Shape& s : {Shape{1, 5000, 64, 64}, Shape{3, 20000, 32, 16}, Shape{300, 300, 64, 64},
                         Shape{129, 700, 16, 24}}) {
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
    CHECK(a.news == 0);
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
    CHECK(b.news == 0);
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
    const auto expected = sdpa::batchedAttentionForward(q, k, v, layout, Heads{H, Hkv}, sdpa::scale::InvSqrtDk{}, alibi);
    CHECK(out == expected.output);
    CHECK(lse == expected.logSumExp);
  }
}

TEMPLATE_TEST_CASE("half inputs into sized outputs allocate nothing after the first call", "[alloc][half]",
                   Eigen::half, Eigen::bfloat16) {
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
