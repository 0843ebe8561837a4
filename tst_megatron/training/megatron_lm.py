"""TST inside Megatron-LM's own training loop (``megatron.training.pretrain()``, megatron-core
>= 0.17), through its official extension points only.

Megatron-LM owns the loop, the arguments and their validation, the optimizer and scheduler,
checkpointing and logging. This module supplies what ``pretrain()`` takes:

- :func:`add_tst_args`: the extra-args provider. The ``--tst-*`` flags are generated from the
  fields of :class:`~tst_megatron.superposition.schedule.TSTConfig` (names, ``Literal``
  choices and help text from the field docstrings), so flag and field cannot drift.
- :func:`model_provider`: a :class:`~tst_megatron.training.gpt.TSTGPTModel` built from
  Megatron-LM's own config builders (``core_transformer_config_from_args`` through
  ``gpt_config_from_args``) and its layer-spec choice (``default_layer_spec``: the local spec
  with ``--transformer-impl local``, Transformer Engine's otherwise; MoE block specs; MTP).
- :class:`TSTDatasets`: the train/valid/test datasets provider. Training sample ``i`` (in
  Megatron-LM's consumed-samples order) is a phase-1 sample of ``S*T + 1`` tokens for the
  samples the first ``N1`` steps consume and a phase-2 sample of ``T + 1`` tokens after
  (:class:`PhasedTrainDataset` over the project's :class:`~tst_megatron.training.data.TrainStream`).
  Validation and test are megatron-core's ordinary next-token splits.
- :class:`TSTForwardStep`: ``forward_step(data_iterator, model)``; the phase is a pure function
  of the iteration (``args.curr_iteration < N1``) and next-token whenever the model is not
  training (``evaluate()``, where ``curr_iteration`` is stale). It reuses the project's
  phase-1/phase-2 steps (:mod:`tst_megatron.training.forward`).
- :func:`tst_problems`: the TST checks on top of Megatron-LM's ``validate_args``.
- :func:`main`: parse and validate (Megatron-LM's parser plus ``--tst-*``), check, then
  ``pretrain(...)`` with the 0.19 config container; with ``--dry-run``, the checks and a
  summary only (:mod:`tst_megatron.training.dry_run`: at ``WORLD_SIZE=N``, no processes, no
  GPU, no data read).

With a batch-size schedule (``--step-batch-size-schedule``) the switch is at the samples the
first ``N1`` steps consume, counted with Megatron-LM's own calculator (:func:`switch_sample`);
``--rampup-batch-size`` is ignored by Megatron-LM 0.19 (deprecated), so the batch is constant.

What Megatron-LM's loop lacks and TST needs, added without patching the loop
(:class:`TSTForwardStep`, :func:`switch_overrides`):

- **A checkpoint, a validation and a log line at the switch** (iteration ``N1``, the state
  after ``N1`` optimizer steps). ``train()`` decides them each iteration from
  ``args.save_interval``, ``args.eval_interval`` and ``args.log_interval``, read after the
  step (``training_log``, then the evaluation, then ``checkpoint_and_decide_exit``), and
  0.19 has no callback there (``process_non_loss_data_func`` / ``non_loss_data_func`` run
  only inside ``evaluate()``; ``pretrain()`` takes no training hook). The forward step is the
  one piece of ours called every iteration, so at the last phase-1 training step
  (``curr_iteration == N1 - 1``) it sets each interval that does not already divide ``N1``
  to ``N1``, and at the first phase-2 *training* forward it puts the user's values back
  (``evaluate()`` at ``N1`` runs before the save check, in eval mode, and does not restore).
  Megatron-LM then saves, validates and logs iteration ``N1`` with its own code. Only an
  interval that does not already divide ``N1`` is touched (no double save or validation);
  the save needs ``--save`` and no ``--no-tst-save-at-switch``, the validation Megatron-LM's
  own conditions (``do_valid``, ``--eval-iters`` > 0, ``--start-eval-at-iter``); nothing
  happens when the switch is not inside the run (``N1`` = 0 or ``N1 >= --train-iters``),
  with ``--skip-train``, or on a resume at or after ``N1`` (the forward step of ``N1 - 1``
  does not run). The switch checkpoint's recorded ``args`` hold ``N1`` for the intervals
  so changed (Megatron-LM pickles the live namespace); neither ``--use-checkpoint-args``
  nor the resume checks read them, so a resume from it takes the command line's values. The
  validation dataset is sized for the extra validation round (:class:`TSTDatasets`), and
  the validation position is ``consumed_valid_samples`` in the checkpoint, so a resume
  continues exactly. The final save of ``pretrain()`` reads ``cfg_container``, not ``args``.
  Every rank sets its own ``args`` in its forward step (every pipeline stage runs one per
  micro-batch), so all ranks take the collective save together. Not covered: an
  ``--iterations-to-skip`` holding ``N1`` (the step ``N1 - 1`` has no forward).
- **The phase-1 loss as its own series.** Phase 1 reports its multi-hot cross-entropy
  under ``mce loss``, phase 2 the next-token loss under ``lm loss`` (the names of
  :mod:`tst_megatron.plots` and the Slurm logs): TensorBoard has one series per phase, and
  ``lm loss`` stays the next-token loss a baseline run reports. ``training_log`` averages a
  key's sum over all iterations since the last log line, so a log interval holding the
  switch would divide each phase's sum by iterations of both phases: the log line forced at
  ``N1`` keeps every interval inside one phase (except when ``N1`` is the first iteration
  of a (re)start: Megatron-LM does not reset its sums after that one). ``training_log``
  never forgets a key: after the switch its lines still print ``mce loss: 0.000000E+00``.
- **Raw tokens per second.** Megatron-LM's throughput counts ``--seq-length`` tokens per
  sample; a phase-1 sample reads ``S*T``. On the last rank the forward step times the steps
  (host clock from the first forward of a step to the first forward of the next step or of
  a validation, skipping steps that ended with a checkpoint save) and, at each log line,
  prints ``TST: iteration N | raw tokens per second: ... | raw tokens per sample: ... |``
  over the interval and writes ``raw-tokens-per-second`` (TensorBoard, W&B) and
  ``tst-phase`` (TensorBoard, the phase of each iteration).

Device: Megatron-LM has no ``--device`` flag; this launcher adds ``--device {auto,cuda,cpu}``
(``auto``: CUDA when ``torch.cuda.is_available()``, else the CPU). A CPU run enables
:func:`tst_megatron.runtime.cpu.enable` with ``training=True``, appends the flags a CPU run
needs (:data:`CPU_FLAGS`) and sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` when unset.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import typing
from typing import Optional, Sequence

import torch

from tst_megatron.errors import ConfigError
from tst_megatron.superposition.schedule import Schedule, TSTConfig
from tst_megatron.training import fields
from tst_megatron.training.forward import make_phase1_step, make_phase2_step, unwrap

#: Flags appended to the command line of a CPU run: Megatron-LM's defaults assume CUDA
#: kernels (Transformer Engine, fused norms/RoPE/SwiGLU, gradient-accumulation fusion, NCCL).
#: ``--disable-jit-fuser`` keeps the fusions' ``torch.compile`` out of the training steps;
#: ``pretrain()``'s warm-up of them still runs (its decorators ran at import; the tests set
#: ``TORCHDYNAMO_DISABLE=1``). A user's own ``--transformer-impl`` / ``--distributed-backend``
#: other than these is refused (:func:`cpu_flag_problems`), not silently overridden.
CPU_FLAGS = (
    "--transformer-impl",
    "local",
    "--distributed-backend",
    "gloo",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--no-rope-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion",
    "--disable-jit-fuser",
    # weights drawn whole and then split (megatron-core's CPU initialisation): a TP layout
    # starts from the weights of a 1-process run
    "--use-cpu-initialization",
)

_DEVICES = ("auto", "cuda", "cpu")


# --- arguments -----------------------------------------------------------------------------


def add_tst_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM extra-args provider: ``--tst-*`` from :class:`TSTConfig`, and ``--device``.

    Each field ``x`` becomes ``--tst-x`` (dest ``tst_x``; a boolean defaulting to True becomes
    ``--no-tst-x``), with the field's ``Literal`` choices and docstring. Returns ``parser``.
    """
    group = parser.add_argument_group("TST (token superposition training)")
    hints = typing.get_type_hints(TSTConfig)
    docs = fields.field_docs(TSTConfig)
    for field in dataclasses.fields(TSTConfig):
        dest, text = f"tst_{field.name}", docs.get(field.name, "")
        kind = fields.unwrap(hints[field.name])
        if kind is bool:
            negate = field.default is True
            group.add_argument(
                fields.flag_name(field.name, prefix="tst-", negate=negate),
                dest=dest,
                action="store_false" if negate else "store_true",
                default=field.default,
                help=text,
            )
            continue
        choices = fields.field_choices(TSTConfig, field.name)
        group.add_argument(
            fields.flag_name(field.name, prefix="tst-"),
            dest=dest,
            type=type(choices[0]) if choices else kind,
            default=field.default,
            choices=choices,
            help=f"{text} (default: {field.default})",
        )
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="check the launch line for WORLD_SIZE processes (Megatron-LM's validation and "
        "the TST checks), print the layout, model size and TST plan or every problem, and "
        "exit (0: no problem, 2: problems) without starting any work",
    )
    group.add_argument(
        "--device",
        choices=_DEVICES,
        default="auto",
        help="cuda, cpu (gloo; megatron-core's CUDA assumptions redirected, the flags of "
        "CPU_FLAGS added), or auto: cuda when torch.cuda.is_available() (default: auto)",
    )
    _escape_broken_help(parser)
    return parser


def _escape_broken_help(parser: argparse.ArgumentParser) -> None:
    """Make ``--help`` work: double the ``%`` of each help text of ``parser`` that argparse
    cannot expand (Megatron-LM 0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda`` help
    says ``10%)``, so its own ``--help`` stops with ``ValueError: unsupported format
    character``). Only this parser's actions are edited; a text that expands is left as is."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help:
            try:
                formatter._expand_help(action)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")


def tst_config(args) -> TSTConfig:
    """The :class:`TSTConfig` of parsed Megatron-LM arguments (fields ``tst_*``)."""
    return TSTConfig(
        **{f.name: getattr(args, f"tst_{f.name}") for f in dataclasses.fields(TSTConfig)}
    )


def _batch_calculator(args):
    """A private copy of Megatron-LM's batch-size calculator for ``--step-batch-size-schedule``
    (built as ``megatron.training.global_vars.set_global_variables`` builds the global one),
    or None for a constant global batch."""
    if not getattr(args, "step_batch_size_schedule", None):
        return None
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    return StepBatchsizeNumMicroBatchesCalculator(
        micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1),
        decrease_batch_size_if_needed=False,
        rank=-1,  # no logging
        schedule=args.step_batch_size_schedule,
        seq_length=args.seq_length,
    )


def consumed_samples(args, iterations: int) -> int:
    """Training samples consumed by the first ``iterations`` steps, as Megatron-LM's ``train()``
    counts them: ``iterations * --global-batch-size``, or with ``--step-batch-size-schedule`` the
    sum of each step's batch, the batch of a step being the schedule's at the samples consumed
    before it (token thresholds count ``--seq-length`` tokens per sample, in phase 1 too)."""
    calculator = _batch_calculator(args)
    if calculator is None:
        return iterations * args.global_batch_size
    consumed = 0
    for _ in range(iterations):
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_running_global_batch_size()
    return consumed


def train_iters(args) -> int:
    """``--train-iters``, or the steps that consume ``--train-samples`` (Megatron-LM's
    ``update_train_iters``: ``train_samples // global batch``, or with a step schedule the
    first step count whose consumed samples reach ``--train-samples``)."""
    if args.train_iters:
        return args.train_iters
    calculator = _batch_calculator(args)
    if calculator is None:
        return (args.train_samples or 0) // args.global_batch_size
    iterations = consumed = 0
    while consumed < args.train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    return iterations


def schedule(args) -> Schedule:
    """The TST phase schedule of the run: ``N1`` and the phases' sequence lengths."""
    return Schedule.plan(
        tst_config(args), seq_length=args.seq_length, train_iters=train_iters(args)
    )


def resume_problems(args, saved) -> list[str]:
    """Why resuming the checkpoint of iteration ``args.iteration``, written by a run with
    arguments ``saved``, under the arguments ``args`` would train a different TST run than the
    one the checkpoint is part of; one line each naming the flag (empty: none). Reads only.

    The phase and the data position are functions of the iteration and of ``N1`` (and the
    phase-1 samples of ``--tst-bag-size`` / ``--tst-mode``), so a resume before the switch
    under another ``N1``, bag size, mode or bag weighting would go on with other samples or
    another loss, and a resume after the old switch under a later ``N1`` would go back to
    phase 1. After the switch of both runs only phase 2 is left: any TST setting may change.
    Megatron-LM's own resume checks do not know the ``--tst-*`` flags. A checkpoint without
    them (a run of Megatron-LM's ``pretrain_gpt.py``) is not checked.

    Args:
        args: this run's Megatron-LM arguments, ``args.iteration`` the loaded iteration.
        saved: the ``args`` namespace the checkpoint recorded.
    """
    iteration = getattr(args, "iteration", 0) or 0
    if iteration <= 0 or not hasattr(saved, "tst_bag_size"):
        return []
    old, new = schedule(saved).n1, schedule(args).n1
    if iteration >= max(old, new):
        return []
    problems = []
    if old != new:
        problems.append(
            f"the checkpoint of iteration {iteration} was written by a run switching at "
            f"N1 = {old}; this run switches at N1 = {new}: give the checkpoint's "
            "--tst-phase1-iters / --tst-phase1-fraction and --train-iters (or resume after both "
            "switches)"
        )
    if iteration < new:
        for field in ("bag_size", "mode", "bag_weighting"):
            was, now = getattr(saved, f"tst_{field}"), getattr(args, f"tst_{field}")
            if was != now:
                flag = "--tst-" + field.replace("_", "-")
                problems.append(
                    f"the checkpoint of iteration {iteration} is in TST phase 1 of a run with "
                    f"{flag} {was}; this run has {flag} {now}: resume with {flag} {was}"
                )
    return problems


def _checkpoint_args(args):
    """The ``args`` namespace the checkpoint this run loaded (``--load``, iteration
    ``args.iteration``) recorded, or None (nothing loaded, not a ``torch_dist`` checkpoint)."""
    if not args.load or not getattr(args, "iteration", 0):
        return None
    import warnings

    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import get_checkpoint_name

    path = get_checkpoint_name(args.load, args.iteration, return_base_dir=True)
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "metadata.json")):
        return None  # not a dist_checkpointing (torch_dist) checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return dist_checkpointing.load_common_state_dict(path).get("args")


def switch_sample(args) -> int:
    """Training samples consumed before the switch: those of the first ``N1`` steps
    (:func:`consumed_samples`), so the switch is right under a batch-size schedule and after
    a resume (Megatron-LM's sampler restarts at its consumed samples)."""
    return consumed_samples(args, schedule(args).n1)


def tst_problems(args, *, config=None) -> list[str]:
    """Every setting this launcher refuses before any work on top of Megatron-LM's
    ``validate_args``, one line each naming the flag (empty: none): what TST cannot run
    (:func:`_tst_setting_problems`), then with ``--fp8-format`` the GEMM shapes Transformer
    Engine would refuse in the first step
    (:func:`~tst_megatron.training.fp8.fp8_shape_problems`). Reads only.

    Args:
        args: Megatron-LM's arguments after ``validate_args``.
        config: the model's ``TransformerConfig`` when the caller built it (the dry run);
            otherwise, with ``--fp8-format``, built here by Megatron-LM's
            ``core_transformer_config_from_args`` (the sizes FP8 checks are Megatron-LM's).
    """
    return _tst_setting_problems(args) + _fp8_problems(args, config)


def _fp8_problems(args, config) -> list[str]:
    """:func:`~tst_megatron.training.fp8.fp8_shape_problems` of the run (empty without FP8)."""
    if not getattr(args, "fp8", None):
        return []
    from tst_megatron.training.fp8 import fp8_shape_problems

    if config is None:
        from megatron.training.argument_utils import core_transformer_config_from_args

        try:
            config = core_transformer_config_from_args(args)
        except (AssertionError, ValueError) as exc:
            from tst_megatron.training.dry_run import validation_error

            line = validation_error(exc).replace("argument validation", "TransformerConfig")
            return [line]
    return fp8_shape_problems(
        config, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size
    )


def _tst_setting_problems(args) -> list[str]:
    """The settings TST cannot run, one line each naming the flag. Reads only."""
    tst = tst_config(args)
    iters = train_iters(args)
    problems = tst.validate(max(iters, 1))
    if problems or tst.phase1_steps(iters) == 0:
        return problems
    bags = "(--tst-bag-size > 1)"
    for flag, on in (
        ("--reset-position-ids", args.reset_position_ids),
        ("--reset-attention-mask", args.reset_attention_mask),
    ):
        if on:
            problems.append(
                f"{flag} is not supported in TST phase 1 {bags}: bags are formed on the packed "
                "token stream; drop the flag or set --tst-bag-size 1"
            )
    if getattr(args, "mtp_num_layers", None) and getattr(args, "overlap_param_gather", False):
        problems.append(
            f"--overlap-param-gather is not supported with --mtp-num-layers and a TST phase 1 "
            f"{bags}: the MTP block does not run in phase 1, so a bucket of MTP parameters "
            "would keep its all-gather in flight at the optimizer step; drop the flag"
        )
    if getattr(args, "phase_transition_iterations", None):
        problems.append(
            f"--phase-transition-iterations is not supported with TST {bags}: it restarts "
            "the sampler in each phase; TST switches in-process at N1"
        )
    if args.dataloader_type != "single":
        problems.append(
            f"--dataloader-type {args.dataloader_type} is not supported with TST {bags}: the "
            "phase of a sample is read from its position in the 'single' sampler's order"
        )
    return problems


def data_problems(args) -> list[str]:
    """Data flags Megatron-LM accepts that this launcher cannot honour, one line each naming
    the flag (empty: none). Reads only (``--data-args-path``: whether the file is readable).

    - ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` /
      ``--per-split-data-args-path``: the datasets provider builds the three splits from one
      blend with ``--split`` (:func:`~tst_megatron.training.data.build_datasets`); without
      this check a run given only these would train on mock data.
    - ``--data-args-path`` naming no readable file, or a file without a word in it (it would
      leave the run on mock data), or without ``--split`` (Megatron-LM's ``validate_args``
      sets its default split only for ``--data-path``; megatron-core's dataset config would
      assert inside ``pretrain()``).
    """
    problems = []
    for flag in (
        "train_data_path",
        "valid_data_path",
        "test_data_path",
        "per_split_data_args_path",
    ):
        if getattr(args, flag, None):
            problems.append(
                f"--{flag.replace('_', '-')} is not supported by this launcher yet; use "
                "--data-path (or --data-args-path) with --split, or --mock-data"
            )
    path = getattr(args, "data_args_path", None)
    if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
        problems.append(f"--data-args-path {path}: no readable file there")
    elif path:
        with open(path) as f:
            if not f.read().split():
                problems.append(
                    f"--data-args-path {path} is empty: it should hold what --data-path would "
                    "(prefixes, optionally with weights)"
                )
        if not args.split:
            problems.append("--data-args-path needs --split (e.g. --split 969,30,1)")
    return problems


def argv_problems(argv: Sequence[str]) -> list[str]:
    """Flags refused as given on the command line, before Megatron-LM parses it (empty:
    none): ``--yaml-cfg`` (Megatron-LM's experimental YAML config replaces the whole parsed
    namespace, so the ``--tst-*`` flags, ``--device`` and a CPU run's :data:`CPU_FLAGS` would
    be lost).

    Args:
        argv: the command line as the user gave it.
    """
    if any(word == "--yaml-cfg" or word.startswith("--yaml-cfg=") for word in argv):
        return [
            "--yaml-cfg is not supported by this launcher: Megatron-LM's experimental YAML "
            "config replaces the whole command line, --tst-* flags included; pass the flags"
        ]
    return []


def late_megatron_problems(args) -> list[str]:
    """Settings Megatron-LM's ``validate_args`` accepts but its ``pretrain()`` refuses only
    after building the model, one line each naming the flag (empty: none). Reads only.

    - ``--lr-decay-style WSD`` without ``--lr-wsd-decay-iters`` (iteration-based run) or
      ``--lr-wsd-decay-samples`` (sample-based run): ``get_optimizer_param_scheduler`` passes
      ``wsd_decay_steps=None`` and ``OptimizerParamScheduler`` asserts on it.
    - no ``--eval-interval`` (0.19's default is None) in a training run without
      ``--full-validation``: ``get_train_valid_test_num_samples`` computes
      ``train_iters // eval_interval`` and stops with a ``TypeError``.
    - ``--full-validation`` with one validation set: ``evaluate()`` indexes the int
      ``--eval-iters`` (``eval_iters[0]`` of ``torch.tensor(int).tolist()``) and stops with a
      ``TypeError`` at the first evaluation (megatron-core 0.19.2).
    """
    problems = []
    if args.full_validation and not getattr(args, "multiple_validation_sets", False):
        problems.append(
            "--full-validation stops Megatron-LM 0.19 at its first evaluation with one "
            "validation set (a TypeError in evaluate()); size --eval-iters to the validation "
            "split instead"
        )
    elif args.eval_interval is None and not args.skip_train:
        problems.append(
            "--eval-interval is required (Megatron-LM 0.19 has no default and would stop with "
            "a TypeError while sizing the validation set)"
        )
    if args.lr_decay_style == "WSD":
        flag, value = (
            ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters)
            if args.train_iters
            else ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples)
        )
        if value is None:
            problems.append(
                f"--lr-decay-style WSD needs {flag} (the length of the decay; Megatron-LM's "
                "scheduler has no default and would stop after building the model)"
            )
    return problems


def cpu_problems(args) -> list[str]:
    """Settings a CPU run (``--device cpu``) cannot do, one line each naming the flag (empty:
    none). Reads only.

    - ``--use-distributed-optimizer``: megatron-core's ``DistributedOptimizer`` builds its
      buffers as CUDA tensors (a ``TypeError`` at set-up on a CPU).
    - pipeline parallelism with tied embeddings: megatron-core's embedding-group all-reduce
      of the tied weights calls ``.cuda()``.
    - ``--bf16`` / ``--fp16``: megatron-core's ``Float16OptimizerWithFloat16Params`` accepts
      only ``torch.cuda.*`` parameter types.
    - ``--log-memory-to-tensorboard``: Megatron-LM reads CUDA memory statistics
      (``KeyError: 'reserved_bytes.all.current'`` at the first log line).
    - ``--mtp-num-layers`` with pipeline parallelism: megatron-core gives the last stage its
      own copy of the embedding and sets it up with ``weight.data.cuda()``
      (``LanguageModule.setup_embeddings_and_output_layer``).
    """
    problems = []
    for flag, on in (("--bf16", args.bf16), ("--fp16", args.fp16)):
        if on:
            problems.append(
                f"{flag} needs CUDA (megatron-core's mixed-precision optimizer accepts only CUDA "
                "parameters); a CPU run trains in float32: drop it"
            )
    if getattr(args, "log_memory_to_tensorboard", False):
        problems.append(
            "--log-memory-to-tensorboard reads CUDA memory statistics; drop it for a CPU run"
        )
    if args.use_distributed_optimizer:
        problems.append(
            "--use-distributed-optimizer needs CUDA (megatron-core's DistributedOptimizer "
            "builds CUDA buffers); drop it for a CPU run"
        )
    if args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights:
        problems.append(
            "--pipeline-model-parallel-size > 1 on a CPU needs --untie-embeddings-and-output-"
            "weights (megatron-core's tied-embedding all-reduce calls .cuda())"
        )
    if args.pipeline_model_parallel_size > 1 and getattr(args, "mtp_num_layers", None):
        problems.append(
            "--mtp-num-layers with --pipeline-model-parallel-size > 1 needs CUDA (megatron-core "
            "sets up the last stage's copy of the embedding with .cuda()); drop one for a CPU run"
        )
    return problems


def cpu_flag_problems(argv: Sequence[str]) -> list[str]:
    """The user's own ``--transformer-impl`` / ``--distributed-backend`` that a CPU run's
    :data:`CPU_FLAGS` would override (``local`` / ``gloo``), one line each (empty: none).

    Args:
        argv: the command line as the user gave it, before :data:`CPU_FLAGS` are appended.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--transformer-impl")
    parser.add_argument("--distributed-backend")
    given, _ = parser.parse_known_args(list(argv))
    problems = []
    if given.transformer_impl not in (None, "local"):
        problems.append(
            f"--transformer-impl {given.transformer_impl} needs CUDA; a CPU run uses local "
            "(drop the flag or run with --device cuda)"
        )
    if given.distributed_backend not in (None, "gloo"):
        problems.append(
            f"--distributed-backend {given.distributed_backend} needs CUDA; a CPU run uses "
            "gloo (drop the flag or run with --device cuda)"
        )
    return problems


# --- the switch ----------------------------------------------------------------------------


def _eval_iters(args) -> int:
    """``--eval-iters`` summed over the validation sets (Megatron-LM allows a list)."""
    iters = getattr(args, "eval_iters", 0) or 0
    return sum(iters) if isinstance(iters, (list, tuple)) else iters


def _switch_in_run(args, n1: int) -> bool:
    """The run trains and switches inside it: ``0 < N1 < --train-iters``."""
    return not getattr(args, "skip_train", False) and 0 < n1 < train_iters(args)


def _validates_at(args, iteration: int) -> bool:
    """Megatron-LM's own conditions for a validation at ``iteration`` other than its interval
    (``train()``: ``--eval-iters`` > 0, ``--start-eval-at-iter``; ``do_valid`` is checked by
    the caller once the data loaders exist)."""
    start = getattr(args, "start_eval_at_iter", None)
    return _eval_iters(args) > 0 and (start is None or iteration >= start)


def _divides(interval, iteration: int) -> bool:
    return bool(interval) and iteration % interval == 0


def switch_overrides(args, n1: int) -> dict:
    """The Megatron-LM intervals to set to ``N1`` for iteration ``N1`` only, so that
    ``train()`` saves, validates and logs the switch with its own code.

    ``save_interval`` when ``--save`` is given, ``--no-tst-save-at-switch`` is not, and
    ``--save-interval`` does not divide ``N1``; ``eval_interval`` when validation is on
    (``args.do_valid``, ``--eval-iters`` > 0, ``N1 >= --start-eval-at-iter``) and
    ``--eval-interval`` does not divide ``N1``; ``log_interval`` when ``--log-interval``
    does not divide ``N1`` (so no ``training_log`` average spans both phases). Empty when
    the switch is not inside the run (``N1`` = 0, ``N1 >= --train-iters``, ``--skip-train``).

    Returns:
        ``{args attribute: N1}`` (each key one of ``save_interval``, ``eval_interval``,
        ``log_interval``).
    """
    if not _switch_in_run(args, n1):
        return {}
    out = {}
    if tst_config(args).save_at_switch and args.save and not _divides(args.save_interval, n1):
        out["save_interval"] = n1
    valid = getattr(args, "do_valid", False) and _validates_at(args, n1)
    if valid and not _divides(args.eval_interval, n1):
        out["eval_interval"] = n1
    if not _divides(args.log_interval, n1):
        out["log_interval"] = n1
    return out


def switch_validation_samples(args) -> int:
    """Validation samples the round at the switch adds to Megatron-LM's count
    (``get_train_valid_test_num_samples``: ``(train_iters // eval_interval + 1)`` rounds of
    ``--eval-iters`` global batches): one round when :func:`switch_overrides` will add a
    validation at ``N1``, else 0. Read before the data loaders exist (``do_valid`` unknown)."""
    if getattr(args, "full_validation", False):
        return 0  # every round reads the whole set from its start
    n1 = schedule(args).n1
    if not _switch_in_run(args, n1) or not _validates_at(args, n1):
        return 0
    if _divides(args.eval_interval, n1):
        return 0
    batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    return _eval_iters(args) * batch


# --- model ---------------------------------------------------------------------------------


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config=None,
    pg_collection=None,
):
    """Megatron-LM model provider: :func:`build_model_from_args` on Megatron-LM's global
    ``args`` (``megatron.training.get_args()``)."""
    from megatron.training import get_args

    return build_model_from_args(
        get_args(),
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        config=config,
        pg_collection=pg_collection,
    )


def build_model_from_args(
    args,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config=None,
    pg_collection=None,
):
    """A :class:`TSTGPTModel` (a ``GPTModel`` with the TST loss seam; same parameters and
    state-dict keys) for Megatron-LM's ``args`` namespace ``args`` (the launcher's, or one a
    checkpoint stores), with Megatron-LM's own configuration. The one way a model is built
    from arguments: the launcher's :func:`model_provider` and the checkpoint converter
    (:mod:`tst_megatron.conversion.megatron`) both call it. megatron-core's parallel state
    must be initialised (its sizes those of ``args``).

    The ``TransformerConfig`` comes from ``core_transformer_config_from_args`` and the GPT
    settings from ``gpt_config_from_args`` (``megatron.training.argument_utils``); the layer
    spec is ``--spec`` when given; with ``--transformer-impl local`` megatron-core's local
    block spec with the project's sequence-parallel norms and expert fc2
    (:func:`~tst_megatron.training.model.gpt_block_spec`); else Megatron-LM's
    ``megatron.training.models.gpt.default_layer_spec`` (Transformer Engine's spec, MoE block
    specs, experimental attention variants). The MTP block spec is Megatron-LM's
    ``mtp_block_spec``, or with the local block spec
    :func:`~tst_megatron.training.model.local_mtp_block_spec` (the same norms). The
    ``GPTModel`` arguments are those of ``GPTModelBuilder.build_model`` (0.19). Expert
    parameters are tagged for their gradient reduction
    (:func:`~tst_megatron.training.model.tag_expert_grad_reduction`) before DDP wraps them.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.heterogeneous.heterogeneous_config import (
        HeterogeneousTransformerConfig,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import default_layer_spec, mtp_block_spec

    from tst_megatron.runtime import cpu
    from tst_megatron.training.gpt import TSTGPTModel
    from tst_megatron.training.model import (
        gpt_block_spec,
        local_mtp_block_spec,
        tag_expert_grad_reduction,
    )

    cfg = gpt_config_from_args(args, config=config)
    spec = cfg.transformer_layer_spec
    plain_local = (
        cfg.transformer.transformer_impl == "local"
        and cfg.transformer.experimental_attention_variant is None
        and not isinstance(cfg.transformer, HeterogeneousTransformerConfig)
    )
    local = spec is None and plain_local
    if local:
        # megatron-core's local block spec with the project's norms (TP + SP without TE or
        # Apex) and expert fc2 (MoE with biases): tst_megatron.training.model.gpt_block_spec
        spec = gpt_block_spec(cfg.transformer, transformer_impl="local", vp_stage=vp_stage)
    elif spec is None:
        spec = default_layer_spec(cfg, vp_stage)
    elif not isinstance(spec, ModuleSpec) and callable(spec):
        spec = spec(cfg, vp_stage=vp_stage)
    if cfg.attention_backend == AttnBackend.local and hasattr(spec, "submodules"):
        spec.submodules.self_attention.submodules.core_attention = DotProductAttention
    model = TSTGPTModel(
        config=cfg.transformer,
        transformer_layer_spec=spec,
        mtp_block_spec=(
            local_mtp_block_spec(cfg.transformer, vp_stage=vp_stage)  # the same norms
            if local
            else mtp_block_spec(cfg, spec, vp_stage=vp_stage)
        ),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=cfg.seq_length,
        fp16_lm_cross_entropy=cfg.fp16_lm_cross_entropy,
        parallel_output=cfg.parallel_output,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
        rotary_percent=cfg.rotary_percent,
        rotary_base=cfg.rotary_base,
        rope_scaling=cfg.rope_scaling,
        rope_scaling_factor=cfg.rope_scaling_factor,
        seq_len_interpolation_factor=cfg.seq_len_interpolation_factor,
        scatter_embedding_sequence_parallel=cfg.scatter_embedding_sequence_parallel,
        pre_process=pre_process,
        post_process=post_process,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    # experts summed over their expert-DP group only (megatron-core also sums the fc2 bias
    # over TP at expert TP 1 < TP): before DDP reads the tags
    tag_expert_grad_reduction(model, cfg.transformer)
    return cpu.keep_on_cpu(model) if cpu.is_enabled() else model


# --- data ----------------------------------------------------------------------------------


class PhasedTrainDataset(torch.utils.data.Dataset):
    """Training sample ``i`` of the run, in Megatron-LM's consumed-samples order: phase-1
    sample ``i`` (``S*T + 1`` tokens; ``T + 1`` with ``--tst-mode output``) for
    ``i < switch``, else phase-2 sample ``i - switch`` (``T + 1`` tokens).

    A micro-batch never straddles the switch (it is at a global-batch boundary), so the
    default collation stacks samples of one length. Each item is a dict of ``tokens``,
    ``labels``, ``loss_mask`` (and in phase 2 ``position_ids``) tensors.

    Args:
        stream: the project's :class:`~tst_megatron.training.data.TrainStream`.
        switch: samples consumed before the switch (:func:`switch_sample`).
        total: samples of the whole run (:func:`consumed_samples` of ``--train-iters``).
    """

    def __init__(self, stream, *, switch: int, total: int):
        self.stream, self.switch, self.total = stream, switch, total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> dict:
        if i < self.switch:
            return self.stream.phase1_sample(i)
        return self.stream.phase2_sample(i - self.switch)


class TSTDatasets:
    """Megatron-LM train/valid/test datasets provider ``(num_samples) -> (train, valid, test)``.

    Every rank builds its datasets (``is_distributed = True``): the batch is read by each
    TP rank and pipeline stage rather than broadcast from TP rank 0, because phase-1
    micro-batches are ``S`` times longer than the ``--seq-length`` buffers that Megatron-LM's
    ``get_batch_on_this_tp_rank`` allocates. The datasets are megatron-core's
    (``GPTDataset`` / ``MockGPTDataset`` of ``--seq-length`` windows) built by the project's
    :func:`~tst_megatron.training.data.build_datasets` (per-node index caches, ids checked
    where data enters).
    """

    is_distributed = True

    def __call__(self, num_samples: Sequence[Optional[int]], vp_stage: Optional[int] = None):
        from megatron.training import get_args, get_tokenizer

        from tst_megatron.training.data import (
            TrainStream,
            build_datasets,
            check_data_files,
            check_mock_data,
            data_settings,
            dataset_pad_id,
            training_windows,
        )

        args, tokenizer = get_args(), get_tokenizer()
        saved = _checkpoint_args(args)
        problems = [] if saved is None else resume_problems(args, saved)
        if problems:  # before any data is read; main() prints them once
            raise ConfigError("\n".join(problems))
        tst = tst_config(args)
        switch, total = switch_sample(args), consumed_samples(args, train_iters(args))
        data = data_settings(args)
        if data.mock_data:
            check_mock_data(tokenizer, tokenizer.vocab_size)
        else:
            check_data_files(
                data.data_path,
                tokenizer.vocab_size,
                cache_path=data.data_cache_path,
                pad_id=dataset_pad_id(tokenizer),
            )
        per_sample = tst.windows_per_sample()
        windows = training_windows(
            data, phase1_samples=switch, phase2_samples=total - switch, per_sample=per_sample
        )
        _, valid_n, test_n = num_samples
        if valid_n is not None:  # the extra round at the switch (switch_overrides)
            valid_n += switch_validation_samples(args)
        train, valid, test = build_datasets(
            data,
            tokenizer,
            seq_length=args.seq_length,
            samples=(windows, 1 if valid_n is None else valid_n, test_n or 0),
            seed=args.seed,
        )
        stream = TrainStream(train, bag_size=per_sample, phase1_samples=switch, seed=args.seed)
        return PhasedTrainDataset(stream, switch=switch, total=total), valid, test


# --- forward step --------------------------------------------------------------------------


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
        return plan, _reported_as(phase1, PHASE1_LOSS), make_phase2_step(cp_group=cp)

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


#: The key (log line, TensorBoard tag) of the phase-1 loss; phase 2 reports ``lm loss``.
PHASE1_LOSS = "mce loss"


def _reported_as(step, key: str):
    """``step`` with its loss function reporting ``lm loss`` under ``key``."""

    def forward_step(data_iterator, model):
        output, loss_func = step(data_iterator, model)
        return output, functools.partial(_rename_report, loss_func, key)

    return forward_step


def _rename_report(loss_func, key: str, output):
    loss, num_tokens, report = loss_func(output)
    return loss, num_tokens, {key if k == "lm loss" else k: v for k, v in report.items()}


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
            final = iteration == args.train_iters and not _divides(args.eval_interval, iteration)
            saved = args.save and final
        else:
            saved = args.save and (
                _divides(args.save_interval, iteration)
                or _divides(getattr(args, "non_persistent_save_interval", None), iteration)
            )
        if not saved:
            self.tokens += self.tokens_in_step
            self.seconds += now - self.start
        logged = _divides(args.log_interval, iteration) or iteration == args.train_iters
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


# --- entry point ---------------------------------------------------------------------------


def pick_device(argv: Sequence[str]) -> str:
    """``"cuda"`` or ``"cpu"`` from ``--device`` in ``argv`` (``auto``: CUDA when available)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--device", choices=_DEVICES, default="auto")
    device = pre.parse_known_args(list(argv))[0].device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def export_torchrun_env(env: Optional[dict] = None, *, gpus: Optional[int] = None) -> dict:
    """Make a task of an ``srun`` step look like a torchrun worker to Megatron-LM.

    Megatron-LM's ``parse_args`` and ``initialize_megatron`` read torchrun's variables
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; init method
    ``env://``). A task started by ``srun`` without torchrun has Slurm's instead; they are read
    by :func:`tst_megatron.runtime.distributed.resolve_process` (rank ``SLURM_PROCID``, world
    ``SLURM_STEP_NUM_TASKS``, local rank ``SLURM_LOCALID``, rendezvous on the step's first host
    at a port derived from the job id: :func:`tst_megatron.runtime.slurm.slurm_rendezvous`) and
    exported under torchrun's names. torchrun's variables win (nothing is changed when ``RANK``
    is set), and outside an ``srun`` step nothing is set. Megatron-LM calls
    ``torch.cuda.set_device(LOCAL_RANK)``: when Slurm binds fewer GPUs to the task than there
    are tasks on the node (``--gpus-per-task=1``: each task sees one GPU, device 0),
    ``LOCAL_RANK`` is ``SLURM_LOCALID`` modulo the visible GPUs, the task's own GPU.

    Args:
        env: the environment to update (default ``os.environ``).
        gpus: the CUDA devices this task sees (default ``torch.cuda.device_count()``; 0 on a
            CPU, where ``LOCAL_RANK`` is ``SLURM_LOCALID``).

    Returns:
        The variables set (empty when none).

    Raises:
        ConfigError: a malformed Slurm node list or a rank outside the world.
    """
    from tst_megatron.runtime.distributed import resolve_process
    from tst_megatron.runtime.slurm import in_srun_step

    env = os.environ if env is None else env
    if "RANK" in env or not in_srun_step(env):
        return {}
    gpus = torch.cuda.device_count() if gpus is None else gpus
    try:
        process = resolve_process(env, device="cpu")  # the device is not read here
    except ValueError as exc:  # a malformed node list
        raise ConfigError(str(exc)) from None
    exported = {
        "RANK": str(process.rank),
        "WORLD_SIZE": str(process.world_size),
        "LOCAL_RANK": str(process.local_rank % gpus if gpus else process.local_rank),
        "MASTER_ADDR": process.master_addr,
        "MASTER_PORT": str(process.master_port),
    }
    env.update(exported)
    return exported


def _use_prebuilt_dataset_helpers() -> None:
    """Megatron-LM's ``initialize_megatron`` runs ``make`` in megatron-core's datasets folder
    (``megatron.core.datasets.utils.compile_helpers``); the wheel ships the compiled helper
    and no Makefile, so ``make`` fails and the run exits. When the compiled helper imports,
    that function is replaced (in its module only) by one that does nothing."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # a source checkout: let Megatron-LM compile it
    import megatron.core.datasets.utils as dataset_utils

    def compile_helpers():
        """The compiled dataset helper is already installed (megatron-core wheel)."""

    dataset_utils.compile_helpers = compile_helpers


def launch_problems(args, user_argv: Sequence[str], *, cpu: bool, config=None) -> list[str]:
    """Everything the launcher refuses on top of Megatron-LM's ``validate_args``, one line
    each (empty: none), in this order: :func:`late_megatron_problems`, :func:`data_problems`,
    :func:`tst_problems`, and for a CPU run :func:`cpu_problems` and
    :func:`cpu_flag_problems`. The launch (:func:`parse`) and the dry run call it alike.

    Args:
        args: Megatron-LM's arguments after ``validate_args``.
        user_argv: the command line as given, before :data:`CPU_FLAGS` are appended.
        cpu: a CPU run (``--device cpu``).
        config: passed to :func:`tst_problems`.
    """
    problems = late_megatron_problems(args) + data_problems(args)
    problems += tst_problems(args, config=config)
    if cpu:
        problems += cpu_problems(args) + cpu_flag_problems(user_argv)
    return problems


def parse(argv: Sequence[str]):
    """:func:`argv_problems`, then Megatron-LM's ``parse_and_validate_args`` with
    :func:`add_tst_args` on ``argv`` (CPU flags appended for a CPU run), then
    :func:`launch_problems`.

    Returns:
        ``(args, device)``.

    Raises:
        ConfigError: a refused flag, Megatron-LM's validation failed (its assertion message),
            or the launcher's checks found problems (one line each).
    """
    from megatron.training.arguments import parse_and_validate_args

    problems = argv_problems(argv)
    if problems:
        raise ConfigError("\n".join(problems))
    device = pick_device(argv)
    user_argv = list(argv)
    argv = user_argv + (list(CPU_FLAGS) if device == "cpu" else [])
    if device == "cpu":
        from tst_megatron.runtime import cpu

        cpu.enable(training=True)
        # validate_args asks for it with TP or CP > 1 on GPUs before Blackwell (the stand-in's
        # compute capability is 0.0); a CPU has no CUDA connections to limit.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    saved = sys.argv
    sys.argv = [saved[0] if saved else "pretrain_gpt_tst.py", *argv]
    try:
        args = parse_and_validate_args(extra_args_provider=add_tst_args)
    except (AssertionError, ValueError) as exc:  # validate_args raises both
        from tst_megatron.training.dry_run import validation_error

        raise ConfigError(validation_error(exc)) from None
    finally:
        sys.argv = saved
    problems = launch_problems(args, user_argv, cpu=device == "cpu")
    if problems:
        raise ConfigError("\n".join(problems))
    return args, device


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Parse, check, then run Megatron-LM's ``pretrain()`` with TST's extension points.

    ``argv`` defaults to ``sys.argv[1:]``. On a problem (the checks before any work, or a
    :class:`ConfigError` raised inside ``pretrain()``: a data file the datasets provider
    refuses) the job prints one ``error:`` line per problem, once
    (:func:`tst_megatron.runtime.report_error`: rank 0, and every other rank returns only
    after it printed, so a launcher that stops all ranks when one exits does not lose the
    line), and every rank exits with status 2. With ``--dry-run`` it exits with
    :func:`tst_megatron.training.dry_run.dry_run`'s status (0 or 2) instead of training.
    """
    from megatron.core.enums import ModelType

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--dry-run" in argv:
        from tst_megatron.training.dry_run import dry_run

        raise SystemExit(dry_run(argv))
    try:
        export_torchrun_env()
        args, device = parse(argv)
    except ConfigError as exc:
        _exit_on(exc)
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    _use_prebuilt_dataset_helpers()
    if device == "cpu":
        from tst_megatron.runtime import cpu

        cpu.enable(training=True)  # again: modules imported since
        fork_checkpoint_results_queue()
    cfg = pretrain_cfg_container_from_args(args)
    try:
        pretrain(
            cfg,
            TSTDatasets(),
            ModelType.encoder_or_decoder,
            TSTForwardStep(),
            model_provider=model_provider,
        )
    except ConfigError as exc:  # found inside: the datasets provider's data checks
        _exit_on(exc)


def fork_checkpoint_results_queue() -> None:
    """Start megatron-core's torch_dist write-results queue now, by ``fork`` (a CPU run).

    megatron-core's ``FileSystemWriterAsync`` makes the queue at a process's first torch_dist
    save (``filesystem_async.get_write_results_queue``) with a multiprocessing ``Manager``
    started by ``spawn``, whose server process re-imports the launcher and with it torch and
    megatron-core: about 8 s at each process's first save on a 2-core machine. Megatron-LM makes the same queue with ``mp_mode="fork"`` when it starts its
    persistent checkpoint worker (``megatron.training.async_utils``); this does what that does,
    through the same public function, before ``pretrain()``. Only for a CPU run: on a GPU the
    launcher keeps megatron-core's default (no fork of a process that holds a CUDA context).
    Idempotent (the queue is made once per process).
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        get_write_results_queue,
    )

    get_write_results_queue(mp_mode="fork")


def _exit_on(exc: ConfigError) -> typing.NoReturn:
    """Report ``exc`` once for the job (:func:`tst_megatron.runtime.report_error`) and exit
    with status 2."""
    from tst_megatron.runtime import report_error

    report_error(str(exc))
    raise SystemExit(2) from None
