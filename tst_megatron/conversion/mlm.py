"""Megatron-LM's own checkpoint ``args`` <-> the converter's architecture dict.

A checkpoint written by Megatron-LM's ``save_checkpoint`` (the launcher
``examples/pretrain_gpt_tst_mlm.py``, i.e. ``megatron.training.pretrain()``) stores the run's
whole ``argparse.Namespace`` as ``args`` in its common state
(``megatron.training.checkpointing.generate_state_dict``), with the values after
``validate_args`` (``kv_channels``, ``ffn_hidden_size``, ``padded_vocab_size``,
``params_dtype`` filled in). The converter itself works on a small dict of the architecture
(``{"model", "moe", "padded_vocab_size", "params_dtype", "tokenizer"}``, the layout the
hand-written trainer stores, :func:`tst_megatron.training.checkpointing.checkpoint_args`):

- :func:`converter_args`: a Megatron-LM ``Namespace`` -> that dict, refusing (one line naming
  the flag) every Megatron-LM setting that changes the model's function but has no place in
  the dict or in a Hugging Face target, so nothing is dropped silently.
- :func:`megatron_lm_namespace`: that dict -> the ``Namespace`` Megatron-LM's parser and
  ``validate_args`` produce for the flags that rebuild the architecture, which an imported
  ``release`` checkpoint stores so that Megatron-LM's ``load_checkpoint`` (``--load``,
  ``--use-checkpoint-args``) reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import enum
import io
import os
import re
import sys
from typing import Iterator, Optional, Sequence

import torch

#: Megatron-LM settings (``args`` dest, default, flag) that change the model's function and
#: that neither the converter's dict nor a Qwen3-MoE/Mixtral/Qwen3/Llama config can hold.
#: A checkpoint with another value is refused, naming the flag.
UNSUPPORTED = (
    ("multi_latent_attention", False, "--multi-latent-attention"),
    ("mtp_num_layers", None, "--mtp-num-layers"),
    ("rotary_interleaved", False, "--rotary-interleaved"),
    ("use_rope_scaling", False, "--use-rope-scaling"),
    ("rope_type", None, "--rope-type"),
    ("no_rope_freq", None, "--no-rope-freq"),
    ("squared_relu", False, "--squared-relu"),
    ("quick_geglu", False, "--quick-geglu"),
    ("glu_linear_offset", 0.0, "--glu-linear-offset"),
    ("activation_func_clamp_value", None, "--activation-func-clamp-value"),
    ("add_qkv_bias", False, "--add-qkv-bias"),
    ("softmax_type", "vanilla", "--softmax-type"),
    ("window_size", None, "--window-size"),
    ("qk_l2_norm", False, "--qk-l2-norm"),
    ("attention_output_gate", False, "--attention-output-gate"),
    ("apply_residual_connection_post_layernorm", False,
     "--apply-residual-connection-post-layernorm"),
    ("layernorm_zero_centered_gamma", False, "--apply-layernorm-1p"),
    ("experimental_attention_variant", None, "--experimental-attention-variant"),
    ("heterogeneous_layers_config_path", None, "--heterogeneous-layers-config-path"),
    ("heterogeneous_layers_config_encoded_json", None,
     "--heterogeneous-layers-config-encoded-json"),
    ("hybrid_layer_pattern", None, "--hybrid-layer-pattern"),
    ("spec", None, "--spec"),
    ("use_mup", False, "--use-mup"),
    ("moe_router_enable_expert_bias", False, "--moe-router-enable-expert-bias"),
    ("moe_router_topk_scaling_factor", None, "--moe-router-topk-scaling-factor"),
    ("moe_router_num_groups", None, "--moe-router-num-groups"),
    ("moe_latent_size", None, "--moe-latent-size"),
    ("moe_shared_expert_gate", False, "--moe-shared-expert-gate"),
)  # fmt: skip

#: Converter dict field -> Megatron-LM ``args`` dest, where the names differ.
_RENAMED = {
    "norm_epsilon": "layernorm_epsilon",
    "apply_layernorm_1p": "layernorm_zero_centered_gamma",
}


def is_megatron_lm(args) -> bool:
    """True for Megatron-LM's ``args`` (a ``Namespace``; the trainer stores a dict)."""
    return not isinstance(args, dict)


def _layer_freq(value, num_layers: int) -> int:
    """``--moe-layer-freq`` as the every-n-th integer the converter's targets use.

    Megatron-LM keeps an int, or after ``validate_args`` possibly a 0/1 list per layer
    (a string pattern such as ``"([1]*3+[0])*2"`` evaluated). A list is accepted when it
    is ``i % n == 0`` for some ``n``.

    Raises:
        ValueError: a pattern that is not every n-th layer from layer 0.
    """
    if isinstance(value, int):
        return value
    if isinstance(value, str):  # Megatron-LM's moe_freq_type evaluates such a pattern too
        if not re.fullmatch(r"[\[\]()0-9*+, ]+", value):
            raise ValueError(f"--moe-layer-freq {value!r} is not a layer pattern")
        value = eval(value, {"__builtins__": {}})
    pattern = list(value)
    for n in range(1, num_layers + 1):
        if pattern == [int(i % n == 0) for i in range(num_layers)]:
            return n
    raise ValueError(
        f"--moe-layer-freq {value}: the MoE layers are not every n-th layer from layer 0, "
        "which is what the Hugging Face targets hold"
    )


def _vocab_size(ns) -> int:
    """The vocabulary before padding: ``--vocab-size``, else the size of the run's tokenizer
    (Megatron-LM's ``build_tokenizer`` on the saved tokenizer settings).

    Raises:
        ValueError: neither is available (names the tokenizer file).
    """
    if getattr(ns, "vocab_size", None):
        return int(ns.vocab_size)
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    probe = copy.copy(ns)
    try:
        return int(build_tokenizer(probe).vocab_size)
    except Exception as exc:  # a missing tokenizer file, an unknown type...
        raise ValueError(
            f"the checkpoint stores no --vocab-size and its tokenizer ({ns.tokenizer_type} "
            f"{getattr(ns, 'tokenizer_model', None)}) cannot be built here ({exc}); run the "
            "export where the tokenizer file exists"
        ) from None


def converter_args(ns) -> dict:
    """The converter's architecture dict for Megatron-LM checkpoint ``args`` ``ns``.

    Returns:
        ``{"model": {...}, "moe": {...}, "hf_dtype": str | None, "padded_vocab_size": int,
        "params_dtype": "float32" | "bfloat16" | "float16", "tokenizer": {"type", "model"}}``
        (``hf_dtype``: the dtype of an imported Hugging Face model, else None): the fields of
        :class:`~tst_megatron.training.config.ModelArgs` / ``MoEArgs`` read from the
        Megatron-LM dests of the same name (``norm_epsilon`` from ``layernorm_epsilon``,
        ``apply_layernorm_1p`` from ``layernorm_zero_centered_gamma``,
        ``disable_bias_linear`` = not ``add_bias_linear``), dropout 0.

    Raises:
        ValueError: a setting of :data:`UNSUPPORTED` is not at its default, or the
            vocabulary size cannot be found (one line naming the flag).
    """
    import dataclasses

    from tst_megatron.training.config import ModelArgs, MoEArgs

    for dest, default, flag in UNSUPPORTED:
        value = getattr(ns, dest, default)
        if value != default and not (default is False and value is None):
            raise ValueError(
                f"{flag} {value}: the converter has no place for it (Qwen3-MoE, Mixtral, Qwen3 "
                "and Llama have no such setting)"
            )
    model = {}
    for field in dataclasses.fields(ModelArgs):
        value = getattr(ns, _RENAMED.get(field.name, field.name), field.default)
        model[field.name] = value.name if isinstance(value, enum.Enum) else value  # AttnBackend
    model["disable_bias_linear"] = not ns.add_bias_linear
    model["vocab_size"] = _vocab_size(ns)
    model["hidden_dropout"] = model["attention_dropout"] = 0.0
    if not model.get("ffn_hidden_size"):
        model["ffn_hidden_size"] = None
    moe = {f.name: getattr(ns, f.name, f.default) for f in dataclasses.fields(MoEArgs)}
    if moe["num_experts"]:
        moe["moe_layer_freq"] = _layer_freq(moe["moe_layer_freq"], ns.num_layers)
    dtype = ns.params_dtype
    dtype = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else str(dtype)
    return {
        "model": model,
        "moe": moe,
        "hf_dtype": getattr(ns, "hf_dtype", None),
        "padded_vocab_size": int(ns.padded_vocab_size),
        "params_dtype": dtype,
        "tokenizer": {
            "type": ns.tokenizer_type,
            "model": getattr(ns, "tokenizer_model", None),
        },
    }


@contextlib.contextmanager
def _one_process_argv(argv: Sequence[str]) -> Iterator[None]:
    """``sys.argv`` = ``argv`` and ``RANK``/``WORLD_SIZE`` of one process, for Megatron-LM's
    parser (which reads both), restored afterwards."""
    saved_argv = sys.argv
    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    sys.argv = ["convert_checkpoint.py", *argv]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        yield
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def megatron_lm_namespace(
    flags: Sequence[str], *, padded_vocab_size: int, vocab_size: Optional[int] = None
) -> argparse.Namespace:
    """The ``args`` Megatron-LM's launcher would hold for model ``flags``: Megatron-LM's
    ``parse_args`` (with the launcher's ``--tst-*`` extra arguments) and ``validate_args``
    on ``flags`` plus the minimum a parse needs (``--micro-batch-size 1``,
    ``--train-iters 0``), as Megatron-LM's own checkpoint converters build theirs.

    The namespace describes a weights-only checkpoint: ``iteration`` and the consumed-sample
    counters are 0, ``no_save_optim`` and ``no_save_rng`` are True (no optimizer or RNG state
    is stored), ``padded_vocab_size`` and ``vocab_size`` are the given values.

    Raises:
        ValueError: Megatron-LM's validation refused the flags (its message).
    """
    from megatron.training.arguments import parse_args, validate_args

    from tst_megatron.training.megatron_lm import add_tst_args

    argv = [*flags, "--micro-batch-size", "1", "--train-iters", "0", "--lr", "0"]
    with _one_process_argv(argv), contextlib.redirect_stdout(io.StringIO()):  # its listing
        ns = parse_args(extra_args_provider=add_tst_args)
        try:
            validate_args(ns)
        except (AssertionError, ValueError) as exc:  # validate_args raises both
            raise ValueError(f"Megatron-LM's argument validation: {exc}") from None
    ns.padded_vocab_size = padded_vocab_size
    if vocab_size is not None:
        ns.vocab_size = vocab_size
    ns.iteration = 0
    ns.consumed_train_samples = ns.consumed_valid_samples = ns.skipped_train_samples = 0
    ns.no_save_optim = ns.no_save_rng = True
    ns.train_iters = None
    return ns
