"""Phase-1 (TST) iteration vs phase-2 and baseline (next-token) iterations at equal T and
micro-batch, through the launcher (Megatron-LM's ``pretrain()`` with TST).

For each bag size (S = 4 and 8 by default) one child process runs
:func:`tst_megatron.training.cli.main` on mock data: a TST run (``--tst-bag-size S``,
phase 1 for the first half of the iterations, phase 2 after) and a baseline run
(``--tst-bag-size 1``), in the order TST, baseline (and with ``--repeats 2`` baseline, TST
again: drift cancels). It reports side by side, per arm, the medians of:

- the iteration time: Megatron-LM's whole training iteration (reading the micro-batches,
  forward, backward, optimizer step), host clock from the first training forward of an
  iteration to the first of the next (CUDA synchronised); phase 1 / baseline (goal <= 1.03),
  phase 2 / baseline (the same work: ~1);
- the peak memory of one iteration (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the live
  tensor bytes, ``measure.PeakTensorMemory``), phase 1 / baseline (goal <= 1.03);
- raw tokens per second (``S*T`` per phase-1 sample), phase 1 over ``S x`` the baseline's
  (goal >= 0.97): phase 1 reads S times the text.

The first iteration of each arm (warm-up) and the one whose memory is measured are not timed.
The timing hooks into the launcher's forward step (:class:`TimedForwardStep`, a subclass of
``TSTForwardStep``), put in place for the benchmark child only. On a shared
machine the timings are noisy: raise ``--rounds``.

    .venv/bin/python benchmarks/step_cost.py --output docs/results/step_cost.md   # ~5 min
    .venv/bin/python benchmarks/step_cost.py --smoke    # under a minute
    .venv/bin/python benchmarks/step_cost.py --device cuda   # the GPU check runs this
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from gpu_data import CARRIED_TOKENIZER  # noqa: E402
from measure import CollectiveBytes, PeakTensorMemory, write, write_index  # noqa: E402

from tst_megatron.training.argv import CPU_FLAGS  # noqa: E402

SMOKE_SIZE = "--num-layers 2 --hidden-size 64 --seq-length 32 --num-experts 4 "
SMOKE_SIZE += "--moe-ffn-hidden-size 64 --vocab-size 512 --num-attention-heads 4"
FULL_SIZE = "--num-layers 4 --hidden-size 256 --seq-length 256 --num-experts 8 "
FULL_SIZE += "--moe-ffn-hidden-size 256 --vocab-size 8192 --num-attention-heads 4"
#: The first real-size GPU run's shapes (an H200, issue 52): seq 4096, a vocabulary of
#: 131,072 (a smaller tokenizer's is padded to it), 8 layers, hidden 2048, 16 heads in 4
#: query groups; dense (ffn 5632) or MoE (16 experts, top 2, moe-ffn 2048, alltoall).
REAL_DENSE = "--num-layers 8 --hidden-size 2048 --num-attention-heads 16 "
REAL_DENSE += "--group-query-attention --num-query-groups 4 --ffn-hidden-size 5632 "
REAL_DENSE += "--seq-length 4096 --vocab-size 131072"
REAL_MOE = REAL_DENSE + " --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 2048"
#: ``--size`` -> (model flags, micro-batch, global batch)
SIZES = {
    "smoke": (SMOKE_SIZE, 4, 4),
    "full": (FULL_SIZE, 4, 4),
    "real-dense": (REAL_DENSE, 2, 8),
    "real-moe": (REAL_MOE, 2, 8),
}
MICRO_BATCH = 4

#: Flags of a CUDA run without Transformer Engine or Apex (the lent GPU machine has neither):
#: megatron-core's local spec, and the fusions that need their kernels (or a torch.compile
#: warm-up) off, as the launcher's CPU_FLAGS do on a CPU.
LOCAL_CUDA_FLAGS = [
    f for f in CPU_FLAGS if f not in ("--distributed-backend", "gloo", "--use-cpu-initialization")
]


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
        return torch.load(out, weights_only=True)


def run_flags(
    bag: int, *, size: str, device: str, per_arm: int, data: str | None = None
) -> list[str]:
    """Launcher flags of one run: ``bag`` = 1 is the baseline (``per_arm`` iterations), else a
    TST run of ``2 * per_arm`` iterations switching after ``per_arm``. ``size``: a key of
    :data:`SIZES`. ``data``: a Megatron dataset prefix tokenized with
    :data:`CARRIED_TOKENIZER` (real text; its vocabulary padded to the size's), else mock
    data."""
    model, micro, global_batch = SIZES[size]
    model = model.split()
    iters = per_arm if bag == 1 else 2 * per_arm
    if data is not None:  # the size's vocabulary by padding the tokenizer's
        at = model.index("--vocab-size")
        vocab = model[at + 1]
        model = model[:at] + model[at + 2 :]
        text = ["--data-path", data, "--split", "100,0,0"]
        text += ["--tokenizer-type", "SentencePieceTokenizer"]
        text += ["--tokenizer-model", CARRIED_TOKENIZER, "--make-vocab-size-divisible-by", vocab]
    else:
        text = ["--mock-data", "--tokenizer-type", "NullTokenizer"]
    flags = model + text + [
        "--max-position-embeddings", model[model.index("--seq-length") + 1],
        "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--moe-token-dispatcher-type", "alltoall",
        "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
        "--train-iters", str(iters), "--lr", "3e-4", "--lr-decay-style", "constant",
        "--adam-beta2", "0.95", "--eval-iters", "0", "--eval-interval", str(10**6),
        "--log-interval", str(10**6),
        "--num-workers", "0", "--seed", "1234", "--device", device,
        "--tst-bag-size", str(bag),
    ]  # fmt: skip
    if bag > 1:
        flags += ["--tst-phase1-iters", str(per_arm)]
    if device == "cuda":
        flags += ["--bf16", *LOCAL_CUDA_FLAGS]
        flags += ["--use-distributed-optimizer"] if size.startswith("real") else []
    return flags


#: torch's caching-allocator counters an iteration's :func:`_allocator_counters` difference
#: reports: a step that keeps calling cudaMalloc/cudaFree (tensors whose sizes vary, as the
#: MoE's per-expert batches do, without enough cached slack) stalls on the device.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def _allocator_counters() -> list:
    stats = torch.cuda.memory_stats()
    return [stats.get(key, 0) for key in ALLOCATOR_COUNTERS]


def _timed_forward_step_class():
    """:class:`TimedForwardStep` (defined on first use: the launcher imports Megatron-LM)."""
    from tst_megatron.loop.forward import TSTForwardStep

    class TimedForwardStep(TSTForwardStep):
        """The launcher's forward step, timing each training iteration: from its first
        training forward to the first training forward of the next iteration (the host
        clock, after a CUDA synchronisation). ``memory_at`` holds 0-based iterations whose
        peak memory is measured instead (CUDA's peak allocation, or the live tensor bytes of
        :class:`PeakTensorMemory` on a CPU). Results: ``times`` / ``peaks``,
        ``{iteration: seconds or bytes}``; ``flops``: Megatron-LM's floating-point operations
        of one iteration (``num_floating_point_operations``, as its ``--log-throughput``);
        ``allocator`` (CUDA): ``{iteration: [cudaMalloc calls, cudaFree calls, allocation
        retries]}`` of torch's caching allocator in that iteration (:data:`ALLOCATOR_COUNTERS`)."""

        memory_at: set = set()

        def __init__(self, plan):
            super().__init__(plan)
            self.times, self.peaks, self.flops, self.allocator = {}, {}, None, {}
            self._counted = None
            self._open, self._start, self._mode = None, 0.0, None

        def __call__(self, data_iterator, model, **kwargs):
            from megatron.training import get_args
            from megatron.training.training import num_floating_point_operations

            args = get_args()
            if self.flops is None:  # Megatron-LM's count for its TFLOP/s log (equal per phase)
                self.flops = num_floating_point_operations(args, args.global_batch_size)
            iteration = args.curr_iteration
            if model.training and iteration != self._open:
                self._next(iteration)
            return super().__call__(data_iterator, model, **kwargs)

        def _next(self, iteration: int) -> None:
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            counters = _allocator_counters() if cuda else None
            if self._open is not None and counters is not None and self._counted is not None:
                self.allocator[self._open] = [a - b for a, b in zip(counters, self._counted)]
            self._counted = counters
            if self._open is not None:
                if self._open in self.memory_at:
                    if self._mode is not None:
                        self._mode.__exit__(None, None, None)
                        self.peaks[self._open], self._mode = self._mode.peak, None
                    else:
                        self.peaks[self._open] = torch.cuda.max_memory_allocated()
                else:
                    self.times[self._open] = now - self._start
            self._open = iteration
            if iteration in self.memory_at:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                else:
                    self._mode = PeakTensorMemory()
                    self._mode.__enter__()
            self._start = time.perf_counter()

    return TimedForwardStep


def run_launcher(argv: list[str], memory_at: set) -> tuple[dict, dict, float, dict]:
    """Run the launcher's ``main(argv)`` in this process with :class:`TimedForwardStep`;
    return its ``(times, peaks, flops per iteration, allocator counters)``. Megatron-LM's
    global state is torn down after."""
    from unittest import mock

    from megatron.training.training import destroy_global_state

    from tst_megatron.training import cli

    timed = _timed_forward_step_class()
    timed.memory_at = set(memory_at)
    steps = []

    def make(plan):
        steps.append(timed(plan))
        return steps[-1]

    with mock.patch.object(cli, "TSTForwardStep", make):  # the forward step cli.main builds
        cli.main(argv)
    destroy_global_state()
    step = steps[0]
    return step.times, step.peaks, step.flops, step.allocator


def measure_bag_size(
    bag: int,
    *,
    size: str,
    device: str,
    rounds: int,
    threads: int,
    repeats: int,
    data: str | None = None,
) -> dict:
    """Run the TST and baseline runs for one ``S`` in this process; return per arm (``"1"``:
    phase 1, ``"2"``: phase 2, ``"base"``: baseline) the median and fastest iteration time
    (s), the peak memory (bytes), the raw tokens per iteration, Megatron-LM's floating-point
    operations per iteration and the number of timed iterations. ``repeats`` runs of each,
    in alternating order (TST first, then baseline, baseline, TST, ...)."""
    torch.set_num_threads(threads)
    for key, value in dict(
        MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    ).items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from tst_megatron.runtime.distributed import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    # each arm: a warm-up iteration, one measuring memory, `rounds` timed, one more (closes
    # the last timed iteration; in phase 1 it also holds the log line at the switch)
    per_arm = rounds + 3
    timed = {"1": range(2, 2 + rounds), "2": range(per_arm + 2, per_arm + 2 + rounds)}
    timed["base"] = timed["1"]
    memory = {"1": 1, "2": per_arm + 1, "base": 1}
    arms = {arm: {"time": [], "peak": 0, "allocator": []} for arm in timed}
    order = [run for r in range(repeats) for run in ((bag, 1) if r % 2 == 0 else (1, bag))]
    model, _, global_batch = SIZES[size]
    model = model.split()
    seq = int(model[model.index("--seq-length") + 1])
    flops = None
    for run in order:
        argv = run_flags(run, size=size, device=device, per_arm=per_arm, data=data)
        names = ("1", "2") if run > 1 else ("base",)
        times, peaks, flops, allocator = run_launcher(argv, {memory[n] for n in names})
        for name in names:
            arms[name]["time"] += [times[i] for i in timed[name]]
            arms[name]["allocator"] += [allocator[i] for i in timed[name] if i in allocator]
            arms[name]["peak"] = max(arms[name]["peak"], peaks[memory[name]])
    tokens = {"1": global_batch * bag * seq, "2": global_batch * seq, "base": global_batch * seq}
    return {
        name: {
            "time": statistics.median(a["time"]),
            "time_min": min(a["time"]),
            "peak": a["peak"],
            "tokens": tokens[name],
            "flops": flops,
            "n": len(a["time"]),
            # per timed iteration, the mean of each of ALLOCATOR_COUNTERS (CUDA; else empty)
            "allocator": [sum(c) / len(c) for c in zip(*a["allocator"])],
        }
        for name, a in arms.items()
    }


def matmul_tflops(n: int = 8192, repeats: int = 20) -> float:
    """This GPU's bf16 matmul rate (TFLOP/s) on ``n x n x n``, median of ``repeats`` (CUDA)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * n**3 / statistics.median(times) / 1e12


def _measure_in_child(bag: int, args) -> dict:
    """One fresh process per ``S`` (Megatron-LM's state is global); its result comes back in
    a JSON file (the launcher prints to stdout)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            str(bag),
            "--child-output",
            out,
        ]
        cmd += ["--device", args.device, "--rounds", str(args.rounds)]
        cmd += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
        cmd += ["--size", args.size] + (["--data-path", args.data_path] if args.data_path else [])
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        )
        result = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=ROOT)
        if result.returncode != 0:
            raise RuntimeError(
                f"measuring S={bag} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
            )
        with open(out) as f:
            return json.load(f)


def report(results: dict, args, matmul: float | None = None) -> str:
    """The Markdown report of :func:`measure_bag_size`'s ``results`` (``{S: arms}``);
    ``matmul``: the machine's bf16 matmul TFLOP/s measured in the same run (CUDA), which
    each arm's TFLOP/s is given as a fraction of."""
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    model, micro, global_batch = SIZES[args.size]
    rounds = next(iter(results.values()))["1"]["n"]
    extra = (
        " --bf16 and the flags of LOCAL_CUDA_FLAGS (local spec)" if args.device == "cuda" else ""
    )
    extra += (
        ", the distributed optimizer"
        if args.device == "cuda" and args.size.startswith("real")
        else ""
    )
    data = (
        f"real text ({args.data_path}, tokenized with benchmarks/data/code32k.model, its "
        "vocabulary padded to the size's)"
        if args.data_path
        else "mock data"
    )
    rate = (
        f"; bf16 matmul (8192^3) on this GPU in the same run: {matmul:.0f} TFLOP/s"
        if matmul
        else ""
    )
    lines = [
        "# TST step cost: phase-1 iteration vs phase-2 and baseline iterations",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{device}, 1 process, {args.threads} thread(s){rate}. Model (`--size {args.size}`): "
        f"{model}{extra}; micro-batch {micro}, global batch {global_batch}; {data}. Each S: "
        "a TST run through the launcher "
        "(`examples/pretrain_gpt_tst.py`: Megatron-LM's `pretrain()`), phase 1 then "
        "phase 2, and a baseline run (`--tst-bag-size 1`)"
        + (f", {args.repeats} times in alternating order" if args.repeats > 1 else "")
        + f"; median of {rounds} iterations per arm (Megatron-LM's whole iteration: reading "
        "the batch, forward, backward, optimizer step); peak memory from one iteration each "
        "(" + ("CUDA peak allocation" if args.device == "cuda" else "live tensor bytes") + "); "
        "TFLOP/s: Megatron-LM's count (`num_floating_point_operations`, as its "
        "`--log-throughput`) over the median time. "
        "When other jobs share the machine, the ratio of the fastest iterations is steadier "
        "than the medians.",
        "",
        "| S | iteration, phase 1 (ms) | phase 2 (ms) | baseline (ms) | "
        "time phase 1 / baseline (<= 1.02) | phase 1 / phase 2 | phase 2 / baseline | "
        "peak memory, phase 1 (MiB) | phase 2 (MiB) | baseline (MiB) | "
        "memory phase 1 / baseline (<= 1.00) | phase 1 / phase 2 | "
        "TFLOP/s, phase 1 | phase 2 | baseline | "
        + ("baseline TFLOP/s / matmul rate | " if matmul else "")
        + "raw tokens/s, phase 1 | baseline | "
        "tokens/s / (S x baseline) (>= 0.97) | time ratio of the fastest iterations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|" if matmul else "")
        + "---|---|---|---|",
    ]
    for bag, arms in results.items():
        p1, p2, base = arms["1"], arms["2"], arms["base"]
        tps1, tps_base = p1["tokens"] / p1["time"], base["tokens"] / base["time"]
        tflops = {k: a["flops"] / a["time"] / 1e12 for k, a in arms.items()}
        lines.append(
            f"| {bag} | {1000 * p1['time']:.1f} | {1000 * p2['time']:.1f} | "
            f"{1000 * base['time']:.1f} | {p1['time'] / base['time']:.3f} | "
            f"{p1['time'] / p2['time']:.3f} | "
            f"{p2['time'] / base['time']:.3f} | {p1['peak'] / 2**20:.1f} | "
            f"{p2['peak'] / 2**20:.1f} | {base['peak'] / 2**20:.1f} | "
            f"{p1['peak'] / base['peak']:.3f} | {p1['peak'] / p2['peak']:.3f} | "
            f"{tflops['1']:.3g} | {tflops['2']:.3g} | {tflops['base']:.3g} | "
            + (f"{tflops['base'] / matmul:.3f} | " if matmul else "")
            + f"{tps1:.0f} | {tps_base:.0f} | "
            f"{tps1 / (int(bag) * tps_base):.3f} | {p1['time_min'] / base['time_min']:.3f} |"
        )
    if args.size.startswith("real"):  # the TP-traffic table is the small model's
        return "\n".join(lines) + "\n"
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
    p = argparse.ArgumentParser(description="TST phase-1 iteration cost vs baseline iteration")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds, S = 4 only")
    p.add_argument(
        "--size",
        default=None,
        choices=sorted(SIZES),
        help="the model (default full; smoke with --smoke); real-dense / real-moe: the first "
        "real-size GPU run's shapes (seq 4096, vocabulary 131,072; a GPU's worth of memory)",
    )
    p.add_argument(
        "--data-path",
        default=None,
        help="a Megatron dataset prefix tokenized with benchmarks/data/code32k.model (real "
        "text; default: mock data)",
    )
    p.add_argument("--bag-sizes", default="4,8", help="comma-separated S values")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda measures the iterations on the GPU (local spec, bf16; the TP-traffic part "
        "stays on gloo)",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="timed iterations per arm and run (default 12)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per arm, in alternating order (default 2; 1 with --smoke)",
    )
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
    p.add_argument(
        "--json",
        default=None,
        help="also write the measurements as JSON ({'matmul_tflops', 'results': {S: {arm: "
        "{time, time_min, peak, tokens, flops, n}}}}; arms '1', '2', 'base')",
    )
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-output", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rounds = args.rounds or (2 if args.smoke else 12)
    args.repeats = args.repeats or (1 if args.smoke else 2)
    args.size = args.size or ("smoke" if args.smoke else "full")
    if args.child is not None:
        result = measure_bag_size(
            args.child,
            size=args.size,
            device=args.device,
            rounds=args.rounds,
            threads=args.threads,
            repeats=args.repeats,
            data=args.data_path,
        )
        with open(args.child_output, "w") as f:
            json.dump(result, f)
        return
    bags = [4] if args.smoke else [int(s) for s in args.bag_sizes.split(",")]
    matmul = matmul_tflops() if args.device == "cuda" else None
    results = {str(bag): _measure_in_child(bag, args) for bag in bags}
    text = report(results, args, matmul)
    print(text)
    if args.json:
        write(args.json, json.dumps({"matmul_tflops": matmul, "results": results}))
    if args.output:
        write(args.output, text)
        write_index(os.path.dirname(os.path.abspath(args.output)))


if __name__ == "__main__":
    main()
