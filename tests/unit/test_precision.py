"""Shapes FP8 can run: with --fp8-format, the tokens per rank and every GEMM width
must be multiples of 16 (32 for MXFP8), checked by validate() before any work."""

import pytest

from tst_megatron.errors import ConfigError
from tst_megatron.training.config import parse_args, validate

BASE = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--lr",
    "1e-3",
    "--vocab-size",
    "1000",
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "10",
    "--tst-bag-size",
    "4",
    "--tst-phase1-iters",
    "3",
    "--transformer-impl",
    "transformer_engine",
    "--bf16",
]
FP8 = ["--fp8-format", "hybrid"]


def _check(argv, world=1):
    validate(parse_args(BASE + argv), world, "cuda")


@pytest.mark.parametrize(
    "extra,world,tokens",
    [
        ([], 1, 64 * 2),
        (["--seq-length", "24", "--micro-batch-size", "1"], 1, 24),
        (["--seq-length", "24"], 1, 48),
        # TP=2: SP splits the sequence over TP; without SP every TP rank has all tokens
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 64),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "40"], 2, 40),
        (
            ["--tensor-model-parallel-size", "2", "--seq-length", "40", "--micro-batch-size", "1"],
            2,
            40,
        ),
        (["--tensor-model-parallel-size", "2", "--seq-length", "40"], 2, 80),
        # CP=2 splits the sequence over CP ranks (and TP=2 + SP over TP as well)
        (["--context-parallel-size", "2"], 2, 64),
        (["--context-parallel-size", "2", "--seq-length", "48", "--micro-batch-size", "1"], 2, 24),
        (
            [
                "--context-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--seq-length",
                "48",
            ],
            4,
            24,
        ),
        # MXFP8: multiples of 32
        (["--fp8-recipe", "mxfp8", "--seq-length", "24"], 1, 48),
        (["--fp8-recipe", "mxfp8", "--seq-length", "16"], 1, 32),
    ],
)
def test_fp8_tokens_per_rank(extra, world, tokens):
    align = 32 if "mxfp8" in extra else 16
    if tokens % align == 0:
        _check(FP8 + extra, world)
    else:
        with pytest.raises(
            ConfigError,
            match=rf"tokens per rank.* = {tokens} \(in both TST phases\), must be a multiple of "
            rf"{align}; change --seq-length or --micro-batch-size",
        ):
            _check(FP8 + extra, world)
    _check(extra, world)  # without FP8 any count is fine


@pytest.mark.parametrize(
    "extra,name,value",
    [
        (["--hidden-size", "200"], "--hidden-size", 200),
        # heads * kv = 4 * 4 = 16 is fine for FP8 but not for MXFP8 (32)
        (
            ["--fp8-recipe", "mxfp8", "--kv-channels", "4"],
            "the attention width per TP rank",
            16,
        ),
        # GQA: (8 heads + 2 * 2 groups) * 8 / TP 2 = 48 per rank is fine for 16 but not for 32,
        # while the attention width 8 * 8 / 2 = 32 is fine (the groups divide by TP, as
        # megatron-core's attention requires)
        (
            [
                "--fp8-recipe",
                "mxfp8",
                "--num-attention-heads",
                "8",
                "--kv-channels",
                "8",
                "--group-query-attention",
                "--num-query-groups",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ],
            "the query-key-value width per TP rank",
            48,
        ),
        (["--ffn-hidden-size", "1000"], "--ffn-hidden-size per TP rank", 1000),
        (
            ["--num-experts", "4", "--moe-ffn-hidden-size", "100"],
            "--moe-ffn-hidden-size per expert-TP rank",
            100,
        ),
        (["--fp8-recipe", "mxfp8", "--hidden-size", "272"], "--hidden-size", 272),
    ],
)
def test_fp8_gemm_widths(extra, name, value):
    world = 4 if "--tensor-model-parallel-size" in extra else 1
    with pytest.raises(ConfigError, match=f"{name} \\({value}\\) must be a multiple of"):
        _check(FP8 + extra, world)
    _check(extra, world)  # the same shapes without FP8 are fine


def test_fp8_reports_every_bad_shape_at_once():
    """Every FP8 shape problem is its own line, with the other problems of the launch."""
    with pytest.raises(ConfigError) as info:
        _check(
            FP8
            + [
                "--seq-length",
                "24",
                "--micro-batch-size",
                "1",
                "--hidden-size",
                "200",  # kv = 200 / 4 heads = 50
                "--num-experts",
                "4",
                "--moe-ffn-hidden-size",
                "100",
                "--lr-warmup-iters",
                "10",
            ]
        )
    lines = str(info.value).splitlines()
    expected = [
        "tokens per rank, --seq-length x --micro-batch-size / (--context-parallel-size) = 24",
        "--hidden-size (200) must be a multiple of 16",
        "the attention width per TP rank (200) must be a multiple of 16",
        "the query-key-value width per TP rank (600) must be a multiple of 16",
        "--moe-ffn-hidden-size per expert-TP rank (100) must be a multiple of 16",
        "--lr-warmup-iters 10 must be in [0, --train-iters 10)",
    ]
    for want in expected:
        assert sum(want in line for line in lines) == 1, (want, lines)
    assert len(lines) == len(expected), lines


def test_fp8_width_of_all_moe_layers_ignores_the_dense_width():
    # every layer is MoE: --ffn-hidden-size shapes nothing, so it is not checked
    _check(
        FP8 + ["--num-experts", "4", "--moe-ffn-hidden-size", "128", "--ffn-hidden-size", "1000"]
    )


def test_no_fp8_no_shape_rule():
    _check(
        [
            "--seq-length",
            "23",
            "--micro-batch-size",
            "1",
            "--hidden-size",
            "200",
            "--num-attention-heads",
            "4",
        ]
    )
