"""Megatron-LM's checkpoint ``args`` namespace as the converter reads and writes it."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("megatron.training")

from tst_megatron.conversion import mlm  # noqa: E402

#: A Qwen3-MoE-like model as Megatron-LM flags (every other layer dense).
FLAGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
    "--ffn-hidden-size", "96", "--seq-length", "32", "--max-position-embeddings", "64",
    "--position-embedding-type", "rope", "--rotary-base", "1000000",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
    "--disable-bias-linear", "--qk-layernorm", "--untie-embeddings-and-output-weights",
    "--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
    "--moe-layer-freq", "([1]*1+[0]*1)*2",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
    "--make-vocab-size-divisible-by", "128",
]  # fmt: skip


@pytest.fixture(scope="module")
def namespace():
    return mlm.megatron_lm_namespace(FLAGS, padded_vocab_size=384)


def _parsed_defaults():
    """Megatron-LM's parse of the minimum (no validation): every dest at its default."""
    from megatron.training.arguments import parse_args

    from tst_megatron.training.flags import add_tst_args

    with mlm._one_process_argv([]):
        return parse_args(extra_args_provider=add_tst_args)


def test_every_refused_setting_is_a_megatron_lm_dest_at_its_default():
    """A typo in the table would make its refusal unreachable."""
    defaults = _parsed_defaults()
    for dest, default, flag in mlm.UNSUPPORTED:
        assert hasattr(defaults, dest), dest
        assert getattr(defaults, dest) == default, dest
        assert flag.startswith("--"), flag


def test_namespace_is_megatron_lms_and_its_one_process_model_is_the_architecture(namespace):
    assert isinstance(namespace, argparse.Namespace)
    # the values validate_args derives, and the weights-only markers
    assert namespace.params_dtype == torch.float32 and mlm.dtype_name(namespace) == "float32"
    assert namespace.add_bias_linear is False
    assert namespace.padded_vocab_size == 384 and namespace.vocab_size == 300
    assert namespace.iteration == namespace.consumed_train_samples == 0
    assert namespace.no_save_optim and namespace.no_save_rng
    one = mlm.one_process_args(namespace)
    assert (one.tensor_model_parallel_size, one.transformer_impl, one.hidden_dropout) == (
        1,
        "local",
        0.0,
    )
    assert namespace.transformer_impl != "local" or namespace is not one  # a copy
    config = mlm.transformer_config(namespace)  # Megatron-LM's own builder
    expected = dict(
        num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=96, layernorm_epsilon=1e-6, gated_linear_unit=True, add_bias_linear=False,
        qk_layernorm=True, num_moe_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
        normalization="RMSNorm", tensor_model_parallel_size=1, hidden_dropout=0.0,
    )  # fmt: skip
    assert {k: getattr(config, k) for k in expected} == expected
    assert mlm.layer_freq(namespace) == 2  # Megatron-LM's [1, 0, 1, 0] pattern
    assert mlm.vocab_size(namespace) == 300


@pytest.mark.parametrize(
    "dest, value, flag",
    [
        ("rotary_interleaved", True, "--rotary-interleaved"),
        ("layernorm_zero_centered_gamma", True, "--apply-layernorm-1p"),
        ("moe_router_enable_expert_bias", True, "--moe-router-enable-expert-bias"),
        ("softmax_type", "learnable", "--softmax-type"),
        ("mtp_num_layers", 1, "--mtp-num-layers"),
        ("window_size", (64, 0), "--window-size"),
    ],
)
def test_settings_without_a_place_are_refused_by_name(namespace, dest, value, flag):
    changed = argparse.Namespace(**vars(namespace))
    setattr(changed, dest, value)
    with pytest.raises(ValueError, match="^" + flag):
        mlm.check_supported(changed)


def test_a_layernorm_model_with_megatron_lms_default_biases_is_refused_for_its_norm(namespace):
    """Megatron-LM's ``validate_args`` sets ``add_qkv_bias`` from its default
    ``--add-bias-linear``: the refusal names the flags the user's line holds (the norm, then
    the biases), not ``--add-qkv-bias``."""
    from tst_megatron.conversion import hf

    changed = argparse.Namespace(**vars(namespace))
    changed.normalization, changed.add_bias_linear, changed.add_qkv_bias = "LayerNorm", True, True
    with pytest.raises(ValueError, match="^--normalization LayerNorm"):
        hf.target_architecture(changed)
    changed.normalization = "RMSNorm"
    with pytest.raises(ValueError, match="no --disable-bias-linear"):
        hf.target_architecture(changed)
    changed.add_bias_linear = False  # --add-qkv-bias given on its own: named
    with pytest.raises(ValueError, match="^--add-qkv-bias"):
        hf.target_architecture(changed)


def test_moe_layer_patterns():
    assert mlm._layer_freq(3, 6) == 3
    assert mlm._layer_freq([1, 0, 0, 1, 0, 0], 6) == 3
    assert mlm._layer_freq("([1]*1+[0]*3)*2", 8) == 4
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        mlm._layer_freq([0, 1, 0, 1], 4)  # dense first: no every-n-th target


def test_vocabulary_from_the_tokenizer_when_no_vocab_size(namespace, tmp_path):
    from tst_megatron.data.tokenizer import train_tokenizer

    texts = [f"def f{i}(x):\n    return x * {i}  # hello world" for i in range(300)]
    model = train_tokenizer(texts, str(tmp_path / "sp"), vocab_size=300)
    changed = argparse.Namespace(**vars(namespace))
    changed.vocab_size = None
    changed.tokenizer_type, changed.tokenizer_model = "SentencePieceTokenizer", model
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    assert mlm.vocab_size(changed) == sp.get_piece_size()
    changed.tokenizer_model = str(tmp_path / "missing.model")
    with pytest.raises(ValueError, match="no --vocab-size"):
        mlm.vocab_size(changed)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("([1]*3+[0])*2", [1, 1, 1, 0, 1, 1, 1, 0]),
        ("[1, 0] * 2", [1, 0, 1, 0]),
        ("([0]+[1]*3)", [0, 1, 1, 1]),
        ("[1,0,0,1]", [1, 0, 0, 1]),
    ],
)
def test_a_moe_layer_freq_pattern_is_parsed_as_megatron_lm_evaluates_it(text, expected):
    """The reference is Python's own evaluation of the expression (what Megatron-LM's
    ``moe_freq_type`` does), on patterns known to be harmless."""
    assert mlm.layer_pattern(text, limit=64) == expected == eval(text)  # noqa: S307


@pytest.mark.parametrize(
    "text, why",
    [
        ("9**9**9**9", "unexpected '9'"),  # passed the old character check and hung
        ("[1]*9**9", "unexpected '*'"),
        ("[1]*100000000", "longer than the 64 layers"),
        ("([1]*8)*8+[1]", "longer than the 64 layers"),
        ("__import__('os')", "unexpected '_'"),
        ("[1]*", "it ends early"),
        ("([1]", "expected ')'"),
        ("[1.5]", "unexpected"),
    ],
)
def test_a_moe_layer_freq_pattern_that_is_code_or_grows_without_bound_is_one_line(text, why):
    with pytest.raises(ValueError, match="is not a layer pattern") as refused:
        mlm.layer_pattern(text, limit=64)
    assert why in str(refused.value), refused.value
