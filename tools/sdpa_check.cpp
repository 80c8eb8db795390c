// The seed's "three-minute check" (C18) from the command line: load q and k dumped from a model
// (scripts/dump_attention.py, or `np.save("q.npy", q.float().numpy())`), compute the attention
// logits with the scale the model uses, and print the figures (facts) and the verdicts
// (warnings and notes) read for the model's stage. Exit status: 0 healthy (notes allowed),
// 1 at least one warning, 2 a usage or input error. Every verdict: docs/DIAGNOSTICS.md.
#include <sdpa/sdpa.hpp>

#include <cstdio>
#include <iostream>
#include <string>

#include "cli_args.hpp"

namespace {

constexpr const char* kUsage =
    "usage: sdpa_check q.npy k.npy [--heads H[:H_kv]] [--scale S] [--causal upper-left|lower-right]\n"
    "                  [--query-length N] [--key-length N] [--stage auto|init|trained]\n"
    "                  [--precision fp32|bf16|fp16] [--softmax max-subtracted|plain] [--json]\n"
    "  q, k: float32 or float64 .npy, one of\n"
    "    (1, H, L, d)  PyTorch SDPA's (batch, heads, seq, dim), batch 1 (what dump_attention.py writes)\n"
    "    (H, L, d)     heads first\n"
    "    (1, L, H d)   a Linear layer's output, batch 1: needs --heads\n"
    "    (L, H d)      heads side by side: needs --heads (or a q or k that states its heads)\n"
    "  --heads H[:H_kv]  query heads, and kv heads for GQA/MQA (H a multiple of H_kv)\n"
    "  --scale S         tau: inv_sqrt_dk (default), none, 0.125, 1/8, 1/sqrt(64), rsqrt(64), T=8\n"
    "  --query-length N, --key-length N  rows beyond N are padding: left out of every figure\n"
    "  --stage           read the figures as at initialisation or trained; auto decides from the data\n"
    "  --precision, --softmax  the model's softmax: where its Jacobian underflows, whether exp overflows\n"
    "exit status: 0 healthy, 1 warnings, 2 usage or input error\n";

using sdpa_tools::refuse;

struct Options {
  std::string qPath, kPath, causal;
  sdpa_tools::ScaleArg scale;
  Eigen::Index heads = 0, kvHeads = 0, queryLength = 0, keyLength = 0;
  sdpa::DiagnoseOptions diagnose;
  bool json = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) refuse(a + " needs a value");
      return argv[++i];
    };
    const auto oneOf = [&](const std::string& v, std::initializer_list<const char*> accepted) {
      std::string list;
      for (const char* x : accepted) {
        if (v == x) return;
        if (!list.empty()) list += ", ";
        list += x;
      }
      std::string message = a + " '";
      message += v;
      message += "': accepted: ";
      refuse(message + list);
    };
    if (a == "--heads") {
      std::tie(o.heads, o.kvHeads) = sdpa_tools::parseHeads(value());
    } else if (a == "--scale") {
      o.scale = sdpa_tools::parseScale(value());
    } else if (a == "--causal") {
      o.causal = value();
      oneOf(o.causal, {"upper-left", "lower-right"});
    } else if (a == "--query-length") {
      o.queryLength = sdpa_tools::parseCount(a, value());
    } else if (a == "--key-length") {
      o.keyLength = sdpa_tools::parseCount(a, value());
    } else if (a == "--stage") {
      const std::string v = value();
      oneOf(v, {"auto", "init", "trained"});
      o.diagnose.stage = v == "init"      ? sdpa::ModelStage::Init
                         : v == "trained" ? sdpa::ModelStage::Trained
                                          : sdpa::ModelStage::Auto;
    } else if (a == "--precision") {
      const std::string v = value();
      oneOf(v, {"fp32", "bf16", "fp16"});
      o.diagnose.precision = v == "fp16"   ? sdpa::Precision::Fp16
                             : v == "bf16" ? sdpa::Precision::Bf16
                                           : sdpa::Precision::Fp32;
    } else if (a == "--softmax") {
      const std::string v = value();
      oneOf(v, {"max-subtracted", "plain"});
      o.diagnose.softmax = v == "plain" ? sdpa::SoftmaxForm::Plain : sdpa::SoftmaxForm::MaxSubtracted;
    } else if (a == "--json") {
      o.json = true;
    } else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (!a.empty() && a[0] == '-') {
      refuse("unknown option " + a);
    } else if (o.qPath.empty()) {
      o.qPath = a;
    } else if (o.kPath.empty()) {
      o.kPath = a;
    } else {
      refuse("unexpected argument " + a + " (q.npy and k.npy are already " + o.qPath + ", " + o.kPath + ")");
    }
  }
  if (o.kPath.empty()) refuse("need q.npy and k.npy");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const sdpa::npy::Array qa = sdpa::npy::read(o.qPath), ka = sdpa::npy::read(o.kPath);
    const sdpa_tools::AttentionInput q = sdpa_tools::attentionInput(qa, o.qPath, "q", o.heads, 0);
    // k's head count when the command line does not give it: q's for MHA (GQA needs --heads H:H_kv).
    const Eigen::Index kImplied = sdpa_tools::statedHeads(ka) ? 0 : q.heads;
    const sdpa_tools::AttentionInput k = sdpa_tools::attentionInput(ka, o.kPath, "k", o.kvHeads, kImplied);
    // (L, H, d) beside (H, L, d): one of the two was saved before PyTorch's transpose(1, 2).
    if (q.headsFirst && k.headsFirst && q.heads == k.positions && q.positions == k.heads && q.heads != q.positions)
      refuse("q (read as " + std::to_string(q.heads) + " heads of " + std::to_string(q.positions) +
             " positions) and k (" + std::to_string(k.heads) + " heads of " + std::to_string(k.positions) +
             " positions) have heads and positions swapped: one was saved as (seq, heads, dim), the other as (heads, "
             "seq, dim); save both as (heads, seq, dim) (x.transpose(0, 1))");
    if (q.headDim != k.headDim)
      refuse("q has heads of d_k " + std::to_string(q.headDim) + " (" + std::to_string(q.heads) + " heads, read as " +
             q.layout + "), k of d_k " + std::to_string(k.headDim) + " (" + std::to_string(k.heads) +
             " heads, read as " + k.layout + "): check --heads");
    if (q.heads % k.heads != 0)
      refuse(std::to_string(q.heads) + " query heads do not share " + std::to_string(k.heads) +
             " kv heads evenly: check --heads H:H_kv");
    if (q.layout != k.layout)
      std::fprintf(stderr, "sdpa_check: note: q is read as %s, k as %s: check they come from the same model\n",
                   q.layout.c_str(), k.layout.c_str());
    if (o.queryLength > q.positions)
      refuse("--query-length " + std::to_string(o.queryLength) + " is beyond q's " + std::to_string(q.positions) +
             " positions");
    if (o.keyLength > k.positions)
      refuse("--key-length " + std::to_string(o.keyLength) + " is beyond k's " + std::to_string(k.positions) +
             " positions");
    // Padding is cut off, not masked: the figures are those of the unpadded rows, exactly.
    const Eigen::Index nQ = o.queryLength ? o.queryLength : q.positions;
    const Eigen::Index nK = o.keyLength ? o.keyLength : k.positions;
    using sdpa::mask::Align;
    // One mask type for every --causal: a window unbounded on the left, and on the right unless causal.
    const sdpa::mask::SlidingWindow window{-1, o.causal.empty() ? -1 : 0,
                                           o.causal == "upper-left" ? Align::UpperLeft : Align::LowerRight};
    const sdpa::Diagnostics d =
        sdpa::diagnose(q.packed.topRows(nQ), k.packed.topRows(nK), sdpa::Heads{q.heads, k.heads},
                       sdpa::scale::Constant{o.scale.value(q.headDim)}, window, o.diagnose);
    std::cout << (o.json ? d.toJson() + "\n" : d.toString());
    return d.healthy() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sdpa_check: %s\n%s", e.what(), kUsage);
    return 2;
  }
}
