"""What the TST core costs, as ratios measured side by side in one run (one process, TP=1).

1. Multi-target CE with k targets vs one megatron-core ``vocab_parallel_cross_entropy`` call
   at the same logits size, and vs k separate megatron-core calls (forward + backward).
2. ``bag_embedding`` of ``[b, T, S]`` vs megatron-core's ``LanguageModelEmbedding`` of
   ``[b, T]``, and vs embedding all ``S*T`` tokens then averaging (forward + backward).

Time: median of ``--repeats`` runs. Peak memory: the most bytes held by tensors allocated
inside the measured region (inputs excluded), tracked with a ``TorchDispatchMode``, so it
works on CPU and GPU alike.

    .venv/bin/python benchmarks/core_cost.py --output docs/results/core_cost.md   # ~3 min
    .venv/bin/python benchmarks/core_cost.py --smoke    # tiny sizes, seconds (run by the tests)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import measure, write, write_index  # noqa: E402


def init_single_process():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from tst_megatron.runtime import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed(device="cpu")
    initialize_model_parallel(ParallelConfig())


def bench_cross_entropy(tokens, vocab, ks, repeats):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from tst_megatron.superposition import vocab_parallel_multi_target_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, 1, vocab, generator=g)  # Megatron's [s, b, V/tp]
    rows = []

    def megatron_ce(targets):
        x = logits.clone().requires_grad_(True)  # megatron-core writes into its input
        loss = vocab_parallel_cross_entropy(x, targets)
        loss.backward(torch.ones_like(loss))

    one_target = torch.randint(0, vocab, (tokens, 1), generator=g)
    base_time, base_mem = measure(lambda: megatron_ce(one_target), repeats)
    for k in ks:
        targets = torch.randint(0, vocab, (tokens, 1, k), generator=g)

        def multi():
            x = logits.clone().requires_grad_(True)
            loss = vocab_parallel_multi_target_cross_entropy(x, targets)
            loss.backward(torch.ones_like(loss))

        def loop():
            for j in range(k):
                megatron_ce(targets[..., j])

        t_multi, m_multi = measure(multi, repeats)
        t_loop, _ = measure(loop, max(1, repeats // 2))
        rows.append((k, t_multi / base_time, m_multi / base_mem, t_loop / t_multi))
    return base_time, rows


def bench_embedding(batch, latent, bags, hidden, vocab, repeats):
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tst_megatron.superposition import bag_embedding

    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=1,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
    )
    emb = LanguageModelEmbedding(
        config, vocab_size=vocab, max_sequence_length=latent, position_embedding_type="rope"
    )
    g = torch.Generator().manual_seed(1)
    rows = []
    for size in bags:
        ids = torch.randint(0, vocab, (batch, latent, size), generator=g)
        upstream = torch.randn(latent, batch, hidden, generator=g)

        def standard():
            emb.zero_grad(set_to_none=True)
            emb(ids[..., 0], None).backward(upstream)

        def bagged():
            emb.zero_grad(set_to_none=True)
            bag_embedding(emb, ids).backward(upstream)

        def all_then_mean():
            emb.zero_grad(set_to_none=True)
            full = emb(ids.reshape(batch, latent * size), None)  # [S*T, b, h]
            full.view(latent, size, batch, hidden).mean(dim=1).backward(upstream)

        t_std, m_std = measure(standard, repeats)
        t_bag, m_bag = measure(bagged, repeats)
        t_all, m_all = measure(all_then_mean, repeats)
        rows.append((size, t_bag / t_std, m_bag / m_std, t_all / t_bag, m_all / m_bag))
    return rows


def main():
    p = argparse.ArgumentParser(description="TST core cost ratios")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument(
        "--output",
        default=None,
        help="also write the Markdown report here "
        "(e.g. docs/results/core_cost.md; docs/results.md is then re-indexed)",
    )
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    init_single_process()
    if args.smoke:
        ce_size, emb_size, repeats = (64, 512), (2, 16, 64, 1000), args.repeats or 2
    else:
        ce_size, emb_size, repeats = (2048, 32768), (4, 512, 512, 32000), args.repeats or 5
    base_time, ce_rows = bench_cross_entropy(*ce_size, ks=(1, 2, 4, 8, 16), repeats=repeats)
    emb_rows = bench_embedding(
        emb_size[0], emb_size[1], (2, 4, 8), emb_size[2], emb_size[3], repeats
    )

    lines = [
        "# TST core cost",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} threads={torch.get_num_threads()}, device cpu, TP=1.",
        "",
        f"## Multi-target CE, logits [{ce_size[0]}, {ce_size[1]}] fp32, forward + backward",
        f"Baseline: one megatron-core `vocab_parallel_cross_entropy` call, {1000 * base_time:.1f} ms.",
        "",
        "| k | time vs 1 megatron CE | peak memory vs 1 megatron CE | k megatron CE calls / multi-target |",
        "|---|---|---|---|",
    ]
    lines += [f"| {k} | {t:.3f} | {m:.3f} | {loop:.2f} |" for k, t, m, loop in ce_rows]
    lines += [
        "",
        f"## Bag embedding, b={emb_size[0]}, T={emb_size[1]}, h={emb_size[2]}, V={emb_size[3]}, "
        "forward + backward",
        "",
        "| S | time vs standard [b,T] | peak memory vs standard | embed-all-then-mean time / bag | "
        "embed-all-then-mean memory / bag |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {s} | {t:.3f} | {m:.3f} | {ta:.2f} | {ma:.2f} |" for s, t, m, ta, ma in emb_rows]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output:
        write(args.output, report)
        write_index(os.path.dirname(os.path.abspath(args.output)))
    from tst_megatron.runtime import destroy

    destroy()


if __name__ == "__main__":
    main()
