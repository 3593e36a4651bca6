"""Evidence for the O1/O2 codec (README "Compression"): how candidate codings of Adam's moments change the update.

Trains a small Llama with AdamW on CPU (Zipf-distributed tokens, as in text: rare tokens' embedding rows get
small second moments) for `--steps` steps, takes the real `exp_avg` / `exp_avg_sq` of every
parameter, round-trips them through each candidate coding, and prints the relative L2 error of the Adam update
direction `m / (sqrt(v) + eps)` over all parameters, the largest per-element ratio |u'| / max|u| (a value far
above 1 is the zero-point blow-up), and how many non-zero v decode as 0 (where that blow-up can start). Bytes per moment value include the scales.

    python bench/decisions/codec_choice.py [--steps 200]
"""

from __future__ import annotations

import argparse

import torch

from hf_unified_ckpt.format.codecs import CODE_BOOKS, Grid, dequantize, quantize


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


NF4 = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461, 0.3379, 0.4407,
       0.5626, 0.7230, 1.0]  # QLoRA's NormalFloat-4, for comparison
S8, Q8, S4, Q4 = (CODE_BOOKS[k] for k in (("signed", 8), ("sqrt", 8), ("signed", 4), ("sqrt", 4)))
CANDIDATES = {
    # name: (m coding, v coding, block); a coding is (kind, book): kind "signed" | "sqrt" | "v" (v itself, linear),
    # book a codecs.Grid (the library's own quantizer) or a list of values (nearest value, by search)
    "O1: int8 linear m, sqrt(v) no-zero, B128 (chosen)": (("signed", S8), ("sqrt", Q8), 128),
    "int8, one scale per tensor": (("signed", S8), ("sqrt", Q8), None),
    "int8 B2048": (("signed", S8), ("sqrt", Q8), 2048),
    "int8, v linear with zero, B128": (("signed", S8), ("v", [k / 255 for k in range(256)]), 128),
    "O2: int4 squared-grid m, sqrt(v) squared-grid no-zero, B128 (chosen)": (("signed", S4), ("sqrt", Q4), 128),
    "int4 NF4 m, sqrt(v) squared-grid no-zero, B128": (("signed", NF4), ("sqrt", Q4), 128),
    "int4 linear m, sqrt(v) linear no-zero, B128": (("signed", [k / 7 for k in range(-7, 8)]),
                                                    ("sqrt", [(k + 1) / 16 for k in range(16)]), 128),
    "int4 squared-grid m, v linear with zero, B128": (("signed", S4), ("v", [k / 15 for k in range(16)]), 128),
    "int4 squared-grid m and sqrt(v), B2048": (("signed", S4), ("sqrt", Q4), 2048),
}


def nearest(x: torch.Tensor, book: list[float], kind: str, block: int) -> torch.Tensor:
    """Round trip through a list code book (nearest value), block-wise absmax scaling."""
    values = torch.tensor(book)
    flat = x.reshape(-1).float()
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, (-n) % block)).view(-1, block)
    domain = blocks.sqrt() if kind == "sqrt" else blocks
    scale = domain.abs().amax(1, keepdim=True)
    norm = domain / torch.where(scale > 0, scale, 1.0)
    idx = torch.bucketize(norm, (values[1:] + values[:-1]) / 2)
    out = (values[idx] * scale).reshape(-1)[:n]
    return (out.square() if kind == "sqrt" else out).reshape(x.shape)


def round_trip(x: torch.Tensor, coding, block) -> tuple[torch.Tensor, int]:
    kind, book = coding
    block = block or x.numel()
    kind = "signed" if kind == "v" else kind
    bits = 4 if len(book.values() if isinstance(book, Grid) else book) <= 16 else 8
    size = -(-x.numel() * bits // 8) + 4 * -(-x.numel() // block)
    if isinstance(book, Grid):
        codes, scales = quantize(x, book, kind, block)
        return dequantize(codes, scales, book, kind, x.numel(), block).reshape(x.shape), size
    return nearest(x, book, kind, block), size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    states, defaults = trained_states(args.steps)
    eps, (b1, b2) = defaults["eps"], defaults["betas"]
    n = sum(m.numel() for m, _, _ in states)
    print(f"{len(states)} parameters, {n:,} values, AdamW after {args.steps} steps")
    print(f"{'candidate':<70} {'B/value':>8} {'update rel. L2 err':>18} {'max |u|/max|u_ref|':>18} "
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
        print(f"{name:<70} {size / (2 * n):>8.3f} {(err2 / ref2) ** 0.5:>18.4f} {worst:>18.1f} {zeroed:>16,}")


if __name__ == "__main__":
    main()
