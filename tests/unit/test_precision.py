"""Shapes FP8 can run: with --fp8-format, the tokens per rank and every GEMM width must be
multiples of 16 (32 for MXFP8). Transformer Engine asserts it only inside the first step and
Megatron-LM's validation does not check it, so the launcher refuses such a line before any
work (``tst_problems``, the dry run), with the sizes of the model's own ``TransformerConfig``
(Megatron-LM's derivation of the FFN width with --swiglu, kv channels and query groups). The
expected numbers are written out here by hand."""

from __future__ import annotations

import pytest

from tests.unit.test_dry_run import _errors, dry

pytest.importorskip("megatron.training")

BASE = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--eval-interval", "5",
    "--tst-bag-size", "4", "--tst-phase1-iters", "3", "--bf16",
]  # fmt: skip
FP8 = ["--fp8-format", "hybrid"]


def _world(extra):
    """WORLD_SIZE for a line: TP x CP (DP 1), and CUDA_DEVICE_MAX_CONNECTIONS as Megatron-LM
    asks for it with TP or CP > 1 before Blackwell."""
    size = 1
    for flag in ("--tensor-model-parallel-size", "--context-parallel-size"):
        if flag in extra:
            size *= int(extra[extra.index(flag) + 1])
    return {"WORLD_SIZE": str(size), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def _check(extra):
    """The dry run's ``error:`` lines for ``BASE + extra`` (empty: the line passes)."""
    r = dry(BASE + extra, env=_world(extra))
    assert "Traceback" not in r.stderr
    assert (r.returncode == 0) == (not _errors(r.stderr)), r.stderr
    return _errors(r.stderr)


@pytest.mark.parametrize(
    "extra,tokens",
    [
        ([], 64 * 2),
        (["--seq-length", "24", "--max-position-embeddings", "24", "--micro-batch-size", "1",
          "--global-batch-size", "1"], 24),
        (["--seq-length", "24", "--max-position-embeddings", "24"], 48),
        # TP=2: SP splits the sequence over TP; without SP every TP rank has all tokens
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 64),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "40",
          "--max-position-embeddings", "40"], 40),
        (["--tensor-model-parallel-size", "2", "--seq-length", "40",
          "--max-position-embeddings", "40"], 80),
        # CP=2 splits the sequence over CP ranks (and TP=2 + SP over TP as well)
        (["--context-parallel-size", "2"], 64),
        (["--context-parallel-size", "2", "--seq-length", "48", "--max-position-embeddings",
          "48", "--micro-batch-size", "1", "--global-batch-size", "1"], 24),
        (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
          "--sequence-parallel", "--seq-length", "48", "--max-position-embeddings", "48"], 24),
        # MXFP8: multiples of 32
        (["--fp8-recipe", "mxfp8", "--seq-length", "24", "--max-position-embeddings", "24"], 48),
        (["--fp8-recipe", "mxfp8", "--seq-length", "16", "--max-position-embeddings", "16"], 32),
    ],
)  # fmt: skip
def test_fp8_tokens_per_rank(extra, tokens):
    align = 32 if "mxfp8" in extra else 16
    errors = _check(FP8 + extra)
    if tokens % align == 0:
        assert errors == []
    else:
        (line,) = errors
        assert "tokens per rank, --seq-length x --micro-batch-size / (" in line
        assert (
            f") = {tokens} (in both TST phases), must be a multiple of {align}; change "
            "--seq-length or --micro-batch-size"
        ) in line
    assert _check(extra) == []  # without FP8 any count is fine


@pytest.mark.parametrize(
    "extra,name,value",
    [
        (["--hidden-size", "200"], "--hidden-size", 200),
        # heads * kv = 4 * 4 = 16 is fine for FP8 but not for MXFP8 (32)
        (["--fp8-recipe", "mxfp8", "--kv-channels", "4"], "the attention width per TP rank", 16),
        # GQA: (8 heads + 2 * 2 groups) * 8 / TP 2 = 48 per rank is fine for 16 but not for 32,
        # while the attention width 8 * 8 / 2 = 32 is fine
        (["--fp8-recipe", "mxfp8", "--num-attention-heads", "8", "--kv-channels", "8",
          "--group-query-attention", "--num-query-groups", "2",
          "--tensor-model-parallel-size", "2", "--sequence-parallel"],
         "the query-key-value width per TP rank", 48),
        (["--ffn-hidden-size", "1000"], "the FFN width per TP rank", 1000),
        # --swiglu: Megatron-LM's FFN width int(4 * 256 * 2/3 / 64) * 64 = 640, over TP 16 = 40
        # (4h = 1024 over 16 would be 64, a multiple of 16)
        (["--swiglu", "--num-attention-heads", "16", "--tensor-model-parallel-size", "16",
          "--sequence-parallel", "--seq-length", "256", "--max-position-embeddings", "256"],
         "the FFN width per TP rank", 40),
        (["--num-experts", "4", "--moe-ffn-hidden-size", "100", "--disable-bias-linear"],
         "--moe-ffn-hidden-size per expert-TP rank", 100),
        (["--fp8-recipe", "mxfp8", "--hidden-size", "272"], "--hidden-size", 272),
    ],
)  # fmt: skip
def test_fp8_gemm_widths(extra, name, value):
    errors = _check(FP8 + extra)
    assert [line for line in errors if f"{name} ({value}) must be a multiple of" in line], errors
    assert _check(extra) == []  # the same shapes without FP8 are fine


def test_fp8_reports_every_bad_shape_at_once_with_the_tst_problems():
    errors = _check(
        FP8
        + ["--seq-length", "24", "--max-position-embeddings", "24", "--micro-batch-size", "1"]
        + ["--global-batch-size", "1", "--hidden-size", "200"]  # kv = 200 / 4 heads = 50
        + ["--num-experts", "4", "--moe-ffn-hidden-size", "100", "--disable-bias-linear"]
        + ["--reset-position-ids"]
    )
    expected = [
        "error: --reset-position-ids is not supported in TST phase 1",
        "tokens per rank, --seq-length x --micro-batch-size / (--context-parallel-size) = 24",
        "--hidden-size (200) must be a multiple of 16",
        "the attention width per TP rank (200) must be a multiple of 16",
        "the query-key-value width per TP rank (600) must be a multiple of 16",
        "--moe-ffn-hidden-size per expert-TP rank (100) must be a multiple of 16",
    ]
    assert len(errors) == len(expected), errors
    for line, want in zip(errors, expected):
        assert want in line, (line, want)


def test_fp8_width_of_all_moe_layers_ignores_the_dense_width():
    # every layer is MoE: --ffn-hidden-size shapes nothing, so it is not checked
    moe = ["--num-experts", "4", "--moe-ffn-hidden-size", "128", "--disable-bias-linear"]
    assert _check(FP8 + moe + ["--ffn-hidden-size", "1000"]) == []
    # one dense layer in two: it is
    errors = _check(FP8 + moe + ["--ffn-hidden-size", "1000", "--moe-layer-freq", "2"])
    assert len(errors) == 1 and "the FFN width per TP rank (1000)" in errors[0], errors
