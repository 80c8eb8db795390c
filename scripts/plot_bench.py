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
    """{(kernel, n): {d: GFLOPS}} from every benchmark named Family<Kernel>/n:../d:.."""
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
            family, kernel, n, d, threads = m.groups()
            label = f"{kernel}, n = {n}" + (f", {threads} threads" if threads != "1" else "")
            series[label][int(d)] = b["GFLOPS"] / 1e9 if b["GFLOPS"] > 1e6 else b["GFLOPS"]
            if "xSGEMM" in b and b["xSGEMM"] > 0:
                ceiling[f"Eigen SGEMM, n = {n}"][int(d)] = series[label][int(d)] / b["xSGEMM"]
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
    legend_y = top
    lines = [(k, s, False) for k, s in sorted(series.items())] + [(k, s, True) for k, s in sorted(ceiling.items())]
    for i, (label, s, dashed) in enumerate(lines):
        color = COLORS[i % len(COLORS)]
        pts = " ".join(f"{xs[d]:.1f},{y(s[d]):.1f}" for d in sorted(s))
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for d in sorted(s):
            out.append(f'<circle cx="{xs[d]:.1f}" cy="{y(s[d]):.1f}" r="3" fill="{color}"/>')
        lx = width - right + 15
        out.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{legend_y}" y2="{legend_y}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
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
