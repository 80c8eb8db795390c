#!/usr/bin/env python3
"""README.md's program excerpts, produced by the programs themselves, so they cannot drift.

A fenced block right after a line `<!-- excerpt NAME -->` holds the output of the command NAME
below (all of it, or the lines a filter keeps). The `readme: excerpts` test runs the check.

    python3 scripts/readme_excerpts.py --bin BUILD_DIR --check    # exit 1 and a diff if stale
    python3 scripts/readme_excerpts.py --bin BUILD_DIR --update   # rewrite README.md's blocks

BUILD_DIR is a build with the examples (any preset that builds them: demo, test, release);
the npy fixtures of the `cli:` tests must be there (`ctest -R "cli: write fixtures"`).
Python's standard library only.
"""
import argparse
import difflib
import functools
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINDINGS = r"^(stage|warning|note|verdict)"

# name: (command, with {check}, {demo}, {npy}, {data} substituted; a regex the kept lines match,
# or None for every line)
EXCERPTS = {
    "demo": (["{demo}"], r"^ {2,3}(d_k|16|64|512) "),
    "demo-length": (["{demo}"], r"^ +(n_k +scale +logit std +H/log n +planted p|\d+ +\S+ +[\d.]+ +[\d.]+% +[\d.]+)$"),
    "check-random-scaled": (["{check}", "{npy}/q.npy", "{npy}/k.npy", "--heads", "2"], None),
    "check-random-unscaled": (["{check}", "{npy}/q.npy", "{npy}/k.npy", "--heads", "2", "--scale", "none"], FINDINGS),
    "check-minilm": (["{check}", "{data}/minilm/layer0.q.npy", "{data}/minilm/layer0.k.npy"], FINDINGS),
    "check-minilm-unscaled": (["{check}", "{data}/minilm/layer0.q.npy", "{data}/minilm/layer0.k.npy", "--scale",
                               "none"], r"^(stage|verdict)|^warning: head [0-2]: "),
}


@functools.lru_cache(maxsize=None)
def run(argv):
    """A command's output lines, each command run once (the demo serves two excerpts: under the
    sanitizers of the test build it takes half a minute)."""
    r = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode not in (0, 1):  # sdpa_check exits 1 on warnings
        sys.exit(f"readme_excerpts: {' '.join(argv)} failed ({r.returncode}):\n{r.stderr}")
    return r.stdout.splitlines()


def output(name, build, demo_output=None):
    command, keep = EXCERPTS[name]
    paths = {"check": os.path.join(build, "tools", "sdpa_check"),
             "demo": os.path.join(build, "examples", "scaling_demo"),
             "npy": os.path.join(build, "tests", "npy"), "data": os.path.join(ROOT, "tests", "data")}
    if command == ["{demo}"] and demo_output:  # the demo's run by ctest, not a second one
        lines = open(demo_output).read().splitlines()
    else:
        lines = run(tuple(c.format(**paths) for c in command))
    if keep:
        lines = [l for l in lines if re.search(keep, l)]
    return [l.rstrip() for l in lines]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="a build directory with the examples and tools")
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--demo-output", help="the demo's standard output, saved by an earlier run of it")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--update", action="store_true")
    a = ap.parse_args()

    lines = open(a.readme).read().split("\n")
    out, i, seen, stale = [], 0, set(), []
    while i < len(lines):
        out.append(lines[i])
        m = re.fullmatch(r"<!-- excerpt ([a-z0-9-]+) -->", lines[i].strip())
        i += 1
        if not m:
            continue
        name = m.group(1)
        if name not in EXCERPTS:
            sys.exit(f"readme_excerpts: README names an unknown excerpt '{name}'")
        if i >= len(lines) or not lines[i].startswith("```"):
            sys.exit(f"readme_excerpts: excerpt '{name}' is not followed by a fenced block")
        out.append(lines[i])
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            sys.exit(f"readme_excerpts: excerpt '{name}': unclosed block")
        old, new = lines[i + 1:end], output(name, a.bin, a.demo_output)
        if old != new:
            stale.append(name)
            sys.stdout.writelines(d + "\n" for d in difflib.unified_diff(old, new, f"README.md ({name})",
                                                                         f"the program ({name})", lineterm=""))
        out.extend(new)
        out.append(lines[end])
        seen.add(name)
        i = end + 1
    missing = set(EXCERPTS) - seen
    if missing:
        sys.exit(f"readme_excerpts: README has no block for {sorted(missing)}")
    if a.update:
        open(a.readme, "w").write("\n".join(out))
        print(f"readme_excerpts: {len(stale)} block(s) updated: {', '.join(stale) or 'none'}")
    elif stale:
        sys.exit(f"readme_excerpts: stale excerpt(s) in README.md: {', '.join(stale)}; run scripts/readme_excerpts.py "
                 f"--bin <build> --update")
    else:
        print(f"readme_excerpts: {len(seen)} excerpts match their programs")


if __name__ == "__main__":
    main()
