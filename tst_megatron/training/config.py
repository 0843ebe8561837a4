"""Run configuration: one small dataclass per concern, command-line flags generated from
the fields (Megatron-LM's flag names and defaults: ``field_name`` -> ``--field-name``; TST
fields get the ``--tst-`` prefix).

Each choice is declared once, as a ``Literal[...]`` annotation: the parser's ``choices`` and
the checks of configurations built in code both come from it. Each dataclass has a
``validate(...)`` that only reads and returns its problems (one line each, naming the flag
and the fix); :func:`validate` collects every problem and raises one
:class:`~tst_megatron.errors.ConfigError` listing them all. :func:`resolve` then fills in
what Megatron-LM derives (iterations from samples, the global batch, the FFN width, ...).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import sys
import textwrap
import typing
from typing import Literal, Optional, Sequence

from tst_megatron.errors import ConfigError
from tst_megatron.runtime.distributed import ParallelConfig
from tst_megatron.superposition.schedule import TSTConfig
from tst_megatron.training.precision import fp8_shape_problems

# Megatron-LM flags this trainer refuses, each with its one-line reason. They are parsed
# (so a launch script gets every problem at once) and reported by :func:`validate`.
REFUSED = {
    "--multi-latent-attention": "multi-latent attention is not wired into this trainer yet",
    "--mtp-num-layers": "multi-token prediction heads are not supported (TST phase 1 scores "
    "bags, not shifted tokens)",
    "--tp-comm-overlap": "Transformer Engine userbuffer overlap is not wired in",
    "--moe-flex-dispatcher-backend": "the flex dispatcher (DeepEP/HybridEP) is not supported; "
    "use --moe-token-dispatcher-type alltoall",
    "--pipeline-model-parallel-layout": "uneven pipeline layouts are not supported; use "
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank": "use --num-layers-per-virtual-pipeline-stage",
    "--decoder-first-pipeline-num-layers": "uneven pipeline stages are not supported",
    "--decoder-last-pipeline-num-layers": "uneven pipeline stages are not supported",
    "--use-precision-aware-optimizer": "not wired into the optimizer config",
    "--optimizer-cpu-offload": "not wired into the optimizer config",
    "--use-torch-fsdp2": "only megatron-core DDP (+ --use-distributed-optimizer) is supported",
    "--use-megatron-fsdp": "only megatron-core DDP (+ --use-distributed-optimizer) is supported",
    "--rampup-batch-size": "batch-size ramp-up is not supported (the TST phase schedule "
    "counts fixed global batches)",
    "--use-legacy-models": "only megatron-core GPTModel is supported",
    "--train-data-path": "per-split data paths are not supported; use --data-path and --split",
    "--valid-data-path": "per-split data paths are not supported; use --data-path and --split",
    "--test-data-path": "per-split data paths are not supported; use --data-path and --split",
}


def _flag(name: str, *, prefix: str = "", negate: bool = False) -> str:
    return "--" + ("no-" if negate else "") + prefix + name.replace("_", "-")


def _meta(default, *, flag: Optional[str] = None, nargs: Optional[str] = None, parse=None):
    """A dataclass field whose flag is not ``--field-name``, that takes several words, or
    whose text is converted by ``parse``."""
    return dataclasses.field(
        default=default, metadata={"flag": flag, "nargs": nargs, "parse": parse}
    )


def _int_or_text(text: str):
    """``"4"`` -> 4; anything else stays text (Megatron-LM's ``moe_freq_type``)."""
    return int(text) if text.strip().isdigit() else text


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """The GPT architecture (Megatron-LM flag names and defaults)."""

    num_layers: Optional[int] = None
    """Transformer layers (required)."""
    hidden_size: Optional[int] = None
    """h (required)."""
    ffn_hidden_size: Optional[int] = None
    """Dense MLP width; None = 4 * h, or int(8h/3 / 64) * 64 with --swiglu (Megatron-LM)."""
    num_attention_heads: Optional[int] = None
    """Attention heads (required)."""
    group_query_attention: bool = False
    """Use grouped-query attention (with --num-query-groups)."""
    num_query_groups: int = 1
    """KV groups under --group-query-attention."""
    kv_channels: Optional[int] = None
    """Attention head dimension; None = --hidden-size / --num-attention-heads."""
    seq_length: Optional[int] = None
    """T: positions the transformer processes per sample (phase-1 samples hold S*T tokens;
    required)."""
    max_position_embeddings: Optional[int] = None
    """Position table size (Megatron-LM requires it); None here = --seq-length."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """Position embedding."""
    add_position_embedding: bool = _meta(True, flag="--no-position-embedding")
    """--no-position-embedding: deprecated in Megatron-LM, allowed only with rope."""
    rotary_base: int = 10000
    """RoPE base."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates."""
    rotary_seq_len_interpolation_factor: Optional[int] = None
    """RoPE sequence-length interpolation factor; None = none."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Norm layers."""
    norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm."""
    apply_layernorm_1p: bool = False
    """Zero-centred norm weights (weight + 1; Transformer Engine norms)."""
    swiglu: bool = False
    """SwiGLU MLPs (gated linear unit with SiLU)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer weights."""
    disable_bias_linear: bool = False
    """No biases in linear layers."""
    qk_layernorm: bool = False
    """Normalise queries and keys."""
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"
    """megatron-core attention backend (flash/fused need Transformer Engine)."""
    masked_softmax_fusion: bool = True
    """Fused masked softmax (a CUDA kernel; --no-masked-softmax-fusion turns it off)."""
    use_flash_attn: bool = False
    """Accepted as in Megatron-LM, where megatron-core models read only
    --attention-backend; it changes nothing."""
    init_method_std: float = 0.02
    """Std of the normal weight initialisation."""
    vocab_size: Optional[int] = None
    """Vocabulary size before padding (required with --tokenizer-type NullTokenizer)."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times TP."""
    hidden_dropout: float = 0.1
    """Dropout after attention/MLP and on embeddings."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""

    def validate(self) -> list[str]:
        """The problems of these settings, one line each (empty: none). Reads only."""
        problems = [
            f"{_flag(name)} is required"
            for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
            if getattr(self, name) is None
        ]
        if problems:
            return problems
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            problems.append(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; give --kv-channels"
            )
        if self.group_query_attention and self.num_attention_heads % self.num_query_groups:
            problems.append(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--num-query-groups {self.num_query_groups}"
            )
        if self.max_position_embeddings is not None and (
            self.max_position_embeddings < self.seq_length
        ):
            problems.append(
                f"--max-position-embeddings {self.max_position_embeddings} must be >= "
                f"--seq-length {self.seq_length}"
            )
        if not self.add_position_embedding and self.position_embedding_type != "rope":
            problems.append(
                "--no-position-embedding is deprecated (as in Megatron-LM); use "
                "--position-embedding-type"
            )
        if not 0.0 < self.rotary_percent <= 1.0:
            problems.append(f"--rotary-percent {self.rotary_percent} must be in (0, 1]")
        return problems

    def ffn_size(self) -> int:
        """The dense MLP width (:func:`tst_megatron.training.model.ffn_hidden_size`)."""
        from tst_megatron.training.model import ffn_hidden_size

        return ffn_hidden_size(self.ffn_hidden_size, self.hidden_size, swiglu=self.swiglu)


def moe_layer_pattern(freq, num_layers: int) -> list[int]:
    """Megatron-LM's ``--moe-layer-freq``: an int ``n`` (every n-th layer from layer 0 is
    MoE) or a list expression such as ``([0]*3+[1]*29)`` (1 = MoE) -> ``[0/1] * num_layers``.

    The expression may use only list literals of 0/1, ``+``, ``*`` and parentheses; it is
    evaluated from its syntax tree, never with ``eval``.

    Raises:
        ConfigError: a malformed expression or a pattern whose length is not ``num_layers``.
    """
    if isinstance(freq, int) or str(freq).strip().isdigit():
        n = int(freq)
        if n < 1:
            raise ConfigError(f"--moe-layer-freq {freq} must be >= 1")
        return [1 if i % n == 0 else 0 for i in range(num_layers)]

    def value(node):
        if isinstance(node, ast.List) and all(
            isinstance(e, ast.Constant) and e.value in (0, 1) for e in node.elts
        ):
            return [e.value for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError

    try:
        pattern = value(ast.parse(str(freq).strip(), mode="eval").body)
        assert isinstance(pattern, list)
    except (SyntaxError, ValueError, TypeError, AssertionError):
        raise ConfigError(
            f"--moe-layer-freq {freq!r} is neither an integer nor a list expression of 0/1 "
            "such as '([0]*3+[1]*29)'"
        ) from None
    if len(pattern) != num_layers:
        raise ConfigError(
            f"--moe-layer-freq {freq!r} gives {len(pattern)} layers but --num-layers is {num_layers}"
        )
    return pattern


@dataclasses.dataclass(frozen=True)
class MoEArgs:
    """Mixture of experts (Megatron-LM flag names and defaults); --num-experts None = dense."""

    num_experts: Optional[int] = None
    """Experts per MoE layer."""
    moe_ffn_hidden_size: Optional[int] = None
    """Expert MLP width; None = --ffn-hidden-size."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "sinkhorn", "none"] = (
        "aux_loss"
    )
    """Load-balancing loss."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient."""
    moe_z_loss_coeff: Optional[float] = None
    """Router z-loss coefficient."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router score function."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k (weights not renormalised)."""
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = None
    """Router computation dtype; None = model dtype."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias updated from the token counts each step."""
    moe_router_bias_update_rate: float = 1e-3
    """Step size of the expert-bias update."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Scale of the top-k routing weights; None = 1."""
    moe_router_num_groups: Optional[int] = None
    """Expert groups for group-limited routing; None = no groups."""
    moe_router_group_topk: Optional[int] = None
    """Groups chosen per token under group-limited routing."""
    moe_router_force_load_balancing: bool = False
    """Route tokens uniformly at random (benchmarking only, as in Megatron-LM)."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    """Token dispatcher (flex needs DeepEP; refused here)."""
    moe_permute_fusion: bool = False
    """Fused token permutation (Transformer Engine)."""
    moe_grouped_gemm: bool = False
    """Grouped GEMM experts (needs Transformer Engine)."""
    moe_layer_freq: typing.Union[int, str] = _meta(1, parse=_int_or_text)
    """MoE layer pattern: n (every n-th layer) or a list expression like ([0]*3+[1]*29)."""
    moe_layer_recompute: bool = False
    """Recompute the MoE layers in backward (adds 'moe' to --recompute-modules)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared expert; None = no shared expert."""
    moe_expert_capacity_factor: Optional[float] = None
    """Token capacity per expert; None = no dropping."""

    def validate(self, num_layers: Optional[int], transformer_impl: str) -> list[str]:
        """The problems of these settings, one line each (empty: none). Reads only."""
        problems = []
        if not self.num_experts:
            return problems
        if self.moe_router_topk > self.num_experts:
            problems.append(
                f"--moe-router-topk {self.moe_router_topk} exceeds --num-experts {self.num_experts}"
            )
        if num_layers:
            try:
                moe_layer_pattern(self.moe_layer_freq, num_layers)
            except ConfigError as exc:
                problems.append(str(exc))
        groups = self.moe_router_num_groups
        if groups and self.num_experts % groups:
            problems.append(
                f"--num-experts {self.num_experts} is not divisible by --moe-router-num-groups "
                f"{groups}"
            )
        if (groups is None) != (self.moe_router_group_topk is None):
            problems.append("give both --moe-router-num-groups and --moe-router-group-topk")
        if self.moe_token_dispatcher_type == "flex":
            problems.append(
                f"--moe-token-dispatcher-type flex: {REFUSED['--moe-flex-dispatcher-backend']}"
            )
        for flag, on in (
            ("--moe-grouped-gemm", self.moe_grouped_gemm),
            ("--moe-permute-fusion", self.moe_permute_fusion),
        ):
            if on and transformer_impl != "transformer_engine":
                problems.append(f"{flag} needs --transformer-impl transformer_engine")
        return problems


@dataclasses.dataclass(frozen=True)
class ParallelArgs:
    """Parallel layout (Megatron-LM flag names). DP is what is left of the world size."""

    tensor_model_parallel_size: int = 1
    """TP."""
    pipeline_model_parallel_size: int = 1
    """PP."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per virtual stage for the interleaved 1F1B schedule; None = not interleaved."""
    context_parallel_size: int = 1
    """CP."""
    expert_model_parallel_size: int = 1
    """EP."""
    expert_tensor_parallel_size: Optional[int] = None
    """Expert TP; None = TP."""

    def virtual_stages(self, num_layers: int) -> Optional[int]:
        """VPP, model chunks per pipeline rank (Megatron-LM: None when it would be 1)."""
        vpl = self.num_layers_per_virtual_pipeline_stage
        if not vpl:
            return None
        vpp = num_layers // (self.pipeline_model_parallel_size * vpl)
        return vpp if vpp > 1 else None

    def to_parallel_config(self, num_layers: int) -> ParallelConfig:
        """The runtime's :class:`ParallelConfig` (virtual stages derived from layers)."""
        return ParallelConfig(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=self.virtual_stages(num_layers),
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
        )

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world size / (TP * PP * CP)."""
        model = (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )
        return max(1, world_size // model)

    def validate(self, world_size: int, num_layers: Optional[int]) -> list[str]:
        """The problems of this layout for ``world_size`` processes. Reads only."""
        problems = []
        try:
            self.to_parallel_config(num_layers or 1).validate(world_size)
        except ConfigError as exc:
            problems.append(str(exc))
        pp, vpl = self.pipeline_model_parallel_size, self.num_layers_per_virtual_pipeline_stage
        if num_layers and pp >= 1 and num_layers % pp:
            problems.append(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}"
            )
        elif vpl is not None and num_layers and (vpl < 1 or (num_layers // pp) % vpl):
            problems.append(
                f"--num-layers {num_layers} / --pipeline-model-parallel-size {pp} is not "
                f"divisible by --num-layers-per-virtual-pipeline-stage {vpl}"
            )
        if vpl is not None and pp == 1:
            problems.append(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
            )
        return problems


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    """Optimisation, schedule, batch and precision (Megatron-LM flag names and defaults).

    The run is given in iterations (--train-iters, --lr-*-iters) or in samples
    (--train-samples, --lr-*-samples), as in Megatron-LM; :func:`resolve` turns samples into
    iterations (``train_samples // global_batch_size``)."""

    micro_batch_size: Optional[int] = None
    """Samples per micro-batch per DP rank (required; same in both phases)."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step; None = micro-batch * DP."""
    train_iters: Optional[int] = None
    """N: optimizer steps (give this or --train-samples)."""
    train_samples: Optional[int] = None
    """Samples to train on; N = train_samples // global batch."""
    lr: Optional[float] = None
    """Peak learning rate (required)."""
    min_lr: float = 0.0
    """Final learning rate."""
    lr_decay_style: Literal["constant", "linear", "cosine", "WSD"] = "linear"
    """Learning-rate decay shape."""
    lr_decay_iters: Optional[int] = None
    """Decay over this many iterations; None = --train-iters."""
    lr_decay_samples: Optional[int] = None
    """Decay over this many samples (sample-based runs); None = --train-samples."""
    lr_warmup_iters: int = 0
    """Linear warmup iterations."""
    lr_warmup_samples: int = 0
    """Linear warmup samples (sample-based runs)."""
    lr_warmup_fraction: Optional[float] = None
    """Warmup as a fraction of the decay length (instead of --lr-warmup-iters/-samples)."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of warmup."""
    lr_wsd_decay_iters: Optional[int] = None
    """WSD decay iterations at the end; None = 10% of --train-iters (Megatron-LM: required)."""
    lr_wsd_decay_samples: Optional[int] = None
    """WSD decay samples (sample-based runs)."""
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """WSD decay shape."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    decoupled_lr: Optional[float] = None
    """Separate peak LR for the input embedding and output layer; None = --lr."""
    decoupled_min_lr: Optional[float] = None
    """Separate final LR for the input embedding and output layer."""
    bf16: bool = False
    """bf16 parameters and compute (GPU)."""
    fp16: bool = False
    """fp16 parameters and compute with dynamic loss scaling (GPU)."""
    loss_scale: Optional[float] = None
    """Static fp16 loss scale; None = dynamic."""
    initial_loss_scale: float = 2.0**32
    """Initial dynamic loss scale."""
    min_loss_scale: float = 1.0
    """Smallest dynamic loss scale."""
    loss_scale_window: float = 1000
    """Steps without overflow before the dynamic loss scale grows."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic loss scale shrinks."""
    grad_reduce_in_bf16: bool = False
    """Reduce gradients in bf16 instead of fp32 (with --bf16)."""
    seed: int = 1234
    """Random seed."""
    sequence_parallel: bool = False
    """Sequence parallelism (switched off when TP = 1, as in Megatron-LM)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across DP (GPU)."""
    overlap_grad_reduce: bool = False
    """Overlap the DP gradient reduce with backward (megatron-core DDP)."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with forward."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop on a NaN/Inf loss or gradient (--no-check-for-nan-in-loss-and-grad)."""
    calculate_per_token_loss: bool = False
    """Accepted: this trainer always averages the loss over tokens across micro-batches
    and DP (the flag's behaviour); without it Megatron-LM averages per micro-batch."""
    cross_entropy_loss_fusion: bool = False
    """Fused vocab-parallel cross-entropy in phase 2 (megatron-core, CUDA)."""
    recompute_activations: bool = False
    """Selective recompute (same as --recompute-granularity selective)."""
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """Activation recompute: full layers or selected modules."""
    recompute_method: Optional[Literal["uniform", "block"]] = None
    """How full recompute picks layers."""
    recompute_num_layers: Optional[int] = None
    """Layers per recompute unit (uniform) or recomputed per stage (block)."""
    recompute_modules: Optional[list] = _meta(None, nargs="*")
    """Modules for selective recompute (megatron-core names); None = core_attn."""
    transformer_impl: Literal["transformer_engine", "local"] = "transformer_engine"
    """Layer implementation; on a CPU run the local spec is used (said at start-up)."""
    fp8_format: Optional[Literal["e4m3", "hybrid"]] = None
    """FP8 format (Transformer Engine); None = no FP8."""
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = "delayed"
    """FP8 scaling recipe."""
    fp8_amax_history_len: int = 1
    """Amax history length for delayed scaling."""
    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    """How the amax is taken from its history."""
    fp8_param_gather: bool = False
    """Keep parameters in FP8 and all-gather them in FP8 (distributed optimizer)."""
    use_mcore_models: bool = False
    """Accepted and ignored, as in Megatron-LM (megatron-core models are the only kind)."""
    distributed_timeout_minutes: int = 10
    """Timeout of torch.distributed collectives."""
    manual_gc: bool = False
    """Disable Python's automatic garbage collection; collect every --manual-gc-interval steps."""
    manual_gc_interval: int = 0
    """Steps between manual collections; 0 = only at start and at validation."""
    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Release cached CUDA memory: 1 after each step, 2 also after validation."""
    exit_duration_in_mins: Optional[float] = None
    """Save (with --save) and stop after this many minutes of training."""
    exit_interval: Optional[int] = None
    """Save (with --save) and stop at the first iteration divisible by this."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to run: auto (CUDA if present), cuda or cpu (gloo + the CPU runtime)."""
    dry_run: bool = False
    """Parse and validate for WORLD_SIZE processes, print the resolved run, exit 0 or 2."""

    def validate(self, device_type: str) -> list[str]:
        """The problems of these settings on ``device_type`` ("cuda" or "cpu"). Reads only."""
        problems = []
        if self.micro_batch_size is None or self.micro_batch_size < 1:
            problems.append("--micro-batch-size is required and must be >= 1")
        if self.lr is None:
            problems.append("--lr is required")
        elif self.min_lr > self.lr:
            problems.append(f"--min-lr {self.min_lr} must be <= --lr {self.lr}")
        if (self.train_iters is None) == (self.train_samples is None):
            problems.append("give one of --train-iters or --train-samples")
        if self.train_iters is not None:
            if self.train_iters < 1:
                problems.append("--train-iters must be >= 1")
            for flag, value in (
                ("--lr-decay-samples", self.lr_decay_samples),
                ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples),
            ):
                if value is not None:
                    problems.append(f"{flag} needs a sample-based run (--train-samples)")
            if self.lr_warmup_samples:
                problems.append("--lr-warmup-samples needs a sample-based run (--train-samples)")
        if self.train_samples is not None:
            for flag, value in (
                ("--lr-decay-iters", self.lr_decay_iters),
                ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters),
            ):
                if value is not None:
                    problems.append(f"{flag} needs an iteration-based run (--train-iters)")
            if self.lr_warmup_iters:
                problems.append("--lr-warmup-iters needs an iteration-based run (--train-iters)")
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            problems.append(
                "give one of --lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples"
            )
        if self.bf16 and self.fp16:
            problems.append("give one of --bf16 and --fp16")
        te = self.transformer_impl == "transformer_engine"
        for flag, on in (
            ("--fp8-format", self.fp8_format),
            ("--fp8-param-gather", self.fp8_param_gather),
        ):
            if on and not te:
                problems.append(f"{flag} needs --transformer-impl transformer_engine")
        if self.fp8_param_gather and not self.fp8_format:
            problems.append("--fp8-param-gather needs --fp8-format")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            problems.append("--overlap-param-gather needs --use-distributed-optimizer")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            problems.append("--overlap-param-gather needs --overlap-grad-reduce")
        if self.recompute_method is not None and self.recompute_granularity != "full":
            problems.append("--recompute-method needs --recompute-granularity full")
        if self.recompute_granularity == "full" and (
            self.recompute_method is None or not self.recompute_num_layers
        ):
            problems.append(
                "--recompute-granularity full needs --recompute-method and --recompute-num-layers"
            )
        if device_type == "cpu":
            for flag, on in (
                ("--bf16", self.bf16),
                ("--fp16", self.fp16),
                ("--use-distributed-optimizer", self.use_distributed_optimizer),
                ("--fp8-format", self.fp8_format),
            ):
                if on:
                    problems.append(f"{flag} needs a CUDA device; drop it for CPU runs")
        return problems


@dataclasses.dataclass(frozen=True)
class DataArgs:
    """Data and tokenizer (Megatron-LM flag names and defaults)."""

    mock_data: bool = False
    """Synthetic data (megatron-core MockGPTDataset)."""
    data_path: Optional[str] = _meta(None, nargs="+")
    """Dataset prefixes, with optional weights: 'prefix' or 'weight prefix weight prefix ...'
    (one word or several, as in Megatron-LM)."""
    split: str = "969,30,1"
    """Train,valid,test proportions (Megatron-LM: None, then '969, 30, 1' with a warning)."""
    tokenizer_type: Optional[
        Literal[
            "NullTokenizer",
            "SentencePieceTokenizer",
            "HuggingFaceTokenizer",
            "GPT2BPETokenizer",
            "Llama2Tokenizer",
        ]
    ] = None
    """Tokenizer kind (required)."""
    tokenizer_model: Optional[str] = None
    """SentencePiece model file (SentencePiece/Llama2) or local Hugging Face directory."""
    vocab_file: Optional[str] = None
    """GPT-2 BPE vocabulary (vocab.json)."""
    merge_file: Optional[str] = None
    """GPT-2 BPE merges (merges.txt)."""
    tiktoken_pattern: Optional[str] = None
    """Read only by TikTokenizer in Megatron-LM; accepted and unused, as there."""
    data_cache_path: Optional[str] = None
    """Where dataset index caches are written."""
    mmap_bin_files: bool = True
    """Memory-map the .bin files (--no-mmap-bin-files reads them with file reads)."""
    create_attention_mask_in_dataloader: bool = True
    """Let the dataset build attention masks (needed only with --reset-attention-mask)."""
    eod_mask_loss: bool = False
    """Do not score the token after EOD."""
    reset_position_ids: bool = False
    """Restart positions at each document (phase 2 only)."""
    reset_attention_mask: bool = False
    """Block attention across documents (phase 2 only)."""
    num_workers: int = 2
    """Data loader worker processes."""

    def validate(self, vocab_size: Optional[int]) -> list[str]:
        """The problems of these settings, one line each. Reads only (no file is opened)."""
        problems = []
        if not self.mock_data and not self.data_path:
            problems.append("give --mock-data or --data-path")
        kind = self.tokenizer_type
        if kind is None:
            problems.append("--tokenizer-type is required")
        elif kind == "NullTokenizer" and vocab_size is None:
            problems.append("--vocab-size is required with --tokenizer-type NullTokenizer")
        elif kind in ("SentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer"):
            if not self.tokenizer_model:
                problems.append(f"--tokenizer-type {kind} needs --tokenizer-model")
        elif kind == "GPT2BPETokenizer" and not (self.vocab_file and self.merge_file):
            problems.append("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        if self.num_workers < 0:
            problems.append("--num-workers must be >= 0")
        if self.reset_attention_mask and not self.create_attention_mask_in_dataloader:
            problems.append(
                "--reset-attention-mask needs the dataloader's attention masks; drop "
                "--no-create-attention-mask-in-dataloader"
            )
        return problems


@dataclasses.dataclass(frozen=True)
class CheckpointArgs:
    """Checkpointing, logging and evaluation (Megatron-LM flag names and defaults)."""

    save: Optional[str] = None
    """Checkpoint directory to write."""
    load: Optional[str] = None
    """Checkpoint directory to resume from (latest iteration)."""
    load_optim: bool = True
    """Restore the optimizer state (``--no-load-optim`` loads weights, schedule and step only)."""
    load_rng: bool = True
    """Restore each rank's RNG states (``--no-load-rng`` skips them)."""
    finetune: bool = False
    """Load only the weights of --load and start at iteration 0 (no optimizer, no RNG)."""
    save_interval: Optional[int] = None
    """Save every n steps."""
    ckpt_format: Literal["torch_dist"] = "torch_dist"
    """Checkpoint format; only torch_dist."""
    auto_detect_ckpt_format: bool = False
    """Detect the format of --load; only torch_dist exists here, so it changes nothing."""
    dist_ckpt_strictness: Literal[
        "assume_ok_unexpected",
        "log_unexpected",
        "log_all",
        "raise_unexpected",
        "raise_all",
        "return_unexpected",
        "return_all",
        "ignore_all",
    ] = "assume_ok_unexpected"
    """How megatron-core's dist_checkpointing treats key mismatches at load."""
    log_interval: int = 100
    """Console/TensorBoard line every n steps."""
    log_throughput: bool = False
    """Add the model TFLOP/s per GPU to the console line."""
    log_validation_ppl_to_tensorboard: bool = False
    """Also write the validation perplexity to TensorBoard."""
    log_timers_to_tensorboard: bool = False
    """Write the iteration time to TensorBoard."""
    log_memory_to_tensorboard: bool = False
    """Write CUDA memory statistics to TensorBoard (nothing on a CPU run)."""
    log_num_zeros_in_grad: bool = False
    """Count zero gradient entries (megatron-core optimizer) and log them."""
    log_params_norm: bool = False
    """Log the L2 norm of all parameters."""
    wandb_project: Optional[str] = None
    """Weights & Biases project (needs the optional wandb package); None = no W&B."""
    wandb_exp_name: Optional[str] = None
    """Weights & Biases run name."""
    wandb_save_dir: Optional[str] = None
    """Weights & Biases directory; None = <--save>/wandb."""
    profile: bool = False
    """Profile iterations [--profile-step-start, --profile-step-end) (nsys capture range on
    CUDA, or --use-pytorch-profiler)."""
    profile_step_start: int = 10
    """First profiled iteration (0-based)."""
    profile_step_end: int = 12
    """Iteration where profiling stops."""
    profile_ranks: list = _meta((0,), nargs="+", parse=int)
    """Global ranks to profile."""
    use_pytorch_profiler: bool = False
    """Use the PyTorch profiler (a TensorBoard trace in --tensorboard-dir)."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard event directory."""
    eval_interval: Optional[int] = None
    """Validate every n steps (next-token loss, both phases)."""
    eval_iters: int = 100
    """Validation micro-batch rounds per evaluation; 0 = no validation."""
    full_validation: bool = False
    """Each validation reads the whole validation split (its samples in global batches, the
    tail short of one dropped) instead of ``--eval-iters`` steps, the same samples every time."""
    exit_signal_handler: bool = False
    """On SIGTERM: finish the step, save, exit 0."""

    def validate(self) -> list[str]:
        """The problems of these settings, one line each. Reads only."""
        problems = []
        if self.save_interval is not None and self.save_interval < 1:
            problems.append("--save-interval must be >= 1")
        if (self.save_interval or self.exit_signal_handler) and not self.save:
            problems.append("--save-interval and --exit-signal-handler need --save DIR")
        if self.finetune and not self.load:
            problems.append("--finetune needs --load DIR")
        if self.dist_ckpt_strictness.startswith("return_"):
            problems.append(
                f"--dist-ckpt-strictness {self.dist_ckpt_strictness} is for programmatic "
                "loads; use log_all or raise_all"
            )
        if self.profile and self.profile_step_end <= self.profile_step_start:
            problems.append("--profile-step-end must be > --profile-step-start")
        if self.use_pytorch_profiler and not self.tensorboard_dir:
            problems.append("--use-pytorch-profiler needs --tensorboard-dir (the trace goes there)")
        if self.eval_iters < 0:
            problems.append("--eval-iters must be >= 0")
        return problems


_GROUPS = {
    "model": (ModelArgs, ""),
    "moe": (MoEArgs, ""),
    "parallel": (ParallelArgs, ""),
    "train": (TrainArgs, ""),
    "data": (DataArgs, ""),
    "checkpoint": (CheckpointArgs, ""),
    "tst": (TSTConfig, "tst-"),
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, one dataclass per concern."""

    model: ModelArgs
    moe: MoEArgs
    parallel: ParallelArgs
    train: TrainArgs
    data: DataArgs
    checkpoint: CheckpointArgs
    tst: TSTConfig
    refused: tuple = ()
    """Flags given on the command line that this trainer refuses (see :data:`REFUSED`)
    and unrecognised arguments, reported by :func:`validate`."""


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict:
    """The docstring under each field of dataclass ``cls`` (the help text of its flag)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split()).replace("%", "%%")
    return docs


def _unwrap(hint):
    """``Optional[X]`` -> ``X``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


@functools.lru_cache(maxsize=None)
def _type_hints(cls) -> dict:
    """``typing.get_type_hints(cls)``, evaluated once per class (it parses every annotation)."""
    return typing.get_type_hints(cls)


def field_choices(cls, name: str) -> Optional[tuple]:
    """The values field ``name`` of dataclass ``cls`` may take (its ``Literal[...]``), or
    None when it is not a choice."""
    hint = _unwrap(_type_hints(cls)[name])
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def _choice_problems(obj, prefix: str = "") -> list[str]:
    """Fields of dataclass ``obj`` whose value is not among their declared choices."""
    problems = []
    for field in dataclasses.fields(obj):
        choices = field_choices(type(obj), field.name)
        value = getattr(obj, field.name)
        if choices and value is not None and value not in choices:
            problems.append(
                f"{_flag(field.name, prefix=prefix)} must be one of "
                f"{', '.join(map(str, choices))}, got {value!r}"
            )
    return problems


class _Parser(argparse.ArgumentParser):
    """argparse that prints ``--help`` from rank 0 only (under torchrun every rank parses the
    same command line) and raises a malformed value as a
    :class:`~tst_megatron.errors.ConfigError`, so the entry point reports it as it reports
    every other bad setting (one ``error:`` line, status 2)."""

    def _print_message(self, message, file=None):
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            super()._print_message(message, file)

    def error(self, message):
        raise ConfigError(message)


class _Refused(argparse.Action):
    """Records a refused Megatron-LM flag (and swallows its values) for :func:`validate`."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.refused = (*getattr(namespace, "refused", ()), option_string)


def build_parser() -> argparse.ArgumentParser:
    """The parser: one flag per dataclass field, help text from the field docstrings,
    ``choices`` from the fields' ``Literal`` types; refused Megatron-LM flags are parsed
    and recorded."""
    parser = _Parser(
        description="Megatron-style GPT/MoE pretraining with Token Superposition Training",
        allow_abbrev=False,
    )
    parser.set_defaults(refused=())
    for group_name, (cls, prefix) in _GROUPS.items():
        group = parser.add_argument_group(group_name)
        hints = _type_hints(cls)
        docs = field_docs(cls)
        for field in dataclasses.fields(cls):
            kind = _unwrap(hints[field.name])
            choices = field_choices(cls, field.name)
            dest = f"{group_name}.{field.name}"
            text = docs.get(field.name, "")
            flag = field.metadata.get("flag")
            if kind is bool:
                negate = field.default is True
                group.add_argument(
                    flag or _flag(field.name, prefix=prefix, negate=negate),
                    dest=dest,
                    action="store_false" if negate else "store_true",
                    default=field.default,
                    help=text,
                )
                continue
            if field.metadata.get("parse"):
                kind = field.metadata["parse"]
            elif choices:
                kind = type(choices[0])
            elif kind is list or typing.get_origin(kind) is list:
                kind = str  # one word per item (nargs)
            group.add_argument(
                flag or _flag(field.name, prefix=prefix),
                dest=dest,
                type=kind,
                nargs=field.metadata.get("nargs"),
                default=field.default,
                choices=choices,
                metavar=None if choices else field.name.upper(),
                help=f"{text} (default: {field.default})",
            )
    refused = parser.add_argument_group("refused (Megatron-LM flags this trainer does not run)")
    for flag, reason in REFUSED.items():
        if flag not in parser._option_string_actions:
            refused.add_argument(
                flag, nargs="*", action=_Refused, dest="refused", default=(), help=reason
            )
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> RunConfig:
    """Parse Megatron-style flags into a :class:`RunConfig`.

    Refused Megatron-LM flags and unrecognised arguments are kept in ``RunConfig.refused``
    and reported by :func:`validate` together with every other problem. A malformed value
    (not a number, not a choice) exits with usage and status 2. Under torchrun only rank 0
    prints usage, errors and ``--help``.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    namespace, unknown = build_parser().parse_known_args(args)
    values = {name: {} for name in _GROUPS}
    for key, value in vars(namespace).items():
        if key == "refused":
            continue
        group, field = key.split(".", 1)
        if isinstance(value, list) and _unwrap(_type_hints(_GROUPS[group][0])[field]) is not list:
            value = " ".join(value) or None  # --data-path 0.7 A 0.3 B: one text, as Megatron-LM
        values[group][field] = value
    refused = tuple(namespace.refused) + tuple(u for u in unknown if u.startswith("-"))
    return RunConfig(
        **{name: cls(**values[name]) for name, (cls, _) in _GROUPS.items()}, refused=refused
    )


def all_flags() -> list[str]:
    """Every long flag the parser runs, sorted (frozen by a test); refused ones excluded."""
    return sorted(
        opt
        for action in build_parser()._actions
        if not isinstance(action, _Refused)
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    )


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    """DP = world size / (TP * PP * CP)."""
    return cfg.parallel.data_parallel_size(world_size)


def global_batch_size(cfg: RunConfig, world_size: int) -> int:
    """--global-batch-size, or --micro-batch-size * DP when not given."""
    t = cfg.train
    return t.global_batch_size or (t.micro_batch_size or 1) * data_parallel_size(cfg, world_size)


def _cross_problems(cfg: RunConfig, world_size: int, device_type: str) -> list[str]:
    """Problems that involve settings of several concerns."""
    m, moe, p, t, d, tst = cfg.model, cfg.moe, cfg.parallel, cfg.train, cfg.data, cfg.tst
    problems = []
    tp, cp, pp = (
        p.tensor_model_parallel_size,
        p.context_parallel_size,
        p.pipeline_model_parallel_size,
    )
    dp = data_parallel_size(cfg, world_size)
    mbs = t.micro_batch_size or 1
    gbs = global_batch_size(cfg, world_size)
    if gbs % (mbs * dp):
        problems.append(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
            f"{mbs} x data-parallel size {dp}; change one of them"
        )
    elif m.num_layers and p.virtual_stages(m.num_layers) and (gbs // (mbs * dp)) % pp:
        # megatron-core's interleaved schedule (pipeline_parallel/schedules.py,
        # forward_backward_pipelining_with_interleaving) groups micro-batches by
        # microbatch_group_size_per_vp_stage (default PP) and needs PP <= M and M % PP == 0
        # or >= PP, i.e. M a multiple of PP; else a RuntimeError on every rank.
        problems.append(
            f"interleaved pipeline: --global-batch-size {gbs} / (--micro-batch-size {mbs} x "
            f"DP {dp}) = {gbs // (mbs * dp)} micro-batches, not a multiple of PP {pp} "
            f"(VPP {p.virtual_stages(m.num_layers)}); change --global-batch-size"
        )
    heads = m.num_attention_heads
    if heads and heads % tp:
        problems.append(
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}"
        )
    if m.group_query_attention and m.num_query_groups % tp:
        problems.append(
            f"--num-query-groups {m.num_query_groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    sp = t.sequence_parallel and tp > 1  # Megatron-LM switches SP off at TP = 1
    if sp and m.seq_length and cp == 1 and m.seq_length % tp:
        problems.append(
            f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
            "under --sequence-parallel"
        )
    elif sp and m.seq_length and not m.seq_length % cp and (m.seq_length // cp) % tp:
        # A CP rank holds --seq-length / CP positions (2 x CP zig-zag chunks), which SP then
        # scatters over TP (megatron-core's _split_along_first_dim needs a multiple). The model
        # sequence is --seq-length in both TST phases (phase 1: T latent positions).
        problems.append(
            f"--seq-length {m.seq_length} is not divisible by --context-parallel-size {cp} x "
            f"--tensor-model-parallel-size {tp} under --sequence-parallel (each CP rank's "
            f"--seq-length / {cp} = {m.seq_length // cp} positions are split over the TP ranks)"
        )
    if moe.moe_layer_recompute and t.recompute_granularity == "full":
        problems.append(  # megatron-core's TransformerConfig raises ValueError at build time
            "--moe-layer-recompute recomputes selectively; drop it or --recompute-granularity full"
        )
    if moe.num_experts and tp > 1 and not sp:
        problems.append("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel")
    if cp > 1 and m.seq_length and m.seq_length % (2 * cp):
        problems.append(
            f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size {cp}"
        )
    if moe.num_experts and moe.moe_shared_expert_intermediate_size and not m.disable_bias_linear:
        problems.append(
            "--moe-shared-expert-intermediate-size needs --disable-bias-linear (megatron-core's "
            "shared expert has no biases)"
        )
    etp = p.expert_tensor_parallel_size or tp
    if moe.num_experts and not m.disable_bias_linear and etp > 1:
        # megatron-core's TransformerConfig asserts "Bias in Moe is only supported when
        # ETP==1" after set-up, on every rank.
        problems.append(
            "MoE with biases (no --disable-bias-linear) needs --expert-tensor-parallel-size 1, "
            f"got {etp} (unset: --tensor-model-parallel-size); add --disable-bias-linear or "
            "--expert-tensor-parallel-size 1"
        )
    ep = p.expert_model_parallel_size
    if moe.num_experts and moe.num_experts % ep:
        problems.append(
            f"--num-experts {moe.num_experts} is not divisible by --expert-model-parallel-size {ep}"
        )
    if ep > 1 and not moe.num_experts:
        problems.append("--expert-model-parallel-size > 1 needs --num-experts")
    if tst.bag_size > 1 and t.train_iters and tst.phase1_steps(t.train_iters) > 0:
        for flag, on in (
            ("--reset-position-ids", d.reset_position_ids),
            ("--reset-attention-mask", d.reset_attention_mask),
        ):
            if on:
                problems.append(
                    f"{flag} is not supported in TST phase 1 (--tst-bag-size > 1): bags are "
                    "formed on the packed token stream; drop the flag or set --tst-bag-size 1"
                )
    iters = t.train_iters or (t.train_samples or 0) // max(gbs, 1)
    if t.train_samples is not None and iters < 1:
        problems.append(f"--train-samples {t.train_samples} is less than one global batch ({gbs})")
    if t.train_iters and not 0 <= t.lr_warmup_iters < t.train_iters:
        problems.append(
            f"--lr-warmup-iters {t.lr_warmup_iters} must be in [0, --train-iters {t.train_iters})"
        )
    if (
        t.lr_wsd_decay_iters is not None
        and t.train_iters
        and not (0 < t.lr_wsd_decay_iters <= t.train_iters)
    ):
        problems.append("--lr-wsd-decay-iters must be in (0, --train-iters]")
    te = t.transformer_impl == "transformer_engine" and device_type != "cpu"
    if cp > 1 and not te:
        problems.append(
            "--context-parallel-size > 1 needs --transformer-impl transformer_engine on CUDA "
            "(megatron-core's local attention has no context parallelism)"
        )
    if m.attention_backend in ("flash", "fused") and not te:
        problems.append(
            f"--attention-backend {m.attention_backend} needs --transformer-impl "
            "transformer_engine on CUDA"
        )
    if m.apply_layernorm_1p and not te:
        problems.append(
            "--apply-layernorm-1p needs --transformer-impl transformer_engine on CUDA (the "
            "local norms have no zero-centred weight)"
        )
    if device_type == "cpu" and cfg.checkpoint.profile and not cfg.checkpoint.use_pytorch_profiler:
        problems.append(
            "--profile without --use-pytorch-profiler opens an nsys capture range and needs a "
            "CUDA device; add --use-pytorch-profiler for a CPU run"
        )
    if device_type == "cpu":
        for flag, on in (
            ("--moe-grouped-gemm", moe.moe_grouped_gemm),
            ("--moe-permute-fusion", moe.moe_permute_fusion),
        ):
            if on:
                problems.append(f"{flag} needs a CUDA device (Transformer Engine)")
        if pp > 1 and not m.untie_embeddings_and_output_weights:
            problems.append(
                "tied embeddings with --pipeline-model-parallel-size > 1 need a CUDA device "
                "(megatron-core moves them with .cuda()); add --untie-embeddings-and-output-weights"
            )
    return problems


def problems(cfg: RunConfig, world_size: int, device_type: str = "cuda") -> list[str]:
    """Every problem of ``cfg`` for ``world_size`` processes on ``device_type``, one line each
    (empty: none). Reads only: no process group, file, data or model."""
    found = []
    for flag in cfg.refused:
        reason = REFUSED.get(flag.split("=", 1)[0])
        found.append(
            f"{flag} is not supported: {reason}"
            if reason
            else f"unrecognised argument {flag} (not a flag of this trainer; see --help)"
        )
    for name, (_, prefix) in _GROUPS.items():
        found += _choice_problems(getattr(cfg, name), prefix)
    m, t = cfg.model, cfg.train
    found += m.validate()
    found += cfg.moe.validate(m.num_layers, t.transformer_impl)
    found += cfg.parallel.validate(world_size, m.num_layers)
    found += t.validate(device_type)
    found += cfg.data.validate(m.vocab_size)
    found += cfg.checkpoint.validate()
    gbs = global_batch_size(cfg, world_size)
    iters = t.train_iters or (t.train_samples or 0) // max(gbs, 1)
    found += cfg.tst.validate(max(iters, 1))
    required = (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length)
    if all(required) and t.micro_batch_size and (t.train_iters or t.train_samples):
        found += _cross_problems(cfg, world_size, device_type)
        found += fp8_shape_problems(cfg)
    seen = set()
    return [p for p in found if not (p in seen or seen.add(p))]


def validate(cfg: RunConfig, world_size: int, device_type: str = "cuda") -> None:
    """Stop before any work on unusable or contradictory settings. Reads only.

    Args:
        cfg: the run configuration.
        world_size: number of processes.
        device_type: ``"cuda"`` or ``"cpu"``, the device the run will use.

    Raises:
        ConfigError: listing every problem found, one per line, each naming the flag.
    """
    found = problems(cfg, world_size, device_type)
    if found:
        raise ConfigError("\n".join(found))


def resolve(cfg: RunConfig, world_size: int, device_type: str = "cuda") -> RunConfig:
    """What Megatron-LM derives from the flags, filled in (call after :func:`validate`):

    - ``--global-batch-size`` (micro-batch * DP when not given);
    - ``--train-iters`` from ``--train-samples`` (``train_samples // global_batch_size``, as
      Megatron-LM's ``update_train_iters``); ``--tst-phase1-fraction`` then counts
      iterations of that length;
    - ``--ffn-hidden-size`` (:meth:`ModelArgs.ffn_size`);
    - ``--sequence-parallel`` off when TP = 1;
    - ``--recompute-granularity selective`` from ``--recompute-activations`` or
      ``--moe-layer-recompute``, which also adds ``moe`` to ``--recompute-modules`` (as
      megatron-core's ``TransformerConfig`` does);
    - ``--transformer-impl local`` on a CPU run.
    """
    t, m, moe = cfg.train, cfg.model, cfg.moe
    gbs = global_batch_size(cfg, world_size)
    granularity = "selective" if t.recompute_activations else t.recompute_granularity
    modules = list(t.recompute_modules) if t.recompute_modules is not None else None
    if moe.moe_layer_recompute:
        granularity = granularity or "selective"
        modules = modules or ["core_attn"]  # megatron-core's default
        modules += [] if "moe" in modules else ["moe"]
    train = dataclasses.replace(
        t,
        global_batch_size=gbs,
        train_iters=t.train_iters or t.train_samples // gbs,
        sequence_parallel=t.sequence_parallel and cfg.parallel.tensor_model_parallel_size > 1,
        recompute_granularity=granularity,
        recompute_modules=modules,
        transformer_impl="local" if device_type == "cpu" else t.transformer_impl,
    )
    model = dataclasses.replace(m, ffn_hidden_size=m.ffn_size())
    return dataclasses.replace(cfg, train=train, model=model)


def lr_schedule(t: TrainArgs) -> dict:
    """Megatron-LM's ``get_optimizer_param_scheduler`` lengths, in samples (the scheduler
    advances by the global batch each step): ``lr_warmup_steps``, ``lr_decay_steps``,
    ``wd_incr_steps``, ``wsd_decay_steps``. ``t`` must be resolved (:func:`resolve`)."""
    gbs = t.global_batch_size
    if t.train_samples is not None:
        decay = t.lr_decay_samples or t.train_samples
        total, wsd = t.train_samples, t.lr_wsd_decay_samples
        warmup = t.lr_warmup_samples
    else:
        decay = (t.lr_decay_iters or t.train_iters) * gbs
        total = t.train_iters * gbs
        wsd = t.lr_wsd_decay_iters * gbs if t.lr_wsd_decay_iters is not None else None
        warmup = t.lr_warmup_iters * gbs
    if t.lr_warmup_fraction is not None:
        warmup = t.lr_warmup_fraction * decay
    if wsd is None:  # Megatron-LM requires it for WSD; here 10% of the run
        wsd = max(1, int(0.1 * t.train_iters)) * gbs
    return {
        "lr_warmup_steps": warmup,
        "lr_decay_steps": decay,
        "wd_incr_steps": total,
        "wsd_decay_steps": wsd,
    }
