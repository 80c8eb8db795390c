// Reruns the seed article's experiment (C6, C11, C12, C17): a one-layer decoder Transformer
// character language model, d_model = 128 with 8 heads (d_k = 16) and 2 heads (d_k = 64), trained
// with sdpa's attention under four scale policies (1/sqrt(d_k), none, learnable from 1, learnable
// from 1/sqrt(d_k)). Same seed, data, batches and steps for every run. See docs/EXPERIMENT.md.
//
//   cmake --preset release && cmake --build --preset release --target char_lm
//   build/release/experiments/char_lm/char_lm --out char_lm_out        # the full run, ~10 min
//   build/release/experiments/char_lm/char_lm --quick --out /tmp/quick  # a smoke run, seconds
//   build/release/experiments/char_lm/char_lm --only dk64-scaled --generate 400   # + text, KvCache
//
// Writes into --out: summary.md / summary.csv (final figures), heads.csv (per head), for each run
// runs/<name>/train.csv (every step), eval.csv (every evaluation) and attention.svg (heat maps of
// a fixed validation sample), and the figures loss_curves.svg and dynamics.svg; with --generate N,
// runs/<name>/generated.txt: N characters generated token by token through a sdpa::KvCache.
#include <sdpa/sdpa.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "model.hpp"
#include "svg.hpp"

namespace {

using char_lm::Index;
namespace fs = std::filesystem;

// The default corpus: Debian's licence texts (package base-files, present on every Debian
// system), one copy of each licence family, about 145 KB of English prose.
const char* const kDefaultDir = "/usr/share/common-licenses/";
const char* const kDefaultFiles[] = {"Apache-2.0", "Artistic", "BSD",      "CC0-1.0", "GFDL-1.3",
                                     "GPL-2",      "GPL-3",    "LGPL-2.1", "MPL-2.0"};

struct Options {
  std::vector<std::string> textFiles;
  std::string out = "char_lm_out";
  double epochs = 15;
  long steps = 0;  // 0: from epochs
  Index batch = 32, seqLen = 64, dModel = 128;
  double lr = 1e-3, weightDecay = 0.01, clip = 0, qkGain = 1;
  unsigned long long seed = 1;
  int jobs = 0;        // 0: one per hardware thread
  long evalEvery = 0;  // 0: twice per epoch
  Index evalBatches = 8;
  bool quick = false;
  std::string only;   // run names containing this substring
  long generate = 0;  // characters each trained model generates through a KvCache (generated.txt)
};

[[noreturn]] void usage(const std::string& error) {
  std::cerr << "char_lm: " << error << "\n"
            << "usage: char_lm [--text FILE]... [--out DIR] [--epochs E | --steps N] [--batch B] [--seq T]\n"
            << "               [--lr LR] [--weight-decay WD] [--clip NORM] [--qk-gain G] [--seed S] [--jobs J]\n"
            << "               [--eval-every N] [--only SUBSTRING] [--generate N] [--quick]\n";
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    try {
      if (a == "--text")
        o.textFiles.push_back(next());
      else if (a == "--out")
        o.out = next();
      else if (a == "--epochs")
        o.epochs = std::stod(next());
      else if (a == "--steps")
        o.steps = std::stol(next());
      else if (a == "--batch")
        o.batch = std::stol(next());
      else if (a == "--seq")
        o.seqLen = std::stol(next());
      else if (a == "--lr")
        o.lr = std::stod(next());
      else if (a == "--weight-decay")
        o.weightDecay = std::stod(next());
      else if (a == "--clip")
        o.clip = std::stod(next());
      else if (a == "--qk-gain")
        o.qkGain = std::stod(next());
      else if (a == "--seed")
        o.seed = std::stoull(next());
      else if (a == "--jobs")
        o.jobs = std::stoi(next());
      else if (a == "--eval-every")
        o.evalEvery = std::stol(next());
      else if (a == "--only")
        o.only = next();
      else if (a == "--quick")
        o.quick = true;
      else if (a == "--generate")
        o.generate = std::stol(next());
      else if (a == "--help" || a == "-h")
        usage("help");
      else
        usage("unknown option " + a);
    } catch (const std::logic_error&) {
      usage("bad value for " + a);
    }
  }
  if (o.quick) {  // every code path, little arithmetic: the CI smoke run, also under sanitizers
    if (o.generate == 0) o.generate = 40;
    o.steps = 6;  // two evaluations; 40 generated tokens wrap the ring cache of 16 twice
    o.batch = 2;
    o.seqLen = 16;
    o.evalEvery = 3;
    o.evalBatches = 1;
  }
  if (o.batch < 1 || o.seqLen < 2 || o.steps < 0 || o.epochs <= 0 || o.lr <= 0 || o.clip < 0 || !(o.qkGain > 0))
    usage("batch, seq, steps, epochs, lr, clip and qk-gain must be positive");
  return o;
}

// ---------------------------------------------------------------------------------------------

struct Corpus {
  std::string alphabet;         // sorted distinct bytes
  std::vector<int> train, val;  // token ids
  std::string valText;
  std::vector<std::string> sources;
};

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// The last tenth of each file is validation text, the rest training text.
Corpus loadCorpus(const Options& o) {
  std::vector<std::string> files = o.textFiles;
  if (files.empty())
    for (const char* f : kDefaultFiles) files.push_back(std::string(kDefaultDir) + f);
  std::string train, val;
  Corpus c;
  for (const std::string& f : files) {
    const std::string text = readFile(f);
    const size_t cut = text.size() - text.size() / 10;
    train += text.substr(0, cut);
    val += text.substr(cut);
    c.sources.push_back(f);
  }
  std::set<unsigned char> chars(train.begin(), train.end());
  chars.insert(val.begin(), val.end());
  c.alphabet.assign(chars.begin(), chars.end());
  int id[256] = {};
  for (size_t i = 0; i < c.alphabet.size(); ++i) id[static_cast<unsigned char>(c.alphabet[i])] = int(i);
  for (unsigned char ch : train) c.train.push_back(id[ch]);
  for (unsigned char ch : val) c.val.push_back(id[ch]);
  c.valText = val;
  const size_t need = size_t(o.seqLen) + 1;
  if (c.train.size() < need || c.val.size() < need)
    throw std::runtime_error("the text is too short: training and validation parts need " + std::to_string(need) +
                             " characters each");
  return c;
}

// ---------------------------------------------------------------------------------------------

enum class Policy { Scaled, Unscaled, LearnableFromOne, LearnableFromInvSqrt };

struct RunSpec {
  std::string name;
  Index heads;
  Policy policy;
};

const char* policyLabel(Policy p) {
  switch (p) {
    case Policy::Scaled:
      return "1/sqrt(d_k)";
    case Policy::Unscaled:
      return "none (tau = 1)";
    case Policy::LearnableFromOne:
      return "learnable from 1";
    case Policy::LearnableFromInvSqrt:
      return "learnable from 1/sqrt(d_k)";
  }
  return "";
}

const char* policyColor(Policy p) {
  switch (p) {
    case Policy::Scaled:
      return "#1f77b4";
    case Policy::Unscaled:
      return "#d62728";
    case Policy::LearnableFromOne:
      return "#ff7f0e";
    case Policy::LearnableFromInvSqrt:
      return "#2ca02c";
  }
  return "#000";
}

struct EvalPoint {
  long step;
  double valLoss, trainLoss;  // trainLoss: mean of the steps since the previous evaluation
  double entropyFraction, maxWeight, headSimilarity, logitStd, tau;
};

struct HeadFigures {
  double entropy, entropyFraction, maxWeight, effectiveKeys;
};

struct RunResult {
  RunSpec spec;
  Index headDim = 0;
  std::vector<EvalPoint> evals;
  std::vector<HeadFigures> heads;
  long steps = 0, nonFiniteLoss = 0, nonFiniteGrad = 0, skipped = 0;
  double bestVal = INFINITY, seconds = 0;
};

/// A batch of windows: tokens text[o, o+T), targets text[o+1, o+T+1) for each offset o.
void window(const std::vector<int>& text, const std::vector<size_t>& offsets, Index seqLen, std::vector<int>& tokens,
            std::vector<int>& targets) {
  tokens.clear();
  targets.clear();
  for (size_t o : offsets)
    for (Index t = 0; t < seqLen; ++t) {
      tokens.push_back(text[o + size_t(t)]);
      targets.push_back(text[o + size_t(t) + 1]);
    }
}

std::mutex g_printMutex;

/**
 * Greedy generation of o.generate characters after a prompt (the validation text's first T / 2),
 * token by token through a sdpa::KvCache ring of the model's T positions (sliding-window
 * attention: generation runs past the T positions of training, whose embeddings wrap as its
 * windows' do). Every 16th token and the last, the logits are checked against recomputing the
 * whole sequence (Model::sequenceLogits); writes generated.txt and prints the largest difference.
 */
template <typename Model>
void generate(const Model& model, const Corpus& corpus, const Options& o, const std::string& name,
              const fs::path& dir) {
  const Index T = o.seqLen, dK = model.config().headDim();
  auto cache = sdpa::KvCache<float>::ring({model.config().heads, dK, dK}, T, 1);
  const auto lr = sdpa::mask::Align::LowerRight;
  std::vector<int> tokens(corpus.val.begin(), corpus.val.begin() + long(T / 2));
  char_lm::Matrix<float> logits;
  for (int t : tokens) logits = model.decodeStep(t, cache, 0, sdpa::mask::SlidingWindow{T - 1, 0, lr});
  double worst = 0;
  for (long i = 0; i < o.generate; ++i) {
    int next = 0;
    logits.row(0).maxCoeff(&next);
    tokens.push_back(next);
    logits = model.decodeStep(next, cache, 0, sdpa::mask::SlidingWindow{T - 1, 0, lr});
    if (i % 16 == 15 || i + 1 == o.generate) {
      const char_lm::Matrix<float> whole =
          model.sequenceLogits(tokens, sdpa::mask::SlidingWindow{T - 1, 0, sdpa::mask::Align::UpperLeft});
      worst = std::max(worst, double((whole.bottomRows(1) - logits).cwiseAbs().maxCoeff()));
    }
  }
  std::string text;
  for (size_t i = size_t(T / 2); i < tokens.size(); ++i) text += corpus.alphabet[size_t(tokens[i])];
  std::ofstream(dir / "generated.txt") << text << "\n";
  std::replace(text.begin(), text.end(), '\n', ' ');
  const std::lock_guard<std::mutex> lock(g_printMutex);
  std::printf("%s: %ld characters through a KvCache ring of %ld (largest |logit - recomputed| %.2g): %.60s...\n",
              name.c_str(), o.generate, long(T), worst, text.c_str());
}

template <typename Scale>
RunResult train(const RunSpec& spec, Scale scale, const Corpus& corpus, const Options& o, long steps, long evalEvery,
                const fs::path& dir) {
  using Model = char_lm::Model<float, Scale>;
  const auto start = std::chrono::steady_clock::now();
  char_lm::ModelConfig cfg;
  cfg.vocab = Index(corpus.alphabet.size());
  cfg.seqLen = o.seqLen;
  cfg.dModel = o.dModel;
  cfg.heads = spec.heads;
  cfg.qkGain = o.qkGain;
  std::mt19937_64 initGen(o.seed), dataGen(o.seed + 1);
  Model model(cfg, std::move(scale), initGen);
  char_lm::AdamWConfig adam;
  adam.lr = o.lr;
  adam.weightDecay = o.weightDecay;
  double tauM = 0, tauV = 0;  // AdamW moments of a learnable tau (no weight decay)

  RunResult r;
  r.spec = spec;
  r.headDim = cfg.headDim();
  r.steps = steps;
  fs::create_directories(dir);
  std::ofstream trainCsv(dir / "train.csv"), evalCsv(dir / "eval.csv");
  trainCsv << "step,train_loss,grad_norm,tau,dtau,finite\n";
  evalCsv << "step,val_loss,train_loss,entropy_fraction,max_weight,head_similarity,logit_std,tau\n";

  // Validation: non-overlapping windows from the start of the validation text.
  std::vector<size_t> valOffsets;
  for (size_t off = 0; off + size_t(o.seqLen) + 1 <= corpus.val.size(); off += size_t(o.seqLen))
    valOffsets.push_back(off);
  valOffsets.resize(std::min(valOffsets.size(), size_t(o.evalBatches * o.batch)));
  std::vector<int> tokens, targets, sampleTokens, sampleTargets;
  window(corpus.val, {0}, o.seqLen, sampleTokens, sampleTargets);

  auto diagnoseSample = [&]() {
    model.loss(sampleTokens, sampleTargets);
    return sdpa::diagnose(model.queries(), model.keys(), model.heads(), model.scale(), Model::causal());
  };
  double trainSum = 0;
  long trainCount = 0;
  auto evaluate = [&](long step) {
    double sum = 0;
    size_t batches = 0;
    for (size_t b = 0; b < valOffsets.size(); b += size_t(o.batch)) {
      const std::vector<size_t> offs(valOffsets.begin() + long(b),
                                     valOffsets.begin() + long(std::min(valOffsets.size(), b + size_t(o.batch))));
      window(corpus.val, offs, o.seqLen, tokens, targets);
      sum += model.loss(tokens, targets) * double(offs.size());
      batches += offs.size();
    }
    const sdpa::Diagnostics d = diagnoseSample();
    EvalPoint e{
        step,       sum / double(batches), trainCount ? trainSum / double(trainCount) : NAN, 0, 0, d.headSimilarity, 0,
        model.tau()};
    for (const auto& h : d.heads) {
      e.entropyFraction += h.entropyFraction.mean / double(d.heads.size());
      e.maxWeight += h.maxWeight.mean / double(d.heads.size());
      e.logitStd += h.logitStd / double(d.heads.size());
    }
    trainSum = 0;
    trainCount = 0;
    r.evals.push_back(e);
    if (std::isfinite(e.valLoss)) r.bestVal = std::min(r.bestVal, e.valLoss);
    evalCsv << e.step << ',' << e.valLoss << ',' << e.trainLoss << ',' << e.entropyFraction << ',' << e.maxWeight << ','
            << e.headSimilarity << ',' << e.logitStd << ',' << e.tau << '\n';
    std::lock_guard<std::mutex> lock(g_printMutex);
    std::printf("[%-26s] step %5ld/%ld  train %.3f  val %.3f  H/log n %.2f  p_max %.2f  sim %.2f  tau %.4f\n",
                spec.name.c_str(), step, steps, e.trainLoss, e.valLoss, e.entropyFraction, e.maxWeight,
                e.headSimilarity, e.tau);
    std::fflush(stdout);
  };

  evaluate(0);
  std::uniform_int_distribution<size_t> offsetDist(0, corpus.train.size() - size_t(o.seqLen) - 1);
  std::vector<size_t> offsets(size_t(o.batch));
  for (long step = 1; step <= steps; ++step) {
    for (size_t& off : offsets) off = offsetDist(dataGen);
    window(corpus.train, offsets, o.seqLen, tokens, targets);
    model.zeroGrad();
    const double loss = model.forward(tokens, targets);
    model.backward();
    double norm2 = 0, dtau = 0;
    for (const auto& p : model.params()) norm2 += double(p.grad.squaredNorm());
    if constexpr (Model::IsLearnable) dtau = double(model.scale().grad()), norm2 += dtau * dtau;
    const double gradNorm = std::sqrt(norm2);
    const bool finite = std::isfinite(loss) && std::isfinite(gradNorm);
    trainCsv << step << ',' << loss << ',' << gradNorm << ',' << model.tau() << ',' << dtau << ',' << int(finite)
             << '\n';
    if (!std::isfinite(loss)) ++r.nonFiniteLoss;
    if (!std::isfinite(gradNorm)) ++r.nonFiniteGrad;
    if (finite) {
      trainSum += loss;
      ++trainCount;
      // Clipping by the global norm (off by default), then AdamW; a non-finite step is skipped,
      // as a mixed-precision loss scaler would.
      const double c = (o.clip > 0 && gradNorm > o.clip) ? o.clip / gradNorm : 1.0;
      for (auto& p : model.params()) {
        if (c != 1.0) p.grad *= float(c);
        char_lm::adamWStep(p, adam, step);
      }
      if constexpr (Model::IsLearnable) {
        const double g = dtau * c;
        tauM = adam.beta1 * tauM + (1 - adam.beta1) * g;
        tauV = adam.beta2 * tauV + (1 - adam.beta2) * g * g;
        const double mHat = tauM / (1 - std::pow(adam.beta1, double(step)));
        const double vHat = tauV / (1 - std::pow(adam.beta2, double(step)));
        model.scale().setValue(float(model.tau() - adam.lr * mHat / (std::sqrt(vHat) + adam.eps)));
      }
    } else {
      ++r.skipped;
    }
    if (step % evalEvery == 0 || step == steps) evaluate(step);
  }

  // Heat maps and per-head figures of the fixed validation sample.
  const sdpa::Diagnostics d = diagnoseSample();
  const Index dk = cfg.headDim();
  std::vector<Eigen::MatrixXd> maps;
  std::vector<std::string> titles;
  for (Index h = 0; h < cfg.heads; ++h) {
    const auto& hd = d.heads[size_t(h)];
    r.heads.push_back({hd.entropy.mean, hd.entropyFraction.mean, hd.maxWeight.mean, hd.effectiveKeys.mean});
    maps.push_back(sdpa::attentionWeights(model.queries().middleCols(h * dk, dk), model.keys().middleCols(h * dk, dk),
                                          model.scale(), Model::causal())
                       .template cast<double>());
    titles.push_back("head " + std::to_string(h) + ": H/log n " + char_lm::svg::num(hd.entropyFraction.mean) +
                     ", p_max " + char_lm::svg::num(hd.maxWeight.mean));
  }
  std::string sample = corpus.valText.substr(0, size_t(o.seqLen));
  std::replace(sample.begin(), sample.end(), '\n', ' ');
  std::ofstream(dir / "attention.svg") << char_lm::svg::heatMaps(
      maps, titles, int(std::min<Index>(4, cfg.heads)),
      spec.name + " (d_k = " + std::to_string(dk) + ", tau = " + char_lm::svg::num(model.tau()) +
          ") rows: queries, columns: keys of \"" + sample + "\"",
      cfg.seqLen >= 48 ? 4 : 6);
  if (o.generate > 0) generate(model, corpus, o, spec.name, dir);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

RunResult runSpec(const RunSpec& spec, const Corpus& corpus, const Options& o, long steps, long evalEvery) {
  const fs::path dir = fs::path(o.out) / "runs" / spec.name;
  const Index dk = o.dModel / spec.heads;
  switch (spec.policy) {
    case Policy::Scaled:
      return train(spec, sdpa::scale::InvSqrtDk{}, corpus, o, steps, evalEvery, dir);
    case Policy::Unscaled:
      return train(spec, sdpa::scale::None{}, corpus, o, steps, evalEvery, dir);
    case Policy::LearnableFromOne:
      return train(spec, sdpa::scale::Learnable<float>{1.0f}, corpus, o, steps, evalEvery, dir);
    case Policy::LearnableFromInvSqrt:
      return train(spec, sdpa::scale::Learnable<float>::forHeadDim(dk), corpus, o, steps, evalEvery, dir);
  }
  throw std::logic_error("unknown policy");
}

// ---------------------------------------------------------------------------------------------

std::string fmt(double x, const char* f = "%.3f") {
  if (!std::isfinite(x)) return std::isnan(x) ? "nan" : "inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

void writeSummary(const std::vector<RunResult>& results, const Options& o, const Corpus& corpus, long steps,
                  double seconds) {
  const fs::path out(o.out);
  std::ofstream csv(out / "summary.csv"), heads(out / "heads.csv"), md(out / "summary.md");
  csv << "run,heads,d_k,policy,steps,final_val_loss,best_val_loss,final_train_loss,nonfinite_losses,"
         "nonfinite_grads,skipped_steps,entropy_fraction,max_weight,head_similarity,logit_std,final_tau,seconds\n";
  heads << "run,head,entropy,entropy_fraction,max_weight,effective_keys\n";
  md << "Corpus: " << corpus.train.size() << " training + " << corpus.val.size() << " validation characters, "
     << corpus.alphabet.size() << " symbols; " << steps << " steps of " << o.batch << " x " << o.seqLen << " tokens ("
     << fmt(double(steps) * double(o.batch * o.seqLen) / double(corpus.train.size()), "%.1f") << " epochs); lr " << o.lr
     << ", weight decay " << o.weightDecay << ", clip " << (o.clip > 0 ? fmt(o.clip, "%g") : std::string("off"))
     << ", q/k init gain " << o.qkGain << ", seed " << o.seed << "; " << fmt(seconds, "%.0f") << " s.\n\n"
     << "| run | d_k | scale | final val loss | best val loss | non-finite loss / grad | H / log n | p_max | "
        "head similarity | logit std | final tau |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const RunResult& r : results) {
    const EvalPoint& last = r.evals.back();
    csv << r.spec.name << ',' << r.spec.heads << ',' << r.headDim << ',' << policyLabel(r.spec.policy) << ',' << r.steps
        << ',' << last.valLoss << ',' << r.bestVal << ',' << last.trainLoss << ',' << r.nonFiniteLoss << ','
        << r.nonFiniteGrad << ',' << r.skipped << ',' << last.entropyFraction << ',' << last.maxWeight << ','
        << last.headSimilarity << ',' << last.logitStd << ',' << last.tau << ',' << r.seconds << '\n';
    for (size_t h = 0; h < r.heads.size(); ++h)
      heads << r.spec.name << ',' << h << ',' << r.heads[h].entropy << ',' << r.heads[h].entropyFraction << ','
            << r.heads[h].maxWeight << ',' << r.heads[h].effectiveKeys << '\n';
    md << "| " << r.spec.name << " | " << r.headDim << " | " << policyLabel(r.spec.policy) << " | " << fmt(last.valLoss)
       << " | " << fmt(r.bestVal) << " | " << r.nonFiniteLoss << " / " << r.nonFiniteGrad << " | "
       << fmt(last.entropyFraction, "%.2f") << " | " << fmt(last.maxWeight, "%.2f") << " | "
       << fmt(last.headSimilarity, "%.2f") << " | " << fmt(last.logitStd, "%.1f") << " | " << fmt(last.tau, "%.4f")
       << " |\n";
  }
}

void writeFigures(const std::vector<RunResult>& results, const Options& o) {
  namespace svg = char_lm::svg;
  std::map<Index, std::vector<const RunResult*>> byDk;
  for (const RunResult& r : results) byDk[r.headDim].push_back(&r);
  auto series = [](const RunResult& r, double EvalPoint::*field, bool thin) {
    svg::Series s{thin ? "" : policyLabel(r.spec.policy), policyColor(r.spec.policy), {}, {}, thin ? 1.0 : 2.0, thin};
    for (const EvalPoint& e : r.evals) {
      s.x.push_back(double(e.step));
      s.y.push_back(e.*field);
    }
    return s;
  };
  std::vector<svg::Panel> loss, dyn;
  svg::Panel tau{"learned tau (dashed: 1/sqrt(d_k))", "step", "tau", {}};
  for (const auto& [dk, runs] : byDk) {
    const std::string suffix = "d_k = " + std::to_string(dk) + " (" + std::to_string(o.dModel / dk) + " heads)";
    svg::Panel l{"loss, " + suffix + " (thick: validation, dashed: training)", "step", "cross-entropy (nats)", {}};
    svg::Panel ent{"attention entropy H / log n, " + suffix, "step", "mean over heads and rows", {}};
    svg::Panel sim{"head-to-head similarity, " + suffix, "step", "1 - JS / ln 2", {}};
    ent.yMin = sim.yMin = 0;
    ent.yMax = sim.yMax = 1;
    for (const RunResult* r : runs) {
      l.series.push_back(series(*r, &EvalPoint::valLoss, false));
      l.series.push_back(series(*r, &EvalPoint::trainLoss, true));
      ent.series.push_back(series(*r, &EvalPoint::entropyFraction, false));
      sim.series.push_back(series(*r, &EvalPoint::headSimilarity, false));
      if (r->spec.policy == Policy::LearnableFromOne || r->spec.policy == Policy::LearnableFromInvSqrt) {
        svg::Series s = series(*r, &EvalPoint::tau, false);
        s.label += ", d_k = " + std::to_string(dk);
        if (dk > 16) s.width = 3.0;
        tau.series.push_back(s);
      }
    }
    loss.push_back(l);
    dyn.push_back(ent);
    dyn.push_back(sim);
    if (!runs.empty()) {
      const double inv = 1.0 / std::sqrt(double(dk));
      tau.series.push_back({"", "#999", {0.0, double(runs[0]->steps)}, {inv, inv}, 1.0, true});
    }
  }
  if (!tau.series.empty()) dyn.push_back(tau);
  std::ofstream(fs::path(o.out) / "loss_curves.svg")
      << svg::linePanels(loss, 2, 520, 340,
                         "One-layer character Transformer, d_model = " + std::to_string(o.dModel) +
                             ": loss by scale policy (same seed, data and steps)");
  std::ofstream(fs::path(o.out) / "dynamics.svg") << svg::linePanels(
      dyn, 2, 460, 280, "Attention of a fixed validation sample during training, and the learned tau");
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    const Corpus corpus = loadCorpus(o);
    const long stepsPerEpoch = std::max<long>(1, long(corpus.train.size() / size_t(o.batch * o.seqLen)));
    const long steps = o.steps > 0 ? o.steps : std::max<long>(1, std::lround(o.epochs * double(stepsPerEpoch)));
    const long evalEvery = o.evalEvery > 0 ? o.evalEvery : std::max<long>(1, stepsPerEpoch / 2);

    std::vector<RunSpec> specs;
    for (Index heads : {Index(8), Index(2)}) {
      if (o.dModel % heads) usage("d_model must be a multiple of 8");
      const std::string dk = "dk" + std::to_string(o.dModel / heads) + "-";
      for (auto [name, policy] : {std::pair{"scaled", Policy::Scaled}, std::pair{"unscaled", Policy::Unscaled},
                                  std::pair{"learnable-from-1", Policy::LearnableFromOne},
                                  std::pair{"learnable-from-invsqrt", Policy::LearnableFromInvSqrt}})
        if (o.only.empty() || (dk + name).find(o.only) != std::string::npos)
          specs.push_back({dk + name, heads, policy});
    }
    if (specs.empty()) usage("--only " + o.only + " matches no run");

    const int jobs =
        std::max(1, std::min(int(specs.size()), o.jobs > 0 ? o.jobs : int(std::thread::hardware_concurrency())));
    // Runs in parallel, each on one thread (kernels and Eigen products serial): the results do
    // not depend on --jobs.
    if (jobs > 1) Eigen::setNbThreads(1);
    std::printf("corpus: %zu train + %zu validation characters, %zu symbols (%s%s)\n", corpus.train.size(),
                corpus.val.size(), corpus.alphabet.size(), corpus.sources.front().c_str(),
                corpus.sources.size() > 1 ? " and more" : "");
    std::printf("%zu runs x %ld steps of %ld x %ld tokens, %d in parallel, output in %s\n", specs.size(), steps,
                long(o.batch), long(o.seqLen), jobs, o.out.c_str());
    fs::create_directories(o.out);

    const auto start = std::chrono::steady_clock::now();
    std::vector<RunResult> results(specs.size());
    std::atomic<size_t> next{0};
    std::vector<std::exception_ptr> errors(static_cast<size_t>(jobs));
    std::vector<std::thread> workers;
    for (int w = 0; w < jobs; ++w)
      workers.emplace_back([&, w] {
        try {
          for (size_t i; (i = next++) < specs.size();) results[i] = runSpec(specs[i], corpus, o, steps, evalEvery);
        } catch (...) {
          errors[size_t(w)] = std::current_exception();
        }
      });
    for (auto& t : workers) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    writeSummary(results, o, corpus, steps, seconds);
    writeFigures(results, o);
    std::cout << "\n" << readFile((fs::path(o.out) / "summary.md").string());
  } catch (const std::exception& e) {
    std::cerr << "char_lm: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
