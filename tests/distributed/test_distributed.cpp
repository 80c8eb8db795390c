// Context parallelism (sdpa/distributed.hpp), run by ctest under mpirun -np 1..4. Every rank
// builds the whole sequence from fixed seeds, runs the distributed call on its slice, and checks
// its rows against the long-double oracle of tests/support/reference.hpp on the concatenated
// sequence (the FlashAttention rule: at most twice the error of the plain loop in the same
// precision), for ring attention and Ulysses, forward and backward.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>

#include <type_traits>

#include <sdpa/distributed.hpp>
#include <sdpa/sdpa.hpp>

#include "support/catch.hpp"
#include "support/reference.hpp"

namespace {

using namespace sdpa_test;
using sdpa::Heads;
using sdpa::distributed::Split;
namespace mask = sdpa::mask;
namespace scale = sdpa::scale;

int worldRank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int worldSize() {
  int p = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

/// Rows of a global matrix that a rank holds, in its local order.
template <typename T>
Mat<T> slice(const Mat<T>& global, const Split& split, int rank) {
  Mat<T> local(split.localRows(rank), global.cols());
  for (const auto& s : split.segments(rank)) local.middleRows(s.local, s.rows) = global.middleRows(s.global, s.rows);
  return local;
}

/// One test case: the global sequence and the oracle's results for every head, packed.
template <typename T>
struct Problem {
  Index nQ, nK, H, hKv, dK, dV;
  Mat<T> q, k, v, dO;
  double tau;
};

template <typename T>
Problem<T> makeProblem(Index nQ, Index nK, Index H, Index hKv, Index dK, Index dV, std::uint64_t seed,
                       double sd = 1.0) {
  return {nQ,
          nK,
          H,
          hKv,
          dK,
          dV,
          randn<T>(nQ, H * dK, seed, sd),
          randn<T>(nK, hKv * dK, seed + 1, sd),
          randn<T>(nK, hKv * dV, seed + 2),
          randn<T>(nQ, H * dV, seed + 3),
          1.0 / std::sqrt(double(dK))};
}

/// The oracle in precision R for every head of a problem, with the mask's own definition of
/// which keys a query sees and what it adds (its apply on a zero logit: ALiBi's term).
template <typename R, typename T, typename Mask>
struct Oracle {
  Mat<R> out, lse, dq, dk, dv;
  Vec<R> dscale;
  Oracle(const Problem<T>& p, const Mask& m, double softcap, bool backward) {
    out.setZero(p.nQ, p.H * p.dV);
    lse.setZero(p.nQ, p.H);
    dq.setZero(p.nQ, p.H * p.dK);
    dk.setZero(p.nK, p.hKv * p.dK);
    dv.setZero(p.nK, p.hKv * p.dV);
    dscale.setZero(p.H);
    const Index group = p.H / p.hKv;
    for (Index h = 0; h < p.H; ++h) {
      const Index g = h / group;
      const Mat<T> qh = p.q.middleCols(h * p.dK, p.dK), kh = p.k.middleCols(g * p.dK, p.dK),
                   vh = p.v.middleCols(g * p.dV, p.dV), dOh = p.dO.middleCols(h * p.dV, p.dV);
      const VisibleFn visible = [&](Index i, Index j) { return m.visible(i, j, p.nQ, p.nK, h); };
      const BiasFn bias = [&](Index i, Index j) {
        Eigen::Matrix<double, 1, 1> s;
        s(0, 0) = 0;
        m.apply(s, i, j, p.nQ, p.nK, h);
        return (long double)(s(0, 0));
      };
      const auto f = referenceAttention<R>(qh, kh, vh, p.tau, visible, bias, softcap);
      out.middleCols(h * p.dV, p.dV) = f.output;
      lse.col(h) = f.logSumExp;
      if (!backward) continue;
      const auto b = referenceBackward<R>(qh, kh, vh, dOh, p.tau, visible, bias, softcap);
      dq.middleCols(h * p.dK, p.dK) = b.dq;
      dk.middleCols(g * p.dK, p.dK) += b.dk;
      dv.middleCols(g * p.dV, p.dV) += b.dv;
      dscale(h) = b.dscale;
    }
  }
};

double finiteMaxAbs(const Mat<double>& m) {
  double s = 0;
  for (Index i = 0; i < m.size(); ++i)
    if (std::isfinite(m.data()[i])) s = std::max(s, std::abs(m.data()[i]));
  return s;
}

/// The FlashAttention rule for one result matrix (this rank's rows of it).
template <typename T, typename D>
void checkRule(const char* what, const Eigen::MatrixBase<D>& got, const Mat<long double>& goldAll,
               const Mat<T>& naiveAll, const Split& split, int rank, double logitScale) {
  const Mat<double> gold = slice<double>(goldAll.template cast<double>(), split, rank);
  const Mat<double> naive = slice<double>(naiveAll.template cast<double>(), split, rank);
  const double err = maxAbsDiff(got, gold), naiveErr = maxAbsDiff(naive, gold);
  INFO(what << " on rank " << rank << ": error " << err << ", plain loop's " << naiveErr);
  CHECK(err <= errorBound<T>(naiveErr, finiteMaxAbs(goldAll.template cast<double>()), logitScale));
}

enum class Route { Ring, Ulysses };

/// One split of one problem and mask against its oracles (gold: long double; naive: the plain
/// loop in T), which do not depend on the split.
template <typename T, typename Mask>
void checkCase(Route route, const Problem<T>& p, const Split& qs, const Split& ks, const Mask& m,
               const Oracle<long double, T, Mask>& gold, const Oracle<T, T, Mask>& naive, bool backward) {
  const int rank = worldRank();
  const Mat<T> q = slice(p.q, qs, rank), k = slice(p.k, ks, rank), v = slice(p.v, ks, rank), dO = slice(p.dO, qs, rank);
  const Heads heads{p.H, p.hKv};
  const double lseScale = finiteMaxAbs(gold.lse.template cast<double>());
  const auto fwd =
      route == Route::Ring
          ? sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, q, k, v, heads, qs, ks, scale::InvSqrtDk{}, m)
          : sdpa::distributed::ulyssesAttentionForward(MPI_COMM_WORLD, q, k, v, heads, qs, ks, scale::InvSqrtDk{}, m);
  REQUIRE(fwd.output.rows() == q.rows());
  REQUIRE(fwd.output.cols() == p.H * p.dV);
  checkRule<T>("output", fwd.output, gold.out, naive.out, qs, rank, lseScale);
  checkRule<T>("logSumExp", fwd.logSumExp, gold.lse, naive.lse, qs, rank, lseScale);
  // Fully masked rows: output exactly 0, logSumExp -inf, as in one process.
  const Mat<double> goldLse = slice<double>(gold.lse.template cast<double>(), qs, rank);
  for (Index i = 0; i < goldLse.rows(); ++i)
    for (Index h = 0; h < p.H; ++h)
      if (goldLse(i, h) == -std::numeric_limits<double>::infinity()) {
        CHECK(fwd.logSumExp(i, h) == -std::numeric_limits<T>::infinity());
        CHECK((fwd.output.block(i, h * p.dV, 1, p.dV).array() == T(0)).all());
      }
  if (!backward) return;
  scale::InvSqrtDk tau;
  const auto g = route == Route::Ring
                     ? sdpa::distributed::ringAttentionBackward(MPI_COMM_WORLD, q, k, v, dO, heads, qs, ks, tau, m)
                     : sdpa::distributed::ulyssesAttentionBackward(MPI_COMM_WORLD, q, k, v, dO, heads, qs, ks, tau, m);
  CHECK(g.dq.allFinite());
  CHECK(g.dk.allFinite());
  CHECK(g.dv.allFinite());
  double scaleG = 0;
  for (const auto* x : {&gold.dq, &gold.dk, &gold.dv})
    scaleG = std::max(scaleG, finiteMaxAbs(x->template cast<double>()));
  // Gradients: the rule with the largest gradient as the scale of the floor (as test_backward).
  const auto rule = [&](const char* what, const auto& got, const Mat<long double>& goldAll, const Mat<T>& naiveAll,
                        const Split& split) {
    const Mat<double> gd = slice<double>(goldAll.template cast<double>(), split, rank);
    const Mat<double> nv = slice<double>(naiveAll.template cast<double>(), split, rank);
    const double err = maxAbsDiff(got, gd), naiveErr = maxAbsDiff(nv, gd);
    INFO(what << " on rank " << rank << ": error " << err << ", plain loop's " << naiveErr);
    CHECK(err <= errorBound<T>(naiveErr, scaleG, lseScale));
  };
  rule("dq", g.dq, gold.dq, naive.dq, qs);
  rule("dk", g.dk, gold.dk, naive.dk, ks);
  rule("dv", g.dv, gold.dv, naive.dv, ks);
  const double errS = maxAbsDiff(g.dscale, gold.dscale.template cast<double>()),
               naiveS = maxAbsDiff(naive.dscale.template cast<double>(), gold.dscale.template cast<double>());
  INFO("dscale: error " << errS << ", plain loop's " << naiveS);
  CHECK(errS <= errorBound<T>(naiveS, std::max(scaleG, maxAbs(gold.dscale.template cast<double>())), lseScale));
}

/// The splits every case runs over: even, uneven with an empty rank, zigzag.
std::vector<std::pair<std::string, Split>> splitsOf(Index rows) {
  const int P = worldSize();
  std::vector<Index> uneven;
  for (int r = 0; r < P; ++r) uneven.push_back(r == P - 1 && P > 1 ? 0 : (r + 1) * rows / P - r * rows / P);
  Index assigned = 0;
  for (Index n : uneven) assigned += n;
  uneven[0] += rows - assigned;  // the first rank takes the last rank's rows: one rank holds none
  return {
      {"contiguous", Split::contiguous(rows, P)}, {"uneven", Split::sizes(uneven)}, {"zigzag", Split::zigzag(rows, P)}};
}

template <typename T, typename F>
void forEachMask(Index nQ, Index nK, Index H, F&& f) {
  using mask::Align;
  f("none", mask::None{}, 0.0);
  f("causal upper-left", mask::Causal{Align::UpperLeft}, 0.0);
  f("causal lower-right", mask::Causal{Align::LowerRight}, 0.0);
  f("sliding window 9 lower-right", mask::SlidingWindow{9, 0, Align::LowerRight}, 0.0);
  f("ALiBi + causal", mask::combine(mask::Causal{Align::UpperLeft}, mask::Alibi::standard(H, Align::UpperLeft)), 0.0);
  f("softcap 3 + causal", mask::combine(mask::Softcap{3}, mask::Causal{Align::LowerRight}), 3.0);
  f("key length", mask::KeyLength{nK - 5}, 0.0);
  (void)nQ;
}

template <typename T>
void runMatrix(Route route, bool backward, Index nQ, Index nK, Index H, Index hKv, std::uint64_t seed) {
  const Problem<T> p = makeProblem<T>(nQ, nK, H, hKv, 8, 6, seed);
  const auto qSplits = splitsOf(nQ), kSplits = splitsOf(nK);
  forEachMask<T>(nQ, nK, H, [&](const char* maskName, const auto& m, double cap) {
    // The oracles once per mask for the three splits: every rank computes them whole, and
    // recomputed per split they were most of a rank's time (the 4-rank run 35 -> 16 s under ASan).
    using Mask = std::decay_t<decltype(m)>;
    const Oracle<long double, T, Mask> gold(p, m, cap, backward);
    const Oracle<T, T, Mask> naive(p, m, cap, backward);
    for (size_t i = 0; i < qSplits.size(); ++i) {  // the same kind of split for queries and keys
      INFO("P " << worldSize() << ", " << qSplits[i].first << " split, mask " << maskName << ", n_q " << nQ << ", n_k "
                << nK << ", Heads{" << H << ", " << hKv << "}");
      checkCase<T>(route, p, qSplits[i].second, kSplits[i].second, m, gold, naive, backward);
    }
  });
}

}  // namespace

TEST_CASE("ring attention equals one process's attention: forward and backward, every mask and split",
          "[distributed]") {
  SECTION("float, GQA 4/2, square") { runMatrix<float>(Route::Ring, true, 37, 37, 4, 2, 11); }
  SECTION("double, MHA 2, n_k > n_q (keys before the queries)") {
    runMatrix<double>(Route::Ring, true, 23, 41, 2, 2, 12);
  }
  SECTION("float, MQA 4/1, n_q > n_k (first rows fully masked under lower-right causal)") {
    runMatrix<float>(Route::Ring, true, 30, 19, 4, 1, 13);
  }
}

TEST_CASE("Ulysses equals one process's attention: forward and backward, every mask and split", "[distributed]") {
  const Index P = worldSize();
  SECTION("float, GQA") { runMatrix<float>(Route::Ulysses, true, 37, 37, 4 * P, 2 * P, 21); }
  SECTION("double, n_k > n_q") { runMatrix<double>(Route::Ulysses, true, 23, 41, 2 * P, P, 22); }
}

TEST_CASE("a learnable scale gets the sum of every rank's dL/dtau, on every rank", "[distributed]") {
  const int rank = worldRank(), P = worldSize();
  const Problem<double> p = makeProblem<double>(29, 29, 2 * P, P, 8, 8, 31);
  const Split split = Split::zigzag(29, P);
  const mask::Causal m{mask::Align::LowerRight};
  const Oracle<long double, double, mask::Causal> gold(p, m, 0, true);
  const Mat<double> q = slice(p.q, split, rank), k = slice(p.k, split, rank), v = slice(p.v, split, rank),
                    dO = slice(p.dO, split, rank);
  const double want = double(gold.dscale.sum());
  for (bool ulysses : {false, true}) {
    auto tau = scale::Learnable<double>::forHeadDim(8);
    const auto g = ulysses ? sdpa::distributed::ulyssesAttentionBackward(MPI_COMM_WORLD, q, k, v, dO, Heads{2 * P, P},
                                                                         split, split, tau, m)
                           : sdpa::distributed::ringAttentionBackward(MPI_COMM_WORLD, q, k, v, dO, Heads{2 * P, P},
                                                                      split, split, tau, m);
    INFO((ulysses ? "Ulysses" : "ring") << ": dL/dtau " << tau.grad() << ", oracle " << want);
    CHECK(std::abs(double(tau.grad()) - want) <= 1e-12 * std::max(1.0, std::abs(want)));
    CHECK(maxAbsDiff(g.dscale, gold.dscale.cast<double>()) <=
          1e-12 * std::max(1.0, maxAbs(gold.dscale.cast<double>())));
  }
}

TEST_CASE("row-major inputs (numpy's, PyTorch's) give the column-major call's results on every rank", "[distributed]") {
  // q and dO are read in place in either order (k and v are packed to travel either way): the
  // fast kernels read either order with the same arithmetic, so the same bits.
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const int rank = worldRank(), P = worldSize();
  const Problem<float> p = makeProblem<float>(70, 70, 2 * P, P, 16, 16, 37);
  const Split split = Split::zigzag(70, P);
  const mask::Causal m{mask::Align::LowerRight};
  const Mat<float> q = slice(p.q, split, rank), k = slice(p.k, split, rank), v = slice(p.v, split, rank),
                   dO = slice(p.dO, split, rank);
  const RowMat qr = q, kr = k, vr = v, dOr = dO;
  const Heads heads{2 * P, P};
  const auto fwd = sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, q, k, v, heads, split, split,
                                                           sdpa::scale::InvSqrtDk{}, m);
  const auto fwdRows = sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, qr, kr, vr, heads, split, split,
                                                               sdpa::scale::InvSqrtDk{}, m);
  CHECK(fwdRows.output == fwd.output);
  CHECK(fwdRows.logSumExp == fwd.logSumExp);
  const auto g = sdpa::distributed::ringAttentionBackward(MPI_COMM_WORLD, q, k, v, dO, heads, split, split,
                                                          sdpa::scale::InvSqrtDk{}, m);
  const auto gRows = sdpa::distributed::ringAttentionBackward(MPI_COMM_WORLD, qr, kr, vr, dOr, heads, split, split,
                                                              sdpa::scale::InvSqrtDk{}, m);
  CHECK(gRows.dq == g.dq);
  CHECK(gRows.dk == g.dk);
  CHECK(gRows.dv == g.dv);
  CHECK(gRows.dscale == g.dscale);
}

TEST_CASE("per-head scales follow their heads to the rank that computes them", "[distributed]") {
  const int rank = worldRank(), P = worldSize();
  const Index H = 2 * P;
  const Problem<double> p = makeProblem<double>(26, 26, H, H, 8, 8, 41);
  std::vector<double> taus;
  for (Index h = 0; h < H; ++h) taus.push_back(0.1 + 0.05 * double(h));
  const auto perHead = scale::PerHead<scale::Constant>::constants(taus);
  const auto m = mask::combine(mask::Causal{mask::Align::UpperLeft}, mask::Alibi::standard(H, mask::Align::UpperLeft));
  const auto whole = sdpa::multiHeadAttentionForward(p.q, p.k, p.v, Heads{H}, perHead, m);
  const auto wholeG = sdpa::multiHeadAttentionBackward(p.q, p.k, p.v, whole, p.dO, Heads{H}, perHead, m);
  const Split split = Split::contiguous(26, P);
  const Mat<double> q = slice(p.q, split, rank), k = slice(p.k, split, rank), v = slice(p.v, split, rank),
                    dO = slice(p.dO, split, rank);
  for (bool ulysses : {false, true}) {
    INFO((ulysses ? "Ulysses" : "ring"));
    const auto f =
        ulysses
            ? sdpa::distributed::ulyssesAttentionForward(MPI_COMM_WORLD, q, k, v, Heads{H}, split, split, perHead, m)
            : sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, q, k, v, Heads{H}, split, split, perHead, m);
    CHECK(maxAbsDiff(f.output, slice<double>(whole.output, split, rank)) <= 1e-13);
    const auto g = ulysses ? sdpa::distributed::ulyssesAttentionBackward(MPI_COMM_WORLD, q, k, v, dO, Heads{H}, split,
                                                                         split, perHead, m)
                           : sdpa::distributed::ringAttentionBackward(MPI_COMM_WORLD, q, k, v, dO, Heads{H}, split,
                                                                      split, perHead, m);
    CHECK(maxAbsDiff(g.dq, slice<double>(wholeG.dq, split, rank)) <= 1e-12);
    CHECK(maxAbsDiff(g.dk, slice<double>(wholeG.dk, split, rank)) <= 1e-12);
    CHECK(maxAbsDiff(g.dscale, wholeG.dscale) <= 1e-12);
  }
}

TEST_CASE("NaN in keys the mask hides never reaches any rank's output or gradient", "[distributed]") {
  const int rank = worldRank(), P = worldSize();
  Problem<float> p = makeProblem<float>(33, 33, 2, 2, 8, 8, 51);
  const auto m = mask::combine(mask::Causal{mask::Align::UpperLeft}, mask::KeyLength{27});
  const Oracle<long double, float, decltype(m)> gold(p, m, 0, true);
  const Oracle<float, float, decltype(m)> naive(p, m, 0, true);
  const double lseScale = finiteMaxAbs(gold.lse.cast<double>());
  // Keys 27..32 are hidden from every query: NaN in them, on whichever rank holds them.
  p.k.bottomRows(6).setConstant(std::numeric_limits<float>::quiet_NaN());
  p.v.bottomRows(6).setConstant(std::numeric_limits<float>::quiet_NaN());
  for (const auto& [name, split] : splitsOf(33)) {
    INFO(name << " split");
    const Mat<float> q = slice(p.q, split, rank), k = slice(p.k, split, rank), v = slice(p.v, split, rank),
                     dO = slice(p.dO, split, rank);
    for (bool ulysses : {false, true}) {
      if (ulysses && 2 % P != 0) continue;
      const auto f = ulysses ? sdpa::distributed::ulyssesAttentionForward(MPI_COMM_WORLD, q, k, v, Heads{2}, split,
                                                                          split, scale::InvSqrtDk{}, m)
                             : sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, q, k, v, Heads{2}, split, split,
                                                                       scale::InvSqrtDk{}, m);
      CHECK(f.output.allFinite());
      checkRule<float>("output", f.output, gold.out, naive.out, split, rank, lseScale);
      const auto g = ulysses ? sdpa::distributed::ulyssesAttentionBackward(MPI_COMM_WORLD, q, k, v, dO, Heads{2}, split,
                                                                           split, scale::InvSqrtDk{}, m)
                             : sdpa::distributed::ringAttentionBackward(MPI_COMM_WORLD, q, k, v, dO, Heads{2}, split,
                                                                        split, scale::InvSqrtDk{}, m);
      // Finite everywhere; the hidden keys' own gradients are the oracle's 0 (they took no weight).
      CHECK(g.dq.allFinite());
      CHECK(g.dk.allFinite());
      CHECK(g.dv.allFinite());
      checkRule<float>("dq", g.dq, gold.dq, naive.dq, split, rank, lseScale);
      checkRule<float>("dk", g.dk, gold.dk, naive.dk, split, rank, lseScale);
      checkRule<float>("dv", g.dv, gold.dv, naive.dv, split, rank, lseScale);
    }
  }
}

TEST_CASE("bad input on one rank is the same clear error on every rank", "[distributed][errors]") {
  const int rank = worldRank(), P = worldSize();
  const Problem<float> p = makeProblem<float>(20, 20, 2 * P, 2 * P, 4, 4, 61);
  const Split split = Split::contiguous(20, P);
  Mat<float> q = slice(p.q, split, rank), k = slice(p.k, split, rank), v = slice(p.v, split, rank);
  const Heads heads{2 * P};
  SECTION("one rank's q has a row too many") {
    Mat<float> bad = rank == P - 1 ? Mat<float>(Mat<float>::Zero(q.rows() + 1, q.cols())) : q;
    const std::string want = "sdpa::distributed::ringAttentionForward: on rank " + std::to_string(P - 1) + " of " +
                             std::to_string(P) + ": q is " + std::to_string(q.rows() + (rank == P - 1 ? 1 : 0));
    try {
      (void)sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, bad, k, v, heads, split, split);
      FAIL("no exception");
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("on rank " + std::to_string(P - 1) + " of " + std::to_string(P) + ": q is ") !=
            std::string::npos);
      CHECK(what.find("but the query split gives this rank") != std::string::npos);
    }
  }
  SECTION("the ranks disagree on the head count") {
    const Index h = rank == 0 ? 2 * P : P;  // the same d_k * H columns, read as other heads
    const Index hv = h;
    if (P > 1) {
      Mat<float> q2 = Mat<float>::Zero(q.rows(), h * 4), k2 = Mat<float>::Zero(k.rows(), hv * 4),
                 v2 = Mat<float>::Zero(v.rows(), hv * 4);
      CHECK_THROWS_WITH(sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, q2, k2, v2, Heads{h, hv}, split, split),
                        Catch::Contains("the ranks disagree on the query heads H"));
    }
  }
  SECTION("a split for another number of ranks") {
    const Split wrong = Split::contiguous(20, P + 1);
    CHECK_THROWS_WITH(sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, q, k, v, heads, wrong, wrong),
                      Catch::Contains("the communicator has " + std::to_string(P)));
  }
  SECTION("Ulysses needs heads that shard over the ranks") {
    if (P > 1) {
      const Mat<float> q1 = q.leftCols(4), k1 = k.leftCols(4), v1 = v.leftCols(4);
      CHECK_THROWS_WITH(sdpa::distributed::ulyssesAttentionForward(MPI_COMM_WORLD, q1, k1, v1, Heads{1}, split, split),
                        Catch::Contains("do not shard over " + std::to_string(P) + " ranks"));
    }
  }
  SECTION("a mask that does not fit the whole sequence") {
    CHECK_THROWS_WITH(sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, q, k, v, heads, split, split,
                                                              scale::InvSqrtDk{}, mask::KeyLength{21}),
                      Catch::Contains("KeyLength{21} is outside [0, n_k = 20]"));
  }
  SECTION("Split factories reject bad arguments") {
    CHECK_THROWS_WITH(Split::contiguous(-1, 2), Catch::Contains("need rows >= 0 and ranks >= 1"));
    CHECK_THROWS_WITH(Split::sizes({3, -1}), Catch::Contains("negative"));
  }
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);  // sdpa calls MPI from this thread only
  const int failed = Catch::Session().run(argc, argv);
  int worst = 0;
  MPI_Allreduce(&failed, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
