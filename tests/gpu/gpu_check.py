"""The GPU path in one command (``scripts/gpu_check.sh``), through the launcher
(``examples/pretrain_gpt_tst.py``: Megatron-LM's ``pretrain()`` with TST): the local spec
in bf16 through the switch, the Transformer Engine spec, FP8, distributed optimizer + alltoall
dispatcher + grouped GEMM, the MCE against megatron-core's fused cross-entropy, the step-cost
benchmark on CUDA, an FP8 save/resume and a distributed-optimizer save/resume through the switch. Each check is a row of a Markdown table written to
``docs/results/gpu_check.md``; without Transformer Engine (the lent H200 has none) the TE and
FP8 rows say ``skipped: Transformer Engine not installed``.

Every training check runs the launcher in a fresh 1-process child through the TST switch
(``RUNS`` below) and reads the per-iteration losses from Megatron-LM's log lines
(``--log-interval 1``: ``mce loss`` in phase 1, ``lm loss`` in phase 2). :func:`validate_all`
checks every launch line with the launcher's ``--dry-run`` checks (Megatron-LM's validation and
the TST checks, as a CUDA run) on any machine, which the CPU suite does.

    python tests/gpu/gpu_check.py [--output docs/results/gpu_check.md]   # needs a CUDA GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from gpu_data import build_real_text  # noqa: E402
from step_cost import LOCAL_CUDA_FLAGS  # noqa: E402

LAUNCHER = "examples/pretrain_gpt_tst.py"
HYBRID_LAUNCHER = "examples/pretrain_hybrid_tst.py"
N, N1 = 20, 8  # iterations; the switch at N1
#: Small but FP8-valid: 128 * 4 = 512 tokens per micro-batch, every width a multiple of 32.
BASE = [
    "--device", "cuda", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1024", "--num-layers", "2", "--hidden-size", "256",
    "--num-attention-heads", "4", "--ffn-hidden-size", "1024", "--seq-length", "128",
    "--max-position-embeddings", "128", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--num-experts", "4",
    "--moe-ffn-hidden-size", "256", "--moe-router-topk", "2",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(N),
    "--tst-bag-size", "4", "--tst-phase1-iters", str(N1),
    "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "WSD",
    "--lr-wsd-decay-iters", "4", "--adam-beta2", "0.95",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-interval", str(N), "--eval-iters", "0",
    "--num-workers", "0", "--seed", "7", "--bf16",
]  # fmt: skip
LOCAL = LOCAL_CUDA_FLAGS
TE = ["--transformer-impl", "transformer_engine"]
FP8 = TE + ["--fp8-format", "hybrid"]
#: The GPT runs' 2 MoE blocks as 4 HybridModel layers (attention, MoE, attention, MoE): run by
#: :data:`HYBRID_LAUNCHER`, without ``--num-layers`` (the pattern sets it).
HYBRID_MOE = ["--hybrid-layer-pattern", "*E*E"]
#: Mamba-2 layers (megatron-core's Transformer Engine hybrid spec and ``mamba_ssm``'s Triton
#: kernels): 8 heads of 64 over the 2 x 256 inner width, 2 groups, state 64.
HYBRID_MAMBA = [
    "--hybrid-layer-pattern", "M*ME", "--mamba-num-heads", "8", "--mamba-head-dim", "64",
    "--mamba-num-groups", "2", "--mamba-state-dim", "64",
]  # fmt: skip

#: Expert parallelism over 2 GPUs (``--overlap-moe-expert-parallel-comm`` needs EP >= 2).
EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]

#: name -> (extra flags, the run it is compared with or None, what is checked)
RUNS = {
    "local bf16": (LOCAL, None, "reference: local spec, bf16, through the switch"),
    "TE bf16": (
        TE,
        "local bf16",
        "TE spec + bf16 through the switch, losses close to the local spec's",
    ),
    "TE FP8 delayed": (
        FP8 + ["--fp8-recipe", "delayed"],
        "TE bf16",
        "FP8 hybrid, delayed scaling: finite, close to bf16",
    ),
    "TE FP8 current": (
        FP8 + ["--fp8-recipe", "tensorwise"],
        "TE bf16",
        "FP8 hybrid, current (per-tensor) scaling: finite, close to bf16",
    ),
    # the distributed optimizer without Transformer Engine too (the lent H200 has none)
    "local distopt alltoall": (
        LOCAL + ["--use-distributed-optimizer", "--moe-token-dispatcher-type", "alltoall"],
        "local bf16",
        "local spec: distributed optimizer + alltoall dispatcher, close to local bf16",
    ),
    "TE distopt alltoall grouped": (
        TE
        + [
            "--use-distributed-optimizer",
            "--moe-token-dispatcher-type",
            "alltoall",
            "--moe-grouped-gemm",
        ],
        "TE bf16",
        "distributed optimizer + alltoall dispatcher + --moe-grouped-gemm, close to TE bf16",
    ),
    # per-layer CUDA graphs (megatron-core's own): the same shapes in both phases
    "local cudagraph": (
        LOCAL + ["--cuda-graph-impl", "local"],
        "local bf16",
        "per-layer CUDA graphs (`--cuda-graph-impl local`) through the switch, close to local bf16",
    ),
    # the expert-parallel all-to-all overlap (megatron-core's combined 1F1B): EP 2, so 2 GPUs
    "local EP2 alltoall": (
        LOCAL + EP2,
        "local bf16",
        "2 GPUs: EP 2, alltoall dispatcher (the overlap's reference), close to local bf16",
    ),
    "local EP2 overlap": (
        # (--delay-wgrad-compute needs the TE spec: Megatron-LM's validate_args)
        LOCAL + EP2 + ["--overlap-moe-expert-parallel-comm"],
        "local EP2 alltoall",
        "2 GPUs: the all-to-all overlap through the switch, close to EP 2 without it",
    ),
    "hybrid local bf16": (
        LOCAL + HYBRID_MOE,
        "local bf16",
        f"HybridModel `*E*E` ({HYBRID_LAUNCHER}), local spec: close to the GPT run's losses",
    ),
    "hybrid TE Mamba": (
        TE + HYBRID_MAMBA,
        None,
        "HybridModel `M*ME` (Mamba-2, TE hybrid spec, mamba_ssm kernels) through the switch",
    ),
}
RESUME_AT = 10

#: |loss - reference loss| allowed, in nats, per iteration: at iteration 1 (same data, both
#: near ln V) and as the mean over the last 5 iterations (different kernels, and bf16/FP8
#: rounding, let trajectories drift a little).
TOL_FIRST, TOL_LAST5 = 0.05, 0.15


def argv_of(name: str) -> list:
    """The launcher flags of run ``name`` (a hybrid run's without ``--num-layers``)."""
    if is_hybrid(name):
        at = BASE.index("--num-layers")
        return BASE[:at] + BASE[at + 2 :] + RUNS[name][0]
    return BASE + RUNS[name][0]


def gpus_of(name: str) -> int:
    """GPUs (processes) run ``name`` takes: 2 for the expert-parallel runs, else 1."""
    return 2 if "--expert-model-parallel-size" in RUNS.get(name, ((),))[0] else 1


def is_hybrid(name: str) -> bool:
    """Whether run ``name`` runs :data:`HYBRID_LAUNCHER` (a ``HybridModel``)."""
    return name.startswith("hybrid")


def launcher_of(name: str) -> str:
    """The script run ``name`` runs."""
    return HYBRID_LAUNCHER if is_hybrid(name) else LAUNCHER


def validate_all(world_size: int = 1) -> None:
    """Check every run's launch line (and the FP8 save run's) with the launcher's ``--dry-run``
    checks at ``world_size``, as a CUDA run (no GPU needed).

    Raises:
        ConfigError: the problems of the first launch line that has any, one per line.
    """
    from tst_megatron.errors import ConfigError
    from tst_megatron.models.family import GPT, HYBRID
    from tst_megatron.training.validate import check

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        saves = {
            "FP8 save": save_argv("/tmp/ckpt"),
            "distopt save": save_argv("/tmp/ckpt", DISTOPT, DISTOPT_RESUME_AT),
        }
        from step_cost import run_flags

        for size in REAL_SIZES:  # the real-size rows' runs (their data is built on the GPU)
            for bag in (4, 1):
                saves[f"{size} S={bag}"] = run_flags(
                    bag, size=size, device="cuda", per_arm=7, data="/nonexistent/corpus"
                )
        for name in [*RUNS, *saves]:
            argv = saves[name] if name in saves else argv_of(name)
            family = HYBRID if name in RUNS and is_hybrid(name) else GPT
            os.environ["WORLD_SIZE"] = str(world_size * gpus_of(name))
            problems = check(argv, dry_run=True, family=family).problems
            if problems:
                raise ConfigError(f"{name}: " + "\n".join(problems))
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved


#: The distributed-optimizer run (no TE needed) saved in phase 1 and resumed across the switch.
DISTOPT, DISTOPT_RESUME_AT = "local distopt alltoall", N1 - 1


def save_argv(ckpt: str, name: str = "TE FP8 delayed", at: int = RESUME_AT) -> list:
    """Run ``name`` (default the FP8 (delayed) run) saving a torch_dist checkpoint at ``at``."""
    return argv_of(name) + [
        "--save", ckpt, "--save-interval", str(at), "--ckpt-format", "torch_dist",
    ]  # fmt: skip


def resume_argv(ckpt: str, name: str = "TE FP8 delayed", at: int = RESUME_AT) -> list:
    """Run ``name`` resumed from :func:`save_argv`'s checkpoint at ``at``."""
    return argv_of(name) + [
        "--load", ckpt, "--ckpt-step", str(at), "--ckpt-format", "torch_dist",
    ]  # fmt: skip


# --- children -------------------------------------------------------------------------------

#: Megatron-LM's ``training_log`` line: ``iteration 3/ 20 | ... | mce loss: 6.9E+00 | ...``.
_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
_KEY = re.compile(r"\| (mce loss|lm loss): ([0-9.E+-]+) ")


def parse_losses(text: str) -> dict:
    """``{iteration: training loss}`` from Megatron-LM's log lines: ``lm loss`` where a line
    has it (phase 2), else ``mce loss`` (phase 1; after the switch Megatron-LM keeps printing
    ``mce loss: 0.0``)."""
    losses = {}
    for iteration, rest in _LINE.findall(text):
        keys = dict(_KEY.findall("| " + rest))
        if "lm loss" in keys and ("mce loss" not in keys or float(keys["mce loss"]) == 0.0):
            losses[int(iteration)] = float(keys["lm loss"])
        elif "mce loss" in keys:
            losses[int(iteration)] = float(keys["mce loss"])
    return losses


#: Seconds one training child may take (20 small iterations take well under a minute on an
#: H100; a hang must not eat the whole check).
RUN_TIMEOUT = 180


def _train(argv: list, log: str, launcher: str = LAUNCHER, gpus: int = 1) -> dict:
    """Run ``launcher`` on 1 GPU with ``argv`` (``gpus`` > 1: one process per GPU through
    ``torch.distributed.run``); return ``{"train": {iteration: loss}}``.

    Raises:
        RuntimeError: the child exited non-zero or ran past :data:`RUN_TIMEOUT`.
    """
    from tst_megatron.runtime.distributed import free_port

    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        CUDA_DEVICE_MAX_CONNECTIONS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    command = [sys.executable, launcher, *argv]
    if gpus > 1:  # torchrun sets each process's rank; the log lines come from the last rank
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            del env[key]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus)]
        command += ["--master-port", env["MASTER_PORT"], launcher, *argv]
    try:
        result = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        out = b"".join(
            x if isinstance(x, bytes) else x.encode() for x in (exc.stdout, exc.stderr) if x
        )
        with open(log, "a") as f:
            f.write(f"\n$ {launcher} {' '.join(argv)}\n{out.decode(errors='replace')}")
        raise RuntimeError(f"launcher ran past {RUN_TIMEOUT} s; see {log}") from None
    with open(log, "a") as f:
        f.write(f"\n$ {launcher} {' '.join(argv)}\n{result.stdout}{result.stderr}")
    if result.returncode != 0:
        raise RuntimeError(f"launcher exited {result.returncode}; see {log}")
    return {"train": parse_losses(result.stdout)}


# --- checks ---------------------------------------------------------------------------------


def _compare(losses: dict, reference: dict) -> tuple:
    """``(ok, text)``: ``losses`` close to ``reference`` (a missing iteration: not ok)."""
    nan = math.nan
    first = abs(losses.get(1, nan) - reference.get(1, nan))
    last = [abs(losses.get(i, nan) - reference.get(i, nan)) for i in range(N - 4, N + 1)]
    mean_last = sum(last) / len(last)
    finite = all(math.isfinite(v) for v in losses.values())
    ok = finite and first <= TOL_FIRST and mean_last <= TOL_LAST5
    return ok, f"|d| it 1: {first:.4f}, mean |d| its {N - 4}-{N}: {mean_last:.4f}"


def _te_has(recipe_class: str) -> bool:
    try:
        from transformer_engine.common import recipe
    except Exception:
        return False
    return hasattr(recipe, recipe_class)


def te_installed() -> bool:
    """Whether Transformer Engine imports (the lent H200 has none: its rows are skipped)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 (ImportError, or TE built for another CUDA/torch)
        return False
    return True


NO_TE = "skipped: Transformer Engine not installed"


def mamba_ssm_installed() -> bool:
    """Whether megatron-core's Mamba mixer finds ``mamba_ssm``'s kernels (``HAVE_MAMBA_SSM``:
    ``mamba_ssm`` imports ``selective_scan_cuda``, its compiled extension, on import)."""
    try:
        from megatron.core.ssm.mamba_mixer import HAVE_MAMBA_SSM
    except Exception:  # noqa: BLE001
        return False
    return bool(HAVE_MAMBA_SSM)


NO_MAMBA = "skipped: mamba_ssm (with its CUDA extension) not installed"


def skip_reason(name: str):
    """Why run ``name`` cannot run here (a row's result), or None."""
    if name.startswith("TE") or name == "hybrid TE Mamba":
        if not te_installed():
            return NO_TE
    if name == "TE FP8 current" and not _te_has("Float8CurrentScaling"):
        return "skipped: this Transformer Engine has no current scaling"
    if name == "hybrid TE Mamba" and not mamba_ssm_installed():
        return NO_MAMBA
    if gpus_of(name) > 1:
        import torch

        if torch.cuda.device_count() < gpus_of(name):
            return (
                f"skipped: needs {gpus_of(name)} GPUs, this machine has {torch.cuda.device_count()}"
            )
    return None


def check_training(rows: list, log: str) -> dict:
    """One row per :data:`RUNS` entry: the run trains through the switch (every iteration
    logged, finite) or stays close to its reference run. A run that fails or is skipped is a
    row, and the check goes on. Returns ``{name: {iteration: loss}}`` of the runs that ran."""
    results = {}
    for name, (_, reference, what) in RUNS.items():
        if reason := skip_reason(name):
            rows.append((what, reason, "-"))
            continue
        if reference is not None and reference not in results:
            rows.append((what, f"skipped: its reference run {reference!r} did not run", "FAIL"))
            continue
        start = time.time()
        try:
            results[name] = _train(argv_of(name), log, launcher_of(name), gpus_of(name))["train"]
        except RuntimeError as exc:
            rows.append((what, str(exc), "FAIL"))
            continue
        losses = results[name]
        at = {i: losses.get(i, math.nan) for i in (1, N1, N1 + 1, N)}  # nan: not logged
        summary = (
            f"loss it 1 {at[1]:.4f}, it {N1} {at[N1]:.4f}, it {N1 + 1} "
            f"{at[N1 + 1]:.4f}, it {N} {at[N]:.4f} ({time.time() - start:.0f} s)"
        )
        if reference is None:  # every iteration logged, both phases, finite
            ok = sorted(losses) == list(range(1, N + 1))
            ok = ok and all(math.isfinite(v) for v in losses.values())
        else:
            ok, diff = _compare(losses, results[reference])
            summary += f"; vs {reference}: {diff}"
        rows.append((what, summary, "pass" if ok else "FAIL"))
    return results


def check_fp8_resume(rows: list, log: str, uninterrupted: dict) -> None:
    what = f"FP8 (delayed) torch_dist save at {RESUME_AT} and resume: losses continue exactly"
    if not te_installed():
        rows.append((what, NO_TE, "-"))
        return
    with tempfile.TemporaryDirectory() as ckpt:
        first = _train(save_argv(ckpt), log)["train"]
        second = _train(resume_argv(ckpt), log)["train"]
    its = compared_iterations(RESUME_AT)
    diffs = [abs(second[i] - first[i]) for i in its]
    loss_ok = max(diffs) <= 1e-3 * abs(first[N])
    reference = uninterrupted.get("TE FP8 delayed", {})
    same_as_run = bool(reference) and abs(reference[N] - first[N]) <= 1e-3 * abs(reference[N])
    rows.append(
        (
            what,
            f"max |loss resumed - uninterrupted| its {RESUME_AT + 2}-{N}: {max(diffs):.2e}; "
            f"saving run = plain FP8 run: {same_as_run}",
            "pass" if loss_ok else "FAIL",
        )
    )


def compared_iterations(at: int) -> list:
    """The iterations whose logged losses a run resumed at ``at`` must repeat: from ``at + 2``
    (Megatron-LM's first log line after a restart may average two steps) to ``N``, without
    ``N1 + 1`` after a restart at ``N1 - 1``: Megatron-LM 0.19.2 logs that line halved (its
    loss dictionary is averaged over two log steps; fixed upstream by PR #7092; the run itself
    is exact: the grad norms on the line match, seen on the H200)."""
    return [i for i in range(at + 2, N + 1) if not (at == N1 - 1 and i == N1 + 1)]


def check_distopt_resume(rows: list, log: str) -> None:
    """The distributed optimizer (local spec, bf16, torch's AdamW without TE or Apex: the lent
    H200's setting) saved at ``N1 - 1`` and resumed through the switch: megatron-core 0.19.2
    cannot load that state by itself (``tst_megatron.upstream.distributed_optimizer_resume``)."""
    at = DISTOPT_RESUME_AT
    what = f"distributed optimizer: torch_dist save at {at} (phase 1), resume through the switch"
    its = compared_iterations(at)
    with tempfile.TemporaryDirectory() as ckpt:
        first = _train(save_argv(ckpt, DISTOPT, at), log)["train"]
        second = _train(resume_argv(ckpt, DISTOPT, at), log)["train"]
    diffs = [abs(second.get(i, math.nan) - first.get(i, math.nan)) for i in its]
    ok = all(math.isfinite(d) for d in diffs) and max(diffs) <= 1e-3 * abs(first[N])
    rows.append(
        (
            what,
            f"max |loss resumed - uninterrupted| its {its[0]}-{N} but {N1 + 1}: {max(diffs):.2e}",
            "pass" if ok else "FAIL",
        )
    )


def check_memory_history(rows: list, log: str) -> None:
    """``--record-memory-history``: the snapshot Megatron-LM writes at its log lines holds the
    CUDA allocator's history (the launcher's model provider starts it, as ``pretrain_gpt.py``'s
    does); without the flag the snapshot has none."""
    import pickle

    what = "--record-memory-history: Megatron-LM's memory snapshot holds the allocator history"
    events = {}
    with tempfile.TemporaryDirectory() as d:
        for on in (True, False):
            path = os.path.join(d, f"snapshot-{on}.pickle")
            flags = ["--memory-snapshot-path", path] + (["--record-memory-history"] if on else [])
            _train(argv_of("local bf16") + flags, log)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    traces = pickle.load(f).get("device_traces", [])
                events[on] = sum(len(trace) for trace in traces)
            else:
                events[on] = None  # no snapshot written
    ok = bool(events[True]) and not events[False]
    rows.append(
        (
            what,
            f"allocator events: {events[True]} with, {events[False]} without",
            "pass" if ok else "FAIL",
        )
    )


@contextlib.contextmanager
def one_process_group(device: str):
    """This process as a world of one with megatron-core's parallel state, torn down after."""
    from tst_megatron.runtime import (
        ParallelConfig,
        destroy,
        init_distributed,
        initialize_model_parallel,
    )

    init_distributed(device=device)
    initialize_model_parallel(ParallelConfig())
    try:
        yield
    finally:
        destroy()


def check_mce_vs_fused_ce(rows: list, device: str = "cuda") -> None:
    """Phase-1 MCE kernel at k=1 (fp32, T=256, b=4, V=32000, random upstream gradient) against
    a float64 cross-entropy (``torch.nn.functional.cross_entropy``; loss and gradient, tight)
    and megatron-core's fused vocab-parallel CE (loss tight; gradient within bf16 rounding:
    ``fused_cross_entropy.calculate_gradients`` returns it cast to bfloat16)."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    from tst_megatron.superposition import vocab_parallel_multi_target_cross_entropy

    with one_process_group(device):
        torch.manual_seed(0)
        T, b, V = 256, 4, 32000
        base = 4 * torch.randn(T, b, V, device=device)
        targets = torch.randint(0, V, (T, b), device=device)
        upstream = torch.rand(T, b, device=device) + 0.5
        group = ps.get_tensor_model_parallel_group()

        def loss_and_grad(loss_fn, logits):
            logits = logits.clone().requires_grad_()
            loss = loss_fn(logits)
            (grad,) = torch.autograd.grad((loss * upstream.to(loss.dtype)).sum(), logits)
            return loss.detach().double(), grad.double()

        ours, grad = loss_and_grad(
            lambda x: vocab_parallel_multi_target_cross_entropy(
                x, targets.unsqueeze(-1), tp_group=group
            )[..., 0],
            base,
        )
        exact, grad_exact = loss_and_grad(
            lambda x: F.cross_entropy(x.view(-1, V), targets.view(-1), reduction="none").view(T, b),
            base.double(),
        )
        fused, grad_fused = loss_and_grad(
            lambda x: fused_vocab_parallel_cross_entropy(x, targets, group), base
        )
        errors = {
            "loss vs fp64": (ours - exact).abs().max().item(),
            "grad vs fp64": (grad - grad_exact).abs().max().item(),
            "loss vs fused": (ours - fused).abs().max().item(),
            # the fused gradient is rounded to bf16 (8 significant bits): relative 2^-8
            "grad vs fused / bf16 bound": (
                (grad - grad_fused).abs() / (grad.abs() * 2.0**-8 + 1e-12)
            )
            .max()
            .item(),
        }
        ok = (
            errors["loss vs fp64"] <= 1e-4
            and errors["grad vs fp64"] <= 1e-6
            and errors["loss vs fused"] <= 1e-4
            and errors["grad vs fused / bf16 bound"] <= 1.01  # + fp32 differences
        )
        rows.append(
            (
                "phase-1 MCE at k=1 vs float64 CE and megatron-core's fused CE "
                f"(fp32, T={T}, b={b}, V={V})",
                "max " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()),
                "pass" if ok else "FAIL",
            )
        )


#: The chunked loss head's row (``--tst-loss-chunks``): the real-size dense head (seq 4096 x
#: micro-batch 2, hidden 2048, vocabulary 131,072, bf16), 8 chunks into an fp32 main_grad.
CHUNKED_SHAPE = {"T": 4096, "b": 2, "h": 2048, "V": 131072, "chunks": 8}


def check_chunked_loss(rows: list, *, device: str = "cuda", shape: dict = CHUNKED_SHAPE) -> None:
    """The chunked head against the unchunked one (the output layer's matmul, then
    megatron-core's ``vocab_parallel_cross_entropy``; k = 1, and k = 4 for phase 1 against the
    project's multi-target CE), forward + backward on the same bf16 hidden states and weight:
    peak allocated bytes above the inputs (CUDA's allocator; on a CPU, the live-tensor
    tracker of ``benchmarks/measure.py``), median time of 5, and the loss's largest
    difference. Passes when the chunked peak is <= 0.25x and the losses agree to bf16
    rounding (1e-2 nats). ``device``/``shape`` let the CPU suite run it small."""
    import statistics

    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from measure import PeakTensorMemory

    from tst_megatron.superposition import vocab_parallel_multi_target_cross_entropy
    from tst_megatron.superposition.chunked_loss import chunked_output_cross_entropy

    cuda = device == "cuda"
    with one_process_group(device):
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        T, b, h, V, n = (shape[k] for k in ("T", "b", "h", "V", "chunks"))
        g = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(T, b, h, device=device, generator=g).bfloat16().requires_grad_()
        weight = (torch.randn(V, h, device=device, generator=g) * 0.02).bfloat16()
        weight.requires_grad_()
        weight.main_grad = torch.zeros(V, h, device=device)
        # megatron-core DDP's hook: it drops the placeholder gradient once autograd set it
        weight.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        for k in (1, 4):
            targets = torch.randint(0, V, (T, b, k), device=device, generator=g)
            upstream = torch.rand(T, b, k, device=device, generator=g)

            def unchunked():
                logits = hidden @ weight.t()
                if k == 1:
                    return vocab_parallel_cross_entropy(logits, targets[..., 0], tp_group=group)[
                        ..., None
                    ]
                return vocab_parallel_multi_target_cross_entropy(
                    logits, targets, tp_group=group, inplace=True
                )

            def chunked():
                weight.grad_added_to_main_grad = False
                return chunked_output_cross_entropy(
                    hidden, weight, targets, chunks=n, tp_group=group, into_main_grad=True
                )

            def measure(loss_fn):
                times, loss = [], None
                for _ in range(6):
                    hidden.grad = weight.grad = None
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                    start = time.perf_counter()
                    tracking = PeakTensorMemory(ignore=[weight.main_grad])  # DDP's buffer
                    with contextlib.nullcontext() if cuda else tracking as tracker:
                        loss = loss_fn()
                        loss.backward(upstream)
                    if cuda:
                        torch.cuda.synchronize()
                        peak = torch.cuda.max_memory_allocated() - base
                    else:
                        peak = tracker.peak
                    times.append(time.perf_counter() - start)
                return statistics.median(times[1:]), peak, loss.detach().float()

            t0, m0, l0 = measure(unchunked)
            t1, m1, l1 = measure(chunked)
            diff = (l1 - l0).abs().max().item()
            ok = m1 <= 0.25 * m0 and diff <= 1e-2
            rows.append(
                (
                    f"--tst-loss-chunks {n} vs the unchunked head, k={k} (bf16, T={T}, b={b}, "
                    f"h={h}, V={V}, main_grad)",
                    f"peak {m1 / 2**20:,.0f} vs {m0 / 2**20:,.0f} MiB ({m1 / m0:.3f}x), time "
                    f"{t1 * 1e3:,.1f} vs {t0 * 1e3:,.1f} ms ({t1 / t0:.2f}x), max loss diff "
                    f"{diff:.1e}",
                    "pass" if ok else "FAIL",
                )
            )


#: The real-size step rows (issue 52): ``benchmarks/step_cost.py --size <size>`` on real text,
#: S = 4, the TST run and the baseline twice each in alternating order (TST, baseline,
#: baseline, TST), 4 timed iterations per arm and run; about 5 minutes of an H200 for both.
REAL_SIZES = ("real-dense", "real-moe")
REAL_SIZE_ARGS = ["--bag-sizes", "4", "--repeats", "2", "--rounds", "4"]
#: Text for them: the machine's own installed Python sources (no network there), tokenized
#: with the tokenizer that travels with the tree; about 4M tokens, of which a TST run reads 1.2M.
REAL_TEXT_BYTES = 16_000_000


def check_real_size(
    rows: list,
    sections: list,
    log: str,
    *,
    device: str = "cuda",
    sizes=REAL_SIZES,
    extra: tuple = tuple(REAL_SIZE_ARGS),
    text_bytes: int = REAL_TEXT_BYTES,
) -> None:
    """One row per size of ``sizes``: ``benchmarks/step_cost.py`` on real text (built here by
    :func:`build_real_text`): per arm the time per iteration, peak memory and Megatron-LM's
    TFLOP/s (and its fraction of this GPU's bf16 matmul rate), and the ratios phase 1 /
    baseline and phase 1 / phase 2. Passes when phase 1 / baseline is <= 1.00 in memory and
    <= 1.02 in time (the goals at the dense shape; the MoE row reports). ``device``/``sizes``
    let the CPU suite run the same code on a tiny model (``--device cpu --size smoke``)."""
    from tst_megatron.runtime.distributed import free_port

    with tempfile.TemporaryDirectory() as data_dir:
        start = time.time()
        data = build_real_text(data_dir, text_bytes, log)
        built = time.time() - start
        for size in sizes:
            start = time.time()
            command = ["benchmarks/step_cost.py", "--device", device, "--size", size]
            command += ["--data-path", data, *extra]
            env = dict(
                os.environ,
                MASTER_PORT=str(free_port()),
                PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
            )
            what = f"real-size step, `--size {size}` on real text: phase 1 vs baseline and phase 2"
            measured = os.path.join(data_dir, f"{size}.json")
            written = os.path.join(data_dir, "reports", f"{size}.md")
            try:
                result = subprocess.run(
                    [sys.executable, *command, "--json", measured, "--output", written],
                    cwd=ROOT, env=env,
                    capture_output=True, text=True, timeout=4 * RUN_TIMEOUT,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                rows.append((what, f"ran past {4 * RUN_TIMEOUT} s", "FAIL"))
                continue
            with open(log, "a") as f:
                f.write(f"\n$ {' '.join(command)}\n{result.stdout}{result.stderr}")
            if result.returncode != 0:
                rows.append((what, f"exit {result.returncode}; see {log}", "FAIL"))
                continue
            with open(measured) as f:
                measurement = json.load(f)
            summary, ok = real_size_summary(measurement)
            summary += f" ({time.time() - start:.0f} s; text built in {built:.0f} s)"
            # the goals hold at the dense shape; the other sizes report
            rows.append((what, summary, "pass" if ok or size != sizes[0] else "FAIL"))
            with open(written) as f:
                table = f.read()
            sections.append(
                f"## {' '.join(command[:5])}, real text\n\n" + table.replace("# TST", "### TST")
            )


def real_size_summary(measurement: dict) -> tuple[str, bool]:
    """``(text, goals met)`` of one ``step_cost.py --json`` measurement at S = 4: the ratios
    phase 1 / baseline (goals: <= 1.00 in memory, <= 1.02 in time) and phase 1 / phase 2,
    Megatron-LM's TFLOP/s per arm and the baseline's fraction of the matmul rate."""
    arms = measurement["results"]["4"]
    p1, p2, base = arms["1"], arms["2"], arms["base"]
    tflops = {k: a["flops"] / a["time"] / 1e12 for k, a in arms.items()}
    time_ratio, memory_ratio = p1["time"] / base["time"], p1["peak"] / base["peak"]
    rate = measurement.get("matmul_tflops")
    fraction = f"{tflops['base'] / rate:.3f} of {rate:.0f}" if rate else "-"
    text = (
        f"time phase 1 / baseline {time_ratio:.3f}, phase 1 / phase 2 "
        f"{p1['time'] / p2['time']:.3f}; memory phase 1 / baseline {memory_ratio:.4f}, "
        f"phase 1 / phase 2 {p1['peak'] / p2['peak']:.4f}; TFLOP/s phase 1 "
        f"{tflops['1']:.3g}, phase 2 {tflops['2']:.3g}, baseline {tflops['base']:.3g} "
        f"(baseline: {fraction} TFLOP/s of bf16 matmul)"
    )
    if base.get("allocator"):  # cudaMalloc / cudaFree calls and retries per iteration
        text += "; allocator per iteration (cudaMalloc, cudaFree, retries): " + ", ".join(
            f"{name} {'/'.join(f'{v:.1f}' for v in arms[key]['allocator'])}"
            for key, name in (("1", "phase 1"), ("2", "phase 2"), ("base", "baseline"))
        )
    return text, memory_ratio <= 1.0 + 5e-4 and time_ratio <= 1.02


def machine() -> str:
    """The GPU, Python, torch, megatron-core and Transformer Engine versions (needs CUDA)."""
    from importlib.metadata import version

    import torch

    try:
        import transformer_engine

        te = getattr(transformer_engine, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        te = f"not importable ({type(exc).__name__})"
    try:
        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001 (a source checkout on PYTHONPATH: no dist-info)
        import megatron.core

        mcore = megatron.core.__version__
    return (
        f"{torch.cuda.get_device_name()}, Python {platform.python_version()}, torch "
        f"{torch.__version__}, megatron-core {mcore}, Transformer Engine {te}"
    )


def report(rows: list, sections: list, elapsed: float, machine_text: str) -> str:
    """The Markdown report: a header, one table row per ``(check, result, verdict)`` of
    ``rows``, then ``sections``."""
    lines = [
        "# GPU check",
        "",
        f"`scripts/gpu_check.sh` on {machine_text}; {elapsed:.0f} s in all.",
        f"Training runs: the launcher (`{LAUNCHER}`, Megatron-LM's `pretrain()`) on 1 GPU, "
        f"{' '.join(BASE)} (+ the flags of each row: the local spec's are "
        f"{' '.join(LOCAL)}); the switch after iteration {N1}. Tolerances vs the reference "
        f"run: |d loss| <= {TOL_FIRST} at iteration 1 and <= {TOL_LAST5} on average over the "
        "last 5 iterations.",
        "",
        "| check | result | verdict |",
        "|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines + [""] + sections) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--output", default=os.path.join(ROOT, "docs/results/gpu_check.md"))
    parser.add_argument("--log", default=os.path.join(ROOT, "runs/gpu_check.log"))
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--real-size-only",
        action="store_true",
        help="only the real-size step rows (about 5 minutes of an H200)",
    )
    group.add_argument(
        "--no-real-size", action="store_true", help="every row but the real-size step rows"
    )
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing was checked", file=sys.stderr)
        return 1
    validate_all()
    os.makedirs(os.path.dirname(args.log), exist_ok=True)
    open(args.log, "w").close()
    start, rows, sections, results = time.time(), [], [], {}
    machine_text = machine()

    def write() -> None:  # after every check: a check that hangs past a limit loses only itself
        text = report(rows, sections, time.time() - start, machine_text)
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        with open(args.output + ".tmp", "w") as f:
            f.write(text)
        os.replace(args.output + ".tmp", args.output)

    checks = [
        ("training runs", lambda: results.update(check_training(rows, args.log))),
        ("MCE vs fused CE", lambda: check_mce_vs_fused_ce(rows)),
        ("distributed-optimizer resume", lambda: check_distopt_resume(rows, args.log)),
        ("FP8 resume", lambda: check_fp8_resume(rows, args.log, results)),
        ("memory history", lambda: check_memory_history(rows, args.log)),
        ("chunked loss head", lambda: check_chunked_loss(rows)),
        ("real-size step", lambda: check_real_size(rows, sections, args.log)),
    ]
    if args.real_size_only:  # with the chunked head's row, also at the real-size shape
        checks = checks[-2:]
    elif args.no_real_size:
        checks = checks[:-1]
    for name, run_check in checks:
        try:
            run_check()
        except Exception as exc:  # noqa: BLE001 (a row, and the other checks still run)
            rows.append((name, f"raised {type(exc).__name__}: {exc}", "FAIL"))
        write()
        print(f"gpu_check: {name} done ({time.time() - start:.0f} s)", flush=True)
    print(open(args.output).read())
    print(f"written to {args.output}; training logs in {args.log}")
    return 0 if all(verdict != "FAIL" for _, _, verdict in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
