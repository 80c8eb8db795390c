// libFuzzer harness: decodes a shape, values (huge, tiny, denormal, inf, NaN among ordinary
// ones), a scale policy, a mask, a head layout and a kernel from the input, runs sdpa's forward
// (single-head, multi-head, batched) and backward passes in float and double, and checks them
// against the long-double oracle of tests/support/reference.hpp:
//
// - a row that the plain loop in the same precision computes finitely must come out finite from
//   every kernel, within the FlashAttention rule (2x the plain loop's error + 8 ulps of the row);
// - a fully masked row gives exactly 0 and logSumExp -inf;
// - a row the plain loop cannot compute (overflow, NaN or inf it can see) may be anything, but
//   the other rows may not change: special values stay in their rows;
// - the tiled backward agrees with the naive backward as in tests/test_tiled.cpp, whenever the
//   naive one is finite.
//
// Built with clang -fsanitize=fuzzer,address,undefined as `fuzz_attention` by the `fuzz` preset,
// whose test replays the committed corpus (tests/fuzz/corpus). A failed check prints the case
// and aborts, which libFuzzer reports as a crash with the input saved.
#include <sdpa/sdpa.hpp>

#include <support/reference.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

using sdpa_test::BiasFn;
using sdpa_test::Index;
using sdpa_test::Mat;
using sdpa_test::VisibleFn;

/// Reads the fuzz input front to back; past its end every read returns 0.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : m_data(data), m_size(size) {}
  uint8_t byte() { return m_pos < m_size ? m_data[m_pos++] : 0; }
  int below(int n) { return byte() % n; }
  /// An input value: mostly ordinary numbers in [-4, 4), sometimes an extreme or special one.
  double value() {
    const uint8_t c = byte();
    switch (c) {
      case 240:
        return std::numeric_limits<double>::infinity();
      case 241:
        return -std::numeric_limits<double>::infinity();
      case 242:
        return std::numeric_limits<double>::quiet_NaN();
      case 243:
        return 1e30;
      case 244:
        return -1e30;
      case 245:
        return 1e-30;
      case 246:
        return 1e-40;  // a float denormal
      case 247:
        return 88.8;  // just past fp32's exp limit
      case 248:
        return 1e4;
      case 249:
        return -1e4;
      case 250:
        return 3.0e38;  // near FLT_MAX
      case 251:
        return 0.0;
      default:
        return (double(c) * 256.0 + double(byte())) / 8192.0 - 4.0;
    }
  }

 private:
  const uint8_t* m_data;
  size_t m_size;
  size_t m_pos = 0;
};

[[noreturn]] void fail(const std::string& what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_attention: %s: %s\n", what.c_str(), detail.c_str());
  std::abort();
}

/// What the fuzz input asks for, independent of the scalar type.
struct Case {
  Index nQ = 0, nK = 0, dK = 0, dV = 0;
  int maskKind = 0, scaleKind = 0, kernelKind = 0;
  Index window = 0, keyLength = 0, blockQ = 1, blockK = 1;
  double scaleParam = 1, softcap = 1;
  double magnitude = 1;  // q and the bias are multiplied by it: large logits (read last, so 1 for old inputs)
  Mat<double> q, k, v, bias;
  Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic> keep;
  std::string describe() const {
    return "n_q " + std::to_string(nQ) + ", n_k " + std::to_string(nK) + ", d_k " + std::to_string(dK) + ", d_v " +
           std::to_string(dV) + ", mask " + std::to_string(maskKind) + ", scale " + std::to_string(scaleKind) + " (" +
           std::to_string(scaleParam) + "), kernel " + std::to_string(kernelKind) + " (" + std::to_string(blockQ) +
           "x" + std::to_string(blockK) + "), magnitude " + std::to_string(magnitude);
  }
};

Mat<double> values(Bytes& in, Index rows, Index cols) {
  Mat<double> m(rows, cols);
  for (Index c = 0; c < cols; ++c)
    for (Index r = 0; r < rows; ++r) m(r, c) = in.value();
  return m;
}

Case decode(Bytes& in) {
  Case c;
  c.nQ = in.below(13);
  c.nK = in.below(41);
  if (in.below(16) == 0) c.nK += 600;  // more keys than one default tile
  c.dK = in.below(10);
  c.dV = in.below(10);
  c.maskKind = in.below(11);
  c.scaleKind = in.below(5);
  c.scaleParam = 0.05 + double(in.byte()) / 32.0;
  c.kernelKind = in.below(3);
  c.blockQ = 1 + in.below(9);
  c.blockK = 1 + in.below(17);
  // Long key ranges in tiles of 16 to 272 keys, not 1 to 17: thousands of one-key tiles cost a
  // hundred times the executions per second and cover nothing that short ranges do not.
  if (c.nK > 64) c.blockK *= 16;
  c.window = in.below(6);
  c.keyLength = c.nK ? in.below(int(c.nK) + 1) : 0;
  c.softcap = 0.5 + double(in.byte()) / 8.0;
  c.q = values(in, c.nQ, c.dK);
  c.k = values(in, c.nK, c.dK);
  c.v = values(in, c.nK, c.dV);
  if (c.maskKind == 5) c.bias = values(in, c.nQ, c.nK);
  if (c.maskKind == 6) {
    c.keep.resize(c.nQ, c.nK);
    for (Index i = 0; i < c.keep.size(); ++i) c.keep.data()[i] = in.below(4) != 0;
  }
  // Large logits (unscaled attention, long head dimensions, big biases, a softcap's saturation),
  // where the float backward once lost digits to a rounded logSumExp: logits up to about 4 x 64 x
  // 16 = 4096 in magnitude, mostly 10-100.
  static constexpr double kMagnitudes[] = {1, 8, 24, 64};
  c.magnitude = kMagnitudes[in.below(4)];
  c.q *= c.magnitude;
  c.bias *= c.magnitude;
  return c;
}

long double tauOf(const Case& c) {
  switch (c.scaleKind) {
    case 0:
      return c.dK > 0 ? 1.0L / std::sqrt((long double)c.dK) : 1.0L;
    case 1:
      return 1.0L;
    case 2:
      return (long double)c.scaleParam;
    case 3:
      return 1.0L / (long double)c.scaleParam;
    default:
      return (long double)(float)c.scaleParam;  // a Learnable<float> stores a float
  }
}

/// Calls f(scale, mask, visible, bias, softcap) with the policy and mask the case asks for and
/// the oracle's description of the same mask.
template <typename T, typename F>
void withPolicies(const Case& c, const Mat<T>& bias, const F& f) {
  using sdpa::mask::Align;
  namespace mask = sdpa::mask;
  const Index nQ = c.nQ, nK = c.nK, w = c.window, len = c.keyLength;
  const Index lr = nK - nQ;  // the lower-right diagonal offset
  auto withScale = [&](const auto& m, const VisibleFn& vis, const BiasFn& b, long double cap) {
    // Three policy types for five tau values: InvSqrtDk, Constant and Temperature differ only in
    // value() (one code path; instantiating each would triple the harness's compile time), None
    // is the identity path and Learnable the accumulating one.
    switch (c.scaleKind) {
      case 1:
        return f(sdpa::scale::None{}, m, vis, b, cap);
      case 4:
        return f(sdpa::scale::Learnable<float>{float(c.scaleParam)}, m, vis, b, cap);
      default:
        return f(sdpa::scale::Constant{double(tauOf(c))}, m, vis, b, cap);
    }
  };
  const VisibleFn all = sdpa_test::allVisible();
  const BiasFn none = sdpa_test::noBias();
  switch (c.maskKind) {
    case 0:
      return withScale(mask::None{}, all, none, 0);
    case 1:
      return withScale(
          mask::Causal{Align::UpperLeft}, [](Index i, Index j) { return j <= i; }, none, 0);
    case 2:
      return withScale(
          mask::Causal{Align::LowerRight}, [=](Index i, Index j) { return j <= i + lr; }, none, 0);
    case 3:
      return withScale(
          mask::SlidingWindow{w, 1, Align::LowerRight},
          [=](Index i, Index j) { return j >= i + lr - w && j <= i + lr + 1; }, none, 0);
    case 4:
      return withScale(
          mask::KeyLength{len}, [=](Index, Index j) { return j < len; }, none, 0);
    case 5:
      return withScale(
          mask::Bias{bias}, all, [&](Index i, Index j) { return (long double)bias(i, j); }, 0);
    case 6: {
      const auto& keep = c.keep;
      return withScale(
          mask::Keep{keep}, [&](Index i, Index j) { return keep(i, j); }, none, 0);
    }
    case 7:
      return withScale(mask::Softcap{c.softcap}, all, none, (long double)c.softcap);
    case 8: {
      const double slope = c.scaleParam / 4;
      return withScale(
          mask::Alibi{{slope}, Align::UpperLeft}, all,
          [=](Index i, Index j) { return -(long double)slope * std::abs((long double)(i - j)); }, 0);
    }
    case 9:
      return withScale(
          mask::combine(mask::Causal{Align::LowerRight}, mask::KeyLength{len}),
          [=](Index i, Index j) { return j <= i + lr && j < len; }, none, 0);
    default:
      // Listed hiding-first and nested, as built by hand (not flattened by combine): the softcap
      // must still act before the hiding (issue #15's defect).
      return withScale(
          mask::Combined<mask::Causal, mask::Combined<mask::Softcap>>(
              mask::Causal{Align::UpperLeft}, mask::Combined<mask::Softcap>(mask::Softcap{c.softcap})),
          [](Index i, Index j) { return j <= i; }, none, (long double)c.softcap);
  }
}

/// The inputs and both results of row i, for the failure message.
template <typename T>
std::string dump(const Case& c, Index i, const Mat<T>& out, const Eigen::Matrix<T, -1, 1>& lse,
                 const sdpa_test::RefResult<long double>& gold) {
  // A row of a matrix without columns is not formed: Eigen offsets its null data pointer (UB).
  const auto row = [i](const auto& m) {
    std::ostringstream r;
    r.precision(9);
    if (m.cols() > 0) r << m.row(i).template cast<double>();
    return r.str();
  };
  std::ostringstream s;
  s.precision(9);
  s << "\n  q row: " << row(c.q) << "\n  k:\n"
    << c.k << "\n  v:\n"
    << c.v << "\n  output: " << row(out) << "  lse " << lse(i) << "\n  oracle: " << row(gold.output) << "  lse "
    << double(gold.logSumExp(i));
  if (c.bias.size()) s << "\n  bias row: " << row(c.bias);
  return s.str();
}

/// m with its inf and NaN entries replaced by 0.
inline Mat<double> finite(const Mat<double>& m) {
  return m.unaryExpr([](double x) { return std::isfinite(x) ? x : 0.0; });
}

/**
 * First-order rounding analysis in precision T, shared by the forward and backward checks. Any
 * summation order computes logit s_ij = tau q_i.k_j (+ b_ij) with an error of at most
 * ds_ij = (d_k + 3) eps S_ij, S_ij = |tau| sum_c |q_ic k_jc| + |b_ij| (+ the cap), so that
 * kernels which sum in different orders (the plain loop, Eigen's products, tiles with the scale
 * folded into q) may differ by that much in each logit: the weights by p_ij 2 max_j ds_ij. The
 * 2x-the-plain-loop rule alone does not hold once logits are large (|s| of 1e2 and beyond), where
 * the plain loop is right by luck. Exponentials below the smallest normal number are clamped by
 * Eigen's vectorised exp (e^-88.7 in float), an absolute error of `min` per weight.
 */
/// Row dot products that also hold for 0 columns (no row() of a matrix without data).
double rowDot(const Mat<double>& a, Index i, const Mat<double>& b, Index j) {
  return a.cols() ? a.row(i).dot(b.row(j)) : 0.0;
}
double rowAbsDot(const Mat<double>& a, Index i, const Mat<double>& b, Index j) {
  return a.cols() ? a.row(i).cwiseAbs().dot(b.row(j).cwiseAbs()) : 0.0;
}

template <typename T>
struct Rounding {
  static constexpr double eps = std::numeric_limits<T>::epsilon();
  static constexpr double tiny = std::numeric_limits<T>::min();
  Index nQ, nK;
  Mat<double> p, ds, dsMax;  // weights (0 where hidden), logit error bound, row maxima of ds (n_q x 1)
  Mat<double> vMax;          // n_q x 1: max |v_jc| over the keys row i sees
  Mat<double> termMax;       // n_q x 1: max |tau q_ic k_jc| over the keys row i sees
  std::vector<Index> visibleCount;
  std::vector<char> nonFiniteValueReachable;  // per row: see below

  Rounding(const Case& c, long double tau, const VisibleFn& vis, const BiasFn& b, long double cap)
      : nQ(c.nQ),
        nK(c.nK),
        p(Mat<double>::Zero(c.nQ, c.nK)),
        ds(Mat<double>::Zero(c.nQ, c.nK)),
        dsMax(Mat<double>::Zero(c.nQ, 1)),
        vMax(Mat<double>::Zero(c.nQ, 1)),
        termMax(Mat<double>::Zero(c.nQ, 1)),
        visibleCount(size_t(c.nQ), 0),
        nonFiniteValueReachable(size_t(c.nQ), 0) {
    const double t = double(tau);
    for (Index i = 0; i < nQ; ++i) {
      std::vector<double> sRow(size_t(nK), -INFINITY);
      double m = -INFINITY;
      for (Index j = 0; j < nK; ++j) {
        if (!vis(i, j)) continue;
        ++visibleCount[size_t(i)];
        for (Index d = 0; d < c.dK; ++d) termMax(i) = std::max(termMax(i), std::abs(t * c.q(i, d) * c.k(j, d)));
        const double raw = t * rowDot(c.q, i, c.k, j);
        const double sj = (cap > 0 ? double(cap) * std::tanh(raw / double(cap)) : raw) + double(b(i, j));
        sRow[size_t(j)] = sj;
        m = std::max(m, sj);
        const double rawError = double(c.dK + 3) * eps * std::abs(t) * rowAbsDot(c.q, i, c.k, j);
        double capError = rawError;
        if (cap > 0) {  // |c tanh(a / c) - c tanh(b / c)| <= |a - b| sup (1 - tanh^2), <= 2c
          const double x = std::abs(raw) / double(cap), dx = rawError / double(cap);
          if (!std::isfinite(x) || !std::isfinite(dx))
            capError = 0;  // saturated: tanh is exactly +-1
          else
            capError = double(cap) * std::min(2.0, x > dx ? dx * 4 * std::exp(-2 * (x - dx)) : dx);
          capError += 2 * eps * double(cap);
        }
        // A -inf logit (from an infinite input) is -inf in any summation order: weight exactly 0.
        ds(i, j) = sj == -INFINITY ? 0.0 : capError + eps * (std::abs(sj) + std::abs(double(b(i, j))));
        dsMax(i) = std::max(dsMax(i), ds(i, j));
        // A non-finite v at a key the row sees has weight exactly 0 wherever the reference is
        // finite (the only rows and gradients checked): it adds nothing, and an inf or NaN here
        // made the bound NaN (0 * inf in the gradient bounds).
        if (c.dV) vMax(i) = std::max(vMax(i), finite(c.v.row(j)).cwiseAbs().maxCoeff());
      }
      if (!std::isfinite(m)) continue;
      // A visible key whose value holds inf or NaN has weight 0 in the reference, but its logit
      // may come out within exp's range of the maximum in T when the logits' rounding allows it
      // (ds: a cancellation of products near 1e32 errs by an ulp of them, 1e25): the row may
      // then be inf or NaN in T, as (tau q) k folded or summed in another order shows.
      for (Index j = 0; j < nK && c.dV; ++j)
        if (vis(i, j) && !c.v.row(j).allFinite() && sRow[size_t(j)] + ds(i, j) >= m - dsMax(i) - 104.0)
          nonFiniteValueReachable[size_t(i)] = 1;
      double l = 0;
      for (Index j = 0; j < nK; ++j)
        if (vis(i, j)) l += std::exp(sRow[size_t(j)] - m);
      for (Index j = 0; j < nK; ++j)
        if (vis(i, j)) p(i, j) = std::exp(sRow[size_t(j)] - m) / l;
    }
  }
  double n(Index i) const { return double(visibleCount[size_t(i)]); }
  /// Bound on |output_i - exact|: weight errors times |v_j - o_i| <= 2 vMax, plus the sum.
  double outputFloor(Index i) const { return vMax(i) * (4 * dsMax(i) + (n(i) + 4) * eps + n(i) * tiny); }
  /// max over visible j and c of |tau q_ic k_jc|: the largest product the tiled kernel forms.
  double largestTerm(Index i) const { return termMax(i); }
  /// The largest |entry| the tiled kernel's unnormalised accumulator may hold in row i: each
  /// weight is at most 1 against the running maximum of the keys seen so far, so up to
  /// sum_j |v_jc| over the visible keys. (Against the final maximum, sum_j p_j |v_jc| / max_j p_j,
  /// it missed a prefix of keys whose own maximum is lower: found by the fuzzer in session 7.)
  double accumulatorBound(const Case& c, Index i) const {
    if (!c.dV || !(p.row(i).maxCoeff() > 0)) return 0;
    // Visible keys with a finite logit (p or its error bound nonzero; a -inf logit weighs 0).
    const Mat<double> seen = (p.row(i).array() > 0 || ds.row(i).array() > 0).cast<double>().matrix();  // 1 x n_k
    return (seen * finite(c.v).cwiseAbs()).maxCoeff();
  }
  double lseFloor(Index i, double lse) const { return dsMax(i) + (n(i) + 4) * eps + 8 * eps * std::abs(lse); }
};

/// The per-row forward oracle check described at the top of the file.
template <typename T>
void checkRows(const char* what, const Case& c, const Mat<T>& out, const Eigen::Matrix<T, -1, 1>& lse,
               const sdpa_test::RefResult<long double>& gold, const sdpa_test::RefResult<T>& naive,
               const Rounding<T>& rounding, bool tiled, const std::vector<double>& outExtra = {},
               const std::vector<double>& lseExtra = {}) {
  if (out.rows() != c.nQ || out.cols() != c.dV || lse.size() != c.nQ) fail(what, "wrong result shape; " + c.describe());
  for (Index i = 0; i < c.nQ; ++i) {
    // Rows of 0-column results are taken as empty matrices (no row() of a matrix without data).
    const auto rowOf = [&](const auto& m) {
      return c.dV ? Mat<double>(m.row(i).template cast<double>()) : Mat<double>(1, 0);
    };
    const Mat<double> g = rowOf(gold.output), n = rowOf(naive.output);
    const double gl = double(gold.logSumExp(i)), nl = double(naive.logSumExp(i));
    // Fully masked: every visible logit is -inf in the oracle and in the plain loop in T (a logit
    // that overflows only in T, as inf - inf = NaN, is a row the plain loop cannot compute).
    // (The tiled kernel's folded tau may overflow a product to NaN there too: see below.)
    if (std::isinf(gl) && gl < 0 && std::isinf(nl) && nl < 0 &&
        !(tiled && rounding.largestTerm(i) > 0.5 * double(std::numeric_limits<T>::max()))) {
      if (!(lse(i) == -std::numeric_limits<T>::infinity() && (rowOf(out).array() == 0.0).all()))
        fail(what, "a fully masked row is not 0 / -inf (row " + std::to_string(i) + "); " + c.describe() +
                       dump(c, i, out, lse, gold));
      continue;
    }
    if (!(n.allFinite() && std::isfinite(nl) && g.allFinite() && std::isfinite(gl))) continue;
    const Mat<double> o = rowOf(out);
    // A known limit of the tiled kernel (NUMERICS.md): its accumulator sums unnormalised weights
    // times v, sum_j exp(s_j - m) |v_j| = sum_j p_j |v_j| / max_j p_j, which overflows T when
    // values come within a factor n_k of the largest T, where the plain loop's normalised sum does
    // not. Such a row may come out inf.
    // And the tiled kernel folds tau into q: a product (tau q_ic) k_jc may overflow where
    // q_ic k_jc does not (tau > 1, values near the largest T), which makes that logit NaN.
    // Such a row may come out NaN, or with its overflowed logits at -inf as if hidden (output 0 and
    // logSumExp -inf when every logit overflows): either shows in the output or the logSumExp
    // (with d_v = 0 only in the latter).
    const double half = 0.5 * double(std::numeric_limits<T>::max());
    if (tiled && !o.allFinite() && rounding.accumulatorBound(c, i) > half) continue;
    if (tiled && !o.allFinite() && rounding.nonFiniteValueReachable[size_t(i)]) continue;
    if (tiled && rounding.largestTerm(i) > half && !(o.allFinite() && std::isfinite(double(lse(i))))) continue;
    const double scale = g.size() ? g.cwiseAbs().maxCoeff() : 0.0;
    const double err = sdpa_test::maxAbsDiff(o, g), naiveErr = sdpa_test::maxAbsDiff(n, g);
    const double bound = 2 * naiveErr + std::max(rounding.outputFloor(i), 8 * Rounding<T>::eps * std::max(1.0, scale)) +
                         (outExtra.empty() ? 0.0 : outExtra[size_t(i)]);
    if (!(err <= bound))
      fail(what, "row " + std::to_string(i) + " error " + std::to_string(err) + " > 2 x " + std::to_string(naiveErr) +
                     " + the rounding floor " + std::to_string(bound - 2 * naiveErr) + "; " + c.describe() +
                     dump(c, i, out, lse, gold));
    const double lseErr =
        sdpa_test::maxAbsDiff(Mat<double>::Constant(1, 1, double(lse(i))), Mat<double>::Constant(1, 1, gl));
    const double lseNaive = std::abs(nl - gl);
    if (!(lseErr <= 2 * lseNaive + rounding.lseFloor(i, gl) + (lseExtra.empty() ? 0.0 : lseExtra[size_t(i)])))
      fail(what, "row " + std::to_string(i) + " logSumExp error " + std::to_string(lseErr) + "; " + c.describe() +
                     dump(c, i, out, lse, gold));
  }
}

/// x stacked on itself: the case as a two-item packed batch (the varlen layout), so that the
/// kernels form blocks at row offsets of the packed matrices.
template <typename T>
Mat<T> twice(const Mat<T>& x) {
  Mat<T> y(2 * x.rows(), x.cols());
  if (x.size()) y << x, x;  // not a block of a matrix without data (null + offset)
  return y;
}
/// Rows [b n, (b + 1) n) of a stacked result, copied.
template <typename T>
Mat<T> item(const Mat<T>& x, Index b, Index n) {
  return x.cols() ? Mat<T>(x.middleRows(b * n, n)) : Mat<T>(n, 0);
}
/// The two-item layout of twice().
sdpa::BatchLayout twoItems(const Case& c) {
  return sdpa::BatchLayout::varlen({0, c.nQ, 2 * c.nQ}, {0, c.nK, 2 * c.nK});
}

template <typename T, typename Kernel>
void runForward(const char* what, const Kernel& kern, const Case& c) {
  const Mat<T> q = c.q.cast<T>(), k = c.k.cast<T>(), v = c.v.cast<T>(), bias = c.bias.cast<T>();
  withPolicies<T>(
      c, bias, [&](const auto& scale, const auto& mask, const VisibleFn& vis, const BiasFn& b, long double cap) {
        const long double tau = tauOf(c);
        const auto gold = sdpa_test::referenceAttention<long double>(q, k, v, tau, vis, b, cap);
        const auto naive = sdpa_test::referenceAttention<T>(q, k, v, tau, vis, b, cap);
        const auto fwd = sdpa::attentionForward(kern, q, k, v, scale, mask);
        checkRows<T>(what, c, fwd.output, fwd.logSumExp, gold, naive, Rounding<T>(c, tau, vis, b, cap),
                     std::is_same_v<Kernel, sdpa::kernel::Tiled>);

        // Two heads side by side (head 1 = head 0 reversed in rows of q) must each equal a single
        // head call: multi-head is bitwise the same computation per head.
        if (c.maskKind != 5 && c.maskKind != 6 && c.maskKind != 8) {
          Mat<T> q2(c.nQ, 2 * c.dK), k2(c.nK, 2 * c.dK), v2(c.nK, 2 * c.dV);
          q2 << q, q.colwise().reverse();
          k2 << k, k;
          v2 << v, v;
          const auto multi = sdpa::multiHeadAttentionForward(kern, q2, k2, v2, sdpa::Heads{2}, scale, mask);
          const auto second = sdpa::attentionForward(kern, Mat<T>(q.colwise().reverse()), k, v, scale, mask);
          const Mat<T> m0 = multi.output.leftCols(c.dV), m1 = multi.output.rightCols(c.dV);
          if (!(m0.array() == fwd.output.array() || (m0.array().isNaN() && fwd.output.array().isNaN())).all() ||
              !(m1.array() == second.output.array() || (m1.array().isNaN() && second.output.array().isNaN())).all())
            fail(what, "a head of a multi-head call differs from the single-head call; " + c.describe());
        }
        // Each item of a batch is the same computation as the single call (bitwise).
        const auto batch =
            sdpa::batchedAttentionForward(kern, twice(q), twice(k), twice(v), twoItems(c), sdpa::Heads{1}, scale, mask);
        for (Index b = 0; b < 2; ++b) {
          const Mat<T> o = item(batch.output, b, c.nQ);
          const Eigen::Matrix<T, -1, 1> l = batch.logSumExp.col(0).segment(b * c.nQ, c.nQ);
          if (!(o.array() == fwd.output.array() || (o.array().isNaN() && fwd.output.array().isNaN())).all() ||
              !(l.array() == fwd.logSumExp.array() || (l.array().isNaN() && fwd.logSumExp.array().isNaN())).all())
            fail(what, "item " + std::to_string(b) + " of a batch differs from the single call; " + c.describe());
        }
      });
}

/// Whether some visible product q_ic k_jc or tau q_ic k_jc is beyond half the largest T (or not
/// finite). The logit is then not determined by its inputs in T: whether it comes out finite, inf
/// or NaN depends on the order of the sum and on FMA contraction (6e38 - 3.3e38 is finite in one
/// fma, inf as a product then a sum), which differ between the naive and the tiled kernel and
/// between builds. The forward excuses such a row of the tiled kernel (Rounding::largestTerm);
/// the backward, whose dk, dv and dL/dtau mix every row, excuses the case.
/// Half-precision inputs (H) on the tiled kernel's fast path (Products::Fp32: k and v converted
/// to float once per call): bitwise the float kernel on the converted inputs, every policy and
/// mask, for every row of a call of more than 4 query rows (at most 4 is decoding, where half
/// K/V are read in place) that the float call also takes to the fast kernel (up to 16 float rows
/// against 4 keys a row or more are decoding too).
template <typename H>
void runHalfForward(const char* what, const sdpa::kernel::Tiled& kern, const Case& c) {
  const Mat<H> q = c.q.cast<float>().cast<H>(), k = c.k.cast<float>().cast<H>(), v = c.v.cast<float>().cast<H>();
  const Mat<float> qF = q.template cast<float>(), kF = k.template cast<float>(), vF = v.template cast<float>();
  const Mat<float> bias = c.bias.cast<float>();
  using FloatRef = sdpa::internal::ConstRef<float>;
  const bool floatDecodes = sdpa::internal::forward_tiled_impl<float>::decodes<FloatRef, FloatRef>(c.nQ, c.nK);
  const Index rows = c.nQ > 4 && !floatDecodes ? c.nQ : 0;
  withPolicies<float>(c, bias, [&](const auto& scale, const auto& mask, const VisibleFn&, const BiasFn&, long double) {
    const auto h = sdpa::attentionForward<float>(kern, q, k, v, scale, mask);
    const auto f = sdpa::attentionForward(kern, qF, kF, vF, scale, mask);
    const auto same = [](const auto& a, const auto& b) {
      return (a.array() == b.array() || (a.array().isNaN() && b.array().isNaN())).all();
    };
    if (!same(h.output.topRows(rows), f.output.topRows(rows)) || !same(h.logSumExp.head(rows), f.logSumExp.head(rows)))
      fail(what, "differs from the float kernel on the converted inputs; " + c.describe());
  });
}

/**
 * bfloat16 inputs with Products::Bf16 (vdpbf16ps or AMX tiles, whichever the ISA in force runs),
 * against the oracle on the values those products see: the bf16 inputs with denormals read as 0
 * (both instructions do). Each row within checkRows' float rule plus what NUMERICS.md allows the
 * bf16 products: P rounded to bf16 before P v, 2 u sum_j P_ij |v_jc| (u = 2^-8); weights below
 * 2^-126 flushed, n_k 2^-126 max|v|; and products' fp32 partial sums flushed below 2^-126,
 * (d_k + 2) 2^-126 |tau| in a logit, which moves the output by at most 4 times that times max|v|.
 */
void runBf16Products(const char* what, const sdpa::kernel::Tiled& tiled, const Case& c) {
  using B = Eigen::bfloat16;
  // Decoding: fp32 products on the bf16 values in place (runHalfForward's rows).
  using BRef = sdpa::internal::ConstRef<B>;
  if (sdpa::internal::forward_tiled_impl<B>::decodes<BRef, BRef>(c.nQ, c.nK)) return;
  const sdpa::kernel::Tiled kern{tiled.blockQ, tiled.blockK, sdpa::kernel::Products::Bf16};
  const Mat<B> q = c.q.cast<float>().cast<B>(), k = c.k.cast<float>().cast<B>(), v = c.v.cast<float>().cast<B>();
  const auto seen = [](const Mat<B>& x) {
    Mat<double> d = x.cast<float>().cast<double>();
    for (Index i = 0; i < d.size(); ++i)
      if (std::abs(d.data()[i]) < double(std::numeric_limits<float>::min())) d.data()[i] = 0.0;
    return d;
  };
  Case cs = c;
  cs.q = seen(q);
  cs.k = seen(k);
  cs.v = seen(v);
  const Mat<float> bias = c.bias.cast<float>();
  const double u = std::ldexp(1.0, -8), tiny = double(std::numeric_limits<float>::min());
  withPolicies<float>(
      c, bias, [&](const auto& scale, const auto& mask, const VisibleFn& vis, const BiasFn& b, long double cap) {
        const long double tau = tauOf(c);
        const auto gold = sdpa_test::referenceAttention<long double>(cs.q, cs.k, cs.v, tau, vis, b, cap);
        const auto naive = sdpa_test::referenceAttention<float>(cs.q, cs.k, cs.v, tau, vis, b, cap);
        const Rounding<float> rounding(cs, tau, vis, b, cap);
        std::vector<double> outExtra(size_t(c.nQ), 0.0), lseExtra(size_t(c.nQ), 0.0);
        const Mat<double> absV = finite(cs.v).cwiseAbs();
        for (Index i = 0; i < c.nQ; ++i) {
          const double logitFlush = double(c.dK + 2) * tiny * std::max(1.0, std::abs(double(tau)));
          // max_c sum_j P_ij |v_jc| (no row() of a matrix without data)
          const double weighted = c.dV && c.nK ? (rounding.p.row(i) * absV).maxCoeff() : 0.0;
          outExtra[size_t(i)] = 2 * u * weighted + (double(c.nK) * tiny + 4 * logitFlush) * rounding.vMax(i);
          lseExtra[size_t(i)] = logitFlush;
        }
        const auto fwd = sdpa::attentionForward<float>(kern, q, k, v, scale, mask);
        checkRows<float>(what, cs, fwd.output, fwd.logSumExp, gold, naive, rounding, true, outExtra, lseExtra);
      });
}

template <typename T>
bool productsNearOverflow(const Case& c, long double tau, const VisibleFn& vis) {
  const double half = 0.5 * double(std::numeric_limits<T>::max()), widen = std::max(1.0, std::abs(double(tau)));
  for (Index i = 0; i < c.nQ; ++i)
    for (Index j = 0; j < c.nK; ++j)
      if (vis(i, j))
        for (Index d = 0; d < c.dK; ++d)
          if (!(std::abs(c.q(i, d) * c.k(j, d)) * widen <= half)) return true;
  return false;
}

/// Elementwise bounds on the gradients' rounding errors in T (first order, see Rounding): the
/// weights' errors and the errors of dP = dO v^T and D = rowsum(dO * O) enter dS = P (dP - D),
/// which enters dq = tau dS k, dk = tau dS^T q, dv = P^T dO with the sums' own rounding.
template <typename T>
struct GradientBounds {
  Mat<double> q, k, v;
  double scale = 0;  // dL/dtau
  GradientBounds(const Case& c, long double tau, const VisibleFn& vis, const BiasFn& b, long double cap,
                 const Mat<double>& dOut) {
    const Rounding<T> r(c, tau, vis, b, cap);
    const double eps = Rounding<T>::eps, t = std::abs(double(tau));
    // The reference gradients are finite, so a non-finite input is one no row sees: out of the sums.
    const Mat<double> vf = finite(c.v);
    const Mat<double> o = r.p * vf;  // n_q x d_v
    Mat<double> dS = Mat<double>::Zero(c.nQ, c.nK), ddS = dS, dp = dS;
    for (Index i = 0; i < c.nQ; ++i) {
      const double dI = rowDot(dOut, i, o, i);
      // D = sum_j P_ij dP_ij: the errors of the weights and of dP, and the sum's own rounding;
      // plus those of dO . O, the same value in exact arithmetic.
      double dError = double(c.dV + 2) * eps * rowAbsDot(dOut, i, o, i) +
                      (c.dV ? dOut.row(i).cwiseAbs().sum() : 0.0) * r.outputFloor(i);
      for (Index j = 0; j < c.nK; ++j) {
        if (r.p(i, j) == 0 && r.ds(i, j) == 0) continue;  // hidden
        const double dP = rowDot(dOut, i, vf, j), dPError = double(c.dV + 2) * eps * rowAbsDot(dOut, i, vf, j);
        // Logits off by up to ds move a weight by a factor up to exp(2 dsMax): first order
        // (2 dsMax) only while that is small. From 2 dsMax = 1 on, a weight may be anywhere in
        // [0, 1] (logits near 10^10, whose float ulp is 10^3: found by the fuzzer).
        const double spread = 2 * r.dsMax(i);
        dp(i, j) = spread >= 1
                       ? 1.0
                       : std::min(1.0, r.p(i, j) * (std::expm1(spread) + (r.n(i) + 4) * eps)) + Rounding<T>::tiny;
        dError += dp(i, j) * std::abs(dP) + r.p(i, j) * dPError + (r.n(i) + 2) * eps * r.p(i, j) * std::abs(dP);
      }
      // dL/dtau = sum_ij dL_ij G_ij, G = X softcap'(tau X); the kernels take each row's G at its
      // maximum (the centre) off every term, which leaves the exact value unchanged (a row of dL
      // sums to 0). In precision T the maximum may be any key within 2 dsMax of it: the
      // distance from the centre is bounded over those.
      std::vector<double> gRow(size_t(c.nK), 0.0), dgRow(size_t(c.nK), 0.0), dLRow(size_t(c.nK), 0.0),
          ddLRow(size_t(c.nK), 0.0);
      double top = -INFINITY;
      for (Index j = 0; j < c.nK; ++j)
        if (r.p(i, j) > 0) top = std::max(top, std::log(r.p(i, j)));
      double centreLo = INFINITY, centreHi = -INFINITY;
      for (Index j = 0; j < c.nK; ++j) {
        if (r.p(i, j) == 0 && r.ds(i, j) == 0) continue;  // hidden
        double g = 1, dg = 0;                             // d cap(x) / dx = 1 - tanh^2 and its rounding error
        const double x = rowDot(c.q, i, c.k, j);
        if (cap > 0) {
          const double u = double(tau) * x / double(cap);
          g = 1 - std::tanh(u) * std::tanh(u);
          dg = 4 * eps + 2 * r.ds(i, j) / double(cap);
        }
        const double dP = rowDot(dOut, i, vf, j);
        const double dPError = double(c.dV + 2) * eps * rowAbsDot(dOut, i, vf, j);
        dS(i, j) = g * r.p(i, j) * (dP - dI);
        const double dL = r.p(i, j) * (dP - dI);
        // The kernel's weight is P + e with |e| <= dp, so the errors of dP - D enter with P + dp, not
        // P: second order, but a weight of 0 in the reference that rounding lifts to 0.2 (tied
        // logits near 10^9, whose float ulp is 256) times a D moved by 10^28 (a value of 10^30 at
        // another tied key) is the whole error (found by the fuzzer in session 8).
        const double pKernel = std::min(1.0, r.p(i, j) + dp(i, j));
        const double ddL = dp(i, j) * std::abs(dP - dI) + pKernel * (dPError + dError) + 2 * eps * std::abs(dL);
        ddS(i, j) = g * ddL + dg * std::abs(dL) + 2 * eps * std::abs(dS(i, j));
        // A softcap saturated to slope 0 (x = +-inf: an infinite q or k) has factor exactly 0 in
        // every kernel, the limit of x sech^2, not inf * 0.
        const bool flat = cap > 0 && g == 0;
        gRow[size_t(j)] = flat ? 0.0 : x * g;
        dgRow[size_t(j)] = flat ? 0.0 : (double(c.dK + 4) * eps * rowAbsDot(c.q, i, c.k, j)) * g + std::abs(x) * dg;
        dLRow[size_t(j)] = dL;
        ddLRow[size_t(j)] = ddL;
        if (r.p(i, j) > 0 && std::log(r.p(i, j)) >= top - 2 * r.dsMax(i) - 4 * eps) {
          centreLo = std::min(centreLo, gRow[size_t(j)]);
          centreHi = std::max(centreHi, gRow[size_t(j)]);
        }
      }
      if (!(centreLo <= centreHi)) continue;  // nothing visible
      // Each term is dL'_j (G'_j - C') with dL' = dL + e (|e| <= ddL), G' = G + g (|g| <= dg_j), C'
      // = C + h (|h| <= dg at the centre): its error is at most ddL (|G - C| + dg_j + dg_C) +
      // |dL| (dg_j + dg_C). The second-order ddL (dg_j + dg_C) matters where both first-order
      // terms vanish: identical keys (G = C exactly) and identical values (dL = 0 exactly), where
      // the kernels' logits still differ by their rounding (found by the fuzzer).
      double dgCentre = 0;
      for (Index j = 0; j < c.nK; ++j)
        if (r.p(i, j) > 0 && std::log(r.p(i, j)) >= top - 2 * r.dsMax(i) - 4 * eps)
          dgCentre = std::max(dgCentre, dgRow[size_t(j)]);
      for (Index j = 0; j < c.nK; ++j) {
        const double dist = std::max(std::abs(gRow[size_t(j)] - centreLo), std::abs(gRow[size_t(j)] - centreHi));
        const double dg = dgRow[size_t(j)] + dgCentre;
        scale += ddLRow[size_t(j)] * (dist + dg) + std::abs(dLRow[size_t(j)]) * dg +
                 double(c.nK + 4) * eps * std::abs(dLRow[size_t(j)]) * dist;
      }
    }
    const Mat<double> aq = finite(c.q).cwiseAbs(), ak = finite(c.k).cwiseAbs(), adO = dOut.cwiseAbs(),
                      adS = dS.cwiseAbs();
    q = t * (ddS * ak + double(c.nK + 2) * eps * adS * ak);
    k = t * (ddS.transpose() * aq + double(c.nQ + 2) * eps * adS.transpose() * aq);
    v = dp.transpose() * adO + double(c.nQ + 2) * eps * r.p.transpose() * adO;
  }
};

/// Entry by entry: |tiled - reference| <= 2 |naive - reference| + 2 bound + 8 ulps of the entry.
template <typename T>
void checkGradient(const char* name, const Case& c, const Mat<T>& tiled, const Mat<T>& naive, const Mat<double>& ref,
                   const Mat<double>& bound) {
  for (Index e = 0; e < ref.size(); ++e) {
    const double err = std::abs(double(tiled.data()[e]) - ref.data()[e]);
    const double naiveErr = std::abs(double(naive.data()[e]) - ref.data()[e]);
    const double limit = 2 * naiveErr + 2 * bound.data()[e] + 8 * Rounding<T>::eps * std::abs(ref.data()[e]);
    // The reference is finite here, and so must be every bound: a bound of inf or NaN passes
    // anything (as the value floor's 0 * inf once did), so it is a defect of this harness.
    if (!std::isfinite(bound.data()[e]) || !std::isfinite(naiveErr))
      fail(std::string("backward ") + name + ": a non-finite bound " + std::to_string(bound.data()[e]) +
               " or naive error " + std::to_string(naiveErr) + " at entry " + std::to_string(e),
           c.describe());
    // A limit beyond T's range says the rounding errors themselves may overflow T (say dP - D of
    // rounding size, 1e22, times a key of 1e30): the entry may then be inf, or NaN from a sum of
    // infinities of both signs, in any order of the sums.
    if (limit > double(std::numeric_limits<T>::max()) && !std::isfinite(double(tiled.data()[e]))) continue;
    if (!(err <= limit)) {
      std::ostringstream s;
      s.precision(9);
      s << "backward " << name << " entry (" << e % ref.rows() << ", " << e / ref.rows() << "): tiled "
        << tiled.data()[e] << ", naive " << naive.data()[e] << ", double reference " << ref.data()[e] << ", limit "
        << limit << "\n  q:\n"
        << c.q << "\n  k:\n"
        << c.k << "\n  v:\n"
        << c.v;
      fail(s.str(), c.describe());
    }
  }
}

/// dL/dtau by the rule of checkGradient; `times` items of the same case add up.
template <typename T>
void checkScaleGradient(const char* name, const Case& c, double tiled, double naive, double ref, double bound,
                        double times = 1) {
  if (!std::isfinite(bound)) fail(std::string("backward ") + name + ": a non-finite dscale bound", c.describe());
  // A sum over the items beyond the largest T has no finite value in T: inf is its rounding.
  if (std::abs(times * ref) > double(std::numeric_limits<T>::max())) return;
  const double err = std::abs(tiled - times * ref), naiveErr = std::abs(naive - ref);
  const double limit = times * (2 * naiveErr + 2 * bound + 8 * Rounding<T>::eps * std::abs(ref));
  // As checkGradient: a limit beyond T's range says a term may overflow (a dL of inf at a key
  // whose float logit ties the maximum), and then the sum may be inf or NaN in any order.
  if (limit > double(std::numeric_limits<T>::max()) && !std::isfinite(tiled)) return;
  if (!(err <= limit)) {
    std::ostringstream s;
    s.precision(9);
    s << "backward " << name << ": " << tiled << ", naive " << naive << ", double reference " << times * ref
      << ", limit " << limit << "\n  q:\n"
      << c.q << "\n  k:\n"
      << c.k << "\n  v:\n"
      << c.v;
    fail(s.str(), c.describe());
  }
}

/// Tiled backward against the naive backward, both in T, with the naive backward in double as
/// the reference, when the naive T and double gradients are finite.
template <typename T>
void runBackward(const Case& c) {
  if (c.nQ == 0 || c.nK == 0) return;
  const Mat<T> q = c.q.cast<T>(), k = c.k.cast<T>(), v = c.v.cast<T>(), bias = c.bias.cast<T>();
  const Mat<T> dOut = sdpa_test::randn<T>(c.nQ, c.dV, 7 + std::uint64_t(c.nQ * 41 + c.nK));
  const Mat<double> dOutD = dOut.template cast<double>();
  // The reference works on the inputs as T holds them.
  Case cd = c;
  cd.q = q.template cast<double>(), cd.k = k.template cast<double>(), cd.v = v.template cast<double>();
  cd.bias = bias.template cast<double>();
  Mat<double> gq, gk, gv;
  double gs = 0;
  withPolicies<double>(
      cd, cd.bias, [&](const auto& scale, const auto& mask, const VisibleFn&, const BiasFn&, long double) {
        const auto fwd = sdpa::attentionForward(sdpa::kernel::Naive{}, cd.q, cd.k, cd.v, scale, mask);
        const auto g = sdpa::attentionBackward(sdpa::kernel::Naive{}, cd.q, cd.k, cd.v, fwd, dOutD, scale, mask);
        gq = g.dq, gk = g.dk, gv = g.dv, gs = g.dscale;
      });
  if (!(gq.allFinite() && gk.allFinite() && gv.allFinite() && std::isfinite(gs))) return;
  withPolicies<T>(
      c, bias, [&](const auto& scale, const auto& mask, const VisibleFn& vis, const BiasFn& b, long double cap) {
        const auto fwdN = sdpa::attentionForward(sdpa::kernel::Naive{}, q, k, v, scale, mask);
        const auto gN = sdpa::attentionBackward(sdpa::kernel::Naive{}, q, k, v, fwdN, dOut, scale, mask);
        if (!(gN.dq.allFinite() && gN.dk.allFinite() && gN.dv.allFinite() && std::isfinite(gN.dscale))) return;
        if (productsNearOverflow<T>(cd, tauOf(c), vis)) return;
        const sdpa::kernel::Tiled kern{c.blockQ, c.blockK};
        const auto fwdT = sdpa::attentionForward(kern, q, k, v, scale, mask);
        const auto gT = sdpa::attentionBackward(kern, q, k, v, fwdT, dOut, scale, mask);
        const GradientBounds<T> bound(cd, tauOf(c), vis, b, cap, dOutD);
        checkGradient<T>("dq", cd, gT.dq, gN.dq, gq, bound.q);
        checkGradient<T>("dk", cd, gT.dk, gN.dk, gk, bound.k);
        checkGradient<T>("dv", cd, gT.dv, gN.dv, gv, bound.v);
        checkScaleGradient<T>("dscale", cd, double(gT.dscale), double(gN.dscale), gs, bound.scale);
        // The case twice in a packed batch, both kernels: each item within the same bounds.
        const auto batched = [&](const auto& kernel, const char* name) {
          const auto f = sdpa::batchedAttentionForward(kernel, twice(q), twice(k), twice(v), twoItems(c),
                                                       sdpa::Heads{1}, scale, mask);
          const auto g = sdpa::batchedAttentionBackward(kernel, twice(q), twice(k), twice(v), f, twice(dOut),
                                                        twoItems(c), sdpa::Heads{1}, scale, mask);
          for (Index b = 0; b < 2; ++b) {
            const std::string at = std::string(" of batch item ") + std::to_string(b) + ", " + name;
            checkGradient<T>(("dq" + at).c_str(), cd, item(g.dq, b, c.nQ), gN.dq, gq, bound.q);
            checkGradient<T>(("dk" + at).c_str(), cd, item(g.dk, b, c.nK), gN.dk, gk, bound.k);
            checkGradient<T>(("dv" + at).c_str(), cd, item(g.dv, b, c.nK), gN.dv, gv, bound.v);
          }
          checkScaleGradient<T>((std::string("dscale of the batch, ") + name).c_str(), cd, double(g.dscale(0)),
                                double(gN.dscale), gs, bound.scale, 2);
        };
        batched(sdpa::kernel::Naive{}, "naive");
        batched(kern, "tiled");
      });
}

/// Which checks run: SDPA_FUZZ_TARGET=forward or =backward in the environment runs only those
/// (several times the executions per second of both, for long runs on one side); unset, both.
enum class Target { Both, Forward, Backward };
Target target() {
  static const Target t = [] {
    const char* s = std::getenv("SDPA_FUZZ_TARGET");
    const std::string name = s ? s : "";
    if (name == "forward") return Target::Forward;
    if (name == "backward") return Target::Backward;
    if (!name.empty()) fail("SDPA_FUZZ_TARGET", "is '" + name + "'; use forward, backward or leave it unset");
    return Target::Both;
  }();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes in(data, size);
  const Case c = decode(in);
  try {
    if (target() != Target::Backward) {
      runForward<float>("forward naive float", sdpa::kernel::Naive{}, c);
      runForward<double>("forward naive double", sdpa::kernel::Naive{}, c);
      const sdpa::kernel::Tiled tiled =
          c.kernelKind == 0 ? sdpa::kernel::Tiled{} : sdpa::kernel::Tiled{c.blockQ, c.blockK};
      const std::string blocks = c.kernelKind == 0 ? "" : " (small blocks)";
      // The float tiled forward under every instruction set this CPU has: the fast prefill
      // kernel's AVX-512 and AVX2 paths and the portable Eigen kernel (internal/cpu.hpp).
      using sdpa::internal::Isa;
      using sdpa::internal::IsaChoice;
      for (const Isa cap : {Isa::Portable, Isa::Avx2, Isa::Avx512}) {
        if (int(cap) > int(IsaChoice::detected())) continue;
        IsaChoice::setCap(cap);
        const char* isa = cap == Isa::Avx512 ? ", AVX-512" : cap == Isa::Avx2 ? ", AVX2" : ", portable";
        runForward<float>(("forward tiled float" + blocks + isa).c_str(), tiled, c);
        if (cap != Isa::Portable) {
          runHalfForward<Eigen::bfloat16>(("forward tiled bfloat16" + blocks + isa).c_str(), tiled, c);
          runHalfForward<Eigen::half>(("forward tiled half" + blocks + isa).c_str(), tiled, c);
        }
      }
      // The bf16 products (Products::Bf16) under each bf16 instruction set this CPU has.
      for (const Isa cap : {Isa::Avx512Bf16, Isa::Amx}) {
        if (int(cap) > int(IsaChoice::detected())) continue;
        IsaChoice::setCap(cap);
        runBf16Products(
            ("forward tiled bf16 products" + blocks + (cap == Isa::Amx ? ", AMX" : ", AVX512_BF16")).c_str(), tiled, c);
      }
      IsaChoice::setCap(Isa::Amx);
      runForward<double>(("forward tiled double" + blocks).c_str(), tiled, c);
    }
    if (target() != Target::Forward) {
      runBackward<float>(c);
      runBackward<double>(c);
    }
  } catch (const std::exception& e) {
    // Every decoded case is valid input: an exception is a defect.
    fail("unexpected exception", std::string(e.what()) + "; " + c.describe());
  }
  return 0;
}
