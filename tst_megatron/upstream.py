"""Workarounds for megatron-core / Megatron-LM 0.19.2 that are not CUDA assumptions (those are
:mod:`tst_megatron.runtime.cpu`'s). Each names the release it is for, the symptom and the
upstream state, and has a test that fails once upstream fixes it
(``tests/distributed/test_distributed_optimizer_resume.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def fill_empty_adam_state(optimizer: torch.optim.Optimizer) -> int:
    """Give each parameter of ``optimizer`` (torch's ``Adam``/``AdamW``) that has no state the
    state ``torch.optim.adamw._init_group`` creates before its first step: ``step`` 0 (a
    float32 scalar on the CPU, as when neither fused nor capturable) and zero moments
    ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``), each shaped and
    typed as the parameter. A step from this state equals a step from no state.

    Returns:
        the number of parameters filled.
    """
    filled = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state[p]:
                continue
            state = optimizer.state[p]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            filled += 1
    return filled


def set_adam_step(optimizer: torch.optim.Optimizer, step: float) -> None:
    """Set every parameter's ``step`` in ``optimizer.state`` to ``step``, each a float32 CPU
    scalar tensor of its own (as torch's AdamW keeps it when neither fused nor capturable)."""
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = torch.tensor(float(step), dtype=torch.float32)


@contextlib.contextmanager
def distributed_optimizer_resume() -> Iterator[None]:
    """While active, a ``--use-distributed-optimizer`` run can load its optimizer state where
    megatron-core 0.19.2 cannot (Megatron-LM main of 2026-08 is unchanged in both places):

    1. Without Apex or Transformer Engine (a CPU run, or a GPU without them),
       ``DistributedOptimizer.state_dict`` reads Adam's step from torch AdamW's per-parameter
       state (``assert len(steps) == 1``). ``load_checkpoint`` calls it through
       ``sharded_state_dict(is_loading=True)`` before any step, when that state is still
       empty: every resume dies with an ``AssertionError`` on every rank. (megatron-core fills
       the state first only for ``fsdp_dtensor`` checkpoints,
       ``_init_optimizer_states_with_dummy_values``.) Here ``sharded_state_dict(is_loading=
       True)`` first fills the empty state (:func:`fill_empty_adam_state`); the load then
       replaces it with the checkpoint's.
    2. With float32 parameters (no ``--bf16``/``--fp16``: every CPU run), the optimizer's main
       parameters are views of the model's parameters, which require grad, and
       ``load_parameter_state_from_dp_reshardable`` (``dp_reshardable``, the default layout)
       copies into them without ``torch.no_grad()``: ``RuntimeError: a view of a leaf
       Variable that requires grad is being used in an in-place operation``. Here
       ``DistributedOptimizer.load_state_dict`` runs under ``torch.no_grad()`` (a load is
       never differentiated).
    3. Without Apex or Transformer Engine, ``DistributedOptimizer.load_state_dict`` sets every
       parameter's ``step`` to one shared tensor holding the checkpoint's step, then
       ``load_parameter_state_from_dp_reshardable`` copies into it the ``step`` of the
       template the load was read into (a local object, not loaded: the state before the
       load). After a resume Adam's bias correction restarted from the template's step, and
       the shared tensor, incremented in place once per parameter, ran ahead (measured with
       1. and 2. mended: the loss two iterations after a resume off by 2e-3, and more later).
       Here each parameter's ``step`` is set to the checkpoint's after the load, a tensor of
       its own (:func:`set_adam_step`).

    Both are class attributes of megatron-core's ``DistributedOptimizer``, replaced for the
    duration of the context (the launcher's ``pretrain()`` call) and restored after.
    """
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original_sharded, original_load = cls.sharded_state_dict, cls.load_state_dict
    fill = not distrib_optimizer.HAVE_APEX_OR_TE

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        if (
            fill
            and is_loading
            and isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW))
        ):
            fill_empty_adam_state(self.optimizer)
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        return original_sharded(self, model_sharded_state_dict, is_loading=is_loading, **kwargs)

    def load_state_dict(self, state_dict):
        with torch.no_grad():
            original_load(self, state_dict)
        steps = {g.get("step") for g in state_dict["optimizer"]["param_groups"]} - {None}
        adam = isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW))
        if fill and adam and len(steps) == 1:  # the checkpoint's (megatron-core asserts one)
            set_adam_step(self.optimizer, steps.pop())

    cls.sharded_state_dict, cls.load_state_dict = sharded_state_dict, load_state_dict
    try:
        yield
    finally:
        cls.sharded_state_dict, cls.load_state_dict = original_sharded, original_load
