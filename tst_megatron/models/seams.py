"""The seams TST shares between megatron-core's ``GPTModel`` and ``HybridModel``, one mixin
each, used by :class:`~tst_megatron.models.gpt.TSTGPTModel` and
:class:`~tst_megatron.models.hybrid.TSTHybridModel`:

- :class:`TSTLossSeam`: both score their logits in ``compute_language_model_loss(labels,
  logits)`` (megatron-core's ``LanguageModule``), which it extends to phase 1's bags;
- :class:`PhaseOneMTPSkip`: phase 1 skips the multi-token-prediction block, whose parameters
  get an exactly zero gradient (and a fresh Adam at the switch,
  :class:`~tst_megatron.loop.switch.FreshAdamForMTP`, which reads
  :meth:`PhaseOneMTPSkip._mtp_only_parameters`).

Phase 1's multi-hot cross-entropy is scored there on the sequence-first logits
``[T, b, V/tp]``, as megatron-core scores its own, with no batch-first copy.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear

from tst_megatron import upstream
from tst_megatron.superposition import vocab_parallel_multi_target_cross_entropy
from tst_megatron.superposition.chunked_loss import chunked_output_cross_entropy
from tst_megatron.superposition.embedding import run_forward_pre_hooks


class TSTLossSeam:
    """Mixin for a megatron-core ``LanguageModule`` (``GPTModel``, ``HybridModel``), listed
    before it: ``class M(TSTLossSeam, GPTModel)``. Adds no parameter, buffer or state-dict key.
    """

    #: ``--tst-loss-chunks`` (:func:`enable_loss_chunks`); 1: megatron-core's head and loss.
    tst_loss_chunks = 1

    @contextlib.contextmanager
    def chunked_head(self, labels):
        """While the model computes a loss (``labels`` given) with ``tst_loss_chunks > 1``,
        its output layer (:class:`ChunkedOutputLayer`) returns its input instead of the
        logits, and :meth:`compute_language_model_loss` computes the output layer and the loss
        together over chunks. Without labels (logits wanted) nothing changes. With MTP heads,
        megatron-core's acceptance counts read the predictions the chunked loss makes
        (:func:`tst_megatron.upstream.mtp_acceptance_from_predictions`)."""
        layer = getattr(self, "output_layer", None)
        on = isinstance(layer, ChunkedOutputLayer) and labels is not None
        if not on:
            yield
            return
        with contextlib.ExitStack() as stack:
            if self._scores_mtp_heads():
                stack.enter_context(upstream.mtp_acceptance_from_predictions())
            layer.deferred = True
            try:
                yield
            finally:
                layer.deferred = False

    def _scores_mtp_heads(self) -> bool:
        """Whether this stage scores multi-token-prediction heads (megatron-core's
        ``mtp_process``; the GPT and hybrid models both set it)."""
        return bool(getattr(self, "mtp_process", False) and self.config.mtp_num_layers)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor):
        """Per-token CE for ``[b, T]`` labels (megatron-core), per-slot CE for ``[b, T, S]``.

        Args:
            labels: ``[b, T]`` or ``[b, T, S]`` integer global token ids.
            logits: ``[T, b, V/tp]`` output-layer logits (vocab-parallel). With ``[b, T, S]``
                labels they are overwritten by the softmax (they are not used afterwards).
                Or, under :meth:`chunked_head`, the output layer's input ``[T, b, h]`` tagged
                by :class:`ChunkedOutputLayer`: then the output layer and the loss run over
                ``tst_loss_chunks`` chunks
                (:func:`~tst_megatron.superposition.chunked_loss.chunked_output_cross_entropy`).

        Returns:
            ``[b, T]`` or ``[b, T, S]`` float32 cross-entropy (nats).

        Raises:
            ValueError: ``labels`` is neither 2-D nor 3-D, or its leading shape does not
                match the logits, or the logits' last dimension is not ``vocab_size / TP``
                (gathered logits).
        """
        tp = self.tp_group.size() if self.tp_group is not None else 1
        deferred = getattr(logits, "tst_output", None)
        if deferred is not None:
            return self._chunked_loss(labels, logits, deferred)
        if logits.shape[-1] * tp != self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[-1]} vocabulary entries per rank but the loss "
                f"scores this rank's shard, padded vocabulary {self.vocab_size} / TP {tp} = "
                f"{self.vocab_size // tp}: do not gather them (runtime_gather_output=True or "
                "parallel_output=False)"
            )
        if labels.dim() == 2:
            per_token = super().compute_language_model_loss(labels, logits)
            if torch.is_grad_enabled() and logits.requires_grad:
                zero_unscored_rows(logits, per_token)
            return per_token
        if labels.dim() != 3:
            raise ValueError(f"labels must be [b, T] or [b, T, S], got {tuple(labels.shape)}")
        targets = labels.transpose(0, 1).contiguous()  # [b, T, S] -> [T, b, S] (small)
        per_slot = vocab_parallel_multi_target_cross_entropy(
            logits, targets, tp_group=self.tp_group, inplace=True
        )
        return per_slot.transpose(0, 1).contiguous()  # [T, b, S] -> [b, T, S]

    def _chunked_loss(self, labels: torch.Tensor, hidden: torch.Tensor, deferred) -> torch.Tensor:
        """:meth:`compute_language_model_loss` of the output layer's input ``hidden``
        ``[T, b, h]`` (``[T/tp, b, h]`` under sequence parallelism) and weight: ``[b, T]`` or
        ``[b, T, S]`` fp32 CE, as the unchunked path returns it."""
        if labels.dim() not in (2, 3):
            raise ValueError(f"labels must be [b, T] or [b, T, S], got {tuple(labels.shape)}")
        slots = labels.unsqueeze(-1) if labels.dim() == 2 else labels
        targets = slots.transpose(0, 1).contiguous()  # [b, T, k] -> [T, b, k] (small)
        predictions = None
        if labels.dim() == 2 and self.training and self._scores_mtp_heads():
            # megatron-core's MTP acceptance counts read them (training only, as upstream);
            # the main head cannot be told apart from an MTP head here, so it makes them too
            predictions = torch.empty(targets.shape[:2], dtype=torch.int64, device=targets.device)
            hidden.tst_predictions = predictions
        per_slot = chunked_output_cross_entropy(
            hidden,
            deferred.weight,
            targets,
            chunks=self.tst_loss_chunks,
            tp_group=self.tp_group,
            sequence_parallel=deferred.sequence_parallel,
            into_main_grad=deferred.gradient_accumulation_fusion,
            predictions=predictions,
        ).transpose(0, 1)  # [T, b, k] -> [b, T, k]
        return (per_slot[..., 0] if labels.dim() == 2 else per_slot).contiguous()


class ChunkedOutputLayer(ColumnParallelLinear):
    """megatron-core's output layer (``ColumnParallelLinear``, same parameters and state-dict
    keys) that, while :attr:`deferred` (:meth:`TSTLossSeam.chunked_head`), returns its input
    tagged with the weight it would use instead of the logits: the model's loss seam then runs
    the output layer and the loss together in chunks. Everywhere else, its own forward."""

    deferred = False

    def forward(self, input_, weight=None, runtime_gather_output=None):
        """``ColumnParallelLinear.forward``; while :attr:`deferred`: ``(input_ view with a
        ``tst_output`` attribute (weight, sequence parallelism), None)``."""
        if not self.deferred:
            return super().forward(
                input_, weight=weight, runtime_gather_output=runtime_gather_output
            )
        tagged = input_.view_as(input_)  # a new tensor object: the tag stays off the input
        tagged.tst_output = DeferredOutput(
            self.weight if weight is None else weight,
            self.sequence_parallel,
            self.gradient_accumulation_fusion,
        )
        return tagged, None


@dataclasses.dataclass(frozen=True)
class DeferredOutput:
    """What :class:`ChunkedOutputLayer` hands the loss seam: the output weight ``[V/tp, h]``
    (its own, or the shared embedding's), whether its input is a sequence-parallel shard, and
    whether the weight gradient goes straight into megatron-core's ``main_grad``."""

    weight: torch.Tensor
    sequence_parallel: bool
    gradient_accumulation_fusion: bool


def enable_loss_chunks(model, chunks: int):
    """Set ``--tst-loss-chunks`` on a TST model (a :class:`TSTLossSeam`) and, on its output
    stage with ``chunks > 1``, make its output layer a :class:`ChunkedOutputLayer` (the same
    module; only its forward changes). Returns ``model``.

    Raises:
        ValueError: the output layer is not megatron-core's ``ColumnParallelLinear`` (e.g.
            Transformer Engine's MXFP8 LM head), which the launch rules refuse first.
    """
    model.tst_loss_chunks = chunks
    layer = getattr(model, "output_layer", None)
    if chunks > 1 and layer is not None:
        if type(layer) is not ColumnParallelLinear:
            raise ValueError(
                f"--tst-loss-chunks needs a ColumnParallelLinear output layer, got {type(layer).__name__}"
            )
        layer.__class__ = ChunkedOutputLayer  # this module only: its forward, nothing else
    return model


# --- phase 2: no gradient from unscored positions ---------------------------------------


def zero_unscored_rows(logits: torch.Tensor, per_token: torch.Tensor) -> None:
    """Make the gradient of ``[T, b, V/tp]`` ``logits`` exactly zero at the positions whose
    ``[b, T]`` per-token CE ``per_token`` (computed from them) gets a zero upstream gradient:
    two tensor hooks on the graph, nothing kept from the forward (the logits are freed after
    it, as in a stock megatron-core run; an autograd function holding them until backward
    cost one logits-sized tensor, ``tests/unit/test_loss_memory.py``).

    Workaround: megatron-core's CE backward (``tensor_parallel/cross_entropy.py``,
    ``fusions/fused_cross_entropy.py``) is ``(softmax - onehot) * g``, so a masked position
    with inf/nan logits gives ``nan * 0 = nan``.
    """
    unscored = {}

    def keep(grad):  # [b, T], before the CE's backward runs
        unscored["rows"] = (grad == 0).transpose(0, 1).unsqueeze(-1)  # [T, b, 1]

    def zero(grad):  # [T, b, V/tp], the CE's gradient of the logits
        rows = unscored.pop("rows", None)
        # in place: the CE's own fresh buffer, which only the output layer's backward reads
        # (a copy would hold a second logits-sized gradient at fp32)
        return grad if rows is None else grad.masked_fill_(rows, 0.0)

    per_token.register_hook(keep)
    logits.register_hook(zero)


# --- phase 1 skips multi-token prediction ----------------------------------------------


class PhaseOneMTPSkip:
    """Mixin for a megatron-core ``GPTModel`` or ``HybridModel`` with multi-token prediction:
    megatron-core's MTP block embeds the next input token, which phase 1 (bag-mean inputs)
    lacks, so a phase-1 forward skips it. Its parameters (:meth:`_mtp_only_parameters`) then
    get an exactly zero gradient (:meth:`_idle_mtp`), so that megatron-core DDP's grad hooks
    fire (``--overlap-grad-reduce``) and their Adam moments stay zero until the switch.
    """

    def _mtp_only_parameters(self) -> list[torch.nn.Parameter]:
        """This stage's trainable parameters only MTP uses: the MTP block's, and the
        embedding's on a non-first stage (minus a tied output weight)."""
        if not getattr(self, "mtp_process", False):
            return []
        params = list(self.mtp.parameters())
        if not self.pre_process:
            shared = None
            if self.share_embeddings_and_output_weights and self.post_process:
                shared = self.shared_embedding_or_output_weight()
            params += [p for p in self.embedding.parameters() if p is not shared]
        unique = {id(p): p for p in params if p.requires_grad}
        return list(unique.values())

    def _idle_mtp(self) -> list[torch.nn.Parameter]:
        """:meth:`_mtp_only_parameters`, after running the forward pre-hooks of the modules
        that own them: megatron-core DDP waits there for their all-gather
        (``--overlap-param-gather``), which must not stay in flight while the block is
        skipped. Wrap the forward's output in ``idle_gradient(output, idle)``."""
        idle = self._mtp_only_parameters()
        if not hasattr(self, "_idle_modules"):
            owners = {id(p) for p in idle}
            self._idle_modules = [
                m for m in self.modules() if any(id(p) in owners for p in m.parameters(False))
            ]
        for module in self._idle_modules:
            run_forward_pre_hooks(module)
        return idle


def idle_gradient(output: torch.Tensor, idle) -> torch.Tensor:
    """``output`` unchanged; in backward, a zero gradient for each parameter of ``idle``
    (:class:`_ZeroGradient`)."""
    return _ZeroGradient.apply(output, *idle)


class _ZeroGradient(torch.autograd.Function):
    """Identity on ``output``; a broadcast zero gradient for each of ``params``, so their
    grad hooks fire (megatron-core DDP's ``register_grad_ready``)."""

    @staticmethod
    def forward(ctx, output, *params):
        ctx.like = [(p.shape, p.dtype, p.device) for p in params]
        return output

    @staticmethod
    def backward(ctx, grad):
        zeros = (torch.zeros((), dtype=d, device=dev).expand(shape) for shape, d, dev in ctx.like)
        return (grad, *zeros)
