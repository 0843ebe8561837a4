"""Data for both TST phases from one megatron-core dataset.

The training data is one ``GPTDataset`` (or ``MockGPTDataset``) of ``T``-token samples built
by ``BlendedMegatronDatasetBuilder``. Read in *stream order* (its shuffle undone), its
samples are consecutive windows of the packed token stream: window ``j`` holds tokens
``[j*T, (j+1)*T]``. :class:`TrainStream` groups the windows into blocks of ``S``
consecutive windows and shuffles the blocks once (seeded):
- phase-1 sample ``i`` is block ``perm[i]``: ``S`` windows concatenated, exactly ``S*T + 1``
  contiguous tokens (``docs/design.md``, "Phase 1 data");
- phase 2 reads the windows of the blocks phase 1 did not use, ``perm[n1:]``, in order, so
  it continues through the data instead of rereading what phase 1 consumed (``docs/design.md``, "The schedule").
The data position is a pure function of the iteration: micro-batch ``m`` of phase-local
step ``k`` on data-parallel rank ``r`` holds samples ``(k*M + m)*b*DP + r*b + [0, b)``
(megatron-core's pretraining sampler order). Validation reads its own split in the
dataset's order. A blend of several ``--data-path`` prefixes has no single stream; its
samples are then taken in the blend's order.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers import MegatronTokenizer

from tst_megatron.compat import null_tokenizer
from tst_megatron.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How samples map to micro-batches on this rank."""

    micro_batch_size: int
    """b: samples per micro-batch."""
    data_parallel_size: int
    """DP."""
    data_parallel_rank: int
    """This rank's DP index."""
    num_microbatches: int
    """M = global batch / (b * DP)."""

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.data_parallel_size * self.num_microbatches


def build_tokenizer(tokenizer_type: str, *, vocab_size: Optional[int], model: Optional[str]):
    """A megatron-core tokenizer: ``NullTokenizer`` (ids ``0..vocab_size-1``, EOD = last id)
    or ``SentencePieceTokenizer``.

    Raises:
        ConfigError: unknown type or missing settings.
    """
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ConfigError("--vocab-size is required with --tokenizer-type NullTokenizer")
        return null_tokenizer(vocab_size)  # library name and EOD id differ across releases
    if tokenizer_type == "SentencePieceTokenizer":
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=model, metadata_path={"library": "sentencepiece"}
        )
    raise ConfigError(f"unknown --tokenizer-type {tokenizer_type!r}")


def check_data_files(data_path: str, vocab_size: int) -> None:
    """Before any work: every dataset prefix of ``--data-path`` has its ``.bin`` and ``.idx``,
    and holds only token ids below ``vocab_size`` (one vectorised pass over the memory-mapped
    ``.bin``).

    Raises:
        ConfigError: a missing file, an empty dataset, or an out-of-vocabulary id, naming it.
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType

    prefixes = get_blend_from_list(data_path.split())[0]
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise ConfigError(
                    f"--data-path: {prefix + suffix} does not exist (run tools/preprocess_data.py)"
                )
        with open(prefix + ".idx", "rb") as f:
            header = f.read(9 + 8 + 1)  # magic, version, dtype code
        if not header.startswith(b"MMIDIDX\x00\x00") or len(header) < 18:
            raise ConfigError(f"--data-path: {prefix}.idx is not a Megatron index file")
        dtype = DType.dtype_from_code(header[-1])
        tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
        if tokens.size == 0:
            raise ConfigError(f"--data-path: {prefix}.bin holds no tokens")
        top = int(tokens.max())
        if top >= vocab_size:
            raise ConfigError(
                f"--data-path: {prefix}.bin holds token id {top}, outside the vocabulary of "
                f"{vocab_size}; preprocess with the tokenizer of --tokenizer-model or raise --vocab-size"
            )


def _dataset_config(data, tokenizer, seq_length, seed, blend) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        blend=blend,
        split=data.split,
        path_to_cache=data.data_cache_path,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=data.reset_attention_mask,
    )


def build_datasets(data, tokenizer, *, seq_length: int, samples: tuple[int, int, int], seed: int):
    """``(train, valid, test)`` datasets of ``seq_length``-token samples (None where 0 asked)."""
    blend = None if data.mock_data else get_blend_from_list(data.data_path.split())
    cls = MockGPTDataset if data.mock_data else GPTDataset
    config = _dataset_config(data, tokenizer, seq_length, seed, blend)
    return BlendedMegatronDatasetBuilder(cls, list(samples), lambda: True, config).build()


class TrainStream:
    """Phase-1 and phase-2 training samples from one dataset of ``T``-token windows.

    Args:
        dataset: a megatron-core ``GPTDataset`` of ``T``-token samples (or a blend).
        bag_size: ``S``.
        phase1_samples: samples phase 1 consumes in the whole run (``N1 * global batch``).
        seed: seeds the block permutation.

    Raises:
        ConfigError: fewer windows than one block per phase-1 sample.
    """

    def __init__(self, dataset, *, bag_size: int, phase1_samples: int, seed: int):
        self.dataset, self.bag_size, self.phase1_samples = dataset, bag_size, phase1_samples
        dataset[0]  # megatron-core may load its indices lazily
        shuffle = getattr(dataset, "shuffle_index", None)
        # window j in stream order is dataset[order[j]]
        self.order = np.argsort(shuffle) if shuffle is not None else np.arange(len(dataset))
        blocks = len(dataset) // bag_size
        if blocks < phase1_samples:
            raise ConfigError(
                f"the data gives {blocks} phase-1 samples of {bag_size} windows but phase 1 needs "
                f"{phase1_samples}; add data or lower --tst-phase1-iters/--train-iters"
            )
        self.blocks = np.random.RandomState(seed).permutation(blocks)

    def _window(self, j: int) -> dict:
        return self.dataset[int(self.order[j])]

    def phase1_sample(self, i: int) -> dict:
        """``S*T``-token sample ``i`` of phase 1 (``tokens``, ``labels``, ``loss_mask`` ``[S*T]``)."""
        if i >= self.phase1_samples:
            raise IndexError(f"phase-1 sample {i} is past the {self.phase1_samples} planned")
        first = int(self.blocks[i]) * self.bag_size
        windows = [self._window(first + k) for k in range(self.bag_size)]
        return {
            key: torch.cat([w[key] for w in windows]) for key in ("tokens", "labels", "loss_mask")
        }

    def phase2_sample(self, i: int) -> dict:
        """``T``-token sample ``i`` of phase 2: the windows of the blocks phase 1 left."""
        block_slot, k = divmod(i, self.bag_size)
        block_slot += self.phase1_samples
        if block_slot >= len(self.blocks):
            raise IndexError(
                f"the data has {len(self.blocks) * self.bag_size} windows; phase-2 sample {i} is "
                "past them"
            )
        return self._window(int(self.blocks[block_slot]) * self.bag_size + k)


def _collate(samples: list[dict]) -> dict:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def microbatches(
    get_sample: Callable[[int], dict], layout: BatchLayout, *, step: int, device: torch.device
) -> Iterator[dict]:
    """The ``M`` micro-batches of phase-local step ``step`` for this DP rank.

    Yields dicts of ``tokens``/``labels``/``loss_mask`` (and ``position_ids`` and, when the
    dataset makes one, ``attention_mask``) batched to ``[b, L]``.

    Raises:
        IndexError: the data has too few samples for the step.
    """
    b, dp = layout.micro_batch_size, layout.data_parallel_size
    for m in range(layout.num_microbatches):
        start = (step * layout.num_microbatches + m) * b * dp + layout.data_parallel_rank * b
        batch = _collate([get_sample(i) for i in range(start, start + b)])
        yield {k: v.to(device) for k, v in batch.items()}
