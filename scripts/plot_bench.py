#!/usr/bin/env python3
"""Turns Google Benchmark JSON from bench/bench_forward (or bench_backward) into an SVG plot of
throughput (GFLOP/s) against the head size d_k, one line per kernel and sequence length n.

    build/bench/bench/bench_forward --benchmark_filter='BM_Forward<' \\
        --benchmark_out=forward.json --benchmark_out_format=json
    python3 scripts/plot_bench.py forward.json -o docs/forward_throughput.svg

Only the Python standard library is needed. With --benchmark_repetitions the median is used.
"""
import argparse
import json
import math
import re
import sys
from collections import defaultdict

COLORS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"]


def load(paths):
    """{(kernel, n, threads): {d: GFLOPS}} from benchmarks named Family<Kernel>/n:../d:../threads:..,
    and the Eigen SGEMM ceiling {n: {d: GFLOPS}} from their xSGEMM counters."""
    series = defaultdict(dict)
    ceiling = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for b in data["benchmarks"]:
            if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
                continue
            m = re.match(r"(\w+)<(?:sdpa::kernel::)?(\w+)[^>]*>/n:(\d+)/d:(\d+)/threads:(\d+)", b["name"])
            if not m or "GFLOPS" not in b:
                continue
            _, kernel, n, d, threads = m.groups()
            rate = b["GFLOPS"] / 1e9 if b["GFLOPS"] > 1e6 else b["GFLOPS"]
            series[(kernel, int(n), int(threads))][int(d)] = rate
            if b.get("xSGEMM", 0) > 0:
                ceiling[int(n)][int(d)] = rate / b["xSGEMM"]
    return series, ceiling


def svg(series, ceiling, title):
    width, height, left, right, top, bottom = 760, 460, 70, 230, 40, 50
    all_d = sorted({d for s in list(series.values()) + list(ceiling.values()) for d in s})
    all_y = [v for s in list(series.values()) + list(ceiling.values()) for v in s.values()]
    if not all_d:
        sys.exit("no benchmark of the form Family<Kernel>/n:N/d:D/threads:T with a GFLOPS counter")
    ymax = max(all_y) * 1.1
    xs = {d: left + (width - left - right) * (i / max(1, len(all_d) - 1)) for i, d in enumerate(all_d)}

    def y(v):
        return top + (height - top - bottom) * (1 - v / ymax)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="15">{title}</text>']
    step = 10 ** math.floor(math.log10(ymax / 4))
    step *= 5 if ymax / step > 20 else (2 if ymax / step > 8 else 1)
    v = 0.0
    while v <= ymax:
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 8}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
        v += step
    for d, x in xs.items():
        out.append(f'<text x="{x:.1f}" y="{height - bottom + 18}" text-anchor="middle">{d}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">d_k</text>')
    out.append(f'<text x="16" y="{(top + height - bottom) / 2}" transform="rotate(-90 16 '
               f'{(top + height - bottom) / 2})" text-anchor="middle">GFLOP/s (4 n_q n_k d / time)</text>')
    # One color per n; the line style tells the kernel (solid: tiled, thin: naive, dashed: SGEMM).
    ns = sorted({key[1] for key in series} | set(ceiling))
    color = {n: COLORS[i % len(COLORS)] for i, n in enumerate(ns)}
    lines = []
    for (kernel, n, threads), s in sorted(series.items(), key=lambda kv: (kv[0][0] != "Tiled", kv[0][1], kv[0][2])):
        width_px = 2.5 if kernel == "Tiled" else 1.2
        label = f"{kernel}, n = {n}" + (f", {threads} threads" if threads != 1 else "")
        lines.append((label, s, color[n], width_px, ""))
    for n, s in sorted(ceiling.items()):
        lines.append((f"Eigen SGEMM, n = {n}", s, color[n], 1.2, ' stroke-dasharray="5,4"'))
    legend_y = top
    for label, s, col, width_px, dash in lines:
        pts = " ".join(f"{xs[d]:.1f},{y(s[d]):.1f}" for d in sorted(s))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{col}" stroke-width="{width_px}"{dash}/>')
        for d in sorted(s):
            out.append(f'<circle cx="{xs[d]:.1f}" cy="{y(s[d]):.1f}" r="2.5" fill="{col}"/>')
        lx = width - right + 15
        out.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{legend_y}" y2="{legend_y}" stroke="{col}" '
                   f'stroke-width="{width_px}"{dash}/>')
        out.append(f'<text x="{lx + 28}" y="{legend_y + 4}">{label}</text>')
        legend_y += 18
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="Google Benchmark JSON output files")
    p.add_argument("-o", "--output", required=True, help="SVG file to write")
    p.add_argument("--title", default="sdpa forward, one head, fp32, 1 thread")
    p.add_argument("--no-ceiling", action="store_true", help="omit the SGEMM ceiling lines")
    args = p.parse_args()
    series, ceiling = load(args.json)
    with open(args.output, "w") as f:
        f.write(svg(series, {} if args.no_ceiling else ceiling, args.title))
    print(f"wrote {args.output}: {len(series)} series")


if __name__ == "__main__":
    main()
