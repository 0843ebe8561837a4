"""No device-to-host read per micro-batch from the TST step of the launcher.

One phase-1 and one phase-2 training step of Megatron-LM's loop (``pretrain()`` through
:func:`tst_megatron.training.cli.main`: an MoE model, 3 micro-batches) run under a
``TorchFunctionMode`` that records every host read of a tensor value (``.item()``,
``.tolist()``, ``bool()``, ``int()``, ``float()``, ``.numpy()``, and the data-dependent
shapes ``nonzero``/``masked_select``/boolean indexing) with its call stack. On a GPU each of
these waits for the stream. The mode is on for the whole of Megatron-LM's ``train_step`` of
iterations 1 (phase 1) and 3 (phase 2): the schedule, the launcher's forward step
(:class:`~tst_megatron.loop.forward.TSTForwardStep`) and its loss function, the
backward and the optimizer.

Allowed, because they are not the TST step's:
- reads in the data pipeline (megatron-core's datasets, ``data/gpt_datasets.py``): host
  tensors, before the forward step moves the batch to the device;
- reads outside megatron-core's pipeline schedule: once per step (the optimizer's grad
  norm and inf check, ``train_step``'s loss reductions);
- inside the schedule, megatron-core's own: the MoE token dispatcher's split sizes, the
  RNG tracker's comparison of host RNG states, ``finalize_model_grads``'s token count,
  the boolean-mask fill in its cross-entropy (phase 2, as in any baseline run), and its rerun
  state machine's checks of the gradients and (``pretrain_gpt.py``'s, in the loss function)
  of the loss.
Not allowed: any read made by the TST step itself (``superposition/``,
``loop/forward.py``, ``models/gpt.py``, ``loop/switch.py`` as the innermost
project or megatron-core frame) or any other read inside the schedule.
"""

import contextlib
import io
import os
import traceback

import pytest
import torch

from tests.distributed.harness import run_distributed

pytest.importorskip("megatron.training")

ARGV = (
    "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32 --num-attention-heads 4 "
    "--ffn-hidden-size 64 --seq-length 16 --max-position-embeddings 16 --swiglu "
    "--normalization RMSNorm --position-embedding-type rope "
    "--disable-bias-linear --untie-embeddings-and-output-weights --micro-batch-size 2 "
    "--global-batch-size 6 --train-iters 4 --tst-bag-size 4 --tst-phase1-iters 2 "
    "--lr 1e-3 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 --eval-interval 4 "
    "--num-workers 0 --seed 5 --num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2 "
    "--moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --moe-token-dispatcher-type alltoall"
).split()

HOST_READS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "numpy",
    "nonzero",
    "masked_select",
    "is_nonzero",
    "equal",
}
TST_STEP = (
    "tst_megatron/superposition/",
    "tst_megatron/loop/forward.py",
    "tst_megatron/models/gpt.py",
    "tst_megatron/loop/switch.py",
    "tst_megatron/loop/plan.py",
)
MEGATRON_OWN = (
    "megatron/core/transformer/moe/",
    "megatron/core/tensor_parallel/random.py",
    "megatron/core/distributed/finalize_model_grads.py",
    "megatron/core/tensor_parallel/cross_entropy.py",  # the baseline's CE (boolean-mask fill)
    # Megatron-LM's NaN/Inf checks (--check-for-nan-in-loss-and-grad, on by default) of the
    # gradients, once per step in finalize_model_grads, and of each micro-batch's loss, as
    # pretrain_gpt.py's loss_func does: megatron-core's rerun state machine.
    "megatron/core/rerun_state_machine.py",
)

#: Megatron-LM's own loop (``train_step``'s reductions across the model-parallel group, once
#: per step, outside the schedule)
LOOP = "megatron/training/"
#: the data pipeline: the datasets build each sample from host tensors (a read there is no
#: device sync); the forward step moves the batch to the device after
DATA_PIPELINE = ("megatron/core/datasets/", "tst_megatron/data/gpt_datasets.py")


def _child(rank, world):
    from megatron.training import get_args
    from megatron.training import training as mlm_training
    from megatron.training.training import destroy_global_state
    from torch.overrides import TorchFunctionMode

    from tst_megatron.training.cli import main

    class HostReads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.stacks = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            bool_index = (
                name in ("__getitem__", "__setitem__")
                and len(args) > 1
                and isinstance(args[1], torch.Tensor)
                and args[1].dtype == torch.bool
            )
            if name in HOST_READS or bool_index:
                files = [
                    (f.filename, f.name)
                    for f in traceback.extract_stack()[:-1]
                    if "site-packages/torch/" not in f.filename
                ]
                self.stacks.append((name, files))
            return func(*args, **(kwargs or {}))

    real_step = mlm_training.train_step
    result = {}

    def recorded_step(*args, **kwargs):
        iteration = get_args().curr_iteration  # 0-based, set by train() before the step
        if iteration not in (1, 3):  # 0 and 2 warm each phase up
            return real_step(*args, **kwargs)
        with HostReads() as reads:
            out = real_step(*args, **kwargs)
        result[1 if iteration < 2 else 2] = reads.stacks
        return out

    mlm_training.train_step = recorded_step  # this spawned test process only
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main(ARGV)
    finally:
        mlm_training.train_step = real_step
        destroy_global_state()
    return result


def _verdict(name, files):
    """``None`` if the read is allowed, else a description. The read belongs to the innermost
    frame of this project or of megatron-core (helpers like ``contextlib`` are skipped)."""
    paths = [f.replace(os.sep, "/") for f, _ in files]
    where = " < ".join(f"{os.path.basename(f)}:{fn}" for f, fn in reversed(files[-6:]))
    if any(mark in p for p in paths for mark in DATA_PIPELINE):
        return None  # host tensors, before the forward step moves the batch to the device
    owners = [p for p in paths if any(m in p for m in ("tst_megatron/", "megatron/core/", LOOP))]
    owner = owners[-1] if owners else ""
    if any(mark in owner for mark in TST_STEP):
        return f"TST step: {name} at {where}"
    in_schedule = any(p.endswith("megatron/core/pipeline_parallel/schedules.py") for p in paths)
    if in_schedule and not any(mark in owner for mark in MEGATRON_OWN):
        return f"inside the schedule: {name} at {where}"
    return None


def test_no_host_reads_in_the_tst_step():
    (result,) = run_distributed(_child, 1)
    assert set(result) == {1, 2}
    for phase, stacks in result.items():
        assert stacks, "the recorder saw nothing (it must see the optimizer's reads)"
        bad = sorted({v for name, files in stacks if (v := _verdict(name, files))})
        assert not bad, f"phase {phase}:\n" + "\n".join(bad)
