"""``--dry-run`` of the Megatron-LM launcher (:mod:`tst_megatron.training.dry_run`): Megatron-LM's
validation as one ``error:`` line, the TST checks, and parameter counts that equal those of the
model the launcher builds."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("megatron.training")

from tests.launcher import MTP  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: A small valid launch line on mock data (no file is read by a dry run).
SMALL = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10",
    "--lr", "1e-3", "--eval-interval", "5", "--tst-bag-size", "2",
]  # fmt: skip


def dry(argv, env=None, model="gpt"):
    """``dry_run(argv + --dry-run)`` in this process with ``env`` over a clean environment
    (no RANK/WORLD_SIZE/CUDA_DEVICE_MAX_CONNECTIONS), for the launcher of ``model`` (``"gpt"``
    or ``"hybrid"``): ``(returncode, stdout, stderr)``."""
    from tst_megatron.models.family import FAMILIES
    from tst_megatron.training.dry_run import dry_run

    drop = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "CUDA_DEVICE_MAX_CONNECTIONS")
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {**environ, **(env or {})}, clear=True):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = dry_run([*argv, "--dry-run"], family=FAMILIES[model])
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def _errors(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_a_valid_line_prints_layout_model_and_plan():
    r = dry(
        SMALL + ["--tensor-model-parallel-size", "2"],
        env={"WORLD_SIZE": "8", "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "layout: world 8 = TP 2 x CP 1 x PP 1 x DP 4; VPP 1; EP 1, ETP 2" in out
    assert "global batch 8 = micro-batch 2 x DP 4 x 1 micro-batches per step" in out
    # 10 iterations, N1 = round(0.3 * 10) = 3; the switch after 3 global batches of 8
    assert "N1 = 3 of 10 iterations; switch at sample 24;" in out
    assert "phase 1: samples of 32 + 1 tokens, 16 positions; phase 2: samples of 16 + 1" in out
    assert "padded vocabulary 256" in out  # 128 rounded up to 128 x TP 2
    assert "Total number of parameters in billions:" in out  # Megatron-LM's count
    assert out.rstrip().endswith("dry run: no problems found")
    assert r.stderr == ""


def test_the_cpu_flags_are_not_added_unless_the_run_is_a_cpu_run():
    auto = dry(SMALL)
    cpu = dry(SMALL + ["--device", "cpu"])
    assert auto.returncode == cpu.returncode == 0, auto.stderr + cpu.stderr
    assert "checked as a CUDA run" in auto.stdout and ", transformer_engine," in auto.stdout
    assert "checked as a CPU run" in cpu.stdout and ", local," in cpu.stdout


@pytest.mark.parametrize(
    "extra,world,expected",
    [
        # validate_args: a world size TP x PP does not divide
        (["--pipeline-model-parallel-size", "2"], "3", "world size (3) is not divisible by"),
        # validate_args' bare `assert args.hidden_size % args.num_attention_heads == 0`
        (["--num-attention-heads", "5"], "1", "hidden_size % args.num_attention_heads == 0"),
        # parse_and_validate_args' own --use-checkpoint-args rule (it asserts before validating)
        (
            ["--use-checkpoint-args", "--load", "/nowhere", "--non-persistent-ckpt-type", "local"],
            "1",
            "--use-checkpoint-args is not supported with --non_persistent_ckpt_type=local",
        ),
    ],
)
def test_an_assertion_in_megatron_validate_args_is_one_error_line(extra, world, expected):
    r = dry(SMALL + extra, env={"WORLD_SIZE": world})
    assert r.returncode == 2
    (line,) = _errors(r.stderr)
    assert line.startswith("error: Megatron-LM's argument validation: ") and expected in line
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_a_tp_size_that_does_not_divide_the_heads_is_one_error_line():
    # validate_args lets it through; megatron-core's TransformerConfig refuses it
    r = dry(
        SMALL + ["--tensor-model-parallel-size", "3"],
        env={"WORLD_SIZE": "3", "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    )
    assert r.returncode == 2
    (line,) = _errors(r.stderr)
    assert line.startswith("error: Megatron-LM's TransformerConfig: "), line
    assert "num_attention_heads (4) must be a multiple of tensor_model_parallel_size (3)" in line
    assert "Traceback" not in r.stderr


def test_tp_on_an_h100_without_cuda_device_max_connections_is_megatron_lm_s_error():
    # no GPU here: validate_args is answered as for an H100, which asserts the variable with TP
    bad = dry(SMALL + ["--tensor-model-parallel-size", "2"], env={"WORLD_SIZE": "2"})
    assert bad.returncode == 2
    (line,) = _errors(bad.stderr)
    assert "CUDA_DEVICE_MAX_CONNECTIONS to 1" in line
    good = dry(
        SMALL + ["--tensor-model-parallel-size", "2"],
        env={"WORLD_SIZE": "2", "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    )
    assert good.returncode == 0, good.stderr
    # the stand-in was scoped to the call: the modules see torch again
    import megatron.training.arguments as arguments
    import megatron.training.utils.common_utils as common_utils

    assert arguments.torch is torch and common_utils.torch is torch
    import megatron.core.transformer.transformer_config as transformer_config

    for module in (arguments, transformer_config):
        assert module.is_te_min_version.__module__ == "megatron.core.utils"


def test_the_dry_run_checks_the_line_for_the_gpu_it_names():
    """``--dry-run-gpu``: Megatron-LM's rules by architecture apply as for that GPU (a GB200
    line with ``CUDA_DEVICE_MAX_CONNECTIONS=32`` and TP, as NVIDIA's Nemotron 3 Super release
    script sets it, is refused as for an H100 and passes as for a GB200); the ``assumed:``
    line names the GPU."""
    tp = SMALL + ["--tensor-model-parallel-size", "2"]
    env = {"WORLD_SIZE": "2", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    h100 = dry(tp, env=env)
    assert h100.returncode == 2 and "CUDA_DEVICE_MAX_CONNECTIONS to 1" in h100.stderr
    assert "validated as for the H100 (compute capability 9.0)" in h100.stdout + h100.stderr
    gb200 = dry(tp + ["--dry-run-gpu", "GB200"], env=env)
    assert gb200.returncode == 0, gb200.stderr
    text = gb200.stdout + gb200.stderr
    assert "--dry-run-gpu: validated as for the GB200 (compute capability 10.0)" in text
    bad = dry(tp + ["--dry-run-gpu", "X100"], env=env)
    assert bad.returncode == 2 and "--dry-run-gpu" in bad.stderr
    # a launch (not a dry run) does not honour it: one line
    from tst_megatron.training.checks import hardware

    args = SimpleNamespace(dry_run_gpu="GB200", wandb_project=None)
    launch = SimpleNamespace(args=args, device="cuda", launch=True, argv=(), pattern=None)
    with mock.patch.object(hardware, "without_te_problems", lambda *a, **k: []):
        lines = hardware.problems(launch)
    assert [line for line in lines if line.startswith("--dry-run-gpu GB200 names the GPU")]


def test_gated_delta_net_layers_are_named_and_not_counted_and_refused_on_a_cpu():
    """A Qwen3-Next-style GPT line (``--experimental-attention-variant gated_delta_net``): the
    model line names its GDN layers (megatron-core's pattern: every 4th layer standard), the
    parameters are "not counted" (Megatron-LM's arithmetic would count them as attention),
    and a CPU run (``fla``'s Triton kernels) is one line."""
    gdn = _without(SMALL, "--num-layers") + ["--num-layers", "8", "--bf16"]
    gdn += ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4"]
    r = dry(gdn + ["--device", "cuda"])
    assert r.returncode == 0, r.stderr
    assert "gated delta net in 6 of 8 layers (the rest standard)" in r.stdout
    assert "parameters: not counted" in r.stdout and "parameters (Megatron-LM)" not in r.stdout
    cpu = dry([a for a in gdn if a != "--bf16"] + ["--device", "cpu"])
    assert cpu.returncode == 2 and "fla package's Triton kernels, a GPU" in cpu.stderr
    # a GPU launch (not a dry run) where fla is not installed (as here): one line
    from tst_megatron.training.checks.model import gated_delta_net_problems

    args = SimpleNamespace(experimental_attention_variant="gated_delta_net")
    (line,) = gated_delta_net_problems(args, "cuda", launch=True)
    assert "need the fla package (flash-linear-attention)" in line
    assert gated_delta_net_problems(args, "cuda", launch=False) == []  # the cluster's


def test_the_dry_run_checks_the_data_files_that_are_here_and_names_those_that_are_not(tmp_path):
    real = tmp_path / "real"
    real.with_suffix(".bin").write_bytes(b"")
    real.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00")  # a header cut short
    data = [a for a in SMALL if a != "--mock-data"] + ["--split", "100,0,0"]
    cut = dry(data + ["--data-path", str(real), "--device", "cpu"])
    assert cut.returncode == 2 and f"{real}.idx is not a Megatron index file" in cut.stderr
    away = dry(data + ["--data-path", str(tmp_path / "cluster"), "--device", "cpu"])
    assert away.returncode == 0, away.stderr
    text = away.stdout + away.stderr
    assert (
        f"not here, so not checked: {tmp_path / 'cluster'}.bin, {tmp_path / 'cluster'}.idx" in text
    )


def test_the_readme_and_the_help_name_every_check_the_dry_run_skips():
    """``DRY_RUN_SKIPS`` is the one list: a skipped check added there fails here until the
    README's dry-run paragraph and ``--help`` say so."""
    import argparse

    from tst_megatron.training.assumed import DRY_RUN_SKIPS
    from tst_megatron.training.flags import add_tst_args

    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    parser = add_tst_args(argparse.ArgumentParser())
    (action,) = [a for a in parser._actions if "--dry-run" in a.option_strings]
    assert "runs exactly the checks a launch runs" not in readme
    for words in DRY_RUN_SKIPS.values():
        assert words in readme, words
        assert words in action.help, words


def test_an_unknown_flag_is_one_error_line():
    r = dry(SMALL + ["--no-such-flag"])
    assert r.returncode == 2
    assert _errors(r.stderr) == [
        "error: Megatron-LM's argument parser: unrecognized arguments: --no-such-flag"
    ]


def test_tst_problems_are_reported_one_line_each():
    r = dry(SMALL + ["--reset-position-ids", "--dataloader-type", "cyclic"])
    assert r.returncode == 2
    errors = _errors(r.stderr)
    assert len(errors) == 2, r.stderr
    assert errors[0].startswith("error: --reset-position-ids is not supported in TST phase 1")
    assert errors[1].startswith("error: --dataloader-type cyclic is not supported with TST")


def test_every_problem_is_reported_at_once():
    """The launcher's own checks after Megatron-LM's validation passed: every problem found,
    one line each naming the flag, in one run (Megatron-LM's late refusals, then TST's)."""
    r = dry(
        SMALL
        + ["--reset-position-ids", "--reset-attention-mask", "--dataloader-type", "cyclic"]
        + ["--lr-decay-style", "WSD"]
    )
    assert r.returncode == 2
    errors = _errors(r.stderr)
    expected = [
        "error: --lr-decay-style WSD needs --lr-wsd-decay-iters",
        "error: --reset-position-ids is not supported in TST phase 1",
        "error: --reset-attention-mask is not supported in TST phase 1",
        "error: --dataloader-type cyclic is not supported with TST",
    ]
    assert len(errors) == len(expected), r.stderr
    for line, want in zip(errors, expected):
        assert line.startswith(want), (line, want)
    assert "dry run: 4 problem(s) for world size 1" in r.stderr and r.stdout == ""


def test_output_mode_reads_t_token_samples_in_phase_1():
    """--tst-mode output feeds single tokens and predicts the next S: phase 1 reads T-token
    samples, as the baseline does, not S*T."""
    r = dry(SMALL + ["--tst-mode", "output"])
    assert r.returncode == 0, r.stderr
    assert "mode output" in r.stdout
    assert "phase 1: samples of 16 + 1 tokens, 16 positions" in r.stdout


def test_a_bad_batch_size_schedule_is_megatron_lm_s_error():
    # the schedule's batch 12 is not a multiple of micro-batch 2 x DP 4
    argv = [a for a in SMALL if a not in ("--global-batch-size", "8")]
    r = dry(argv + ["--step-batch-size-schedule", "0:8 64:12"], env={"WORLD_SIZE": "4"})
    assert r.returncode == 2
    assert _errors(r.stderr) == [
        "error: --step-batch-size-schedule: global batch 12 (from sample 4) is not divisible "
        "by --micro-batch-size 2 x data-parallel size 4; Megatron-LM asserts it when the run "
        "gets there"
    ]
    # Megatron-LM's calculator refuses a schedule that does not start at 0
    r = dry(argv + ["--step-batch-size-schedule", "16:8"], env={"WORLD_SIZE": "4"})
    assert r.returncode == 2
    (line,) = _errors(r.stderr)
    assert line.startswith("error: Megatron-LM's batch-size schedule: first schedule entry")


def test_only_rank_0_prints():
    r = dry(SMALL + ["--reset-position-ids"], env={"RANK": "1"})
    assert r.returncode == 2 and r.stdout == r.stderr == ""


@pytest.mark.slow
def test_entry_point_dry_run_exits_2_with_one_error_line_and_no_traceback():
    """The example entry point, as a user runs it: an assertion inside Megatron-LM's
    validate_args (4 heads do not divide hidden size 30) is one line on stderr, status 2."""
    env = dict(os.environ, PYTHONPATH=ROOT, WORLD_SIZE="1", RANK="0")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt_tst.py"), *SMALL,
         "--hidden-size", "30", "--dry-run"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    errors = _errors(result.stderr)
    assert len(errors) == 1 and "Megatron-LM's argument validation:" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert "dry run:" not in result.stdout


# --- parameter counts: Megatron-LM's compute_weight_and_optimizer_memory -------------------


def _billions(out: str, what: str) -> float:
    line = next(x for x in out.splitlines() if f"{what} in billions:" in x)
    return float(line.rsplit(":", 1)[1])


def test_the_parameter_count_is_megatron_lm_s_and_follows_the_flags():
    """The dry run prints Megatron-LM's count; more experts add exactly their weights: per MoE
    layer, 8 more SwiGLU experts of 3 x h x f (counted here plainly)."""
    big = SMALL + [
        "--hidden-size", "2048", "--num-attention-heads", "16", "--num-layers", "8",
        "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
        "--moe-ffn-hidden-size", "4096", "--moe-router-topk", "2",
    ]  # fmt: skip
    outs = {}
    for experts in (8, 16):
        r = dry(big + ["--num-experts", str(experts)])
        assert r.returncode == 0, r.stderr
        outs[experts] = r.stdout
    assert "parameters (Megatron-LM): padded vocabulary 128" in outs[8]
    added = 8 * (8 * 3 * 2048 * 4096 + 8 * 2048)  # layers x (experts x SwiGLU + router rows)
    got = (
        _billions(outs[16], "Total number of parameters")
        - _billions(outs[8], "Total number of parameters")
    ) * 1e9
    assert abs(got - added) <= 0.01e9, (got, added)
    # active parameters do not grow with the experts (top-2 both times), but for the router
    active = _billions(outs[16], "Total number of active parameters") - _billions(
        outs[8], "Total number of active parameters"
    )
    assert abs(active) <= 0.01
    assert "memory (Megatron-LM): weights and optimizer state on the most loaded rank" in outs[8]


@pytest.mark.parametrize(
    "extra,device,world,expected",
    [
        (["--full-validation"], "auto", "1", "--full-validation stops Megatron-LM 0.19"),
        (["--eval-interval", None], "auto", "1", "--eval-interval is required"),
        (["--bf16"], "cpu", "1", "--bf16 needs CUDA"),
        (["--log-memory-to-tensorboard"], "cpu", "1", "--log-memory-to-tensorboard reads CUDA"),
        (["--record-memory-history"], "cpu", "1", "--record-memory-history records CUDA's"),
        # features of pretrain_gpt.py's forward step the launcher's does not have
        (["--inprocess-restart"], "auto", "1", "--inprocess-restart is not supported by"),
        (
            ["--hybrid-context-parallel", "--calculate-per-token-loss"],
            "auto",
            "1",
            "--hybrid-context-parallel is not supported by this launcher",
        ),
        (
            ["--pipeline-model-parallel-size", "2"],
            "cpu",
            "2",
            "--pipeline-model-parallel-size > 1 on a CPU needs --untie-embeddings",
        ),
        (  # tied embeddings too: both lines, not only the first
            ["--pipeline-model-parallel-size", "2"] + MTP,
            "cpu",
            "2",
            "--mtp-num-layers with --pipeline-model-parallel-size > 1 needs CUDA",
        ),
        # a CPU run appends --transformer-impl local --distributed-backend gloo: a user's
        # other choice is refused, not overridden
        (["--transformer-impl", "transformer_engine"], "cpu", "1", "--transformer-impl trans"),
        (["--distributed-backend", "nccl"], "cpu", "1", "--distributed-backend nccl needs CUDA"),
        (["--yaml-cfg", "c.yaml"], "auto", "1", "--yaml-cfg is not supported"),
        # pretrain_hybrid.py's flags: a GPTModel would ignore them (with --num-layers 2 and this
        # pattern, Megatron-LM's validate_args alone makes the model 4 dense layers)
        (["--hybrid-layer-pattern", "M*M*"], "auto", "1", "--hybrid-layer-pattern: a HybridMod"),
        (["--hybrid-override-pattern=*-*-"], "auto", "1", "--hybrid-override-pattern: a Hybri"),
        (["--mamba-num-heads", "4"], "cpu", "1", "--mamba-num-heads: a HybridModel flag"),
        (["--is-hybrid-model"], "auto", "1", "--is-hybrid-model: a HybridModel flag"),
        # each seen as a traceback in a real 1-process CPU launch (megatron-core 0.19.2)
        (["--num-workers", "-1"], "cpu", "1", "--num-workers must be 0 or more (got -1)"),
        (
            ["--group-query-attention", "--num-query-groups", "3"],
            "cpu",
            "1",
            "--num-attention-heads 4 is not divisible by --num-query-groups 3",
        ),
        (
            ["--num-experts", "4", "--moe-shared-expert-intermediate-size", "64"],
            "cpu",
            "1",
            "shared experts have no biases; add --disable-bias-linear",
        ),
        (["--profile"], "cpu", "1", "--profile starts CUDA's profiler"),
        (
            ["--use-distributed-optimizer", "--ckpt-format", "torch"],
            "cpu",
            "1",
            "--use-distributed-optimizer with --ckpt-format torch cannot resume",
        ),
        (
            ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"],
            "cpu",
            "1",
            "--dist-ckpt-optim-fully-reshardable needs CUDA",
        ),
        (["--wandb-project", "p"], "auto", "1", "--wandb-project needs --wandb-exp-name"),
        # CUDA graphs: none on a CPU (a traceback in the RNG tracker at start-up); a
        # full-iteration graph would replay a phase-1 step after the switch (also its
        # deprecated spelling, --cuda-graph-scope full_iteration)
        (["--cuda-graph-impl", "local"], "cpu", "1", "--cuda-graph-impl local captures CUDA"),
        (
            [
                "--bf16",
                "--no-check-for-nan-in-loss-and-grad",
                "--cuda-graph-impl",
                "full_iteration",
            ],
            "auto",
            "1",
            "--cuda-graph-impl full_iteration is not supported with a TST phase 1",
        ),
        (
            ["--bf16", "--no-check-for-nan-in-loss-and-grad", "--cuda-graph-impl", "local"]
            + ["--cuda-graph-scope", "full_iteration"],
            "auto",
            "1",
            "--cuda-graph-impl full_iteration is not supported with a TST phase 1",
        ),
    ],
)
def test_settings_megatron_lm_accepts_but_cannot_run_are_one_error_line(
    extra, device, world, expected
):
    """Each stops ``pretrain()`` with a traceback after set-up (Megatron-LM 0.19's own bugs, or
    CUDA-only code on a CPU): the launcher names the flag before any work."""
    argv = list(SMALL)
    if extra[-1] is None:  # drop the flag
        i = argv.index(extra[0])
        del argv[i : i + 2]
    else:
        argv += extra
    r = dry(argv + ["--device", device], env={"WORLD_SIZE": world})
    assert r.returncode == 2
    assert [e for e in _errors(r.stderr + r.stdout) if expected in e], r.stderr + r.stdout
    ok = dry(SMALL + ["--device", device], env={"WORLD_SIZE": world})
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--train-data-path", "t"], "--train-data-path is not supported"),
        (["--valid-data-path", "v"], "--valid-data-path is not supported"),
        (["--per-split-data-args-path", "s.json"], "--per-split-data-args-path is not"),
        (["--data-args-path", "/nonexistent/args"], "/nonexistent/args: no readable file"),
        (["--data-args-path", "/"], "--data-args-path /: no readable file"),  # a directory
        (["--data-args-path", "EMPTY", "--split", "98,2,0"], "is empty"),
        (["--data-args-path", "BINARY", "--split", "98,2,0"], "is not a text file ("),
        (["--data-args-path", __file__], "--data-args-path needs --split"),
        (["--sft"], "--sft is not supported by this launcher: TST trains on"),
        (["--multiple-validation-sets"], "--multiple-validation-sets is not supported"),
        (["--fim-data"], "--fim-data is not supported"),
        (["--object-storage-cache-path", "c"], "--object-storage-cache-path is not supported"),
        (["--dataloader-inter-document-masking"], "--dataloader-inter-document-masking is not"),
        (["--per-dataset-sequences-path", "s.json"], "--per-dataset-sequences-path is not"),
        (["--dataloader-fast-cache-load"], "--dataloader-fast-cache-load is not supported"),
        (["--dataloader-defer-npy-index-mmap"], "--dataloader-defer-npy-index-mmap is not"),
    ],
)
def test_data_flags_the_launcher_cannot_honour_are_refused_not_run_on_mock_data(
    extra, expected, tmp_path
):
    """The datasets provider reads one blend (``--data-path`` or ``--data-args-path``) with
    ``--split``; Megatron-LM accepts per-split paths alone, and the run would have trained on
    mock data. Refused in a baseline run (``--tst-bag-size 1``) as in a TST one."""
    (tmp_path / "empty").write_text(" \n")
    (tmp_path / "binary").write_bytes(bytes([0xCD, 0xFF, 0x00, 0x81]))
    files = {"EMPTY": str(tmp_path / "empty"), "BINARY": str(tmp_path / "binary")}
    extra = [files.get(word, word) for word in extra]
    argv = [a for a in SMALL if a != "--mock-data"] + extra
    for bag in ("1", "2"):
        r = dry(argv + ["--tst-bag-size", bag, "--device", "cpu"])
        assert r.returncode == 2
        assert [e for e in _errors(r.stderr + r.stdout) if expected in e], r.stderr + r.stdout


def test_per_layer_cuda_graphs_and_full_iteration_graphs_without_a_phase_1_pass():
    graphs = ["--bf16", "--no-check-for-nan-in-loss-and-grad", "--device", "auto"]
    assert dry(SMALL + graphs + ["--cuda-graph-impl", "local"]).returncode == 0
    baseline = [a if a != "2" or SMALL[i - 1] != "--tst-bag-size" else "1"
                for i, a in enumerate(SMALL)]  # fmt: skip
    r = dry(baseline + graphs + ["--cuda-graph-impl", "full_iteration"])
    assert r.returncode == 0, r.stderr


def test_a_cpu_run_with_tp_needs_no_cuda_device_max_connections():
    """A CPU run sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` itself, so its dry run does not ask for
    it (a CUDA run on an H100 does: Megatron-LM's own assertion)."""
    tp2 = SMALL + ["--tensor-model-parallel-size", "2"]
    r = dry(tp2 + ["--device", "cpu"], env={"WORLD_SIZE": "2"})
    assert r.returncode == 0, r.stderr
    cuda = dry(tp2 + ["--device", "cuda"], env={"WORLD_SIZE": "2"})
    assert cuda.returncode == 2 and "CUDA_DEVICE_MAX_CONNECTIONS" in cuda.stderr + cuda.stdout


def test_a_cuda_run_without_te_apex_or_grouped_gemm_is_told_which_flag_avoids_each():
    """Megatron-LM's defaults (the TE spec, gradient accumulation fusion) fail after set-up
    where Transformer Engine or Apex is missing (the lent H200 has neither): one line each,
    naming the flag; the CPU flags (local spec, no fusion) avoid them all."""
    from tst_megatron.training.argv import CPU_FLAGS
    from tst_megatron.training.checks.hardware import without_te_problems
    from tst_megatron.training.validate import _parse

    args = _parse(SMALL + ["--moe-grouped-gemm", "--transformer-impl", "local"])
    problems = without_te_problems(args, te=False, apex=False, grouped_gemm=False)
    assert len(problems) == 2, problems
    assert "add --no-gradient-accumulation-fusion" in problems[0]
    assert problems[1].startswith("--moe-grouped-gemm on the local spec needs the grouped_gemm")
    default = _parse(SMALL)
    assert without_te_problems(default, te=False, apex=True)[0].startswith(
        "--transformer-impl transformer_engine (Megatron-LM's default) needs Transformer Engine"
    )
    assert without_te_problems(default, te=True, apex=True) == []
    assert without_te_problems(_parse(SMALL + list(CPU_FLAGS)), te=False, apex=False) == []


def test_mtp_with_a_fused_adam_is_noted_and_with_torch_adamw_is_not():
    """A fused Adam (Transformer Engine's or Apex's) is not made to start the MTP parameters
    afresh at the switch: the launch says so; torch's AdamW (this machine) is, and nothing is
    said. No note without MTP or without a phase 1."""
    from tst_megatron.training.checks import hardware
    from tst_megatron.training.validate import check

    mtp = SMALL + MTP

    def notes(argv, fused):
        with mock.patch.object(hardware, "_group_step_adam", return_value=fused):
            return [n for n in check(argv, dry_run=True).notes if "--mtp-num-layers" in n]

    assert len(notes(mtp, fused=True)) == 1
    assert "without Adam's bias correction" in notes(mtp, fused=True)[0]
    assert notes(mtp, fused=False) == []
    assert notes(SMALL, fused=True) == []
    assert notes(mtp + ["--tst-phase1-iters", "0"], fused=True) == []
    assert hardware._group_step_adam() is False  # no TE, no Apex here: torch's AdamW


def test_a_moe_layer_pattern_of_another_length_is_one_error_line():
    """``--moe-layer-freq`` as a list of another length than ``--num-layers``: megatron-core
    asserts it only while building the model (``get_moe_layer_pattern``)."""
    moe = SMALL + ["--num-experts", "4", "--disable-bias-linear"]
    r = dry(moe + ["--moe-layer-freq", "([1]*3)"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert _errors(r.stderr) == [
        "error: --moe-layer-freq gives a pattern of 3 layers for --num-layers 2: give one 0/1 "
        "entry per layer"
    ]
    ok = dry(moe + ["--moe-layer-freq", "([1,0])"])
    assert ok.returncode == 0, ok.stderr
    assert "MoE 1 of 2 layers" in ok.stdout


def test_the_tokenizer_type_defaults_to_pretrain_gpt_s():
    """Without ``--tokenizer-type`` the launch validates as Megatron-LM's ``pretrain_gpt.py``
    does (its ``args_defaults``): ``GPT2BPETokenizer``, for ``--vocab-file``/``--merge-file``."""
    from tst_megatron.training.validate import check

    argv = [w for w in SMALL if w not in ("--tokenizer-type", "NullTokenizer")]
    argv += ["--vocab-file", "vocab.json", "--merge-file", "merges.txt"]
    checked = check(argv, dry_run=True)
    assert checked.problems == [] and checked.args.tokenizer_type == "GPT2BPETokenizer"
    given = check(SMALL, dry_run=True)  # a given type is kept
    assert given.problems == [] and given.args.tokenizer_type == "NullTokenizer"


def test_phase_1_flags_without_a_bag_size_and_a_phase_1_filling_the_run_are_noted():
    """Valid but likely mistaken settings print a ``note:`` (the run is checked as usual)."""
    assert SMALL[-2:] == ["--tst-bag-size", "2"]
    plain = SMALL[:-2]
    r = dry(plain + ["--tst-phase1-iters", "4"])
    assert r.returncode == 0, r.stderr
    assert "note: --tst-phase1-iters without --tst-bag-size > 1: no phase 1" in r.stdout
    r = dry(SMALL + ["--tst-phase1-fraction", "1"])
    assert r.returncode == 0, r.stderr
    assert "note: phase 1 fills all 10 iterations: this run trains no next-token" in r.stdout
    quiet = dry(SMALL)
    assert "phase1" not in quiet.stdout and "phase 1 fills" not in quiet.stdout


def _without(argv, flag):
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :]


#: SMALL as a HybridModel line: attention and MoE layers by pattern, on a CPU.
HYBRID = _without(_without(SMALL, "--num-layers"), "--tst-bag-size") + [
    "--device", "cpu", "--hybrid-layer-pattern", "*E*E", "--num-experts", "4",
    "--moe-router-topk", "2", "--disable-bias-linear", "--tst-bag-size", "2",
]  # fmt: skip


@pytest.mark.parametrize(
    "change, expected",
    [
        (("--hybrid-layer-pattern", None), "a HybridModel needs --hybrid-layer-pattern"),
        (("--num-experts", None), "has MoE layers (E): give --num-experts"),
        (("--hybrid-layer-pattern", "M*E*"), "Mamba-2 layers (M) need the mamba_ssm package"),
        (("--hybrid-layer-pattern", "G*E*"), "gated delta net layers (G) need the fla package"),
        (("--hybrid-layer-pattern", "D-E-"), "DeepSeek sparse attention layers (D) need"),
        (("--moe-layer-freq", "[1,0,1,0]"), "--moe-layer-freq (a HybridModel places"),
        (("--use-rope-scaling", ""), "--use-rope-scaling (HybridModel takes no RoPE scaling)"),
        (("--mtp-num-layers", "1"), "without an MTP pattern"),
        (("--hybrid-layer-pattern", "*|E|*|E"), "pipeline rank(s) 0 without MoE (E) layers"),
        (("--hybrid-layer-pattern", "**EE"), "give every rank an E layer in its share"),
        (("--hybrid-layer-pattern", "*E*E-"), "5 layers do not split evenly"),
        # megatron-core: "TransformerConfig: ZeroDivisionError: float division by zero"
        (("--hybrid-layer-pattern", ""), "'' is empty"),
        (("--hybrid-layer-pattern", "/"), "'/' holds no layer before its MTP part"),
        (("--hybrid-layer-pattern", "|"), "'|' holds no layer, only pipeline-stage splits"),
        (("--hybrid-layer-pattern", "*E*E/"), "without an MTP pattern"),
        (("--transformer-impl", "inference_optimized"), "--transformer-impl inference_optimized"),
    ],
)
def test_the_hybrid_launcher_refuses_what_its_model_cannot_run_in_one_line(change, expected):
    """``examples/pretrain_hybrid_tst.py``: one line each; the valid line passes."""
    ok = dry(HYBRID, model="hybrid")
    assert ok.returncode == 0, ok.stderr
    assert "model: HybridModel '*E*E': 2 attention (*), 2 MoE (E);" in ok.stdout
    flag, value = change
    argv = list(HYBRID)
    if flag in argv:
        i = argv.index(flag)
        argv[i + 1 : i + 2] = [value] if value is not None else []
        if value is None:
            del argv[i]
            argv += ["--num-layers", "4"] if flag == "--hybrid-layer-pattern" else []
    else:
        argv += [flag] + ([value] if value else [])
    staged = "|" in (value or "") or value in ("**EE", "*E*E-")
    if staged:
        argv += ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]
    if "/" in (value or "") or flag == "--mtp-num-layers":
        argv += ["--position-embedding-type", "rope"]  # Megatron-LM's MTP rule
    if value == "*E*E/":
        argv += ["--mtp-num-layers", "1"]
    if value == "inference_optimized":
        argv += ["--normalization", "RMSNorm", "--moe-router-dtype", "fp32"]  # Megatron-LM's
    env = {"WORLD_SIZE": "2"} if staged else None
    result = dry(argv, env=env, model="hybrid")
    errors = _errors(result.stderr)
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert expected in errors[0], errors[0]


#: The expert-parallel all-to-all overlap as the large-MoE recipes turn it on (EP 2, alltoall).
OVERLAP = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--bf16"]
OVERLAP += ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"]


def test_the_all_to_all_overlap_runs_on_the_gpt_launcher_and_is_refused_on_the_hybrid():
    """The GPT launcher's forward step builds megatron-core's schedule plan in both phases
    (``tests/distributed/test_ep_overlap.py`` runs it); megatron-core 0.19.2's HybridModel
    has none."""
    gpt = dry(SMALL + OVERLAP + ["--device", "cuda"], env={"WORLD_SIZE": "2"})
    assert gpt.returncode == 0, gpt.stderr
    delay = dry(SMALL + OVERLAP + ["--device", "cuda", "--delay-wgrad-compute"],
                env={"WORLD_SIZE": "2"})  # fmt: skip
    assert delay.returncode == 0, delay.stderr
    argv = _without(_without(HYBRID, "--num-experts"), "--device") + OVERLAP + ["--device", "cuda"]
    hybrid = dry(argv, env={"WORLD_SIZE": "2"}, model="hybrid")
    errors = _errors(hybrid.stderr)
    assert hybrid.returncode == 2 and len(errors) == 1, hybrid.stderr
    assert "HybridModel builds no schedule plan" in errors[0]


def test_the_legacy_hybrid_pattern_spellings_get_a_note():
    """``--hybrid-override-pattern`` / ``--mtp-hybrid-override-pattern``: Megatron-LM 0.19
    translates them; a ``note:`` names the new spelling, as for the other translated flags."""
    argv = list(HYBRID)
    argv[argv.index("--hybrid-layer-pattern")] = "--hybrid-override-pattern"
    argv += ["--mtp-hybrid-override-pattern", "*E", "--mtp-num-layers", "1"]
    argv += ["--position-embedding-type", "rope"]
    result = dry(argv, model="hybrid")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if "note:" in line]
    assert any("--hybrid-override-pattern is deprecated" in n and "--hybrid-layer-pattern" in n
               for n in notes), notes  # fmt: skip
    assert any("--mtp-hybrid-override-pattern is deprecated" in n for n in notes), notes
    assert "MTP 1 x '*E'" in result.stdout


def test_a_hybrid_mtp_pattern_is_accepted_with_and_without_a_phase_1():
    for argv in (HYBRID, _without(HYBRID, "--tst-bag-size")):
        argv = argv + ["--position-embedding-type", "rope"]
        argv[argv.index("*E*E")] = "*E*E/*E"
        result = dry(argv, model="hybrid")
        assert result.returncode == 0, result.stderr
        assert "MTP 1 x '*E'" in result.stdout


def test_a_kernel_family_needs_its_package_in_a_gpu_launch():
    """On a GPU a launch (not a dry run) checks that ``mamba_ssm``/``fla`` import."""
    import importlib.util

    from tst_megatron.models.pattern import HybridPattern
    from tst_megatron.training.checks.model import hybrid_package_problems

    args = HybridPattern.parse("M*G*")  # the launch's parsed --hybrid-layer-pattern
    found = hybrid_package_problems(args, "cuda")
    for package in ("mamba_ssm", "fla"):
        missing = importlib.util.find_spec(package) is None
        assert missing == any(f"need the {package} package" in line for line in found)
    assert hybrid_package_problems(args, "cpu") == []  # the CPU rule names them instead


def test_a_cuda_dry_run_assumes_the_cluster_has_the_kernel_packages():
    """A dry run for CUDA does not refuse ``M`` layers whose ``mamba_ssm`` is missing here:
    it says it assumed the cluster has it."""
    import importlib.util

    argv = list(HYBRID)
    argv[argv.index("--device") + 1] = "cuda"
    argv[argv.index("*E*E")] = "M*ME"
    result = dry(argv, model="hybrid")
    assert result.returncode == 0, result.stderr
    assumed = " assumed: mamba_ssm not installed here: assumed installed on the cluster"
    assert (assumed in result.stdout.splitlines()) == (
        importlib.util.find_spec("mamba_ssm") is None
    )


def test_the_stage_layers_of_a_hybrid_pattern_are_megatron_cores():
    from tst_megatron.models.pattern import HybridPattern

    def stage_layers(pattern, pp):
        return HybridPattern.parse(pattern).stage_layers(pp)

    assert stage_layers("*|E|*|E", 2) == ["**", "EE"]  # segment v * pp + r on rank r
    assert stage_layers("*E|*E", 2) == ["*E", "*E"]
    assert stage_layers("M*M*EEEE", 2) == ["M*M*", "EEEE"]  # an even split without '|'
    assert stage_layers("*E*E/*E", 2) == ["*E", "*E"]  # the MTP part is not a stage


@pytest.mark.slow
def test_the_hybrid_launcher_script_checks_and_trains(launcher_env, tmp_path):
    """``examples/pretrain_hybrid_tst.py`` as a user runs it: its dry run describes the
    HybridModel; the same line trains 2 iterations (the switch after 1) and exits 0."""
    from tests.launcher import ROOT

    script = os.path.join(ROOT, "examples", "pretrain_hybrid_tst.py")
    line = HYBRID + ["--num-workers", "0", "--log-interval", "1"]
    line = _without(_without(line, "--train-iters"), "--eval-interval")
    line += ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1"]
    line += ["--tst-phase1-iters", "1"]
    line += ["--num-layers", "8"]  # Megatron-LM ignores it (the pattern has 4): a note

    def run(*extra):
        return subprocess.run(
            [sys.executable, script, *line, *extra],
            capture_output=True, text=True, env=launcher_env, cwd=tmp_path, timeout=600,
        )  # fmt: skip

    checked = run("--dry-run")
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "model: HybridModel '*E*E': 2 attention (*), 2 MoE (E);" in checked.stdout
    ignored = "--num-layers 8 is not used: --hybrid-layer-pattern '*E*E' has 4 layers"
    assert f" note: {ignored}" in checked.stdout
    trained = run()
    assert trained.returncode == 0, trained.stderr[-3000:]
    lines = trained.stdout.splitlines()
    first_step = next(i for i, x in enumerate(lines) if re.search(r"iteration\s+1/", x))
    assert any(x.startswith(f"note: {ignored}") for x in lines[:first_step]), lines[:first_step]
    assert "TST: phase 2 (next-token) from iteration 1 (switch at 1)" in trained.stdout
    assert re.search(r"iteration\s+2/\s+2 \|.*\| lm loss: ", trained.stdout), trained.stdout[-3000:]


@pytest.mark.parametrize(
    "pattern, world, gpt_flags",
    [
        ("*E*E", "1", []),
        ("*E*-*E*-", "1", ["--moe-layer-freq", "([1]+[0])*2"]),
        ("*E|*E", "2", ["--pipeline-model-parallel-size", "2"]),
    ],
)
def test_a_gpt_shaped_hybrid_counts_the_parameters_of_its_gpt(pattern, world, gpt_flags):
    # Megatron-LM's arithmetic covers GPT models: '*X' pairs are counted as the GPT they equal
    wide = ["--hidden-size", "512", "--ffn-hidden-size", "2048", "--num-attention-heads", "8"]
    wide += ["--moe-ffn-hidden-size", "1024"]
    hybrid = _without(HYBRID, "--hybrid-layer-pattern") + wide
    layout = ["--pipeline-model-parallel-size", "2"] if "|" in pattern else []
    hybrid += ["--untie-embeddings-and-output-weights"] if layout else []
    env = {"WORLD_SIZE": world}
    got = dry(hybrid + layout + ["--hybrid-layer-pattern", pattern], env=env, model="hybrid")
    gpt = hybrid + gpt_flags + ["--num-layers", str(len(pattern.replace("|", "")) // 2)]
    want = dry(gpt, env=env)
    assert got.returncode == want.returncode == 0, got.stderr + want.stderr

    def counts(text, prefix):
        return [x.split(prefix, 1)[1] for x in text.splitlines() if prefix in x]

    ours = counts(got.stdout, "parameters (Megatron-LM, as the equivalent GPT):")
    theirs = counts(want.stdout, "parameters (Megatron-LM):")
    assert ours == theirs and len(ours) >= 5, got.stdout
    memory = "memory (Megatron-LM, as the equivalent GPT):"
    assert counts(got.stdout, memory) == counts(want.stdout, "memory (Megatron-LM):")
    assert len(counts(got.stdout, memory)) == 1
    assert any("Total number of parameters in billions: 0.0" in x for x in ours)
    assert not any(x.endswith(": 0.00") for x in ours if "Total number of parameters" in x)


@pytest.mark.parametrize("pattern", ["**EE", "*E*E/*E"])
def test_a_hybrid_that_is_no_gpt_says_its_parameters_are_not_counted(pattern):
    rope = ["--position-embedding-type", "rope"]  # MTP needs it
    result = dry(
        _without(HYBRID, "--hybrid-layer-pattern") + rope + ["--hybrid-layer-pattern", pattern],
        model="hybrid",
    )
    lines = [x for x in result.stdout.splitlines() if "parameters" in x]
    assert len(lines) == 1 and "not counted" in lines[0], result.stdout + result.stderr


def test_flags_megatron_lm_replaces_by_the_hybrid_pattern_are_noted():
    # Megatron-LM 0.19.2's validate_args only warns and takes the pattern's counts
    def notes(extra, pattern="*E*E"):
        argv = HYBRID + ["--position-embedding-type", "rope", "--hybrid-layer-pattern", pattern]
        result = dry(argv + extra, model="hybrid")
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        noted = [x for x in lines if x.startswith(" note: ") and not x.startswith(" note: text:")]
        return noted, result.stdout

    assert notes(["--num-layers", "4"])[0] == []  # the pattern's count: nothing to say
    (line,), _ = notes(["--num-layers=2"])
    assert "--num-layers 2 is not used: --hybrid-layer-pattern '*E*E' has 4 layers" in line
    (line,), out = notes(["--mtp-num-layers", "3"], "*E*E/*E")
    assert "--mtp-num-layers 3 is not used" in line and "has 1 MTP depth(s)" in line
    # the family counts are the main layers'; the MTP part is listed apart
    assert "'*E*E/*E': 2 attention (*), 2 MoE (E); MTP 1 x '*E';" in out
    assert notes(["--mtp-num-layers", "1"], "*E*E/*E")[0] == []


def _hf_tokenizer(folder) -> str:
    """A tiny Hugging Face tokenizer (word level, 4 tokens) saved in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "</s>": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    fast.save_pretrained(str(folder))
    return str(folder)


def test_a_hugging_face_tokenizer_is_loaded_when_here_and_named_when_not(tmp_path):
    """Here: loaded as megatron-core would (local files, no remote code): a folder that does not
    load is one error line. Not here: a hub name is an ``assumed:`` line, a path is among the
    files not checked."""
    pytest.importorskip("transformers")
    hf = _without(SMALL, "--tokenizer-type") + ["--tokenizer-type", "HuggingFaceTokenizer"]
    good = dry(hf + ["--tokenizer-model", _hf_tokenizer(tmp_path / "tok"), "--device", "cpu"])
    assert good.returncode == 0, good.stderr
    (tmp_path / "empty").mkdir()
    bad = dry(hf + ["--tokenizer-model", str(tmp_path / "empty"), "--device", "cpu"])
    errors = _errors(bad.stderr)
    assert bad.returncode == 2 and len(errors) == 1, bad.stderr
    assert (
        f"--tokenizer-model {tmp_path / 'empty'}: Hugging Face's AutoTokenizer cannot" in errors[0]
    )
    hub = dry(hf + ["--tokenizer-model", "some-org/some-tokenizer", "--device", "cpu"])
    assert hub.returncode == 0, hub.stderr
    assert (
        "assumed: --tokenizer-model some-org/some-tokenizer is not here: taken as a Hugging Face "
        "hub name" in hub.stdout
    ), hub.stdout
    away = dry(hf + ["--tokenizer-model", str(tmp_path / "cluster" / "tok"), "--device", "cpu"])
    assert away.returncode == 0, away.stderr
    assert f"not here, so not checked: {tmp_path / 'cluster' / 'tok'}" in away.stdout
