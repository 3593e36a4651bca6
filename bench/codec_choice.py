"""Evidence for the O1/O2 codec (README "Compression"): how candidate codings of Adam's moments change the update.

Trains a small Llama with AdamW on CPU (Zipf-distributed tokens, as in text: rare tokens' embedding rows get
small second moments) for `--steps` steps, takes the real `exp_avg` / `exp_avg_sq` of every
parameter, round-trips them through each candidate coding, and prints the relative L2 error of the Adam update
direction `m / (sqrt(v) + eps)` over all parameters, the largest per-element ratio |u'| / max|u| (a value far
above 1 is the zero-point blow-up), and how many non-zero v decode as 0 (where that blow-up can start). Bytes per moment value include the scales.

    python bench/codec_choice.py [--steps 200]
"""

from __future__ import annotations

import argparse

import torch

from hf_unified_ckpt.codecs import CODE_BOOKS, dequantize, quantize


def trained_states(steps: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, 513, dtype=torch.float64)  # token frequencies as in text: many rare tokens
    base = torch.multinomial(zipf, 64 * 65, replacement=True, generator=g).view(64, 65)
    for step in range(steps):
        batch = base[torch.randint(0, 64, (8,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [(s["exp_avg"], s["exp_avg_sq"], s["step"]) for s in opt.state.values()], opt.defaults


CANDIDATES = {
    # name: (m coding, v coding, block); a coding is (kind, book) with kind "signed" | "sqrt" | "v" (v itself)
    "O1 int8 linear m, sqrt(v) no-zero, B128 (chosen)": (("signed", CODE_BOOKS[("signed", 8)]),
                                                          ("sqrt", CODE_BOOKS[("sqrt", 8)]), 128),
    "int8 per-tensor scale (block = whole tensor)": (("signed", CODE_BOOKS[("signed", 8)]),
                                                     ("sqrt", CODE_BOOKS[("sqrt", 8)]), None),
    "int8 B2048": (("signed", CODE_BOOKS[("signed", 8)]), ("sqrt", CODE_BOOKS[("sqrt", 8)]), 2048),
    "int8, v linear with zero, B128": (("signed", CODE_BOOKS[("signed", 8)]),
                                       ("v", [k / 255 for k in range(256)]), 128),
    "O2 int4 NF4 m, sqrt(v) squared-grid no-zero, B128 (chosen)": (("signed", CODE_BOOKS[("signed", 4)]),
                                                                    ("sqrt", CODE_BOOKS[("sqrt", 4)]), 128),
    "int4 linear m, sqrt(v) linear no-zero, B128": (("signed", [k / 7 for k in range(-7, 8)]),
                                                    ("sqrt", [(k + 1) / 16 for k in range(16)]), 128),
    "int4 NF4 m, v linear with zero, B128": (("signed", CODE_BOOKS[("signed", 4)]),
                                             ("v", [k / 15 for k in range(16)]), 128),
    "int4 NF4 m, sqrt(v) linear no-zero, B128": (("signed", CODE_BOOKS[("signed", 4)]),
                                                 ("sqrt", [(k + 1) / 16 for k in range(16)]), 128),
    "int4 NF4 m, sqrt(v) squared-grid, B2048": (("signed", CODE_BOOKS[("signed", 4)]),
                                                ("sqrt", CODE_BOOKS[("sqrt", 4)]), 2048),
}


def round_trip(x: torch.Tensor, coding, block) -> tuple[torch.Tensor, int]:
    kind, book = coding
    book = torch.tensor(book)
    bits = 8 if len(book) > 16 else 4
    block = block or x.numel()
    qkind = "signed" if kind == "v" else kind
    codes, scales = quantize(x, book, qkind, bits, block)
    out = dequantize(codes, scales, book, qkind, bits, x.numel(), block).reshape(x.shape)
    return out, codes.numel() + 4 * scales.numel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    states, defaults = trained_states(args.steps)
    eps, (b1, b2) = defaults["eps"], defaults["betas"]
    n = sum(m.numel() for m, _, _ in states)
    print(f"{len(states)} parameters, {n:,} values, AdamW after {args.steps} steps")
    print(f"{'candidate':<60} {'B/value':>8} {'update rel. L2 err':>18} {'max |u|/max|u_ref|':>18} "
          f"{'v>0 decoded as 0':>16}")
    for name, (mc, vc, block) in CANDIDATES.items():
        err2 = ref2 = 0.0
        worst = 0.0
        size = zeroed = 0
        for m, v, step in states:
            c1, c2 = 1 - b1 ** float(step), 1 - b2 ** float(step)
            u = (m / c1) / ((v / c2).sqrt() + eps)
            m2, s1 = round_trip(m, mc, block)
            v2, s2 = round_trip(v, vc, block)
            u2 = (m2 / c1) / ((v2 / c2).sqrt() + eps)
            err2 += float((u2 - u).square().sum())
            ref2 += float(u.square().sum())
            worst = max(worst, float(u2.abs().max() / u.abs().max().clamp_min(1e-30)))
            size += s1 + s2
            zeroed += int(((v > 0) & (v2 == 0)).sum())
        print(f"{name:<60} {size / (2 * n):>8.3f} {(err2 / ref2) ** 0.5:>18.4f} {worst:>18.1f} {zeroed:>16,}")


if __name__ == "__main__":
    main()
