/**
 * \file char_lm/svg.hpp
 * \brief Just enough SVG for the experiment's figures: panels of line charts and grids of
 * attention heat maps. Self-contained text output, so the program needs no plotting package.
 */
#ifndef SDPA_EXPERIMENTS_CHAR_LM_SVG_HPP
#define SDPA_EXPERIMENTS_CHAR_LM_SVG_HPP

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

namespace char_lm::svg {

struct Series {
  std::string label, color;
  std::vector<double> x, y;  ///< non-finite y values are gaps
  double width = 1.5;
  bool dashed = false;
};

struct Panel {
  std::string title, xLabel, yLabel;
  std::vector<Series> series;
  /// Optional y range; NaN means "from the data".
  double yMin = std::numeric_limits<double>::quiet_NaN(), yMax = std::numeric_limits<double>::quiet_NaN();
};

inline std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", x);
  return buf;
}

inline std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
    }
  }
  return out;
}

/// About five round tick values covering [lo, hi].
inline std::vector<double> ticks(double lo, double hi) {
  const double span = hi - lo;
  if (!(span > 0)) return {lo};
  const double raw = span / 5, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / mag < 1.5 ? mag : raw / mag < 3.5 ? 2 * mag : raw / mag < 7.5 ? 5 * mag : 10 * mag;
  std::vector<double> t;
  for (double v = std::ceil(lo / step) * step; v <= hi + 1e-9 * span; v += step)
    t.push_back(std::abs(v) < 1e-12 ? 0 : v);
  return t;
}

/// Panels of line charts, `columns` per row, each `w` x `h` pixels.
inline std::string linePanels(const std::vector<Panel>& panels, int columns, int w = 460, int h = 300,
                              const std::string& caption = "") {
  const int rows = int((panels.size() + size_t(columns) - 1) / size_t(columns));
  const int top = caption.empty() ? 0 : 28;
  std::string s = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(columns * w) + "\" height=\"" +
                  std::to_string(rows * h + top) + "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  if (!caption.empty()) s += "<text x=\"8\" y=\"18\" font-size=\"13\">" + escape(caption) + "</text>\n";
  const double ml = 52, mr = 12, mt = 24, mb = 36;
  for (size_t pi = 0; pi < panels.size(); ++pi) {
    const Panel& p = panels[pi];
    const double ox = double(int(pi) % columns) * w, oy = top + double(int(pi) / columns) * h;
    double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
    for (const Series& se : p.series)
      for (size_t i = 0; i < se.x.size(); ++i)
        if (std::isfinite(se.y[i])) {
          x0 = std::min(x0, se.x[i]), x1 = std::max(x1, se.x[i]);
          y0 = std::min(y0, se.y[i]), y1 = std::max(y1, se.y[i]);
        }
    if (!std::isnan(p.yMin)) y0 = p.yMin;
    if (!std::isnan(p.yMax)) y1 = p.yMax;
    if (!(x1 > x0)) x0 = 0, x1 = 1;
    if (!(y1 > y0)) y0 = std::isfinite(y0) ? y0 - 1 : 0, y1 = y0 + 2;
    const double pw = w - ml - mr, ph = h - mt - mb;
    auto px = [&](double x) { return ox + ml + (x - x0) / (x1 - x0) * pw; };
    auto py = [&](double y) { return oy + mt + (1 - (std::clamp(y, y0, y1) - y0) / (y1 - y0)) * ph; };
    s += "<text x=\"" + num(ox + ml) + "\" y=\"" + num(oy + 16) + "\" font-size=\"12\" font-weight=\"bold\">" +
         escape(p.title) + "</text>\n";
    s += "<rect x=\"" + num(ox + ml) + "\" y=\"" + num(oy + mt) + "\" width=\"" + num(pw) + "\" height=\"" + num(ph) +
         "\" fill=\"none\" stroke=\"#888\"/>\n";
    for (double t : ticks(y0, y1))
      s += "<line x1=\"" + num(ox + ml) + "\" x2=\"" + num(ox + ml + pw) + "\" y1=\"" + num(py(t)) + "\" y2=\"" +
           num(py(t)) + "\" stroke=\"#eee\"/><text x=\"" + num(ox + ml - 4) + "\" y=\"" + num(py(t) + 4) +
           "\" text-anchor=\"end\">" + num(t) + "</text>\n";
    for (double t : ticks(x0, x1))
      s += "<text x=\"" + num(px(t)) + "\" y=\"" + num(oy + mt + ph + 14) + "\" text-anchor=\"middle\">" + num(t) +
           "</text>\n";
    s += "<text x=\"" + num(ox + ml + pw / 2) + "\" y=\"" + num(oy + h - 6) + "\" text-anchor=\"middle\">" +
         escape(p.xLabel) + "</text>\n";
    s += "<text transform=\"translate(" + num(ox + 12) + "," + num(oy + mt + ph / 2) +
         ") rotate(-90)\" text-anchor=\"middle\">" + escape(p.yLabel) + "</text>\n";
    int legend = 0;
    for (const Series& se : p.series) {
      std::string d;
      bool pen = false;
      for (size_t i = 0; i < se.x.size(); ++i) {
        if (!std::isfinite(se.y[i])) {
          pen = false;
          continue;
        }
        d += (pen ? " L" : " M") + num(px(se.x[i])) + " " + num(py(se.y[i]));
        pen = true;
      }
      const std::string dash = se.dashed ? " stroke-dasharray=\"5 3\"" : "";
      if (!d.empty())
        s += "<path d=\"" + d + "\" fill=\"none\" stroke=\"" + se.color + "\" stroke-width=\"" + num(se.width) + "\"" +
             dash + "/>\n";
      if (se.label.empty()) continue;
      const double ly = oy + mt + 12 + 13 * legend++, lx = ox + ml + pw - 150;
      s += "<line x1=\"" + num(lx) + "\" x2=\"" + num(lx + 18) + "\" y1=\"" + num(ly - 4) + "\" y2=\"" + num(ly - 4) +
           "\" stroke=\"" + se.color + "\" stroke-width=\"" + num(se.width) + "\"" + dash + "/><text x=\"" +
           num(lx + 22) + "\" y=\"" + num(ly) + "\">" + escape(se.label) + "</text>\n";
    }
  }
  return s + "</svg>\n";
}

/// A grid of heat maps (weights in [0, 1], white to dark blue), `columns` per row. Cells are
/// drawn as one path per colour level so that a 64 x 64 map stays a few kilobytes.
inline std::string heatMaps(const std::vector<Eigen::MatrixXd>& maps, const std::vector<std::string>& titles,
                            int columns, const std::string& caption, int cell = 4) {
  constexpr int kLevels = 32;
  const int n = maps.empty() ? 0 : int(maps[0].rows()), m = maps.empty() ? 0 : int(maps[0].cols());
  const int pw = m * cell + 16, ph = n * cell + 34, rows = int((maps.size() + size_t(columns) - 1) / size_t(columns));
  std::string s = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(columns * pw + 8) +
                  "\" height=\"" + std::to_string(rows * ph + 30) + "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"8\" y=\"18\" font-size=\"12\">" +
       escape(caption) + "</text>\n";
  for (size_t k = 0; k < maps.size(); ++k) {
    const int ox = 8 + int(k) % columns * pw, oy = 30 + int(k) / columns * ph;
    s += "<text x=\"" + std::to_string(ox) + "\" y=\"" + std::to_string(oy + 12) + "\">" + escape(titles[k]) +
         "</text>\n<rect x=\"" + std::to_string(ox) + "\" y=\"" + std::to_string(oy + 18) + "\" width=\"" +
         std::to_string(m * cell) + "\" height=\"" + std::to_string(n * cell) + "\" fill=\"none\" stroke=\"#bbb\"/>\n";
    std::vector<std::string> paths(kLevels);
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < m; ++j) {
        const double p = maps[k](i, j);
        const int level = std::isfinite(p) ? std::clamp(int(std::lround(p * (kLevels - 1))), 0, kLevels - 1) : 0;
        if (level == 0) continue;
        paths[size_t(level)] += "M" + std::to_string(ox + j * cell) + " " + std::to_string(oy + 18 + i * cell) + "h" +
                                std::to_string(cell) + "v" + std::to_string(cell) + "h-" + std::to_string(cell) + "z";
      }
    for (int level = 1; level < kLevels; ++level) {
      if (paths[size_t(level)].empty()) continue;
      const double t = double(level) / (kLevels - 1);  // white -> #08306b
      char color[8];
      std::snprintf(color, sizeof color, "#%02x%02x%02x", int(255 - t * (255 - 8)), int(255 - t * (255 - 48)),
                    int(255 - t * (255 - 107)));
      s += "<path fill=\"" + std::string(color) + "\" d=\"" + paths[size_t(level)] + "\"/>\n";
    }
  }
  return s + "</svg>\n";
}

}  // namespace char_lm::svg

#endif  // SDPA_EXPERIMENTS_CHAR_LM_SVG_HPP
