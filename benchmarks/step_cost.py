"""Phase-1 (TST) training step vs baseline (next-token) step at equal T and micro-batch.

For each bag size (S = 4 and 8 by default) one process builds the trainer's model,
optimizer and data once, then runs phase-1 and phase-2 (baseline) steps interleaved
(A B B A ...: both arms see the same machine state, drift cancels) and reports side by
side the medians of:

- step time ratio, phase 1 / baseline (goal <= 1.03);
- peak tensor memory ratio (goal <= 1.03), one step of each arm (see measure.py);
- tokens/s ratio over ``S x`` the baseline's (goal >= 0.97): phase 1 reads S times the text.

Step time is the trainer's own (forward, backward, optimizer step), without reading the
samples, which Megatron users do in data-loader workers; that time is reported on its own
row. On a shared machine the timings are noisy: raise ``--rounds``.

    .venv/bin/python benchmarks/step_cost.py --output docs/results/step_cost.md   # ~5 min
    .venv/bin/python benchmarks/step_cost.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import CollectiveBytes, PeakTensorMemory, write, write_index  # noqa: E402

SMOKE_SIZE = "--num-layers 2 --hidden-size 64 --seq-length 32 --num-experts 4 "
SMOKE_SIZE += "--moe-ffn-hidden-size 64 --vocab-size 512"
FULL_SIZE = "--num-layers 4 --hidden-size 256 --seq-length 256 --num-experts 8 "
FULL_SIZE += "--moe-ffn-hidden-size 256 --vocab-size 8192"
MICRO_BATCH = 4


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


def measure_bag_size(bag: int, *, smoke: bool, device: str, rounds: int, threads: int) -> dict:
    """Run the interleaved arms for one ``S`` in this process; return medians and peaks."""
    torch.set_num_threads(threads)
    for key, value in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29581", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    ).items():
        os.environ.setdefault(key, value)
    from tst_megatron.runtime import destroy
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    size = (SMOKE_SIZE if smoke else FULL_SIZE).split()
    per_arm = rounds + 2  # warm-up + memory step + timed rounds
    train_iters = 2 * per_arm
    cfg = parse_args(
        size
        + "--mock-data --num-attention-heads 4 --swiglu --disable-bias-linear".split()
        + "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0".split()
        + ["--device", device, "--micro-batch-size", str(MICRO_BATCH)]
        + ["--train-iters", str(train_iters), "--tst-bag-size", str(bag)]
        + ["--tst-phase1-iters", str(per_arm), "--log-interval", str(10**6)]
        # what Megatron-LM's defaults would otherwise change
        + "--lr 3e-4 --tokenizer-type NullTokenizer --position-embedding-type rope".split()
        + "--normalization RMSNorm --adam-beta2 0.95 --lr-decay-style WSD".split()
        + "--lr-wsd-decay-style linear --moe-token-dispatcher-type alltoall --num-workers 0".split()
    )
    run = trainer.setup(cfg)
    arms = {arm: {"time": [], "cpu": [], "load": []} for arm in (1, 2)}

    def step(arm: int, i: int, *, memory: bool = False):
        iteration = i if arm == 1 else per_arm + i
        phase = run.schedule.phase_at(iteration)
        assert phase.index == arm, (phase, arm)
        mem = PeakTensorMemory() if memory else None
        start, cpu_start = time.perf_counter(), time.process_time()
        if mem is not None:
            with mem:
                metrics = trainer.train_step(run, phase, iteration)
        else:
            metrics = trainer.train_step(run, phase, iteration)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        arms[arm]["tokens"] = metrics["tokens"]
        if mem is not None:
            arms[arm]["peak"] = mem.peak
        else:
            arms[arm]["time"].append(metrics["step_time"])
            arms[arm]["cpu"].append(cpu)
            arms[arm]["load"].append(elapsed - metrics["step_time"])

    step(1, 0), step(2, 0)  # warm-up (timed, then discarded)
    step(1, 1, memory=True), step(2, 1, memory=True)
    for arm in (1, 2):
        for values in ("time", "cpu", "load"):
            arms[arm][values].clear()
    for r in range(rounds):  # A B, B A, A B, ...
        for arm in (1, 2) if r % 2 == 0 else (2, 1):
            step(arm, 2 + r)
    destroy()
    return {
        str(arm): {
            "time": statistics.median(a["time"]),
            "time_min": min(a["time"]),
            "cpu": statistics.median(a["cpu"]),
            "load": statistics.median(a["load"]),
            "peak": a["peak"],
            "tokens": a["tokens"],
            "n": len(a["time"]),
        }
        for arm, a in arms.items()
    }


def _measure_in_child(bag: int, args) -> dict:
    """One fresh process per ``S`` (megatron-core's parallel state is global)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(bag)]
    cmd += ["--device", args.device, "--rounds", str(args.rounds), "--threads", str(args.threads)]
    cmd += ["--smoke"] if args.smoke else []
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"measuring S={bag} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def report(results: dict, args) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    size = SMOKE_SIZE if args.smoke else FULL_SIZE
    rounds = next(iter(results.values()))["1"]["n"]
    lines = [
        "# TST step cost: phase-1 step vs baseline step",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{device}, 1 process, {args.threads} thread(s). Model: {size}; micro-batch "
        f"{MICRO_BATCH}. Arms interleaved (A B B A ...), median of {rounds} steps per arm; "
        "peak memory from one step each. Step time is wall-clock (the trainer's, without "
        "reading samples); CPU time is the process's, reading samples included. When other "
        "jobs share the machine, the ratio of the fastest steps and the CPU time ratio are "
        "steadier than the medians.",
        "",
        "| S | step time, phase 1 (ms) | baseline (ms) | time ratio (<= 1.03) | "
        "peak memory, phase 1 (MiB) | baseline (MiB) | memory ratio (<= 1.03) | "
        "tokens/s, phase 1 | baseline | tokens/s / (S x baseline) (>= 0.97) | "
        "time ratio of the fastest steps | CPU time ratio | "
        "reading samples, phase 1 / baseline (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for bag, arms in results.items():
        p1, p2 = arms["1"], arms["2"]
        tps1, tps2 = p1["tokens"] / p1["time"], p2["tokens"] / p2["time"]
        lines.append(
            f"| {bag} | {1000 * p1['time']:.1f} | {1000 * p2['time']:.1f} | "
            f"{p1['time'] / p2['time']:.3f} | {p1['peak'] / 2**20:.1f} | "
            f"{p2['peak'] / 2**20:.1f} | {p1['peak'] / p2['peak']:.3f} | {tps1:.0f} | "
            f"{tps2:.0f} | {tps1 / (int(bag) * tps2):.3f} | "
            f"{p1['time_min'] / p2['time_min']:.3f} | {p1['cpu'] / p2['cpu']:.3f} | "
            f"{1000 * p1['load']:.1f} / {1000 * p2['load']:.1f} |"
        )
    lines += [
        "",
        "## Embedding traffic across TP (TP = 2, b = 4, T = 128, h = 256, fwd + bwd)",
        "",
        "| S | layout | bytes through TP collectives, phase 1 | baseline | ratio | goal |",
        "|---|---|---|---|---|---|",
    ]
    for bag in results:
        for sp in (False, True):
            traffic = embedding_tp_traffic(int(bag), sp)
            lines.append(
                f"| {bag} | TP=2{' + SP' if sp else ''} | {traffic['phase1']} | "
                f"{traffic['baseline']} | {traffic['phase1'] / traffic['baseline']:.3f} | "
                "1.000 (T positions, not S*T) |"
            )
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description="TST phase-1 step cost vs baseline step")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds, S = 4 only")
    p.add_argument("--bag-sizes", default="4,8", help="comma-separated S values")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda measures the step on the GPU (the TP-traffic part stays on gloo)",
    )
    p.add_argument("--rounds", type=int, default=None, help="timed steps per arm (default 12)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: least disturbed by other load on a shared machine)",
    )
    p.add_argument(
        "--output",
        default=None,
        help="also write the Markdown report here "
        "(e.g. docs/results/step_cost.md; docs/results.md is then re-indexed)",
    )
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rounds = args.rounds or (2 if args.smoke else 12)
    if args.child is not None:
        result = measure_bag_size(
            args.child,
            smoke=args.smoke,
            device=args.device,
            rounds=args.rounds,
            threads=args.threads,
        )
        print(json.dumps(result))
        return
    bags = [4] if args.smoke else [int(s) for s in args.bag_sizes.split(",")]
    results = {str(bag): _measure_in_child(bag, args) for bag in bags}
    text = report(results, args)
    print(text)
    if args.output:
        write(args.output, text)
        write_index(os.path.dirname(os.path.abspath(args.output)))


if __name__ == "__main__":
    main()
