"""The switch at iteration ``N1``: Megatron-LM intervals set to ``N1`` for that iteration so
``train()`` saves, validates and logs it (``docs/launcher.md``, "The switch"), and a fresh Adam
state for the multi-token-prediction parameters, which phase 1 leaves idle."""

from __future__ import annotations

import functools
import weakref

import torch


def _eval_iters(args) -> int:
    """``--eval-iters`` summed over the validation sets (Megatron-LM allows a list)."""
    iters = getattr(args, "eval_iters", 0) or 0
    return sum(iters) if isinstance(iters, (list, tuple)) else iters


def _switch_in_run(args, plan) -> bool:
    """The run trains and switches inside it: ``0 < N1 < N``."""
    return not getattr(args, "skip_train", False) and 0 < plan.n1 < plan.n


def _validates_at(args, iteration: int) -> bool:
    """Megatron-LM ``train()``'s conditions for validating at ``iteration``, besides the
    interval and ``do_valid``."""
    start = getattr(args, "start_eval_at_iter", None)
    return _eval_iters(args) > 0 and (start is None or iteration >= start)


def divides(interval, iteration: int) -> bool:
    """Whether ``interval`` is set and divides ``iteration``."""
    return bool(interval) and iteration % interval == 0


def switch_overrides(args, plan) -> dict:
    """The Megatron-LM intervals to set to ``N1`` for iteration ``N1`` only: each of
    ``save_interval`` (with ``--save`` and TST's save-at-switch), ``eval_interval`` (when
    validating) and ``log_interval`` that does not already divide ``N1``. ``plan``: the run's
    :class:`~tst_megatron.loop.plan.RunPlan`.

    Returns:
        ``{args attribute: N1}``; empty when the switch is not inside the run.
    """
    if not _switch_in_run(args, plan):
        return {}
    out, n1 = {}, plan.n1
    if plan.tst.save_at_switch and args.save and not divides(args.save_interval, n1):
        out["save_interval"] = n1
    valid = getattr(args, "do_valid", False) and _validates_at(args, n1)
    if valid and not divides(args.eval_interval, n1):
        out["eval_interval"] = n1
    if not divides(args.log_interval, n1):
        out["log_interval"] = n1
    return out


def switch_validation_samples(args, plan) -> int:
    """Validation samples to add to Megatron-LM's ``get_train_valid_test_num_samples`` count:
    one round (``--eval-iters`` global batches) when :func:`switch_overrides` adds a
    validation at ``N1``, else 0."""
    if getattr(args, "full_validation", False):
        return 0  # every round reads the whole set from its start
    n1 = plan.n1
    if not _switch_in_run(args, plan) or not _validates_at(args, n1):
        return 0
    if divides(args.eval_interval, n1):
        return 0
    batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    return _eval_iters(args) * batch


class SwitchIntervals:
    """The switch's state machine over Megatron-LM's intervals, driven by the forward step of
    every training micro-batch: ``"before"`` -> ``"set"`` (the intervals of
    :func:`switch_overrides` at ``N1``, for iteration ``N1`` only) -> ``"done"`` (the user's
    values back)."""

    def __init__(self):
        self._state = "before"
        self._saved_intervals: dict = {}

    def at_step(self, args, plan) -> None:
        """At the last phase-1 training step set the intervals of :func:`switch_overrides` to
        ``N1`` (Megatron-LM reads them after the step); at the first phase-2 training step put
        the user's values back. Idempotent over micro-batches, model chunks and stages; an
        in-process restart to before the last phase-1 step puts the user's values back too."""
        n1 = plan.n1
        if args.curr_iteration < n1 - 1:  # (again) before the switch: a restart in-process
            for key, value in self._saved_intervals.items():  # the user's values back first
                setattr(args, key, value)
            self._state, self._saved_intervals = "before", {}
        elif self._state == "before" and args.curr_iteration == n1 - 1:
            overrides = switch_overrides(args, plan)
            self._saved_intervals = {k: getattr(args, k) for k in overrides}
            for key, value in overrides.items():
                setattr(args, key, value)
            self._state = "set"
            if overrides and args.rank == 0:
                what = {
                    "save_interval": "checkpoint",
                    "eval_interval": "validation",
                    "log_interval": "log line",
                }
                added = [what[k] for k in overrides]
                print(
                    f"TST: at the switch (iteration {n1}): {', '.join(added)} "
                    f"({', '.join('--' + k.replace('_', '-') for k in overrides)} {n1} "
                    "for this iteration only)",
                    flush=True,
                )
        elif self._state != "done" and args.curr_iteration >= n1:
            for key, value in self._saved_intervals.items():
                setattr(args, key, value)
            self._saved_intervals, self._state = {}, "done"


class FreshAdamForMTP:
    """A torch optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
    that makes every AdamW update of the MTP-only parameters after the switch the update of an
    Adam started at the switch (Kingma & Ba, Algorithm 1: step ``k`` from 1, both moments from
    0), within the optimizer's one step count.

    Phase 1 gives them exactly zero gradients (:class:`~tst_megatron.models.gpt.TSTGPTModel`),
    so their moments are exactly zero at ``N1``, but the step count ``T`` is shared by all
    parameters (megatron-core's ``torch_dist`` optimizer checkpoint refuses per-parameter
    counts) and is ``N1`` larger than ``k``: the first update would be
    ``(1 - beta1) / sqrt(1 - beta2)`` times Adam's first step (3.2x at beta2 0.999). So before
    each step, with ``r1 = (1 - beta1**T) / (1 - beta1**k)`` and ``r2`` likewise, the stored
    moments (``r1 * m`` and ``r2 * v`` of the fresh Adam's ``m``, ``v`` at step ``k - 1``) are
    replaced by the values from which torch's update
    ``m_T = beta1 * m_stored + (1 - beta1) * g`` gives ``r1 * m_k`` (and ``v`` likewise), so
    that ``m_T / (1 - beta1**T) = m_k / (1 - beta1**k)``. The stored moments stay a scaled
    fresh state, so a resume continues it (``k = iteration - N1 + 1``). Each moment is left as
    it is once its ``r`` is within 1e-7 of 1 (about 16,000 steps at beta2 0.999), and at a beta
    of 0 (torch's update does not read it then). An iteration skipped after the switch (an
    fp16 overflow, ``--iterations-to-skip``) counts in ``k`` but not in ``T``: the updates
    after it are then close to, not exactly, a fresh Adam's. Weight decay still shrank the
    parameters in phase 1.

    The parameters are found as the model parameter itself (megatron-core's ``FP32Optimizer``),
    its ``main_param`` (fp16/bf16, and the distributed optimizer's shard copy) or a view into
    its memory (the distributed optimizer's fp32 shard; a DTensor by identity only). Only
    per-parameter ``step`` states (torch's ``AdamW``) are adjusted; a fused Adam (Transformer
    Engine's, Apex's) is left as it is, and the launch notes it.
    """

    def __init__(self, n1: int):
        self.n1 = n1
        self._models = weakref.WeakSet()
        self._targets = {}  # id(optimizer) -> [(param group, parameter)]

    def watch(self, provider):
        """``provider`` (a Megatron-LM model provider) remembering each model it builds."""

        @functools.wraps(provider)
        def build(*args, **kwargs):
            model = provider(*args, **kwargs)
            self._models.add(model)
            return model

        return build

    def _find(self, optimizer) -> list:
        """``[(param group, parameter)]`` of ``optimizer``'s MTP-only parameters. Memory ranges
        are compared only for tensors with storage of their own (a DTensor's ``data_ptr()``
        is 0)."""
        ids, spans = set(), []
        for model in list(self._models):
            for p in model._mtp_only_parameters():
                ids.add(id(p))
                if p.data_ptr():
                    spans.append((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()))
                main = getattr(p, "main_param", None)
                if main is not None:
                    ids.add(id(main))
        return [
            (group, q)
            for group in optimizer.param_groups
            for q in group["params"]
            if id(q) in ids or (q.data_ptr() and any(a <= q.data_ptr() < b for a, b in spans))
        ]

    @torch.no_grad()
    def __call__(self, optimizer: torch.optim.Optimizer, *_unused) -> None:
        if not self._models:
            return
        # Megatron-LM's training package: heavy, imported where it runs
        from megatron.training import get_args

        iteration = getattr(get_args(), "curr_iteration", None)
        if iteration is None or iteration < self.n1:
            return
        if id(optimizer) not in self._targets:
            self._targets[id(optimizer)] = self._find(optimizer)
        k = iteration - self.n1 + 1  # this update's step in an Adam started at the switch
        for group, q in self._targets[id(optimizer)]:
            state = optimizer.state.get(q)
            if not state or "step" not in state or "exp_avg" not in state or q.grad is None:
                continue
            t = int(state["step"]) + 1  # torch counts the step before using it
            if t <= k:
                continue  # the count is the fresh Adam's already (e.g. --no-load-optim)
            for key, beta in zip(("exp_avg", "exp_avg_sq"), group["betas"]):
                r = (1 - beta**t) / (1 - beta**k)
                if beta == 0 or abs(r - 1) < 1e-7:
                    continue  # torch's update does not read the stored moment, or r is 1
                x = q.grad if key == "exp_avg" else q.grad * q.grad
                stored = state[key]
                # the fresh moment after step k - 1 (zero at the switch), then after step k
                fresh = stored * ((1 - beta ** (k - 1)) / (1 - beta ** (t - 1)))
                fresh.mul_(beta).add_(x, alpha=1 - beta)
                stored.copy_(fresh.mul_(r).sub_(x, alpha=1 - beta).div_(beta))
                if key == "exp_avg_sq":
                    stored.clamp_(min=0)  # >= 0 exactly; rounding only
