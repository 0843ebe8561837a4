"""Run configuration: one small dataclass per concern, command-line flags generated from
the fields (Megatron-LM's flag names: ``field_name`` -> ``--field-name``; TST fields get the
``--tst-`` prefix), and one validation function that only reads and raises.
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
from typing import Optional, Sequence

from tst_megatron.errors import ConfigError
from tst_megatron.runtime.distributed import ParallelConfig
from tst_megatron.superposition.schedule import TSTConfig
from tst_megatron.training.precision import check_fp8_shapes


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """The GPT architecture (Megatron-LM flag names)."""

    num_layers: int = 4
    """Transformer layers."""
    hidden_size: int = 128
    """h."""
    ffn_hidden_size: Optional[int] = None
    """Dense MLP width; None = 4 * h."""
    num_attention_heads: int = 4
    """Attention heads."""
    group_query_attention: bool = False
    """Use grouped-query attention (with --num-query-groups)."""
    num_query_groups: int = 1
    """KV groups under --group-query-attention."""
    kv_channels: Optional[int] = None
    """Attention head dimension; None = --hidden-size / --num-attention-heads."""
    seq_length: int = 128
    """T: positions the transformer processes per sample (phase-1 samples hold S*T tokens)."""
    max_position_embeddings: Optional[int] = None
    """Learned-position table size; None = --seq-length."""
    position_embedding_type: str = "rope"
    """rope or learned_absolute."""
    rotary_base: int = 10000
    """RoPE base."""
    normalization: str = "RMSNorm"
    """LayerNorm or RMSNorm."""
    norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm."""
    swiglu: bool = False
    """SwiGLU MLPs (gated linear unit with SiLU)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer weights."""
    disable_bias_linear: bool = False
    """No biases in linear layers."""
    qk_layernorm: bool = False
    """Normalise queries and keys."""
    init_method_std: float = 0.02
    """Std of the normal weight initialisation."""
    vocab_size: Optional[int] = None
    """Vocabulary size before padding (required with --mock-data and no tokenizer)."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times TP."""
    hidden_dropout: float = 0.1
    """Dropout after attention/MLP and on embeddings."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""


@dataclasses.dataclass(frozen=True)
class MoEArgs:
    """Mixture of experts (Megatron-LM flag names); --num-experts None = dense."""

    num_experts: Optional[int] = None
    """Experts per MoE layer."""
    moe_ffn_hidden_size: Optional[int] = None
    """Expert MLP width; None = --ffn-hidden-size."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_router_load_balancing_type: str = "aux_loss"
    """aux_loss, seq_aux_loss, sinkhorn or none."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient."""
    moe_z_loss_coeff: Optional[float] = None
    """Router z-loss coefficient."""
    moe_router_score_function: str = "softmax"
    """softmax or sigmoid."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k (weights not renormalised); default: softmax over the top-k."""
    moe_router_dtype: Optional[str] = None
    """fp32 or fp64 router computation; None = model dtype."""
    moe_token_dispatcher_type: str = "alltoall"
    """allgather, alltoall or flex."""
    moe_grouped_gemm: bool = False
    """Grouped GEMM experts (needs Transformer Engine)."""
    moe_layer_freq: int = 1
    """Every n-th layer is MoE."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared expert; None = no shared expert."""
    moe_expert_capacity_factor: Optional[float] = None
    """Token capacity per expert; None = no dropping."""


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

    def to_parallel_config(self, num_layers: int) -> ParallelConfig:
        """The runtime's :class:`ParallelConfig` (virtual stages derived from layers)."""
        vpp = None
        if self.num_layers_per_virtual_pipeline_stage:
            vpp = num_layers // (
                self.pipeline_model_parallel_size * self.num_layers_per_virtual_pipeline_stage
            )
        return ParallelConfig(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
        )


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    """Optimisation, batch and precision (Megatron-LM flag names)."""

    micro_batch_size: int = 2
    """Samples per micro-batch per DP rank (same in both phases)."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step; None = micro-batch * DP."""
    train_iters: int = 100
    """N: optimizer steps."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate."""
    lr_decay_style: str = "WSD"
    """constant, linear, cosine or WSD."""
    lr_warmup_iters: int = 0
    """Linear warmup steps."""
    lr_wsd_decay_iters: Optional[int] = None
    """WSD decay steps at the end; None = 10% of --train-iters."""
    lr_wsd_decay_style: str = "linear"
    """WSD decay shape: linear, cosine, exponential or minus_sqrt."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    bf16: bool = False
    """bf16 parameters and compute (GPU)."""
    seed: int = 1234
    """Random seed."""
    sequence_parallel: bool = False
    """Sequence parallelism (with TP > 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across DP (GPU)."""
    transformer_impl: str = "local"
    """local or transformer_engine."""
    fp8_format: Optional[str] = None
    """e4m3 or hybrid (Transformer Engine)."""
    fp8_recipe: str = "delayed"
    """FP8 scaling recipe: delayed, tensorwise, mxfp8 or blockwise."""
    fp8_amax_history_len: int = 1024
    """Amax history length for delayed scaling."""
    device: str = "auto"
    """auto, cuda or cpu (cpu = gloo + the CPU runtime)."""


@dataclasses.dataclass(frozen=True)
class DataArgs:
    """Data (Megatron-LM flag names)."""

    mock_data: bool = False
    """Synthetic data (megatron-core MockGPTDataset)."""
    data_path: Optional[str] = None
    """Dataset prefix, or 'weight prefix weight prefix ...' (one quoted word or several, as in
    Megatron-LM)."""
    split: str = "969,30,1"
    """Train,valid,test proportions."""
    tokenizer_type: str = "NullTokenizer"
    """NullTokenizer or SentencePieceTokenizer."""
    tokenizer_model: Optional[str] = None
    """SentencePiece model file."""
    data_cache_path: Optional[str] = None
    """Where dataset index caches are written."""
    eod_mask_loss: bool = False
    """Do not score the token after EOD."""
    reset_position_ids: bool = False
    """Restart positions at each document (phase 2 only)."""
    reset_attention_mask: bool = False
    """Block attention across documents (phase 2 only)."""
    num_workers: int = 0
    """Data loader workers (0 = in the main process)."""


@dataclasses.dataclass(frozen=True)
class CheckpointArgs:
    """Checkpointing, logging and evaluation (Megatron-LM flag names)."""

    save: Optional[str] = None
    """Checkpoint directory to write."""
    load: Optional[str] = None
    """Checkpoint directory to resume from (latest iteration)."""
    load_optim: bool = True
    """Restore the optimizer state (``--no-load-optim`` loads weights, schedule and step only)."""
    load_rng: bool = True
    """Restore each rank's RNG states (``--no-load-rng`` skips them)."""
    save_interval: Optional[int] = None
    """Save every n steps."""
    ckpt_format: str = "torch_dist"
    """Checkpoint format; only torch_dist."""
    log_interval: int = 10
    """Console/TensorBoard line every n steps."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard event directory."""
    eval_interval: Optional[int] = None
    """Validate every n steps (next-token loss, both phases)."""
    eval_iters: int = 2
    """Validation micro-batch rounds per evaluation."""
    exit_signal_handler: bool = False
    """On SIGTERM: finish the step, save, exit 0."""


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


#: Fields whose values come from a fixed set (argparse ``choices``; :func:`validate` checks
#: the same sets for configurations built in code).
CHOICES = {
    "position_embedding_type": ("rope", "learned_absolute"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
    "moe_router_score_function": ("softmax", "sigmoid"),
    "moe_router_dtype": ("fp32", "fp64"),
    "moe_token_dispatcher_type": ("allgather", "alltoall", "flex"),
    "lr_decay_style": ("constant", "linear", "cosine", "WSD"),
    "lr_wsd_decay_style": ("linear", "cosine", "exponential", "minus_sqrt"),
    "transformer_impl": ("local", "transformer_engine"),
    "fp8_format": ("e4m3", "hybrid"),
    "fp8_recipe": ("delayed", "tensorwise", "mxfp8", "blockwise"),
    "device": ("auto", "cuda", "cpu"),
    "tokenizer_type": ("NullTokenizer", "SentencePieceTokenizer"),
    "ckpt_format": ("torch_dist",),
    "bag_weighting": ("uniform", "power"),
}


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


def _flag(prefix: str, name: str) -> str:
    return "--" + prefix + name.replace("_", "-")


def _base_type(annotation):
    hint = annotation if not isinstance(annotation, str) else eval(annotation, vars(typing))  # noqa: S307
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def build_parser() -> argparse.ArgumentParser:
    """The parser: one flag per dataclass field, help text from the field docstrings."""
    parser = argparse.ArgumentParser(
        description="Megatron-style GPT/MoE pretraining with Token Superposition Training",
        allow_abbrev=False,
    )
    for group_name, (cls, prefix) in _GROUPS.items():
        group = parser.add_argument_group(group_name)
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for field in dataclasses.fields(cls):
            kind = _base_type(hints[field.name])
            dest = f"{group_name}.{field.name}"
            text = docs.get(field.name, "")
            if kind is bool and field.default is True:
                group.add_argument(
                    _flag("no-" + prefix, field.name),
                    dest=dest,
                    action="store_false",
                    default=True,
                    help=text,
                )
            elif kind is bool:
                group.add_argument(
                    _flag(prefix, field.name), dest=dest, action="store_true", help=text
                )
            else:
                group.add_argument(
                    _flag(prefix, field.name),
                    dest=dest,
                    type=kind,
                    default=field.default,
                    choices=CHOICES.get(field.name),
                    nargs="*" if field.name == "data_path" else None,  # joined in parse_args
                    metavar=None if field.name in CHOICES else field.name.upper(),
                    help=f"{text} (default: {field.default})",
                )
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> RunConfig:
    """Parse Megatron-style flags into a :class:`RunConfig`. Unknown flags exit with usage.

    Under torchrun only rank 0 prints ``--help``; the other ranks exit quietly.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if ("-h" in args or "--help" in args) and os.environ.get("RANK", "0") != "0":
        sys.exit(0)
    namespace = vars(build_parser().parse_args(args))
    values = {name: {} for name in _GROUPS}
    for key, value in namespace.items():
        group, field = key.split(".", 1)
        if isinstance(value, list):  # --data-path 0.7 A 0.3 B (nargs="*")
            value = " ".join(value) or None
        values[group][field] = value
    return RunConfig(**{name: cls(**values[name]) for name, (cls, _) in _GROUPS.items()})


def all_flags() -> list[str]:
    """Every long flag the parser accepts, sorted (frozen by a test)."""
    return sorted(
        opt
        for action in build_parser()._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    )


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )


def validate(cfg: RunConfig, world_size: int, device_type: str = "cuda") -> None:
    """Stop before any work on an unusable or contradictory setting: one line naming the flag
    and the fix. Reads only.

    Args:
        cfg: the run configuration.
        world_size: number of processes.
        device_type: ``"cuda"`` or ``"cpu"``, the device the run will use.

    Raises:
        ConfigError: the first problem found.
    """
    m, moe, p, t, d, c, tst = (
        cfg.model,
        cfg.moe,
        cfg.parallel,
        cfg.train,
        cfg.data,
        cfg.checkpoint,
        cfg.tst,
    )
    vpl = p.num_layers_per_virtual_pipeline_stage
    if vpl is not None and (vpl < 1 or m.num_layers % (p.pipeline_model_parallel_size * vpl)):
        raise ConfigError(
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size x "
            f"--num-layers-per-virtual-pipeline-stage {vpl}"
        )
    if vpl is not None and p.pipeline_model_parallel_size == 1:
        raise ConfigError(
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
        )
    p.to_parallel_config(m.num_layers).validate(world_size)
    tst.validate(t.train_iters)
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    dp = data_parallel_size(cfg, world_size)
    if t.train_iters < 1:
        raise ConfigError("--train-iters must be >= 1")
    if t.micro_batch_size < 1:
        raise ConfigError("--micro-batch-size must be >= 1")
    gbs = t.global_batch_size or t.micro_batch_size * dp
    if gbs % (t.micro_batch_size * dp) != 0:
        raise ConfigError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp}; change one of them"
        )
    if m.position_embedding_type not in ("rope", "learned_absolute"):
        raise ConfigError("--position-embedding-type must be rope or learned_absolute")
    if m.normalization not in ("LayerNorm", "RMSNorm"):
        raise ConfigError("--normalization must be LayerNorm or RMSNorm")
    if m.num_attention_heads % tp != 0:
        raise ConfigError(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if t.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if t.sequence_parallel and m.seq_length % tp != 0:
        raise ConfigError(
            f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
            "under --sequence-parallel"
        )
    if moe.num_experts and tp > 1 and not t.sequence_parallel:
        raise ConfigError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel")
    if cp > 1 and m.seq_length % (2 * cp) != 0:
        raise ConfigError(
            f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size {cp}"
        )
    if moe.num_experts and moe.num_experts % p.expert_model_parallel_size != 0:
        raise ConfigError(
            f"--num-experts {moe.num_experts} is not divisible by --expert-model-parallel-size "
            f"{p.expert_model_parallel_size}"
        )
    if p.expert_model_parallel_size > 1 and not moe.num_experts:
        raise ConfigError("--expert-model-parallel-size > 1 needs --num-experts")
    if m.num_layers % p.pipeline_model_parallel_size != 0:
        raise ConfigError(
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size "
            f"{p.pipeline_model_parallel_size}"
        )
    if tst.bag_size > 1 and tst.phase1_steps(t.train_iters) > 0:
        for flag, on in (
            ("--reset-position-ids", d.reset_position_ids),
            ("--reset-attention-mask", d.reset_attention_mask),
        ):
            if on:
                raise ConfigError(
                    f"{flag} is not supported in TST phase 1 (--tst-bag-size > 1): bags are "
                    "formed on the packed token stream; drop the flag or set --tst-bag-size 1"
                )
    if not d.mock_data and not d.data_path:
        raise ConfigError("give --mock-data or --data-path")
    if d.tokenizer_type == "NullTokenizer" and m.vocab_size is None:
        raise ConfigError("--vocab-size is required with --tokenizer-type NullTokenizer")
    if d.tokenizer_type not in ("NullTokenizer", "SentencePieceTokenizer"):
        raise ConfigError("--tokenizer-type must be NullTokenizer or SentencePieceTokenizer")
    if d.tokenizer_type == "SentencePieceTokenizer" and not d.tokenizer_model:
        raise ConfigError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model")
    if c.ckpt_format != "torch_dist":
        raise ConfigError(f"--ckpt-format {c.ckpt_format} is not supported; use torch_dist")
    if c.save_interval is not None and c.save_interval < 1:
        raise ConfigError("--save-interval must be >= 1")
    if (c.save_interval or c.exit_signal_handler) and not c.save:
        raise ConfigError("--save-interval and --exit-signal-handler need --save DIR")
    if not 0 <= t.lr_warmup_iters < t.train_iters:
        raise ConfigError(
            f"--lr-warmup-iters {t.lr_warmup_iters} must be in [0, --train-iters {t.train_iters})"
        )
    if t.lr_wsd_decay_iters is not None and not 0 < t.lr_wsd_decay_iters <= t.train_iters:
        raise ConfigError("--lr-wsd-decay-iters must be in (0, --train-iters]")
    if t.lr_decay_style not in ("constant", "linear", "cosine", "WSD"):
        raise ConfigError("--lr-decay-style must be constant, linear, cosine or WSD")
    if t.transformer_impl not in ("local", "transformer_engine"):
        raise ConfigError("--transformer-impl must be local or transformer_engine")
    if t.fp8_format and t.transformer_impl != "transformer_engine":
        raise ConfigError("--fp8-format needs --transformer-impl transformer_engine")
    check_fp8_shapes(cfg)
    if moe.moe_grouped_gemm and t.transformer_impl != "transformer_engine":
        raise ConfigError("--moe-grouped-gemm needs --transformer-impl transformer_engine")
    if d.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {d.num_workers}")
    if cp > 1 and t.transformer_impl != "transformer_engine":
        raise ConfigError(
            "--context-parallel-size > 1 needs --transformer-impl transformer_engine "
            "(megatron-core's local attention has no context parallelism)"
        )
    if device_type == "cpu":
        for flag, on in (
            ("--bf16", t.bf16),
            ("--use-distributed-optimizer", t.use_distributed_optimizer),
            ("--transformer-impl transformer_engine", t.transformer_impl == "transformer_engine"),
        ):
            if on:
                raise ConfigError(f"{flag} needs a CUDA device; drop it for CPU runs")
        if p.pipeline_model_parallel_size > 1 and not m.untie_embeddings_and_output_weights:
            raise ConfigError(
                "tied embeddings with --pipeline-model-parallel-size > 1 need a CUDA device "
                "(megatron-core moves them with .cuda()); add --untie-embeddings-and-output-weights"
            )
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.seq_length:
        raise ConfigError("--max-position-embeddings must be >= --seq-length")
