// The command line of sdpa_check, parsed strictly: every argument parses whole or throws a
// std::invalid_argument that names the argument and says what is accepted; and the layouts of
// the .npy inputs, read without guessing: an ambiguous layout is refused with what to pass.
#pragma once

#include <Eigen/Core>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

#include <sdpa/npy.hpp>

namespace sdpa_tools {

[[noreturn]] inline void refuse(const std::string& what) { throw std::invalid_argument(what); }

/// A finite decimal number, the whole of `text` (strtod's syntax, no trailing characters).
inline double parseNumber(const std::string& option, const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front())))
    refuse(option + " '" + text + "': not a number");
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size()) refuse(option + " '" + text + "': not a number");
  if (errno == ERANGE && std::abs(x) > 1) refuse(option + " '" + text + "': out of the range of a double");
  if (!std::isfinite(x)) refuse(option + " '" + text + "': must be finite");
  return x;
}

/// A positive integer, the whole of `text` (digits only).
inline Eigen::Index parseCount(const std::string& option, const std::string& text) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos)
    refuse(option + " '" + text + "': need a positive whole number");
  if (text.size() > 12) refuse(option + " '" + text + "': too large");
  const Eigen::Index n = std::stoll(text);
  if (n <= 0) refuse(option + " '" + text + "': need a positive whole number");
  return n;
}

/// --heads H or H:H_kv, H_kv dividing H.
inline std::pair<Eigen::Index, Eigen::Index> parseHeads(const std::string& text) {
  const std::string option = "--heads '" + text + "'";
  const size_t colon = text.find(':');
  Eigen::Index h = 0, hKv = 0;
  try {
    h = parseCount("--heads", text.substr(0, colon));
    hKv = colon == std::string::npos ? h : parseCount("--heads", text.substr(colon + 1));
  } catch (const std::invalid_argument&) {
    refuse(option + ": need H or H:H_kv, positive whole numbers (12, or 32:8 for GQA)");
  }
  if (h % hKv != 0)
    refuse(option + ": " + std::to_string(h) + " query heads do not share " + std::to_string(hKv) +
           " kv heads evenly (H must be a multiple of H_kv)");
  return {h, hKv};
}

/// The scale: tau as a number, or how to compute it from d_k (invSqrtDk).
struct ScaleArg {
  bool invSqrtDk = true;
  double tau = 0;
  double value(Eigen::Index dK) const { return invSqrtDk ? 1 / std::sqrt(double(dK)) : tau; }
};

constexpr const char* kScaleForms =
    "inv_sqrt_dk, none, a number (0.125), 1/<x> (1/8), 1/sqrt(<x>) or rsqrt(<x>) (1/sqrt(64)), T=<temperature>";

/// --scale in every form a user would type: inv_sqrt_dk, none, 0.125, 1/8, 1/sqrt(64),
/// rsqrt(64), T=8.
inline ScaleArg parseScale(const std::string& text) {
  const std::string opt = "--scale";
  const auto fail = [&](const std::string& why) {
    refuse(opt + " '" + text + "': " + why + "; accepted: " + kScaleForms);
  };
  ScaleArg s;
  if (text == "inv_sqrt_dk") return s;
  s.invSqrtDk = false;
  const auto inner = [&](const std::string& prefix) {  // the x of prefix(x)
    const std::string x = text.substr(prefix.size(), text.size() - prefix.size() - 1);
    if (text.back() != ')') fail("missing ')'");
    double v = 0;
    try {
      v = parseNumber(opt, x);
    } catch (const std::invalid_argument&) {
      fail("'" + x + "' is not a number");
    }
    if (!(v > 0)) fail("the square root needs x > 0");
    return 1 / std::sqrt(v);
  };
  try {
    if (text == "none") {
      s.tau = 1;
    } else if (text.rfind("T=", 0) == 0) {
      const double t = parseNumber(opt, text.substr(2));
      if (!(t > 0)) fail("the temperature must be > 0");
      s.tau = 1 / t;
    } else if (text.rfind("1/sqrt(", 0) == 0) {
      s.tau = inner("1/sqrt(");
    } else if (text.rfind("rsqrt(", 0) == 0) {
      s.tau = inner("rsqrt(");
    } else if (text.rfind("1/", 0) == 0) {
      const double x = parseNumber(opt, text.substr(2));
      if (x == 0) fail("division by zero");
      s.tau = 1 / x;
    } else {
      s.tau = parseNumber(opt, text);
    }
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    if (m.find("accepted:") != std::string::npos) throw;
    fail(m.substr(m.find(": ") + 2));
  }
  if (!std::isfinite(s.tau)) fail("tau is not finite");
  return s;
}

/// One attention input as sdpa's packed matrix (positions x heads side by side), with its head
/// count and the layout it was read as.
struct AttentionInput {
  Eigen::MatrixXd packed;
  Eigen::Index heads = 0;
  Eigen::Index positions = 0, headDim = 0;
  std::string layout;  ///< "(L, H d)", "(H, L, d)", "(1, L, H d)" or "(1, H, L, d)"
  bool headsFirst = false;
};

inline std::string shapeString(const sdpa::npy::Array& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(a.shape[i]);
  return s + ")";
}

/**
 * Reads `a` (from `path`; `what` is "q" or "k") given the head count the command line says
 * (0: not given) and the count the other file implies (0: none):
 * - 2-D (L, H d): heads side by side; the count from --heads or the other file, else refused;
 * - 3-D (H, L, d): heads first (a PyTorch (heads, seq, dim) tensor); a (1, L, W) array is a
 *   Linear layer's output (batch 1) when --heads says H > 1, and refused without --heads;
 * - 4-D (1, H, L, d): PyTorch SDPA's (batch, heads, seq, dim); batch must be 1.
 */
inline AttentionInput attentionInput(const sdpa::npy::Array& a, const std::string& path, const std::string& what,
                                     Eigen::Index given, Eigen::Index implied) {
  const std::string shape = shapeString(a);
  const auto fail = [&](const std::string& why) { refuse(what + " " + path + " " + shape + ": " + why); };
  AttentionInput in;
  std::vector<Eigen::Index> s = a.shape;
  Eigen::Index L = 0, H = 0, d = 0;
  if (s.size() < 2) fail("not a matrix of positions x features");
  if (s.size() == 4) {
    if (s[0] != 1) fail("a batch of " + std::to_string(s[0]) + ": save one item (x[i:i+1]), unpadded");
    if (given && s[1] != given && s[2] == given)
      fail("looks like (batch, seq, heads, dim): save x.transpose(1, 2), PyTorch SDPA's (batch, heads, seq, dim)");
    H = s[1], L = s[2], d = s[3];
    in.layout = "(1, H, L, d)";
    in.headsFirst = true;
  } else if (s.size() == 3) {
    if (s[0] == 1 && given != 1) {
      if (!given)
        fail(
            "(1, L, W) is a Linear layer's output (batch 1, heads side by side) or one head: pass --heads H "
            "(--heads 1 for one head of d_k " +
            std::to_string(s[2]) + ")");
      if (s[2] % given != 0)
        fail(std::to_string(s[2]) + " features do not split into --heads " + std::to_string(given));
      H = given, L = s[1], d = s[2] / given;
      in.layout = "(1, L, H d)";
    } else {
      H = s[0], L = s[1], d = s[2];
      in.layout = "(H, L, d)";
      in.headsFirst = true;
    }
  } else {
    const Eigen::Index h = given ? given : implied;
    if (!h)
      fail(
          "2-D, heads side by side, and their count is not in the file: pass --heads H (--heads 1 for one "
          "head of d_k " +
          std::to_string(s[1]) + ")");
    if (s[1] % h != 0) fail(std::to_string(s[1]) + " features do not split into " + std::to_string(h) + " heads");
    H = h, L = s[0], d = s[1] / h;
    in.layout = "(L, H d)";
  }
  if (given && H != given) fail("holds " + std::to_string(H) + " heads, but --heads says " + std::to_string(given));
  if (L == 0 || d == 0) fail("empty");
  in.heads = H, in.positions = L, in.headDim = d;
  in.packed.resize(L, H * d);
  for (Eigen::Index i = 0; i < L; ++i)
    for (Eigen::Index h = 0; h < H; ++h)
      for (Eigen::Index j = 0; j < d; ++j)
        in.packed(i, h * d + j) = in.headsFirst ? a.data[size_t((h * L + i) * d + j)]     // (.., H, L, d)
                                                : a.data[size_t(i * H * d + h * d + j)];  // (.., L, H d)
  return in;
}

/// The head count a file states by its shape (3-D heads first, 4-D), or 0.
inline Eigen::Index statedHeads(const sdpa::npy::Array& a) {
  if (a.shape.size() == 4) return a.shape[1];
  if (a.shape.size() == 3 && a.shape[0] != 1) return a.shape[0];
  return 0;
}

}  // namespace sdpa_tools
