"""Megatron-LM's checkpoint ``args`` namespace <-> the converter's architecture dict."""

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

    from tst_megatron.training.megatron_lm import add_tst_args

    with mlm._one_process_argv([]):
        return parse_args(extra_args_provider=add_tst_args)


def test_every_refused_setting_is_a_megatron_lm_dest_at_its_default():
    """A typo in the table would make its refusal unreachable."""
    defaults = _parsed_defaults()
    for dest, default, flag in mlm.UNSUPPORTED:
        assert hasattr(defaults, dest), dest
        assert getattr(defaults, dest) == default, dest
        assert flag.startswith("--"), flag


def test_namespace_is_megatron_lms_and_reads_back_as_the_architecture(namespace):
    assert isinstance(namespace, argparse.Namespace)
    # the values validate_args derives, and the weights-only markers
    assert namespace.params_dtype == torch.float32
    assert namespace.add_bias_linear is False
    assert namespace.padded_vocab_size == 384 and namespace.vocab_size == 300
    assert namespace.iteration == namespace.consumed_train_samples == 0
    assert namespace.no_save_optim and namespace.no_save_rng
    args = mlm.converter_args(namespace)
    m, moe = args["model"], args["moe"]
    expected_model = dict(
        num_layers=4, hidden_size=64, num_attention_heads=8, group_query_attention=True,
        num_query_groups=2, kv_channels=16, ffn_hidden_size=96, seq_length=32,
        max_position_embeddings=64, position_embedding_type="rope", rotary_base=1000000,
        normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, disable_bias_linear=True,
        qk_layernorm=True, untie_embeddings_and_output_weights=True, vocab_size=300,
        apply_layernorm_1p=False, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    assert {k: m[k] for k in expected_model} == expected_model
    assert (moe["num_experts"], moe["moe_ffn_hidden_size"], moe["moe_router_topk"]) == (8, 32, 2)
    assert moe["moe_layer_freq"] == 2  # Megatron-LM's [1, 0, 1, 0] pattern
    assert args["padded_vocab_size"] == 384 and args["params_dtype"] == "float32"
    assert args["tokenizer"] == {"type": "NullTokenizer", "model": None}
    assert m["attention_backend"] == "auto"  # the enum's name, as the trainer stores it


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
        mlm.converter_args(changed)


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
    assert mlm.converter_args(changed)["model"]["vocab_size"] == sp.get_piece_size()
    changed.tokenizer_model = str(tmp_path / "missing.model")
    with pytest.raises(ValueError, match="no --vocab-size"):
        mlm.converter_args(changed)
