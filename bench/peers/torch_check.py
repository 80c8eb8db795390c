#!/usr/bin/env python3
"""sdpa's multi-head forward and backward against PyTorch's scaled_dot_product_attention.

For each case (shapes, GQA, masks, scales, large logits) the inputs are drawn in float64 and:
  - PyTorch's SDPA runs in float64 (the reference) and in float32 (the peer), forward and
    backward (out.backward(dO)), with PyTorch's own conventions: is_causal (top-left), a
    boolean attn_mask (True = attend), a float attn_mask (added), scale=, enable_gqa=;
  - the textbook float32 computation (materialised P, no tiling) runs beside it;
  - sdpa runs the same case in float32 through torch_check.cpp (built here with the system's
    c++: multiHeadAttentionForward / multiHeadAttentionBackward, the default kernel) with the
    matching policies: Causal{UpperLeft}, Causal{LowerRight} for tril(S - L), Keep, Bias,
    scale::Constant or InvSqrtDk, Heads{H, H_kv}.
Each of out, dq, dk, dv is checked by the FlashAttention rule the tests use (tests/support/
reference.hpp): sdpa's largest error against the float64 reference is at most twice the
textbook float32 one, plus (8 + max |logit|) eps times the result's largest entry (the rounding
of each logit, which no float computation avoids). The figures printed are sdpa / textbook /
PyTorch float32 errors. Exit status 1 if a case breaks the rule.

Not part of CI (PyTorch comes from PyPI):
  python3 -m venv /tmp/peers && /tmp/peers/bin/pip install numpy torch
  /tmp/peers/bin/python bench/peers/torch_check.py
"""
import itertools
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EPS = float(np.finfo(np.float32).eps)


def build(work):
    exe = os.path.join(work, "torch_check")
    subprocess.run(["c++", "-std=c++17", "-O2", "-fopenmp", "-isystem", "/usr/include/eigen3", "-I",
                    os.path.join(ROOT, "include"), os.path.join(HERE, "torch_check.cpp"), "-o", exe], check=True)
    return exe


def packed(x):
    """(1, H, L, d) -> (L, H d): rows are positions, heads side by side (sdpa's layout)."""
    return x[0].permute(1, 0, 2).reshape(x.shape[2], -1)


def textbook(q, k, v, dO, tau, bias, dt):
    """Materialised P in dtype dt; bias (L x S, -inf where hidden) or None."""
    H, Hkv = q.shape[1], k.shape[1]
    q, k, v, dO = (t.to(dt) for t in (q, k, v, dO))
    rep = H // Hkv
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = tau * q @ kk.transpose(-1, -2)
    if bias is not None:
        s = s + bias.to(dt)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row that sees no key: weights and output 0
    o = p @ vv
    dp = dO @ vv.transpose(-1, -2)
    ds = p * (dp - (dO * o).sum(-1, keepdim=True))
    dq = tau * ds @ kk
    dk = (tau * ds.transpose(-1, -2) @ q).view(1, Hkv, rep, *k.shape[2:]).sum(2)
    dv = (p.transpose(-1, -2) @ dO).view(1, Hkv, rep, *v.shape[2:]).sum(2)
    return [o, dq, dk, dv], s


def case(exe, work, nq, nk, H, Hkv, d, mask, tau, big=1.0):
    g = torch.Generator().manual_seed(nq * 1000 + nk + d + 7 * H + Hkv)
    q = torch.randn(1, H, nq, d, dtype=torch.float64, generator=g) * big
    k = torch.randn(1, Hkv, nk, d, dtype=torch.float64, generator=g) * big
    v = torch.randn(1, Hkv, nk, d, dtype=torch.float64, generator=g)
    dO = torch.randn(1, H, nq, d, dtype=torch.float64, generator=g)
    # sdpa reads the float32 inputs: every computation starts from the same rounded values.
    q, k, v, dO = (t.float().double() for t in (q, k, v, dO))
    kw, bias = {}, None
    if mask == "causal-ul":
        kw["is_causal"] = True
        keep = torch.ones(nq, nk, dtype=torch.bool).tril(0)
    elif mask == "causal-lr":
        keep = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        kw["attn_mask"] = keep
    elif mask == "bool":
        keep = torch.rand(nq, nk, generator=g) > 0.3
        keep[:, 0] = True
        kw["attn_mask"] = keep
    elif mask == "float":
        b = torch.randn(nq, nk, dtype=torch.float64, generator=g)
        b[torch.rand(nq, nk, generator=g) < 0.2] = float("-inf")
        b[:, 0] = 0.5
        kw["attn_mask"], bias = b, b
    else:
        keep = None
    if bias is None and mask != "none":
        bias = torch.zeros(nq, nk, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    scale = tau if tau > 0 else 1.0 / d ** 0.5
    if tau > 0:
        kw["scale"] = tau
    if H != Hkv:
        kw["enable_gqa"] = True

    def peer(dt):
        qq, kk, vv = (t.to(dt).detach().requires_grad_() for t in (q, k, v))
        kw2 = dict(kw)
        if "attn_mask" in kw2 and kw2["attn_mask"].dtype != torch.bool:
            kw2["attn_mask"] = kw2["attn_mask"].to(dt)
        o = F.scaled_dot_product_attention(qq, kk, vv, **kw2)
        o.backward(dO.to(dt))
        return [o.detach(), qq.grad, kk.grad, vv.grad]

    ref, t32 = peer(torch.float64), peer(torch.float32)
    plain, s32 = textbook(q, k, v, dO, scale, bias, torch.float32)
    for name, t in (("q", q), ("k", k), ("v", v), ("dO", dO)):
        np.save(os.path.join(work, name + ".npy"), packed(t).numpy())
    if mask in ("bool", "float"):
        np.save(os.path.join(work, "mask.npy"), kw["attn_mask"].double().numpy())
    subprocess.run([exe, work, str(H), str(Hkv), mask, str(tau)], check=True)
    ours = [np.load(os.path.join(work, n + ".npy")) for n in ("out", "dq", "dk", "dv")]
    logit = float(s32[torch.isfinite(s32)].abs().max())
    ok, cells = True, []
    for name, r, o, p, t in zip(("out", "dq", "dk", "dv"), ref, ours, plain, t32):
        r = packed(r.double()).numpy()
        eo = np.abs(o - r).max()
        ep = np.abs(packed(p.double()).numpy() - r).max()
        et = np.abs(packed(t.double()).numpy() - r).max()
        bound = 2 * ep + (8 + logit) * EPS * max(1.0, np.abs(r).max())
        ok = ok and eo <= bound
        cells.append(f"{name} {eo:.1e} / {ep:.1e} / {et:.1e}")
    print(f"| {nq} x {nk} | {H}/{Hkv} | {d} | {mask} | {tau or '1/sqrt(d)'} | {big} | " + " | ".join(cells) +
          f" | {'ok' if ok else 'BROKEN'} |", flush=True)
    return ok


def main():
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        exe = build(work)
        print("| n_q x n_k | H / H_kv | d | mask | tau | x | out: sdpa / textbook / PyTorch fp32 | dq | dk | dv | |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        ok = True
        shapes = [(37, 37), (5, 70), (70, 45), (300, 300)]
        for (nq, nk), (H, Hkv), d, mask, tau in itertools.product(
                shapes, [(1, 1), (4, 2), (4, 1)], [16, 64], ["none", "causal-ul", "causal-lr", "bool", "float"],
                [0, 0.3]):
            ok = case(exe, work, nq, nk, H, Hkv, d, mask, tau) and ok
        for big in (4.0, 8.0):  # logits in the hundreds and thousands
            ok = case(exe, work, 256, 256, 4, 2, 64, "causal-lr", 0, big) and ok
            ok = case(exe, work, 256, 256, 2, 2, 128, "none", 1.0, big) and ok
        print("every case within the rule" if ok else "some case breaks the rule")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
