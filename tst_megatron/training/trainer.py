"""A lean ``pretrain_gpt``-style trainer built from megatron-core parts, with the TST switch.

``train(cfg)`` reads as a table of contents: set up, then per step: phase, step, log,
(switch), evaluate, exit?, save. The plan lives in :class:`~tst_megatron.superposition.
schedule.Schedule` (``N1`` computed once; each phase carries its data reader and its
forward step), so a resumed run lands in the right phase, and the data, the forward step
and the sequence length change together at step ``N1`` on every rank while the model, the
optimizer state and the LR schedule carry on. What to do after a step (validate, save,
stop) is decided by the pure functions of that module.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe import moe_utils

from tst_megatron.errors import ConfigError
from tst_megatron.runtime import (
    describe_layout,
    init_distributed,
    initialize_model_parallel,
    resolve_process,
    set_seed,
)
from tst_megatron.superposition.schedule import (
    Phase,
    Schedule,
    should_eval,
    should_exit,
    should_save,
)
from tst_megatron.training import checkpointing
from tst_megatron.training.config import (
    RunConfig,
    data_parallel_size,
    lr_schedule,
    resolve,
    validate,
)
from tst_megatron.training.data import (
    BatchLayout,
    TrainStream,
    build_datasets,
    build_tokenizer,
    check_data_files,
    check_mock_data,
    dataset_pad_id,
    read_step,
    training_windows,
)
from tst_megatron.training.forward import make_phase1_step, make_phase2_step
from tst_megatron.training.model import build_model, padded_vocab_size, transformer_config
from tst_megatron.training.monitoring import Profiler, open_wandb

NO_TOKENS = "n/a (no tokens scored)"
"""Printed instead of a loss when a step or a validation round scored no token."""


@dataclasses.dataclass
class Run:
    """Everything built once by :func:`setup`."""

    cfg: RunConfig
    device: torch.device
    model: list
    optimizer: object
    scheduler: OptimizerParamScheduler
    layout: BatchLayout
    schedule: Schedule
    """The two training phases, each bound to its data and forward step."""
    validation: Phase
    """Next-token steps over the validation dataset (in both phases)."""
    eval_steps: int
    """Validation steps per evaluation: ``--eval-iters``, or the whole split's global
    batches with ``--full-validation`` (then every evaluation reads the same ones)."""
    writer: Optional[object]
    args: dict
    """The checkpoint ``args`` entry (:func:`.checkpointing.checkpoint_args`)."""
    history: dict = dataclasses.field(default_factory=lambda: {"train": {}, "valid": {}})
    """Per-iteration training loss and validation loss (None: no token scored)."""
    wandb: Optional[object] = None
    """The Weights & Biases run (``--wandb-project``, last rank), else None."""


def print_rank0(*args) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


# --- set-up -------------------------------------------------------------------------------


def build_model_chunks(cfg: RunConfig, config, vocab: int, device) -> list:
    """One ``GPTModel`` per virtual pipeline stage on this rank, each wrapped in DDP."""
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    t = cfg.train
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not (t.bf16 and t.grad_reduce_in_bf16),
        use_distributed_optimizer=t.use_distributed_optimizer,
        overlap_grad_reduce=t.overlap_grad_reduce,
        overlap_param_gather=t.overlap_param_gather,
        check_for_nan_in_grad=t.check_for_nan_in_loss_and_grad,
    )
    chunks = []
    for stage in range(vpp or 1):
        model = build_model(cfg, config, vocab_size=vocab, vp_stage=stage if vpp else None)
        chunks.append(
            DistributedDataParallel(
                config, ddp_config, model.to(device), disable_bucketing=stage > 0
            )
        )
    return chunks


def build_optimizer(cfg: RunConfig, chunks):
    """megatron-core AdamW and a WSD/cosine/... schedule over all ``--train-iters`` steps."""
    t = cfg.train
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            clip_grad=t.clip_grad,
            bf16=t.bf16,
            fp16=t.fp16,
            loss_scale=t.loss_scale,
            initial_loss_scale=t.initial_loss_scale,
            min_loss_scale=t.min_loss_scale,
            loss_scale_window=t.loss_scale_window,
            hysteresis=t.hysteresis,
            decoupled_lr=t.decoupled_lr,
            decoupled_min_lr=t.decoupled_min_lr,
            params_dtype=torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32,
            use_distributed_optimizer=t.use_distributed_optimizer,
            log_num_zeros_in_grad=cfg.checkpoint.log_num_zeros_in_grad,
        ),
        chunks,
    )
    # Megatron-LM's lengths, in samples: the scheduler advances by the global batch per step.
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=t.lr_warmup_init,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_style="constant",
        lr_wsd_decay_style=t.lr_wsd_decay_style,
        **lr_schedule(t),
    )
    return optimizer, scheduler


def build_data(cfg: RunConfig, tokenizer, layout: BatchLayout, n1: int):
    """The training stream (both phases) and the validation dataset, sized for the run."""
    t, c, tst, T = cfg.train, cfg.checkpoint, cfg.tst, cfg.model.seq_length
    gbs = layout.global_batch_size
    per_sample = tst.windows_per_sample()  # S, or 1 in output mode
    windows = training_windows(
        cfg.data,
        phase1_samples=n1 * gbs,
        phase2_samples=(t.train_iters - n1) * gbs,
        per_sample=per_sample,
    )
    evals = (t.train_iters // c.eval_interval + 1) if c.eval_interval else 1
    # --full-validation: one epoch of the split (megatron-core builds whole epochs)
    valid_samples = 1 if c.full_validation else c.eval_iters * gbs * evals
    train, valid, _ = build_datasets(
        cfg.data,
        tokenizer,
        seq_length=T,
        samples=(windows, valid_samples, 0),
        seed=t.seed,
    )
    checks = [("training", train)] + (
        [("validation", valid)] if c.eval_iters or c.full_validation else []
    )
    for name, dataset in checks:
        if dataset is None or len(dataset) == 0:
            raise ConfigError(
                f"the data gives no {name} samples of {T} tokens; lower --seq-length or add "
                "data (--data-path, --split)"
            )
    stream = TrainStream(
        train,
        bag_size=per_sample,
        phase1_samples=n1 * gbs,
        seed=t.seed,
        num_workers=cfg.data.num_workers,
    )
    return stream, valid


def build_phases(cfg: RunConfig, tokenizer, layout: BatchLayout) -> tuple[Schedule, Phase, int]:
    """The schedule with each phase bound to its samples and forward step, validation, and
    the validation steps per evaluation (``--eval-iters``, or with ``--full-validation`` the
    whole split in global batches).

    Raises:
        ConfigError: ``--full-validation`` with a validation split smaller than one global
            batch.
    """
    schedule = Schedule.plan(
        cfg.tst, seq_length=cfg.model.seq_length, train_iters=cfg.train.train_iters
    )
    stream, valid = build_data(cfg, tokenizer, layout, schedule.n1)
    tp_group, cp_group = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
    phase1_step = make_phase1_step(
        bag_size=cfg.tst.bag_size,
        weighting=cfg.tst.bag_weighting,
        mode=cfg.tst.mode,
        tp_group=tp_group,
        cp_group=cp_group,
    )
    phase2_step = make_phase2_step(cp_group=cp_group)
    schedule = schedule.bind(
        phase1=(stream.samples(1), phase1_step), phase2=(stream.samples(2), phase2_step)
    )
    validation = dataclasses.replace(schedule.phase2, first_iteration=0).bind(
        valid.__getitem__, phase2_step
    )
    eval_steps = cfg.checkpoint.eval_iters
    if cfg.checkpoint.full_validation:
        eval_steps = len(valid) // layout.global_batch_size
        if eval_steps == 0:
            raise ConfigError(
                f"--full-validation: the validation split has {len(valid)} samples of "
                f"{cfg.model.seq_length} tokens, fewer than one global batch "
                f"({layout.global_batch_size}); give it a larger --split share"
            )
    return schedule, validation, eval_steps


def setup(cfg: RunConfig) -> Run:
    """Start the process, validate, build model/optimizer/data, resume if asked."""
    process = resolve_process(device=cfg.train.device)
    validate(cfg, process.world_size, process.device.type)  # before any work
    cfg = resolve(cfg, process.world_size, process.device.type)
    info = init_distributed(
        device=cfg.train.device, timeout_minutes=cfg.train.distributed_timeout_minutes
    )
    pcfg = cfg.parallel.to_parallel_config(cfg.model.num_layers)
    initialize_model_parallel(pcfg)
    print_rank0(describe_layout(info))
    if process.device.type == "cpu":
        print_rank0(" transformer impl: local (megatron-core's local spec; a CPU run)")
    set_seed(cfg.train.seed)
    tokenizer = build_tokenizer(
        cfg.data.tokenizer_type,
        vocab_size=cfg.model.vocab_size,
        model=cfg.data.tokenizer_model,
        vocab_file=cfg.data.vocab_file,
        merge_file=cfg.data.merge_file,
    )
    if cfg.model.vocab_size is not None and tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            f"--tokenizer-model has {tokenizer.vocab_size} ids but --vocab-size is "
            f"{cfg.model.vocab_size}; make them equal (or omit --vocab-size)"
        )
    if cfg.data.data_path:
        check_data_files(
            cfg.data.data_path,
            tokenizer.vocab_size,
            cache_path=cfg.data.data_cache_path,
            pad_id=dataset_pad_id(tokenizer),
        )
    else:
        check_mock_data(tokenizer, tokenizer.vocab_size)
    vocab = padded_vocab_size(
        cfg.model.vocab_size or tokenizer.vocab_size,
        divisible_by=cfg.model.make_vocab_size_divisible_by,
        tp=pcfg.tensor_model_parallel_size,
    )
    config = transformer_config(cfg, use_cpu_initialization=info.device.type == "cpu")
    chunks = build_model_chunks(cfg, config, vocab, info.device)
    optimizer, scheduler = build_optimizer(cfg, chunks)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    dp = data_parallel_size(cfg, info.world_size)
    gbs = cfg.train.global_batch_size or cfg.train.micro_batch_size * dp
    layout = BatchLayout(
        cfg.train.micro_batch_size,
        dp,
        ps.get_data_parallel_rank(),
        gbs // (cfg.train.micro_batch_size * dp),
    )
    schedule, validation, eval_steps = build_phases(cfg, tokenizer, layout)
    writer = None
    if cfg.checkpoint.tensorboard_dir and dist.get_rank() == dist.get_world_size() - 1:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=cfg.checkpoint.tensorboard_dir)
    args = checkpointing.checkpoint_args(
        cfg, vocab_size=cfg.model.vocab_size or tokenizer.vocab_size, padded_vocab_size=vocab
    )
    return Run(
        cfg,
        info.device,
        chunks,
        optimizer,
        scheduler,
        layout,
        schedule,
        validation,
        eval_steps,
        writer,
        args,
    )


# --- one step -----------------------------------------------------------------------------


def mean_loss(loss_sum: float, tokens: float) -> Optional[float]:
    """``loss_sum / tokens``, or None when no token was scored (never a made-up 0)."""
    return loss_sum / tokens if tokens > 0 else None


def _reduce_report(reports: list, device: torch.device) -> Optional[float]:
    """Megatron's ``[loss_sum, tokens]`` reports of this step -> mean loss over DP/CP, or
    None when no token was scored. (On ``device``: NCCL reduces only CUDA tensors.)"""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0:
        for report in reports:
            total += report["lm loss"].detach().double()
    dist.all_reduce(total)  # contributions: one per distinct DP/CP slice of the data
    loss_sum, tokens = total.tolist()
    return mean_loss(loss_sum, tokens)


def _moe_aux_loss(cfg: RunConfig, num_microbatches: int) -> Optional[float]:
    if not cfg.moe.num_experts or not moe_utils.get_moe_layer_wise_logging_tracker():
        return None
    return moe_logged_aux_loss(num_layers=cfg.model.num_layers, num_microbatches=num_microbatches)


def moe_logged_aux_loss(*, num_layers: int, num_microbatches: int) -> float:
    """The step's MoE balancing losses as logged (``moe aux loss``): the sum over megatron-core's
    tracker entries (aux loss, z-loss, ...) averaged over layers and micro-batches, then the
    tracker is cleared. Collective over the whole world (PP via megatron-core, TP x CP here).

    megatron-core <= 0.18 records the z-loss as each rank's mean over its own sequence-parallel
    tokens; the mean over the TP x CP group is the mean over the whole sequence, as at TP = 1.
    Entries that are already equal across the group (the aux loss, and every entry on 0.19,
    which averages there itself) are unchanged by it. One host read (``.item()``).
    """
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    group = ps.get_tensor_and_context_parallel_group()
    size = dist.get_world_size(group)
    total = 0.0
    for entry in tracker.values():
        values = entry["values"].detach().clone()
        if size > 1:
            dist.all_reduce(values, group=group)
            values /= size
        total += values.sum().item() / (num_layers * num_microbatches)
    moe_utils.clear_aux_losses_tracker()
    return total


def read_batches(run: Run, phase: Phase, data_step: int) -> list:
    """This rank's micro-batches of ``phase``'s phase-local step ``data_step``."""
    return read_step(phase.read_sample, run.layout, step=data_step, device=run.device)


def run_schedule(run: Run, phase: Phase, batches: list, *, forward_only: bool) -> list:
    """One pass of megatron-core's pipeline schedule over ``batches`` with ``phase``'s forward
    step; returns the loss reports of this rank."""
    iterators = [iter(batches) for _ in run.model]
    return get_forward_backward_func()(
        forward_step_func=phase.forward_step,
        data_iterator=iterators if len(run.model) > 1 else iterators[0],
        model=run.model,
        num_microbatches=len(batches),
        seq_length=phase.model_seq_length,
        micro_batch_size=run.layout.micro_batch_size,
        forward_only=forward_only,
    )


def train_step(run: Run, phase: Phase, iteration: int) -> dict:
    """One optimizer step of ``phase`` at 0-based ``iteration``; returns the step's metrics.

    Host reads: none per micro-batch. Once per step, after the optimizer step: the step's
    loss (one ``.tolist()``: the history, Megatron-LM's NaN check and the log line), the MoE
    balancing loss (one ``.item()``, MoE only), megatron-core's own grad-norm and
    skipped-step reads inside ``optimizer.step()``, and its NaN/Inf check of the gradients in
    ``finalize_model_grads`` (``--check-for-nan-in-loss-and-grad``, on by default).
    """
    batches = read_batches(run, phase, phase.data_step(iteration))
    start = time.perf_counter()  # the step itself, without reading samples
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    reports = run_schedule(run, phase, batches, forward_only=False)
    _, grad_norm, num_zeros = run.optimizer.step()
    run.scheduler.step(increment=run.layout.global_batch_size)
    elapsed = time.perf_counter() - start
    loss = _reduce_report(reports, run.device)
    if (
        run.cfg.train.check_for_nan_in_loss_and_grad
        and loss is not None
        and not math.isfinite(loss)
    ):
        raise RuntimeError(
            f"iteration {iteration}: the loss is {loss} (--no-check-for-nan-in-loss-and-grad "
            "skips this check)"
        )
    if run.cfg.train.empty_unused_memory_level >= 1 and run.device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "loss": loss,
        "moe_aux_loss": _moe_aux_loss(run.cfg, run.layout.num_microbatches),
        "grad_norm": grad_norm,
        "num_zeros": num_zeros,
        "lr": run.optimizer.param_groups[0]["lr"],
        "tokens": run.layout.global_batch_size * phase.data_seq_length,
        "step_time": elapsed,
    }


def evaluate(run: Run, eval_round: int) -> Optional[float]:
    """Next-token validation loss of round ``eval_round`` (in either phase: round ``k`` reads
    validation steps ``[k*K, (k+1)*K)``, ``K`` = ``--eval-iters``; with ``--full-validation``
    every round reads the whole split); None when no token was scored."""
    phase, k = run.validation, run.eval_steps
    if run.cfg.checkpoint.full_validation:
        eval_round = 0  # the whole split, every time
    for chunk in run.model:
        chunk.eval()
    reports = []
    with torch.no_grad():
        for i in range(k):
            batches = read_batches(run, phase, eval_round * k + i)
            reports += run_schedule(run, phase, batches, forward_only=True)
    for chunk in run.model:
        chunk.train()
    moe_utils.clear_aux_losses_tracker()
    return _reduce_report(reports, run.device)


# --- logging, saving, signals -------------------------------------------------------------


def _loss_text(loss: Optional[float]) -> str:
    return NO_TOKENS if loss is None else f"{loss:.6E}"


def log_step(run: Run, iteration: int, phase: Phase, metrics: dict, tokens_seen: int) -> None:
    """Megatron-style console line and TensorBoard scalars (against steps and tokens); a step
    that scored no token prints :data:`NO_TOKENS` and writes no loss scalar."""
    run.history["train"][iteration] = metrics["loss"]
    if run.writer is not None:  # the phase marker at every step, so the switch is exact
        run.writer.add_scalar("tst-phase", phase.index, iteration)
    if iteration % run.cfg.checkpoint.log_interval and iteration != run.cfg.train.train_iters:
        return
    kind = "mce loss" if phase.index == 1 else "lm loss"
    aux = metrics["moe_aux_loss"]
    tokens_per_second = metrics["tokens"] / metrics["step_time"]
    extra = _monitoring(run, metrics)  # collective (--log-params-norm): on every rank
    print_rank0(
        f" iteration {iteration:8d}/{run.cfg.train.train_iters:8d} | phase {phase.index} | "
        f"consumed tokens: {tokens_seen:12d} | elapsed time per iteration (ms): "
        f"{1000 * metrics['step_time']:.1f} | tokens/s: {tokens_per_second:.0f} | "
        f"learning rate: {metrics['lr']:.3E} | {kind}: {_loss_text(metrics['loss'])} | "
        + (f"moe aux loss: {aux:.4E} | " if aux is not None else "")
        + f"grad norm: {metrics['grad_norm']:.3f} |"
        + (
            f" throughput per GPU (TFLOP/s/GPU): {_tflops(run, metrics):.1f} |"
            if run.cfg.checkpoint.log_throughput
            else ""
        )
        + "".join(f" {name}: {value} |" for name, value in extra.items() if "mem" not in name)
    )
    if run.wandb is not None:
        logged = {kind: metrics["loss"], "learning-rate": metrics["lr"], **extra}
        run.wandb.log({k: v for k, v in logged.items() if v is not None}, iteration)
    if run.writer is not None:
        scalars = {
            kind: metrics["loss"],
            "learning-rate": metrics["lr"],
            "grad-norm": metrics["grad_norm"],
            "tokens-per-second": tokens_per_second,
            "moe aux loss": aux,
            **extra,
        }
        for name, value in scalars.items():
            if value is not None:
                run.writer.add_scalar(name, value, iteration)
                run.writer.add_scalar(f"{name} vs tokens", value, tokens_seen)
        run.writer.add_scalar("tst-phase vs tokens", phase.index, tokens_seen)


def _monitoring(run: Run, metrics: dict) -> dict:
    """The optional values of Megatron-LM's --log-* flags for this step."""
    from tst_megatron.training import monitoring

    c, extra = run.cfg.checkpoint, {}
    if c.log_num_zeros_in_grad:
        extra["num zeros"] = int(metrics["num_zeros"])
    if c.log_params_norm:
        extra["params norm"] = round(monitoring.params_l2_norm(run.model), 6)
    if c.log_timers_to_tensorboard:
        extra["iteration-time"] = metrics["step_time"]
    if c.log_memory_to_tensorboard:
        extra.update(monitoring.memory_scalars(run.device))
    return extra


def _tflops(run: Run, metrics: dict) -> float:
    """Model TFLOP/s per process of this step (``--log-throughput``)."""
    from tst_megatron.training.plan import flops_per_position

    positions = run.layout.global_batch_size * run.cfg.model.seq_length
    flops = positions * flops_per_position(run.cfg)
    return flops / metrics["step_time"] / dist.get_world_size() / 1e12


def log_validation(run: Run, iteration: int, loss: Optional[float], tokens_seen: int) -> None:
    """Megatron-style validation line and TensorBoard scalars; :data:`NO_TOKENS` and no
    scalar when the round scored no token."""
    run.history["valid"][iteration] = loss
    ppl = NO_TOKENS if loss is None else f"{math.exp(min(loss, 50)):.3E}"
    print_rank0(
        f" validation at iteration {iteration} | lm loss: {_loss_text(loss)} | lm loss PPL: {ppl} |"
    )
    if run.writer is not None and loss is not None:
        run.writer.add_scalar("validation lm loss", loss, iteration)
        run.writer.add_scalar("validation lm loss vs tokens", loss, tokens_seen)
        if run.cfg.checkpoint.log_validation_ppl_to_tensorboard:
            run.writer.add_scalar("lm loss validation ppl", math.exp(min(loss, 50)), iteration)


def save(run: Run, iteration: int, tokens_seen: int) -> None:
    path = checkpointing.save_checkpoint(
        run.cfg.checkpoint.save,
        iteration,
        run.model,
        run.optimizer,
        run.scheduler,
        loop={"consumed_tokens": tokens_seen},
        tst=run.cfg.tst,
        args=run.args,
    )
    print_rank0(f" saved checkpoint of iteration {iteration} to {path}")


class SignalFlag:
    """Set by SIGTERM; checked (on all ranks together) at the end of each step."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.received, self.device = enabled, False, device
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank(self) -> bool:
        """Whether any rank received SIGTERM (a collective when enabled; False otherwise)."""
        if not self.enabled:
            return False
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


# --- the loop -----------------------------------------------------------------------------


def resume(run: Run) -> tuple[int, int]:
    """``(iteration, tokens consumed)`` from ``--load``, or ``(0, 0)``."""
    if not run.cfg.checkpoint.load:
        return 0, 0
    loop = checkpointing.load_checkpoint(
        run.cfg.checkpoint.load,
        run.model,
        run.optimizer,
        run.scheduler,
        tst=run.cfg.tst,
        train_iters=run.cfg.train.train_iters,
        args=run.args,
        load_optim=run.cfg.checkpoint.load_optim,
        load_rng=run.cfg.checkpoint.load_rng,
        finetune=run.cfg.checkpoint.finetune,
        strict=run.cfg.checkpoint.dist_ckpt_strictness,
    )
    if loop is None:
        print_rank0(f" no checkpoint in {run.cfg.checkpoint.load}; starting from scratch")
        return 0, 0
    if loop.get("release"):
        print_rank0(
            f" loaded the weights of {run.cfg.checkpoint.load} (--finetune or a converted "
            "release checkpoint); training starts at iteration 0 with a new optimizer"
        )
    else:
        print_rank0(f" resumed from iteration {loop['iteration']} of {run.cfg.checkpoint.load}")
    return loop["iteration"], loop["consumed_tokens"]


def _announce(run: Run, iteration: int) -> None:
    n1, n = run.schedule.n1, run.schedule.train_iters
    print_rank0(
        f" TST: bag size {run.cfg.tst.bag_size}, phase 1 = iterations [0, {n1}), "
        f"phase 2 = [{n1}, {n})"
    )
    if iteration >= n:
        print_rank0(
            f" nothing to do: the checkpoint is at iteration {iteration} of "
            f"--train-iters {n}; raise --train-iters to train further"
        )


def train(cfg: RunConfig) -> dict:
    """Pretrain from iteration 0 (or the ``--load`` checkpoint) to ``--train-iters``.

    Returns the history ``{"train": {iteration: loss}, "valid": {iteration: loss},
    "exit": "finished" | "signal"}`` (the same on every rank; a loss is None when the step
    or round scored no token).
    """
    # The handler goes in before set-up, which can take minutes on a cluster: a preemption
    # notice that arrives while the model and checkpoint load is acted on after the first step.
    signals = SignalFlag(
        cfg.checkpoint.exit_signal_handler, resolve_process(device=cfg.train.device).device
    )
    run = setup(cfg)
    cfg = run.cfg  # resolved: iterations from samples, global batch, ...
    c, t, schedule = cfg.checkpoint, cfg.train, run.schedule
    run.wandb = open_wandb(cfg, dist.get_rank(), dist.get_world_size())
    profiler = Profiler(cfg, dist.get_rank(), run.device)
    if t.manual_gc:  # Megatron-LM's --manual-gc: no automatic collection during steps
        gc.disable()
        gc.collect()
    started = time.monotonic()
    iteration, tokens_seen = resume(run)
    _announce(run, iteration)
    exit_reason = should_exit(iteration, train_iters=schedule.train_iters)
    while exit_reason is None:
        phase = schedule.phase_at(iteration)
        profiler.before_step(iteration)
        metrics = train_step(run, phase, iteration)
        profiler.after_step(iteration)
        iteration, tokens_seen = iteration + 1, tokens_seen + metrics["tokens"]
        log_step(run, iteration, phase, metrics, tokens_seen)
        at_switch = schedule.switches_after(iteration)
        if at_switch:
            print_rank0(f" TST switch at iteration {iteration}: phase 2 (next-token) from here on")
        if t.manual_gc and t.manual_gc_interval and iteration % t.manual_gc_interval == 0:
            gc.collect()
        if should_eval(
            iteration, eval_interval=c.eval_interval, eval_iters=run.eval_steps, at_switch=at_switch
        ):
            loss = evaluate(run, iteration // c.eval_interval)
            log_validation(run, iteration, loss, tokens_seen)
        exit_reason = should_exit(
            iteration,
            train_iters=schedule.train_iters,
            signalled=signals.any_rank(),
            exit_interval=t.exit_interval,
            minutes_elapsed=_minutes_elapsed(started, run.device, t.exit_duration_in_mins),
            exit_duration_in_mins=t.exit_duration_in_mins,
        )
        if should_save(
            iteration,
            save=c.save,
            save_interval=c.save_interval,
            at_switch=at_switch,
            save_at_switch=cfg.tst.save_at_switch,
            exiting=exit_reason is not None,
        ):
            save(run, iteration, tokens_seen)
    if exit_reason == "signal":  # the Slurm template's preemption path reads this line
        print_rank0(f" exiting on SIGTERM after iteration {iteration}")
    elif exit_reason != "finished":
        print_rank0(f" exiting after iteration {iteration} ({exit_reason})")
    run.history["exit"] = exit_reason
    if run.writer is not None:
        run.writer.close()
    if t.manual_gc:
        gc.enable()
    if run.wandb is not None:
        run.wandb.finish()
    return run.history


def _minutes_elapsed(started: float, device, limit: Optional[float]) -> Optional[float]:
    """Minutes since ``started``, the maximum over ranks so all agree (a collective); None
    without ``--exit-duration-in-mins``."""
    if limit is None:
        return None
    minutes = torch.tensor([(time.monotonic() - started) / 60.0], device=device)
    dist.all_reduce(minutes, op=dist.ReduceOp.MAX)
    return minutes.item()


def main(argv=None) -> int:
    """Entry point: parse, train, tear down.

    A :class:`~tst_megatron.errors.ConfigError` (bad flag or value, layout, tokenizer, data or
    checkpoint) prints its problems (``error: ...``, one line each) once, from rank 0, and
    returns 2; every rank returns only after the lines are out
    (:func:`tst_megatron.runtime.report_error`). Any other exception propagates with its
    traceback on the rank where it happened. ``--dry-run`` validates and prints the resolved
    run without training (:func:`tst_megatron.training.plan.dry_run`).
    """
    from tst_megatron.runtime import destroy, report_error
    from tst_megatron.training.config import parse_args

    try:
        cfg = parse_args(argv)
        if cfg.train.dry_run:
            from tst_megatron.training.plan import dry_run

            return dry_run(cfg)
        train(cfg)
    except ConfigError as exc:
        report_error(str(exc))
        return 2
    finally:
        destroy()
    return 0
