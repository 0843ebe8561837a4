"""Hugging Face side of the conversion: ``config.json`` <-> Megatron-LM checkpoint ``args``
(the ``argparse.Namespace`` Megatron-LM stores; the shapes read from its
``TransformerConfig``, :func:`.mlm.transformer_config`), and the safetensors/tokenizer files
of a Hugging Face model directory.

The config is built and read through ``transformers``' own config classes
(``AutoConfig.for_model`` / ``AutoConfig.from_pretrained``), so the files are written the
way the installed ``transformers`` writes them. The files themselves (safetensors shards,
tokenizer): :mod:`.hf_files`.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from tst_megatron.conversion import mlm
from tst_megatron.conversion.rules import ARCHITECTURES, Architecture, Shapes, architecture_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def require_transformers():
    """Import and return ``transformers``; ``ImportError`` with the install line if absent."""
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"Hugging Face conversion needs transformers and safetensors: pip install "
            f"'tst-megatron[hf]' ({exc})"
        ) from exc
    return transformers


def shapes_of(ns, config=None) -> Shapes:
    """:class:`~tst_megatron.conversion.rules.Shapes` of Megatron-LM checkpoint ``args`` ``ns``
    (heads, query groups and head width from its ``TransformerConfig`` ``config``, default
    :func:`.mlm.transformer_config`; vocabulary sizes from ``ns``)."""
    config = mlm.transformer_config(ns) if config is None else config
    return Shapes(
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels,
        vocab_size=mlm.vocab_size(ns),
        padded_vocab_size=int(ns.padded_vocab_size),
    )


def target_architecture(ns) -> Architecture:
    """The Hugging Face architecture for Megatron-LM checkpoint ``args`` ``ns``, after checking
    that every setting has a place in it (:func:`.mlm.check_supported` first).

    Qwen3-MoE for experts + qk-layernorm, Mixtral for experts without, Qwen3 / Llama for the
    dense models with / without qk-layernorm.

    Raises:
        ValueError: one line naming the first setting no target can represent.
    """
    mlm.check_supported(ns)
    targets = "Qwen3-MoE, Mixtral, Qwen3 or Llama"
    if ns.normalization != "RMSNorm":
        raise ValueError(f"--normalization {ns.normalization}: {targets} use RMSNorm")
    if ns.position_embedding_type != "rope":
        raise ValueError(
            f"--position-embedding-type {ns.position_embedding_type}: {targets} use RoPE"
        )
    if getattr(ns, "rotary_percent", 1.0) != 1.0:
        raise ValueError(
            f"--rotary-percent {ns.rotary_percent}: {targets} rotate every channel of a head"
        )
    if getattr(ns, "rotary_seq_len_interpolation_factor", None) not in (None, 1):
        raise ValueError(
            f"--rotary-seq-len-interpolation-factor {ns.rotary_seq_len_interpolation_factor}: "
            f"{targets} are exported without RoPE scaling"
        )
    if not ns.swiglu:
        raise ValueError(f"the MLPs are not SwiGLU (no --swiglu): {targets} use SwiGLU")
    if ns.add_bias_linear:
        raise ValueError(
            f"linear layers have biases (no --disable-bias-linear): {targets} have none"
        )
    arch = architecture_for(moe=bool(ns.num_experts), qk_layernorm=bool(ns.qk_layernorm))
    if arch.moe:
        if getattr(ns, "moe_shared_expert_intermediate_size", None):
            raise ValueError(
                f"--moe-shared-expert-intermediate-size: {arch.name} has no shared expert"
            )
        score = getattr(ns, "moe_router_score_function", "softmax")
        if score != "softmax":
            raise ValueError(
                f"--moe-router-score-function {score}: {arch.name} routes with a softmax"
            )
        if arch.model_type == "mixtral" and ns.moe_router_pre_softmax:
            raise ValueError("--moe-router-pre-softmax: Mixtral renormalises the top-k weights")
        freq = mlm.layer_freq(ns)
        if arch.model_type == "mixtral" and freq != 1:
            raise ValueError(f"--moe-layer-freq {ns.moe_layer_freq}: every Mixtral layer is MoE")
    return arch


def hf_config(ns, *, dtype: str, special_ids: Optional[dict] = None):
    """The ``transformers`` config object for Megatron-LM checkpoint ``args`` ``ns`` (see
    :func:`target_architecture`). Widths, heads, norm epsilon, router top-k and aux-loss
    coefficient come from its ``TransformerConfig`` (:func:`.mlm.transformer_config`: the
    values the model was built with, e.g. ``ffn_hidden_size`` as ``validate_args`` derived
    it); RoPE base, positions and embedding tying from ``ns``.

    Args:
        ns: Megatron-LM ``args`` (as a checkpoint stores them).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (the config's ``dtype``).
        special_ids: ``bos_token_id``/``eos_token_id``/``pad_token_id`` when known.

    Raises:
        ValueError: see :func:`target_architecture`.
    """
    transformers = require_transformers()
    arch = target_architecture(ns)
    tc = mlm.transformer_config(ns)
    s = shapes_of(ns, tc)
    ffn = tc.ffn_hidden_size
    kwargs = dict(
        vocab_size=s.vocab_size,
        hidden_size=tc.hidden_size,
        num_hidden_layers=tc.num_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_query_groups,
        head_dim=s.head_dim,
        hidden_act="silu",
        max_position_embeddings=ns.max_position_embeddings or ns.seq_length,
        rms_norm_eps=tc.layernorm_epsilon,
        rope_theta=float(ns.rotary_base),
        tie_word_embeddings=not ns.untie_embeddings_and_output_weights,
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=tc.init_method_std,
        dtype=dtype,
        **(special_ids or {}),
    )
    if arch.moe:
        experts_ffn = tc.moe_ffn_hidden_size or ffn
        kwargs.update(
            num_experts_per_tok=tc.moe_router_topk,
            router_aux_loss_coef=_aux_coeff(tc.moe_aux_loss_coeff),
        )
    if arch.model_type == "qwen3_moe":
        freq = mlm.layer_freq(ns)
        kwargs.update(
            num_experts=tc.num_moe_experts,
            moe_intermediate_size=experts_ffn,
            intermediate_size=ffn,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(tc.num_layers) if i % freq != 0],
            norm_topk_prob=not tc.moe_router_pre_softmax,
            use_sliding_window=False,
        )
    elif arch.model_type == "mixtral":
        kwargs.update(
            num_local_experts=tc.num_moe_experts,
            intermediate_size=experts_ffn,
            sliding_window=None,
        )
    else:
        kwargs.update(intermediate_size=ffn)
        if arch.model_type == "llama":
            kwargs.update(mlp_bias=False)
        else:
            kwargs.update(use_sliding_window=False)
    config = transformers.AutoConfig.for_model(arch.model_type, **kwargs)
    config.architectures = [arch.hf_class]
    return config


def _aux_coeff(value) -> float:
    """``--moe-aux-loss-coeff`` (a float, or a list per aux-loss type) as one float."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else 0.0
    return float(value or 0.0)


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _number(value) -> str:
    """A flag value: an integral float without its ``.0``."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def flags_from_hf(
    config, *, make_vocab_size_divisible_by: int = 128
) -> Tuple[List[str], Architecture, str]:
    """Megatron-LM model flags for a Hugging Face config of a supported architecture.

    Args:
        config: a ``transformers`` config (``AutoConfig.from_pretrained``).
        make_vocab_size_divisible_by: Megatron-LM's ``--make-vocab-size-divisible-by``.

    Returns:
        ``(flags, architecture, hf_dtype)``: the flags (Megatron-LM's names and meanings)
        that rebuild the architecture (``--vocab-size``, ``--make-vocab-size-divisible-by``
        ``--max-position-embeddings`` and ``--tokenizer-type NullTokenizer`` included; not
        ``--seq-length`` or ``--init-method-std``, which :func:`run_flags_from_hf` adds), and
        the dtype of the Hugging Face weights.

    Raises:
        ValueError: an unsupported ``model_type`` or a setting Megatron's model here cannot
            represent (biases, non-SiLU activation, RoPE scaling, sliding windows, a dense-layer
            pattern that is not every n-th layer), named in one line.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    arch = ARCHITECTURES[model_type]
    if _get(config, "hidden_act", default="silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r}: only SwiGLU (silu) MLPs are supported")
    for name in ("attention_bias", "mlp_bias"):
        if getattr(config, name, False):
            raise ValueError(f"{name}=true: biases are not supported")
    rope = dict(_get(config, "rope_parameters", "rope_scaling", default={}) or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(
            f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported"
        )
    theta = _get(config, "rope_theta", default=rope.get("rope_theta", 10000.0))
    if getattr(config, "use_sliding_window", False) or (
        model_type == "mixtral" and getattr(config, "sliding_window", None)
    ):
        raise ValueError("sliding-window attention is not supported")
    heads, hidden = config.num_attention_heads, config.hidden_size
    kv_heads = _get(config, "num_key_value_heads", default=heads)
    head_dim = _get(config, "head_dim", default=hidden // heads)
    layers = config.num_hidden_layers
    flags = ["--num-layers", str(layers), "--hidden-size", str(hidden)]
    flags += ["--ffn-hidden-size", str(config.intermediate_size)]
    flags += ["--num-attention-heads", str(heads)]
    if kv_heads != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(kv_heads)]
    flags += ["--kv-channels", str(head_dim)]
    flags += ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]
    if not getattr(config, "tie_word_embeddings", False):
        flags.append("--untie-embeddings-and-output-weights")
    flags.append("--disable-bias-linear")
    if arch.qk_layernorm:
        flags.append("--qk-layernorm")
    if model_type in ("qwen3_moe", "mixtral"):
        if model_type == "qwen3_moe":
            step = _get(config, "decoder_sparse_step", default=1)
            dense = set(_get(config, "mlp_only_layers", default=[]) or [])
            sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
            freq = moe_layer_freq(sparse, layers)
            if freq is None:
                raise ValueError(
                    f"MoE layers {sparse} are not every n-th layer from layer 0 "
                    "(--moe-layer-freq n)"
                )
            experts, experts_ffn = (
                _get(config, "num_experts", "num_local_experts"),
                (config.moe_intermediate_size),
            )
        else:
            freq = 1
            experts = _get(config, "num_local_experts", "num_experts")
            experts_ffn = config.intermediate_size
        flags += ["--num-experts", str(experts), "--moe-ffn-hidden-size", str(experts_ffn)]
        flags += ["--moe-router-topk", str(config.num_experts_per_tok)]
        flags += ["--moe-layer-freq", str(freq)]
        if model_type == "qwen3_moe" and not getattr(config, "norm_topk_prob", True):
            flags.append("--moe-router-pre-softmax")
        flags += [
            "--moe-aux-loss-coeff",
            repr(float(_get(config, "router_aux_loss_coef", default=0.0))),
        ]
    flags += ["--vocab-size", str(config.vocab_size)]
    flags += ["--make-vocab-size-divisible-by", str(make_vocab_size_divisible_by)]
    flags += ["--norm-epsilon", repr(float(config.rms_norm_eps))]
    flags += ["--rotary-base", _number(theta)]
    flags += ["--max-position-embeddings", str(config.max_position_embeddings)]
    flags += ["--tokenizer-type", "NullTokenizer"]
    dtype = str(_get(config, "dtype", "torch_dtype", default="float32")).replace("torch.", "")
    return flags, arch, dtype if dtype in DTYPES else "float32"


def moe_layer_freq(sparse: List[int], layers: int) -> Optional[int]:
    """The smallest ``n`` with MoE layers ``sparse`` = every ``n``-th of ``layers`` from layer 0
    (Megatron-LM's ``--moe-layer-freq n``), or None; O(layers) (a crafted config's layer count
    cannot make it slow)."""
    if not sparse or sparse[0] != 0:
        return None
    if len(sparse) == 1:  # only layer 0: every n-th for any n >= layers; the smallest
        return max(layers, 1)
    step = sparse[1]
    return step if sparse == list(range(0, layers, step)) else None


def run_flags_from_hf(config) -> List[str]:
    """The flags a weights-only namespace needs beyond :func:`flags_from_hf`: the sequence
    length (the positions, at most 4096) and ``--init-method-std`` (``initializer_range``)."""
    positions = config.max_position_embeddings
    return [
        "--seq-length", str(min(positions, 4096)),
        "--init-method-std", repr(float(_get(config, "initializer_range", default=0.02))),
    ]  # fmt: skip
