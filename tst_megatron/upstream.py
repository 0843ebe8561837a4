"""Every workaround for megatron-core / Megatron-LM 0.19.2, listed at one address
(:data:`WORKAROUNDS`: where it lives, the symptom, the test that shows it, the upstream code
that causes it), and the ones that live here: :func:`distributed_optimizer_resume`. The
redirections of megatron-core's CUDA assumptions on a CPU are :mod:`tst_megatron.runtime.cpu`'s
(one entry below; its own version check is ``cpu.check_version``).

On a megatron-core upgrade, ``tests/unit/test_upstream.py`` fails for each entry whose upstream
code changed: run that entry's test without it, and where upstream fixed the symptom, delete
the workaround and its entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch
from megatron.core.optimizer import distrib_optimizer
from megatron.core.transformer import multi_token_prediction as mtp

#: The megatron-core release every workaround below was written for and tested with.
RELEASE = "megatron-core 0.19.2"


@dataclasses.dataclass(frozen=True)
class Workaround:
    """One workaround: ``where`` (a dotted path to it), the ``symptom`` in 0.19.2 without it,
    ``test`` (a test file that fails without it), and ``probe``: ``(dotted path of the
    megatron-core / Megatron-LM code that causes it, a fragment of that code's source)``, which
    ``tests/unit/test_upstream.py`` finds in the installed release. Once upstream changes that
    code the probe fails: rerun ``test`` without the workaround, and delete it if fixed. None:
    no line of upstream code shows the cause (the reason is in ``symptom``)."""

    where: str
    symptom: str
    test: str
    probe: Optional[tuple] = None


WORKAROUNDS = (
    Workaround(
        "tst_megatron.models.hybrid.LocalHybridStack",
        "HybridStack builds Transformer Engine's TENorm as its final norm whatever its spec: a "
        "HybridModel cannot be built without Transformer Engine (every CPU run)",
        "tests/distributed/test_hybrid.py",
        (
            "megatron.core.models.hybrid.hybrid_block.HybridStack.__init__",
            "self.final_norm = TENorm(",
        ),
    ),
    Workaround(
        "tst_megatron.training.checks.model.hybrid_stage_problems",
        "a hybrid MoE pattern whose pipeline split leaves a rank without E layers hangs at the "
        "first log line (MoEMetricsTracker.report sizes that rank's tensors by the E count, "
        "the MoE ranks' by num_layers); refused in one line",
        "tests/unit/test_dry_run.py",
        (
            "megatron.core.transformer.moe.moe_logging.MoEMetricsTracker.report",
            "init_size = num_layers + (mtp_num_layers or 0)",
        ),
    ),
    Workaround(
        "tst_megatron.upstream.distributed_optimizer_resume",
        "a --use-distributed-optimizer run without Apex/TE cannot resume (AssertionError), "
        "with fp32 parameters cannot load (in-place copy into a grad-requiring view), and "
        "resumed with the wrong Adam step",
        "tests/distributed/test_distributed_optimizer_resume.py",
        (
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict",
            "assert len(steps) == 1",
        ),
    ),
    Workaround(
        "tst_megatron.data.index_cache._MaskCacheFilled",
        "GPTDataset caches the first sample's loss mask with its pad labels zeroed: every "
        "later sample loses those positions",
        "tests/unit/test_pad_token.py",
        (
            "megatron.core.datasets.gpt_dataset.GPTDataset.__getitem__",
            "self.cached_loss_mask = loss_mask",
        ),
    ),
    Workaround(
        "tst_megatron.data.index_cache._AtomicIndexCache",
        "a dataset index cache written by a killed job is read back half-written",
        "tests/distributed/test_data_caches.py",
        (
            "megatron.core.datasets.gpt_dataset.GPTDataset._build_document_sample_shuffle_indices",
            "numpy.save(path_to_document_index, document_index, allow_pickle=True)",
        ),
    ),
    Workaround(
        "tst_megatron.data.gpt_datasets.use_prebuilt_dataset_helpers",
        "initialize_megatron runs make in the wheel's datasets folder, which has no Makefile",
        "tests/distributed/test_megatron_lm_loop.py",
        ("megatron.core.datasets.utils.compile_helpers", '["make", "-C"'),
    ),
    Workaround(
        "tst_megatron.models.layers.ExpertRowParallelLinear",
        "at expert TP = EP = 1 the expert bias is added in place to a view (autograd error)",
        "tests/distributed/test_megatron_lm_moe.py",
        (
            "megatron.core.transformer.mlp.MLP.forward",
            "output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)",
        ),
    ),
    Workaround(
        "tst_megatron.models.layers.tag_expert_grad_reduction",
        "the experts' fc2 bias is tagged sequence_parallel: its gradient is summed over TP "
        "on top of expert DP",
        "tests/distributed/test_megatron_lm_moe.py",
        (
            "megatron.core.tensor_parallel.layers.RowParallelLinear.__init__",
            'setattr(self.bias, "sequence_parallel", self.sequence_parallel)',
        ),
    ),
    Workaround(
        "tst_megatron.models.seams.zero_unscored_rows",
        "the CE backward (softmax - onehot) * g gives nan * 0 = nan at masked positions with "
        "non-finite logits",
        "tests/distributed/test_gpt_seam.py",
        (
            "megatron.core.tensor_parallel.cross_entropy.VocabParallelCrossEntropy.calculate_gradients",
            "grad_input.mul_(grad_output.unsqueeze(dim=-1))",
        ),
    ),
    Workaround(
        "tst_megatron.upstream.mtp_acceptance_from_predictions",
        "process_mtp_loss takes the argmax of each MTP head's full logits for its acceptance "
        "counts, which the chunked loss head (--tst-loss-chunks) never makes",
        "tests/distributed/test_loss_chunks.py",
        (
            "megatron.core.transformer.multi_token_prediction.process_mtp_loss",
            "correct, total = _compute_mtp_acceptance_counts(\n                mtp_logits,",
        ),
    ),
    Workaround(
        "tst_megatron.training.flags._fix_help",
        "--help raises ValueError on an unescaped % in one Megatron-LM help text",
        "tests/unit/test_megatron_lm_args.py",
        ("megatron.core.transformer.transformer_config", "(e.g. 1.10 = 10%)"),
    ),
    Workaround(
        "tst_megatron.data.resume.checkpoint_to_resume",
        "Megatron-LM's read_metadata exits with status 0 on a malformed tracker file",
        "tests/unit/test_megatron_lm_args.py",
        ("megatron.training.checkpointing.read_metadata", "sys.exit()"),
    ),
    Workaround(
        "tst_megatron.runtime.cpu.fork_checkpoint_results_queue",
        "on a CPU the first torch_dist save spawns a process that re-imports torch (about 8 s)",
        "tests/distributed/test_megatron_lm_loop.py",
        (
            "megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue",
            "mp_mode: str = 'spawn'",
        ),
    ),
    Workaround(
        "tst_megatron.runtime.cpu.enable",
        "megatron-core's CUDA assumptions on a CPU (devices, streams, RNG, type checks, "
        "te_general_gemm undefined without TE): docs/design.md, 'megatron-core on the CPU'",
        "tests/unit/test_runtime.py",
    ),
)


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
    megatron-core 0.19.2 cannot (three bugs of ``DistributedOptimizer``'s load; each, and the
    measured error, in ``docs/design.md``, "Resuming the distributed optimizer"):

    1. without Apex/TE, ``sharded_state_dict(is_loading=True)`` first fills torch AdamW's
       empty per-parameter state (:func:`fill_empty_adam_state`; upstream asserts one step);
    2. ``load_state_dict`` runs under ``torch.no_grad()`` (float32 main parameters are views
       of grad-requiring model parameters);
    3. without Apex/TE, each parameter's ``step`` is then set to the checkpoint's, a tensor of
       its own (:func:`set_adam_step`; upstream leaves one shared tensor holding the
       template's step).

    Both methods are class attributes of megatron-core's ``DistributedOptimizer``, replaced
    for the context (the launcher's ``pretrain()`` call) and restored after. The legacy
    ``--ckpt-format torch`` (a fourth bug) is refused before work instead
    (``checks.hardware.without_te_problems``).
    """
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


@contextlib.contextmanager
def mtp_acceptance_from_predictions() -> Iterator[None]:
    """While active, megatron-core's MTP acceptance counts (``process_mtp_loss`` calls
    ``multi_token_prediction._compute_mtp_acceptance_counts(mtp_logits, mtp_labels, loss_mask,
    ...)``) read the predicted tokens that the chunked loss head attached to its deferred
    logits (``mtp_logits.tst_predictions``, ``[T, b]`` int64: the first global argmax of each
    position's logits, :func:`~tst_megatron.superposition.chunked_loss.chunked_output_cross_entropy`)
    instead of taking the argmax of logits it never made. Any other ``mtp_logits`` goes to
    the original function. The counts are upstream's formula: ``correct = sum((pred ==
    label) & mask)``, ``total = sum(mask)``, both float32 scalars.

    The module attribute is replaced for the context (:meth:`TSTLossSeam.chunked_head`, one
    model forward) and restored after.
    """
    original = mtp._compute_mtp_acceptance_counts

    def counts(mtp_logits, mtp_labels, loss_mask, *args, **kwargs):
        preds = getattr(mtp_logits, "tst_predictions", None)
        if preds is None:
            return original(mtp_logits, mtp_labels, loss_mask, *args, **kwargs)
        with torch.no_grad():
            labels = mtp_labels.transpose(0, 1)  # [b, s] -> [s, b], as upstream
            valid = loss_mask.transpose(0, 1).bool()
            return ((preds == labels) & valid).sum().float(), valid.sum().float()

    mtp._compute_mtp_acceptance_counts = counts
    try:
        yield
    finally:
        mtp._compute_mtp_acceptance_counts = original
