"""``torch_dist`` checkpoints through megatron-core ``dist_checkpointing``.

A checkpoint is named parts plus the config (Megatron-LM's layout, so its tools find it):
``<dir>/iter_0000042/`` holds ``model`` (``model0``, ``model1``... with virtual pipelines),
``optimizer``, ``opt_param_scheduler``, ``loop`` (iteration, tokens consumed), ``tst``
(the TST settings), ``args`` (the architecture, as Megatron-LM stores its ``args``) and each
rank's RNG states; ``<dir>/latest_checkpointed_iteration.txt`` names the newest. A tracker
that reads ``release`` names ``<dir>/release/``: model weights only (Megatron-LM's layout for
converted checkpoints, e.g. from ``tools/convert_checkpoint.py import``), loaded as the
starting point of iteration 0. Each checkpoint is written to ``iter_XXXXXXX.tmp`` and renamed when every
rank has finished, and the tracker file is replaced atomically, so a crash never leaves a
checkpoint that looks complete but is not. The data position is a function of the
iteration (see :mod:`.data`), so it needs no separate state.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

from tst_megatron.errors import ConfigError
from tst_megatron.superposition.schedule import TSTConfig
from tst_megatron.training.forward import unwrap
from tst_megatron.training.model import ffn_hidden_size

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"

#: Settings that fix the shapes or the function of the weights. A checkpoint loads only into
#: a model with the same values (the message names the flag, instead of a shape mismatch).
ARCHITECTURE_FIELDS = {
    "model": (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "group_query_attention",
        "num_query_groups",
        "kv_channels",
        "position_embedding_type",
        "normalization",
        "swiglu",
        "untie_embeddings_and_output_weights",
        "disable_bias_linear",
        "qk_layernorm",
    ),
    "moe": (
        "num_experts",
        "moe_ffn_hidden_size",
        "moe_router_topk",
        "moe_layer_freq",
        "moe_shared_expert_intermediate_size",
        "moe_router_score_function",
        "moe_router_pre_softmax",
    ),
}


def checkpoint_args(cfg, *, vocab_size: int, padded_vocab_size: int) -> dict:
    """The ``args`` entry of a checkpoint: what a converter needs to rebuild the model.

    Args:
        cfg: the run's :class:`~tst_megatron.training.config.RunConfig`.
        vocab_size: the vocabulary before padding (tokenizer size or ``--vocab-size``).
        padded_vocab_size: rows of the embedding and output weights (Megatron's padding).

    Returns:
        ``{"model": ModelArgs fields (vocab_size resolved), "moe": MoEArgs fields,
        "padded_vocab_size": int, "params_dtype": "float32" | "bfloat16",
        "tokenizer": {"type": str, "model": str | None}}`` (plain Python values).
    """
    return {
        "model": dict(dataclasses.asdict(cfg.model), vocab_size=vocab_size),
        "moe": dataclasses.asdict(cfg.moe),
        "padded_vocab_size": padded_vocab_size,
        "params_dtype": "bfloat16" if cfg.train.bf16 else "float32",
        "tokenizer": {"type": cfg.data.tokenizer_type, "model": cfg.data.tokenizer_model},
    }


def _effective(args: dict) -> dict:
    """``args`` with the defaults that None stands for filled in (Megatron's meanings)."""
    m, moe = dict(args["model"]), dict(args["moe"])
    m["kv_channels"] = m.get("kv_channels") or m["hidden_size"] // m["num_attention_heads"]
    m["ffn_hidden_size"] = ffn_hidden_size(
        m.get("ffn_hidden_size"), m["hidden_size"], swiglu=m.get("swiglu", False)
    )
    if not m.get("group_query_attention"):
        m["num_query_groups"] = m["num_attention_heads"]
    if moe.get("num_experts"):
        moe["moe_ffn_hidden_size"] = moe.get("moe_ffn_hidden_size") or m["ffn_hidden_size"]
        if moe.get("moe_layer_freq", 1) == 1:
            m["ffn_hidden_size"] = None  # every layer is MoE: the dense width shapes nothing
    else:
        moe = {"num_experts": None}
    return {"model": m, "moe": moe}


def check_architecture(saved: dict, current: dict, path: str) -> None:
    """Raise ``ConfigError`` naming the first flag whose value differs between the ``args``
    of the checkpoint at ``path`` (``saved``) and this run's (``current``); padded vocab too.
    Unset values compare as their defaults (``--kv-channels`` = h / heads, ...)."""
    old_args, new_args = _effective(saved), _effective(current)
    for group, names in ARCHITECTURE_FIELDS.items():
        for name in names:
            old, new = old_args[group].get(name), new_args[group].get(name)
            if old != new:
                raise ConfigError(
                    f"checkpoint {path} was saved with --{name.replace('_', '-')} {old} but "
                    f"this run has {new}; use the checkpoint's value"
                )
    if saved["padded_vocab_size"] != current["padded_vocab_size"]:
        raise ConfigError(
            f"checkpoint {path} has a padded vocabulary of {saved['padded_vocab_size']} rows "
            f"but this run pads to {current['padded_vocab_size']}; match --vocab-size/"
            "--make-vocab-size-divisible-by (times --tensor-model-parallel-size)"
        )


# Key optimizer state by parameter only, so a checkpoint reshards across TP/PP/EP/DP layouts
# (megatron-core ChainedOptimizer otherwise prefixes "chained_<i>." by optimizer count).
_OPTIMIZER_METADATA = {"chained_optim_avoid_prefix": True}


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str):
    """The iteration named by the tracker file (int), ``"release"``, or None when there is none.

    Raises:
        ConfigError: the tracker holds something else.
    """
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{path} holds {text!r}, not an iteration or 'release'") from None


def write_tracker(root: str, value) -> None:
    """Point ``root``'s tracker file at ``value`` (an iteration or ``"release"``), atomically."""
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(value))
    os.replace(tracker_tmp, os.path.join(root, TRACKER))


def _model_sharded(model_chunks):
    if len(model_chunks) == 1:
        return {"model": unwrap(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(model_chunks)}


def _rng_object() -> ShardedObject:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _restore_rng(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(
    root, iteration, model_chunks, optimizer, scheduler, *, loop: dict, tst: TSTConfig, args: dict
) -> str:
    """Write the checkpoint of ``iteration`` under ``root``; return its directory.

    ``args`` is :func:`checkpoint_args` (stored for converters and the architecture check).
    """
    sharded = _model_sharded(model_chunks)
    state = dict(sharded)
    state["optimizer"] = optimizer.sharded_state_dict(sharded, metadata=_OPTIMIZER_METADATA)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["loop"] = dict(loop, iteration=iteration, world_size=dist.get_world_size())
    state["tst"] = dataclasses.asdict(tst)
    state["args"] = args
    state["rng_state"] = _rng_object()
    return _save_and_track(root, checkpoint_dir(root, iteration), state, iteration)


def _save_and_track(root: str, final: str, state: dict, tracker_value) -> str:
    """``dist_checkpointing.save`` into ``final + ".tmp"``, rename to ``final`` once every
    rank is done, then point the tracker at ``tracker_value``. Collective."""
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dist_checkpointing.save(state, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_tracker(root, tracker_value)
    dist.barrier()
    return final


_RUN_CHANGING = ("bag_size", "bag_weighting", "mode")


def _optimizer_count(optimizer) -> int:
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def load_checkpoint(
    root,
    model_chunks,
    optimizer,
    scheduler,
    *,
    tst: TSTConfig,
    train_iters: int,
    args: dict,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    strict: str = "assume_ok_unexpected",
) -> Optional[dict]:
    """Restore the newest checkpoint under ``root`` into the given objects.

    Returns:
        The saved ``loop`` dict (with ``iteration``), or None when ``root`` has no checkpoint.
        A ``release`` checkpoint (weights only) restores the model and returns
        ``{"iteration": 0, "consumed_tokens": 0, "release": True}``: training starts at
        iteration 0 with a fresh optimizer and schedule, as Megatron-LM does; so does any
        checkpoint with ``finetune`` (``--finetune``). ``strict`` is megatron-core's
        ``dist_checkpointing`` key-mismatch handling (``--dist-ckpt-strictness``).

    The model always loads into any TP/PP/EP/DP layout (``torch_dist`` reshards). The
    optimizer state does too, except between layouts whose megatron-core optimizer is split
    differently (EP > 1 or expert-TP != TP gives a separate expert optimizer); such a
    load stops with a message suggesting ``--no-load-optim``.

    Raises:
        ConfigError: the checkpoint's architecture (:data:`ARCHITECTURE_FIELDS`, padded
            vocabulary) differs from ``args``, or its TST settings differ from this run's in a
            way that would change the run (bag size, weighting, phase-1 length), naming the
            field; or the optimizer layouts differ (see above).
    """
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = os.path.join(root, RELEASE) if iteration == RELEASE else checkpoint_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    if common.get("args") is not None:
        saved = common["args"]
        if not isinstance(saved, dict):  # Megatron-LM's namespace (e.g. an imported model)
            from tst_megatron.conversion.mlm import converter_args

            saved = converter_args(saved)
        check_architecture(saved, args, path)
    if iteration == RELEASE or finetune:
        _load_model(model_chunks, path, strict=strict)
        return {"iteration": 0, "consumed_tokens": 0, "release": True}
    saved_tst = TSTConfig(**common["tst"])
    for name in _RUN_CHANGING:
        if getattr(saved_tst, name) != getattr(tst, name):
            raise ConfigError(
                f"checkpoint {path} was saved with tst {name}={getattr(saved_tst, name)!r} but this "
                f"run has {getattr(tst, name)!r}; use the same --tst-{name.replace('_', '-')}"
            )
    if saved_tst.phase1_steps(train_iters) != tst.phase1_steps(train_iters):
        raise ConfigError(
            f"checkpoint {path} has {saved_tst.phase1_steps(train_iters)} phase-1 iterations but "
            f"this run has {tst.phase1_steps(train_iters)}; use the same --tst-phase1-iters/fraction"
        )
    saved_optim = common.get("optimizer", {})
    saved_count = sum(1 for k in saved_optim if isinstance(k, int)) or 1
    if load_optim and saved_count != _optimizer_count(optimizer):
        raise ConfigError(
            f"checkpoint {path} holds {saved_count} optimizer(s) but this layout builds "
            f"{_optimizer_count(optimizer)} (experts in an optimizer of their own, EP > 1 or "
            "expert-TP != TP, on one side only); resume with the same "
            "--expert-model-parallel-size and --expert-tensor-parallel-size or pass --no-load-optim"
        )
    sharded = _model_sharded(model_chunks)
    request = dict(sharded)
    if load_optim:
        request["optimizer"] = optimizer.sharded_state_dict(
            sharded, is_loading=True, metadata=_OPTIMIZER_METADATA
        )
    # RNG states are per rank: restored only when the layout's world size is unchanged.
    same_world = load_rng and common["loop"].get("world_size") == dist.get_world_size()
    if same_world:
        request["rng_state"] = _rng_object()
    state = load_sharded(request, path, strict=strict)
    _set_model(model_chunks, state)
    if load_optim:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_world:
        _restore_rng(state["rng_state"])
    return state["loop"]


#: Names megatron-core gives one tensor in its two layer specs: an MoE layer's pre-MLP norm is
#: ``pre_mlp_layernorm.*`` in the Transformer Engine spec (a separate norm) but
#: ``mlp.linear_fc1.layer_norm_*`` in the local spec (whose ``sharded_state_dict_keys_map``
#: renames it to the TE name of a norm fused into fc1, which only dense TE layers have).
SPEC_ALIASES = (("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),)


def load_sharded(request: dict, path: str, *, strict: str = "assume_ok_unexpected") -> dict:
    """``dist_checkpointing.load(request, path)`` for a checkpoint saved with either layer
    spec (Transformer Engine or local, ``--moe-grouped-gemm`` or not), as megatron-core means
    them to be interchangeable. Collective.

    - A tensor the checkpoint holds under the other spec's name (:data:`SPEC_ALIASES`) is read
      from there (model weights and their optimizer states alike).
    - An ``_extra_state`` object (Transformer Engine's FP8 metadata, e.g. of a TE norm) that
      the checkpoint lacks, because the other spec has no such module state, is returned as
      ``None``, which leaves the module's state as it is when loaded.

    Args:
        request: a sharded state dict (``{"model": model.sharded_state_dict(), ...}``); its
            keys are renamed in place where an alias applies.
        path: the checkpoint directory.
        strict: megatron-core's key-mismatch handling (``--dist-ckpt-strictness``).

    Returns:
        The loaded state dict, shaped like ``request``.

    Raises:
        megatron-core's ``CheckpointingException``: any other tensor or object is missing.
    """
    saved = {getattr(meta, "key", name) for name, meta in load_sharded_metadata(path).items()}
    absent = []

    def adapt(tree: dict, where: tuple) -> dict:
        out = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = adapt(value, where + (name,))
            elif isinstance(value, ShardedTensor) and value.key not in saved:
                for a, b in SPEC_ALIASES:
                    for old, new in ((a, b), (b, a)):
                        if old in value.key and value.key.replace(old, new, 1) in saved:
                            value.key = value.key.replace(old, new, 1)
                out[name] = value
            elif (
                isinstance(value, ShardedObject)
                and value.key.endswith("_extra_state")
                and value.key not in saved
            ):
                absent.append(where + (name,))
            else:
                out[name] = value
        return out

    state = dist_checkpointing.load(adapt(request, ()), path, strict=strict)
    for where in absent:
        node = state
        for name in where[:-1]:
            node = node.setdefault(name, {})
        node[where[-1]] = None
    return state


def _set_model(model_chunks, state: dict) -> None:
    if len(model_chunks) == 1:
        unwrap(model_chunks[0]).load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model_chunks):
            unwrap(chunk).load_state_dict(state[f"model{i}"])


def _load_model(model_chunks, path: str, strict: str = "assume_ok_unexpected") -> None:
    """Load only the weights of the checkpoint at ``path`` (any layout it was saved in)."""
    _set_model(model_chunks, load_sharded(_model_sharded(model_chunks), path, strict=strict))


def save_release(root: str, model_chunks, *, args, extra: Optional[dict] = None) -> str:
    """Write ``model_chunks``' weights as ``<root>/release`` (Megatron-LM's weights-only
    layout) with ``args`` (this trainer's dict or Megatron-LM's namespace) and the common
    entries ``extra``, and point the tracker at it. Collective over all ranks.

    Written to ``release.tmp`` and renamed when complete. Returns the directory.
    """
    state = dict(_model_sharded(model_chunks))
    state.update(extra or {})
    state["args"] = args
    return _save_and_track(root, os.path.join(root, RELEASE), state, RELEASE)


def load_model_weights(path: str, model_chunks) -> dict:
    """Load the weights of the checkpoint directory ``path`` (``iter_XXXXXXX`` or
    ``release``, saved with any TP/PP/VPP/EP layout) into ``model_chunks`` (this process's
    layout; ``torch_dist`` reshards). Collective. Returns the checkpoint's common state
    (``args``, and ``tst``/``loop`` for training checkpoints)."""
    common = dist_checkpointing.load_common_state_dict(path)
    _load_model(model_chunks, path)
    return common
