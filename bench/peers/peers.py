#!/usr/bin/env python3
"""sdpa's forward beside ONNX Runtime's and PyTorch's CPU attention, on one machine, in one run.

One head, fp32, softmax(q k^T / sqrt(d)) v, n_q = n_k = n, GFLOP/s = 4 n^2 d / t. Every peer runs
in its own process pinned with taskset to the first `threads` cores, with OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE removed from its environment; each figure is the median of --reps passes of at
least --min-time seconds. sdpa's figures come from its Google Benchmark binary
(BM_ForwardPeers<Tiled>, medians of the same number of repetitions), the FMA peak from the probe
in that binary (xFMA = GFLOP/s / (peak per core x threads)).

  ONNX Runtime   com.microsoft.MultiHeadAttention (MLAS flash attention on the CPU), a one-node
                 model made here, I/O binding with preallocated outputs, intra_op_num_threads;
                 also timed with ORT_DISABLE_FLASH_ATTENTION=1 (its unfused path), which shows
                 that the flash path is the one the first column timed.
  PyTorch        torch.nn.functional.scaled_dot_product_attention under no_grad, [1, 1, n, d];
                 the script checks with the profiler that the CPU flash kernel
                 (_scaled_dot_product_flash_attention_for_cpu) is the one that ran.

Not part of CI: the peers come from PyPI, in a virtual environment of your own:

  python3 -m venv /tmp/peers && /tmp/peers/bin/pip install onnxruntime onnx numpy torch
  cmake --preset bench && cmake --build --preset bench
  /tmp/peers/bin/python bench/peers/peers.py --rounds 3   # prints a Markdown table

Every peer's output is first checked against a float64 NumPy reference at n = 256 (a peer that
computes something else would otherwise be timed happily).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = [(1024, 64), (4096, 16), (4096, 64), (4096, 128), (4096, 256)]
THREADS = [1, 2]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def clean_env(threads, extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra or {})
    return env


def pinned(threads):
    return ["taskset", "-c", "0" if threads == 1 else f"0-{threads - 1}"]


def gflops(n, d, seconds):
    return 4.0 * n * n * d / seconds * 1e-9


def median_rate(run, n, d, reps, min_time):
    """Median GFLOP/s of `reps` passes, each repeating run() for at least min_time seconds."""
    run()
    run()
    t0 = time.perf_counter()
    run()
    once = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(min_time / once))
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        rates.append(gflops(n, d, (time.perf_counter() - t0) / iters))
    return statistics.median(rates)


def reference(q, k, v):
    import numpy as np

    s = (q.astype(np.float64) @ k.astype(np.float64).T) / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v.astype(np.float64)


def check(name, got, q, k, v, tol=1e-4):
    import numpy as np

    err = float(np.max(np.abs(got.astype(np.float64) - reference(q, k, v))))
    if not err < tol:
        raise SystemExit(f"{name}: output differs from the float64 reference by {err:g}")


# --- workers: one process per peer and thread count, printing JSON lines -----------------------


def ort_session(n, d, threads):
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    shape = [1, n, d]
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=1)
    graph = helper.make_graph(
        [node],
        "mha",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape) for x in "qkv"],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    x = {name: rng.uniform(-1, 1, size=shape).astype(np.float32) for name in "qkv"}
    binding = sess.io_binding()
    for name, value in x.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
    out = ort.OrtValue.ortvalue_from_numpy(np.empty(shape, np.float32))
    binding.bind_ortvalue_output("o", out)
    return sess, binding, x, out


def worker_ort(threads, reps, min_time):
    import onnxruntime as ort

    sess, binding, x, out = ort_session(256, 64, threads)
    sess.run_with_iobinding(binding)
    check("onnxruntime", out.numpy()[0], x["q"][0], x["k"][0], x["v"][0])
    for n, d in SHAPES:
        sess, binding, _, _ = ort_session(n, d, threads)
        rate = median_rate(lambda: sess.run_with_iobinding(binding), n, d, reps, min_time)
        print(json.dumps({"n": n, "d": d, "gflops": rate, "version": ort.__version__}), flush=True)


def worker_torch(threads, reps, min_time, dtype="fp32"):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(1)
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32

    def inputs(n, d):
        return [(torch.rand(1, 1, n, d) * 2 - 1).to(tdtype) for _ in range(3)]

    q, k, v = inputs(256, 64)
    with torch.no_grad():
        o = F.scaled_dot_product_attention(q, k, v)
    # bf16: the reference on the same bf16 inputs; the output rounded to bf16 (2^-9 relative).
    f = [x[0, 0].float().numpy() for x in (o, q, k, v)]
    check("torch", *f, tol=1e-4 if dtype == "fp32" else 1e-2)
    for n, d in SHAPES:
        q, k, v = inputs(n, d)
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            F.scaled_dot_product_attention(q, k, v)
        flash = any("flash_attention" in e.key for e in prof.key_averages())
        with torch.no_grad():
            rate = median_rate(lambda: F.scaled_dot_product_attention(q, k, v), n, d, reps, min_time)
        print(json.dumps({"n": n, "d": d, "gflops": rate, "flash": flash, "version": torch.__version__}), flush=True)


def run_worker(peer, threads, args, extra_env=None):
    cmd = pinned(threads) + [sys.executable, os.path.abspath(__file__), "--worker", peer, "--dtype", args.dtype]
    cmd += ["--threads-one", str(threads), "--reps", str(args.reps), "--min-time", str(args.min_time)]
    res = subprocess.run(cmd, env=clean_env(threads, extra_env), capture_output=True, text=True)
    if res.returncode != 0:
        print(f"{peer} ({threads} threads) failed:\n{res.stderr[-2000:]}", file=sys.stderr)
        return {}
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return {(r["n"], r["d"]): r for r in rows}


def run_sdpa(threads, args):
    shapes = "|".join(f"n:{n}/d:{d}" for n, d in SHAPES)
    name = "BM_ForwardPeers<Tiled>" if args.dtype == "fp32" else "BM_ForwardPeersBf16"
    cmd = pinned(threads) + [
        args.bench,
        f"--benchmark_filter={name}/({shapes})/threads:{threads}/",
        f"--benchmark_repetitions={args.reps}",
        "--benchmark_report_aggregates_only=true",
        f"--benchmark_min_time={args.min_time}",
        "--benchmark_format=json",
    ]
    res = subprocess.run(cmd, env=clean_env(threads), capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{args.bench} failed:\n{res.stderr[-2000:]}")
    out = {}
    for b in json.loads(res.stdout)["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        parts = dict(p.split(":") for p in b["run_name"].split("/")[1:] if ":" in p)
        out[(int(parts["n"]), int(parts["d"]))] = {"gflops": b["GFLOPS"], "xFMA": b.get("xFMA", float("nan"))}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default=os.path.join(ROOT, "build", "bench", "bench", "bench_forward"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument(
        "--rounds", type=int, default=1, help="run every peer this many times, interleaved; each cell is the median"
    )
    ap.add_argument("--peers", default="ort,ort-unfused,torch", help="which peers to run")
    ap.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="bf16: bf16 inputs and outputs, sdpa with kernel::Products::Bf16, PyTorch only (ONNX Runtime's "
        "MultiHeadAttention has no bf16 CPU kernel)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--threads-one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker == "ort":
        return worker_ort(args.threads_one, args.reps, args.min_time)
    if args.worker == "torch":
        return worker_torch(args.threads_one, args.reps, args.min_time, args.dtype)

    peers = args.peers.split(",") if args.dtype == "fp32" else ["torch"]
    names = {"ort": "ONNX Runtime MHA (flash)", "ort-unfused": "ONNX Runtime MHA (unfused)", "torch": "PyTorch SDPA"}
    versions = {}
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        # A shared machine drifts: the peers take turns, round after round, and each cell is
        # the median of its rounds.
        rounds = []
        for _ in range(args.rounds):
            got = {"sdpa": run_sdpa(threads, args)}
            if "ort" in peers:
                got["ort"] = run_worker("ort", threads, args)
            if "ort-unfused" in peers:
                got["ort-unfused"] = run_worker("ort", threads, args, {"ORT_DISABLE_FLASH_ATTENTION": "1"})
            if "torch" in peers:
                got["torch"] = run_worker("torch", threads, args)
            rounds.append(got)
        got = {}
        for peer in rounds[0]:
            got[peer] = {}
            for shape in SHAPES:
                cells = [r[peer][shape] for r in rounds if shape in r.get(peer, {})]
                if not cells:
                    continue
                cell = dict(cells[0])
                for key in ("gflops", "xFMA"):
                    if key in cell:
                        cell[key] = statistics.median(c[key] for c in cells)
                cell["flash"] = all(c.get("flash", True) for c in cells)
                got[peer][shape] = cell
        for n, d in SHAPES:
            row = {"threads": threads, "n": n, "d": d}
            for peer, res in got.items():
                if (n, d) in res:
                    row[peer] = res[(n, d)]
                    if "version" in res[(n, d)]:
                        versions[peer] = res[(n, d)]["version"]
            rows.append(row)

    cols = [p for p in ["ort", "ort-unfused", "torch"] if p in peers]
    # xFMA: against the fp32 FMA peak, also for bf16 (where AMX tiles can pass it).
    head = ["threads", "n, d", "sdpa", "sdpa xFMA"] + [names[p] for p in cols] + ["sdpa / best peer"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [str(r["threads"]), f"{r['n']}, {r['d']}", f"{r['sdpa']['gflops']:.1f}", f"{r['sdpa']['xFMA']:.2f}"]
        best = 0.0
        for p in cols:
            if p not in r:
                cells.append("-")
                continue
            g = r[p]["gflops"]
            mark = "" if r[p].get("flash", True) else " (not flash)"
            cells.append(f"{g:.1f}{mark}")
            if p != "ort-unfused":
                best = max(best, g)
        cells.append(f"{r['sdpa']['gflops'] / best:.2f}" if best > 0 else "-")
        print("| " + " | ".join(cells) + " |")
    print()
    print(
        f"GFLOP/s = 4 n^2 d / t, medians of {args.reps} passes, median of {args.rounds} interleaved rounds;",
        "versions:",
        json.dumps(versions),
    )


if __name__ == "__main__":
    main()
