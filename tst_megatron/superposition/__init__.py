"""Token Superposition Training: the method, as small functions over tensors.

Source: Peng, Gigant, Quesnelle, "Efficient Pre-Training with Token Superposition",
arXiv 2605.06546 (2026), section 3; the method as implemented and the project's decisions are in ``docs/design.md``.

Glossary (used in every docstring of this package)
--------------------------------------------------
``S``     bag size (``--tst-bag-size``; the spec writes it ``s``). ``S = 1`` is plain training.
``T``     latent sequence length: the positions the transformer processes (``--seq-length``).
``L``     ``S * T``, tokens per sample read from the data in phase 1.
``b``     micro-batch size in samples.
``h``     hidden size.
``V``     (padded) vocabulary size; ``V/tp`` is one tensor-parallel shard of it.
``k``     number of target slots scored per position (``k = S`` in phase 1).

Layouts: token ids and labels are batch-first, ``[b, L]`` folded to ``[b, T, S]``. The
embedding returns Megatron's sequence-first hidden states ``[T, b, h]`` (``[T/tp, b, h]``
under sequence parallelism). The output layer's logits are sequence-first
``[T, b, V/tp]``; the launcher scores them there, in the model's loss seam
(:class:`tst_megatron.models.gpt.TSTGPTModel`, ``labels=[b, T, S]``), while
``GPTModel(labels=None)`` returns a batch-first copy ``[b, T, V/tp]``.
:func:`vocab_parallel_multi_target_cross_entropy` accepts any leading shape as long as
logits and targets agree.

Host synchronisation: none of these functions reads a device value on the host, unless
asked to check ids (``check=True``); ids are checked once where data enters.
"""

from tst_megatron.superposition.bags import align_bag_targets, bag_weights, fold_bags
from tst_megatron.superposition.cross_entropy import (
    multi_hot_cross_entropy,
    vocab_parallel_multi_target_cross_entropy,
)
from tst_megatron.superposition.embedding import bag_embedding

__all__ = [
    "fold_bags",
    "align_bag_targets",
    "bag_weights",
    "bag_embedding",
    "vocab_parallel_multi_target_cross_entropy",
    "multi_hot_cross_entropy",
]
