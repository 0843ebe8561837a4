"""Hugging Face side of the conversion: ``config.json`` <-> checkpoint ``args``, and the
safetensors/tokenizer files of a Hugging Face model directory.

The config is built and read through ``transformers``' own config classes
(``AutoConfig.for_model`` / ``AutoConfig.from_pretrained``), so the files are written the
way the installed ``transformers`` writes them; safetensors shards are split by
``huggingface_hub.split_torch_state_dict_into_shards`` with the standard index file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Dict, Optional, Tuple

import torch

from tst_megatron.conversion.rules import ARCHITECTURES, Architecture, Shapes, architecture_for
from tst_megatron.training.model import ffn_hidden_size

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


def shapes_of(args: dict) -> Shapes:
    """:class:`~tst_megatron.conversion.rules.Shapes` from checkpoint ``args``."""
    m = args["model"]
    heads = m["num_attention_heads"]
    return Shapes(
        num_attention_heads=heads,
        num_query_groups=m["num_query_groups"] if m["group_query_attention"] else heads,
        head_dim=m.get("kv_channels") or m["hidden_size"] // heads,
        vocab_size=m["vocab_size"],
        padded_vocab_size=args["padded_vocab_size"],
    )


def target_architecture(args: dict) -> Architecture:
    """The Hugging Face architecture for checkpoint ``args``, after checking that every
    setting has a place in it.

    Qwen3-MoE for experts + qk-layernorm, Mixtral for experts without, Qwen3 / Llama for the
    dense models with / without qk-layernorm.

    Raises:
        ValueError: one line naming the first setting no target can represent.
    """
    m, moe = args["model"], args["moe"]
    targets = "Qwen3-MoE, Mixtral, Qwen3 or Llama"
    if m["normalization"] != "RMSNorm":
        raise ValueError(f"--normalization {m['normalization']}: {targets} use RMSNorm")
    if m["position_embedding_type"] != "rope":
        raise ValueError(
            f"--position-embedding-type {m['position_embedding_type']}: {targets} use RoPE"
        )
    if m.get("rotary_percent", 1.0) != 1.0:
        raise ValueError(
            f"--rotary-percent {m['rotary_percent']}: {targets} rotate every channel of a head"
        )
    if m.get("rotary_seq_len_interpolation_factor") not in (None, 1):
        raise ValueError(
            f"--rotary-seq-len-interpolation-factor {m['rotary_seq_len_interpolation_factor']}: "
            f"{targets} are exported without RoPE scaling"
        )
    if not m["swiglu"]:
        raise ValueError(f"the MLPs are not SwiGLU (no --swiglu): {targets} use SwiGLU")
    if not m["disable_bias_linear"]:
        raise ValueError(
            f"linear layers have biases (no --disable-bias-linear): {targets} have none"
        )
    arch = architecture_for(moe=bool(moe.get("num_experts")), qk_layernorm=m["qk_layernorm"])
    if arch.moe:
        if moe.get("moe_shared_expert_intermediate_size"):
            raise ValueError(
                f"--moe-shared-expert-intermediate-size: {arch.name} has no shared expert"
            )
        if moe.get("moe_router_score_function", "softmax") != "softmax":
            raise ValueError(
                f"--moe-router-score-function {moe['moe_router_score_function']}: "
                f"{arch.name} routes with a softmax"
            )
        if arch.model_type == "mixtral" and moe.get("moe_router_pre_softmax"):
            raise ValueError("--moe-router-pre-softmax: Mixtral renormalises the top-k weights")
        if arch.model_type == "mixtral" and moe.get("moe_layer_freq", 1) != 1:
            raise ValueError(
                f"--moe-layer-freq {moe['moe_layer_freq']}: every Mixtral layer is MoE"
            )
    return arch


def hf_config(args: dict, *, dtype: str, special_ids: Optional[dict] = None):
    """The ``transformers`` config object for checkpoint ``args`` (see :func:`target_architecture`).

    Args:
        args: checkpoint ``args`` (:func:`tst_megatron.training.checkpointing.checkpoint_args`).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (the config's ``dtype``).
        special_ids: ``bos_token_id``/``eos_token_id``/``pad_token_id`` when known.

    Raises:
        ValueError: see :func:`target_architecture`.
    """
    transformers = require_transformers()
    arch = target_architecture(args)
    m, moe = args["model"], args["moe"]
    s = shapes_of(args)
    ffn = ffn_hidden_size(m.get("ffn_hidden_size"), m["hidden_size"], swiglu=m.get("swiglu", False))
    kwargs = dict(
        vocab_size=s.vocab_size,
        hidden_size=m["hidden_size"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_query_groups,
        head_dim=s.head_dim,
        hidden_act="silu",
        max_position_embeddings=m.get("max_position_embeddings") or m["seq_length"],
        rms_norm_eps=m.get("norm_epsilon", 1e-5),
        rope_theta=float(m["rotary_base"]),
        tie_word_embeddings=not m["untie_embeddings_and_output_weights"],
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=m["init_method_std"],
        dtype=dtype,
        **(special_ids or {}),
    )
    if arch.moe:
        experts_ffn = moe.get("moe_ffn_hidden_size") or ffn
        kwargs.update(
            num_experts_per_tok=moe["moe_router_topk"],
            router_aux_loss_coef=moe.get("moe_aux_loss_coeff") or 0.0,
        )
    if arch.model_type == "qwen3_moe":
        freq = moe.get("moe_layer_freq", 1)
        kwargs.update(
            num_experts=moe["num_experts"],
            moe_intermediate_size=experts_ffn,
            intermediate_size=ffn,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(m["num_layers"]) if i % freq != 0],
            norm_topk_prob=not moe.get("moe_router_pre_softmax", False),
            use_sliding_window=False,
        )
    elif arch.model_type == "mixtral":
        kwargs.update(
            num_local_experts=moe["num_experts"], intermediate_size=experts_ffn, sliding_window=None
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


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def args_from_hf(
    config, *, make_vocab_size_divisible_by: int = 128, tp: int = 1
) -> Tuple[dict, Architecture]:
    """Checkpoint ``args`` for a Hugging Face config of a supported architecture.

    Args:
        config: a ``transformers`` config (``AutoConfig.from_pretrained``).
        make_vocab_size_divisible_by / tp: Megatron's vocabulary padding
            (``--make-vocab-size-divisible-by`` x ``--tensor-model-parallel-size``).

    Returns:
        ``(args, architecture)``; ``args["model"]``/``["moe"]`` hold the values of the
        trainer's flags of the same names.

    Raises:
        ValueError: an unsupported ``model_type`` or a setting Megatron's model here cannot
            represent (biases, non-SiLU activation, RoPE scaling, sliding windows, a dense-layer
            pattern that is not every n-th layer), named in one line.
    """
    from tst_megatron.training.config import ModelArgs, MoEArgs
    from tst_megatron.training.model import padded_vocab_size

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
    model = dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        group_query_attention=kv_heads != heads,
        num_query_groups=kv_heads if kv_heads != heads else 1,
        kv_channels=head_dim,
        seq_length=min(config.max_position_embeddings, 4096),
        max_position_embeddings=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        normalization="RMSNorm",
        norm_epsilon=config.rms_norm_eps,
        swiglu=True,
        untie_embeddings_and_output_weights=not getattr(config, "tie_word_embeddings", False),
        disable_bias_linear=True,
        qk_layernorm=arch.qk_layernorm,
        init_method_std=_get(config, "initializer_range", default=0.02),
        vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    moe: Dict[str, object] = dict(num_experts=None)
    if model_type == "qwen3_moe":
        step = _get(config, "decoder_sparse_step", default=1)
        dense = set(_get(config, "mlp_only_layers", default=[]) or [])
        sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        freq = next(
            (f for f in range(1, layers + 1) if sparse == [i for i in range(layers) if i % f == 0]),
            None,
        )
        if freq is None:
            raise ValueError(
                f"MoE layers {sparse} are not every n-th layer from layer 0 (--moe-layer-freq n)"
            )
        model["ffn_hidden_size"] = config.intermediate_size
        moe = dict(
            num_experts=_get(config, "num_experts", "num_local_experts"),
            moe_ffn_hidden_size=config.moe_intermediate_size,
            moe_layer_freq=freq,
            moe_router_pre_softmax=not getattr(config, "norm_topk_prob", True),
        )
    elif model_type == "mixtral":
        model["ffn_hidden_size"] = config.intermediate_size
        moe = dict(
            num_experts=_get(config, "num_local_experts", "num_experts"),
            moe_ffn_hidden_size=config.intermediate_size,
            moe_layer_freq=1,
        )
    else:
        model["ffn_hidden_size"] = config.intermediate_size
    if moe["num_experts"]:
        moe.update(
            moe_router_topk=config.num_experts_per_tok,
            moe_aux_loss_coeff=_get(config, "router_aux_loss_coef", default=0.0),
        )
    dtype = str(_get(config, "dtype", "torch_dtype", default="float32")).replace("torch.", "")
    args = {  # every flag's value, as the trainer stores them
        "model": dict(dataclasses.asdict(ModelArgs()), **model),
        "moe": dict(dataclasses.asdict(MoEArgs()), **moe),
        "padded_vocab_size": padded_vocab_size(
            config.vocab_size, divisible_by=make_vocab_size_divisible_by, tp=tp
        ),
        "params_dtype": "float32",
        "hf_dtype": dtype if dtype in DTYPES else "float32",
        "tokenizer": {"type": "NullTokenizer", "model": None},
    }
    return args, arch


# --- files --------------------------------------------------------------------------------


def read_hf_dir(path: str) -> Tuple[object, Dict[str, torch.Tensor]]:
    """``(config, {name: tensor})`` of a Hugging Face model directory (one
    ``model.safetensors`` or shards with ``model.safetensors.index.json``).

    A tied model's ``lm_head.weight``, if stored anyway, is dropped when it equals
    ``model.embed_tokens.weight``.

    Raises:
        FileNotFoundError: no ``config.json`` or no safetensors weights.
        ValueError: a tied model stores an ``lm_head.weight`` different from the embedding.
    """
    transformers = require_transformers()
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json (not a Hugging Face model directory)")
    config = transformers.AutoConfig.from_pretrained(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json")
    state: Dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in state:
        if not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise ValueError(
                "tie_word_embeddings=true but lm_head.weight differs from the embedding"
            )
        del state["lm_head.weight"]
    return config, state


def write_hf_dir(
    out: str,
    config,
    state: Dict[str, torch.Tensor],
    *,
    max_shard_size="5GB",
    tokenizer_model: Optional[str] = None,
    force: bool = False,
) -> str:
    """Write a Hugging Face model directory ``out``: ``config.json``,
    ``generation_config.json``, ``model.safetensors`` (or shards + index above
    ``max_shard_size``, e.g. ``"5GB"`` or bytes) and, with ``tokenizer_model`` (a
    SentencePiece ``.model``), ``tokenizer.model`` + ``tokenizer_config.json`` for
    ``LlamaTokenizer``.

    Everything is written to ``out + ".tmp"`` and renamed at the end.

    Raises:
        FileExistsError: ``out`` exists and ``force`` is False (nothing is written).
    """
    require_transformers()
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if os.path.exists(out) and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file(
            {n: state[n] for n in names}, os.path.join(tmp, filename), metadata={"format": "pt"}
        )
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    if tokenizer_model:
        write_tokenizer(tmp, tokenizer_model, max_length=config.max_position_embeddings)
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(tmp):  # safetensors writes 0600; give every file the usual mode
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def special_ids(tokenizer_model: Optional[str], vocab_size: int) -> dict:
    """``bos/eos/pad_token_id`` of a SentencePiece model (eos = Megatron's EOD); without a
    model, Megatron's NullTokenizer convention: EOD = ``vocab_size - 1``."""
    if not tokenizer_model:
        return {"eos_token_id": vocab_size - 1}
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
    return {k: v for k, v in ids.items() if v >= 0}


def write_tokenizer(out: str, tokenizer_model: str, max_length: int = 1 << 30) -> None:
    """Copy a SentencePiece model as ``tokenizer.model`` with a ``LlamaTokenizer`` config
    (special pieces read from the model; no BOS/EOS added, as Megatron's tokenizer)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
    shutil.copyfile(tokenizer_model, os.path.join(out, "tokenizer.model"))
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        "legacy": True,
        "model_max_length": max_length,
    }
    for name, index in (
        ("unk_token", sp.unk_id()),
        ("bos_token", sp.bos_id()),
        ("eos_token", sp.eos_id()),
        ("pad_token", sp.pad_id()),
    ):
        if index >= 0:
            config[name] = sp.id_to_piece(index)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
