"""Architecture and layout rules of a resume: a checkpoint in ``--load`` of another model, or
in a layout Megatron-LM 0.19.2 cannot load it into, one line each before any work (run by
:func:`tst_megatron.training.checks.resume.resume_checks`)."""

from __future__ import annotations

from typing import Optional

from megatron.core.dist_checkpointing.gpt_checkpoint_interop import gpt_compatible_layer_maps


def flag_name(name: str) -> str:
    """The flag of Megatron-LM's ``args`` attribute ``name``: ``num_layers`` -> ``--num-layers``."""
    return "--" + name.replace("_", "-")


ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "swiglu",
    "normalization",
    "qk_layernorm",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "multi_latent_attention",
    "mtp_num_layers",
    "hybrid_layer_pattern",
)
"""The flags whose change makes a checkpoint another model's. Megatron-LM's
``check_checkpoint_args`` compares three of them, and only after the model is built."""


def _pattern(ns) -> Optional[str]:
    return getattr(ns, "hybrid_layer_pattern", None) or getattr(ns, "hybrid_override_pattern", None)


def model_class_problems(args, saved) -> list[str]:
    """A checkpoint of the other model class: a ``HybridModel``'s under the GPT launcher is
    refused; a ``GPTModel``'s under the hybrid launcher loads through megatron-core's
    load-time translation (``dist_checkpointing.gpt_checkpoint_interop``: each GPT layer feeds
    one attention and one MLP/MoE position of the pattern), so its ``--num-layers`` is compared
    with the pattern's GPT layer count."""
    now, was = _pattern(args), _pattern(saved)
    if was and not now:
        return [
            f"the checkpoint in --load {args.load} was saved by a HybridModel run "
            f"(--hybrid-layer-pattern {was}): resume it with examples/pretrain_hybrid_tst.py"
        ]
    if not now or was:
        return []
    try:
        layers = gpt_compatible_layer_maps(now).num_gpt_layers
    except ValueError as exc:
        message = " ".join(str(exc).split())
        return [
            f"the checkpoint in --load {args.load} is a GPTModel's, which megatron-core loads "
            f"into a HybridModel only layer for layer: {message}"
        ]
    if getattr(saved, "num_layers", layers) != layers:
        return [
            f"the checkpoint in --load {args.load} is a GPTModel's of {saved.num_layers} layers; "
            f"--hybrid-layer-pattern {now} pairs with one of {layers} (one attention and one "
            "MLP or MoE position per GPT layer)"
        ]
    return []


def architecture_problems(args, saved) -> list[str]:
    """One line naming each :data:`ARCHITECTURE` flag of ``args`` that differs from the
    checkpoint's ``saved`` arguments (empty: none, or ``--use-checkpoint-args``), after
    :func:`model_class_problems` (which runs with ``--use-checkpoint-args`` too)."""
    problems = model_class_problems(args, saved)
    if problems or getattr(args, "use_checkpoint_args", False):
        return problems
    # a GPT checkpoint in a hybrid run: its layers pair by model_class_problems' rule
    skip = {"num_layers", "hybrid_layer_pattern"} if _pattern(args) and not _pattern(saved) else ()
    changed = []
    for name in ARCHITECTURE:
        if not hasattr(saved, name) or name in skip:
            continue
        if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
            continue
        was, now = getattr(saved, name), getattr(args, name, None)
        if name == "hybrid_layer_pattern" and was and now:  # '|' is the layout, not the model
            was, now = was.replace("|", ""), now.replace("|", "")
        if was != now:
            changed.append(f"--{name.replace('_', '-')} {was} (this run: {now})")
    if not changed:
        return []
    return [
        f"the checkpoint in --load {args.load} is of another model: {', '.join(changed)}; give "
        "the checkpoint's model flags (or --use-checkpoint-args)"
    ]


#: The layout flags a legacy ``torch`` checkpoint is tied to: one ``mp_rank_<TP>[_<PP>][_<EP>]``
#: file per model-parallel rank (``megatron.training.checkpointing.get_checkpoint_name``),
#: each holding that rank's shards (and, with virtual stages, one ``model<i>`` per chunk).
TORCH_FORMAT_LAYOUT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def _expert_groups(ns) -> bool:
    """The optimizer keeps the experts' parameters in groups of their own: megatron-core marks
    them ``allreduce=False`` when EP > 1 or the expert TP differs from TP
    (``tensor_parallel/layers.py``, ``use_expert_pgs``), and ``get_megatron_optimizer`` then
    chains a dense and an expert optimizer (0.19.2)."""
    if not getattr(ns, "num_experts", None):
        return False
    tp = getattr(ns, "tensor_model_parallel_size", 1) or 1
    etp = getattr(ns, "expert_tensor_parallel_size", None) or tp
    return (getattr(ns, "expert_model_parallel_size", 1) or 1) > 1 or etp != tp


def layout_problems(args, saved, ckpt_format: str) -> list[str]:
    """The layout changes Megatron-LM 0.19.2 cannot resume, one line each (empty: none).

    - A legacy ``torch`` checkpoint loads only into the layout it was saved in
      (:data:`TORCH_FORMAT_LAYOUT`; DP may change): another one fails on a missing
      ``mp_rank_*`` file or a ``size mismatch`` after the model is built.
    - Optimizer state saved with expert groups (:func:`_expert_groups`: EP > 1, or expert TP
      other than TP) into a run without them (EP = 1), or the other way: megatron-core's
      ``_filter_and_reorder_param_groups`` raises ``ValueError: Could not find parameter
      group`` (EP 2 -> 1), the plain optimizer's load "Expected 2 entries in state dict, but
      got 4" (EP 1 -> 2, ``tests/distributed/test_megatron_lm_layouts.py``), after the model
      is built. EP 2 -> 4 is not refused (both keep the groups; not run: it needs 4
      processes). Not with ``--no-load-optim`` or ``--finetune``
      (the weights are resharded alone).
    """
    problems = []
    if ckpt_format == "torch":
        changed = [
            f"{flag_name(name)} {getattr(saved, name)} (this run: {getattr(args, name, None)})"
            for name in TORCH_FORMAT_LAYOUT
            if hasattr(saved, name) and getattr(saved, name) != getattr(args, name, None)
        ]
        if changed:
            problems.append(
                f"the checkpoint in --load {args.load} is in the legacy --ckpt-format torch, "
                f"which loads only into the layout it was saved in: {', '.join(changed)}; "
                "resume in that layout (a torch_dist checkpoint reshards onto another)"
            )
    no_optim = getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)
    if _expert_groups(saved) != _expert_groups(args) and not no_optim:
        was = getattr(saved, "expert_model_parallel_size", 1)
        now = getattr(args, "expert_model_parallel_size", 1)
        kept, other = ("keeps", "without") if _expert_groups(saved) else ("does not keep", "with")
        problems.append(
            f"the checkpoint in --load {args.load} (--expert-model-parallel-size {was}; this "
            f"run: {now}) {kept} its experts' optimizer state in groups of their own, and "
            f"megatron-core 0.19 cannot load it into a run {other} them: add --no-load-optim "
            "to resume the weights with a fresh optimizer, or resume with the checkpoint's "
            "expert layout"
        )
    return problems
