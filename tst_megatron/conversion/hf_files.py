"""The files of a Hugging Face model directory, read as input and written atomically: the
safetensors shards (split by ``huggingface_hub.split_torch_state_dict_into_shards`` with the
standard index file), ``config.json`` beside them, and the SentencePiece tokenizer. Every
path read is checked to be a file inside the folder (:func:`inside`)."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, Optional, Tuple

import sentencepiece
import torch

from tst_megatron.conversion.hf import require_transformers
from tst_megatron.conversion.output import (
    building,
    check_output,
    umask,
)

# --- files --------------------------------------------------------------------------------


def inside(folder: str, name: str) -> str:
    """The path of ``name`` in ``folder``, checked to be a file of that folder: ``name`` is a
    relative path without ``..``, and its real path (symlinks resolved) is a regular file
    inside ``folder``'s real path.

    Raises:
        ValueError: an absolute path, a ``..`` or a symlink that leaves ``folder``, or not a
            regular file (one line naming it).
    """
    if not isinstance(name, str) or os.path.isabs(name) or ".." in name.split("/"):
        raise ValueError(f"{folder}: {name!r} is not a file name inside the folder")
    path = os.path.join(folder, name)
    real, root = os.path.realpath(path), os.path.realpath(folder)
    if not real.startswith(root + os.sep):
        raise ValueError(f"{path} leads outside {folder} (to {real}); it is not read")
    if not os.path.isfile(real):
        raise ValueError(f"{path} is not a regular file")
    return path


def read_sentencepiece(path: str) -> bytes:
    """The bytes of a SentencePiece model file, checked to load as one (at most 64 MiB).

    Raises:
        ValueError: larger, or not a SentencePiece model (one line naming it).
    """

    if os.path.getsize(path) > 64 * 2**20:
        raise ValueError(f"{path} is over 64 MiB: not a SentencePiece model")
    with open(path, "rb") as f:
        data = f.read()
    try:
        sentencepiece.SentencePieceProcessor(model_proto=data)
    except (RuntimeError, TypeError, OSError) as exc:
        why = " ".join(str(exc).split())[:120]
        raise ValueError(f"{path} is not a SentencePiece model ({why})") from None
    return data


def safetensors_header(path: str) -> Dict[str, dict]:
    """The header of a safetensors file, ``{tensor name: {"dtype", "shape", ...}}`` (its first
    8 + n bytes; no tensor is read).

    Raises:
        ValueError: not a safetensors file (a header that does not fit the file or is not JSON).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, 100 * 2**20):
            raise ValueError(f"{path} is not a safetensors file (header size {length})")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file")
    header.pop("__metadata__", None)
    return header


def check_config_against_weights(config, headers: Dict[str, dict]) -> None:
    """The config's sizes against the weights' safetensors headers, before any model is built
    (a config of 10^6 layers or a 10^7 vocabulary over small weights is refused here, not
    allocated): the embedding is ``[vocab_size, hidden_size]`` and the layers stored are
    ``0 .. num_hidden_layers - 1``.

    Raises:
        ValueError: one line naming the first size that does not match.
    """
    embedding = headers.get("model.embed_tokens.weight", {}).get("shape")
    want = [config.vocab_size, config.hidden_size]
    if embedding != want:
        raise ValueError(
            f"config.json says vocab_size {config.vocab_size} x hidden_size "
            f"{config.hidden_size}, but model.embed_tokens.weight is {embedding}"
        )
    stored = {int(n.split(".")[2]) for n in headers if re.match(r"model\.layers\.\d+\.", n)}
    if stored != set(range(config.num_hidden_layers)):
        raise ValueError(
            f"config.json says num_hidden_layers {config.num_hidden_layers}, but the weights "
            f"hold {len(stored)} layers ({min(stored, default=None)} to {max(stored, default=None)})"
        )


def read_hf_dir(path: str) -> Tuple[object, Dict[str, torch.Tensor]]:
    """``(config, {name: tensor})`` of a Hugging Face model directory (one
    ``model.safetensors`` or shards with ``model.safetensors.index.json``).

    Every file read is a file of the directory (:func:`inside`: no absolute path, no ``..``,
    no symlink leaving it), the config's sizes are checked against the safetensors headers
    (:func:`check_config_against_weights`) before any tensor is read, and the config is read
    without remote code. A tied model's ``lm_head.weight``, if stored anyway, is dropped when
    it equals ``model.embed_tokens.weight``.

    Raises:
        FileNotFoundError: no ``config.json`` or no safetensors weights.
        ValueError: a path that leaves the directory, a file that is not safetensors, sizes
            that do not match, or a tied model storing an ``lm_head.weight`` different from
            the embedding.
    """
    transformers = require_transformers()
    # Hugging Face packages: optional (the hf extra), only for conversion
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist")
    if not os.path.lexists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json (not a Hugging Face model directory)")
    inside(path, "config.json")
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.lexists(index):
        with open(inside(path, "model.safetensors.index.json")) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = sorted({str(name) for name in weight_map.values()})
    elif os.path.lexists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json")
    paths = [inside(path, name) for name in files]  # every one checked before any is read
    headers: Dict[str, dict] = {}
    for file in paths:
        headers.update(safetensors_header(file))
    check_config_against_weights(config, headers)
    state: Dict[str, torch.Tensor] = {}
    for file in paths:
        state.update(load_file(file))
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

    Everything is written to a new hidden folder next to ``out`` and renamed at the end.

    Raises:
        FileExistsError: ``out`` is a previous export and ``force`` is False.
        RefusedOutput: ``out`` holds anything but a previous export (a checkpoint, other
            files) or the tokenizer model (:func:`.output.check_output`; nothing is written).
    """
    require_transformers()
    # Hugging Face packages: optional (the hf extra), only for conversion
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    reads = {"--tokenizer-model": tokenizer_model} if tokenizer_model else {}
    check_output(out, reads=reads, force=force, kind="export")
    with building(out) as tmp:
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
        mask = umask()
        for name in os.listdir(tmp):  # safetensors writes 0600; give every file the usual mode
            os.chmod(os.path.join(tmp, name), 0o666 & ~mask)
    return out


def special_ids(tokenizer_model: Optional[str], vocab_size: int) -> dict:
    """``bos/eos/pad_token_id`` of a SentencePiece model (eos = Megatron's EOD); without a
    model, Megatron's NullTokenizer convention: EOD = ``vocab_size - 1``."""
    if not tokenizer_model:
        return {"eos_token_id": vocab_size - 1}

    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
    return {k: v for k, v in ids.items() if v >= 0}


def write_tokenizer(out: str, tokenizer_model: str, max_length: int = 1 << 30) -> None:
    """Copy a SentencePiece model as ``tokenizer.model`` with a ``LlamaTokenizer`` config
    (special pieces read from the model; no BOS/EOS added, as Megatron's tokenizer)."""

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
