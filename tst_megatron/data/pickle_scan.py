"""Pickles read as input, never as code: a restricted unpickler that replaces every global
by an inert stand-in (so nothing from the file is ever called) and names any global outside
the allowed ones (:class:`UnsafeCheckpoint`). :mod:`tst_megatron.data.checkpoint` runs it on
every pickled part of a checkpoint folder."""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Optional

import torch

# torch's default weights_only allow-list (the set torch.load(weights_only=True) starts from)
from torch._weights_only_unpickler import _get_allowed_globals

from tst_megatron.errors import ConfigError

#: The DCP metadata classes torch 2.13 pickles in ``.metadata`` (a real ``torch_dist`` and
#: ``torch_dcp`` checkpoint's, read with a recording unpickler).
DCP_METADATA_GLOBALS = frozenset(
    [f"torch.distributed.checkpoint.metadata.{name}" for name in (
        "Metadata", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )]
    + [f"torch.distributed.checkpoint.planner.{name}" for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
    )]
    + ["torch.distributed.checkpoint.filesystem._StorageInfo", "torch.serialization._get_layout"]
)  # fmt: skip


#: numpy 1.x's names of what megatron-core allows under numpy 2's (``numpy._core``): a
#: checkpoint saved with numpy < 2 names them in its RNG state (the scan calls nothing).
NUMPY_1_GLOBALS = frozenset(["numpy.core.multiarray._reconstruct", "numpy.core.multiarray.scalar"])


def _megatron_globals() -> set:
    """megatron-core's allowed globals: those it registers with torch at import
    (``megatron/core/safe_globals.py``, ``SAFE_GLOBALS``) and its restricted unpickler's
    (``SafeUnpickler._SAFE_CLASSES``: TE's FP8 recipes among them)."""
    # megatron-core: heavy, imported when a checkpoint is read
    from megatron.core.safe_globals import SAFE_GLOBALS, SafeUnpickler

    names = {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
    return names | {f"{m}.{n}" for m, n in SafeUnpickler._SAFE_CLASSES}


def allowed_globals() -> frozenset:
    """Every global a checkpoint's pickles may name (``"module.name"``): torch's own
    ``weights_only`` set (tensors, storages, dtypes, ``OrderedDict``, ...), the globals
    registered with ``torch.serialization.add_safe_globals`` (megatron-core's, at its import),
    megatron-core's own restricted unpickler's, and :data:`DCP_METADATA_GLOBALS`."""
    registered = set()
    for g in torch.serialization.get_safe_globals():
        g = g[0] if isinstance(g, tuple) else g
        registered.add(f"{g.__module__}.{g.__qualname__}")
    return frozenset(
        set(_get_allowed_globals())
        | registered
        | _megatron_globals()
        | DCP_METADATA_GLOBALS
        | NUMPY_1_GLOBALS
    )


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file's pickle names a global outside :func:`allowed_globals`: reading it
    with ``pickle`` would import and may call it.

    Attributes:
        file: the file's path.
        name: the global, ``"module.name"``.
    """

    def __init__(self, file: str, name: str):
        self.file, self.name = file, name
        super().__init__(
            f"{file} would run code when read: its pickle names {name}, which no Megatron-LM "
            "checkpoint holds; refused. If you made this checkpoint yourself and trust it, "
            "add --trust-checkpoint"
        )


class _Inert:
    """What every allowed global becomes while a pickle is scanned: it takes any call,
    construction, state and item, and does nothing."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _Scanner(pickle.Unpickler):
    def __init__(self, file, allowed: frozenset, where: str):
        super().__init__(file)
        self.allowed, self.where = allowed, where

    nested = False  # the pickle builds an io.BytesIO: bytes that may hold another pickle

    def find_class(self, module, name):
        full = f"{module}.{name}"
        if full not in self.allowed:
            raise UnsafeCheckpoint(self.where, full)
        self.nested |= full == "_io.BytesIO"
        return _Inert  # never the real object: nothing the file names is called

    def persistent_load(self, pid):
        return _Inert()  # torch.save's storages: not read


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals it is given
    (:func:`~tst_megatron.data.checkpoint.read_dcp_metadata`:
    :func:`allowed_globals`)."""

    def __init__(self, file, allowed: frozenset, where: str):
        super().__init__(file)
        self.allowed, self.where = allowed, where

    def find_class(self, module, name):
        if f"{module}.{name}" not in self.allowed:
            raise UnsafeCheckpoint(self.where, f"{module}.{name}")
        return super().find_class(module, name)


_ZIP_MAGIC = b"PK\x03\x04"


def starts_as_zip(data) -> bool:
    """``data`` (a path or a seekable binary stream) begins with a zip local header, as
    ``torch.load`` requires of its zip format (``torch.serialization._is_zipfile``)."""
    if isinstance(data, str):
        with open(data, "rb") as f:
            return f.read(4) == _ZIP_MAGIC
    data.seek(0)
    head = data.read(4)
    data.seek(0)
    return head == _ZIP_MAGIC


def scan_pickle(stream, where: str, allowed: Optional[frozenset] = None) -> bool:
    """Parse one pickle from ``stream`` with every global an inert stand-in. Returns whether it
    builds an ``io.BytesIO`` (whose bytes :func:`scan_torch_save` scans in turn).

    Raises:
        UnsafeCheckpoint: a global outside ``allowed`` (default :func:`allowed_globals`).
        pickle.UnpicklingError, EOFError, ValueError: not a whole pickle (damage).
    """
    scanner = _Scanner(stream, allowed or allowed_globals(), where)
    scanner.load()
    return scanner.nested


def _byte_streams(obj, depth: int = 0) -> list:
    """The ``io.BytesIO`` objects in ``obj`` (itself, or in its lists, tuples and dicts)."""
    if isinstance(obj, io.BytesIO):
        return [obj]
    if depth > 8:
        return []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [b for item in obj for b in _byte_streams(item, depth + 1)]
    return []


def scan_torch_save(
    data, where: str, allowed: Optional[frozenset] = None, *, depth: int = 0
) -> None:
    """Scan every pickle of one ``torch.save`` output (a path or a binary stream): each
    ``*.pkl`` record of its zip archive, or the leading pickles of torch's pre-1.6 format; and,
    when it holds ``io.BytesIO`` objects, their bytes in turn (to ``depth`` 4).

    Raises:
        UnsafeCheckpoint: see :func:`scan_pickle`.
        zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError: damage.
    """
    allowed = allowed or allowed_globals()
    # torch.load takes a zip only when it starts with one (torch._is_zipfile); zipfile also
    # accepts data before it, which torch would unpickle as its pre-1.6 format
    if starts_as_zip(data) and zipfile.is_zipfile(data):
        nested = False
        with zipfile.ZipFile(data) as archive:
            for name in archive.namelist():
                if name.endswith(".pkl"):
                    with archive.open(name) as record:
                        nested |= scan_pickle(record, where, allowed)
        if nested and depth < 4:  # DCP stores a BytesIO value as torch.save(BytesIO(...))
            if not isinstance(data, str):
                data.seek(0)
            # every global in it was allowed above: weights_only gives the real bytes
            for inner in _byte_streams(torch.load(data, map_location="cpu", weights_only=True)):
                if starts_as_zip(inner):
                    scan_torch_save(inner, where, allowed, depth=depth + 1)
                else:
                    inner.seek(0)
                    try:
                        scan_pickle(inner, where, allowed)
                    except UnsafeCheckpoint:
                        raise
                    except Exception:  # raw bytes, not a pickle: nothing to run
                        pass
        return
    stream = open(data, "rb") if isinstance(data, str) else data
    try:
        stream.seek(0)
        for _ in range(4):  # magic number, protocol, system info, the object (torch < 1.6)
            scan_pickle(stream, where, allowed)
    finally:
        if isinstance(data, str):
            stream.close()
