"""``--dry-run`` of the Megatron-LM launcher (:mod:`tst_megatron.training.megatron_lm`): what a
launch line would do at ``WORLD_SIZE=N``, without starting processes, initialising
``torch.distributed``, reading data or a tokenizer, or building the model.

:func:`dry_run` runs Megatron-LM's own ``parse_args`` and ``validate_args`` (with the
launcher's ``--tst-*`` flags), then the TST checks (:func:`~megatron_lm.tst_problems`) and
Megatron-LM's batch-size schedule checks, and prints the layout, the model and its parameter
counts (:func:`parameter_counts`, arithmetic) and the TST plan; or every problem found, one
``error: ...`` line each (an assertion inside ``validate_args`` becomes one line, not a
traceback). Exit status 0 or 2.

The launch line is checked as a CUDA run (``--device cpu``: as a CPU run, with the flags a CPU
run appends); nothing CUDA is needed here. ``validate_args`` asks the GPU two things, and on
a machine without one the dry run answers them as for :data:`ASSUMED_GPU` (an H100, compute
capability 9.0, the machine the public launch scripts are written for) through a stand-in
``torch`` given to the two Megatron-LM modules that ask (``megatron.training.arguments``,
``megatron.training.utils.common_utils``) for the duration of the call only, then restored:

- ``torch.cuda.get_device_capability()`` with ``--moe-grouped-gemm`` (needs >= 8);
- ``get_device_arch_version()`` (``torch.cuda.get_device_properties``) with TP or CP > 1:
  below Blackwell Megatron-LM asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1``, so that check runs
  as on an H100 against this process's environment (the public scripts export it; export it
  for the dry run too).

After ``validate_args`` the model's ``TransformerConfig`` is built from the arguments
(Megatron-LM's ``core_transformer_config_from_args``; its ``__post_init__`` checks what
``validate_args`` does not, e.g. attention heads divisible by TP): a dataclass, no model.

Transformer Engine is not imported. When it is not installed, the TE version checks of
``validate_args`` and ``TransformerConfig`` (``is_te_min_version`` / ``get_te_version`` in
``megatron.training.arguments`` and ``megatron.core.transformer.transformer_config``:
``--qk-clip``, ``--delay-wgrad-compute``, MoE FP8, ...) are answered for
:data:`ASSUMED_TE_VERSION`, by the same scoped replacement of those names in those modules.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import sys
import traceback
import types
import warnings
from typing import Optional, Sequence
from unittest import mock

import torch

#: What a dry run on a machine without CUDA answers for the GPU (``validate_args`` reads
#: ``major``/``minor``): an H100 (Hopper, compute capability 9.0).
ASSUMED_GPU = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (assumed by --dry-run)",
    major=9,
    minor=0,
    total_memory=80 * 2**30,
    multi_processor_count=132,
)

#: The Transformer Engine version the version checks of ``validate_args`` and
#: ``TransformerConfig`` are answered for when TE is not installed (the highest version
#: megatron-core 0.19's checks ask about).
ASSUMED_TE_VERSION = "2.14.0"

#: The Megatron-LM modules whose ``torch`` global is the stand-in during validation.
_GPU_ASKING_MODULES = ("megatron.training.arguments", "megatron.training.utils.common_utils")

#: The modules whose ``is_te_min_version`` (and ``get_te_version``) answer for
#: :data:`ASSUMED_TE_VERSION` during validation when TE is not installed.
_TE_ASKING_MODULES = ("megatron.training.arguments", "megatron.core.transformer.transformer_config")


# --- parameter counts ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    """Parameters of the whole model (all pipeline stages, before any sharding; a tied
    output layer counted once)."""

    total: int
    """Every parameter."""
    active: int
    """Parameters a token goes through: ``total`` less the ``E - topk`` unrouted experts of
    each MoE layer (MTP layers included)."""
    embedding: int
    """Input embedding + learned positions + untied output layer (0: vocabulary unknown)."""
    mtp: int
    """The multi-token-prediction layers (``--mtp-num-layers``; 0 without)."""


def _norm(args, size: int) -> int:
    """Parameters of one norm over ``size`` features: LayerNorm weight + bias, RMSNorm weight."""
    return (2 if args.normalization == "LayerNorm" else 1) * size


def _attention(args) -> int:
    """One self-attention block with its input norm (megatron-core ``SelfAttention`` or
    ``MLASelfAttention``, local and Transformer Engine specs alike)."""
    h, heads = args.hidden_size, args.num_attention_heads
    bias = args.add_bias_linear
    sinks = heads if getattr(args, "softmax_type", "vanilla") == "learnable" else 0
    if args.multi_latent_attention:
        # MLASelfAttention.__init__: q (direct or down/up through q_lora_rank), kv down to
        # kv_lora_rank + rope dims, kv up to heads * (qk + v), norms on the low ranks with
        # --qk-layernorm (the local spec; TE fuses them into the up projections), no biases
        # except linear_proj's.
        q_head = args.qk_head_dim + args.qk_pos_emb_head_dim
        if args.q_lora_rank is None:
            q = h * heads * q_head
        else:
            q = h * args.q_lora_rank + args.q_lora_rank * heads * q_head
            q += _norm(args, args.q_lora_rank) if args.qk_layernorm else 0
        kv = h * (args.kv_lora_rank + args.qk_pos_emb_head_dim)
        kv += args.kv_lora_rank * heads * (args.qk_head_dim + args.v_head_dim)
        kv += _norm(args, args.kv_lora_rank) if args.qk_layernorm else 0
        proj = heads * args.v_head_dim * h + (h if bias else 0)
        return _norm(args, h) + q + kv + proj + sinks
    d = args.kv_channels
    groups = args.num_query_groups if args.group_query_attention else heads
    qkv_out = (heads + 2 * groups) * d
    qkv = h * qkv_out + (qkv_out if args.add_qkv_bias else 0)
    proj = heads * d * h + (h if bias else 0)
    qk_norm = 2 * _norm(args, d) if args.qk_layernorm else 0
    return _norm(args, h) + qkv + proj + qk_norm + sinks


def _mlp(args, width: int, hidden: Optional[int] = None) -> int:
    """One megatron-core ``MLP`` (fc1 ``h x f``, doubled when gated: ``--swiglu`` or
    ``--quick-geglu``; fc2 ``f x h``; biases with ``--add-bias-linear``)."""
    h = args.hidden_size if hidden is None else hidden
    gated = bool(args.swiglu or getattr(args, "quick_geglu", False))
    up = width * (2 if gated else 1)
    return h * up + width * h + ((up + h) if args.add_bias_linear else 0)


def moe_layer_pattern(args) -> list[int]:
    """1 for each MoE layer of ``--num-layers`` (``--moe-layer-freq``: an int ``k`` makes every
    ``k``-th layer from the first MoE; a list is the pattern itself), all 0 without experts.
    Megatron-LM's ``TransformerConfig.moe_layer_freq`` rule."""
    if not args.num_experts:
        return [0] * args.num_layers
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]
    return [int(x) for x in freq]


def parameter_counts(args, padded_vocab: Optional[int]) -> ParameterCounts:
    """Parameter counts of the ``GPTModel`` that validated Megatron-LM arguments ``args`` build,
    by arithmetic (no model is built): megatron-core 0.19's module shapes.

    Per layer: the input norm and attention (:func:`_attention`: GQA/MHA ``linear_qkv`` and
    ``linear_proj``, q/k norms with ``--qk-layernorm``, one learnable softmax offset per head
    with ``--softmax-type learnable``; or MLA's projections), the pre-MLP norm, and either a
    dense MLP of ``--ffn-hidden-size`` or an MoE layer: router ``E x h`` (+ ``E`` biases),
    ``E`` experts of ``--moe-ffn-hidden-size``, the shared expert
    (``--moe-shared-expert-intermediate-size``, its gate with ``--moe-shared-expert-gate``),
    latent projections ``2 h x latent`` (``--moe-latent-size``). Plus the final norm, the
    embedding ``V x h`` (+ learned positions), an untied output layer ``V x h``, and per MTP
    layer two norms, ``eh_proj`` ``2h x h``, a transformer layer like the last decoder
    layer and a final norm (``MultiTokenPredictionLayer``; embedding and output shared).
    Megatron-LM's ``compute_weight_and_optimizer_memory`` (theoretical_memory_usage.py) is
    the same sum without biases, q/k norms, sinks and the MTP layer's own weights.

    Args:
        args: validated Megatron-LM arguments (``validate_args`` has filled ``kv_channels``,
            ``ffn_hidden_size``, ``moe_ffn_hidden_size``, ``add_qkv_bias``).
        padded_vocab: ``V`` after Megatron-LM's padding; None = unknown (embedding not counted).

    Raises:
        NotImplementedError: a model this count does not cover (hybrid/heterogeneous models,
            experimental attention variants), naming it.
    """
    for flag, on in (
        (
            "--heterogeneous-layers-config-path",
            getattr(args, "heterogeneous_layers_config_path", None),
        ),
        ("--hybrid-override-pattern", getattr(args, "hybrid_override_pattern", None)),
        ("--experimental-attention-variant", getattr(args, "experimental_attention_variant", None)),
    ):
        if on:
            raise NotImplementedError(f"not counted for {flag}")
    h = args.hidden_size
    attention = _attention(args)
    norm = _norm(args, h)
    dense = attention + norm + _mlp(args, args.ffn_hidden_size)
    experts = args.num_experts or 0
    if experts:
        latent = getattr(args, "moe_latent_size", None)
        expert = _mlp(args, args.moe_ffn_hidden_size, hidden=latent or h)
        shared_width = args.moe_shared_expert_intermediate_size
        shared = _mlp(args, shared_width) if shared_width else 0
        if shared_width and getattr(args, "moe_shared_expert_gate", False):
            shared += h
        router = experts * h + (experts if args.add_bias_linear else 0)
        moe_rest = attention + norm + router + shared + (2 * h * latent if latent else 0)
        unrouted = (experts - args.moe_router_topk) * expert
    else:
        expert = moe_rest = unrouted = 0
    pattern = moe_layer_pattern(args)
    n_moe = sum(pattern)
    moe_layer = moe_rest + experts * expert
    layers = (args.num_layers - n_moe) * dense + n_moe * moe_layer + norm
    mtp_layers = getattr(args, "mtp_num_layers", None) or 0
    mtp_is_moe = bool(pattern[-1]) if pattern else False
    mtp = mtp_layers * (3 * norm + 2 * h * h + (moe_layer if mtp_is_moe else dense))
    embedding = 0
    if padded_vocab:
        tied = not args.untie_embeddings_and_output_weights
        embedding = padded_vocab * h * (1 if tied else 2)
        if args.position_embedding_type == "learned_absolute":
            embedding += args.max_position_embeddings * h
    total = layers + mtp + embedding
    active = total - (n_moe + (mtp_layers if mtp_is_moe else 0)) * unrouted
    return ParameterCounts(total=total, active=active, embedding=embedding, mtp=mtp)


def padded_vocab_size(args) -> Optional[int]:
    """``V`` as Megatron-LM pads it (``vocab_utils.calculate_padded_vocab_size``: a multiple of
    ``--make-vocab-size-divisible-by x TP``), when the launch line gives it without a
    tokenizer file (``--tokenizer-type NullTokenizer --vocab-size V``); None otherwise (a
    dry run reads no tokenizer)."""
    if args.tokenizer_type != "NullTokenizer" or not args.vocab_size:
        return None
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    return calculate_padded_vocab_size(
        args.vocab_size,
        args.make_vocab_size_divisible_by,
        args.tensor_model_parallel_size,
        logging_enabled=False,
    )


# --- validation without a GPU --------------------------------------------------------------


class _AssumedCuda(types.ModuleType):
    """``torch.cuda`` as the two GPU-asking Megatron-LM modules see it in a dry run without
    CUDA: device properties and capability of :data:`ASSUMED_GPU`, the rest torch's."""

    def __init__(self):
        super().__init__("torch.cuda (tst_megatron dry-run stand-in)")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def get_device_properties(device=None):
        return ASSUMED_GPU

    @staticmethod
    def get_device_capability(device=None):
        return (ASSUMED_GPU.major, ASSUMED_GPU.minor)


class _AssumedTorch(types.ModuleType):
    """``torch`` with :class:`_AssumedCuda` as ``torch.cuda``; every other name torch's."""

    def __init__(self):
        super().__init__("torch (tst_megatron dry-run stand-in)")
        self.cuda = _AssumedCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


def _te_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _assumed_te_version():
    """``get_te_version`` answered: :data:`ASSUMED_TE_VERSION`."""
    from packaging.version import Version

    return Version(ASSUMED_TE_VERSION)


def _assumed_te_min_version(version: str, check_equality: bool = True) -> bool:
    """``is_te_min_version`` answered for :data:`ASSUMED_TE_VERSION`."""
    from packaging.version import Version

    have, want = Version(ASSUMED_TE_VERSION), Version(version)
    return have >= want if check_equality else have > want


@contextlib.contextmanager
def _validation_environment(notes: list):
    """During the block, the GPU questions of ``validate_args`` are answered for
    :data:`ASSUMED_GPU` when this machine has no CUDA, and its TE version checks for
    :data:`ASSUMED_TE_VERSION` when TE is not installed; ``notes`` gets a line for each.
    Only the ``torch`` / ``is_te_min_version`` globals of the modules in
    :data:`_GPU_ASKING_MODULES` are swapped, and restored on exit."""
    import importlib

    saved = []
    try:
        if not torch.cuda.is_available():
            stand_in = _AssumedTorch()
            for name in _GPU_ASKING_MODULES:
                module = importlib.import_module(name)
                saved.append((module, "torch", module.torch))
                module.torch = stand_in
            notes.append(
                f"no GPU here: validated as for compute capability {ASSUMED_GPU.major}."
                f"{ASSUMED_GPU.minor} (H100)"
            )
        if not _te_installed():
            for name in _TE_ASKING_MODULES:
                module = importlib.import_module(name)
                saved.append((module, "is_te_min_version", module.is_te_min_version))
                module.is_te_min_version = _assumed_te_min_version
                if hasattr(module, "get_te_version"):
                    saved.append((module, "get_te_version", module.get_te_version))
                    module.get_te_version = _assumed_te_version
            notes.append(
                f"Transformer Engine not installed here: its version checks answered as "
                f"for TE {ASSUMED_TE_VERSION}"
            )
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def validation_error(exc: BaseException) -> str:
    """One line for an exception raised by Megatron-LM's argument validation: its message
    with whitespace collapsed or, for a bare ``assert``, the failing source line and where
    it is (``file:line``)."""
    message = " ".join(str(exc).split())
    if message:
        return f"Megatron-LM's argument validation: {message}"
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return f"Megatron-LM's argument validation: {type(exc).__name__}"
    frame = frames[-1]
    where = "/".join(frame.filename.split(os.sep)[-3:])
    return (
        f"Megatron-LM's argument validation: {type(exc).__name__} at {where}:{frame.lineno}: "
        f"{(frame.line or '').strip()}"
    )


# --- the dry run ---------------------------------------------------------------------------


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n:,} ({n / size:.2f}{unit})"
    return f"{n:,}"


def _batch_lines(args, dp: int) -> list[str]:
    """The batch, or the batch-size schedule step by step (Megatron-LM's calculator)."""
    from tst_megatron.training.megatron_lm import _batch_calculator

    per_micro = args.micro_batch_size * dp
    calculator = _batch_calculator(args)
    if calculator is None:
        line = (
            f"batch: global batch {args.global_batch_size} = micro-batch "
            f"{args.micro_batch_size} x DP {dp} x {args.global_batch_size // per_micro} "
            f"micro-batches per step; samples of --seq-length {args.seq_length}"
        )
        if getattr(args, "rampup_batch_size", None):
            line += " (--rampup-batch-size is deprecated and ignored by Megatron-LM 0.19)"
        return [line]
    steps = ", ".join(
        f"from sample {threshold:,}: {batch} ({batch // per_micro} micro-batches)"
        for threshold, batch in calculator.schedule
    )
    return [
        f"batch: --step-batch-size-schedule, micro-batch {args.micro_batch_size} x DP {dp}; "
        f"global batch {steps}; samples of --seq-length {args.seq_length}"
    ]


def describe(args) -> list[str]:
    """The run as lines of text (layout, batch, model, parameters, TST plan) from validated
    Megatron-LM arguments with the launcher's ``--tst-*`` flags.

    Raises:
        ValueError, AssertionError: Megatron-LM's batch-size schedule calculator refused the
            schedule (it is built here, as ``set_global_variables`` would).
    """
    from tst_megatron.training.megatron_lm import schedule, switch_sample, tst_config

    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    dp = args.data_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size or 1
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    lines = [
        f"layout: world {args.world_size} = TP {tp} x CP {cp} x PP {pp} x DP {dp}; VPP {vpp}; "
        f"EP {ep}, ETP {etp}, expert DP {args.world_size // (ep * etp * pp)}; "
        f"sequence parallel {'on' if args.sequence_parallel else 'off'}"
    ]
    lines += _batch_lines(args, dp)
    pattern = moe_layer_pattern(args)
    if args.num_experts:
        kind = (
            f"MoE {sum(pattern)} of {args.num_layers} layers: {args.num_experts} experts of "
            f"{args.moe_ffn_hidden_size}, top-{args.moe_router_topk}"
        )
        if args.moe_shared_expert_intermediate_size:
            kind += f", shared expert {args.moe_shared_expert_intermediate_size}"
    else:
        kind = "dense"
    if args.multi_latent_attention:
        attention = (
            f"MLA, {args.num_attention_heads} heads (q rank {args.q_lora_rank}, kv rank "
            f"{args.kv_lora_rank})"
        )
    else:
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        attention = (
            f"{args.num_attention_heads} heads / {groups} query groups of {args.kv_channels}"
        )
    if getattr(args, "softmax_type", "vanilla") != "vanilla":
        attention += f", softmax {args.softmax_type}"
    if getattr(args, "window_size", None):
        attention += f", window {args.window_size}"
    mtp = f", MTP {args.mtp_num_layers} layer(s)" if getattr(args, "mtp_num_layers", None) else ""
    lines.append(
        f"model: {args.num_layers} layers, hidden {args.hidden_size}, FFN "
        f"{args.ffn_hidden_size}{' (gated)' if args.swiglu else ''}, {attention}; {kind}{mtp}; "
        f"{args.normalization}, {args.position_embedding_type} positions, "
        f"{args.transformer_impl}, {args.params_dtype}"
    )
    vocab = padded_vocab_size(args)
    try:
        counts = parameter_counts(args, vocab)
    except NotImplementedError as exc:
        lines.append(f"parameters: {exc}")
    else:
        note = (
            f" (padded vocabulary {vocab})"
            if vocab
            else " (embeddings not counted: the vocabulary comes from the tokenizer, "
            "which a dry run does not read)"
        )
        mtp_note = f", of which MTP {_human(counts.mtp)}" if counts.mtp else ""
        lines.append(
            f"parameters: {_human(counts.total)} total, {_human(counts.active)} active per "
            f"token{mtp_note}{note}"
        )
    tst, plan = tst_config(args), schedule(args)
    n1, n = plan.n1, plan.train_iters
    given = f" (from --train-samples {args.train_samples:,})" if args.train_samples else ""
    if n1 == 0:
        lines.append(
            f"TST: no phase 1 (bag size {tst.bag_size}): next-token training for {n:,} "
            f"iterations{given}, samples of {plan.phase2.data_seq_length} + 1 tokens"
        )
        return lines
    lines.append(
        f"TST: bag size {tst.bag_size}, mode {tst.mode}, weighting {tst.bag_weighting}; "
        f"N1 = {n1:,} of {n:,} iterations{given}; switch at sample {switch_sample(args):,}; "
        f"phase 1: samples of {plan.phase1.data_seq_length} + 1 tokens, {plan.phase1.model_seq_length} "
        f"positions; phase 2: samples of {plan.phase2.data_seq_length} + 1 tokens"
    )
    return lines


class ParserError(Exception):
    """Megatron-LM's argument parser rejected the command line (argparse's message)."""


def _one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The launcher's flags added to ``parser`` (Megatron-LM's, built for this call), whose
    ``error`` raises :class:`ParserError` instead of printing the whole usage and exiting."""
    from tst_megatron.training.megatron_lm import add_tst_args

    def error(message):
        raise ParserError(message)

    parser = add_tst_args(parser)
    parser.error = error  # this parser object only
    return parser


def _parse(argv: Sequence[str]):
    """Megatron-LM's ``parse_args`` with the launcher's flags, ``sys.argv`` restored after.

    Raises:
        ParserError: argparse rejected ``argv`` (unknown flag, bad value).
    """
    from megatron.training.arguments import parse_args

    saved = sys.argv
    sys.argv = [saved[0] if saved else "pretrain_gpt_tst.py", *argv]
    try:
        return parse_args(extra_args_provider=_one_line_errors)
    finally:
        sys.argv = saved


def check(argv: Sequence[str]) -> tuple[Optional[argparse.Namespace], list[str], list[str]]:
    """Validate a launch line at this process's ``WORLD_SIZE`` without any work.

    Megatron-LM's ``parse_args``, ``validate_args`` and ``core_transformer_config_from_args``
    (prints and warnings captured, GPU and TE questions answered as the module docstring
    says), then, when those pass, Megatron-LM's batch-size schedule calculator and the
    launcher's checks (:func:`~tst_megatron.training.megatron_lm.tst_problems`: TST, and FP8
    shapes from that ``TransformerConfig``). ``--device cpu`` appends the
    launcher's CPU flags first, as a CPU run does; otherwise nothing is appended.

    Returns:
        ``(args, problems, notes)``: the validated arguments (None when ``validate_args``
        or the parser refused), every problem found (one line each, naming the flag or
        giving Megatron-LM's message), and notes on what the dry run assumed.

    Megatron-LM's import-time warnings (no Transformer Engine or Apex here) and the prints
    and warnings of its validation are not shown.
    """
    argv = list(argv)
    problems, notes = [], []
    captured = io.StringIO()
    with _quiet(), contextlib.redirect_stdout(captured):
        from megatron.training.argument_utils import core_transformer_config_from_args
        from megatron.training.arguments import validate_args

        from tst_megatron.training.megatron_lm import CPU_FLAGS, argv_problems, launch_problems

        refused = argv_problems(argv)
        if refused:
            return None, refused, notes

        cpu = _device_flag(argv) == "cpu"
        user_argv = list(argv)
        if cpu:
            argv += list(CPU_FLAGS)

        try:
            args = _parse(argv)
        except ParserError as exc:
            return None, [f"Megatron-LM's argument parser: {exc}"], notes
    # a CPU run sets CUDA_DEVICE_MAX_CONNECTIONS=1 itself when unset (megatron_lm.parse)
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1" if cpu else None)
    env = {} if connections is None else {"CUDA_DEVICE_MAX_CONNECTIONS": connections}
    with _validation_environment(notes), _quiet(), mock.patch.dict(os.environ, env):
        try:
            with contextlib.redirect_stdout(captured):
                validate_args(args)
        except (AssertionError, ValueError) as exc:
            # validate_args stops at its first failed check and leaves the arguments half
            # filled in: the TST checks would read defaults it has not set yet, so they wait
            return None, [validation_error(exc)], notes
        try:  # TransformerConfig.__post_init__ checks more (heads divisible by TP, MoE, MLA)
            with contextlib.redirect_stdout(captured):
                config = core_transformer_config_from_args(_without_te_kernels(args, notes))
        except (AssertionError, ValueError) as exc:
            line = validation_error(exc).replace("argument validation", "TransformerConfig")
            return None, [line], notes
    try:
        problems += _schedule_problems(args)
    except (AssertionError, ValueError) as exc:  # Megatron-LM's calculator refused it
        problems.append(validation_error(exc).replace("argument validation", "batch-size schedule"))
        return args, problems, notes
    problems += launch_problems(args, user_argv, cpu=cpu, config=config)
    return args, problems, notes


#: Switches whose ``TransformerConfig`` check is "is Transformer Engine's kernel importable
#: here" (``apply_rope_fusion``: RoPE fusion, on by default; ``moe_permute_fusion``:
#: ``--moe-permute-fusion``), not a check of the settings.
_TE_KERNEL_SWITCHES = ("apply_rope_fusion", "moe_permute_fusion")


def _without_te_kernels(args, notes: list):
    """``args``, or without Transformer Engine installed a copy with
    :data:`_TE_KERNEL_SWITCHES` off (a note names those that were on): a machine without TE
    cannot say whether the cluster's has the kernels."""
    if _te_installed():
        return args
    on = [name for name in _TE_KERNEL_SWITCHES if getattr(args, name, False)]
    if not on:
        return args
    notes.append(f"Transformer Engine kernels not checked ({', '.join(on)}): TE not installed here")
    return argparse.Namespace(**{**vars(args), **dict.fromkeys(on, False)})


def _schedule_problems(args) -> list[str]:
    """Megatron-LM's checks of ``--step-batch-size-schedule``: its calculator's own (raised
    when it is built, as ``set_global_variables`` builds it), and the divisibility of each
    global batch the run reaches by micro-batch x DP, which ``train()`` asserts when it gets
    there (``update_num_microbatches(..., consistency_check=True)``)."""
    from tst_megatron.training.megatron_lm import _batch_calculator, consumed_samples, train_iters

    calculator = _batch_calculator(args)
    if calculator is None:
        return []
    per_step = args.micro_batch_size * args.data_parallel_size
    total = consumed_samples(args, train_iters(args))
    return [
        f"--step-batch-size-schedule: global batch {batch} (from sample {threshold:,}) is not "
        f"divisible by --micro-batch-size {args.micro_batch_size} x data-parallel size "
        f"{args.data_parallel_size}; Megatron-LM asserts it when the run gets there"
        for threshold, batch in calculator.schedule
        if threshold < total and batch % per_step
    ]


def dry_run(argv: Sequence[str], *, out=None, err=None) -> int:
    """``--dry-run``: check ``argv`` for ``WORLD_SIZE`` processes (default 1; environment) and
    print the run (stdout) or every problem (``error: ...`` lines on stderr). Prints from rank
    0 only (``RANK``, else ``SLURM_PROCID``, default 0).

    Returns:
        0 when no problem was found, else 2.
    """
    out, err = out or sys.stdout, err or sys.stderr
    rank0 = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    args, problems, notes = check(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not problems:
        try:
            lines = describe(args)
        except (AssertionError, ValueError) as exc:
            problems.append(validation_error(exc))
    if not rank0:
        return 2 if problems else 0
    if problems:
        for line in problems:
            print(f"error: {line}", file=err, flush=True)
        for line in notes:
            print(f" note: {line}", file=err)
        print(f"dry run: {len(problems)} problem(s) for world size {world}", file=err, flush=True)
        return 2
    device = "CPU" if _device_flag(argv) == "cpu" else "CUDA"
    print(f"dry run: world size {world}, checked as a {device} run", file=out)
    for line in notes:
        print(f" note: {line}", file=out)
    for line in lines:
        print(f" {line}", file=out)
    print("dry run: no problems found", file=out, flush=True)
    return 0


@contextlib.contextmanager
def _quiet():
    """Python warnings and log records below ERROR off for the block (restored after):
    megatron-core warns at import that Transformer Engine and Apex are missing, and torch
    logs that no CUDA runtime is found."""
    import logging

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _device_flag(argv: Sequence[str]) -> str:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--device", default="auto")
    return pre.parse_known_args(list(argv))[0].device
