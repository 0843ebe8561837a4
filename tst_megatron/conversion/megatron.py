"""Megatron side of the conversion: a Megatron-LM ``torch_dist`` checkpoint <-> the state
dict of a 1-process megatron-core model.

A checkpoint of Megatron-LM's own loop (``megatron.training.pretrain()``, e.g. the launcher
``examples/pretrain_gpt_tst.py``) saved with any TP/PP/VPP/EP/expert-TP layout and either
layer spec (Transformer Engine or local) is read by building its model with every parallel
size 1 (the launcher's builder, :attr:`~tst_megatron.models.family.ModelFamily.build`, on
the checkpoint's own ``args``, :func:`.mlm.one_process_args`) and letting
``dist_checkpointing`` reshard into it; an imported model is written the same way, as
Megatron-LM's weights-only ``release`` checkpoint, which Megatron-LM's ``load_checkpoint``
(``--load``) reads into any layout. The whole model is held in CPU memory once (about 4
bytes per parameter in fp32).

Checkpoints of the former hand-written trainer (a dict as ``args``) are refused; the last
commit that reads them is :data:`LAST_OLD_FORMAT_COMMIT`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

from tst_megatron.conversion import mlm
from tst_megatron.conversion.output import RELEASE, TRACKER
from tst_megatron.data.checkpoint import (
    UnsafeCheckpoint,
    inspect,
    instead,
    read_common_state,
)
from tst_megatron.errors import ConfigError
from tst_megatron.models.family import HYBRID, family_of
from tst_megatron.models.pattern import gpt_equivalent
from tst_megatron.runtime import destroy, init_distributed, initialize_model_parallel
from tst_megatron.runtime.distributed import ParallelConfig, free_port

#: Megatron-LM's tracker file of a ``--save`` root and its weights-only checkpoint name.
#: The last commit of this project whose converter reads the hand-written trainer's format.
LAST_OLD_FORMAT_COMMIT = "0dc9f79"

#: Names of the same tensor under megatron-core's two GPT layer specs: the local spec's
#: ``sharded_state_dict_keys_map`` renames every ``pre_mlp_layernorm.`` to
#: ``mlp.linear_fc1.layer_norm_`` (MoE layers included); the Transformer Engine spec keeps an
#: MoE layer's ``pre_mlp_layernorm`` (``TENorm``).
SPEC_ALIASES = (("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),)


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """A 1-process gloo world with megatron-core's parallel state (all sizes 1) on the CPU.

    Uses an existing process group when there is one (and then leaves it). Otherwise sets
    ``RANK=0, WORLD_SIZE=1`` and a free ``MASTER_PORT`` for the duration, and tears down.

    Raises:
        RuntimeError: an existing process group has more than one rank.
    """
    owned = not dist.is_initialized()
    saved = {
        k: os.environ.get(k)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    if owned:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
        init_distributed(device="cpu")
    elif dist.get_world_size() != 1:
        raise RuntimeError("conversion runs in one process; start it without torchrun/srun")
    initialize_model_parallel(ParallelConfig())
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        if owned:
            destroy()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def build_model(ns):
    """The whole model of checkpoint ``args`` ``ns`` in this 1-process world (eval mode, CPU):
    its family's builder (:func:`~tst_megatron.models.family.family_of`,
    :attr:`~tst_megatron.models.family.ModelFamily.build`) on :func:`.mlm.one_process_args`.
    Call inside :func:`single_process`."""
    return family_of(ns).build(mlm.one_process_args(ns)).eval()


def tensor_names(model) -> Dict[str, torch.Size]:
    """``{name: shape}`` of the model's weights (``_extra_state`` entries left out)."""
    return {
        name: value.shape
        for name, value in model.state_dict().items()
        if isinstance(value, torch.Tensor) and not name.endswith("_extra_state")
    }


def _latest(root: str):
    """The tracker's iteration (int) or ``"release"``; None without a tracker."""
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
        raise ValueError(f"{path} holds {text!r}, not an iteration or 'release'") from None


def resolve_checkpoint(load: str, ckpt_step: Optional[int] = None) -> str:
    """The checkpoint directory for ``--load``: a root with Megatron-LM's tracker file (its
    latest, or ``iter_<ckpt_step>``), or a checkpoint directory itself.

    Raises:
        FileNotFoundError: nothing loadable at ``load``.
    """
    if not os.path.exists(load):
        raise FileNotFoundError(f"{load} does not exist")
    if ckpt_step is not None:
        path = os.path.join(load, f"iter_{ckpt_step:07d}")
        if not os.path.isdir(path):
            steps = sorted(
                int(n[5:]) for n in os.listdir(load) if n.startswith("iter_") and n[5:].isdigit()
            )
            raise FileNotFoundError(
                f"{load} has no iter_{ckpt_step:07d}; saved steps: "
                f"{', '.join(map(str, steps)) or 'none'}"
            )
    elif os.path.isfile(os.path.join(load, "metadata.json")):
        path = load
    else:
        latest = _latest(load) if os.path.isdir(load) else None
        if latest is None:
            raise FileNotFoundError(
                f"{load} is neither a checkpoint directory nor a --save root with {TRACKER}"
            )
        path = os.path.join(load, RELEASE if latest == RELEASE else f"iter_{latest:07d}")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"{path} is not a torch_dist checkpoint (no metadata.json)")
    return path


def check_checkpoint(path: str, *, trust: bool = False) -> None:
    """Refuse the checkpoint directory ``path`` before anything unpickles it
    (:func:`tst_megatron.data.checkpoint.inspect`, with every entry read against its CRC-32):
    megatron-core's load unpickles its ``.metadata`` and byte objects without restriction.

    Raises:
        ConfigError: a pickle in it would run code (unless ``trust``), or it is damaged (naming
            the newest intact checkpoint beside it).
    """
    try:
        problem = inspect(path, trust=trust, crc=True)
    except UnsafeCheckpoint as exc:
        raise ConfigError(f"--load: {exc}") from None
    if problem is not None:
        root, name = os.path.split(os.path.normpath(path))
        raise ConfigError(
            f"--load: {path} is damaged: {problem}; "
            + instead(root, skip=_iteration_of(name), trust=trust)
        )


def _iteration_of(name: str) -> tuple:
    return (int(name[5:]),) if name.startswith("iter_") and name[5:].isdigit() else ()


def read_args(path: str, *, trust: bool = False):
    """Megatron-LM's ``args`` namespace stored in the checkpoint directory ``path`` (no weights
    are read; ``weights_only`` unless ``trust``), checked by :func:`.mlm.check_supported`.

    Raises:
        ValueError: the checkpoint has no ``args``, is in the former hand-written trainer's
            format (a dict as ``args``: no longer read; names :data:`LAST_OLD_FORMAT_COMMIT`),
            or has a setting the converter cannot hold (named).
    """
    try:
        args = read_common_state(path, trust=trust).get("args")
    except Exception as exc:  # one line, never a traceback (a missing entry, a refused global)
        raise ValueError(
            f"{path}: its common state could not be read ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]})"
        ) from None
    if args is None:
        raise ValueError(
            f"{path} stores no model args (Megatron-LM's args left out); re-save it "
            "(--load it, train one step, --save)"
        )
    if isinstance(args, dict):
        raise ValueError(
            f"{path} is a checkpoint of the former hand-written trainer, which is no longer "
            f"read; export it with the converter of commit {LAST_OLD_FORMAT_COMMIT} "
            f"(git checkout {LAST_OLD_FORMAT_COMMIT} -- tools/convert_checkpoint.py tst_megatron)"
        )
    mlm.check_supported(args)
    return args


def load_sharded(request: dict, path: str, *, strict: str = "assume_ok_unexpected") -> dict:
    """``dist_checkpointing.load(request, path)`` for a checkpoint saved with either layer
    spec (Transformer Engine or local, grouped GEMM experts or not), as megatron-core means
    them to be interchangeable.

    - A tensor the checkpoint holds under the other spec's name (:data:`SPEC_ALIASES`) is read
      from there.
    - An ``_extra_state`` object (Transformer Engine's FP8 metadata, e.g. of a TE norm) that
      the checkpoint lacks, because the other spec has no such module state, is returned as
      ``None``, which leaves the module's state as it is when loaded.

    Args:
        request: a sharded state dict (``{"model": model.sharded_state_dict()}``); its keys
            are renamed in place where an alias applies.
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


def load_weights(path: str, model) -> None:
    """Load the model weights of the checkpoint directory ``path`` (saved with any layout and
    either spec, :func:`load_sharded`) into ``model`` (this process's layout; one chunk).
    Collective."""
    model.load_state_dict(load_sharded({"model": model.sharded_state_dict()}, path)["model"])


def read_checkpoint(path: str, *, trust: bool = False) -> Tuple[object, Dict[str, torch.Tensor]]:
    """Load the ``torch_dist`` checkpoint directory ``path`` into a 1-process model.

    Returns:
        ``(args, state)``: the stored Megatron-LM ``args`` and the model's weights
        ``{megatron name: tensor}`` (parameter dtype). A GPT-shaped ``HybridModel``
        (``*-``/``*E`` pairs) comes back as the ``GPTModel`` it equals: its
        :func:`~tst_megatron.models.pattern.gpt_equivalent` ``args`` and its weights under GPT names
        (:func:`.mlm.hybrid_to_gpt_names`).

    Raises:
        ValueError: see :func:`read_args`.
    """
    args = read_args(path, trust=trust)
    with single_process():
        model = build_model(args)
        load_weights(path, model)
        weights = model.state_dict()
        state = {name: weights[name].detach().clone() for name in tensor_names(model)}
    if family_of(args) is HYBRID:
        state, args = mlm.hybrid_to_gpt_names(state, args), gpt_equivalent(args)
    return args, state


def write_release(root: str, ns, state: Dict[str, torch.Tensor]) -> str:
    """Write ``state`` (``{megatron name: tensor}``, every weight of the model of Megatron-LM
    ``args`` ``ns``) as ``<root>/release`` and point ``root``'s tracker at it. Returns the
    directory.

    The checkpoint stores ``ns`` as its ``args``, with Megatron-LM's ``iteration`` (0) and
    ``checkpoint_version`` (3.0), the common entries Megatron-LM's ``load_checkpoint`` and
    ``load_args_from_checkpoint`` read. ``root`` is a new folder that the caller renames
    into place when complete (:mod:`.output`); nothing in it is replaced.

    Raises:
        ValueError: ``state``'s names differ from the model's (listing them).
        FileExistsError: ``root`` already holds a ``release``.
    """
    with single_process():
        model = build_model(ns)
        expected = tensor_names(model)
        if set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise ValueError(f"state does not fit the model: missing {missing}, extra {extra}")
        with torch.no_grad():
            for name, param in model.state_dict(keep_vars=True).items():
                if name in state:
                    param.copy_(state[name])
        final = os.path.join(root, RELEASE)
        if os.path.lexists(final):  # written into a fresh folder only: nothing is replaced
            raise FileExistsError(f"{final} exists")
        os.makedirs(final)
        saved = {
            "model": model.sharded_state_dict(),
            "args": ns,
            "iteration": 0,
            "checkpoint_version": 3.0,
        }
        dist_checkpointing.save(saved, final)
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(RELEASE)
    return final
