"""One launch path: every class of problem the dry run reports stops a real 2-process launch
before any work, as one ``error:`` line printed once (rank 0), exit status 2 on every rank,
no traceback and no usage block; and the line is the dry run's.

The classes: Megatron-LM's parser (a misspelled flag), its ``validate_args``, the model's
``TransformerConfig`` (heads not divisible by TP; MoE biases at expert TP 2), the rules
megatron-core enforces only inside the first step (sequence parallelism with a length TP does
not divide; the interleaved pipeline's micro-batch counts), a feature that needs Transformer
Engine, a TST setting, a CPU limit, a HybridModel flag given to the GPT launcher, a deprecated
flag Megatron-LM 0.19 would ignore and one on which its ``validate_args`` exits with status 0.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest

from tests.distributed.harness import run_distributed
from tests.launcher import BASE, ROOT
from tests.ports import free_port

#: name: (flags added to tests.launcher.BASE, a fragment of the one error line)
CASES = {
    "parser": (["--tst-bag-sise", "2"], "unrecognized arguments: --tst-bag-sise 2"),
    "validate_args": (["--micro-batch-size", "3"], "must be divisible by"),
    "TransformerConfig heads": (
        ["--hidden-size", "48", "--num-attention-heads", "3", "--tensor-model-parallel-size", "2"],
        "num_attention_heads (3) must be a multiple of tensor_model_parallel_size (2)",
    ),
    "TransformerConfig MoE bias": (
        ["--num-experts", "4", "--expert-tensor-parallel-size", "2"]
        + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "Bias in Moe is only supported when ETP==1",
    ),
    "sequence parallel length": (
        ["--seq-length", "7", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "--seq-length 7 with --sequence-parallel",
    ),
    "interleaved micro-batches": (
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]
        + ["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6"],
        "the interleaved pipeline (PP 2, 2 virtual stages) with global batch 6 = 3 micro-batches",
    ),
    "no Transformer Engine": (
        ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
        "--recompute-modules layernorm needs Transformer Engine",
    ),
    "model rule": (["--num-experts", "2", "--moe-router-topk", "4"], "--moe-router-topk 4 is more"),
    "TST setting": (["--reset-position-ids"], "--reset-position-ids is not supported"),
    "CPU limit": (["--bf16"], "--bf16 needs CUDA"),
    "HybridModel flag": (
        ["--hybrid-layer-pattern", "M*M*", "--mamba-num-heads", "4"],
        "--hybrid-layer-pattern, --mamba-num-heads: a HybridModel flag",
    ),
    "ignored deprecated flag": (
        ["--rampup-batch-size", "2", "2", "8"],
        "--rampup-batch-size is ignored by Megatron-LM 0.19 (deprecated; the run would train at "
        "--global-batch-size 4 from the first step): give the ramp as --step-batch-size-schedule",
    ),
    "validate_args exits": (["--checkpoint-activations"], "use --recompute-activations"),
}


def _launch_and_dry_run_child(rank, world, *, cases):
    """For each case: the launcher's ``main`` (the real launch, in this process) and, on rank
    0, its dry run; return ``{name: (status, stdout, stderr, dry-run error lines)}``."""
    from tst_megatron.training.cli import main
    from tst_megatron.training.dry_run import dry_run

    results = {}
    for name, argv in cases.items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(argv)
                status = 0
            except SystemExit as exc:
                status = exc.code
        dry_err = io.StringIO()
        if rank == 0:
            dry_run([*argv, "--dry-run"], out=io.StringIO(), err=dry_err)
        dry_lines = [line for line in dry_err.getvalue().splitlines() if line.startswith("error:")]
        results[name] = (status, out.getvalue(), err.getvalue(), dry_lines)
    return results


@pytest.mark.slow
def test_every_class_of_problem_stops_a_real_launch_in_one_line():
    cases = {name: BASE + extra for name, (extra, _) in CASES.items()}
    rank0, rank1 = run_distributed(_launch_and_dry_run_child, world_size=2, cases=cases)
    for name, (_, fragment) in CASES.items():
        status, out, err, dry_lines = rank0[name]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 2, (name, err[-2000:])
        assert len(errors) == 1 and fragment in errors[0], (name, err[-2000:])
        assert errors == dry_lines, (name, errors, dry_lines)  # the dry run's line
        for text in (out, err):
            assert "Traceback" not in text and "usage:" not in text, (name, text[-2000:])
        # refused before pretrain(): no model, no data
        assert "building GPT model" not in out and "> building train" not in out, name
        status1, out1, err1, _ = rank1[name]
        assert status1 == 2 and "error:" not in err1 + out1, (name, err1[-2000:])


@pytest.mark.slow
def test_a_missing_or_truncated_data_file_stops_a_launch_before_the_model(tmp_path):
    """A launch checks that each --data-path prefix's .bin and .idx exist and agree before
    any work (one line, rank 0 prints, status 2 everywhere); the dry run, which may run where
    the data is not, checks the files that are here (the truncated ones) and names those
    that are not in an ``assumed:`` line (``tests/unit/test_dry_run.py``)."""
    real = tmp_path / "real"
    real.with_suffix(".bin").write_bytes(b"")
    real.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00")  # a header cut short
    base = [w for w in BASE if w != "--mock-data"]
    cases = {
        "missing": base + ["--data-path", str(tmp_path / "nowhere")],
        "truncated": base + ["--data-path", "0.5", str(real), "0.5", str(real)],
    }
    rank0, rank1 = run_distributed(_launch_and_dry_run_child, world_size=2, cases=cases)
    expected = {
        "missing": f"error: --data-path: {tmp_path / 'nowhere'}.bin does not exist",
        "truncated": f"error: --data-path: {real}.idx is not a Megatron index file",
    }
    for name, line in expected.items():
        status, out, err, dry_lines = rank0[name]
        errors = [x for x in err.splitlines() if x.startswith("error:")]
        assert status == 2 and len(errors) == 2 - (name == "missing"), (name, err[-2000:])
        assert all(e.startswith(line) for e in errors), (name, errors)
        assert "Traceback" not in out + err and "building GPT model" not in out, name
        if name == "missing":
            assert dry_lines == [], (name, dry_lines)
        else:
            assert dry_lines and all(d.startswith(line) for d in dry_lines), (name, dry_lines)
        status1, out1, err1, _ = rank1[name]
        assert status1 == 2 and "error:" not in err1 + out1, (name, err1[-2000:])


def _torchrun(tmp_path, *flags):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    script = os.path.join(ROOT, "examples", "pretrain_gpt_tst.py")
    return subprocess.run(
        [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), script, *flags],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        cwd=tmp_path,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["parser", "TransformerConfig heads"])
def test_a_torchrun_launch_prints_exactly_one_error_line(tmp_path, case):
    """The reported launches, through torchrun: a misspelled flag printed argparse's usage
    block from each rank; heads TP does not divide gave a traceback from each rank."""
    extra, fragment = CASES[case]
    done = _torchrun(tmp_path, *BASE, *extra)
    text = done.stdout + done.stderr
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert done.returncode != 0
    assert len(errors) == 1 and fragment in errors[0], text[-3000:]
    assert "usage:" not in text, text[-3000:]
    # torchrun's own failure report names the exit code of each rank; no Python exception
    assert "Traceback" not in done.stdout and "Error:" not in done.stdout, done.stdout[-2000:]
    assert "exitcode  : 2" in done.stderr or "exit code: 2" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_a_plain_python_launch_trains_as_a_world_of_one_and_a_lone_world_size_is_refused(
    tmp_path,
):
    """``python examples/pretrain_gpt_tst.py ...`` without torchrun or srun: Megatron-LM alone
    stops with a traceback (MASTER_ADDR not set); the launcher runs it as rank 0 of 1."""
    script = os.path.join(ROOT, "examples", "pretrain_gpt_tst.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    done = subprocess.run(
        [sys.executable, script, *BASE, "--train-iters", "2", "--tst-phase1-iters", "1"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": ROOT},
        cwd=tmp_path,
        timeout=300,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "Traceback" not in text and " iteration        2/       2 |" in text, text[-3000:]
    # WORLD_SIZE without RANK: the checks would see a world of 2 while the process trains alone
    done = subprocess.run(
        [sys.executable, script, *BASE],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": ROOT, "WORLD_SIZE": "2"},
        cwd=tmp_path,
        timeout=300,
    )
    text = done.stdout + done.stderr
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and "Traceback" not in text, text[-3000:]
    # megatron-core's import-time notices of missing TE/Apex are hidden by the entry point
    assert "UserWarning" not in text, text[-3000:]
    assert errors == [
        "error: WORLD_SIZE=2 is set but RANK is not: start the 2 processes with torchrun (or "
        "srun), which gives each its rank, or unset WORLD_SIZE for one process"
    ], text[-3000:]
