"""Flags, validation messages and the phase schedule (one process, no torch.distributed)."""

import subprocess
import sys

import pytest

from tst_megatron.training.config import all_flags, parse_args, validate

# Frozen flag set: adding, renaming or removing a flag must be a deliberate change here.
FLAGS = [
    "--adam-beta1",
    "--adam-beta2",
    "--attention-dropout",
    "--bf16",
    "--ckpt-format",
    "--clip-grad",
    "--context-parallel-size",
    "--data-cache-path",
    "--data-path",
    "--device",
    "--disable-bias-linear",
    "--eod-mask-loss",
    "--eval-interval",
    "--eval-iters",
    "--exit-signal-handler",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    "--ffn-hidden-size",
    "--fp8-amax-history-len",
    "--fp8-format",
    "--fp8-recipe",
    "--global-batch-size",
    "--group-query-attention",
    "--hidden-dropout",
    "--hidden-size",
    "--init-method-std",
    "--load",
    "--log-interval",
    "--lr",
    "--lr-decay-style",
    "--lr-warmup-iters",
    "--lr-wsd-decay-iters",
    "--lr-wsd-decay-style",
    "--make-vocab-size-divisible-by",
    "--max-position-embeddings",
    "--micro-batch-size",
    "--min-lr",
    "--mock-data",
    "--moe-aux-loss-coeff",
    "--moe-expert-capacity-factor",
    "--moe-ffn-hidden-size",
    "--moe-grouped-gemm",
    "--moe-layer-freq",
    "--moe-router-dtype",
    "--moe-router-load-balancing-type",
    "--moe-router-score-function",
    "--moe-router-topk",
    "--moe-shared-expert-intermediate-size",
    "--moe-token-dispatcher-type",
    "--moe-z-loss-coeff",
    "--no-load-optim",
    "--no-load-rng",
    "--no-tst-save-at-switch",
    "--normalization",
    "--num-attention-heads",
    "--num-experts",
    "--num-layers",
    "--norm-epsilon",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-query-groups",
    "--num-workers",
    "--kv-channels",
    "--moe-router-pre-softmax",
    "--pipeline-model-parallel-size",
    "--position-embedding-type",
    "--qk-layernorm",
    "--reset-attention-mask",
    "--reset-position-ids",
    "--rotary-base",
    "--save",
    "--save-interval",
    "--seed",
    "--seq-length",
    "--sequence-parallel",
    "--split",
    "--swiglu",
    "--tensor-model-parallel-size",
    "--tensorboard-dir",
    "--tokenizer-model",
    "--tokenizer-type",
    "--train-iters",
    "--transformer-impl",
    "--tst-bag-size",
    "--tst-bag-weighting",
    "--tst-phase1-fraction",
    "--tst-phase1-iters",
    "--untie-embeddings-and-output-weights",
    "--use-distributed-optimizer",
    "--vocab-size",
    "--weight-decay",
]


def test_flag_set_is_frozen():
    assert all_flags() == sorted(FLAGS)


GOOD = [
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
def test_bad_settings_give_one_line_naming_the_flag(extra, world, device, message):
    with pytest.raises(ValueError) as info:
        validate(parse_args(GOOD + extra), world, device)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_programmatic_config_is_validated_too():
    import dataclasses

    cfg = parse_args(GOOD)
    cfg = dataclasses.replace(cfg, tst=dataclasses.replace(cfg.tst, bag_weighting="cubic"))
    with pytest.raises(ValueError, match="--tst-bag-weighting must be one of uniform, power"):
        validate(cfg, 1, "cpu")


def test_choices_are_checked_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse_args(GOOD + ["--tst-bag-weighting", "cubic"])
    assert "invalid choice: 'cubic' (choose from 'uniform', 'power')" in capsys.readouterr().err


def test_good_settings_pass():
    validate(parse_args(GOOD), 1, "cpu")
    validate(
        parse_args(GOOD + ["--tst-bag-size", "1", "--reset-position-ids"]), 1, "cpu"
    )  # baseline


def test_data_source_required():
    with pytest.raises(ValueError, match="give --mock-data or --data-path"):
        validate(parse_args(["--vocab-size", "10"]), 1, "cpu")


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
