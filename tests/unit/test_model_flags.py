"""Every accepted model flag reaches the model as Megatron-LM maps it.

Megatron-LM builds the model from ``core_transformer_config_from_args`` (every argument whose
name is a ``TransformerConfig`` field, plus explicit ones, after ``validate_args`` derived
its values) and its GPT builder's ``GPTModel`` arguments. The tables below write that
mapping out plainly, from Megatron-LM's sources (``megatron/training/arguments.py`` at
``core_v0.16.1``; ``gpt_builders.py`` there and ``megatron/training/models/gpt.py`` at
``core_v0.19.0``, which also passes ``--rotary-seq-len-interpolation-factor``): for each flag,
the ``TransformerConfig`` fields it changes against a run without it, and what it changes in
the built model. A field of ``ModelArgs`` or ``MoEArgs`` without a row fails the test, so a
new flag cannot be accepted and silently dropped.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnBackend

from tests.defaults import TEST_DEFAULTS
from tst_megatron.training.config import ModelArgs, MoEArgs, parse_args, resolve

BASE = [
    *TEST_DEFAULTS,  # RoPE, RMSNorm, local spec, alltoall dispatcher
    "--mock-data",
    "--vocab-size",
    "100",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--device",
    "cpu",
]
MOE = ["--num-experts", "4", "--disable-bias-linear"]

# Fields left out of the comparison: callables rebuilt per config (init methods), and the
# fused-kernel switches Megatron-LM turns on by default and this trainer has no flag for
# (bias_activation_fusion follows --disable-bias-linear there); see the README.
NOT_COMPARED = {"init_method", "output_layer_init_method", "bias_activation_fusion"}


def _rope(model):
    return model.rotary_pos_emb


def _inv_freq(dim, base):
    """Megatron's RoPE frequencies, written plainly: ``base ** (-2i / dim)``, ``i < dim/2``."""
    return torch.tensor([base ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)


def _layer(model, i=0):
    return model.decoder.layers[i]


# flag field -> (extra argv, TransformerConfig fields it changes, model check or None).
# Model checks receive the built model (1 process, CPU) and return True when right.
MODEL_FLAGS = {
    "num_layers": (["--num-layers", "3"], {"num_layers": 3}, lambda m: len(m.decoder.layers) == 3),
    "hidden_size": (
        ["--hidden-size", "64"],  # Megatron-LM derives ffn = 4h and kv_channels = h / heads
        {"hidden_size": 64, "ffn_hidden_size": 256, "kv_channels": 16},
        None,
    ),
    "ffn_hidden_size": (
        ["--ffn-hidden-size", "40"],
        {"ffn_hidden_size": 40},
        lambda m: _layer(m).mlp.linear_fc1.weight.shape[0] == 40,
    ),
    "num_attention_heads": (
        ["--num-attention-heads", "8"],
        {"num_attention_heads": 8, "kv_channels": 4, "num_query_groups": 8},
        None,
    ),
    "group_query_attention": (
        ["--group-query-attention", "--num-query-groups", "2"],
        {"num_query_groups": 2},
        # fused QKV rows: (heads + 2 groups) * head dim = (4 + 2 * 2) * 8
        lambda m: _layer(m).self_attention.linear_qkv.weight.shape[0] == 64,
    ),
    "num_query_groups": (["--num-query-groups", "2"], {}, None),  # only with GQA
    "kv_channels": (["--kv-channels", "16"], {"kv_channels": 16}, None),
    "seq_length": (["--seq-length", "24"], {}, lambda m: m.max_sequence_length == 24),
    "max_position_embeddings": (
        ["--max-position-embeddings", "64"],
        {},
        lambda m: m.max_sequence_length == 64,
    ),
    "position_embedding_type": (
        ["--position-embedding-type", "learned_absolute"],
        {},
        lambda m: (
            m.embedding.position_embeddings.weight.shape[0] == 16
            and not hasattr(m, "rotary_pos_emb")
        ),
    ),
    "add_position_embedding": (  # deprecated; with RoPE it changes nothing
        ["--no-position-embedding"],
        {},
        lambda m: not hasattr(m.embedding, "position_embeddings") and hasattr(m, "rotary_pos_emb"),
    ),
    "rotary_base": (
        ["--rotary-base", "500"],
        {},
        lambda m: torch.allclose(_rope(m).inv_freq.double(), _inv_freq(8, 500), rtol=1e-6),
    ),
    "rotary_percent": (
        ["--rotary-percent", "0.5"],  # RoPE on int(8 * 0.5) = 4 of each head's 8 channels
        {},
        lambda m: torch.allclose(_rope(m).inv_freq.double(), _inv_freq(4, 10000), rtol=1e-6),
    ),
    "rotary_seq_len_interpolation_factor": (
        ["--rotary-seq-len-interpolation-factor", "2"],
        {},
        lambda m: _rope(m).seq_len_interpolation_factor == 2,
    ),
    "normalization": (["--normalization", "LayerNorm"], {"normalization": "LayerNorm"}, None),
    "norm_epsilon": (["--norm-epsilon", "1e-6"], {"layernorm_epsilon": 1e-6}, None),
    "apply_layernorm_1p": (["--apply-layernorm-1p"], {"layernorm_zero_centered_gamma": True}, None),
    "swiglu": (
        ["--swiglu"],  # ffn = int(4h * 2/3 / 64) * 64 = 64
        {"gated_linear_unit": True, "activation_func": F.silu, "ffn_hidden_size": 64},
        lambda m: _layer(m).mlp.linear_fc1.weight.shape[0] == 2 * 64,
    ),
    "untie_embeddings_and_output_weights": (
        ["--untie-embeddings-and-output-weights"],
        {},
        lambda m: not m.share_embeddings_and_output_weights and m.output_layer.weight is not None,
    ),
    "disable_bias_linear": (
        ["--disable-bias-linear"],  # validate_args keeps add_qkv_bias = add_bias_linear
        {"add_bias_linear": False, "add_qkv_bias": False},
        lambda m: (
            _layer(m).self_attention.linear_qkv.bias is None
            and _layer(m).mlp.linear_fc1.bias is None
        ),
    ),
    "qk_layernorm": (
        ["--qk-layernorm"],
        {"qk_layernorm": True},
        lambda m: hasattr(_layer(m).self_attention.q_layernorm, "weight"),
    ),
    "attention_backend": (
        ["--attention-backend", "unfused"],
        {"attention_backend": AttnBackend.unfused},
        None,
    ),
    "masked_softmax_fusion": (
        ["--no-masked-softmax-fusion"],
        {"masked_softmax_fusion": False},
        None,
    ),
    "use_flash_attn": (["--use-flash-attn"], {}, None),  # read by nothing for mcore models
    "init_method_std": (
        ["--init-method-std", "0.01"],
        {"init_method_std": 0.01, "embedding_init_method_std": 0.01},
        None,
    ),
    # The padded vocabulary: the smallest multiple of divisible_by * TP >= vocab_size.
    "vocab_size": (["--vocab-size", "200"], {}, lambda m: m.vocab_size == 256),
    "make_vocab_size_divisible_by": (
        ["--make-vocab-size-divisible-by", "48"],
        {},
        lambda m: m.vocab_size == 144,
    ),
    "hidden_dropout": (["--hidden-dropout", "0.2"], {"hidden_dropout": 0.2}, None),
    "attention_dropout": (["--attention-dropout", "0.2"], {"attention_dropout": 0.2}, None),
}

# Against BASE + MOE (num_experts against BASE alone).
MOE_FLAGS = {
    "num_experts": (
        ["--num-experts", "4"],  # expert width defaults to --ffn-hidden-size (4h)
        {"num_moe_experts": 4, "moe_ffn_hidden_size": 128},
        lambda m: len(_layer(m).mlp.experts.local_experts) == 4,
    ),
    "moe_ffn_hidden_size": (["--moe-ffn-hidden-size", "48"], {"moe_ffn_hidden_size": 48}, None),
    "moe_router_topk": (["--moe-router-topk", "3"], {"moe_router_topk": 3}, None),
    "moe_router_load_balancing_type": (
        ["--moe-router-load-balancing-type", "seq_aux_loss"],
        {"moe_router_load_balancing_type": "seq_aux_loss"},
        None,
    ),
    "moe_aux_loss_coeff": (["--moe-aux-loss-coeff", "0.01"], {"moe_aux_loss_coeff": 0.01}, None),
    "moe_z_loss_coeff": (["--moe-z-loss-coeff", "0.001"], {"moe_z_loss_coeff": 0.001}, None),
    "moe_router_score_function": (
        ["--moe-router-score-function", "sigmoid"],
        {"moe_router_score_function": "sigmoid"},
        None,
    ),
    "moe_router_pre_softmax": (
        ["--moe-router-pre-softmax"],
        {"moe_router_pre_softmax": True},
        None,
    ),
    "moe_router_dtype": (["--moe-router-dtype", "fp32"], {"moe_router_dtype": "fp32"}, None),
    "moe_router_enable_expert_bias": (
        ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"],
        {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"},
        lambda m: _layer(m).mlp.router.expert_bias is not None,
    ),
    "moe_router_bias_update_rate": (
        ["--moe-router-bias-update-rate", "0.01"],
        {"moe_router_bias_update_rate": 0.01},
        None,
    ),
    "moe_router_topk_scaling_factor": (
        ["--moe-router-topk-scaling-factor", "2.0"],
        {"moe_router_topk_scaling_factor": 2.0},
        None,
    ),
    "moe_router_num_groups": (
        ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"],
        {"moe_router_num_groups": 2, "moe_router_group_topk": 1},
        None,
    ),
    "moe_router_group_topk": (
        ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"],
        {"moe_router_num_groups": 2, "moe_router_group_topk": 1},
        None,
    ),
    "moe_router_force_load_balancing": (
        ["--moe-router-force-load-balancing"],
        {"moe_router_force_load_balancing": True},
        None,
    ),
    "moe_token_dispatcher_type": (
        ["--moe-token-dispatcher-type", "allgather"],
        {"moe_token_dispatcher_type": "allgather"},
        None,
    ),
    # Transformer Engine only: compared on the TransformerConfig arguments (see below).
    "moe_permute_fusion": (["--moe-permute-fusion"], {"moe_permute_fusion": True}, None),
    "moe_grouped_gemm": (["--moe-grouped-gemm"], {"moe_grouped_gemm": True}, None),
    "moe_layer_freq": (
        ["--moe-layer-freq", "2"],
        {"moe_layer_freq": 2},
        lambda m: not hasattr(_layer(m, 1).mlp, "experts") and hasattr(_layer(m, 0).mlp, "experts"),
    ),
    "moe_layer_recompute": (
        ["--moe-layer-recompute"],  # megatron-core: selective recompute of 'moe' as well
        {
            "moe_layer_recompute": True,
            "recompute_granularity": "selective",
            "recompute_modules": ["core_attn", "moe"],
        },
        None,
    ),
    "moe_shared_expert_intermediate_size": (
        ["--moe-shared-expert-intermediate-size", "32"],
        {"moe_shared_expert_intermediate_size": 32},
        lambda m: _layer(m).mlp.shared_experts is not None,
    ),
    "moe_expert_capacity_factor": (
        ["--moe-expert-capacity-factor", "1.5"],
        {"moe_expert_capacity_factor": 1.5},
        None,
    ),
}

# Training flags that Megatron-LM copies into the TransformerConfig (by name).
TRAIN_FLAGS = {
    "recompute_activations": (
        ["--recompute-activations"],
        {"recompute_granularity": "selective"},
        None,
    ),
    "recompute_granularity": (
        ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        + ["--recompute-num-layers", "1"],
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        None,
    ),
    "recompute_modules": (
        ["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"],
        {"recompute_granularity": "selective", "recompute_modules": ["mlp", "layernorm"]},
        None,
    ),
    "cross_entropy_loss_fusion": (
        ["--cross-entropy-loss-fusion"],
        {"cross_entropy_loss_fusion": True},
        None,
    ),
}

TE_ONLY = {"moe_permute_fusion"}  # its TransformerConfig checks import Transformer Engine


def _cfg(argv):
    return resolve(parse_args(argv), 1, "cuda")  # a GPU run: fused-kernel flags kept


def _config(argv, monkeypatch=None):
    """The run's TransformerConfig as a dict of field -> value, or (``monkeypatch``) the
    arguments it is built from, for settings whose checks need Transformer Engine."""
    from tst_megatron.training import model as model_module

    cfg = _cfg(argv)
    if monkeypatch is not None:
        captured = {}
        monkeypatch.setattr(model_module, "TransformerConfig", lambda **kw: captured.update(kw))
        model_module.transformer_config(cfg, use_cpu_initialization=False)
        monkeypatch.undo()
        return captured
    config = model_module.transformer_config(cfg, use_cpu_initialization=False)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _changed(base: dict, other: dict) -> dict:
    out = {}
    for name in base.keys() | other.keys():
        a, b = base.get(name), other.get(name)
        if name in NOT_COMPARED or (callable(a) and name != "activation_func"):
            continue
        if a is not b and a != b:
            out[name] = b
    return out


def _cases():
    for name, case in MODEL_FLAGS.items():
        yield name, BASE, case
    for name, case in MOE_FLAGS.items():
        # Without experts the MoE settings are not passed on: compare from megatron-core's
        # default dispatcher (BASE has alltoall).
        dense = BASE + ["--moe-token-dispatcher-type", "allgather"]
        yield name, dense if name == "num_experts" else BASE + MOE, case
    for name, case in TRAIN_FLAGS.items():
        yield name, BASE, case


def test_every_model_flag_has_a_row():
    fields = {f.name for cls in (ModelArgs, MoEArgs) for f in dataclasses.fields(cls)}
    assert fields == set(MODEL_FLAGS) | set(MOE_FLAGS)


def test_each_flag_changes_the_transformer_config_as_megatron_lm(monkeypatch):
    wrong = []
    for name, base, (extra, expected, _) in _cases():
        patch = monkeypatch if name in TE_ONLY else None
        try:
            changed = _changed(_config(base, patch), _config(base + extra, patch))
        except Exception as exc:  # report every row, not the first that raises
            changed = repr(exc)
        if changed != expected:
            wrong.append(f"{name}: {changed} != {expected}")
    assert not wrong, "\n".join(wrong)


def test_each_flag_changes_the_built_model_as_megatron_lm():
    from tst_megatron.conversion.megatron import single_process
    from tst_megatron.training.model import build_model, padded_vocab_size, transformer_config

    wrong = []
    with single_process():
        for name, base, (extra, _, check) in _cases():
            if check is None:
                continue
            cfg = resolve(parse_args(base + extra), 1, "cpu")
            vocab = padded_vocab_size(
                cfg.model.vocab_size, divisible_by=cfg.model.make_vocab_size_divisible_by, tp=1
            )
            model = build_model(
                cfg, transformer_config(cfg, use_cpu_initialization=True), vocab_size=vocab
            )
            try:
                right = check(model)
            except Exception as exc:  # e.g. a RoPE table of the wrong width
                right = False
                name = f"{name} ({exc!r})"
            if not right:
                wrong.append(name)
    assert not wrong, wrong


def _rope_logits(extra):
    """Logits of the BASE model (fixed weights) with ``extra`` flags, and its RoPE table."""
    from tst_megatron.conversion.megatron import single_process
    from tst_megatron.training.model import build_model, transformer_config

    cfg = resolve(
        parse_args(BASE + ["--hidden-dropout", "0", "--attention-dropout", "0"] + extra), 1, "cpu"
    )
    with single_process():
        torch.manual_seed(0)
        model = build_model(
            cfg, transformer_config(cfg, use_cpu_initialization=True), vocab_size=128
        )
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                g = torch.Generator().manual_seed(i)
                p.copy_((1.0 if p.dim() == 1 else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
        model.eval()
        tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(5))
        positions = torch.arange(16).expand(2, 16)
        with torch.no_grad():
            logits = model(tokens, positions, None)
        table = model.rotary_pos_emb(16).reshape(16, -1).double()  # [T, rotary dim]
    return logits, table


@pytest.mark.parametrize(
    "extra, dim, factor",
    [
        (["--rotary-percent", "0.5"], 4, 1.0),
        (["--rotary-seq-len-interpolation-factor", "2"], 8, 2.0),
        (["--rotary-percent", "0.5", "--rotary-seq-len-interpolation-factor", "4"], 4, 4.0),
    ],
)
def test_rotary_flags_change_the_rope_table_and_the_output(extra, dim, factor):
    """The RoPE angle of position p, channel pair i is (p / factor) * base ** (-2i / dim),
    dim = int(kv_channels * rotary_percent) (megatron-core's RotaryEmbedding; kv = 8 here);
    the logits differ from a model without the flags."""
    base_logits, base_table = _rope_logits([])
    logits, table = _rope_logits(extra)
    positions = torch.arange(16, dtype=torch.float64) / factor
    angles = torch.outer(positions, _inv_freq(dim, 10000))
    torch.testing.assert_close(table, torch.cat([angles, angles], dim=-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(base_table.shape[-1], 8)
    assert not torch.allclose(logits, base_logits, atol=1e-3), "the flags do not change the output"
    assert math.isfinite(float(logits.abs().max()))
