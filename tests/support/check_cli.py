"""sdpa_check's options, checked through its JSON report (Python's standard library only).

    python3 check_cli.py SDPA_CHECK DIR     # DIR: the .npy files of write_npy_fixtures

q.npy: 2 heads of 128 x 64 (3-D); q_short.npy: the first 32 rows of each head, packed 2-D;
k.npy: 128 x (2 x 64), packed 2-D.
"""
import json
import subprocess
import sys

check, d = sys.argv[1], sys.argv[2]


def report(*args):
    out = subprocess.run([check, *args, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert out.returncode == 0, f"sdpa_check {' '.join(args)} failed ({out.returncode}): {out.stderr}"
    return json.loads(out.stdout)


def heads(r, key):
    return [h[key] for h in r["heads"]]


# The JSON is whole: both heads and at least one verdict.
r = report(f"{d}/q.npy", f"{d}/k.npy", "--scale", "none")
assert len(r["heads"]) == 2 and r["verdicts"], r
assert heads(r, "tau") == [1.0, 1.0], heads(r, "tau")

# Each scale spelling gives its tau: 1/sqrt(64), a temperature T (tau = 1 / T), a constant.
for scale, tau in (("inv_sqrt_dk", 0.125), ("T=4", 0.25), ("0.5", 0.5)):
    got = heads(report(f"{d}/q.npy", f"{d}/k.npy", "--scale", scale), "tau")
    assert got == [tau, tau], f"--scale {scale}: tau {got}, expected {tau}"

# Causal alignment with 32 queries against 128 keys: upper-left lets query i see keys 0..i
# (528 logits per head), lower-right keys 0..96+i (32 x 96 + 528 = 3600).
for align, visible in (("upper-left", 528), ("lower-right", 3600)):
    got = heads(report(f"{d}/q_short.npy", f"{d}/k.npy", "--heads", "2", "--causal", align), "visible_logits")
    assert got == [visible, visible], f"--causal {align}: {got} visible logits, expected {visible}"
assert heads(report(f"{d}/q_short.npy", f"{d}/k.npy", "--heads", "2"), "visible_logits") == [4096, 4096]

# GQA: 2 query heads reading 1 kv head of d_k = 64 (k's first 64 columns would not do: the
# packed k has 128 columns, so 2:1 must be refused with the shapes named).
out = subprocess.run([check, f"{d}/q.npy", f"{d}/k.npy", "--heads", "2:1"], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
assert out.returncode == 2 and "sdpa_check:" in out.stderr, (out.returncode, out.stderr)
print("sdpa_check: every option checked")
