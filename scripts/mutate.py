#!/usr/bin/env python3
"""Mutation testing of sdpa's headers: does the test suite notice a plausible one-line defect?

Each mutant below replaces one exact, unique piece of a header under include/sdpa (or of the
command-line tool, tools/) with a plausible mistake (a flipped comparison, an off-by-one, the
wrong head, a dropped term). For each mutant the script copies the repository's sources to a
scratch directory, applies the change, compiles the test files that cover that code (g++ -O1, no
unity build) and runs them (for the CLI: configures the copy with CMake, builds sdpa_check and
runs the `cli:` tests of ctest); the mutant is *killed* when the build's tests fail (or time out), and
*survives* when they pass. Mutants marked `equivalent` change no observable result; they are kept
with the argument and left out of the score. A mutant whose change does not compile is
*stillborn* (also left out): fix the list.

    scripts/mutate.py                  # every mutant, 2 at a time; writes build/mutate/report.md
    scripts/mutate.py -k tiled -j 1    # those whose id contains "tiled"
    scripts/mutate.py --check          # only check that every pattern occurs exactly once
    scripts/mutate.py --native -k half # with -march=native (code behind __AVX512F__ / __F16C__ / __AVX2__)

Not part of CI (about 30-60 minutes on 2 cores); README's testing section records the last score.
"""
import argparse
import concurrent.futures as cf
import datetime
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (id, header, original text, mutated text, test files that cover it, note)
# A test file list may name "fuzz": the harness replays the committed corpus too; "cli": the
# copy is configured with CMake and its `cli:` tests run (ctest -R '^cli:'). A header path that
# starts with "tools/" is relative to the repository, any other to include/sdpa.
MUTANTS = [
    # --- masks ---------------------------------------------------------------------------
    ("mask-causal-strict", "mask.hpp",
     "return j <= i + diagonalOffset(align, nQ, nK); }", "return j < i + diagonalOffset(align, nQ, nK); }",
     ["test_masks.cpp"], "causal hides the diagonal"),
    ("mask-align-swap", "mask.hpp",
     "return align == Align::UpperLeft ? 0 : nK - nQ; }", "return align == Align::UpperLeft ? 0 : nQ - nK; }",
     ["test_masks.cpp"], "lower-right offset reversed"),
    ("mask-window-high", "mask.hpp",
     "return j >= p + lowOffset() && j <= p + highOffset();", "return j >= p + lowOffset() && j < p + highOffset();",
     ["test_masks.cpp"], "window loses its right edge"),
    ("mask-keylength-visible", "mask.hpp",
     "bool visible(Index, Index j, Index, Index, Index = 0) const { return j < length; }",
     "bool visible(Index, Index j, Index, Index, Index = 0) const { return j <= length; }",
     ["test_masks.cpp"], "KeyLength off by one"),
    ("mask-keylength-classify", "mask.hpp",
     "return col0 >= length ? Tile::Hidden : (col0 + cols <= length ? Tile::Visible : Tile::Partial);",
     "return col0 >= length ? Tile::Hidden : (col0 + cols <= length + 1 ? Tile::Visible : Tile::Partial);",
     ["test_masks.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "a partial tile classified visible"),
    ("mask-querylength-classify", "mask.hpp",
     "return row0 >= length ? Tile::Hidden : (row0 + rows <= length ? Tile::Visible : Tile::Partial);",
     "return row0 > length ? Tile::Hidden : (row0 + rows <= length ? Tile::Visible : Tile::Partial);",
     ["test_masks.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "a tile of hidden rows classified Partial (the results are the same, but classify() breaks its contract, which test_masks checks)"),
    ("mask-band-classify", "mask.hpp",
     "if (colLast < row0 + lo || col0 > rowLast + hi) return Tile::Hidden;",
     "if (colLast < row0 + lo || col0 >= rowLast + hi) return Tile::Hidden;",
     ["test_masks.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "band classification hides a visible tile"),
    ("mask-nested-stage", "mask.hpp",
     "  } else if constexpr (M::MaskStage == S) {\n    m.apply(tile, row0, col0, nQ, nK, head);",
     "  } else if constexpr (M::MaskStage == S || (S == Stage::Hide && M::MaskStage == Stage::Transform)) {\n    m.apply(tile, row0, col0, nQ, nK, head);",
     ["test_masks.cpp", "fuzz"], "a softcap also runs at the hiding stage (after hiding: -inf -> -c)"),
    ("mask-padded-shift", "layout.hpp",
     "const Index shift = (u.keyLength - u.queryLength) - (u.nK - u.nQ);",
     "const Index shift = (u.keyLength - u.queryLength) + (u.nK - u.nQ);",
     ["test_multihead.cpp"], "padded items aligned to the padded lengths"),
    # --- scale policies ------------------------------------------------------------------
    ("scale-invsqrt", "scale.hpp",
     "return headDim > 0 ? Scalar(1) / std::sqrt(Scalar(headDim)) : Scalar(1);",
     "return headDim > 0 ? Scalar(1) / Scalar(headDim) : Scalar(1);",
     ["test_scale.cpp"], "1/d_k instead of 1/sqrt(d_k)"),
    ("scale-temperature", "scale.hpp",
     "return Scalar(1) / Scalar(m_temperature);", "return Scalar(m_temperature);",
     ["test_scale.cpp"], "temperature multiplies"),
    ("scale-learnable-grad", "scale.hpp",
     "void accumulateGrad(Scalar g) { m_grad += g; }", "void accumulateGrad(Scalar g) { m_grad = g; }",
     ["test_scale.cpp", "test_backward.cpp"], "gradient overwritten, not accumulated"),
    ("scale-learnable-init", "scale.hpp",
     "return m_hasValue ? S(m_value) : InvSqrtDk{}.value<S>(headDim);",
     "return m_hasValue ? S(m_value) : S(1);",
     ["test_scale.cpp"], "learnable starts at 1"),
    # --- online softmax and softmax helpers ----------------------------------------------
    ("online-alpha", "internal/online_softmax.hpp",
     "const Acc alpha = std::exp(m(i) - mNew);", "const Acc alpha = std::exp(mNew - m(i));",
     ["test_softmax.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "rescale by the inverse factor"),
    ("online-lse", "internal/online_softmax.hpp",
     "lse(i) = Lse(m(i) + std::log(l(i)));", "lse(i) = Lse(m(i) + std::log1p(l(i)));",
     ["test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "logSumExp off"),
    ("online-merge", "internal/online_softmax.hpp",
     "const Acc x = std::exp(m(i) - mNew), y = std::exp(mo(i) - mNew);",
     "const Acc x = std::exp(m(i) - mNew), y = std::exp(m(i) - mNew);",
     ["test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "key-split merge uses the wrong factor"),
    ("online-cut", "internal/online_softmax.hpp",
     "p[j] = z > kExpCut<Acc> ? std::exp(z) / l : Acc(0);\n  }\n}", "p[j] = z > kExpCut<Acc> ? std::exp(z) * l : Acc(0);\n  }\n}",
     ["test_backward.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "scalar tail of expDivided multiplies by l"),
    ("online-dot-skip", "internal/online_softmax.hpp",
     "    if (e != Acc(0)) d += e * w[j];", "    d += e * w[j];",
     ["test_backward.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp", "fuzz"],
     "equivalent: 0 * inf makes the row's D NaN, and a non-finite D is summed again from the final weights"),
    ("online-finite-flag", "internal/online_softmax.hpp",
     "  return {std::isnan(argSum) ? argSum : sum, d, !std::isnan(zero)};",
     "  return {std::isnan(argSum) ? argSum : sum, d, true};",
     ["test_backward.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp", "fuzz"], "dP taken as finite"),
    # --- naive forward ---------------------------------------------------------------------
    ("naive-tau", "internal/forward_naive.hpp",
     "    if (tau != Scalar(1)) s *= tau;\n", "    if (tau != Scalar(1)) s /= tau;\n",
     ["test_forward.cpp"], "naive forward divides by tau"),
    ("naive-skip-zeros", "internal/forward_naive.hpp",
     "      if (a(i, j) != 0) out.row(i) += a(i, j) * b.row(j);", "      out.row(i) += a(i, j) * b.row(j);",
     ["test_masks.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "a hidden NaN value leaks"),
    ("naive-dropout-scale", "internal/forward_naive.hpp",
     "if (p(i, j) != 0) p(i, j) = dropout.keep(row0 + i, col0 + j, head) ? p(i, j) * keepScale : Scalar(0);",
     "if (p(i, j) != 0) p(i, j) = dropout.keep(row0 + i, col0 + j, head) ? p(i, j) : Scalar(0);",
     ["test_backward.cpp"], "dropout without 1/(1-p)"),
    # --- tiled forward and decoding ------------------------------------------------------
    ("tiled-fold", "internal/forward_tiled.hpp",
     "static bool folds(Acc tau, const RowStream* stats) { return foldsScaleIntoQuery(tau) && !(stats && tau == Acc(0)); }",
     "static bool folds(Acc tau, const RowStream* stats) { return !(stats && tau == Acc(0)); }",
     ["test_special_values.cpp", "fuzz"], "tau folded into q whatever its size"),
    ("tiled-unfold-scale", "internal/forward_tiled.hpp",
     "    if (!fold) s *= tau;\n", "",
     ["test_special_values.cpp", "test_multihead.cpp", "test_decode.cpp"], "a large tau never applied"),
    ("tiled-head-scale", "internal/forward_tiled.hpp",
     "v.block(u.k0, u.kvHead * dims.dV, u.nK, dims.dV), taus.tau(u.head), itemMask(mask, u), dropout,",
     "v.block(u.k0, u.kvHead * dims.dV, u.nK, dims.dV), taus.tau(u.kvHead), itemMask(mask, u), dropout,",
     ["test_multihead.cpp"], "per-head tau read from the kv head (#21's survivor)"),
    ("tiled-sizes", "internal/forward_tiled.hpp",
     "  TileSizes t = d <= 32 ? TileSizes{128, 512} : TileSizes{256, 256};",
     "  TileSizes t = d <= 32 ? TileSizes{128, 512} : TileSizes{256, 255};",
     ["test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "equivalent: another key tile size changes only rounding"),
    ("half-axpy-lanes", "internal/half.hpp",
     "      y3 = _mm256_fmadd_ps(va[c], widen(xc + 24), y3);", "",
     ["test_tiled.cpp", "test_decode.cpp", "test_half.cpp"], "AVX2 half decoding drops a quarter of its logits' lanes"),
    ("half-dot-lanes", "internal/half.hpp",
     "        hi[c] = _mm256_fmadd_ps(p3, widen(xc + 24), _mm256_fmadd_ps(p1, widen(xc + 8), hi[c]));",
     "        hi[c] = _mm256_fmadd_ps(p3, widen(xc + 16), _mm256_fmadd_ps(p1, widen(xc + 8), hi[c]));",
     ["test_tiled.cpp", "test_decode.cpp", "test_half.cpp"], "AVX2 half decoding reads the wrong keys in its values' dots"),
    ("half-avx512-lanes", "internal/half.hpp",
     "      hi = _mm512_fmadd_ps(va[c], widen(xc + 16), hi);", "",
     ["test_tiled.cpp", "test_decode.cpp", "test_half.cpp"], "AVX-512 half decoding drops half its lanes (#21's survivor; survives where the CPU has no AVX-512)"),
    ("quant-avx2-q4-high", "internal/kv_quant.hpp",
     "      x[h + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));",
     "      x[h + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 3));",
     ["test_kv_cache.cpp"], "AVX2 q4 widening reads the high nibbles wrong"),
    ("quant-avx2-q4-key-offset", "internal/kv_quant.hpp",
     "      bias[r] = -kQ4Offset<F> * total;",
     "      bias[r] = -kQ4Offset<F> * ar[0];",
     ["test_kv_cache.cpp"], "AVX2 q4 logits take the codes' offset of 8 out for one channel only"),
    ("quant-avx2-q4-value-offset", "internal/kv_quant.hpp",
     "        dots[m][c] = std::fma(-kQ4Offset<F>, offset[m * d + c], sum);",
     "        dots[m][c] = std::fma(-kQ4Offset<F>, offset[m * d], sum);",
     ["test_kv_cache.cpp"], "AVX2 q4 values take the first channel's offset for every channel"),
    ("decode-paged-keys", "internal/decode_cache.hpp",
     "    for (int b = 0; b < J; ++b) x[b] = loadFloats(k + b * W + c * ldk);",
     "    for (int b = 0; b < J; ++b) x[b] = loadFloats(k + c * ldk);",
     ["test_kv_cache.cpp"], "a paged block's logits (keys in registers) read the first key packet for every packet"),
    ("decode-paged-values", "internal/decode_cache.hpp",
     "      const Packet x = loadFloats(vc + j);",
     "      const Packet x = loadFloats(vc);",
     ["test_kv_cache.cpp"], "a paged block's values (column order) read the first key packet for every packet"),
    ("tiled-skip-zeros", "internal/forward_tiled.hpp",
     "        addProductSkippingZeros(s, vt, acc);  // a GEMM unless this v tile holds NaN or inf",
     "        acc.noalias() += s * vt;",
     ["test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp", "test_masks.cpp"], "hidden NaN values reach the output"),
    # --- GQA, batches, layouts -----------------------------------------------------------
    ("gqa-mapping", "layout.hpp",
     "f(ItemHead{b, h, h / heads.groupSize(), q0, nQ, k0, nK, qLen, kLen});",
     "f(ItemHead{b, h, h % heads.keyValue, q0, nQ, k0, nK, qLen, kLen});",
     ["test_multihead.cpp"], "query head h reads kv head h % H_kv"),
    ("dropout-keep", "dropout.hpp",
     "return double(r[0]) >= p * 4294967296.0;", "return double(r[0]) > p * 4096.0;",
     ["test_backward.cpp"], "keep rate wrong"),
    ("dropout-scale", "dropout.hpp",
     "double keepScale() const { return 1.0 / (1.0 - p); }", "double keepScale() const { return 1.0 - p; }",
     ["test_backward.cpp"], "inverted dropout scale"),
    # --- naive backward ------------------------------------------------------------------
    ("bnaive-softcap-slope", "internal/backward_naive.hpp",
     "          g *= Scalar(1) - t * t;", "          g *= Scalar(1) + t * t;",
     ["test_backward.cpp"], "softcap derivative sign"),
    ("bnaive-dtau-tau", "internal/backward_naive.hpp",
     "        g *= tau;\n", "",
     ["test_backward.cpp"], "dq, dk not scaled by tau"),
    ("bnaive-hidden-select", "internal/backward_naive.hpp",
     "      dp = (p == Scalar(0)).select(Scalar(0), p * (dp - d));", "      dp = p * (dp - d);",
     ["test_backward.cpp", "test_special_values.cpp"], "0 * inf at hidden entries"),
    ("bnaive-centre", "internal/backward_naive.hpp",
     "        dtau += double(g * (factor - s.centre(i)));", "        dtau += double(g * factor);",
     ["test_backward.cpp"], "dtau not centred (accuracy at large logits)"),
    # --- tiled backward ------------------------------------------------------------------
    ("btiled-alpha", "internal/backward_tiled.hpp",
     "      const Scalar alpha = std::exp(m(r) - mNew);", "      const Scalar alpha = Scalar(1);",
     ["test_backward.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "running sums not rescaled"),
    ("btiled-d-norm", "internal/backward_tiled.hpp",
     "      if (l(r) > Scalar(0)) d(r) /= l(r);", "",
     ["test_backward.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "D not normalised"),
    ("btiled-softcap-slope", "internal/backward_tiled.hpp",
     "      t.array() = Scalar(1) - t.array() * t.array();", "      t.array() = Scalar(1) + t.array() * t.array();",
     ["test_backward.cpp"], "softcap derivative sign (tiled)"),
    ("btiled-softcap-nonfinite", "internal/backward_tiled.hpp",
     "        dp = (dp.array() == Scalar(0)).select(Scalar(0), dp.array() * t.array()).matrix();",
     "        dp = (dp.array() == Scalar(0)).select(Scalar(0), -dp.array() * t.array()).matrix();",
     ["test_backward.cpp", "fuzz"], "softcap derivative sign in the non-finite path (#21's survivor)"),
    ("btiled-dtau-tau", "internal/backward_tiled.hpp",
     "      dtau /= double(h.tau);", "      dtau /= 2 * double(h.tau);",
     ["test_backward.cpp", "fuzz"], "dL/dtau off by a factor"),
    ("btiled-scale-dx", "internal/backward_tiled.hpp",
     "        if (!done(r)) dp.row(r) *= h.tau;", "        if (!done(r)) dp.row(r) /= h.tau;",
     ["test_backward.cpp"], "dX = dY / tau (the rows not done in one sweep: softcap, bias gradient, non-finite)"),
    ("btiled-fused-tau", "internal/online_softmax.hpp",
     "    ei::pstoreu(dp + j, ei::pmul(dl, ptau));", "    ei::pstoreu(dp + j, dl);",
     ["test_backward.cpp", "test_tiled.cpp", "test_decode.cpp", "test_special_values.cpp"], "dX = dY (tau not applied in the one-sweep rows)"),
    ("btiled-head-scale", "internal/backward_tiled.hpp",
     "        taus.tau(u.head),\n", "        taus.tau(u.kvHead),\n",
     ["test_multihead.cpp", "test_backward.cpp"], "per-head tau read from the kv head (backward)"),
    ("btiled-dp-finite", "internal/backward_tiled.hpp",
     "safe = safe && sc.dpSafe[size_t(j0 / tile.k)];", "safe = safe || sc.dpSafe[size_t(j0 / tile.k)];",
     ["test_special_values.cpp", "test_backward.cpp", "fuzz"], "an overflowing dP taken as finite"),
    ("btiled-unfold", "internal/backward_tiled.hpp",
     "    if (!foldsScaleIntoQuery(h.tau)) x *= h.tau;\n", "",
     ["test_special_values.cpp", "test_backward.cpp", "test_multihead.cpp"], "a large tau never applied (backward)"),
    ("btiled-centre", "internal/backward_tiled.hpp",
     "dtau += double(centredDotSkippingZeros(dp.row(r).data(), factor.row(r).data(), bk, rows.centre(i0 + r)));",
     "dtau += double(centredDotSkippingZeros(dp.row(r).data(), factor.row(r).data(), bk, Scalar(0)));",
     ["test_backward.cpp"], "dtau not centred (tiled; accuracy at large logits)"),
    # --- diagnostics ---------------------------------------------------------------------
    ("diag-saturated", "diagnostics.hpp",
     "inline constexpr double kSaturated = 0.99;", "inline constexpr double kSaturated = 0.9;",
     ["test_diagnostics.cpp"], "saturation threshold (#21's survivor)"),
    ("diag-uniform", "diagnostics.hpp",
     "inline constexpr double kNearUniform = 0.99;", "inline constexpr double kNearUniform = 0.98;",
     ["test_diagnostics.cpp"], "near-uniform threshold"),
    ("diag-entropy-fraction", "diagnostics.hpp",
     "    fraction.push_back(r.entropy / std::log(double(r.visible)));",
     "    fraction.push_back(r.entropy / std::log(double(r.visible + 1)));",
     ["test_diagnostics.cpp"], "entropy fraction over n + 1"),
    ("diag-std", "diagnostics.hpp",
     "    d.logitStd = std::sqrt(std::max(0.0, sumSq / n - d.logitMean * d.logitMean));",
     "    d.logitStd = std::sqrt(std::max(0.0, sumSq / n));",
     ["test_diagnostics.cpp"], "std without the mean"),
    ("diag-pmax", "internal/diagnostics_rows.hpp",
     "  r.lse = lse;\n  r.pMax = std::exp(r.logitMax - lse);", "  r.lse = lse;\n  r.pMax = std::exp(r.logitMin - lse);",
     ["test_diagnostics.cpp"], "p_max from the smallest logit"),
    ("diag-overflow", "internal/diagnostics_rows.hpp",
     "    r.overFp32 = Index((s.array() > Scalar(fp32Limit)).count());",
     "    r.overFp32 = Index((s.array() > Scalar(fp16Limit)).count());",
     ["test_diagnostics.cpp"], "fp32 overflow counted at the fp16 limit"),
    ("diag-stage-band", "diagnostics.hpp",
     "  return std::max(0.25,\n", "  return std::max(5.0,\n",
     ["test_diagnostics.cpp", "test_real_model.cpp"], "every model read as at initialisation"),
    ("diag-run-missing", "diagnostics.hpp",
     "spread.size() >= 2 && medianSpread > 3 &&", "spread.size() >= 2 && medianSpread > 30 &&",
     ["test_real_model.cpp"], "a trained model's missing scale not seen"),
    ("diag-underflow", "diagnostics.hpp",
     "  d.underflowFraction = countAbove(gap, underflow);", "  d.underflowFraction = countAbove(gap, 2 * underflow);",
     ["test_diagnostics.cpp"], "underflow at twice the smallest normal's lead"),
    ("diag-plain-fp16", "diagnostics.hpp",
     "      if (plain && opt.precision == Precision::Fp16)", "      if (opt.precision == Precision::Fp16)",
     ["test_diagnostics.cpp"], "fp16 overflow a warning for a max-subtracted softmax too"),
    ("diag-median", "diagnostics.hpp",
     "    const double h = f * double(x.size() - 1);", "    const double h = f * double(x.size());",
     ["test_diagnostics.cpp"], "quantiles one rank high (the upper median)"),
    # --- command-line tool (tools/) ------------------------------------------------------
    ("cli-causal-align", "tools/sdpa_check.cpp",
     "causal == \"upper-left\" ? Align::UpperLeft : Align::LowerRight", "causal == \"upper-left\" ? Align::LowerRight : Align::UpperLeft",
     ["cli"], "--causal alignments swapped"),
    ("cli-temperature", "tools/cli_args.hpp",
     "      s.tau = 1 / t;", "      s.tau = t;",
     ["test_npy.cpp", "cli"], "--scale T=<temperature> taken as tau"),
    ("cli-scale-none", "tools/cli_args.hpp",
     "    if (text == \"none\") {\n      s.tau = 1;", "    if (text == \"none\") {\n      s.invSqrtDk = true;",
     ["test_npy.cpp", "cli"], "--scale none ignored"),
    ("cli-kv-heads", "tools/cli_args.hpp",
     "hKv = colon == std::string::npos ? h :", "hKv = colon == std::string::npos ? 1 :",
     ["test_npy.cpp", "cli"], "--heads H means H:1 (MQA) instead of H:H"),
    ("cli-number-prefix", "tools/cli_args.hpp",
     "  if (end != text.c_str() + text.size()) refuse(", "  if (end == text.c_str()) refuse(",
     ["test_npy.cpp", "cli"], "a number parsed by its prefix (0.5abc is 0.5: the defect #18 reported)"),
    ("cli-exit-warning", "tools/sdpa_check.cpp",
     "    return d.healthy() ? 0 : 1;", "    return 0;",
     ["cli"], "warnings exit 0 (the check cannot gate CI)"),
    ("cli-exit-code", "tools/sdpa_check.cpp",
     "    return 2;\n", "    return 0;\n",
     ["cli"], "an error exits 0"),
    ("cli-npy-fortran", "npy.hpp",
     "  if (!fortran || a.shape.size() == 1) {", "  if (true) {",
     ["test_npy.cpp"], "Fortran-order arrays read as C order"),
    ("cli-npy-pack", "tools/cli_args.hpp",
     "in.headsFirst ? a.data[size_t((h * L + i) * d + j)]", "in.headsFirst ? a.data[size_t((i * H + h) * d + j)]",
     ["test_npy.cpp", "cli"], "(H, L, d) heads packed from the wrong strides"),
]


def run(cmd, cwd=None, timeout=None):
    return subprocess.run(cmd, cwd=cwd, timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def check_patterns():
    ok = True
    for mid, header, old, new, tests, note in MUTANTS:
        text = open(source(ROOT, header)).read()
        n = text.count(old)
        if n != 1:
            print(f"{mid}: pattern occurs {n} times in {header}")
            ok = False
        for t in tests:
            if t not in ("fuzz", "cli") and not os.path.exists(os.path.join(ROOT, "tests", t)):
                print(f"{mid}: no tests/{t}")
                ok = False
    return ok


NATIVE = False


def source(root, header):
    return os.path.join(root, header) if header.startswith("tools/") else os.path.join(root, "include", "sdpa", header)


def flags():
    eigen = "/usr/include/eigen3"
    return ["-std=c++17", "-O1", "-fopenmp", "-w", f"-I{eigen}"] + (["-march=native"] if NATIVE else [])


def catch_main(work):
    """Catch2 2.x's main compiled once (Debian 12 ships 2.13 with catch.hpp)."""
    obj = os.path.join(work, "catch_main.o")
    if not os.path.exists(obj):
        r = run(["g++", *flags(), f"-I{ROOT}/tests", "-c", os.path.join(ROOT, "tests/support/main.cpp"), "-o", obj])
        if r.returncode != 0:
            sys.exit("cannot compile tests/support/main.cpp:\n" + r.stdout)
    return obj


def one(mutant, work, main_obj, timeout):
    mid, header, old, new, tests, note = mutant
    d = os.path.join(work, mid)
    shutil.rmtree(d, ignore_errors=True)
    for sub in ("include", "tests", "experiments", "tools", "examples", "cmake"):
        if os.path.isdir(os.path.join(ROOT, sub)):
            shutil.copytree(os.path.join(ROOT, sub), os.path.join(d, sub))
    shutil.copy(os.path.join(ROOT, "CMakeLists.txt"), d)
    path = source(d, header)
    text = open(path).read()
    assert text.count(old) == 1, mid
    open(path, "w").write(text.replace(old, new))
    inc = [f"-I{d}/include", f"-I{d}/tests", f"-I{d}/experiments", f"-I{d}/tools", f'-DSDPA_TEST_DATA="{d}/tests/data"']
    start = time.time()
    outcome, detail = "survived", ""
    units = [t for t in tests if t not in ("fuzz", "cli")]
    if units:
        exe = os.path.join(d, "unit")
        r = run(["g++", *flags(), *inc, *[os.path.join(d, "tests", t) for t in units], main_obj, "-o", exe,
                 "-fopenmp"])
        if r.returncode != 0:
            return mid, "stillborn", r.stdout[-400:], time.time() - start
        try:
            r = run([exe], cwd=d, timeout=timeout)
            if r.returncode != 0:
                outcome = "killed"
                detail = next((l for l in r.stdout.splitlines() if "FAILED" in l or "with expansion" in l), "")
        except subprocess.TimeoutExpired:
            outcome, detail = "killed", "timeout"
    if outcome == "survived" and "cli" in tests:
        b = os.path.join(d, "build")
        r = run(["cmake", "-S", d, "-B", b, "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_CXX_FLAGS=-O1 -w",
                 "-DSDPA_BUILD_TESTS=ON", "-DSDPA_BUILD_EXAMPLES=ON", "-DSDPA_BUILD_BENCHMARKS=OFF",
                 "-DSDPA_FUZZ_REPLAY=OFF", "-DSDPA_INSTALL=OFF"] + (["-DSDPA_NATIVE=ON"] if NATIVE else []))
        if r.returncode == 0:
            r = run(["cmake", "--build", b, "--target", "sdpa_check", "write_npy_fixtures"])
        if r.returncode != 0:
            return mid, "stillborn", r.stdout[-400:], time.time() - start
        try:
            r = run(["ctest", "--test-dir", b, "-R", "^cli:", "--output-on-failure"], timeout=timeout)
            if r.returncode != 0:
                outcome = "killed"
                detail = "cli: " + next((l for l in r.stdout.splitlines() if "***Failed" in l or "Error" in l), "")
        except subprocess.TimeoutExpired:
            outcome, detail = "killed", "cli: timeout"
    if outcome == "survived" and "fuzz" in tests:
        exe = os.path.join(d, "replay")
        r = run(["g++", *flags(), *inc, os.path.join(d, "tests/fuzz/fuzz_attention.cpp"),
                 os.path.join(d, "tests/fuzz/replay_main.cpp"), "-o", exe])
        if r.returncode != 0:
            return mid, "stillborn", r.stdout[-400:], time.time() - start
        try:
            r = run([exe, os.path.join(d, "tests/fuzz/corpus")], cwd=d, timeout=timeout,)
            if r.returncode != 0:
                outcome = "killed"
                detail = "fuzz corpus: " + next((l for l in r.stdout.splitlines() if "fuzz_attention:" in l), "")
        except subprocess.TimeoutExpired:
            outcome, detail = "killed", "fuzz corpus: timeout"
    shutil.rmtree(d, ignore_errors=True)
    return mid, outcome, detail, time.time() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only mutants whose id contains this")
    ap.add_argument("-j", type=int, default=2, help="mutants built and run at once")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per test run")
    ap.add_argument("--check", action="store_true", help="only check the patterns")
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "mutate"))
    ap.add_argument("--report", metavar="LOG", help="only rebuild the report from a run's printed lines")
    ap.add_argument("--native", action="store_true",
                    help="compile with -march=native (the paths chosen at compile time: Eigen's packets, short half pieces)")
    args = ap.parse_args()
    global NATIVE
    NATIVE = args.native
    if not check_patterns():
        sys.exit(1)
    if args.check:
        print(f"{len(MUTANTS)} mutants, every pattern unique")
        return
    os.makedirs(args.work, exist_ok=True)
    chosen = [m for m in MUTANTS if args.k in m[0]]
    results = {}
    if args.report:
        for line in open(args.report):
            parts = line.split()
            if len(parts) >= 3 and parts[0] in ("killed", "survived", "stillborn"):
                results[parts[1]] = (parts[0], "", float(parts[2]))
        chosen = [m for m in chosen if m[0] in results]
    else:
        main_obj = catch_main(args.work)
        with cf.ThreadPoolExecutor(max_workers=args.j) as pool:
            futures = [pool.submit(one, m, args.work, main_obj, args.timeout) for m in chosen]
            for f in cf.as_completed(futures):
                mid, outcome, detail, secs = f.result()
                results[mid] = (outcome, detail, secs)
                print(f"{outcome:10s} {mid:28s} {secs:6.0f} s  {detail[:100]}", flush=True)
    equivalent = {m[0] for m in chosen if m[5].startswith("equivalent")}
    counted = [m for m in chosen if m[0] not in equivalent and results[m[0]][0] != "stillborn"]
    killed = [m for m in counted if results[m[0]][0] == "killed"]
    score = 100.0 * len(killed) / max(1, len(counted))
    lines = [f"# Mutation run {datetime.date.today()}: {len(killed)} of {len(counted)} killed ({score:.0f}%)", "",
             "| mutant | header | outcome | what it breaks |", "|---|---|---|---|"]
    for m in chosen:
        outcome = results[m[0]][0] + (" (equivalent)" if m[0] in equivalent else "")
        lines.append(f"| {m[0]} | {m[1]} | {outcome} | {m[5]} |")
    report = os.path.join(args.work, "report.md")
    open(report, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines[:1]))
    print(f"report: {report}")
    survivors = [m[0] for m in counted if results[m[0]][0] == "survived"]
    if survivors:
        print("survived: " + ", ".join(survivors))


if __name__ == "__main__":
    main()
