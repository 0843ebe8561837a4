"""A Megatron-LM checkpoint folder read as input, never as code: every pickled part is parsed by
a restricted unpickler before anything unpickles it for real, and the folder is checked for
damage without reading tensors.

A checkpoint is pickles. Megatron-LM 0.19.2 reads some of them with bare ``pickle.load`` or
``torch.load(weights_only=False)``: DCP's ``.metadata`` (``FileSystemReader.read_metadata``,
torch 2.13 ``torch/distributed/checkpoint/filesystem.py``) and each stored byte object
(``DefaultLoadPlanner.load_bytes``; megatron-core's common state, RNG state, optimizer groups).
So a crafted ``iter_N/.metadata`` runs its code in any tool that reads it. Here:

- :func:`~tst_megatron.data.pickle_scan.scan_pickle` parses a pickle with every global
  replaced by an inert stand-in, so nothing from the file is ever called; a global outside
  :func:`~tst_megatron.data.pickle_scan.allowed_globals` raises
  :class:`~tst_megatron.data.pickle_scan.UnsafeCheckpoint` naming it;
- :func:`inspect` does that for every pickled part of one ``iter_N`` folder in each format
  Megatron-LM 0.19 tells apart (``torch_dist``, ``torch``, ``torch_dcp``/``fsdp_dtensor``), and
  checks what can be checked without reading tensors: the files the metadata names exist, hold
  the bytes their entries need, and each entry is a well-formed ``torch.save`` archive;
- :func:`read_dcp_metadata` and :func:`read_dcp_bytes` read a DCP folder's metadata and byte
  objects through the restricted unpickler and ``torch.load(weights_only=True)``.

Files from a source the user trusts can skip this (``trust=True``: the launchers'
``--trust-checkpoint``); never the default.
"""

from __future__ import annotations

import glob
import io
import json
import os
import pickle
import re
import warnings
import zipfile
from typing import Iterable, Optional

import torch

from tst_megatron.data.pickle_scan import (
    RestrictedUnpickler,
    UnsafeCheckpoint,
    allowed_globals,
    scan_pickle,
    scan_torch_save,
    starts_as_zip,
)
from tst_megatron.errors import ConfigError


class _Slice(io.RawIOBase):
    """``length`` bytes of an open binary file from ``offset``, as a seekable stream (a DCP
    entry inside its ``.distcp`` file)."""

    def __init__(self, file, offset: int, length: int):
        self.file, self.offset, self.length, self.pos = file, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, buffer):
        n = max(0, min(len(buffer), self.length - self.pos))
        self.file.seek(self.offset + self.pos)
        data = self.file.read(n)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _check_archive(stream, crc: bool = False) -> None:
    """A ``torch.save`` archive's structure: its central directory, and each record's local
    header (read without the records' data); with ``crc``, every record's data against the
    CRC-32 ``torch.save`` stored (reads it all).

    Raises:
        zipfile.BadZipFile: damage.
    """
    with zipfile.ZipFile(stream) as archive:
        for info in archive.infolist():
            archive.open(info).close()  # reads and checks the record's local header
        # torch.load does not check the CRC: data damage would load as other numbers
        if crc and (bad := archive.testzip()) is not None:
            raise zipfile.BadZipFile(f"{bad}: its data does not match its CRC-32")


def read_dcp_metadata(path: str, *, trust: bool = False):
    """The ``Metadata`` of the DCP folder ``path`` (its ``.metadata``), unpickled resolving only
    :func:`allowed_globals` (``trust``: plain ``pickle``, as torch's
    ``FileSystemReader.read_metadata``).

    Raises:
        UnsafeCheckpoint: any other global.
        OSError, pickle.UnpicklingError, EOFError, ...: missing or damaged.
    """
    where = os.path.join(path, ".metadata")
    with open(where, "rb") as f:
        if trust:
            return pickle.load(f)
        # :func:`allowed_globals`: a torch_dcp checkpoint_id is a pathlib path (megatron-core's)
        return RestrictedUnpickler(f, allowed_globals(), where).load()


def read_dcp_bytes(path: str, metadata, fqn: str, *, trust: bool = False):
    """The byte object ``fqn`` of the DCP folder ``path`` (a ``BytesStorageMetadata`` entry),
    loaded with ``torch.load(weights_only=True)`` (``trust``: ``False``, as torch's
    ``DefaultLoadPlanner.load_bytes``).

    Raises:
        KeyError: no such entry.
        pickle.UnpicklingError: a global outside megatron-core's and torch's safe globals.
    """
    info = next((v for k, v in metadata.storage_data.items() if k.fqn == fqn), None)
    if info is None:
        raise KeyError(f"the checkpoint has no entry {fqn}")
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        data = io.BytesIO(f.read(info.length))
    return torch.load(data, map_location="cpu", weights_only=not trust)


def checkpoint_format(path: str) -> Optional[str]:
    """The format of the ``iter_N`` folder ``path`` as Megatron-LM 0.19's
    ``_get_checkpoint_format`` tells it (``metadata.json``: ``torch_dist``; ``mp_rank_0*``:
    ``torch``; ``.metadata``: ``torch_dcp``), or None for none of them."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return "torch_dist"
    if glob.glob(os.path.join(path, "mp_rank_0*")):
        return "torch"
    if os.path.isfile(os.path.join(path, ".metadata")):
        return "torch_dcp"
    return None


def inspect(path: str, *, trust: bool = False, crc: bool = False) -> Optional[str]:
    """What is wrong with the checkpoint folder ``path`` (``iter_N``), read without its tensors:
    None when intact. Unless ``trust``, every pickled part is scanned first (:func:`scan_pickle`).
    With ``crc``, every entry's data is also read and checked against its stored CRC-32: the
    only check here that finds bytes changed inside a tensor (torch.load would load them).

    - ``torch_dist``: ``metadata.json`` is JSON; ``.metadata`` unpickles; every file it names
      exists and holds the bytes its entries need; every entry is a well-formed ``torch.save``
      archive; every byte object's pickle is scanned;
    - ``torch_dcp``/``fsdp_dtensor``: the same without ``metadata.json``; a folder whose
      entries are megatron-core's (``common_state``) lacks its ``metadata.json``;
    - ``torch``: each ``mp_rank_*`` folder's ``*.pt`` files are well-formed archives whose
      pickles are scanned (their tensors are not read).

    Raises:
        UnsafeCheckpoint: a pickle would run code (never turned into damage).
    """
    fmt = checkpoint_format(path)
    if fmt is None:
        if not os.path.isdir(path):
            return "its folder does not exist"
        return (
            "no checkpoint Megatron-LM reads is in it (no metadata.json, mp_rank_*/ or .metadata)"
        )
    allowed = None if trust else allowed_globals()  # once per folder: every entry is scanned
    try:
        if fmt == "torch":
            return _torch_problem(path, allowed, crc)
        return _dcp_problem(path, fmt, allowed, crc)
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # any failure to read is damage, in one line
        return f"unreadable ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"


def _torch_problem(path: str, allowed: Optional[frozenset], crc: bool) -> Optional[str]:
    """:func:`inspect` of a legacy ``torch`` folder; ``allowed`` None: trusted, not scanned."""
    files = sorted(glob.glob(os.path.join(path, "mp_rank_*", "*.pt")))
    folders = sorted(glob.glob(os.path.join(path, "mp_rank_*")))
    empty = [os.path.basename(d) for d in folders if not glob.glob(os.path.join(d, "*.pt"))]
    if empty:
        return f"{empty[0]}/ holds no .pt file"
    for file in files:
        name = os.path.relpath(file, path)
        if starts_as_zip(file):
            try:
                _check_archive(file, crc)
            except zipfile.BadZipFile as exc:
                return f"{name} is damaged ({exc})"
        if allowed is not None:
            try:
                scan_torch_save(file, file, allowed)
            except UnsafeCheckpoint:
                raise
            except Exception as exc:
                return f"{name} is damaged ({type(exc).__name__}: {exc})"
    return None


def _dcp_problem(path: str, fmt: str, allowed: Optional[frozenset], crc: bool) -> Optional[str]:
    """:func:`inspect` of a DCP folder; ``allowed`` None: trusted, not scanned."""
    # torch's DCP metadata: imported when a DCP folder is read
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    if fmt == "torch_dist":
        try:
            with open(os.path.join(path, "metadata.json")) as f:
                if not isinstance(json.load(f), dict):
                    return "metadata.json holds no JSON object"
        except (OSError, ValueError) as exc:
            return f"metadata.json is unreadable ({type(exc).__name__})"
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return ".metadata is missing"
    trust = allowed is None
    # torch falls back to __<rank>.metadata when .metadata reads as falsy: scan every one;
    # megatron-core's legacy common state sits in common.pt
    others = sorted(glob.glob(os.path.join(path, "__*.metadata")))
    legacy = os.path.join(path, "common.pt")
    for other in [] if trust else others + ([legacy] if os.path.isfile(legacy) else []):
        try:
            if other == legacy:
                scan_torch_save(other, other, allowed)
            else:
                with open(other, "rb") as f:
                    scan_pickle(f, other, allowed)
        except UnsafeCheckpoint:
            raise
        except Exception as exc:
            return f"{os.path.basename(other)} is unreadable ({type(exc).__name__})"
    try:
        metadata = read_dcp_metadata(path, trust=trust)
    except UnsafeCheckpoint:
        raise
    except Exception as exc:
        return f".metadata is unreadable ({type(exc).__name__})"
    if not isinstance(metadata, Metadata):
        return f".metadata holds a {type(metadata).__name__}, not torch's DCP Metadata"
    stored = metadata.state_dict_metadata
    if fmt == "torch_dcp" and any(k.startswith("common_state/") for k in stored):
        return "metadata.json is missing (its entries are a torch_dist checkpoint's)"
    kinds = {fqn: isinstance(md, BytesStorageMetadata) for fqn, md in stored.items()}
    by_file: dict = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index.fqn, info))
    for relative, entries in sorted(by_file.items()):
        file = os.path.join(path, relative)
        if not os.path.isfile(file):
            return f"{relative} is missing ({len(entries)} entries of .metadata are in it)"
        size, need = os.path.getsize(file), max(i.offset + i.length for _, i in entries)
        if size < need:
            return f"{relative} holds {size} of the {need} bytes its entries need (truncated)"
        with open(file, "rb") as f:
            for fqn, info in entries:
                if info.transform_descriptors:
                    return f"{relative}: {fqn} is stored transformed, which is not checked here"
                item = _Slice(f, info.offset, info.length)
                try:
                    if not starts_as_zip(item):  # torch.save output begins with a zip header
                        raise zipfile.BadZipFile("it does not begin with a zip local header")
                    _check_archive(item, crc)
                    if kinds.get(fqn) and not trust:
                        where = os.path.join(path, relative)
                        scan_torch_save(io.BufferedReader(item), where, allowed)
                except UnsafeCheckpoint:
                    raise
                except Exception as exc:
                    return f"{relative}: the entry {fqn} is damaged ({type(exc).__name__}: {exc})"
    return None


#: What :func:`read_common_state` keeps of a checkpoint's common state.
COMMON_KEYS = ("args", "iteration", "opt_param_scheduler", "checkpoint_version")


def read_common_state(path: str, *, trust: bool = False) -> dict:
    """The entries :data:`COMMON_KEYS` of the checkpoint folder ``path`` (``iter_<N>``), and
    its ``"format"`` (``torch_dist``, ``torch`` or ``torch_dcp``), in each format
    Megatron-LM 0.19's ``load_checkpoint`` tells apart (``_get_checkpoint_format``), read as
    data (``torch.load(weights_only=True)`` with megatron-core's safe globals; the DCP
    metadata through :func:`read_dcp_metadata`), or, with
    ``trust``, as Megatron-LM reads them:

    - ``torch_dist`` (``metadata.json``, any layout): megatron-core's ``common_state`` byte
      object (or its legacy ``common.pt``);
    - ``torch`` (``mp_rank_*/model_optim_rng.pt``): one rank's file, memory-mapped so that
      its tensors are not read (every rank's file holds the same ``args``);
    - ``torch_dcp`` / ``fsdp_dtensor`` (``.metadata``): torch's distributed checkpoint,
      reading those keys' byte objects only.

    Raises:
        ConfigError: none of these formats.
        pickle.UnpicklingError: a global outside the safe ones (run :func:`inspect` first:
            it names it).
    """
    fmt = checkpoint_format(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if fmt == "torch_dist" and os.path.isfile(os.path.join(path, "common.pt")):
            common = torch.load(os.path.join(path, "common.pt"), weights_only=not trust)
        elif fmt == "torch_dist":
            metadata = read_dcp_metadata(path, trust=trust)
            loaded = read_dcp_bytes(path, metadata, "common_state/shard_0_1", trust=trust)
            if isinstance(loaded, io.BytesIO):  # as megatron-core's load_common_state_dict
                loaded.seek(0)
                loaded = torch.load(loaded, map_location="cpu", weights_only=not trust)
            common = loaded[0]  # a one-element list
        elif fmt == "torch":
            shard = sorted(glob.glob(os.path.join(path, "mp_rank_*", "model_optim_rng.pt")))[0]
            try:
                common = torch.load(shard, map_location="cpu", weights_only=not trust, mmap=True)
            except RuntimeError:  # a file of torch's pre-1.6 format cannot be mapped
                common = torch.load(shard, map_location="cpu", weights_only=not trust)
        elif fmt == "torch_dcp":
            # torch's DCP metadata: imported when a DCP folder is read
            from torch.distributed.checkpoint.metadata import BytesStorageMetadata

            metadata = read_dcp_metadata(path, trust=trust)
            stored = metadata.state_dict_metadata
            common = {
                k: read_dcp_bytes(path, metadata, k, trust=trust)
                for k in COMMON_KEYS
                if isinstance(stored.get(k), BytesStorageMetadata)
            }
        else:
            raise ConfigError(
                f"--load: {path} holds no checkpoint Megatron-LM reads (no metadata.json, "
                "mp_rank_*/model_optim_rng.pt or .metadata)"
            )
    return {"format": fmt, **{k: common[k] for k in COMMON_KEYS if k in common}}


_ITER = re.compile(r"iter_(\d{7,})$")


def iterations(root: str) -> list[int]:
    """The iterations of the ``iter_N`` folders in the checkpoint root ``root``, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [int(m.group(1)) for n in names if (m := _ITER.match(n))]
    return sorted(found, reverse=True)


def newest_intact(
    root: str, *, skip: Iterable[int] = (), trust: bool = False, crc: bool = False
) -> Optional[int]:
    """The newest iteration in ``root`` whose folder :func:`inspect` (``trust``, ``crc``) finds
    intact, other than ``skip``; None when there is none. A folder that would run code is not
    intact."""
    skip = set(skip)
    for iteration in iterations(root):
        if iteration in skip:
            continue
        try:
            folder = os.path.join(root, f"iter_{iteration:07d}")
            if inspect(folder, trust=trust, crc=crc) is None:
                return iteration
        except UnsafeCheckpoint:
            continue
    return None


def instead(root: str, *, skip: Iterable[int] = (), trust: bool = False, crc: bool = False) -> str:
    """What to do about a damaged checkpoint in ``root``: resume the newest intact one
    (:func:`newest_intact`) with ``--ckpt-step``, which Megatron-LM's ``load_checkpoint`` and
    the converter honour, or that there is none."""
    newest = newest_intact(root, skip=skip, trust=trust, crc=crc)
    if newest is None:
        return f"no intact checkpoint is in {root}: restore one"
    return (
        f"the newest intact checkpoint is iter_{newest:07d}: use it with --ckpt-step {newest} "
        "(or fix or remove the damaged one)"
    )
