/**
 * \file sdpa/diagnostics.hpp
 * \brief Diagnostics of the attention scale: logit statistics, entropy, saturation, the softmax
 * Jacobian, overflow headroom, head collapse and the variance check (seed C3, C5, C6, C10,
 * C12-C14, C17, C18).
 *
 * `diagnose(q, k, scale, mask, options)` (one head) or `diagnose(q, k, heads, scale, mask, options)`
 * (packed heads) returns a `Diagnostics`: per-head figures (facts), and findings, each a warning
 * (something will go wrong) or a note (unusual, worth a look), read for the model's stage
 * (initialisation or trained, given or decided from the data) and the precision and form of its
 * softmax (`DiagnoseOptions`); `toString()` and `toJson()`. Every verdict, its claim and its
 * threshold are documented in docs/DIAGNOSTICS.md. The same per-row figures can be gathered during a forward pass by
 * passing a `DiagnosticsSink` to `attentionForward` / `multiHeadAttentionForward` and read with `diagnostics(sink)`,
 * without a second pass. All statistics are over visible (unmasked) positions; rows with no visible key are counted as
 * fully masked and left out of the row statistics.
 */
#ifndef SDPA_DIAGNOSTICS_HPP
#define SDPA_DIAGNOSTICS_HPP

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "diagnostics_sink.hpp"
#include "internal/diagnostics_rows.hpp"
#include "internal/forward_naive.hpp"
#include "internal/input_moments.hpp"
#include "mask.hpp"
#include "multihead.hpp"
#include "scale.hpp"

namespace sdpa {

/// \brief Mean and order statistics of a per-row quantity. Quantiles interpolate linearly between
/// order statistics (NumPy's default `percentile`): the median of an even count is the mean of
/// the two middle values.
struct Quantiles {
  double mean = 0, min = 0, p05 = 0, median = 0, p95 = 0, max = 0;
};

/// Thresholds of the verdicts: p_max above kSaturated is a saturated row; an entropy fraction
/// H / log(n_visible) above kNearUniform is a near-uniform row.
inline constexpr double kSaturated = 0.99;
inline constexpr double kNearUniform = 0.99;

/// \brief Where the model is: at initialisation (random q and k, seed C3's premise holds), or
/// trained (q and k correlated by design; sharp heads are learned). Auto decides from the data.
enum class ModelStage { Auto, Init, Trained };
/// \brief The precision the model's softmax (and its backward) runs in: where its Jacobian
/// underflows and where a plain exp overflows.
enum class Precision { Fp32, Bf16, Fp16 };
/// \brief Whether the model's softmax subtracts the row maximum before exp (sdpa, PyTorch,
/// FlashAttention, every mainstream kernel) or not (a hand-written exp(s) / sum exp(s)).
enum class SoftmaxForm { MaxSubtracted, Plain };

/// \brief How to read the figures: the model's stage, its softmax's precision and form.
struct DiagnoseOptions {
  ModelStage stage = ModelStage::Auto;
  Precision precision = Precision::Fp32;
  SoftmaxForm softmax = SoftmaxForm::MaxSubtracted;
};

/// \brief ln of the smallest normal number of a precision: a weight exp(-gap) below it has
/// underflowed (to zero under flush-to-zero, as GPU kernels and fast-math builds do).
inline double underflowGap(Precision p) {
  switch (p) {
    case Precision::Fp16:
      return 9.704060527839234;  // -ln 2^-14
    default:
      return 87.33654475055310;  // -ln 2^-126, fp32 and bf16
  }
}

inline const char* toString(ModelStage s) {
  return s == ModelStage::Init ? "init" : s == ModelStage::Trained ? "trained" : "auto";
}
inline const char* toString(Precision p) {
  return p == Precision::Fp16 ? "fp16" : p == Precision::Bf16 ? "bf16" : "fp32";
}

/// \brief The figures of one head.
struct HeadDiagnostics {
  Index head = 0, headDim = 0, queries = 0, keys = 0;
  double tau = 0;             ///< the scale used
  Index visibleLogits = 0;    ///< unmasked (query, key) pairs
  Index fullyMaskedRows = 0;  ///< queries that see no key
  Index singleKeyRows = 0;    ///< queries that see one key (left out of the row statistics)
  /// Of the final logits tau q.k (+ softcap, + bias) at visible positions.
  double logitMean = 0, logitStd = 0, logitMin = 0, logitMax = 0;
  /// Std of the raw q.k at visible positions, and the std 1/sqrt(d_k) would give (seed C14).
  double rawStd = 0, invSqrtDkStd = 0;
  /// Per row that sees at least two keys: the largest weight p_max = exp(max - lse), the entropy
  /// H (nats), H / log(n_visible), the effective number of keys exp(H), ||diag(p) - p p^T||_F,
  /// and the lead of the largest logit over the second.
  Quantiles maxWeight, entropy, entropyFraction, effectiveKeys, jacobianNorm, logitGap;
  double saturatedFraction = 0;  ///< rows with p_max > kSaturated
  double uniformFraction = 0;    ///< rows with H / log(n_visible) > kNearUniform
  /// Rows whose off-max weights all underflow in the precision of the options (gap above
  /// -ln of its smallest normal): their softmax Jacobian is zero there (seed C5).
  double underflowFraction = 0;
  /// The key most rows put their largest weight on, and the share of rows that do (a "sink");
  /// the most common offset of that key from the row's diagonal (j - i, lower-right aligned),
  /// and its share (a positional head, e.g. -1: the previous token).
  Index modeKey = 0, modeOffset = 0;
  double modeKeyShare = 0, modeOffsetShare = 0;
  /// Visible logits above the exp limits of fp16, bf16, fp32 (seed C13, C15).
  Index overflowFp16 = 0, overflowBf16 = 0, overflowFp32 = 0;
  /// Var(q.k) over visible pairs against d_k Var(q) Var(k) (seed C3).
  double varianceObserved = 0, variancePredicted = 0;
  /// The same ratio for q and k centred on their column means, over every pair (see HeadInputs):
  /// 1 within sampling noise when q and k are independent and isotropic (C3's premise).
  double varianceRatioCentred = std::numeric_limits<double>::quiet_NaN();
};

/// \brief One verdict: a warning (something will go wrong) or a note (unusual, worth a look).
struct Finding {
  enum class Level { Note, Warning } level = Level::Note;
  Index head = -1;     ///< the head it is about, or -1 for the whole run
  std::string claims;  ///< the seed claims it rests on, e.g. "C5"
  std::string text;
};

/// \brief Per-head figures (facts), head-to-head similarity and verdicts (warnings and notes).
struct Diagnostics {
  std::vector<HeadDiagnostics> heads;
  /// The stage the verdicts were read for (Init or Trained), and why: the option, or how Auto
  /// decided.
  ModelStage stage = ModelStage::Init;
  std::string stageReason;
  DiagnoseOptions options;
  /// Mean over head pairs and query rows of 1 - JS(P_a, P_b) / ln 2: 1 when all heads attend
  /// identically (collapse, seed C6, C12), NaN with fewer than two heads or without weights.
  double headSimilarity = std::numeric_limits<double>::quiet_NaN();
  /// H x H matrix of the pairwise similarities (empty without weights).
  Eigen::MatrixXd pairwiseSimilarity;
  /// Warnings and notes, in head order; no warning means healthy.
  std::vector<Finding> findings;
  /// The findings as lines ("warning: ...", "note: ..."), or one "healthy: ..." line.
  std::vector<std::string> verdicts;

  Index warnings() const;
  Index notes() const;
  bool healthy() const { return warnings() == 0; }

  std::string toString() const;
  std::string toJson() const;
};

inline std::ostream& operator<<(std::ostream& os, const Diagnostics& d) { return os << d.toString(); }

namespace internal {

/// Linear interpolation between order statistics, as NumPy's percentile (its default method).
inline Quantiles quantiles(std::vector<double> x) {
  Quantiles q;
  if (x.empty()) return q;
  std::sort(x.begin(), x.end());
  const auto at = [&](double f) {
    const double h = f * double(x.size() - 1);
    const size_t lo = size_t(h), hi = std::min(x.size() - 1, lo + 1);
    return x[lo] + (h - double(lo)) * (x[hi] - x[lo]);
  };
  double sum = 0;
  for (const double v : x) sum += v;
  q.mean = sum / double(x.size());
  q.min = x.front();
  q.max = x.back();
  q.p05 = at(0.05);
  q.median = at(0.5);
  q.p95 = at(0.95);
  return q;
}

/// The most common value of a list and its share of the list.
inline std::pair<Index, double> mode(std::vector<Index> x) {
  if (x.empty()) return {0, 0.0};
  std::sort(x.begin(), x.end());
  Index best = x.front(), bestCount = 0;
  for (size_t i = 0; i < x.size();) {
    size_t j = i;
    while (j < x.size() && x[j] == x[i]) ++j;
    if (Index(j - i) > bestCount) best = x[i], bestCount = Index(j - i);
    i = j;
  }
  return {best, double(bestCount) / double(x.size())};
}

/// Folds the per-row records of one head into its figures; `underflow` is the logit lead above
/// which a row's off-max weights underflow (underflowGap of the options' precision).
inline HeadDiagnostics summarize(const std::vector<RowStats>& rows, const HeadInputs& in, Index head,
                                 double underflow) {
  HeadDiagnostics d;
  d.head = head;
  d.headDim = in.headDim;
  d.queries = Index(rows.size());
  d.keys = in.keys;
  d.tau = in.tau;
  d.varianceRatioCentred = in.centredRatio;
  double sum = 0, sumSq = 0, rawSum = 0, rawSumSq = 0;
  d.logitMin = std::numeric_limits<double>::infinity();
  d.logitMax = -std::numeric_limits<double>::infinity();
  std::vector<double> pMax, entropy, fraction, effective, jacobian, gap;
  std::vector<Index> keys, offsets;
  for (size_t i = 0; i < rows.size(); ++i) {
    const RowStats& r = rows[i];
    if (r.visible == 0) {
      ++d.fullyMaskedRows;
      continue;
    }
    d.visibleLogits += r.visible;
    sum += r.logitSum;
    sumSq += r.logitSumSq;
    rawSum += r.rawSum;
    rawSumSq += r.rawSumSq;
    d.logitMin = std::min(d.logitMin, r.logitMin);
    d.logitMax = std::max(d.logitMax, r.logitMax);
    d.overflowFp16 += r.overFp16;
    d.overflowFp32 += r.overFp32;
    if (r.visible < 2) {  // one visible key: p = 1 by construction, not by the scale
      ++d.singleKeyRows;
      continue;
    }
    pMax.push_back(r.pMax);
    entropy.push_back(r.entropy);
    effective.push_back(std::exp(r.entropy));
    jacobian.push_back(r.jacobianNorm);
    fraction.push_back(r.entropy / std::log(double(r.visible)));
    gap.push_back(r.gap);
    keys.push_back(r.argmax);
    offsets.push_back(r.argmax - (Index(i) + in.keys - d.queries));  // lower-right diagonal
  }
  d.overflowBf16 = d.overflowFp32;  // bf16 has fp32's exponent range
  const double n = double(d.visibleLogits);
  if (n > 0) {
    d.logitMean = sum / n;
    d.logitStd = std::sqrt(std::max(0.0, sumSq / n - d.logitMean * d.logitMean));
    const double rawMean = rawSum / n;
    d.varianceObserved = std::max(0.0, rawSumSq / n - rawMean * rawMean);
    d.rawStd = std::sqrt(d.varianceObserved);
    d.invSqrtDkStd = in.headDim > 0 ? d.rawStd / std::sqrt(double(in.headDim)) : 0;
  } else {
    d.logitMin = d.logitMax = 0;
  }
  d.variancePredicted = double(in.headDim) * in.varQ * in.varK;
  const auto countAbove = [](const std::vector<double>& x, double t) {
    return x.empty() ? 0.0
                     : double(std::count_if(x.begin(), x.end(), [t](double v) { return v > t; })) / double(x.size());
  };
  d.saturatedFraction = countAbove(pMax, kSaturated);
  d.uniformFraction = countAbove(fraction, kNearUniform);
  d.underflowFraction = countAbove(gap, underflow);
  d.maxWeight = quantiles(pMax);
  d.entropy = quantiles(entropy);
  d.entropyFraction = quantiles(fraction);
  d.effectiveKeys = quantiles(effective);
  d.jacobianNorm = quantiles(jacobian);
  d.logitGap = quantiles(gap);
  std::tie(d.modeKey, d.modeKeyShare) = mode(keys);
  std::tie(d.modeOffset, d.modeOffsetShare) = mode(offsets);
  return d;
}

inline std::string format(const char* fmt, double a, double b = 0, double c = 0, double e = 0) {
  char buf[320];
  std::snprintf(buf, sizeof buf, fmt, a, b, c, e);
  return buf;
}

/// Half-width of the interval the centred variance ratio stays in when q and k are independent
/// and isotropic: its sampling standard deviation is about sqrt(2 / (n_q n_k)) (each pair's
/// (q.k)^2 / (|q|^2 |k|^2) has relative std sqrt(2), and pairs are uncorrelated), taken 4 times;
/// at least 0.25, the largest deviation measured on a randomly initialised 6-layer BERT (0.19,
/// every layer, d_k 32 and 64, 21 tokens: docs/DIAGNOSTICS.md).
inline double premiseBand(const HeadDiagnostics& h) {
  return std::max(0.25,
                  4 * std::sqrt(2.0 / (double(std::max<Index>(1, h.queries)) * double(std::max<Index>(1, h.keys)))));
}

/// Decides the stage for Auto (C3's premise on every head), or records the caller's.
inline void decideStage(Diagnostics& d) {
  if (d.options.stage != ModelStage::Auto) {
    d.stage = d.options.stage;
    d.stageReason = std::string("set by the caller");
    return;
  }
  Index outside = 0, tested = 0, worst = -1;
  double worstDev = 0;
  for (const HeadDiagnostics& h : d.heads) {
    if (!std::isfinite(h.varianceRatioCentred)) continue;
    ++tested;
    const double dev = std::abs(h.varianceRatioCentred - 1) / premiseBand(h);
    if (dev > 1) ++outside;
    if (dev > worstDev) worstDev = dev, worst = h.head;
  }
  if (tested == 0) {
    d.stage = ModelStage::Init;
    d.stageReason = "auto: the centred variance ratio is undefined (constant q or k); read as at initialisation";
    return;
  }
  const HeadDiagnostics& w = d.heads[size_t(worst < 0 ? 0 : worst)];
  const std::string ratio = format("centred Var(q.k) / (d_k Var(q) Var(k)) %.2f at head %.0f, outside 1 +- %.2f",
                                   w.varianceRatioCentred, double(w.head), premiseBand(w));
  if (outside > 0) {
    d.stage = ModelStage::Trained;
    d.stageReason = "auto: " + std::to_string(outside) + " of " + std::to_string(tested) +
                    " heads break C3's premise (" + ratio +
                    "): q and k are not independent and isotropic, as in a trained model";
  } else {
    d.stage = ModelStage::Init;
    d.stageReason =
        "auto: every head's centred Var(q.k) / (d_k Var(q) Var(k)) is within the noise of independent, "
        "isotropic q and k (C3's premise), as at initialisation";
  }
}

/// The warnings and notes: each names the problem, the figure and the seed claims it rests on.
/// The thresholds and their reasons are in docs/DIAGNOSTICS.md.
inline void judge(Diagnostics& diag, bool learnable) {
  using Level = Finding::Level;
  decideStage(diag);
  const bool init = diag.stage == ModelStage::Init;
  const DiagnoseOptions& opt = diag.options;
  const bool plain = opt.softmax == SoftmaxForm::Plain;
  std::vector<Finding>& out = diag.findings;
  out.clear();
  const auto add = [&](Level level, Index head, const char* claims, std::string text) {
    out.push_back(Finding{level, head, claims, std::move(text)});
  };
  // A missing scale in a trained model is a fact of the run, not of one head: every head's
  // spread grows by 1/tau. It shows when the median head is far too spread (std > 3) while
  // 1/sqrt(d_k) would bring it to a trained head's spread (std <= 3).
  std::vector<double> spread, spreadInvSqrtDk;
  for (const HeadDiagnostics& h : diag.heads)
    if (h.visibleLogits > 0) spread.push_back(h.logitStd), spreadInvSqrtDk.push_back(h.invSqrtDkStd);
  const double medianSpread = quantiles(spread).median, medianInvSqrtDk = quantiles(spreadInvSqrtDk).median;
  const bool runMissingScale =
      !init && spread.size() >= 2 && medianSpread > 3 && medianInvSqrtDk > 0 && medianInvSqrtDk <= 3;
  for (const HeadDiagnostics& h : diag.heads) {
    const Index who = diag.heads.size() > 1 ? h.head : -1;
    const double sqrtDk = std::sqrt(double(std::max<Index>(1, h.headDim)));
    if (h.visibleLogits == 0) {
      add(Level::Note, who, "", "every query is fully masked: nothing to diagnose");
      continue;
    }
    const double s = h.logitStd, s1 = h.invSqrtDkStd;
    if (init && s > 3) {
      if (s1 >= 0.5 && s1 <= 2)
        add(Level::Warning, who, "C4, C14",
            format("logit std %.1f where 1/sqrt(d_k) would give %.2f: the scale looks missing", s, s1));
      else
        add(Level::Warning, who, "C14",
            format("logit std %.1f: far above the ~1 of a healthy start; check the scale and the initialisation "
                   "of q and k",
                   s));
    } else if (runMissingScale && s > 3 && s1 <= 3) {
      add(Level::Warning, who, "C4, C14",
          format("logit std %.1f where 1/sqrt(d_k) would give %.2f: with the median head at %.1f, %.1f x what "
                 "1/sqrt(d_k) gives, the scale looks missing",
                 s, s1, medianSpread, medianSpread / medianInvSqrtDk));
    } else if (!init && spread.size() < 2 && s > 3 && s1 <= 3) {
      add(Level::Note, who, "C4, C14",
          format("logit std %.1f where 1/sqrt(d_k) would give %.2f: if the model was trained with 1/sqrt(d_k) the "
                 "scale is missing; one head cannot tell that from a sharp learned head: diagnose every head",
                 s, s1));
    }
    const std::string lead = format("largest logit lead %.1f", h.logitGap.max);
    if (h.underflowFraction > 0.1) {
      add(Level::Warning, who, "C5",
          format("%.0f%% of rows lead their second logit by more than %.1f: every other weight underflows in ",
                 100 * h.underflowFraction, underflowGap(opt.precision)) +
              toString(opt.precision) + ", so their softmax Jacobian is zero and no gradient reaches q and k (" + lead +
              ")");
    } else if (h.saturatedFraction > 0.1) {
      if (init) {
        add(Level::Warning, who, "C5",
            format("%.0f%% of rows are saturated (max weight > 0.99): their softmax Jacobian is ~0 (norm median "
                   "%.2g), so gradients vanish before the head can learn where to look",
                   100 * h.saturatedFraction, h.jacobianNorm.median));
      } else {
        std::string pattern;
        if (h.modeOffsetShare >= 0.5)
          pattern = format(", its largest weight at offset %+.0f for %.0f%% of rows (a positional head)",
                           double(h.modeOffset), 100 * h.modeOffsetShare);
        else if (h.modeKeyShare >= 0.5)
          pattern = format(", its largest weight on key %.0f for %.0f%% of rows (a sink)", double(h.modeKey),
                           100 * h.modeKeyShare);
        std::string text =
            format("a sharp head: %.0f%% of rows are saturated (max weight > 0.99)", 100 * h.saturatedFraction);
        text += pattern;
        text += "; learned behaviour in a trained model, and gradients still flow in ";
        text += toString(opt.precision);
        text += " (" + lead;
        text += format(" < %.1f)", underflowGap(opt.precision));
        add(Level::Note, who, "C5", std::move(text));
      }
    }
    if (h.uniformFraction > 0.5)
      add(init ? Level::Warning : Level::Note, who, "C10",
          format("%.0f%% of rows are near uniform (entropy > 99%% of log n): ", 100 * h.uniformFraction) +
              (init ? "the logits are too small to choose between keys (temperature too high)"
                    : "an averaging head, or logits too small to choose between keys"));
    if (h.overflowFp32 > 0) {
      if (plain)
        add(Level::Warning, who, "C13",
            format("%.0f logits exceed 88.72: this softmax does not subtract the row maximum, so its exp overflows "
                   "even in fp32 and bf16",
                   double(h.overflowFp32)));
      else
        add(Level::Note, who, "C13",
            format("%.0f logits exceed 88.72: a softmax that does not subtract the row maximum would overflow in "
                   "fp32 and bf16; this one subtracts it and is safe",
                   double(h.overflowFp32)));
    } else if (h.overflowFp16 > 0) {
      const std::string count = format("%.0f logits (%.2f%%) exceed 11.09", double(h.overflowFp16),
                                       100.0 * double(h.overflowFp16) / double(h.visibleLogits));
      if (plain && opt.precision == Precision::Fp16)
        add(Level::Warning, who, "C13, C15",
            count +
                ": this fp16 softmax does not subtract the row maximum, so its exp overflows; compute it in "
                "fp32 or subtract the maximum");
      else
        add(Level::Note, who, "C13, C15",
            count + ": a softmax in fp16 that does not subtract the row maximum would overflow; " +
                (plain ? std::string("this one runs in ") + toString(opt.precision)
                       : std::string("this one subtracts it and is safe")));
    }
    if (init && h.variancePredicted > 0 && h.varianceObserved > 0) {
      const double ratio = h.varianceObserved / h.variancePredicted;
      if (ratio > 2 || ratio < 0.5)
        add(Level::Note, who, "C3",
            format("Var(q.k) = %.3g but d_k Var(q) Var(k) = %.3g (ratio %.2f): q and k are not independent with "
                   "zero mean, so 1/sqrt(d_k) is not the variance-preserving scale",
                   h.varianceObserved, h.variancePredicted, ratio));
    }
    if (learnable && h.headDim > 0) {
      const double ratio = h.tau * sqrtDk;
      if (ratio > 2 || ratio < 0.5)
        add(init ? Level::Warning : Level::Note, who, "C17",
            format("the learnable tau = %.3g is %.2f x 1/sqrt(d_k): ", h.tau, ratio) +
                (init ? "a start far from 1/sqrt(d_k) risks collapse" : "far from where such a tau starts"));
    }
  }
  if (diag.heads.size() > 1 && diag.headSimilarity > 0.9)
    add(init ? Level::Warning : Level::Note, -1, "C6, C12",
        format("heads attend alike (mean similarity %.3f, 1 = identical): ", diag.headSimilarity) +
            (init ? "head collapse" : "redundant heads, or head collapse"));
  diag.verdicts.clear();
  for (const Finding& f : out)
    diag.verdicts.push_back(std::string(f.level == Level::Warning ? "warning: " : "note: ") +
                            (f.head >= 0 ? "head " + std::to_string(f.head) + ": " : std::string()) + f.text +
                            (f.claims.empty() ? std::string() : " (" + f.claims + ")"));
  if (diag.healthy())
    diag.verdicts.insert(diag.verdicts.begin(), std::string("healthy: no warning at the ") + toString(diag.stage) +
                                                    " stage (" + toString(opt.precision) + ", " +
                                                    (plain ? "plain" : "max-subtracted") + " softmax)");
}

/// JSON number: finite as %.17g, non-finite as null.
inline std::string jsonNumber(double x) { return std::isfinite(x) ? format("%.17g", x) : std::string("null"); }

inline std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

inline std::string jsonQuantiles(const Quantiles& q) {
  return "{\"mean\":" + jsonNumber(q.mean) + ",\"min\":" + jsonNumber(q.min) + ",\"p05\":" + jsonNumber(q.p05) +
         ",\"median\":" + jsonNumber(q.median) + ",\"p95\":" + jsonNumber(q.p95) + ",\"max\":" + jsonNumber(q.max) +
         "}";
}

}  // namespace internal

inline Index Diagnostics::warnings() const {
  return Index(std::count_if(findings.begin(), findings.end(),
                             [](const Finding& f) { return f.level == Finding::Level::Warning; }));
}
inline Index Diagnostics::notes() const { return Index(findings.size()) - warnings(); }

/// \brief The diagnostics gathered by the last forward pass that wrote into `sink` (without
/// head similarity, which needs the weights of every head at once).
inline Diagnostics diagnostics(const DiagnosticsSink& sink, const DiagnoseOptions& options = {}) {
  Diagnostics d;
  d.options = options;
  for (Index h = 0; h < sink.heads(); ++h)
    d.heads.push_back(internal::summarize(sink.rows(h), sink.inputs(h), h, underflowGap(options.precision)));
  internal::judge(d, false);
  return d;
}

inline std::string Diagnostics::toString() const {
  std::string s;
  for (const HeadDiagnostics& h : heads) {
    s += (heads.size() > 1 ? "head " + std::to_string(h.head) + ": " : std::string()) + "d_k " +
         std::to_string(h.headDim) + ", " + std::to_string(h.queries) + " queries x " + std::to_string(h.keys) +
         " keys, tau " + internal::format("%.4g", h.tau) + "\n";
    s += internal::format("  logits   mean %.3f  std %.3f  min %.3f  max %.3f\n", h.logitMean, h.logitStd, h.logitMin,
                          h.logitMax);
    s += internal::format("  raw q.k  std %.3f (1/sqrt(d_k) would give %.3f); Var %.3g vs d_k Var(q) Var(k) %.3g",
                          h.rawStd, h.invSqrtDkStd, h.varianceObserved, h.variancePredicted) +
         internal::format(" (centred ratio %.2f)\n", h.varianceRatioCentred);
    s += internal::format("  rows     max weight median %.3f, entropy median %.3f nats (%.0f%% of log n), ",
                          h.maxWeight.median, h.entropy.median, 100 * h.entropyFraction.median) +
         internal::format("effective keys median %.1f\n", h.effectiveKeys.median);
    s += internal::format("           saturated %.1f%%, near uniform %.1f%%, Jacobian norm mean %.3g min %.3g\n",
                          100 * h.saturatedFraction, 100 * h.uniformFraction, h.jacobianNorm.mean, h.jacobianNorm.min);
    s += internal::format("           logit lead median %.2f max %.2f; top key %.0f for %.0f%% of rows, ",
                          h.logitGap.median, h.logitGap.max, double(h.modeKey), 100 * h.modeKeyShare) +
         internal::format("offset %+.0f for %.0f%%\n", double(h.modeOffset), 100 * h.modeOffsetShare);
    s += internal::format("  overflow max logit %.2f: %.0f above 11.09 (fp16), %.0f above 88.72 (bf16, fp32)\n",
                          h.logitMax, double(h.overflowFp16), double(h.overflowFp32));
    if (h.fullyMaskedRows > 0) s += "  " + std::to_string(h.fullyMaskedRows) + " fully masked rows\n";
  }
  if (heads.size() > 1 && std::isfinite(headSimilarity))
    s += internal::format("head similarity %.3f (1 - Jensen-Shannon / ln 2, mean over head pairs)\n", headSimilarity);
  s += std::string("stage: ") + sdpa::toString(stage) + " (" + stageReason + ")\n";
  for (const std::string& v : verdicts) s += v + "\n";
  const Index w = warnings(), n = notes();
  const auto plural = [](Index c, const char* what) { return std::to_string(c) + " " + what + (c == 1 ? "" : "s"); };
  s += "verdict: " + (w == 0 ? std::string("healthy") : plural(w, "warning")) +
       (n > 0 ? " (" + plural(n, "note") + ")" : std::string()) + "\n";
  return s;
}

inline std::string Diagnostics::toJson() const {
  using internal::jsonNumber;
  using internal::jsonString;
  std::string s = "{\"heads\":[";
  for (size_t i = 0; i < heads.size(); ++i) {
    const HeadDiagnostics& h = heads[i];
    s += std::string(i ? "," : "") + "{\"head\":" + std::to_string(h.head) + ",\"d_k\":" + std::to_string(h.headDim) +
         ",\"queries\":" + std::to_string(h.queries) + ",\"keys\":" + std::to_string(h.keys) +
         ",\"tau\":" + jsonNumber(h.tau) + ",\"visible_logits\":" + std::to_string(h.visibleLogits) +
         ",\"fully_masked_rows\":" + std::to_string(h.fullyMaskedRows) +
         ",\"single_key_rows\":" + std::to_string(h.singleKeyRows) + ",\"logit\":{\"mean\":" + jsonNumber(h.logitMean) +
         ",\"std\":" + jsonNumber(h.logitStd) + ",\"min\":" + jsonNumber(h.logitMin) +
         ",\"max\":" + jsonNumber(h.logitMax) + "},\"raw_std\":" + jsonNumber(h.rawStd) +
         ",\"inv_sqrt_dk_std\":" + jsonNumber(h.invSqrtDkStd) +
         ",\"max_weight\":" + internal::jsonQuantiles(h.maxWeight) +
         ",\"entropy\":" + internal::jsonQuantiles(h.entropy) +
         ",\"entropy_fraction\":" + internal::jsonQuantiles(h.entropyFraction) +
         ",\"effective_keys\":" + internal::jsonQuantiles(h.effectiveKeys) +
         ",\"jacobian_norm\":" + internal::jsonQuantiles(h.jacobianNorm) +
         ",\"logit_lead\":" + internal::jsonQuantiles(h.logitGap) +
         ",\"saturated_fraction\":" + jsonNumber(h.saturatedFraction) +
         ",\"uniform_fraction\":" + jsonNumber(h.uniformFraction) +
         ",\"underflow_fraction\":" + jsonNumber(h.underflowFraction) +
         ",\"top_key\":{\"key\":" + std::to_string(h.modeKey) + ",\"share\":" + jsonNumber(h.modeKeyShare) +
         "},\"top_offset\":{\"offset\":" + std::to_string(h.modeOffset) +
         ",\"share\":" + jsonNumber(h.modeOffsetShare) + "},\"overflow\":{\"fp16\":" + std::to_string(h.overflowFp16) +
         ",\"bf16\":" + std::to_string(h.overflowBf16) + ",\"fp32\":" + std::to_string(h.overflowFp32) +
         "},\"variance\":{\"observed\":" + jsonNumber(h.varianceObserved) +
         ",\"predicted\":" + jsonNumber(h.variancePredicted) +
         ",\"centred_ratio\":" + jsonNumber(h.varianceRatioCentred) + "}}";
  }
  s += "],\"head_similarity\":" + jsonNumber(headSimilarity) + ",\"stage\":" + jsonString(sdpa::toString(stage)) +
       ",\"stage_reason\":" + jsonString(stageReason) +
       ",\"precision\":" + jsonString(sdpa::toString(options.precision)) +
       ",\"softmax\":" + jsonString(options.softmax == SoftmaxForm::Plain ? "plain" : "max-subtracted") +
       ",\"level\":" + jsonString(healthy() ? "healthy" : "warning") + ",\"warnings\":" + std::to_string(warnings()) +
       ",\"notes\":" + std::to_string(notes()) + ",\"findings\":[";
  for (size_t i = 0; i < findings.size(); ++i) {
    const Finding& f = findings[i];
    s += std::string(i ? "," : "") +
         "{\"level\":" + jsonString(f.level == Finding::Level::Warning ? "warning" : "note") +
         ",\"head\":" + (f.head >= 0 ? std::to_string(f.head) : std::string("null")) +
         ",\"claims\":" + jsonString(f.claims) + ",\"text\":" + jsonString(f.text) + "}";
  }
  s += "],\"verdicts\":[";
  for (size_t i = 0; i < verdicts.size(); ++i) s += std::string(i ? "," : "") + jsonString(verdicts[i]);
  return s + "]}";
}

namespace internal {

/// 1 - JS(p, r) / ln 2 for two distributions over the same keys (1 = identical, 0 = disjoint).
inline double jsSimilarity(const Eigen::Ref<const Eigen::RowVectorXd>& p,
                           const Eigen::Ref<const Eigen::RowVectorXd>& r) {
  double js = 0;
  for (Index j = 0; j < p.size(); ++j) {
    const double m = 0.5 * (p(j) + r(j));
    if (p(j) > 0) js += 0.5 * p(j) * std::log(p(j) / m);
    if (r(j) > 0) js += 0.5 * r(j) * std::log(r(j) / m);
  }
  return 1 - std::max(0.0, js) / std::log(2.0);
}

template <typename DQ, typename DK, typename Scale, typename Mask>
Diagnostics diagnoseImpl(const char* where, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                         const Heads& heads, const Scale& scale, const Mask& mask, const DiagnoseOptions& options) {
  assertScalars<DQ, DK>();
  assertPolicyTypes<Scale, Mask>();
  SDPA_STATIC_ASSERT(!scale::DependsOnKeyCount<Scale>,
                     diagnose_TAKES_A_FIXED_TAU_PER_HEAD__NOT_scale_LogN__READ_attentionWeights_FOR_ITS_ENTROPY);
  using Scalar = typename DQ::Scalar;
  // k doubles as v (n_k x H_kv d_k) for the shape check; v is never read here.
  const HeadDims dims = checkBatch(where, q.rows(), q.cols(), k.rows(), k.cols(), k.rows(), k.cols(),
                                   singleItem(q.rows(), k.rows()), heads, scale, mask, Dropout{});
  const ConstRef<Scalar> qr(q), kr(k);
  Diagnostics d;
  d.options = options;
  std::vector<Eigen::MatrixXd> weights;
  typename forward_naive_impl<Scalar>::Scratch scratch;
  std::vector<RowStats> rows(size_t(q.rows()));
  Vector<Scalar> lse(q.rows());
  const HeadTaus<Scalar> taus(scale, heads.query, dims.dK);
  for (Index h = 0; h < heads.query; ++h) {
    const Index g = h / heads.groupSize();
    const auto qh = qr.middleCols(h * dims.dK, dims.dK);
    const auto kh = kr.middleCols(g * dims.dK, dims.dK);
    forward_naive_impl<Scalar>::softmaxWithStats(qh, kh, taus.tau(h), mask, h, lse, scratch, rows, 0);
    d.heads.push_back(summarize(rows, headInputs(qh, kh, double(taus.tau(h))), h, underflowGap(options.precision)));
    weights.push_back(scratch.s.template cast<double>());
  }
  if (heads.query > 1) {
    d.pairwiseSimilarity = Eigen::MatrixXd::Identity(heads.query, heads.query);
    double total = 0;
    Index pairs = 0;
    for (Index a = 0; a < heads.query; ++a)
      for (Index b = a + 1; b < heads.query; ++b) {
        double sum = 0;
        Index n = 0;
        for (Index i = 0; i < q.rows(); ++i) {
          if (weights[size_t(a)].row(i).sum() == 0) continue;  // fully masked
          sum += jsSimilarity(weights[size_t(a)].row(i), weights[size_t(b)].row(i));
          ++n;
        }
        const double sim = n ? sum / double(n) : 1.0;
        d.pairwiseSimilarity(a, b) = d.pairwiseSimilarity(b, a) = sim;
        total += sim;
        ++pairs;
      }
    d.headSimilarity = total / double(pairs);
  }
  judge(d, std::decay_t<Scale>::IsLearnable);
  return d;
}

}  // namespace internal

/**
 * \brief Diagnoses one head: q n_q x d_k, k n_k x d_k, with the scale and mask the model uses.
 * Materialises n_q x n_k. `options` says how to read the figures (stage, precision, softmax).
 */
template <typename DQ, typename DK, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
Diagnostics diagnose(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Scale& scale = Scale(),
                     const Mask& mask = Mask(), const DiagnoseOptions& options = {}) {
  internal::checkAttentionShapes("sdpa::diagnose", q.rows(), q.cols(), k.rows(), k.cols(), k.rows(), 0);
  return internal::diagnoseImpl("sdpa::diagnose", q, k, Heads{1}, scale, mask, options);
}

/// \brief Diagnoses packed multi-head q (n_q x H d_k) and k (n_k x H_kv d_k), with head
/// similarity. Materialises H x n_q x n_k.
template <typename DQ, typename DK, typename Scale = scale::InvSqrtDk, typename Mask = mask::None>
Diagnostics diagnose(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Heads& heads,
                     const Scale& scale = Scale(), const Mask& mask = Mask(), const DiagnoseOptions& options = {}) {
  return internal::diagnoseImpl("sdpa::diagnose", q, k, heads, scale, mask, options);
}

/// \brief What calibrateTemperature aims for: a mean entropy fraction H / log(n_visible) in
/// (0, 1), or a logit std > 0.
struct CalibrationTarget {
  enum class Kind { EntropyFraction, LogitStd } kind;
  double value;
  static CalibrationTarget entropyFraction(double f) { return {Kind::EntropyFraction, f}; }
  static CalibrationTarget logitStd(double s) { return {Kind::LogitStd, s}; }
};

/**
 * \brief The tau > 0 at which one head reaches the target (seed C10): the mean entropy fraction
 * falls and the logit std rises monotonically with tau (without a bias), so a bisection on
 * log tau over [1e-6, 1e6] (60 steps, relative precision ~1e-9) finds it. Throws
 * std::invalid_argument if the target is out of range or not reachable in that bracket.
 */
template <typename DQ, typename DK, typename Mask = mask::None>
double calibrateTemperature(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                            const CalibrationTarget& target, const Mask& mask = Mask()) {
  constexpr const char* where = "sdpa::calibrateTemperature";
  const bool entropy = target.kind == CalibrationTarget::Kind::EntropyFraction;
  if (entropy ? !(target.value > 0 && target.value < 1) : !(target.value > 0 && std::isfinite(target.value)))
    internal::throwInvalid(where, "the target must be an entropy fraction in (0, 1) or a logit std > 0, got " +
                                      std::to_string(target.value));
  // f(tau) increases with tau: the logit std, or minus the entropy fraction.
  const auto f = [&](double logTau) {
    const HeadDiagnostics h = diagnose(q, k, scale::Constant{std::exp(logTau)}, mask).heads.front();
    return entropy ? -h.entropyFraction.mean : h.logitStd;
  };
  const double goal = entropy ? -target.value : target.value;
  double lo = std::log(1e-6), hi = std::log(1e6);
  if (!(f(lo) <= goal && goal <= f(hi)))
    internal::throwInvalid(where,
                           "the target " + std::to_string(target.value) + " is not reached for tau in [1e-6, 1e6]");
  for (int i = 0; i < 60; ++i) {
    const double mid = 0.5 * (lo + hi);
    (f(mid) < goal ? lo : hi) = mid;
  }
  return std::exp(0.5 * (lo + hi));
}

}  // namespace sdpa

#endif  // SDPA_DIAGNOSTICS_HPP
