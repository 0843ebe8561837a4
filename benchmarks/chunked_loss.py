"""The chunked output layer + cross-entropy (``tst_megatron/superposition/chunked_loss.py``)
against the unchunked path (the output layer's matmul, then the vocab-parallel CE whose memory
equals megatron-core's, ``tests/unit/test_loss_memory.py``), side by side in one process on
the same hidden states and weight: peak live tensor bytes of forward + backward (bf16 and
fp32) and median time, for each chunk count; and the bytes per token scaled to the H200 shape
of ``docs/gpu_check.md`` (131,072 vocabulary, 8,192 tokens a micro-batch).

    .venv/bin/python benchmarks/chunked_loss.py --out docs/results/chunked_loss.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import measure  # noqa: E402

from tst_megatron.superposition import vocab_parallel_multi_target_cross_entropy  # noqa: E402
from tst_megatron.superposition.chunked_loss import chunked_output_cross_entropy  # noqa: E402

#: name -> (positions T*b as (T, b), hidden h, vocabulary V)
SHAPES = {
    "head-heavy (V 32,768, h 256)": ((512, 2), 256, 32768),
    "quickstart (V 4,096, h 128)": ((128, 4), 128, 4096),
}
CHUNKS = (1, 2, 4, 8, 16)
#: Chunk counts also measured with megatron-core's gradient-accumulation fusion (main_grad).
MAIN_GRAD_CHUNKS = (8, 16)
#: The H200 row of docs/gpu_check.md: 131,072 entries, seq 4096 x micro-batch 2 tokens,
#: hidden 2048 (the real-size dense row).
H200_TOKENS, H200_VOCAB, H200_HIDDEN = 8192, 131072, 2048


def _inputs(shape, dtype, k):
    (T, b), h, V = shape
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, b, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, h, generator=g) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T, b, k), generator=g)
    upstream = torch.rand(T, b, k, generator=g)
    return hidden, weight, targets, upstream


def _step(loss_fn, hidden, weight, targets, upstream):
    def run():
        hidden.grad = weight.grad = None
        loss_fn(hidden, weight, targets).backward(upstream)

    return run


def _unchunked(hidden, weight, targets):
    return vocab_parallel_multi_target_cross_entropy(hidden @ weight.t(), targets, inplace=True)


def rows(shape, dtype, k, repeats):
    """``[(label, seconds, peak bytes)]``: the unchunked path, then each chunk count."""
    inputs = _inputs(shape, dtype, k)
    found = [("unchunked", *measure(_step(_unchunked, *inputs), repeats))]
    for n in CHUNKS:

        def chunked(h, w, t, n=n):
            return chunked_output_cross_entropy(h, w, t, chunks=n)

        found.append((f"{n} chunk(s)", *measure(_step(chunked, *inputs), repeats)))
    # megatron-core DDP: its fp32 main_grad exists before the step (not counted), and its hook
    # drops the placeholder gradient as soon as autograd has set it
    weight = inputs[1]
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    weight.grad_added_to_main_grad = False
    hook = weight.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    for n in MAIN_GRAD_CHUNKS:

        def fused(h, w, t, n=n):
            w.grad_added_to_main_grad = False
            return chunked_output_cross_entropy(h, w, t, chunks=n, into_main_grad=True)

        step = _step(fused, *inputs)
        measured = measure(step, repeats, ignore=[weight.main_grad])
        found.append((f"{n} chunk(s), into main_grad", *measured))
    hook.remove()
    del weight.main_grad
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the Markdown report here")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--k", type=int, default=4, help="target slots (phase 1's S; 1: phase 2)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    lines = [
        "# The chunked loss head: memory and time against the unchunked path",
        "",
        f"Command: `.venv/bin/python benchmarks/chunked_loss.py --k {args.k} --repeats "
        f"{args.repeats}` on {platform.machine()}, {os.cpu_count()} CPU cores, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads. Peak: live tensor bytes of "
        "forward + backward of the output layer and the loss (inputs made before excluded); "
        f"time: median of {args.repeats} runs, each chunked row measured right after the "
        f"unchunked one in the same process. k = {args.k} target slots (phase 1 at S = "
        f"{args.k}).",
        "",
    ]
    per_token = {}
    for name, shape in SHAPES.items():
        (T, b), h, V = shape
        lines += [f"## {name}, {T} x {b} positions", ""]
        lines += [
            "| path | bf16 peak MiB | vs unchunked | fp32 peak MiB | fp32 ms | vs unchunked |"
        ]
        lines += ["|---|---|---|---|---|---|"]
        bf16 = rows(shape, torch.bfloat16, args.k, 1)
        fp32 = rows(shape, torch.float32, args.k, args.repeats)
        base_mem, base_t = bf16[0][2], fp32[0][1]
        for (label, _, mem16), (_, t32, mem32) in zip(bf16, fp32):
            lines.append(
                f"| {label} | {mem16 / 2**20:,.2f} | {mem16 / base_mem:.3f} | "
                f"{mem32 / 2**20:,.2f} | {t32 * 1e3:,.1f} | {t32 / base_t:.3f} |"
            )
            per_token.setdefault(label, []).append(mem16 / (T * b * V))
        lines.append("")
    lines += [
        f"## At the H200 shape ({H200_TOKENS:,} tokens x {H200_VOCAB:,} vocabulary, hidden "
        f"{H200_HIDDEN:,}, bf16)",
        "",
        "An estimate from the CPU measurement, not a GPU run. Each bf16 peak of the head-heavy "
        "shape is split into the weight gradient (V x h x 2 bytes; the chunked path holds it "
        "for the whole backward, the unchunked path only at its end) and the rest, per token "
        "per vocabulary entry; both are scaled to the H200 shape.",
        "",
        "| path | rest: bytes per token x entry | GiB at the H200 shape | vs unchunked |",
        "|---|---|---|---|",
    ]
    (T, b), h, V = SHAPES[next(iter(SHAPES))]
    weight_grad, h200_grad = V * h * 2, H200_VOCAB * H200_HIDDEN * 2
    base = None
    for label, values in per_token.items():
        holds_grad = label != "unchunked" and "main_grad" not in label
        rest = values[0] - (weight_grad / (T * b * V) if holds_grad else 0)
        gib = rest * H200_TOKENS * H200_VOCAB + (h200_grad if holds_grad else 0)
        gib /= 2**30
        base = base or gib
        lines.append(f"| {label} | {rest:.3f} | {gib:,.2f} | {gib / base:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
