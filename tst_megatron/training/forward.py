"""Forward-step functions for megatron-core's pipeline schedules, one per phase.

Both follow Megatron's contract: ``forward_step(data_iterator, model) -> (output,
loss_func)``; ``loss_func(output) -> (loss_sum, num_tokens, report)`` with an *integer*
``num_tokens`` (the schedule accumulates it in an int tensor) and
``config.calculate_per_token_loss = True`` so gradients are scaled by the global count.

Phase 1 (``docs/design.md``, "The method"): the first stage embeds bags with ``bag_embedding`` and
passes them as ``decoder_input``; the last stage gets per-slot cross-entropy ``[b, T, S]``
from the model's own loss seam (:class:`~tst_megatron.training.gpt.TSTGPTModel` with
``labels=`` the ``[b, T, S]`` bag targets) and reduces it to the MCE. A model with
multi-token prediction skips its MTP block there (see ``TSTGPTModel``); phase 2 and
validation run it as megatron-core does.

The unit of ``num_tokens`` is a *scored position* in both phases: a token whose loss mask
is 1 in phase 2, a latent position with at least one scored slot in phase 1. The loss
returned is ``MCE_mb * n_mb``. Two consequences:

- the step's loss (``sum / sum n``) is the MCE of the micro-batches weighted by their
  scored positions; with uniform weights and no masking inside bags it is exactly the
  paper's MCE, the mean over all scored slots (every micro-batch has the same
  slots-per-position ratio);
- megatron-core scales the MoE aux and z losses by the number of routed positions, which
  the global count divides: per position, the balancing gradient at a given
  ``--moe-aux-loss-coeff`` is the same in phase 1 as in phase 2 (counting slots would
  weigh it about ``1/S`` as much in phase 1).

Masked positions and slots are excluded by selection (``torch.where``), never by
multiplication, so an ``inf``/``nan`` there cannot reach the loss. Their gradient is zero,
and the model's loss seam turns a zero gradient into exactly zero on the logits' rows (the
cross-entropy's backward alone would give ``nan * 0 = nan``): phase 1 in
``vocab_parallel_multi_target_cross_entropy``, phase 2 and validation around megatron-core's
cross-entropy (:class:`~tst_megatron.training.gpt.TSTGPTModel`), so no gradient is
non-finite either. Nothing here reads a device value on the host.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from tst_megatron.superposition import (
    bag_embedding,
    multi_hot_cross_entropy,
)
from tst_megatron.superposition.bags import phase1_inputs, phase1_targets, phase1_weights
from tst_megatron.superposition.schedule import Schedule
from tst_megatron.training.flags import tst_config
from tst_megatron.training.plan import schedule
from tst_megatron.training.switch import divides, switch_overrides


def unwrap(model):
    """The ``GPTModel`` inside DDP (or other) wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


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
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)


def make_phase1_step(
    *,
    bag_size: int,
    weighting: str,
    tp_group=None,
    cp_group: Optional[dist.ProcessGroup] = None,
    mode: str = "full",
):
    """Forward step of the superposition phase in ``mode`` (``superposition.bags.TST_MODES``):
    samples of ``S*T`` tokens (``full``, ``input``) or ``T`` tokens (``output``), inputs from
    ``phase1_inputs`` (``[b, T, S]`` bags or ``[b, T, 1]``), targets ``[b, T, k]`` from
    ``phase1_targets``, MCE weights from ``phase1_weights``.

    ``tp_group`` is accepted for compatibility and unused: the model's loss seam takes the
    output layer's own group. ``cp_group`` splits the latent sequence (whole bags).
    """

    def forward_step(data_iterator, model):
        # Every stage reads the micro-batch (cheap); only the first embeds, only the last scores.
        batch = next(data_iterator)
        gpt = unwrap(model)
        targets, mask = phase1_targets(batch["labels"], batch["loss_mask"], bag_size, mode)
        bags = phase1_inputs(batch["tokens"], bag_size, mode)  # [b, T, S] or [b, T, 1]
        local = _cp_split({"bags": bags, "targets": targets, "mask": mask}, cp_group)
        x = bag_embedding(gpt.embedding, local["bags"]) if gpt.pre_process else None
        per_slot = model(None, None, None, decoder_input=x, labels=local["targets"])
        weights = _slot_weights(bag_size, weighting, mode, local["mask"].device)

        def loss_func(ce):
            loss_sum, weight_sum = multi_hot_cross_entropy(ce, local["mask"], weights)
            positions = (local["mask"] > 0).any(dim=-1).sum().to(torch.int)
            mce = torch.where(weight_sum > 0, loss_sum / weight_sum.clamp_min(1e-12), 0.0)
            loss = mce * positions  # = MCE_mb * scored positions (see the module docstring)
            return loss, positions, _report(loss, positions, PHASE1_LOSS)

        return per_slot, loss_func

    return forward_step


def make_phase2_step(*, cp_group: Optional[dist.ProcessGroup] = None):
    """Forward step of ordinary next-token training (and of validation in both phases).

    The model gets ``labels=`` and ``loss_mask=`` as in Megatron-LM's ``pretrain_gpt.py``:
    megatron-core's multi-token prediction (``process_mtp_loss``) masks and counts its
    rolled labels with it; without MTP the model does not read it.
    """

    def forward_step(data_iterator, model):
        batch = _cp_split(dict(next(data_iterator)), cp_group)
        loss_mask = batch["loss_mask"]
        per_token = model(
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
            return loss, num_tokens, _report(loss, num_tokens)

        return per_token, loss_func

    return forward_step


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
    """Megatron-LM ``forward_step(data_iterator, model) -> (output_tensor, loss_func)``.

    The phase is a pure function of the iteration: phase 1 (bags, the project's
    :func:`~tst_megatron.training.forward.make_phase1_step`) while the model is training and
    ``args.curr_iteration < N1``, else next-token (:func:`make_phase2_step`), which is what
    ``evaluate()`` runs (the model is in eval mode there; ``curr_iteration`` is stale).
    Every stage reads the micro-batch from its own iterator (:class:`TSTDatasets`); the
    steps split it for context parallelism themselves. The loss function returns
    Megatron-LM's ``(loss, num_tokens, {key: [loss, num_tokens]})`` with key ``mce loss``
    in phase 1 and ``lm loss`` in phase 2 and validation.

    Being the one piece of ours called every iteration, it also makes Megatron-LM save,
    validate and log iteration ``N1`` (:func:`switch_overrides`, set at the last phase-1
    training forward and undone at the first phase-2 training forward) and, on the last
    rank, reports raw tokens per second (:class:`_RawTokenRate`).
    """

    def __init__(self):
        self._steps = None
        self._announced = -1  # the last phase announced on rank 0
        self._switch = "before"  # "before" -> "set" (intervals at N1) -> "done"
        self._saved_intervals: dict = {}
        self._rate = None

    def _build(self, args):
        from megatron.core import mpu
        from megatron.training.utils import is_last_rank

        tst = tst_config(args)
        cp = mpu.get_context_parallel_group() if args.context_parallel_size > 1 else None
        phase1 = make_phase1_step(
            bag_size=tst.bag_size, weighting=tst.bag_weighting, mode=tst.mode, cp_group=cp
        )
        plan = schedule(args)
        self._rate = _RawTokenRate(plan) if is_last_rank() else None
        return plan, phase1, make_phase2_step(cp_group=cp)

    def __call__(self, data_iterator, model):
        from megatron.training import get_args

        args = get_args()
        if self._steps is None:
            self._steps = self._build(args)
        plan, phase1, phase2 = self._steps
        training = unwrap(model).training
        in_phase1 = training and args.curr_iteration < plan.n1
        if self._rate is not None:
            self._rate.forward(args, training)
        if training:
            self._announce(1 if in_phase1 else 2, args.curr_iteration, plan.n1)
            self._at_switch(args, plan.n1)
        phase = plan.phase1 if in_phase1 else plan.phase2
        what = f"phase-{phase.index} step {args.curr_iteration}" if training else "validation"
        batches = _OnDevice(data_iterator, _device(), length=phase.data_seq_length, what=what)
        return (phase1 if in_phase1 else phase2)(batches, model)

    def _at_switch(self, args, n1: int) -> None:
        """At the last phase-1 training step set the intervals of :func:`switch_overrides` to
        ``N1`` (Megatron-LM reads them after the step); at the first phase-2 training step put
        the user's values back. Idempotent over micro-batches, model chunks and stages."""
        if args.curr_iteration < n1 - 1:  # (again) before the switch: a restart in-process
            self._switch, self._saved_intervals = "before", {}
        elif self._switch == "before" and args.curr_iteration == n1 - 1:
            overrides = switch_overrides(args, n1)
            self._saved_intervals = {k: getattr(args, k) for k in overrides}
            for key, value in overrides.items():
                setattr(args, key, value)
            self._switch = "set"
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
        elif self._switch != "done" and args.curr_iteration >= n1:
            for key, value in self._saved_intervals.items():
                setattr(args, key, value)
            self._saved_intervals, self._switch = {}, "done"

    def _announce(self, phase: int, iteration: int, n1: int) -> None:
        """One line on rank 0 when training enters a phase (at the start, and at the switch)."""
        if phase == self._announced:
            return
        from megatron.training.utils import print_rank_0

        self._announced = phase
        if phase == 1:
            print_rank_0(f"TST: phase 1 (bags) from iteration {iteration}, until {n1}")
        else:
            print_rank_0(f"TST: phase 2 (next-token) from iteration {iteration} (switch at {n1})")


class _RawTokenRate:
    """Raw tokens per second on the last rank: ``S*T`` tokens per phase-1 sample (``T`` with
    ``--tst-mode output``), ``T`` per phase-2 sample, times the global batch of the step.

    A step is timed on the host clock from its first training forward to the first forward
    after it: the next step's, or a validation's (so a validation is not counted). A step
    whose time holds a checkpoint save (``--save-interval``, the switch,
    ``--non-persistent-save-interval``, ``pretrain()``'s final save) is left out. At each iteration Megatron-LM logs
    (``--log-interval``, the switch) the rate over the counted steps since the last report
    is printed (``TST: iteration ... | raw tokens per second: ...``) and written to
    TensorBoard and W&B (``raw-tokens-per-second``); ``tst-phase`` (1 or 2) is written at every
    iteration. The last iteration is reported when the final validation starts (none
    without validation).
    """

    def __init__(self, plan: Schedule):
        self.plan = plan
        self.index = None  # 0-based index of the open step, None when none is open
        self.start, self.tokens_in_step = 0.0, 0
        self.tokens, self.seconds = 0, 0.0

    def forward(self, args, training: bool) -> None:
        import time

        if training and args.curr_iteration == self.index:
            return  # another micro-batch or chunk of the open step
        if not training and self.index is None:
            return
        now = time.perf_counter()
        if self.index is not None:
            self._close(args, now, by_validation=not training)
        if training:
            self._open(args, now)

    def _open(self, args, now: float) -> None:
        from megatron.core.num_microbatches_calculator import (
            get_current_running_global_batch_size,
        )
        from megatron.training.global_vars import get_tensorboard_writer

        self.index, self.start = args.curr_iteration, now
        phase = self.plan.phase_at(self.index)
        self.tokens_in_step = get_current_running_global_batch_size() * phase.data_seq_length
        writer = get_tensorboard_writer()
        if writer is not None:
            writer.add_scalar("tst-phase", phase.index, self.index + 1)

    def _close(self, args, now: float, *, by_validation: bool) -> None:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        iteration, self.index = self.index + 1, None
        if by_validation:  # pretrain()'s final save comes before its final validation
            final = iteration == args.train_iters and not divides(args.eval_interval, iteration)
            saved = args.save and final
        else:
            saved = args.save and (
                divides(args.save_interval, iteration)
                or divides(getattr(args, "non_persistent_save_interval", None), iteration)
            )
        if not saved:
            self.tokens += self.tokens_in_step
            self.seconds += now - self.start
        logged = divides(args.log_interval, iteration) or iteration == args.train_iters
        if not logged or self.seconds <= 0:
            return
        rate = self.tokens / self.seconds
        print(
            f" TST: iteration {iteration:8d} | raw tokens per second: {rate:.1f} | "
            f"raw tokens per sample: {self.plan.phase_at(iteration - 1).data_seq_length} |",
            flush=True,
        )
        writer = get_tensorboard_writer()
        if writer is not None:
            writer.add_scalar("raw-tokens-per-second", rate, iteration)
        wandb = get_wandb_writer()
        if wandb is not None:
            wandb.log({"raw-tokens-per-second": rate}, iteration)
        self.tokens, self.seconds = 0, 0.0


def _device() -> torch.device:
    from tst_megatron.runtime import cpu

    if cpu.is_enabled() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
