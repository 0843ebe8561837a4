"""Phase-1 (TST) training step vs baseline (next-token) step at equal T and micro-batch.

One process builds the trainer's model, optimizer and data once, then alternates phase-1
and phase-2 steps (so both see the same machine state) and reports, side by side:
step time ratio (goal <= 1.05), peak tensor memory ratio (goal <= 1.05) and tokens/s ratio
(goal >= 0.95 * S). Step time is the trainer's own (forward, backward, optimizer step),
without reading the samples, which Megatron users do in data-loader workers; the time to
read the samples in the main process is reported on its own row. Peak memory counts
tensors allocated during the step (see measure.py).

    .venv/bin/python benchmarks/step_cost.py --output docs/results/step_cost.md   # ~2 min
    .venv/bin/python benchmarks/step_cost.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import CollectiveBytes, PeakTensorMemory, write, write_index  # noqa: E402


def _traffic_child(rank, world, port, sp, bag, out):
    """TP=2: bytes the embedding sends through TP collectives, bag_embedding vs standard."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tst_megatron.runtime import (
        ParallelConfig,
        destroy,
        init_distributed,
        initialize_model_parallel,
        set_seed,
    )
    from tst_megatron.superposition import bag_embedding

    init_distributed(device="cpu")
    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=world))
    set_seed(1)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=256,
        num_attention_heads=2,
        tensor_model_parallel_size=world,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
    )
    emb = LanguageModelEmbedding(
        config, vocab_size=4096, max_sequence_length=128, position_embedding_type="rope"
    )
    b, T = 4, 128
    ids = torch.randint(0, 4096, (b, T, bag))
    result = {}
    for name, fn in (
        ("baseline", lambda: emb(ids[..., 0], None)),
        ("phase1", lambda: bag_embedding(emb, ids)),
    ):
        with CollectiveBytes() as counter:
            out_t = fn()
            out_t.backward(torch.ones_like(out_t))
        result[name] = sum(counter.bytes.values())
    if rank == 0:
        torch.save(result, out)
    destroy()


def embedding_tp_traffic(bag: int, sp: bool) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    from tst_megatron.runtime.distributed import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "traffic.pt")
        mp.start_processes(
            _traffic_child, args=(2, port, sp, bag, out), nprocs=2, start_method="spawn"
        )
        return torch.load(out)


def main():
    p = argparse.ArgumentParser(description="TST phase-1 step cost vs baseline step")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--bag-size", type=int, default=4)
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda measures the step on the GPU (the TP-traffic part stays on gloo)",
    )
    p.add_argument("--steps", type=int, default=None, help="measured steps per phase")
    p.add_argument(
        "--output",
        default=None,
        help="also write the Markdown report here "
        "(e.g. docs/results/step_cost.md; docs/results.md is then re-indexed)",
    )
    args = p.parse_args()
    for key, value in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29581", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    ).items():
        os.environ.setdefault(key, value)
    from tst_megatron.runtime import destroy
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    size = (
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--seq-length",
            "32",
            "--num-experts",
            "4",
            "--moe-ffn-hidden-size",
            "64",
            "--vocab-size",
            "512",
        ]
        if args.smoke
        else [
            "--num-layers",
            "4",
            "--hidden-size",
            "256",
            "--seq-length",
            "256",
            "--num-experts",
            "8",
            "--moe-ffn-hidden-size",
            "256",
            "--vocab-size",
            "8192",
        ]
    )
    steps = args.steps or (2 if args.smoke else 8)
    train_iters = 2 * (steps + 2)
    cfg = parse_args(
        size
        + [
            "--mock-data",
            "--device",
            args.device,
            "--num-attention-heads",
            "4",
            "--swiglu",
            "--disable-bias-linear",
            "--untie-embeddings-and-output-weights",
            "--micro-batch-size",
            "4",
            "--train-iters",
            str(train_iters),
            "--tst-bag-size",
            str(args.bag_size),
            "--tst-phase1-iters",
            str(steps + 2),
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
        ]
    )
    run = trainer.setup(cfg)
    n1 = steps + 2
    results = {1: {"time": [], "peak": 0, "tokens": 0}, 2: {"time": [], "peak": 0, "tokens": 0}}
    # Warm-up one step of each, then alternate: phase-1 step i, phase-2 step n1 + i.
    order = [(0, 1), (n1, 2)] + [
        (it, ph) for i in range(1, steps + 1) for it, ph in ((i, 1), (n1 + i, 2))
    ]
    for k, (iteration, expected) in enumerate(order):
        phase = run.schedule.phase_at(iteration)
        assert phase.index == expected
        mem = PeakTensorMemory() if k >= 2 and iteration in (1, n1 + 1) else None
        start = time.perf_counter()
        if mem is not None:
            with mem:
                metrics = trainer.train_step(run, phase, iteration)
        else:
            metrics = trainer.train_step(run, phase, iteration)
        elapsed = time.perf_counter() - start
        if k >= 2:
            if mem is None:
                results[expected]["time"].append(metrics["step_time"])
                results[expected].setdefault("load", []).append(elapsed - metrics["step_time"])
            else:
                results[expected]["peak"] = mem.peak
            results[expected]["tokens"] = metrics["tokens"]
    t1, t2 = (statistics.median(results[i]["time"]) for i in (1, 2))
    tps1, tps2 = results[1]["tokens"] / t1, results[2]["tokens"] / t2
    l1, l2 = (statistics.median(results[i]["load"]) for i in (1, 2))
    s = args.bag_size
    lines = [
        "# TST step cost: phase-1 step vs baseline step",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}, "
        f"1 process. Model: {' '.join(size)}; micro-batch 4; S = {s}; median of {len(results[1]['time'])} steps.",
        "",
        "| quantity | phase 1 (S=%d) | baseline | ratio | goal |" % s,
        "|---|---|---|---|---|",
        f"| step time (ms) | {1000 * t1:.1f} | {1000 * t2:.1f} | {t1 / t2:.3f} | <= 1.05 |",
        f"| peak tensor memory (MiB) | {results[1]['peak'] / 2**20:.1f} | {results[2]['peak'] / 2**20:.1f} | "
        f"{results[1]['peak'] / results[2]['peak']:.3f} | <= 1.05 |",
        f"| tokens/s | {tps1:.0f} | {tps2:.0f} | {tps1 / tps2:.2f} | >= {0.95 * s:.2f} |",
        f"| reading samples, main process (ms) | {1000 * l1:.1f} | {1000 * l2:.1f} | {l1 / l2:.2f} | - |",
    ]
    lines += [
        "",
        "## Embedding traffic across TP (TP = 2, b = 4, T = 128, h = 256, fwd + bwd)",
        "",
        "| layout | bytes through TP collectives, phase 1 | baseline | ratio | goal |",
        "|---|---|---|---|---|",
    ]
    for sp in (False, True):
        traffic = embedding_tp_traffic(s, sp)
        lines.append(
            f"| TP=2{' + SP' if sp else ''} | {traffic['phase1']} | {traffic['baseline']} | "
            f"{traffic['phase1'] / traffic['baseline']:.3f} | 1.000 (T positions, not S*T) |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output:
        write(args.output, report)
        write_index(os.path.dirname(os.path.abspath(args.output)))
    destroy()


if __name__ == "__main__":
    main()
