"""Flags, validation messages and the phase schedule (one process, no torch.distributed)."""

import subprocess
import sys

import pytest

from tests.defaults import TEST_DEFAULTS
from tst_megatron.errors import ConfigError
from tst_megatron.training.config import all_flags, parse_args, validate

# Frozen flag set: adding, renaming or removing a flag must be a deliberate change here.
FLAGS = [
    "--adam-beta1",
    "--adam-beta2",
    "--apply-layernorm-1p",
    "--attention-backend",
    "--attention-dropout",
    "--auto-detect-ckpt-format",
    "--bf16",
    "--calculate-per-token-loss",
    "--ckpt-format",
    "--clip-grad",
    "--context-parallel-size",
    "--cross-entropy-loss-fusion",
    "--data-cache-path",
    "--data-path",
    "--decoupled-lr",
    "--decoupled-min-lr",
    "--device",
    "--disable-bias-linear",
    "--dist-ckpt-strictness",
    "--distributed-timeout-minutes",
    "--dry-run",
    "--empty-unused-memory-level",
    "--eod-mask-loss",
    "--eval-interval",
    "--eval-iters",
    "--exit-duration-in-mins",
    "--exit-interval",
    "--exit-signal-handler",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    "--ffn-hidden-size",
    "--finetune",
    "--full-validation",
    "--fp16",
    "--fp8-amax-compute-algo",
    "--fp8-amax-history-len",
    "--fp8-format",
    "--fp8-param-gather",
    "--fp8-recipe",
    "--global-batch-size",
    "--grad-reduce-in-bf16",
    "--group-query-attention",
    "--hidden-dropout",
    "--hidden-size",
    "--hysteresis",
    "--init-method-std",
    "--initial-loss-scale",
    "--kv-channels",
    "--load",
    "--log-interval",
    "--log-memory-to-tensorboard",
    "--log-num-zeros-in-grad",
    "--log-params-norm",
    "--log-throughput",
    "--log-timers-to-tensorboard",
    "--log-validation-ppl-to-tensorboard",
    "--loss-scale",
    "--loss-scale-window",
    "--lr",
    "--lr-decay-iters",
    "--lr-decay-samples",
    "--lr-decay-style",
    "--lr-warmup-fraction",
    "--lr-warmup-init",
    "--lr-warmup-iters",
    "--lr-warmup-samples",
    "--lr-wsd-decay-iters",
    "--lr-wsd-decay-samples",
    "--lr-wsd-decay-style",
    "--make-vocab-size-divisible-by",
    "--manual-gc",
    "--manual-gc-interval",
    "--max-position-embeddings",
    "--merge-file",
    "--micro-batch-size",
    "--min-loss-scale",
    "--min-lr",
    "--mock-data",
    "--moe-aux-loss-coeff",
    "--moe-expert-capacity-factor",
    "--moe-ffn-hidden-size",
    "--moe-grouped-gemm",
    "--moe-layer-freq",
    "--moe-layer-recompute",
    "--moe-permute-fusion",
    "--moe-router-bias-update-rate",
    "--moe-router-dtype",
    "--moe-router-enable-expert-bias",
    "--moe-router-force-load-balancing",
    "--moe-router-group-topk",
    "--moe-router-load-balancing-type",
    "--moe-router-num-groups",
    "--moe-router-pre-softmax",
    "--moe-router-score-function",
    "--moe-router-topk",
    "--moe-router-topk-scaling-factor",
    "--moe-shared-expert-intermediate-size",
    "--moe-token-dispatcher-type",
    "--moe-z-loss-coeff",
    "--no-check-for-nan-in-loss-and-grad",
    "--no-create-attention-mask-in-dataloader",
    "--no-load-optim",
    "--no-load-rng",
    "--no-masked-softmax-fusion",
    "--no-mmap-bin-files",
    "--no-position-embedding",
    "--no-tst-save-at-switch",
    "--norm-epsilon",
    "--normalization",
    "--num-attention-heads",
    "--num-experts",
    "--num-layers",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-query-groups",
    "--num-workers",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--pipeline-model-parallel-size",
    "--position-embedding-type",
    "--profile",
    "--profile-ranks",
    "--profile-step-end",
    "--profile-step-start",
    "--qk-layernorm",
    "--recompute-activations",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-modules",
    "--recompute-num-layers",
    "--reset-attention-mask",
    "--reset-position-ids",
    "--rotary-base",
    "--rotary-percent",
    "--rotary-seq-len-interpolation-factor",
    "--save",
    "--save-interval",
    "--seed",
    "--seq-length",
    "--sequence-parallel",
    "--split",
    "--swiglu",
    "--tensor-model-parallel-size",
    "--tensorboard-dir",
    "--tiktoken-pattern",
    "--tokenizer-model",
    "--tokenizer-type",
    "--train-iters",
    "--train-samples",
    "--transformer-impl",
    "--tst-bag-size",
    "--tst-bag-weighting",
    "--tst-mode",
    "--tst-phase1-fraction",
    "--tst-phase1-iters",
    "--untie-embeddings-and-output-weights",
    "--use-distributed-optimizer",
    "--use-flash-attn",
    "--use-mcore-models",
    "--use-pytorch-profiler",
    "--vocab-file",
    "--vocab-size",
    "--wandb-exp-name",
    "--wandb-project",
    "--wandb-save-dir",
    "--weight-decay",
]


def test_flag_set_is_frozen():
    assert all_flags() == sorted(FLAGS)


GOOD = [
    *TEST_DEFAULTS,
    "--mock-data",
    "--vocab-size",
    "100",
    "--num-experts",
    "4",
    "--tst-bag-size",
    "4",
    "--train-iters",
    "10",
]


@pytest.mark.parametrize(
    "extra,world,device,message",
    [
        (
            ["--reset-position-ids"],
            1,
            "cpu",
            "--reset-position-ids is not supported in TST phase 1",
        ),
        (
            ["--reset-attention-mask"],
            1,
            "cpu",
            "--reset-attention-mask is not supported in TST phase 1",
        ),
        (
            ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "33"],
            2,
            "cpu",
            "--seq-length 33 is not divisible by --tensor-model-parallel-size 2",
        ),
        (
            ["--tensor-model-parallel-size", "2"],
            2,
            "cpu",
            "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel",
        ),
        (
            ["--global-batch-size", "3"],
            2,
            "cpu",
            "--global-batch-size 3 is not divisible by --micro-batch-size 2",
        ),
        (
            [
                "--context-parallel-size",
                "2",
                "--seq-length",
                "30",
                "--transformer-impl",
                "transformer_engine",
            ],
            2,
            "cuda",
            "--seq-length 30 is not divisible by 2 x --context-parallel-size 2",
        ),
        (
            ["--context-parallel-size", "2"],
            2,
            "cpu",
            "--context-parallel-size > 1 needs --transformer-impl transformer_engine",
        ),
        (["--tst-phase1-iters", "3", "--tst-phase1-fraction", "0.3"], 1, "cpu", "not both"),
        (
            ["--tst-phase1-iters", "11"],
            1,
            "cpu",
            "--tst-phase1-iters 11 must be in [0, --train-iters 10]",
        ),
        (["--tst-bag-size", "0"], 1, "cpu", "--tst-bag-size must be an integer >= 1"),
        (["--bf16"], 1, "cpu", "--bf16 needs a CUDA device"),
        (
            ["--pipeline-model-parallel-size", "2"],
            2,
            "cpu",
            "add --untie-embeddings-and-output-weights",
        ),
        (
            ["--expert-model-parallel-size", "3"],
            3,
            "cpu",
            "--num-experts 4 is not divisible by --expert-model-parallel-size 3",
        ),
        (["--exit-signal-handler"], 1, "cpu", "need --save DIR"),
        (
            ["--lr-warmup-iters", "10"],
            1,
            "cpu",
            "--lr-warmup-iters 10 must be in [0, --train-iters 10)",
        ),
        (["--num-workers", "-1"], 1, "cpu", "--num-workers must be >= 0"),
        (
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            2,
            "cpu",
            "world size 2 is not divisible by TP*PP*CP = 4",
        ),
    ],
)
def test_bad_settings_give_a_line_naming_the_flag(extra, world, device, message):
    with pytest.raises(ValueError) as info:
        validate(parse_args(GOOD + extra), world, device)
    lines = str(info.value).splitlines()  # every problem, one line each
    assert any(message in line for line in lines), lines


# --- expert biases need expert TP 1; SP splits each CP rank's positions --------

BIAS_ETP = (
    "MoE with biases (no --disable-bias-linear) needs --expert-tensor-parallel-size 1, got {} "
    "(unset: --tensor-model-parallel-size); add --disable-bias-linear or "
    "--expert-tensor-parallel-size 1"
)


@pytest.mark.parametrize(
    "extra,etp",
    [
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),  # expert TP = TP
        (["--expert-tensor-parallel-size", "2"], 2),
    ],
)
def test_moe_biases_at_expert_tp_above_1_are_refused_by_the_dry_run(extra, etp):
    """megatron-core's TransformerConfig asserts "Bias in Moe is only supported when ETP==1"
    after set-up, on every rank; the dry run must say it first, with every other problem."""
    result = _dry(GOOD + extra + ["--tst-bag-size", "0"], env={"WORLD_SIZE": "2"})
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert f"error: {BIAS_ETP.format(etp)}" in errors, result.stderr
    assert any("--tst-bag-size must be an integer >= 1" in line for line in errors), errors
    validate(parse_args(GOOD + extra + ["--disable-bias-linear"]), 2, "cpu")
    if "--expert-tensor-parallel-size" not in extra:
        validate(parse_args(GOOD + extra + ["--expert-tensor-parallel-size", "1"]), 2, "cpu")


CP_TP = [
    *GOOD,
    "--disable-bias-linear",
    "--transformer-impl",
    "transformer_engine",
    "--tensor-model-parallel-size",
    "4",
    "--context-parallel-size",
    "2",
    "--sequence-parallel",
]


@pytest.mark.parametrize("seq,ok", [(12, False), (20, False), (16, True), (24, True)])
def test_sequence_parallel_splits_each_context_parallel_ranks_positions(seq, ok):
    """A CP rank holds --seq-length / CP positions (2 x CP zig-zag chunks), which SP splits
    over TP: --seq-length 12 passes both "/ (2 x CP)" and "/ TP" but leaves 6 positions per
    CP rank for 4 TP ranks. The latent length is --seq-length in both TST phases."""
    result = _dry(CP_TP + ["--seq-length", str(seq)], env={"WORLD_SIZE": "8"})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    if ok:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 2
    assert errors == [
        f"error: --seq-length {seq} is not divisible by --context-parallel-size 2 x "
        "--tensor-model-parallel-size 4 under --sequence-parallel (each CP rank's "
        f"--seq-length / 2 = {seq // 2} positions are split over the TP ranks)"
    ], result.stderr


def test_programmatic_config_is_validated_too():
    import dataclasses

    cfg = parse_args(GOOD)
    cfg = dataclasses.replace(cfg, tst=dataclasses.replace(cfg.tst, bag_weighting="cubic"))
    with pytest.raises(ValueError, match="--tst-bag-weighting must be one of uniform, power"):
        validate(cfg, 1, "cpu")


def test_choices_are_checked_by_the_parser():
    # a ConfigError, so main reports it as every other bad setting
    with pytest.raises(ConfigError) as info:
        parse_args(GOOD + ["--tst-bag-weighting", "cubic"])
    message = str(info.value)
    assert message.startswith("argument --tst-bag-weighting: invalid choice: 'cubic'")
    assert "(choose from 'uniform', 'power')" in message


def test_good_settings_pass():
    validate(parse_args(GOOD), 1, "cpu")
    validate(
        parse_args(GOOD + ["--tst-bag-size", "1", "--reset-position-ids"]), 1, "cpu"
    )  # baseline


def test_data_source_required():
    with pytest.raises(ValueError, match="give --mock-data or --data-path"):
        validate(parse_args([*TEST_DEFAULTS, "--vocab-size", "10"]), 1, "cpu")


def test_cli_error_is_one_line_and_exit_code_2(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "examples/pretrain_gpt_tst.py",
            *GOOD,
            "--reset-position-ids",
            "--device",
            "cpu",
            "--save",
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: --reset-position-ids is not supported in TST phase 1 (--tst-bag-size > 1): "
        "bags are formed on the packed token stream; drop the flag or set --tst-bag-size 1"
    ]
    assert not (tmp_path / "ckpt").exists()  # nothing was written


# --- choices declared once; validation collects every problem ----------------


def test_parser_choices_come_from_the_literal_declarations():
    from tst_megatron.superposition.bags import BAG_WEIGHTINGS
    from tst_megatron.training.config import TrainArgs, build_parser, field_choices

    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["tst.bag_weighting"].choices) == BAG_WEIGHTINGS == ("uniform", "power")
    assert tuple(actions["train.lr_decay_style"].choices) == field_choices(
        TrainArgs, "lr_decay_style"
    )
    assert tuple(actions["train.empty_unused_memory_level"].choices) == (0, 1, 2)


def test_every_problem_is_reported_at_once():
    cfg = parse_args(
        GOOD
        + [
            "--tst-bag-size",
            "0",
            "--pipeline-model-parallel-size",
            "3",
            "--tp-comm-overlap",
            "--no-such-flag",
            "--lr-warmup-samples",
            "5",
        ]
    )
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1, "cpu")
    lines = str(info.value).splitlines()
    expected = [
        "--tp-comm-overlap is not supported: Transformer Engine userbuffer overlap",
        "unrecognised argument --no-such-flag",
        "world size 1 is not divisible by TP*PP*CP = 3",
        "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3",
        "--lr-warmup-samples needs a sample-based run (--train-samples)",
        "--tst-bag-size must be an integer >= 1, got 0",
        "tied embeddings with --pipeline-model-parallel-size > 1 need a CUDA device",
    ]
    assert len(lines) == len(expected), lines
    for line, want in zip(lines, expected):
        assert line.startswith(want), (line, want)


def test_required_flags_are_named():
    with pytest.raises(ConfigError) as info:
        validate(parse_args(["--mock-data"]), 1, "cpu")
    text = str(info.value)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
        assert f"{flag} is required" in text
    assert "--micro-batch-size is required" in text
    assert "--lr is required" in text
    assert "give one of --train-iters or --train-samples" in text
    assert "--tokenizer-type is required" in text


# --- interleaved-pipeline micro-batch rule, up front --------------------------

VPP = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
    "--untie-embeddings-and-output-weights",
    "--micro-batch-size",
    "1",
]


@pytest.mark.parametrize("gbs,ok", [(1, False), (2, True), (3, False), (4, True), (5, False)])
def test_interleaved_pipeline_needs_a_multiple_of_pp_micro_batches(gbs, ok):
    # megatron-core 0.16.1 pipeline_parallel/schedules.py (interleaved 1F1B) raises a
    # RuntimeError at the first step unless num_microbatches % PP == 0.
    cfg = parse_args(GOOD + VPP + ["--global-batch-size", str(gbs)])
    if ok:
        validate(cfg, 2, "cpu")
        return
    with pytest.raises(ConfigError) as info:
        validate(cfg, 2, "cpu")
    (line,) = str(info.value).splitlines()
    for word in ("--global-batch-size", "--micro-batch-size", "DP 1", "PP 2", "VPP 2"):
        assert word in line


# --- Megatron-LM's defaults ----------------------------------------------------

# Megatron-LM core_v0.16.1, megatron/training/arguments.py: the default of each flag we share
# (read from its argparse actions; None = no default, required or derived there).
MEGATRON_DEFAULTS = {
    "--adam-beta1": 0.9,
    "--adam-beta2": 0.999,
    "--attention-backend": "auto",
    "--attention-dropout": 0.1,
    "--clip-grad": 1.0,
    "--context-parallel-size": 1,
    "--distributed-timeout-minutes": 10,
    "--dist-ckpt-strictness": "assume_ok_unexpected",
    "--empty-unused-memory-level": 0,
    "--eval-interval": None,
    "--eval-iters": 100,
    "--expert-model-parallel-size": 1,
    "--expert-tensor-parallel-size": None,
    "--ffn-hidden-size": None,
    "--full-validation": False,
    "--fp8-amax-compute-algo": "most_recent",
    "--fp8-amax-history-len": 1,
    "--fp8-format": None,
    "--fp8-recipe": "delayed",
    "--global-batch-size": None,
    "--hidden-dropout": 0.1,
    "--hidden-size": None,
    "--hysteresis": 2,
    "--init-method-std": 0.02,
    "--initial-loss-scale": 2.0**32,
    "--kv-channels": None,
    "--log-interval": 100,
    "--lr": None,
    "--lr-decay-iters": None,
    "--lr-decay-samples": None,
    "--lr-decay-style": "linear",
    "--lr-warmup-fraction": None,
    "--lr-warmup-init": 0.0,
    "--lr-warmup-iters": 0,
    "--lr-warmup-samples": 0,
    "--lr-wsd-decay-iters": None,
    "--lr-wsd-decay-samples": None,
    "--lr-wsd-decay-style": "exponential",
    "--make-vocab-size-divisible-by": 128,
    "--manual-gc-interval": 0,
    "--max-position-embeddings": None,
    "--micro-batch-size": None,
    "--min-loss-scale": 1.0,
    "--min-lr": 0.0,
    "--moe-aux-loss-coeff": 0.0,
    "--moe-layer-freq": 1,
    "--moe-router-bias-update-rate": 1e-3,
    "--moe-router-load-balancing-type": "aux_loss",
    "--moe-router-score-function": "softmax",
    "--moe-router-topk": 2,
    "--moe-token-dispatcher-type": "allgather",
    "--norm-epsilon": 1e-5,
    "--normalization": "LayerNorm",
    "--num-attention-heads": None,
    "--num-layers": None,
    "--num-query-groups": 1,
    "--num-workers": 2,
    "--pipeline-model-parallel-size": 1,
    "--position-embedding-type": "learned_absolute",
    "--rotary-base": 10000,
    "--rotary-percent": 1.0,
    "--seed": 1234,
    "--seq-length": None,
    "--tensor-model-parallel-size": 1,
    "--tokenizer-type": None,
    "--train-iters": None,
    "--train-samples": None,
    "--transformer-impl": "transformer_engine",
    "--weight-decay": 0.01,
    # store_true flags: off; store_false ("--no-X") flags: the feature on
    "--bf16": False,
    "--fp16": False,
    "--swiglu": False,
    "--disable-bias-linear": False,
    "--overlap-grad-reduce": False,
    "--sequence-parallel": False,
    "--no-masked-softmax-fusion": True,
    "--no-position-embedding": True,
    "--no-check-for-nan-in-loss-and-grad": True,
    "--no-mmap-bin-files": True,
    "--no-create-attention-mask-in-dataloader": True,
}
# Ours differs on purpose (documented in README, "Coming from Megatron-LM"):
#   --split: Megatron-LM None, then '969, 30, 1' with a warning when --data-path is given.
DOCUMENTED_DIFFERENCES = {"--split": ("969,30,1", None)}


def test_defaults_are_megatron_lms():
    from tst_megatron.training.config import build_parser

    actions = {o: a for a in build_parser()._actions for o in a.option_strings}
    for flag, theirs in MEGATRON_DEFAULTS.items():
        ours = actions[flag].default
        assert ours == theirs and type(ours) is type(theirs), (flag, ours, theirs)
    for flag, (ours, _theirs) in DOCUMENTED_DIFFERENCES.items():
        assert actions[flag].default == ours


def _without(argv, flag):
    """``argv`` without every ``flag VALUE`` pair."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == flag:
            skip = True
        else:
            out.append(word)
    return out


def test_sample_based_schedule_is_megatron_lms():
    from tst_megatron.training.config import lr_schedule, resolve

    cfg = parse_args(
        _without(GOOD, "--train-iters")
        + ["--global-batch-size", "4", "--train-samples", "103", "--lr-decay-samples", "90"]
        + ["--lr-warmup-fraction", "0.1", "--lr-decay-style", "cosine"]
    )
    validate(cfg, 1, "cpu")
    resolved = resolve(cfg, 1, "cpu")
    assert resolved.train.train_iters == 25  # 103 // 4, Megatron-LM's update_train_iters
    sched = lr_schedule(resolved.train)
    assert sched["lr_decay_steps"] == 90 and sched["wd_incr_steps"] == 103
    assert sched["lr_warmup_steps"] == pytest.approx(9.0)
    # --tst-phase1-fraction counts iterations of the resolved run
    assert resolved.tst.phase1_steps(resolved.train.train_iters) == round(0.3 * 25)


def test_sequence_parallel_is_switched_off_at_tp1_and_ffn_follows_megatron():
    from tst_megatron.training.config import resolve

    cfg = parse_args(GOOD + ["--sequence-parallel", "--swiglu", "--hidden-size", "96"])
    validate(cfg, 1, "cpu")
    resolved = resolve(cfg, 1, "cpu")
    assert resolved.train.sequence_parallel is False
    assert resolved.model.ffn_hidden_size == int((4 * 96 * 2 / 3) / 64) * 64 == 256
    assert resolved.train.transformer_impl == "local"  # a CPU run uses the local spec


def test_moe_layer_freq_list_expression():
    from tst_megatron.training.config import moe_layer_pattern

    assert moe_layer_pattern("([0]*3+[1]*29)", 32) == [0] * 3 + [1] * 29
    assert moe_layer_pattern(2, 4) == [1, 0, 1, 0]
    assert moe_layer_pattern("([1]*3+[0]*1)*2", 8) == [1, 1, 1, 0] * 2
    with pytest.raises(ConfigError, match="gives 3 layers but --num-layers is 4"):
        moe_layer_pattern("[1]*3", 4)
    with pytest.raises(ConfigError, match="neither an integer nor a list expression"):
        moe_layer_pattern("__import__('os')", 4)
    assert parse_args(GOOD + ["--moe-layer-freq", "([0]+[1]*3)"]).moe.moe_layer_freq == (
        "([0]+[1]*3)"
    )


# --- --dry-run -----------------------------------------------------------------


def _dry(argv, env=None):
    """``main([... --dry-run])`` in this process (no process group is started):
    ``(returncode, stdout, stderr)``."""
    import contextlib
    import io
    import os
    from types import SimpleNamespace
    from unittest import mock

    from tst_megatron.training.trainer import main

    out, err = io.StringIO(), io.StringIO()
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    with mock.patch.dict(os.environ, {**environ, **(env or {})}, clear=True):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([*argv, "--dry-run"])
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_dry_run_prints_the_resolved_run():
    result = _dry(
        GOOD + ["--expert-model-parallel-size", "2", "--global-batch-size", "8"],
        env={"WORLD_SIZE": "2"},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "world 2 = TP 1 x PP 1 x CP 1 x DP 2" in out
    assert "EP 2, expert-TP 1" in out
    assert "micro-batch 2 x DP 2 x 2 micro-batches per step = global batch 8" in out
    assert "4 layers, hidden 128, FFN 512, 4 heads / 4 query groups, MoE, 4 experts" in out
    assert "phase 1 = iterations [0, 3), 12,288 tokens" in out  # 3 x 8 x 4 x 128


def test_dry_run_counts_the_tokens_output_mode_reads():
    """--tst-mode output reads T-token samples in phase 1, as the baseline does."""
    result = _dry(
        GOOD
        + ["--expert-model-parallel-size", "2", "--global-batch-size", "8", "--tst-mode", "output"],
        env={"WORLD_SIZE": "2"},
    )
    assert result.returncode == 0, result.stderr
    assert "mode output; phase 1 = iterations [0, 3), 3,072 tokens" in result.stdout  # 3 x 8 x 128


def test_dry_run_reports_every_problem_and_exits_2():
    result = _dry(GOOD + ["--tst-bag-size", "0", "--tensor-model-parallel-size", "2"])
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    # world size, bag size, MoE + TP without SP, MoE biases at expert-TP (= TP) 2
    assert len(errors) == 4, result.stderr
    # Under torchrun only rank 0 prints: other ranks are silent with the same exit status.
    quiet = _dry(GOOD + ["--tst-bag-size", "0"], env={"RANK": "1", "WORLD_SIZE": "2"})
    assert quiet.returncode == 2 and "error" not in quiet.stderr and not quiet.stdout


def test_parameter_count_matches_the_built_model():
    """The dry run's analytic count against the numel of the megatron-core model."""
    from tst_megatron.conversion.megatron import build_model, single_process
    from tst_megatron.training.checkpointing import checkpoint_args
    from tst_megatron.training.config import resolve
    from tst_megatron.training.plan import parameter_counts

    for extra in (
        ["--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"],
        ["--group-query-attention", "--num-query-groups", "2", "--qk-layernorm"],
        [
            "--moe-layer-freq",
            "([0]+[1]*3)",
            "--moe-shared-expert-intermediate-size",
            "64",
            "--disable-bias-linear",
        ],
    ):
        cfg = resolve(parse_args(GOOD + ["--normalization", "LayerNorm"] + extra), 1, "cpu")
        args = checkpoint_args(cfg, vocab_size=100, padded_vocab_size=128)
        with single_process():
            model = build_model(args)
            numel = sum(p.numel() for p in model.parameters())
        assert parameter_counts(cfg, 128).total == numel, extra


# --- trainer-side effects of the new flags (1 process, tiny model) -------------------------

TINY = [
    *TEST_DEFAULTS,
    "--mock-data",
    "--vocab-size",
    "128",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--num-experts",
    "4",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",  # MoE with biases
    "--device",
    "cpu",
    "--log-interval",
    "1",
    "--tst-bag-size",
    "2",
]


def _train_child(rank, world, *, argv):
    from tst_megatron.training import trainer

    return trainer.train(parse_args(argv))


@pytest.mark.slow
def test_sample_based_run_exits_at_the_interval_and_finetunes(tmp_path, capfd):
    """--train-samples, --exit-interval (saves), --log-params-norm/--log-num-zeros-in-grad,
    --manual-gc, then --finetune from that checkpoint starts at iteration 0."""
    import gc

    from tests.distributed.harness import run_distributed

    run = _without(TINY, "--train-iters") + [
        "--train-samples",
        "16",  # 16 // global batch 2 = 8 iterations
        "--exit-interval",
        "3",
        "--save",
        str(tmp_path),
        "--log-params-norm",
        "--log-num-zeros-in-grad",
        "--manual-gc",
        "--manual-gc-interval",
        "2",
    ]
    (history,) = run_distributed(_train_child, 1, argv=run)
    assert sorted(history["train"]) == [1, 2, 3] and history["exit"] == "interval"
    assert (tmp_path / "iter_0000003").is_dir()
    out = capfd.readouterr().out
    assert " params norm: " in out and " num zeros: " in out
    assert gc.isenabled()
    (history,) = run_distributed(
        _train_child,
        1,
        argv=TINY + ["--train-iters", "2", "--load", str(tmp_path), "--finetune"],
    )
    assert sorted(history["train"]) == [1, 2]  # from iteration 0, weights of iteration 3
