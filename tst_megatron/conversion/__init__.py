"""Checkpoint conversion between Megatron ``torch_dist`` and Hugging Face ``transformers``.

- :func:`export_checkpoint`: a ``torch_dist`` checkpoint (any TP/PP/VPP/EP layout, TST or
  not) of Megatron-LM's own loop (``megatron.training.pretrain()``, e.g. the launcher
  ``examples/pretrain_gpt_tst.py``, or ``examples/pretrain_hybrid_tst.py`` with a GPT-shaped
  ``*-``/``*E`` pattern; the architecture from its saved Megatron-LM ``args``, :mod:`.mlm`)
  -> a Hugging Face directory (Qwen3-MoE, Mixtral, Qwen3 or Llama, chosen from the
  settings).
- :func:`import_checkpoint`: a Hugging Face directory of those architectures -> a
  weights-only ``release`` checkpoint in Megatron-LM's layout (tracker file, Megatron-LM
  ``args`` namespace, ``iteration`` 0) that Megatron-LM's ``load_checkpoint`` (the launcher's
  ``--load``) reads into any layout.

Both build the 1-process model the way the launcher does
(:attr:`~tst_megatron.models.family.ModelFamily.build` on the Megatron-LM
``args``). The name and layout mapping is data (:mod:`.rules`); :mod:`.hf` and
:mod:`.megatron` hold the file handling of each side. CLI: ``tools/convert_checkpoint.py``.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from tst_megatron.conversion import hf, hf_files, mlm, rules
from tst_megatron.conversion.megatron import (
    build_model,
    check_checkpoint,
    read_args,
    read_checkpoint,
    resolve_checkpoint,
    single_process,
    tensor_names,
    write_release,
)
from tst_megatron.conversion.output import (
    IMPORT_MARKER,
    building,
    check_output,
)
from tst_megatron.loop.plan import run_plan
from tst_megatron.models.pattern import gpt_equivalent


def export_checkpoint(
    load: str,
    out: str,
    *,
    ckpt_step: Optional[int] = None,
    dtype: str = "auto",
    tokenizer_model: Optional[str] = None,
    max_shard_size="5GB",
    force: bool = False,
    trust: bool = False,
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
        trust: read the checkpoint's pickles without the restricted unpickler
            (``--trust-checkpoint``: only for checkpoints the user made).

    Returns:
        ``{"architecture", "checkpoint", "out", "tensors", "dtype", "tokenizer", "phase1"}``
        (the SentencePiece model included, or None; ``(iteration, N1)`` for a checkpoint
        before a TST run's switch, else None).

    Raises:
        FileExistsError: ``out`` is a previous export and ``force`` is False.
        RefusedOutput: ``out`` is, holds or lies inside ``load``, or holds a checkpoint or
            files an export does not write, with or without ``force``
            (:func:`.output.check_output`; these are checked before any work).
        FileNotFoundError: no checkpoint at ``load``.
        ConfigError: a pickle in the checkpoint would run code, or it is damaged
            (:func:`.megatron.check_checkpoint`; before it is read).
        ValueError: a setting or a tensor with no place in any target (named), or a
            checkpoint of the former hand-written trainer (no longer read).
    """
    check_output(out, reads={"--load": load}, force=force, kind="export")
    if dtype != "auto" and dtype not in hf.DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    hf.require_transformers()
    path = resolve_checkpoint(load, ckpt_step)
    check_checkpoint(path, trust=trust)  # before anything unpickles it
    saved = read_args(path, trust=trust)
    hf.target_architecture(gpt_equivalent(saved))  # before the weights are read
    phase1 = _phase1_position(saved, path)
    args, state = read_checkpoint(path, trust=trust)
    arch = hf.target_architecture(args)
    if dtype == "auto":
        dtype = getattr(args, "hf_dtype", None) or mlm.dtype_name(args)
    if tokenizer_model is None:
        saved = getattr(args, "tokenizer_model", None)
        tokenizer_model = saved if saved and os.path.isfile(saved) else None
    shapes = hf.shapes_of(args)
    weights = rules.megatron_to_hf(state, arch, shapes)
    weights = {k: v.to(hf.DTYPES[dtype]) for k, v in weights.items()}
    config = hf.hf_config(
        args, dtype=dtype, special_ids=hf_files.special_ids(tokenizer_model, shapes.vocab_size)
    )
    hf_files.write_hf_dir(
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
        "phase1": phase1,
    }


def _phase1_position(saved, path: str) -> Optional[tuple[int, int]]:
    """``(iteration, N1)`` when the checkpoint ``path`` of a TST run (its saved ``args``) is
    before the switch, else None. Such a model was trained on bags only: the paper's phase-1
    -only models scored 4.6-6.6 next-token loss where the baseline scored 3.2 (270M)."""
    found = re.fullmatch(r"iter_(\d+)", os.path.basename(os.path.normpath(path)))
    if found is None or getattr(saved, "tst_bag_size", None) is None:
        return None
    n1 = run_plan(saved).n1
    return (int(found.group(1)), n1) if int(found.group(1)) < n1 else None


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
        ``{"architecture", "checkpoint", "args", "flags", "tokenizer"}``: ``args`` the
        Megatron-LM namespace the release stores (:func:`.mlm.megatron_lm_namespace`);
        ``flags`` the Megatron-LM flags that rebuild this architecture (for the launcher);
        ``tokenizer`` the copied SentencePiece ``<save>/tokenizer.model`` (None when
        ``hf_dir`` has none), which a later export includes again.

    Raises:
        FileExistsError: ``save`` is a previous import and ``force`` is False.
        RefusedOutput: ``save`` is, holds or lies inside ``hf_dir``, or holds a checkpoint
            or files an import does not write (:func:`.output.check_output`; before any work).
        FileNotFoundError / ValueError: see :func:`.hf_files.read_hf_dir` (every file read is a file
            of ``hf_dir``; the config's sizes against the weights' headers),
            :func:`.hf.flags_from_hf`, :func:`.rules.hf_to_megatron` (missing, extra or
            misshapen tensors are listed); a ``tokenizer.model`` that leaves ``hf_dir`` or is
            not a SentencePiece model (:func:`.hf_files.read_sentencepiece`). Nothing is written.
    """
    check_output(save, reads={"--load": hf_dir}, force=force, kind="import")
    config, hf_state = hf_files.read_hf_dir(hf_dir)
    flags, arch, hf_dtype = hf.flags_from_hf(
        config, make_vocab_size_divisible_by=make_vocab_size_divisible_by
    )
    tokenizer = tokenizer_bytes = None
    if os.path.lexists(os.path.join(hf_dir, "tokenizer.model")):  # SentencePiece: keep it
        tokenizer_bytes = hf_files.read_sentencepiece(hf_files.inside(hf_dir, "tokenizer.model"))
        tokenizer = os.path.join(os.path.abspath(save), "tokenizer.model")
        i = flags.index("--tokenizer-type")
        flags[i : i + 2] = ["--tokenizer-type", "SentencePieceTokenizer"]
        flags += ["--tokenizer-model", tokenizer]
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    ns = mlm.megatron_lm_namespace(
        flags + hf.run_flags_from_hf(config),
        padded_vocab_size=-(-config.vocab_size // multiple) * multiple,  # Megatron-LM's padding
        vocab_size=config.vocab_size,
    )
    ns.hf_dtype = hf_dtype  # the dtype a later export writes again
    with single_process():
        expected = tensor_names(build_model(ns))
    state = rules.hf_to_megatron(hf_state, expected, arch, hf.shapes_of(ns))
    with building(save) as tmp:
        if tokenizer:  # the checked bytes, as a new file with the output's usual mode
            with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
                f.write(tokenizer_bytes)
        write_release(tmp, ns, state)
        with open(os.path.join(tmp, IMPORT_MARKER), "w") as f:  # lets --force replace it later
            f.write(f"imported from {os.path.abspath(hf_dir)}\n")
    return {
        "architecture": arch.name,
        "checkpoint": os.path.join(save, "release"),
        "args": ns,
        "flags": flags,
        "tokenizer": tokenizer,
    }
