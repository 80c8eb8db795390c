"""sdpa_check's options, exit status, verdicts on a real model, and its refusals (Python's
standard library only).

    python3 check_cli.py SDPA_CHECK NPY_DIR DATA_DIR WORK_DIR

NPY_DIR: the .npy files of write_npy_fixtures (q.npy: 2 heads of 128 x 64, 3-D; q_short.npy: the
first 32 rows of each head, packed 2-D; k.npy: 128 x (2 x 64), packed 2-D). DATA_DIR: tests/data
(all-MiniLM-L6-v2's q and k, 4-D (1, 12, 21, 32); the same architecture at initialisation with 6
heads of 64). WORK_DIR: where the layout variants of the real fixtures are written.
"""
import array
import json
import os
import subprocess
import sys

check, d, data, work = sys.argv[1:5]
os.makedirs(work, exist_ok=True)
HEALTHY, WARNINGS, USAGE = 0, 1, 2


def run(*args):
    return subprocess.run([check, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def report(*args, status=None):
    out = run(*args, "--json")
    assert out.returncode in (HEALTHY, WARNINGS), f"sdpa_check {' '.join(args)} failed ({out.returncode}): {out.stderr}"
    r = json.loads(out.stdout)
    # The exit status is the verdict's level: 0 healthy (notes allowed), 1 warnings.
    assert out.returncode == (HEALTHY if r["level"] == "healthy" else WARNINGS), (out.returncode, r["level"])
    assert r["warnings"] == sum(f["level"] == "warning" for f in r["findings"]), r
    if status is not None:
        assert out.returncode == status, f"sdpa_check {' '.join(args)}: exit {out.returncode}, expected {status}"
    return r


def refused(args, *fragments):
    out = run(*args)
    assert out.returncode == USAGE, f"sdpa_check {' '.join(args)}: exit {out.returncode}, expected 2\n{out.stdout}"
    errors = [l for l in out.stderr.splitlines() if l.startswith("sdpa_check: ") and not l.startswith("sdpa_check: note:")]
    assert errors, out.stderr
    first = errors[0]
    for f in fragments:
        assert f in first, f"sdpa_check {' '.join(args)}: '{f}' not in: {first}"


def heads(r, key):
    return [h[key] for h in r["heads"]]


def warned(r, text):
    return sum(f["level"] == "warning" and text in f["text"] for f in r["findings"])


# --- npy helpers (float32 in, float32 out, C order) -------------------------------------------
def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[8:10], "little")
    header = raw[10:10 + n].decode()
    assert "'<f4'" in header and "False" in header, header
    shape = tuple(int(x) for x in header.split("(")[1].split(")")[0].split(",") if x.strip())
    a = array.array("f")
    a.frombytes(raw[10 + n:])
    return shape, a


def save(path, shape, values):
    dims = ",".join(str(s) for s in shape) + ("," if len(shape) == 1 else "")
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%s), }" % dims
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode())
        f.write(array.array("f", values).tobytes())


def transpose_hl(shape, a):
    """(1, H, L, d) -> (L, H, d) values in C order."""
    _, H, L, dd = shape
    return [a[(h * L + i) * dd + c] for i in range(L) for h in range(H) for c in range(dd)]


# --- the generated fixtures: every option ------------------------------------------------------
r = report(f"{d}/q.npy", f"{d}/k.npy", "--scale", "none")
assert len(r["heads"]) == 2 and r["verdicts"], r
assert heads(r, "tau") == [1.0, 1.0], heads(r, "tau")
# Independent N(0, 1) q and k: at initialisation by C3's premise; unscaled d_k = 64 is warned.
assert r["stage"] == "init" and r["level"] == "warning", (r["stage"], r["level"])
assert warned(r, "the scale looks missing") == 2

# Each scale spelling gives its tau.
for scale, tau in (("inv_sqrt_dk", 0.125), ("T=4", 0.25), ("0.5", 0.5), ("1/8", 0.125), ("1/sqrt(64)", 0.125),
                   ("rsqrt(64)", 0.125), ("none", 1.0)):
    got = heads(report(f"{d}/q.npy", f"{d}/k.npy", "--scale", scale), "tau")
    assert got == [tau, tau], f"--scale {scale}: tau {got}, expected {tau}"

# Causal alignment with 32 queries against 128 keys: upper-left lets query i see keys 0..i
# (528 logits per head), lower-right keys 0..96+i (32 x 96 + 528 = 3600).
for align, visible in (("upper-left", 528), ("lower-right", 3600)):
    got = heads(report(f"{d}/q_short.npy", f"{d}/k.npy", "--heads", "2", "--causal", align), "visible_logits")
    assert got == [visible, visible], f"--causal {align}: {got} visible logits, expected {visible}"
assert heads(report(f"{d}/q_short.npy", f"{d}/k.npy", "--heads", "2"), "visible_logits") == [4096, 4096]

# Padding: the lengths cut the figures to those of the unpadded rows, exactly.
short = report(f"{d}/q_short.npy", f"{d}/k.npy", "--heads", "2", "--key-length", "100")
assert heads(short, "visible_logits") == [3200, 3200] and heads(short, "keys") == [100, 100], short["heads"][0]
padded = report(f"{d}/q.npy", f"{d}/k.npy", "--query-length", "32", "--key-length", "100")
assert heads(padded, "logit") == heads(short, "logit"), (heads(padded, "logit"), heads(short, "logit"))

# GQA: 2 query heads reading 1 kv head would need k of 64 columns; k.npy has 128.
refused([f"{d}/q.npy", f"{d}/k.npy", "--heads", "2:1"], "d_k")

# The stage, precision and softmax options are carried to the report.
r = report(f"{d}/q.npy", f"{d}/k.npy", "--stage", "trained", "--precision", "fp16", "--softmax", "plain")
assert (r["stage"], r["stage_reason"], r["precision"], r["softmax"]) == ("trained", "set by the caller", "fp16",
                                                                         "plain"), r

# --- a real trained model: all-MiniLM-L6-v2 ---------------------------------------------------
missing = 0
for layer in range(6):
    q, k = f"{data}/minilm/layer{layer}.q.npy", f"{data}/minilm/layer{layer}.k.npy"
    r = report(q, k, status=HEALTHY)  # its own scale, 1/sqrt(d_k): healthy, notes allowed
    assert r["stage"] == "trained" and r["stage_reason"].startswith("auto: "), r["stage_reason"]
    r = report(q, k, "--scale", "none", status=WARNINGS)
    missing += warned(r, "the scale looks missing")
assert missing >= 64, f"the missing scale is flagged on {missing} of 72 heads"
r = report(f"{data}/minilm-init-d64/layer0.q.npy", f"{data}/minilm-init-d64/layer0.k.npy", "--scale", "none",
           status=WARNINGS)
assert r["stage"] == "init" and warned(r, "the scale looks missing") == 6 and warned(r, "saturated") >= 3, r

# The same layer in every layout a user may have gives the same report.
shape, a = load(f"{data}/minilm/layer1.q.npy")
_, H, L, dd = shape
lhd = transpose_hl(shape, a)
save(f"{work}/q_packed.npy", (L, H * dd), lhd)
save(f"{work}/q_linear.npy", (1, L, H * dd), lhd)
save(f"{work}/q_heads_first.npy", (H, L, dd), a)
save(f"{work}/q_seq_first.npy", (L, H, dd), lhd)
save(f"{work}/q_batch2.npy", (2, H, L, dd), list(a) + list(a))
k = f"{data}/minilm/layer1.k.npy"
base = report(f"{data}/minilm/layer1.q.npy", k)
for variant, extra in (("q_packed", ["--heads", "12"]), ("q_linear", ["--heads", "12"]), ("q_heads_first", [])):
    got = report(f"{work}/{variant}.npy", k, *extra)
    assert got["heads"] == base["heads"], f"{variant}: the figures differ from the 4-D file's"

# --- refusals: each names the argument and says what is accepted ------------------------------
q, k = f"{d}/q.npy", f"{d}/k.npy"
for bad in ("1/sqrt(32", "0.5abc", "T=4foo", "", "1e400", "1/0", "T=0", "-", "nan"):
    refused([q, k, "--scale", bad], f"--scale '{bad}'", "accepted:")
for bad in ("0", "12:0", "12x", "2:", ":2", "-2", "12:5"):
    refused([q, k, "--heads", bad], f"--heads '{bad}'")
for opt in ("--causal", "--stage", "--precision", "--softmax"):
    refused([q, k, opt, "sideways"], f"{opt} 'sideways'", "accepted:")
for opt in ("--query-length", "--key-length"):
    refused([q, k, opt, "0"], f"{opt} '0'")
    refused([q, k, opt, "129"], f"{opt} 129", "beyond")
refused([q, k, "--scale"], "--scale needs a value")
refused([q, k, "--sclae", "none"], "unknown option --sclae")
refused([q], "need q.npy and k.npy")
refused([q, k, q], "unexpected argument")
refused([f"{work}/q_packed.npy", k], "2-D", "pass --heads H")
refused([f"{work}/q_linear.npy", k], "Linear layer's output", "pass --heads H")
refused([f"{work}/q_seq_first.npy", f"{work}/q_heads_first.npy"], "swapped")
refused([f"{work}/q_batch2.npy", k], "a batch of 2")
refused([f"{d}/bad.npy", k], "bad magic string")
print("sdpa_check: every option, exit status, real-model verdict and refusal checked")
