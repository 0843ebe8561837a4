"""Checkpoint conversion between Megatron ``torch_dist`` and Hugging Face ``transformers``.

- :func:`export_checkpoint`: a ``torch_dist`` checkpoint (any TP/PP/VPP/EP layout, TST or
  not) of Megatron-LM's own loop (``megatron.training.pretrain()``, e.g. the launcher
  ``examples/pretrain_gpt_tst_mlm.py``; the architecture from its saved Megatron-LM ``args``,
  :mod:`.mlm`) or of the hand-written trainer -> a Hugging Face directory (Qwen3-MoE,
  Mixtral, Qwen3 or Llama, chosen from the settings).
- :func:`import_checkpoint`: a Hugging Face directory of those architectures -> a
  weights-only ``release`` checkpoint in Megatron-LM's layout (tracker file, Megatron-LM
  ``args`` namespace, ``iteration`` 0) that Megatron-LM's ``load_checkpoint`` (the launcher's
  ``--load``) and the trainer's ``--load`` read into any layout.

The name and layout mapping is data (:mod:`.rules`); :mod:`.hf` and :mod:`.megatron` hold the
file handling of each side. CLI: ``tools/convert_checkpoint.py``.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from tst_megatron.conversion import hf, rules
from tst_megatron.conversion.megatron import (
    read_args,
    read_checkpoint,
    resolve_checkpoint,
    write_release,
)


def export_checkpoint(
    load: str,
    out: str,
    *,
    ckpt_step: Optional[int] = None,
    dtype: str = "auto",
    tokenizer_model: Optional[str] = None,
    max_shard_size="5GB",
    force: bool = False,
) -> dict:
    """Megatron ``torch_dist`` checkpoint -> Hugging Face directory.

    Args:
        load: a ``--save`` root (latest checkpoint, or ``ckpt_step``) or a checkpoint directory.
        out: the Hugging Face directory to create.
        dtype: ``auto`` (the dtype the model was imported from, else its parameter dtype),
            ``float32``, ``bfloat16`` or ``float16``.
        tokenizer_model: a SentencePiece model to include; default: the one the checkpoint's
            run used (``--tokenizer-model``), if that file exists.
        max_shard_size: safetensors shard limit (``"5GB"``, or bytes); above it the weights
            are sharded with ``model.safetensors.index.json``.
        force: replace an existing ``out``.

    Returns:
        ``{"architecture", "checkpoint", "out", "tensors", "dtype", "tokenizer"}`` (the
        SentencePiece model included, or None).

    Raises:
        FileExistsError: ``out`` exists without ``force`` (checked before any work).
        FileNotFoundError: no checkpoint at ``load``.
        ValueError: a setting or a tensor with no place in any target (named).
    """
    if os.path.exists(out) and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    if dtype != "auto" and dtype not in hf.DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    hf.require_transformers()
    path = resolve_checkpoint(load, ckpt_step)
    hf.target_architecture(read_args(path))  # before the weights are read
    args, state = read_checkpoint(path)
    arch = hf.target_architecture(args)
    if dtype == "auto":
        dtype = args.get("hf_dtype") or args.get("params_dtype") or "float32"
    if tokenizer_model is None:
        saved = (args.get("tokenizer") or {}).get("model")
        tokenizer_model = saved if saved and os.path.isfile(saved) else None
    weights = rules.megatron_to_hf(state, arch, hf.shapes_of(args))
    weights = {k: v.to(hf.DTYPES[dtype]) for k, v in weights.items()}
    config = hf.hf_config(
        args, dtype=dtype, special_ids=hf.special_ids(tokenizer_model, args["model"]["vocab_size"])
    )
    hf.write_hf_dir(
        out,
        config,
        weights,
        max_shard_size=max_shard_size,
        tokenizer_model=tokenizer_model,
        force=force,
    )
    return {
        "architecture": arch.name,
        "checkpoint": path,
        "out": out,
        "tensors": len(weights),
        "dtype": dtype,
        "tokenizer": tokenizer_model,
    }


def import_checkpoint(
    hf_dir: str,
    save: str,
    *,
    make_vocab_size_divisible_by: int = 128,
    tensor_model_parallel_size: int = 1,
    force: bool = False,
) -> dict:
    """Hugging Face directory -> ``<save>/release`` (+ tracker), loadable with ``--load``.

    Args:
        hf_dir: a Hugging Face model directory (Qwen3-MoE, Mixtral, Qwen3, Llama).
        save: the checkpoint root to create.
        make_vocab_size_divisible_by / tensor_model_parallel_size: the vocabulary padding of
            the runs that will load it (Megatron pads to a multiple of their product).
        force: replace an existing ``save``.

    Returns:
        ``{"architecture", "checkpoint", "args", "flags", "tokenizer"}``; ``flags`` are the
        Megatron-LM flags (the launcher's and the trainer's) that rebuild this architecture; ``tokenizer`` is the copied SentencePiece
        ``<save>/tokenizer.model`` (None when ``hf_dir`` has none), which a later export
        includes again.

    Raises:
        FileExistsError: ``save`` exists without ``force``.
        FileNotFoundError / ValueError: see :func:`.hf.read_hf_dir`, :func:`.hf.args_from_hf`,
            :func:`.rules.hf_to_megatron` (missing, extra or misshapen tensors are listed).
    """
    if os.path.exists(save) and not force:
        raise FileExistsError(f"{save} exists; pass --force to replace it")
    config, hf_state = hf.read_hf_dir(hf_dir)
    args, arch = hf.args_from_hf(
        config,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tp=tensor_model_parallel_size,
    )
    from tst_megatron.conversion.megatron import build_model, single_process, tensor_names

    with single_process():
        expected = tensor_names(build_model(args))
    state = rules.hf_to_megatron(hf_state, expected, arch, hf.shapes_of(args))
    tmp = save.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = None
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):  # SentencePiece: keep it
        tokenizer = os.path.join(os.path.abspath(save), "tokenizer.model")
        args["tokenizer"] = {"type": "SentencePieceTokenizer", "model": tokenizer}
        os.makedirs(tmp)
        shutil.copyfile(
            os.path.join(hf_dir, "tokenizer.model"), os.path.join(tmp, "tokenizer.model")
        )
    write_release(tmp, args, state, saved_args=megatron_lm_args(args))
    if os.path.exists(save):
        shutil.rmtree(save)
    os.replace(tmp, save)
    return {
        "architecture": arch.name,
        "checkpoint": os.path.join(save, "release"),
        "args": args,
        "flags": trainer_flags(args),
        "tokenizer": tokenizer,
    }


def megatron_lm_args(args: dict):
    """Megatron-LM's ``args`` namespace for the converter's dict ``args`` (an imported
    model): :func:`~tst_megatron.conversion.mlm.megatron_lm_namespace` of
    :func:`trainer_flags` with ``--seq-length``, ``--max-position-embeddings`` and
    ``--init-method-std``, the padded vocabulary of ``args``, and ``hf_dtype`` (the dtype
    the Hugging Face model had, which a later export writes again) as an extra attribute."""
    from tst_megatron.conversion.mlm import megatron_lm_namespace

    m = args["model"]
    flags = trainer_flags(args) + [
        "--seq-length",
        str(m["seq_length"]),
        "--max-position-embeddings",
        str(m["max_position_embeddings"]),
        "--init-method-std",
        str(m["init_method_std"]),
    ]
    ns = megatron_lm_namespace(
        flags, padded_vocab_size=args["padded_vocab_size"], vocab_size=m["vocab_size"]
    )
    ns.hf_dtype = args.get("hf_dtype")
    return ns


def trainer_flags(args: dict) -> list:
    """The flags (Megatron-LM's names; the trainer and the launcher take them) that rebuild
    the architecture of ``args``."""
    from tst_megatron.conversion.megatron import run_config
    from tst_megatron.training.checkpointing import ARCHITECTURE_FIELDS

    cfg = run_config(args)
    flags = []
    for group, names in ARCHITECTURE_FIELDS.items():
        if group == "moe" and not cfg.moe.num_experts:
            continue
        if group == "model" and not cfg.model.group_query_attention:
            names = tuple(n for n in names if n != "num_query_groups")
        values = getattr(cfg, group)
        for name in names + (
            ("vocab_size", "make_vocab_size_divisible_by", "norm_epsilon", "rotary_base")
            if group == "model"
            else ()
        ):
            value = getattr(values, name)
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                if value:
                    flags.append(flag)
            elif value is not None:
                flags += [flag, str(value)]
    tokenizer = args.get("tokenizer") or {}
    if tokenizer.get("type"):  # required by the trainer, as by Megatron-LM
        flags += ["--tokenizer-type", tokenizer["type"]]
        if tokenizer.get("model"):
            flags += ["--tokenizer-model", tokenizer["model"]]
    return flags
