"""Forward-step functions for megatron-core's pipeline schedules, one per phase.

Megatron's contract: ``forward_step(data_iterator, model) -> (output, loss_func)``;
``loss_func(output) -> (loss_sum, num_tokens, report)`` with an integer ``num_tokens``, which
megatron-core divides out per micro-batch, or with ``--calculate-per-token-loss`` over the step.
The loss sum passes ``pretrain_gpt.py``'s checks (:func:`loss_checks`).

The unit of ``num_tokens`` is a *scored position*: a token whose loss mask is 1 in phase 2,
a latent position with at least one scored slot in phase 1, where the loss is
``MCE_mb * n_mb``. So the step's loss is the paper's MCE (the mean over scored slots, with
uniform weights), and megatron-core's MoE aux and z losses, scaled per routed position,
weigh the same in both phases. Masked positions and slots are excluded by selection
(``torch.where``), never by multiplication, so an ``inf``/``nan`` there reaches neither the
loss nor, through the model's loss seam (:class:`~tst_megatron.models.gpt.TSTGPTModel`),
a gradient. Nothing here reads a device value on the host, except ``pretrain_gpt.py``'s loss
checks (:func:`loss_checks`: megatron-core's rerun state machine reads the loss, as in a
baseline run).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import mpu
from megatron.core.num_microbatches_calculator import get_current_running_global_batch_size
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_batch_on_this_cp_rank, unwrap_model

from tst_megatron.loop.plan import RunPlan
from tst_megatron.loop.switch import SwitchIntervals, divides
from tst_megatron.runtime import cpu
from tst_megatron.superposition import (
    bag_embedding,
    multi_hot_cross_entropy,
)
from tst_megatron.superposition.bags import phase1_inputs, phase1_targets, phase1_weights

#: The key (log line, TensorBoard tag) of the phase-1 loss; phase 2 and validation report
#: Megatron-LM's ``lm loss``, so that ``lm loss`` stays the next-token loss a baseline reports.
PHASE1_LOSS = "mce loss"


def _report(loss_sum: torch.Tensor, num_tokens: torch.Tensor, key: str = "lm loss") -> dict:
    return {key: torch.stack([loss_sum.detach().float(), num_tokens.float()])}


@functools.lru_cache(maxsize=None)
def _slot_weights(bag_size: int, weighting: str, mode: str, device: torch.device) -> torch.Tensor:
    """``phase1_weights`` on ``device``, copied there once per run (not per micro-batch)."""
    return phase1_weights(bag_size, weighting, mode).to(device)


def _cp_split(batch: dict, cp_group: Optional[dist.ProcessGroup]) -> dict:
    """This CP rank's share of a micro-batch: megatron-core's load-balanced (zig-zag) split
    (``get_batch_on_this_cp_rank``: the sequence dimension, dim 2 of ``attention_mask`` and dim
    1 of every other tensor, in ``2 x CP`` chunks; rank ``r`` keeps chunks ``r`` and
    ``2 x CP - 1 - r``). In phase 1 it runs on the *latent* sequence of ``[b, T, S]`` bags, so
    each chunk holds whole bags and exactly their targets. ``batch`` is not modified."""
    if cp_group is None:
        return batch
    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)


def loss_checks(args) -> Callable[[torch.Tensor, str], None]:
    """``check(loss_sum, key)``: Megatron-LM ``pretrain_gpt.py``'s ``loss_func`` checks, by
    megatron-core's rerun state machine (``--rerun-mode``): NaN and Inf with
    ``--check-for-nan-in-loss-and-grad`` (fatal; with reruns disabled a ``RuntimeError``, under
    Megatron-LM's default ``validate_results`` the iteration is rerun first), and a loss 10
    times the largest seen (per ``key``) with ``--check-for-spiky-loss``."""

    def check(loss: torch.Tensor, key: str) -> None:
        machine = get_rerun_state_machine()  # as stock: the current one (restarts replace it)
        if args.check_for_nan_in_loss_and_grad:
            for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
                message = f"found {what} in local forward loss calculation"
                machine.validate_result(loss, reject, message=message, tolerance=0.0, fatal=True)
        if args.check_for_spiky_loss:
            large = functools.partial(machine.is_unexpectedly_large, threshold=10, context=key)
            machine.validate_result(loss, large, message="Spiky loss", tolerance=0.0, fatal=False)

    return check


def make_phase1_step(
    *,
    bag_size: int,
    weighting: str,
    cp_group: Optional[dist.ProcessGroup] = None,
    mode: str = "full",
    check: Callable[[torch.Tensor, str], None] = lambda loss, key: None,
):
    """Forward step of the superposition phase in ``mode`` (``superposition.bags.TST_MODES``):
    samples of ``S*T`` tokens (``full``, ``input``) or ``T`` tokens (``output``), inputs from
    ``phase1_inputs`` (``[b, T, S]`` bags or ``[b, T, 1]``) embedded by ``bag_embedding`` on
    the first stage, targets ``[b, T, k]`` from ``phase1_targets`` scored by the model's loss
    seam on the last, MCE weights from ``phase1_weights``. ``cp_group`` splits the latent
    sequence (whole bags); ``check`` sees each loss sum (:func:`loss_checks`)."""

    def forward_step(data_iterator, model, return_schedule_plan: bool = False):
        # Every stage reads the micro-batch (cheap); only the first embeds, only the last scores.
        batch = next(data_iterator)
        gpt = unwrap_model(model)
        targets, mask = phase1_targets(batch["labels"], batch["loss_mask"], bag_size, mode)
        bags = phase1_inputs(batch["tokens"], bag_size, mode)  # [b, T, S] or [b, T, 1]
        local = _cp_split({"bags": bags, "targets": targets, "mask": mask}, cp_group)
        x = bag_embedding(gpt.embedding, local["bags"]) if gpt.pre_process else None
        if return_schedule_plan:  # megatron-core's combined 1F1B (the all-to-all overlap)
            per_slot = phase1_schedule_plan(gpt, x, local["targets"])
        else:
            per_slot = model(None, None, None, decoder_input=x, labels=local["targets"])
        weights = _slot_weights(bag_size, weighting, mode, local["mask"].device)

        def loss_func(ce):
            loss_sum, weight_sum = multi_hot_cross_entropy(ce, local["mask"], weights)
            positions = (local["mask"] > 0).any(dim=-1).sum().to(torch.int)
            mce = torch.where(weight_sum > 0, loss_sum / weight_sum.clamp_min(1e-12), 0.0)
            loss = mce * positions  # = MCE_mb * scored positions (see the module docstring)
            check(loss, PHASE1_LOSS)
            return loss, positions, _report(loss, positions, PHASE1_LOSS)

        return per_slot, loss_func

    return forward_step


def make_phase2_step(
    *,
    cp_group: Optional[dist.ProcessGroup] = None,
    check: Callable[[torch.Tensor, str], None] = lambda loss, key: None,
):
    """Forward step of ordinary next-token training (and of validation in both phases);
    ``check`` sees each loss sum (:func:`loss_checks`).

    The model gets ``labels=`` and ``loss_mask=`` as in Megatron-LM's ``pretrain_gpt.py``:
    megatron-core's multi-token prediction (``process_mtp_loss``) masks and counts its
    rolled labels with it; without MTP the model does not read it.
    """

    def forward_step(data_iterator, model, return_schedule_plan: bool = False):
        batch = _cp_split(dict(next(data_iterator)), cp_group)
        loss_mask = batch["loss_mask"]
        # megatron-core's combined 1F1B (the all-to-all overlap) takes the model's schedule
        # plan, built from the same inputs, where a plain step takes its output
        run = unwrap_model(model).build_schedule_plan if return_schedule_plan else model
        per_token = run(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"],
            loss_mask=loss_mask,
        )

        def loss_func(output):
            scored = loss_mask > 0
            loss = torch.where(scored, output.float(), 0.0).sum()
            num_tokens = scored.sum().to(torch.int)
            check(loss, "lm loss")
            return loss, num_tokens, _report(loss, num_tokens)

        return per_token, loss_func

    return forward_step


def phase1_schedule_plan(gpt, decoder_input, targets):
    """Phase 1's schedule plan for megatron-core's combined 1F1B
    (``--overlap-moe-expert-parallel-comm``): ``GPTModel.build_schedule_plan`` with the bag
    embedding ``[T, b, h]`` as ``decoder_input`` (the plan's pre-process node passes it on)
    and the ``[b, T, k]`` targets as ``labels`` (its post-process node scores them through
    the model's loss seam). Multi-token prediction's layer nodes are dropped, as a plain
    phase-1 forward skips the MTP block: the post-process node then gives the MTP-only
    parameters their zero gradient (``TSTGPTModel._postprocess``)."""
    plan = gpt.build_schedule_plan(None, None, None, decoder_input=decoder_input, labels=targets)
    if getattr(gpt, "mtp_process", False):
        for _ in gpt.mtp.layers:  # the MTP layers' plans come last (FILO)
            plan.pop_layer()
    return plan


# --- Megatron-LM's forward step -----------------------------------------------------------


class _OnDevice:
    """An iterator of host batches as batches on ``device`` (a no-op on the CPU), each checked
    to hold ``length`` tokens per sample (a shape read: no device sync).

    Raises:
        RuntimeError: a batch of another length (the phase of the sample and of the step
            differ), naming both.
    """

    def __init__(self, iterator, device: torch.device, *, length: int, what: str):
        self.iterator, self.device, self.length, self.what = iterator, device, length, what

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.iterator)
        got = batch["tokens"].shape[-1]
        if got != self.length:
            raise RuntimeError(
                f"TST: {self.what} got samples of {got} tokens, expected {self.length}: the "
                "training data's phase boundary does not match the step's phase"
            )
        if self.device.type == "cpu":
            return batch
        return {
            k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
            for k, v in batch.items()
        }


class TSTForwardStep:
    """Megatron-LM's ``forward_step(data_iterator, model)``: phase 1
    (:func:`make_phase1_step`, key ``mce loss``) while training and ``args.curr_iteration <
    N1``, else next-token (:func:`make_phase2_step`, key ``lm loss``), which is also what
    ``evaluate()`` runs. Called every iteration, it also makes Megatron-LM save, validate and
    log iteration ``N1`` (:func:`switch_overrides`, set at the last phase-1 step, undone at
    the first phase-2 step) and, on the last rank, reports the raw tokens read
    (:class:`_RawTokens`).
    """

    def __init__(self, plan: RunPlan):
        self.plan = plan
        self._steps = None
        self._announced = -1  # the last phase announced on rank 0
        self._switch = SwitchIntervals()
        self._raw = None

    def _build(self, args):
        # Megatron-LM's training package: imported where it runs
        from megatron.training.utils import is_last_rank

        plan, tst = self.plan, self.plan.tst
        cp = mpu.get_context_parallel_group() if args.context_parallel_size > 1 else None
        check = loss_checks(args)
        phase1 = make_phase1_step(
            bag_size=tst.bag_size,
            weighting=tst.bag_weighting,
            mode=tst.mode,
            cp_group=cp,
            check=check,
        )
        self._raw = _RawTokens(plan) if is_last_rank() else None
        return phase1, make_phase2_step(cp_group=cp, check=check)

    def __call__(self, data_iterator, model, return_schedule_plan: bool = False):
        # Megatron-LM's training package: heavy, imported where it runs
        from megatron.training import get_args

        args = get_args()
        if self._steps is None:
            self._steps = self._build(args)
        plan = self.plan
        phase1, phase2 = self._steps
        training = model.training
        in_phase1 = training and args.curr_iteration < plan.n1
        if training:
            self._announce(1 if in_phase1 else 2, args.curr_iteration, plan.n1)
            self._switch.at_step(args, plan)
            if self._raw is not None:
                self._raw.step(args)
        phase = plan.schedule.phase1 if in_phase1 else plan.schedule.phase2
        what = f"phase-{phase.index} step {args.curr_iteration}" if training else "validation"
        batches = _OnDevice(data_iterator, _device(), length=phase.data_seq_length, what=what)
        step = phase1 if in_phase1 else phase2
        if return_schedule_plan:  # megatron-core's combined 1F1B asks for it
            return step(batches, model, return_schedule_plan=True)
        return step(batches, model)

    def _announce(self, phase: int, iteration: int, n1: int) -> None:
        """One line on rank 0 when training enters a phase (at the start, and at the switch)."""
        if phase == self._announced:
            return
        # Megatron-LM's training package: heavy, imported where it runs
        from megatron.training.utils import print_rank_0

        self._announced = phase
        if phase == 1:
            print_rank_0(f"TST: phase 1 (bags) from iteration {iteration}, until {n1}")
        else:
            print_rank_0(f"TST: phase 2 (next-token) from iteration {iteration} (switch at {n1})")


class _RawTokens:
    """The text a run reads, on the last rank (where Megatron-LM's writers live): ``tst-phase``
    (1 or 2) to TensorBoard at every training iteration, and at each iteration Megatron-LM logs
    (``--log-interval``, the switch, the last) the line ``TST: iteration N | raw tokens per
    sample: T' | raw tokens: R |`` and ``raw-tokens`` to TensorBoard and W&B. ``T'`` is ``S*T``
    in phase 1 (``T`` with ``--tst-mode output``) and ``T`` in phase 2; ``R`` counts every
    training sample read through iteration ``N`` (Megatron-LM's ``consumed_train_samples``,
    restored on a resume, split at the switch sample). Megatron-LM's own elapsed time per
    iteration turns it into a rate."""

    def __init__(self, plan: RunPlan):
        self.plan, self.switch, self.last = plan.schedule, plan.switch_sample, None

    def step(self, args) -> None:
        """Called at every training forward; acts once per iteration."""
        # Megatron-LM's training package: imported where it runs
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        if args.curr_iteration == self.last:
            return  # another micro-batch or model chunk of this iteration
        self.last, iteration = args.curr_iteration, args.curr_iteration + 1
        phase = self.plan.phase_at(iteration - 1)
        writer = get_tensorboard_writer()
        if writer is not None:
            writer.add_scalar("tst-phase", phase.index, iteration)
        if not (divides(args.log_interval, iteration) or iteration == args.train_iters):
            return
        before = args.consumed_train_samples
        length1, length2 = self.plan.phase1.data_seq_length, self.plan.phase2.data_seq_length
        raw = min(before, self.switch) * length1 + max(before - self.switch, 0) * length2
        raw += get_current_running_global_batch_size() * phase.data_seq_length
        print(
            f" TST: iteration {iteration:8d} | raw tokens per sample: {phase.data_seq_length} | "
            f"raw tokens: {raw} |",
            flush=True,
        )
        if writer is not None:
            writer.add_scalar("raw-tokens", raw, iteration)
        wandb = get_wandb_writer()
        if wandb is not None:
            wandb.log({"raw-tokens": raw}, iteration)


def _device() -> torch.device:
    if cpu.is_enabled() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
