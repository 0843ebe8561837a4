"""The switch at iteration ``N1``: Megatron-LM intervals set to ``N1`` for that iteration so
``train()`` saves, validates and logs it (``docs/launcher.md``, "The switch"), and a fresh Adam
state for the multi-token-prediction parameters, which phase 1 leaves idle."""

from __future__ import annotations

import functools
import weakref

import torch

from tst_megatron.training.flags import tst_config
from tst_megatron.training.plan import schedule, train_iters


def _eval_iters(args) -> int:
    """``--eval-iters`` summed over the validation sets (Megatron-LM allows a list)."""
    iters = getattr(args, "eval_iters", 0) or 0
    return sum(iters) if isinstance(iters, (list, tuple)) else iters


def _switch_in_run(args, n1: int) -> bool:
    """The run trains and switches inside it: ``0 < N1 < --train-iters``."""
    return not getattr(args, "skip_train", False) and 0 < n1 < train_iters(args)


def _validates_at(args, iteration: int) -> bool:
    """Megatron-LM ``train()``'s conditions for validating at ``iteration``, besides the
    interval and ``do_valid``."""
    start = getattr(args, "start_eval_at_iter", None)
    return _eval_iters(args) > 0 and (start is None or iteration >= start)


def divides(interval, iteration: int) -> bool:
    """Whether ``interval`` is set and divides ``iteration``."""
    return bool(interval) and iteration % interval == 0


def switch_overrides(args, n1: int) -> dict:
    """The Megatron-LM intervals to set to ``N1`` for iteration ``N1`` only: each of
    ``save_interval`` (with ``--save`` and TST's save-at-switch), ``eval_interval`` (when
    validating) and ``log_interval`` that does not already divide ``N1``.

    Returns:
        ``{args attribute: N1}``; empty when the switch is not inside the run.
    """
    if not _switch_in_run(args, n1):
        return {}
    out = {}
    if tst_config(args).save_at_switch and args.save and not divides(args.save_interval, n1):
        out["save_interval"] = n1
    valid = getattr(args, "do_valid", False) and _validates_at(args, n1)
    if valid and not divides(args.eval_interval, n1):
        out["eval_interval"] = n1
    if not divides(args.log_interval, n1):
        out["log_interval"] = n1
    return out


def switch_validation_samples(args) -> int:
    """Validation samples to add to Megatron-LM's ``get_train_valid_test_num_samples`` count:
    one round (``--eval-iters`` global batches) when :func:`switch_overrides` adds a
    validation at ``N1``, else 0."""
    if getattr(args, "full_validation", False):
        return 0  # every round reads the whole set from its start
    n1 = schedule(args).n1
    if not _switch_in_run(args, n1) or not _validates_at(args, n1):
        return 0
    if divides(args.eval_interval, n1):
        return 0
    batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    return _eval_iters(args) * batch


class FreshAdamForMTP:
    """A torch optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
    that starts Adam afresh for the MTP-only parameters at the switch: their step count and
    both moments are zeroed before the first phase-2 step, so their first update is Adam's
    first step (bias-corrected, ``m_hat = g``, ``v_hat = g**2``; Kingma & Ba, Algorithm 1).

    Phase 1 gives them exactly zero gradients (:class:`~tst_megatron.training.gpt.TSTGPTModel`),
    so their moments are exactly zero at ``N1`` but torch's ``AdamW`` counted ``N1`` steps:
    without this, the first update is ``(1 - beta1) / sqrt(1 - beta2)`` times Adam's first
    step (3.2x at ``--adam-beta2 0.999``). Weight decay still shrank them in phase 1.

    It acts once per inner optimizer, at its first step with ``args.curr_iteration >= N1``, on
    the states of the watched models' MTP-only parameters whose step count exceeds the steps
    taken since ``N1`` (so a resume after the switch keeps them). It finds them as the model
    parameter itself (megatron-core's ``FP32Optimizer``), its ``main_param`` (fp16/bf16 and the
    distributed optimizer's shard copy) or a view into its memory (the distributed optimizer's
    fp32 shard). Optimizers with a group-level step (Transformer Engine's and Apex's
    ``FusedAdam``) keep their state: the launch notes it.
    """

    def __init__(self, n1: int):
        self.n1 = n1
        self._models = weakref.WeakSet()
        self._done = set()

    def watch(self, provider):
        """``provider`` (a Megatron-LM model provider) remembering each model it builds."""

        @functools.wraps(provider)
        def build(*args, **kwargs):
            model = provider(*args, **kwargs)
            self._models.add(model)
            return model

        return build

    def _idle_parameters(self) -> tuple[set, list]:
        """(ids of the MTP-only parameters and their ``main_param``, their memory ranges)."""
        ids, spans = set(), []
        for model in list(self._models):
            for p in model._mtp_only_parameters():
                ids.add(id(p))
                spans.append((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()))
                main = getattr(p, "main_param", None)
                if main is not None:
                    ids.add(id(main))
        return ids, spans

    def __call__(self, optimizer: torch.optim.Optimizer, *_unused) -> None:
        if id(optimizer) in self._done or not self._models:
            return
        from megatron.training import get_args

        iteration = getattr(get_args(), "curr_iteration", None)
        if iteration is None or iteration < self.n1:
            return
        self._done.add(id(optimizer))
        ids, spans = self._idle_parameters()
        for group in optimizer.param_groups:
            for q in group["params"]:
                start = q.data_ptr()
                if id(q) not in ids and not any(a <= start < b for a, b in spans):
                    continue
                state = optimizer.state.get(q)
                if not state or "step" not in state:
                    continue
                if float(state["step"]) <= iteration - self.n1:
                    continue  # restarted after the switch: already fresh
                for key, value in state.items():
                    if torch.is_tensor(value):
                        value.zero_()
                    elif key == "step":
                        state[key] = 0
