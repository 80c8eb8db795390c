// A real trained model: all-MiniLM-L6-v2's own q, k, v and attention output on one text
// (tests/data/minilm, Apache-2.0; scripts/dump_attention.py regenerates them), and the same
// architecture at random initialisation (tests/data/minilm-init-d64). The diagnostics' verdicts
// must be healthy on the trained model with its scale, say the scale is missing without it, and
// keep the initialisation warnings at initialisation; multiHeadAttention must reproduce the
// model's own attention output within float32's error bound.
#include <sdpa/sdpa.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include <sdpa/npy.hpp>
#include "../tools/cli_args.hpp"
#include "support/cases.hpp"

using namespace sdpa_test;
namespace scale = sdpa::scale;
using sdpa::Finding;
using sdpa::ModelStage;

namespace {

const std::string kData = SDPA_TEST_DATA;

/// One fixture as a packed matrix (positions x H d) and its head count.
sdpa_tools::AttentionInput load(const std::string& file) {
  const std::string path = kData + "/" + file;
  return sdpa_tools::attentionInput(sdpa::npy::read(path), path, "fixture", 0, 0);
}

/// The heads with a warning whose text contains `what`.
Index headsWarned(const sdpa::Diagnostics& d, const std::string& what) {
  return Index(std::count_if(d.findings.begin(), d.findings.end(), [&](const Finding& f) {
    return f.level == Finding::Level::Warning && f.text.find(what) != std::string::npos;
  }));
}

}  // namespace

TEST_CASE("a trained model with its own scale is healthy; its stage is read from the data  [seed C3, C14, C18]",
          "[diagnostics][real-model]") {
  for (int layer = 0; layer < 6; ++layer) {
    const auto q = load("minilm/layer" + std::to_string(layer) + ".q.npy");
    const auto k = load("minilm/layer" + std::to_string(layer) + ".k.npy");
    REQUIRE(q.heads == 12);
    REQUIRE(q.headDim == 32);
    const sdpa::Diagnostics d = sdpa::diagnose(q.packed, k.packed, sdpa::Heads{12});
    INFO("layer " << layer << "\n" << d.toString());
    CHECK(d.stage == ModelStage::Trained);
    CHECK(d.healthy());
    // The scaled logits of a trained head spread by about 1-3, not the ~1 of initialisation,
    // and q.k's variance is not d_k Var(q) Var(k): facts, printed, not warnings.
    Index outside = 0;
    for (const auto& h : d.heads) outside += std::abs(h.varianceRatioCentred - 1) > sdpa::internal::premiseBand(h);
    CHECK(outside >= 4);
  }
}

TEST_CASE("the same trained model without its scale: the scale is missing for most heads  [seed C4, C14]",
          "[diagnostics][real-model]") {
  Index flagged = 0;
  for (int layer = 0; layer < 6; ++layer) {
    const auto q = load("minilm/layer" + std::to_string(layer) + ".q.npy");
    const auto k = load("minilm/layer" + std::to_string(layer) + ".k.npy");
    const sdpa::Diagnostics d = sdpa::diagnose(q.packed, k.packed, sdpa::Heads{12}, scale::None{});
    INFO("layer " << layer << "\n" << d.toString());
    CHECK(d.stage == ModelStage::Trained);  // the stage does not depend on the scale
    CHECK_FALSE(d.healthy());
    const Index missing = headsWarned(d, "the scale looks missing");
    CHECK(missing >= 9);  // of 12: measured 9-12 per layer on four texts
    flagged += missing;
  }
  CHECK(flagged >= 64);  // of 72: measured 68
}

TEST_CASE(
    "the architecture at random initialisation: unscaled d_k = 64 heads are warned as before  [seed C4, C5, "
    "C14]",
    "[diagnostics][real-model]") {
  const auto q = load("minilm-init-d64/layer0.q.npy"), k = load("minilm-init-d64/layer0.k.npy");
  REQUIRE(q.heads == 6);
  REQUIRE(q.headDim == 64);
  const sdpa::Diagnostics unscaled = sdpa::diagnose(q.packed, k.packed, sdpa::Heads{6}, scale::None{});
  INFO(unscaled.toString());
  CHECK(unscaled.stage == ModelStage::Init);
  CHECK(headsWarned(unscaled, "the scale looks missing") == 6);
  CHECK(headsWarned(unscaled, "saturated") >= 3);  // 4 of 6 with 21 rows each
  const sdpa::Diagnostics scaled = sdpa::diagnose(q.packed, k.packed, sdpa::Heads{6});
  INFO(scaled.toString());
  CHECK(scaled.stage == ModelStage::Init);
  CHECK(scaled.healthy());
}

TEST_CASE("a sink on the trained model: the centred ratio of diagnose, from the rows' raw sums  [seed C3]",
          "[diagnostics][real-model][sink]") {
  // Float q and k, both kernels: every row sees every key, so the ratio comes from the rows' sums
  // of q.k squared (internal::streamedInner) where the means keep 1/16 of them, else from the
  // Gram matrices; within the bound of test_diagnostics.cpp against the ratio in double.
  const double u = std::ldexp(1.0, -24);
  for (int layer = 0; layer < 6; ++layer) {
    const auto q = load("minilm/layer" + std::to_string(layer) + ".q.npy");
    const auto k = load("minilm/layer" + std::to_string(layer) + ".k.npy");
    const Index H = q.heads, d = q.headDim;
    const Mat<float> qf = q.packed.cast<float>(), kf = k.packed.cast<float>();
    const double steps = double(kf.rows() + sdpa::internal::kMomentRows + d + 2);
    forEachKernel([&](const auto& kern, const char* name) {
      sdpa::DiagnosticsSink sink;
      sdpa::multiHeadAttentionForward(kern, qf, kf, kf, sdpa::Heads{H}, scale::InvSqrtDk{}, sdpa::mask::None{}, {},
                                      &sink);
      for (Index h = 0; h < H; ++h) {
        const auto [want, spread] =
            centredRatioOf(qf.middleCols(h * d, d).cast<double>(), kf.middleCols(h * d, d).cast<double>());
        INFO(name << ", layer " << layer << ", head " << h << ": " << sink.inputs(h).centredRatio << " against "
                  << want);
        CHECK(std::abs(sink.inputs(h).centredRatio - want) <=
              sdpa::internal::kStreamedLoss * steps * u * spread * std::abs(want));
      }
    });
  }
}

TEST_CASE("the stage can be given: a trained model read as at initialisation gets init's thresholds",
          "[diagnostics][real-model]") {
  const auto q = load("minilm/layer0.q.npy"), k = load("minilm/layer0.k.npy");
  sdpa::DiagnoseOptions init;
  init.stage = ModelStage::Init;
  const sdpa::Diagnostics d =
      sdpa::diagnose(q.packed, k.packed, sdpa::Heads{12}, scale::InvSqrtDk{}, sdpa::mask::None{}, init);
  INFO(d.toString());
  CHECK(d.stage == ModelStage::Init);
  CHECK(d.stageReason == "set by the caller");
  // Head 2, a previous-token head (logit std 10.7), is a warning at init, a note when trained.
  CHECK(headsWarned(d, "saturated") == 1);
  const sdpa::Diagnostics trained = sdpa::diagnose(q.packed, k.packed, sdpa::Heads{12});
  const auto note = std::find_if(trained.findings.begin(), trained.findings.end(),
                                 [](const Finding& f) { return f.text.find("sharp head") != std::string::npos; });
  REQUIRE(note != trained.findings.end());
  CHECK(note->head == 2);
  CHECK(note->text.find("offset -1") != std::string::npos);  // the previous token
}

TEST_CASE("multiHeadAttention reproduces the model's own attention output within float32's error bound",
          "[real-model][forward]") {
  // Worst-case bound, per output entry, of a float computation of softmax(tau q k^T) v against
  // the exact one (u = 2^-24, gamma_m = m u / (1 - m u)): each logit is off by at most
  // E_ij = gamma_{d+1} tau sum_c |q_ic k_jc| (a d-term dot product and the scale), which moves
  // each weight by a factor within exp(+-2 max_j E_ij); exp, the sum, the division and the
  // n_k-term sum of p v add gamma_{2 n_k + 8} sum_j p_j |v_j|. Any summation order obeys it.
  const double u = std::ldexp(1.0, -24);
  const auto gamma = [u](double m) { return m * u / (1 - m * u); };
  for (const int layer : {0, 3, 5}) {
    const std::string base = "minilm/layer" + std::to_string(layer);
    const auto q = load(base + ".q.npy"), k = load(base + ".k.npy"), v = load(base + ".v.npy");
    const auto model = load(base + ".out.npy");
    const Index H = q.heads, d = q.headDim, n = q.positions;
    const double tau = 1 / std::sqrt(double(d));
    const Mat<float> qf = q.packed.cast<float>(), kf = k.packed.cast<float>(), vf = v.packed.cast<float>();
    const Mat<double> tiled = sdpa::multiHeadAttention(qf, kf, vf, sdpa::Heads{H}).cast<double>();
    const Mat<double> naive =
        sdpa::multiHeadAttention(sdpa::kernel::Naive{}, qf, kf, vf, sdpa::Heads{H}).cast<double>();
    double worst = 0;
    for (Index h = 0; h < H; ++h) {
      const Mat<double> qh = q.packed.middleCols(h * d, d), kh = k.packed.middleCols(h * d, d),
                        vh = v.packed.middleCols(h * d, d);
      Mat<double> s = tau * qh * kh.transpose();
      const Mat<double> e = gamma(d + 1) * tau * qh.cwiseAbs() * kh.cwiseAbs().transpose();
      Mat<double> p = (s.colwise() - s.rowwise().maxCoeff()).array().exp().matrix();
      p.array().colwise() /= p.rowwise().sum().array();
      const Mat<double> exact = p * vh, magnitude = p * vh.cwiseAbs();
      for (Index i = 0; i < n; ++i)
        for (Index c = 0; c < d; ++c) {
          const double bound = (std::expm1(2 * e.row(i).maxCoeff()) + gamma(2 * n + 8)) * magnitude(i, c);
          for (const Mat<double>* got : {&tiled, &naive, &model.packed}) {
            const double err = std::abs((*got)(i, h * d + c) - exact(i, c));
            worst = std::max(worst, err / bound);
            if (err > bound) {
              INFO("layer " << layer << " head " << h << " row " << i << " col " << c << ": error " << err
                            << " > bound " << bound);
              CHECK(err <= bound);
            }
          }
        }
    }
    INFO("layer " << layer << ": largest error / bound " << worst);
    CHECK(worst <= 1);
    CHECK(worst > 0);  // the comparison ran on real data
  }
}
