#!/usr/bin/env python3
"""Writes the initial seeds of tests/fuzz/corpus (files named seed-*): every mask and scale policy, each kernel, with
ordinary values and with the special ones (inf, NaN, 1e30, denormals, exp-limit logits). The
committed corpus is these plus what fuzzing found (libFuzzer -merge=1). Byte layout: see decode()
in fuzz_attention.cpp."""
import os
import random
import sys

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus")
os.makedirs(out, exist_ok=True)
rng = random.Random(2026)
SPECIALS = list(range(240, 252))


def case(n_q, n_k, d_k, d_v, mask, scale, kernel, specials, long_keys=False):
    header = [n_q, n_k, 0 if long_keys else 1, d_k, d_v, mask, scale, rng.randrange(256), kernel,
              rng.randrange(9), rng.randrange(17), rng.randrange(6)]
    if n_k or long_keys:
        header.append(rng.randrange(256))
    header.append(rng.randrange(256))
    body = []
    for _ in range((n_q + n_k + 600 * long_keys) * max(d_k, 1) * 2 + n_q * n_k + n_k * d_v + 64):
        if rng.random() < specials:
            body.append(rng.choice(SPECIALS))
        else:
            body += [rng.randrange(240), rng.randrange(256)]
    return bytes(header + body)


count = 0
for mask in range(11):
    for scale in range(5):
        for kernel in range(3):
            for specials in (0.05,):  # ordinary values are what the mutations start from anyway
                data = case(rng.randrange(1, 13), rng.randrange(1, 41), rng.randrange(1, 10), rng.randrange(1, 10),
                            mask, scale, kernel, specials)
                with open(os.path.join(out, f"seed-m{mask}-s{scale}-k{kernel}-{int(specials > 0)}"), "wb") as f:
                    f.write(data)
                count += 1
for i, (n_q, n_k, d_k, d_v) in enumerate([(0, 5, 3, 2), (3, 0, 3, 2), (2, 4, 0, 3), (2, 4, 3, 0), (1, 1, 1, 1)]):
    with open(os.path.join(out, f"seed-empty-{i}"), "wb") as f:
        f.write(case(n_q, n_k, d_k, d_v, i % 11, i % 5, i % 3, 0.1))
    count += 1
for i in range(3):
    with open(os.path.join(out, f"seed-long-{i}"), "wb") as f:
        f.write(case(2, 30, 4, 3, [0, 2, 9][i], i, i, 0.01, long_keys=True))
    count += 1
print(f"wrote {count} seeds to {out}")
