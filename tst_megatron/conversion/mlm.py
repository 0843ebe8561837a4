"""Megatron-LM's checkpoint ``args`` namespace: what the converter reads from it and how it
makes one.

A checkpoint written by Megatron-LM's ``save_checkpoint`` (the launcher
``examples/pretrain_gpt_tst.py``, i.e. ``megatron.training.pretrain()``) stores the run's
whole ``argparse.Namespace`` as ``args`` in its common state
(``megatron.training.checkpointing.generate_state_dict``), with the values after
``validate_args`` (``kv_channels``, ``ffn_hidden_size``, ``padded_vocab_size``,
``params_dtype`` filled in). The converter works on that namespace directly:

- :func:`check_supported`: refuses (one line naming the flag) every Megatron-LM setting that
  changes the model's function but has no place in a Hugging Face target, so nothing is
  dropped silently; a ``HybridModel`` checkpoint only where its pattern is GPT-shaped
  (:func:`check_hybrid`).
- :func:`~tst_megatron.models.pattern.gpt_equivalent` / :func:`hybrid_to_gpt_names`: a
  GPT-shaped ``HybridModel`` (``*-`` / ``*E`` pairs, ``examples/pretrain_hybrid_tst.py``) as
  the ``GPTModel`` it equals, so that it exports to the same Hugging Face families.
- :func:`one_process_args` / :func:`transformer_config`: the namespace of the same model in
  one CPU process, and its ``TransformerConfig`` by Megatron-LM's own
  ``core_transformer_config_from_args`` (the shapes the Hugging Face side needs are read
  from it); the model itself is built by the launcher's
  :attr:`~tst_megatron.models.family.ModelFamily.build`.
- :func:`megatron_lm_namespace`: model flags -> the ``Namespace`` Megatron-LM's parser and
  ``validate_args`` produce, which an imported ``release`` checkpoint stores so that
  Megatron-LM's ``load_checkpoint`` (``--load``, ``--use-checkpoint-args``) reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import re
import sys
from typing import Iterator, Optional, Sequence

import torch

from tst_megatron.models.pattern import pattern_of
from tst_megatron.training.flags import add_tst_args

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
    ("spec", None, "--spec"),
    ("use_mup", False, "--use-mup"),
    ("moe_router_enable_expert_bias", False, "--moe-router-enable-expert-bias"),
    ("moe_router_topk_scaling_factor", None, "--moe-router-topk-scaling-factor"),
    ("moe_router_num_groups", None, "--moe-router-num-groups"),
    ("moe_latent_size", None, "--moe-latent-size"),
    ("moe_shared_expert_gate", False, "--moe-shared-expert-gate"),
)  # fmt: skip


def layer_pattern(text: str, *, limit: int) -> list[int]:
    """A ``--moe-layer-freq`` list pattern (``"([1]*3+[0])*2"``: lists of integers, ``+``,
    ``* n`` and parentheses, the expressions Megatron-LM's ``moe_freq_type`` evaluates),
    parsed without ``eval``.

    Raises:
        ValueError: anything else, or a list longer than ``limit`` at any step (a pattern such
            as ``[1]*9**9`` is refused before it grows).
    """
    tokens = re.findall(r"\d+|[\[\]()*+,]|\S", text)
    at = 0

    def fail(why: str):
        raise ValueError(f"--moe-layer-freq {text!r} is not a layer pattern ({why})")

    def take(expected=None):
        nonlocal at
        if at >= len(tokens) or (expected and tokens[at] != expected):
            fail(f"expected {expected!r}" if expected else "it ends early")
        at += 1
        return tokens[at - 1]

    def atom() -> list:
        token = take()
        if token == "(":
            inner = expr()
            take(")")
            return inner
        if token != "[":
            fail(f"unexpected {token!r}")
        items = []
        while tokens[at : at + 1] != ["]"]:
            item = take()
            if not item.isdigit():
                fail(f"unexpected {item!r}")
            items.append(int(item))
            if tokens[at : at + 1] == [","]:
                take(",")
        take("]")
        return items

    def term() -> list:
        value = atom()
        while tokens[at : at + 1] == ["*"]:
            take("*")
            count = take()
            if not count.isdigit():
                fail(f"unexpected {count!r}")
            if len(value) * int(count) > limit:
                fail(f"longer than the {limit} layers")
            value = value * int(count)
        return value

    def expr() -> list:
        value = term()
        while tokens[at : at + 1] == ["+"]:
            take("+")
            value = value + term()
            if len(value) > limit:
                fail(f"longer than the {limit} layers")
        return value

    result = expr()
    if at != len(tokens):
        fail(f"unexpected {tokens[at]!r}")
    return result


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
    if isinstance(value, str):  # Megatron-LM's moe_freq_type evaluates such a pattern
        value = layer_pattern(value, limit=num_layers)
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
    # megatron-core: heavy, imported when used
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


#: The model-parallel settings of ``args`` that :func:`one_process_args` sets to one process.
_ONE_PROCESS = dict(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    expert_model_parallel_size=1,
    expert_tensor_parallel_size=1,
    context_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    num_layers_per_virtual_pipeline_stage=None,
    num_virtual_stages_per_pipeline_rank=None,
    pipeline_model_parallel_layout=None,
    decoder_first_pipeline_num_layers=None,
    decoder_last_pipeline_num_layers=None,
    account_for_embedding_in_pipeline_split=False,
    account_for_loss_in_pipeline_split=False,
    sequence_parallel=False,
)


#: Hybrid layer symbols with no place in the Hugging Face targets (megatron-core 0.19.2's
#: ``hybrid_layer_allocation.Symbols``).
_NO_PLACE = {"M": "Mamba-2", "G": "gated delta net", "D": "DeepSeek sparse attention",
             "+": "multi-latent attention"}  # fmt: skip


def check_hybrid(ns) -> None:
    """Refuse a ``HybridModel`` checkpoint's ``args`` ``ns`` whose pattern is not
    GPT-shaped (:attr:`~tst_megatron.models.pattern.HybridPattern.gpt_shaped`): the Hugging
    Face targets hold GPT layers.

    Raises:
        ValueError: one line naming the pattern and what has no place.
    """
    pattern = pattern_of(ns)
    if pattern is None:
        return
    head = f"--hybrid-layer-pattern {pattern.text}: the Hugging Face targets hold GPT layers"
    if pattern.mtp_depths:
        raise ValueError(f"{head}; its multi-token prediction layers (after '/') have no place")
    families = sorted({c for c in pattern.main if c in _NO_PLACE})
    if families:
        names = ", ".join(f"{c} ({_NO_PLACE[c]})" for c in families)
        raise ValueError(f"{head}; its {names} layers have no place")
    if not pattern.gpt_shaped:
        raise ValueError(
            f"{head}, each an attention layer '*' followed by its MLP '-' or MoE 'E' layer; "
            f"{pattern.main!r} does not pair up that way"
        )


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")


def hybrid_to_gpt_names(state: dict, ns) -> dict:
    """``state`` (``{name: tensor}`` of a 1-process GPT-shaped ``HybridModel``) under the
    names of the ``GPTModel`` it equals (:func:`~tst_megatron.models.pattern.gpt_equivalent`): hybrid layer ``2i``
    (attention: ``input_layernorm``, ``self_attention``) and ``2i + 1`` (``pre_mlp_layernorm``,
    ``mlp``) are GPT layer ``i``; ``decoder.final_norm`` is ``decoder.final_layernorm``
    (``gpt_checkpoint_interop``'s ``_GPT_FINAL_NORM_KEY_MAP``).

    Raises:
        ValueError: a tensor not where the pattern puts it (named).
    """
    out = {}
    for name, tensor in state.items():
        m = _LAYER.match(name)
        if m:
            h, rest = int(m.group(1)), m.group(2)
            attention = rest.startswith(("input_layernorm.", "self_attention."))
            mlp = rest.startswith(("pre_mlp_layernorm.", "mlp."))
            if not (attention and h % 2 == 0) and not (mlp and h % 2 == 1):
                raise ValueError(f"{name}: not an attention/MLP tensor of a '*X' pair")
            name = f"decoder.layers.{h // 2}.{rest}"
        elif name.startswith("decoder.final_norm."):
            name = name.replace("decoder.final_norm.", "decoder.final_layernorm.", 1)
        out[name] = tensor
    return out


def check_supported(ns) -> None:
    """Refuse a checkpoint's ``args`` ``ns`` with a setting of :data:`UNSUPPORTED` away from
    its default, or a ``HybridModel`` pattern that is not GPT-shaped (:func:`check_hybrid`).

    Raises:
        ValueError: one line naming the flag and its value.
    """
    check_hybrid(ns)
    for dest, default, flag in UNSUPPORTED:
        if dest == "add_qkv_bias" and getattr(ns, "add_bias_linear", False):
            continue  # set by validate_args from --add-bias-linear, whose own rule names it
        value = getattr(ns, dest, default)
        if value != default and not (default is False and value is None):
            raise ValueError(
                f"{flag} {value}: the converter has no place for it (Qwen3-MoE, Mixtral, Qwen3 "
                "and Llama have no such setting)"
            )


def one_process_args(ns) -> argparse.Namespace:
    """A copy of Megatron-LM ``args`` ``ns`` for the same model in one CPU process: every
    model-parallel size 1 (:data:`_ONE_PROCESS`; weight shards derived from them, no GTP
    rematerialisation), megatron-core's local layer spec
    (``--transformer-impl local``, no grouped GEMM: ``SequentialMLP``, whose checkpoint
    tensors are interchangeable with the grouped ones), CPU initialisation, no fused CUDA
    kernels, FP8/FP4 off, dropout 0 (evaluation)."""
    out = copy.copy(ns)
    for name, value in _ONE_PROCESS.items():
        setattr(out, name, value)
    if getattr(out, "hybrid_layer_pattern", None):  # one pipeline stage: no '|'
        out.hybrid_layer_pattern = out.hybrid_layer_pattern.replace("|", "")
    for name in ("tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards"):
        setattr(out, name, None)  # megatron-core derives them from the sizes (no GTP)
    out.gtp_weight_remat_size = out.expert_gtp_weight_remat_size = 1
    out.transformer_impl = "local"
    out.moe_grouped_gemm = False
    out.use_cpu_initialization = True
    out.gradient_accumulation_fusion = False
    out.persist_layer_norm = False
    out.apply_rope_fusion = False
    out.bias_swiglu_fusion = out.bias_gelu_fusion = out.bias_dropout_fusion = False
    out.masked_softmax_fusion = False
    out.fp8 = out.fp4 = None
    out.hidden_dropout = out.attention_dropout = 0.0
    return out


def transformer_config(ns):
    """megatron-core's ``TransformerConfig`` of checkpoint ``args`` ``ns`` in one process:
    Megatron-LM's ``core_transformer_config_from_args`` on :func:`one_process_args` (what the
    launcher's model provider uses, through ``gpt_config_from_args``)."""
    # Megatron-LM's training package: heavy, imported where it runs
    from megatron.training.argument_utils import core_transformer_config_from_args

    return core_transformer_config_from_args(one_process_args(ns))


def vocab_size(ns) -> int:
    """The vocabulary before padding (see :func:`_vocab_size`)."""
    return _vocab_size(ns)


def layer_freq(ns) -> int:
    """``--moe-layer-freq`` of ``ns`` as every n-th layer (see :func:`_layer_freq`)."""
    return _layer_freq(ns.moe_layer_freq, ns.num_layers)


def dtype_name(ns) -> str:
    """``params_dtype`` of ``ns`` as ``float32`` / ``bfloat16`` / ``float16``."""
    dtype = ns.params_dtype
    return str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else str(dtype)


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
    # megatron.training (Megatron-LM) is heavy: imported by the conversions that need it
    from megatron.training.arguments import parse_args, validate_args

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
