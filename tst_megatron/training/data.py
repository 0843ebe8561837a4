"""Data for both TST phases from megatron-core's dataset builder.

Phase 1 reads samples of ``S*T`` tokens, phase 2 and validation samples of ``T`` tokens,
from the same corpus (``GPTDataset``/``MockGPTDataset`` through
``BlendedMegatronDatasetBuilder``). The data position is a pure function of the iteration:
micro-batch ``m`` of phase-local step ``k`` on data-parallel rank ``r`` holds samples
``offset + (k*M + m)*b*DP + r*b + [0, b)`` (megatron-core's pretraining sampler order).
Phase 2 starts at sample offset ``N1 * global_batch * S`` of its dataset, i.e. after the
number of tokens phase 1 consumed, instead of rereading from the start.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator, Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers import MegatronTokenizer


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
        ValueError: unknown type or missing settings.
    """
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--vocab-size is required with --tokenizer-type NullTokenizer")
        # megatron-core's null tokenizer adds one id for EOD.
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"},
                                                 vocab_size=vocab_size - 1)  # fmt: skip
    if tokenizer_type == "SentencePieceTokenizer":
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=model, metadata_path={"library": "sentencepiece"}
        )
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}")


def check_data_files(data_path: str, vocab_size: int) -> None:
    """Before any work: every dataset prefix of ``--data-path`` has its ``.bin`` and ``.idx``,
    and holds only token ids below ``vocab_size`` (one vectorised pass over the memory-mapped
    ``.bin``).

    Raises:
        ValueError: a missing file, an empty dataset, or an out-of-vocabulary id, naming it.
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType

    prefixes = get_blend_from_list(data_path.split())[0]
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise ValueError(f"--data-path: {prefix + suffix} does not exist "
                                 "(run tools/preprocess_data.py)")  # fmt: skip
        with open(prefix + ".idx", "rb") as f:
            header = f.read(9 + 8 + 1)  # magic, version, dtype code
        if not header.startswith(b"MMIDIDX\x00\x00") or len(header) < 18:
            raise ValueError(f"--data-path: {prefix}.idx is not a Megatron index file")
        dtype = DType.dtype_from_code(header[-1])
        tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
        if tokens.size == 0:
            raise ValueError(f"--data-path: {prefix}.bin holds no tokens")
        top = int(tokens.max())
        if top >= vocab_size:
            raise ValueError(
                f"--data-path: {prefix}.bin holds token id {top}, outside the vocabulary of "
                f"{vocab_size}; preprocess with the tokenizer of --tokenizer-model or raise --vocab-size"
            )


def _dataset_config(data, tokenizer, seq_length, seed, blend) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, tokenizer=tokenizer, blend=blend,
        split=data.split, path_to_cache=data.data_cache_path,
        reset_position_ids=data.reset_position_ids, reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss, create_attention_mask=data.reset_attention_mask,
    )  # fmt: skip


def build_datasets(data, tokenizer, *, seq_length: int, samples: tuple[int, int, int], seed: int):
    """``(train, valid, test)`` datasets of ``seq_length``-token samples (None where 0 asked)."""
    blend = None if data.mock_data else get_blend_from_list(data.data_path.split())
    cls = MockGPTDataset if data.mock_data else GPTDataset
    config = _dataset_config(data, tokenizer, seq_length, seed, blend)
    return BlendedMegatronDatasetBuilder(cls, list(samples), lambda: True, config).build()


def _collate(samples: list[dict]) -> dict:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def microbatches(dataset, layout: BatchLayout, *, step: int, offset: int = 0,
                 device: torch.device) -> Iterator[dict]:  # fmt: skip
    """The ``M`` micro-batches of phase-local step ``step`` for this DP rank.

    Yields dicts of ``tokens``/``labels``/``loss_mask``/``position_ids`` ``[b, L]`` (and
    ``attention_mask`` ``[b, 1, L, L]`` when the dataset makes one).

    Raises:
        ValueError: the dataset is too small for the requested samples.
    """
    b, dp = layout.micro_batch_size, layout.data_parallel_size
    for m in range(layout.num_microbatches):
        start = offset + (step * layout.num_microbatches + m) * b * dp + layout.data_parallel_rank * b
        if start + b > len(dataset):
            raise ValueError(
                f"the dataset has {len(dataset)} samples but step {step} needs sample {start + b - 1}"
            )
        batch = _collate([dataset[i] for i in range(start, start + b)])
        yield {k: v.to(device) for k, v in batch.items()}
