"""The GPU path in one command (``scripts/gpu_check.sh``): Transformer Engine spec, bf16, FP8,
distributed optimizer, alltoall dispatcher, grouped GEMM, the MCE against megatron-core's fused
cross-entropy, the step-cost benchmark on CUDA, and an FP8 save/resume. Each check is a row of a
Markdown table written to ``docs/results/gpu_check.md``.

Every training check runs the trainer (``tst_megatron.training.trainer.train``) in a fresh
1-process child through the TST switch (``RUNS`` below; :func:`validate_all` checks each of
them with the trainer's own ``validate`` on any machine, which the CPU suite does).

    python tests/gpu/gpu_check.py [--output docs/results/gpu_check.md]   # needs a CUDA GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

N, N1 = 20, 8  # iterations; the switch at N1
#: Small but FP8-valid: 128 * 4 = 512 tokens per micro-batch, every width a multiple of 32.
BASE = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--adam-beta2",
    "0.95",
    "--lr-decay-style",
    "WSD",
    "--device",
    "cuda",
    "--vocab-size",
    "1024",
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "1024",
    "--seq-length",
    "128",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--num-experts",
    "4",
    "--moe-ffn-hidden-size",
    "256",
    "--moe-router-topk",
    "2",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--train-iters",
    str(N),
    "--tst-bag-size",
    "4",
    "--tst-phase1-iters",
    str(N1),
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "2",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--log-interval",
    "5",
    "--seed",
    "7",
    "--bf16",
]
TE = ["--transformer-impl", "transformer_engine"]
FP8 = TE + ["--fp8-format", "hybrid"]

#: name -> (extra flags, the run it is compared with or None, what is checked)
RUNS = {
    "local bf16": ([], None, "reference: local spec, bf16"),
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
}
RESUME_AT = 10

#: |loss - reference loss| allowed, in nats, per iteration: at iteration 1 (same data, both
#: near ln V) and as the mean over the last 5 iterations (different kernels, and bf16/FP8
#: rounding, let trajectories drift a little).
TOL_FIRST, TOL_LAST5 = 0.05, 0.15


def argv_of(name: str) -> list:
    """The trainer flags of run ``name``."""
    return BASE + RUNS[name][0]


def validate_all(world_size: int = 1) -> None:
    """Parse every run's flags and check them with the trainer's ``validate`` for a CUDA
    device (no GPU needed). Raises ``ConfigError`` on the first problem."""
    from tst_megatron.training.config import parse_args, validate

    for name in RUNS:
        validate(parse_args(argv_of(name)), world_size, "cuda")
    validate(parse_args(argv_of("TE FP8 delayed") + ["--save", "x"]), world_size, "cuda")


# --- children -------------------------------------------------------------------------------


def _amax(model_chunks):
    """The delayed-scaling amax history of the first TE module that has one (CPU copy)."""
    for chunk in model_chunks:
        for module in chunk.modules():
            meta = getattr(module, "fp8_meta", None)
            if isinstance(meta, dict) and "scaling_fwd" in meta:
                history = getattr(meta["scaling_fwd"], "amax_history", None)
                if history is not None:
                    return history.detach().float().cpu()
    return None


def child(argv: list, out: str) -> None:
    """Train with ``argv``; write ``{"train": {it: loss}, "amax_saved", "amax_loaded"}``."""
    from tst_megatron.runtime import destroy
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    probe = {}
    real_save, real_resume = trainer.save, trainer.resume

    def save(run, iteration, tokens_seen):
        real_save(run, iteration, tokens_seen)
        amax = _amax(run.model)
        probe[f"amax_saved_{iteration}"] = None if amax is None else amax.tolist()

    def resume(run):
        result = real_resume(run)
        amax = _amax(run.model)
        probe["amax_loaded"] = None if amax is None else amax.tolist()
        return result

    trainer.save, trainer.resume = save, resume
    try:
        history = trainer.train(parse_args(argv))
    finally:
        destroy()
    with open(out, "w") as f:
        json.dump({"train": history["train"], **probe}, f)


def _train(argv: list, log: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(argv)}\n")
        f.flush()
        subprocess.run(
            [sys.executable, __file__, "--child", out, "--", *argv],
            check=True,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    result["train"] = {int(k): v for k, v in result["train"].items()}
    return result


# --- checks ---------------------------------------------------------------------------------


def _compare(losses: dict, reference: dict) -> tuple:
    first = abs(losses[1] - reference[1])
    last = [abs(losses[i] - reference[i]) for i in range(N - 4, N + 1)]
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


def check_training(rows: list, log: str) -> dict:
    results = {}
    for name, (_, reference, what) in RUNS.items():
        if name.startswith("TE") and not te_installed():
            rows.append((what, NO_TE, "-"))
            continue
        if name == "TE FP8 current" and not _te_has("Float8CurrentScaling"):
            rows.append((what, "skipped: this Transformer Engine has no current scaling", "-"))
            continue
        start = time.time()
        results[name] = _train(argv_of(name), log)["train"]
        losses = results[name]
        summary = (
            f"loss it 1 {losses[1]:.4f}, it {N1} {losses[N1]:.4f}, it {N1 + 1} "
            f"{losses[N1 + 1]:.4f}, it {N} {losses[N]:.4f} ({time.time() - start:.0f} s)"
        )
        if reference is None:
            ok = all(math.isfinite(v) for v in losses.values())
        else:
            ok, diff = _compare(losses, results[reference])
            summary += f"; vs {reference}: {diff}"
        rows.append((what, summary, "pass" if ok else "FAIL"))
    return results


def check_fp8_resume(rows: list, log: str, uninterrupted: dict) -> None:
    what = f"FP8 (delayed) save at {RESUME_AT} and resume: amax history and losses survive"
    if not te_installed():
        rows.append((what, NO_TE, "-"))
        return
    with tempfile.TemporaryDirectory() as ckpt:
        first = _train(
            argv_of("TE FP8 delayed")
            + ["--train-iters", str(N), "--save", ckpt, "--save-interval", str(RESUME_AT)],
            log,
        )
        # drop the checkpoints after RESUME_AT so the resume starts there
        for entry in os.listdir(ckpt):
            if entry.startswith("iter_") and int(entry[5:12]) > RESUME_AT:
                subprocess.run(["rm", "-rf", os.path.join(ckpt, entry)], check=True)
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(RESUME_AT))
        second = _train(argv_of("TE FP8 delayed") + ["--load", ckpt], log)
    saved, loaded = first.get(f"amax_saved_{RESUME_AT}"), second.get("amax_loaded")
    amax_ok = saved is not None and saved == loaded and any(any(row) for row in saved)
    diffs = [abs(second["train"][i] - first["train"][i]) for i in range(RESUME_AT + 1, N + 1)]
    loss_ok = max(diffs) <= 1e-3 * abs(first["train"][N])
    reference = uninterrupted.get("TE FP8 delayed", {})
    same_as_run = reference and abs(reference[N] - first["train"][N]) <= 1e-3 * abs(reference[N])
    rows.append(
        (
            what,
            f"amax history {'restored' if amax_ok else 'NOT restored'} "
            f"({'missing' if saved is None else f'{len(saved)} x {len(saved[0])}'}); "
            f"max |loss resumed - uninterrupted| its {RESUME_AT + 1}-{N}: {max(diffs):.2e}; "
            f"saving run = plain FP8 run: {bool(same_as_run)}",
            "pass" if amax_ok and loss_ok else "FAIL",
        )
    )


def check_mce_vs_fused_ce(rows: list) -> None:
    """Phase-1 MCE kernel at k=1 against megatron-core's fused vocab-parallel CE on CUDA."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    from tst_megatron.runtime import (
        ParallelConfig,
        destroy,
        init_distributed,
        initialize_model_parallel,
    )
    from tst_megatron.superposition import vocab_parallel_multi_target_cross_entropy

    init_distributed(device="cuda")
    initialize_model_parallel(ParallelConfig())
    try:
        torch.manual_seed(0)
        T, b, V = 256, 4, 32000
        base = 4 * torch.randn(T, b, V, device="cuda")
        logits, logits_ref = base.clone().requires_grad_(), base.clone().requires_grad_()
        targets = torch.randint(0, V, (T, b), device="cuda")
        upstream = torch.rand(T, b, device="cuda") + 0.5
        group = ps.get_tensor_model_parallel_group()
        ref = fused_vocab_parallel_cross_entropy(logits_ref, targets, group)
        (grad_ref,) = torch.autograd.grad((ref * upstream).sum(), logits_ref)
        ours = vocab_parallel_multi_target_cross_entropy(
            logits, targets.unsqueeze(-1), tp_group=group
        )[..., 0]
        (grad,) = torch.autograd.grad((ours * upstream).sum(), logits)
        loss_err = (ours - ref).abs().max().item()
        grad_err = (grad - grad_ref).abs().max().item()
        ok = loss_err <= 1e-4 and grad_err <= 1e-6
        rows.append(
            (
                "phase-1 MCE at k=1 vs megatron-core fused CE (fp32, T=256, b=4, V=32000)",
                f"max |loss diff| {loss_err:.2e}, max |grad diff| {grad_err:.2e}",
                "pass" if ok else "FAIL",
            )
        )
    finally:
        destroy()


def check_step_cost(rows: list, sections: list, log: str) -> None:
    start = time.time()
    result = subprocess.run(
        [sys.executable, "benchmarks/step_cost.py", "--device", "cuda"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    with open(log, "a") as f:
        f.write(result.stdout + result.stderr)
    ok = result.returncode == 0
    rows.append(
        (
            "`benchmarks/step_cost.py --device cuda`",
            f"exit {result.returncode} ({time.time() - start:.0f} s); report below",
            "pass" if ok else "FAIL",
        )
    )
    table = result.stdout[result.stdout.find("# TST step cost") :] if ok else ""
    sections.append(
        "## benchmarks/step_cost.py --device cuda\n\n"
        + (table.replace("# TST", "### TST") if ok else "failed; see the log")
    )


def report(rows: list, sections: list, elapsed: float) -> str:
    import megatron.core
    import torch

    try:
        import transformer_engine

        te = getattr(transformer_engine, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        te = f"not importable ({type(exc).__name__})"
    lines = [
        "# GPU check",
        "",
        f"`scripts/gpu_check.sh` on {torch.cuda.get_device_name()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, megatron-core "
        f"{megatron.core.__version__}, Transformer Engine {te}; {elapsed:.0f} s in all.",
        f"Training runs: 1 GPU, {' '.join(BASE)} (+ the flags of each row); the switch at "
        f"iteration {N1}. Tolerances vs the reference run: |d loss| <= {TOL_FIRST} at "
        f"iteration 1 and <= {TOL_LAST5} on average over the last 5 iterations.",
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
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        child([a for a in rest if a != "--"], args.child)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing was checked", file=sys.stderr)
        return 1
    validate_all()
    os.makedirs(os.path.dirname(args.log), exist_ok=True)
    open(args.log, "w").close()
    start, rows, sections = time.time(), [], []
    results = check_training(rows, args.log)
    check_fp8_resume(rows, args.log, results)
    check_mce_vs_fused_ce(rows)
    check_step_cost(rows, sections, args.log)
    text = report(rows, sections, time.time() - start)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(text)
    print(text)
    print(f"written to {args.output}; training logs in {args.log}")
    return 0 if all(verdict != "FAIL" for _, _, verdict in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
