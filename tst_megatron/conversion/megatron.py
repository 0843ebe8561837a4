"""Megatron side of the conversion: a ``torch_dist`` checkpoint <-> the state dict of a
1-process megatron-core ``GPTModel``.

A checkpoint saved with any TP/PP/VPP/EP/expert-TP layout is read by building the model
with every parallel size 1 and letting ``dist_checkpointing`` reshard into it; an imported
model is written the same way, as Megatron-LM's weights-only ``release`` checkpoint, which
the trainer loads into any layout (``--load``). The whole model is held in CPU memory once
(about 4 bytes per parameter in fp32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Dict, Iterator, Optional, Tuple

import torch

from tst_megatron.runtime.distributed import free_port
from tst_megatron.training import checkpointing


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """A 1-process gloo world with megatron-core's parallel state (all sizes 1) on the CPU.

    Uses an existing process group when there is one (and then leaves it). Otherwise sets
    ``RANK=0, WORLD_SIZE=1`` and a free ``MASTER_PORT`` for the duration, and tears down.

    Raises:
        RuntimeError: an existing process group has more than one rank.
    """
    import torch.distributed as dist

    from tst_megatron.runtime import destroy, init_distributed, initialize_model_parallel
    from tst_megatron.runtime.distributed import ParallelConfig

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
    from megatron.core import tensor_parallel

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


def run_config(args: dict):
    """A :class:`~tst_megatron.training.config.RunConfig` with the architecture of checkpoint
    ``args`` and every other setting at its default (1 process, CPU, eval dropout 0)."""
    from tst_megatron.superposition.schedule import TSTConfig
    from tst_megatron.training.config import (
        CheckpointArgs,
        DataArgs,
        ModelArgs,
        MoEArgs,
        ParallelArgs,
        RunConfig,
        TrainArgs,
    )

    def known(cls, values):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    model = known(ModelArgs, dict(args["model"], hidden_dropout=0.0, attention_dropout=0.0))
    return RunConfig(
        model=model,
        moe=known(MoEArgs, args["moe"]),
        parallel=ParallelArgs(),
        train=TrainArgs(
            device="cpu", transformer_impl="local", bf16=args.get("params_dtype") == "bfloat16"
        ),
        data=DataArgs(mock_data=True),
        checkpoint=CheckpointArgs(),
        tst=TSTConfig(),
    )


def build_model(args: dict):
    """The whole ``GPTModel`` of checkpoint ``args`` in this 1-process world (local spec,
    eval mode, CPU). Call inside :func:`single_process`."""
    from tst_megatron.training.model import build_model as build_run_model
    from tst_megatron.training.model import transformer_config

    cfg = run_config(args)
    config = transformer_config(cfg, use_cpu_initialization=True)
    return build_run_model(cfg, config, vocab_size=args["padded_vocab_size"]).eval()


def tensor_names(model) -> Dict[str, torch.Size]:
    """``{name: shape}`` of the model's weights (``_extra_state`` entries left out)."""
    return {
        name: value.shape
        for name, value in model.state_dict().items()
        if isinstance(value, torch.Tensor) and not name.endswith("_extra_state")
    }


def resolve_checkpoint(load: str, ckpt_step: Optional[int] = None) -> str:
    """The checkpoint directory for ``--load``: a root with a tracker file (its latest, or
    ``iter_<ckpt_step>``), or a checkpoint directory itself.

    Raises:
        FileNotFoundError: nothing loadable at ``load``.
    """
    if not os.path.exists(load):
        raise FileNotFoundError(f"{load} does not exist")
    if ckpt_step is not None:
        path = checkpointing.checkpoint_dir(load, ckpt_step)
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
        latest = checkpointing.latest_iteration(load) if os.path.isdir(load) else None
        if latest is None:
            raise FileNotFoundError(
                f"{load} is neither a checkpoint directory nor a --save root with "
                f"{checkpointing.TRACKER}"
            )
        path = (
            os.path.join(load, checkpointing.RELEASE)
            if latest == checkpointing.RELEASE
            else checkpointing.checkpoint_dir(load, latest)
        )
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"{path} is not a torch_dist checkpoint (no metadata.json)")
    return path


def read_args(path: str) -> dict:
    """The architecture stored in the checkpoint directory ``path`` (no weights are read), as
    the converter's dict: the trainer's ``args`` as stored, Megatron-LM's ``args`` namespace
    (a checkpoint of ``megatron.training.pretrain()``, e.g. the launcher
    ``examples/pretrain_gpt_tst_mlm.py``, or an imported one) through
    :func:`~tst_megatron.conversion.mlm.converter_args`.

    Raises:
        ValueError: the checkpoint has no ``args`` (written before they were stored), or
            Megatron-LM ``args`` with a setting the converter cannot hold (named).
    """
    from megatron.core import dist_checkpointing

    from tst_megatron.conversion.mlm import converter_args, is_megatron_lm

    common = dist_checkpointing.load_common_state_dict(path)
    if common.get("args") is None:
        raise ValueError(
            f"{path} stores no model args (saved by an older version or with "
            "Megatron-LM's args left out); re-save it (--load it, train one step, --save)"
        )
    args = common["args"]
    return converter_args(args) if is_megatron_lm(args) else args


def read_checkpoint(path: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """Load the ``torch_dist`` checkpoint directory ``path`` into a 1-process model.

    Returns:
        ``(args, state)``: the stored ``args`` and the model's weights
        ``{megatron name: tensor}`` (parameter dtype).

    Raises:
        ValueError: the checkpoint has no ``args`` (written before they were stored).
    """
    args = read_args(path)
    with single_process():
        model = build_model(args)
        checkpointing.load_model_weights(path, [model])
        weights = model.state_dict()
        state = {name: weights[name].detach().clone() for name in tensor_names(model)}
    return args, state


def write_release(root: str, args: dict, state: Dict[str, torch.Tensor], *, saved_args=None) -> str:
    """Write ``state`` (``{megatron name: tensor}``, every weight of the model of ``args``)
    as ``<root>/release`` and point ``root``'s tracker at it. Returns the directory.

    The checkpoint stores ``saved_args`` as its ``args`` (default: ``args``), with
    Megatron-LM's ``iteration`` (0) and ``checkpoint_version`` (3.0), the common entries
    Megatron-LM's ``load_checkpoint`` and ``load_args_from_checkpoint`` read.

    Raises:
        ValueError: ``state``'s names differ from the model's (listing them).
    """
    with single_process():
        model = build_model(args)
        expected = tensor_names(model)
        if set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise ValueError(f"state does not fit the model: missing {missing}, extra {extra}")
        with torch.no_grad():
            for name, param in model.state_dict(keep_vars=True).items():
                if name in state:
                    param.copy_(state[name])
        os.makedirs(root, exist_ok=True)
        return checkpointing.save_release(
            root,
            [model],
            args=args if saved_args is None else saved_args,
            extra={"iteration": 0, "checkpoint_version": 3.0},
        )
