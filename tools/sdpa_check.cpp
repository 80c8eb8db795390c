// The seed's "three-minute check" (C18) from the command line: load q and k dumped from a model
// (`np.save("q.npy", q.float().numpy())`), compute the attention logits with the scale the model
// uses, and print the diagnostics with a verdict per problem found.
//
//   sdpa_check q.npy k.npy [--heads H[:H_kv]] [--scale inv_sqrt_dk|none|<tau>|T=<temperature>]
//              [--causal upper-left|lower-right] [--json]
//
// q is n_q x (H d_k) (heads side by side) or (H, n_q, d_k); k likewise with H_kv heads.
#include <sdpa/sdpa.hpp>

#include <cstdio>
#include <iostream>
#include <string>

#include "npy.hpp"

namespace {

constexpr const char* kUsage =
    "usage: sdpa_check q.npy k.npy [--heads H[:H_kv]] [--scale inv_sqrt_dk|none|<tau>|T=<temperature>]\n"
    "                  [--causal upper-left|lower-right] [--json]\n"
    "  q: n_q x (H d_k) or (H, n_q, d_k); k: n_k x (H_kv d_k) or (H_kv, n_k, d_k); float32 or float64 .npy\n";

struct Options {
  std::string qPath, kPath, scale = "inv_sqrt_dk", causal;
  Eigen::Index heads = 0, kvHeads = 0;
  bool json = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--heads") {
      const std::string v = value();
      const size_t colon = v.find(':');
      o.heads = std::stol(v.substr(0, colon));
      o.kvHeads = colon == std::string::npos ? o.heads : std::stol(v.substr(colon + 1));
    } else if (a == "--scale") {
      o.scale = value();
    } else if (a == "--causal") {
      o.causal = value();
      if (o.causal != "upper-left" && o.causal != "lower-right")
        throw std::invalid_argument("--causal takes upper-left or lower-right, got " + o.causal);
    } else if (a == "--json") {
      o.json = true;
    } else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (!a.empty() && a[0] == '-') {
      throw std::invalid_argument("unknown option " + a);
    } else if (o.qPath.empty()) {
      o.qPath = a;
    } else if (o.kPath.empty()) {
      o.kPath = a;
    } else {
      throw std::invalid_argument("unexpected argument " + a);
    }
  }
  if (o.kPath.empty()) throw std::invalid_argument("need q.npy and k.npy");
  return o;
}

template <typename Scale>
sdpa::Diagnostics run(const Eigen::MatrixXd& q, const Eigen::MatrixXd& k, const sdpa::Heads& heads, const Scale& scale,
                      const std::string& causal) {
  using sdpa::mask::Align;
  if (causal.empty()) return sdpa::diagnose(q, k, heads, scale);
  return sdpa::diagnose(q, k, heads, scale,
                        sdpa::mask::Causal{causal == "upper-left" ? Align::UpperLeft : Align::LowerRight});
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    Eigen::Index qHeads = 0, kHeads = 0;
    const Eigen::MatrixXd q = sdpa_tools::packedMatrix(sdpa_tools::readNpy(o.qPath), o.qPath, qHeads);
    const Eigen::MatrixXd k = sdpa_tools::packedMatrix(sdpa_tools::readNpy(o.kPath), o.kPath, kHeads);
    Eigen::Index h = o.heads ? o.heads : (qHeads ? qHeads : 1);
    Eigen::Index hKv = o.kvHeads ? o.kvHeads : (kHeads ? kHeads : h);
    if ((qHeads && qHeads != h) || (kHeads && kHeads != hKv))
      throw std::invalid_argument("--heads " + std::to_string(h) + ":" + std::to_string(hKv) +
                                  " disagrees with the files' " + std::to_string(qHeads) + ":" +
                                  std::to_string(kHeads) + " heads");
    const sdpa::Heads heads{h, hKv};
    sdpa::Diagnostics d;
    if (o.scale == "inv_sqrt_dk")
      d = run(q, k, heads, sdpa::scale::InvSqrtDk{}, o.causal);
    else if (o.scale == "none")
      d = run(q, k, heads, sdpa::scale::None{}, o.causal);
    else if (o.scale.rfind("T=", 0) == 0)
      d = run(q, k, heads, sdpa::scale::Temperature{std::stod(o.scale.substr(2))}, o.causal);
    else
      d = run(q, k, heads, sdpa::scale::Constant{std::stod(o.scale)}, o.causal);
    std::cout << (o.json ? d.toJson() + "\n" : d.toString());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sdpa_check: %s\n%s", e.what(), kUsage);
    return 2;
  }
}
