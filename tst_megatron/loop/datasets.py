"""Megatron-LM's datasets provider for TST: training sample ``i`` is a phase-1 sample before
the switch and a phase-2 window after it; validation and test are megatron-core's ordinary
next-token splits."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from tst_megatron.data.gpt_datasets import (
    build_datasets,
    check_data_files,
    check_mock_data,
    data_prefixes,
    data_settings,
    dataset_pad_id,
    training_windows,
)
from tst_megatron.data.index_cache import cache_dir_of
from tst_megatron.data.stream import open_stream
from tst_megatron.loop.plan import RunPlan
from tst_megatron.loop.switch import switch_validation_samples
from tst_megatron.runtime import resolve_process


class PhasedTrainDataset(torch.utils.data.Dataset):
    """Training sample ``i`` of the run: phase-1 sample ``i`` for ``i < switch``, else phase-2
    sample ``i - switch``. Items are dicts of ``tokens``, ``labels``, ``loss_mask`` (phase 2
    also ``position_ids``), ``[S*T]`` in phase 1 (``[T]`` with ``--tst-mode output``) and
    ``[T]`` in phase 2.

    Args:
        stream: the project's :class:`~tst_megatron.data.stream.TrainStream`.
        switch: samples consumed before the switch (``RunPlan.switch_sample``).
        total: samples of the whole run (``RunPlan.total_samples``).
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
    """Megatron-LM datasets provider ``(num_samples) -> (train, valid, test)`` of the run
    ``plan`` (:class:`~tst_megatron.loop.plan.RunPlan`).

    ``is_distributed = True``: every rank reads its batch, since phase-1 micro-batches are
    ``S`` times longer than the buffers of Megatron-LM's ``get_batch_on_this_tp_rank``.
    """

    is_distributed = True

    def __init__(self, plan: RunPlan):
        self.plan = plan

    def __call__(self, num_samples: Sequence[Optional[int]], vp_stage: Optional[int] = None):
        # Megatron-LM's globals: set by its pretrain(), which calls this provider
        from megatron.training import get_args, get_tokenizer

        args, tokenizer = get_args(), get_tokenizer()
        plan = self.plan
        tst, switch, total = plan.tst, plan.switch_sample, plan.total_samples
        data = data_settings(args)
        if data.mock_data:
            check_mock_data(tokenizer, tokenizer.vocab_size)
        per_sample = tst.windows_per_sample()
        windows = training_windows(
            data, phase1_samples=switch, phase2_samples=total - switch, per_sample=per_sample
        )
        _, valid_n, test_n = num_samples
        if valid_n is not None:  # the extra round at the switch (switch_overrides)
            valid_n += switch_validation_samples(args, plan)
        train, valid, test = build_datasets(
            data,
            tokenizer,
            seq_length=args.seq_length,
            samples=(windows, 1 if valid_n is None else valid_n, test_n or 0),
            seed=args.seed,
        )
        if not data.mock_data:  # the pad id of megatron-core's built datasets
            check_data_files(
                data.data_path,
                tokenizer.vocab_size,
                cache_path=data.data_cache_path,
                pad_id=dataset_pad_id(train),
                pad_flag=data.allow_ambiguous_pad_tokens,
            )
        prefixes = None if data.mock_data else data_prefixes(data.data_path)
        stream = open_stream(
            train,
            windows_per_sample=per_sample,
            phase1_samples=switch,
            seed=args.seed,
            cache_dir=cache_dir_of(data.data_cache_path, prefixes),
            local_rank=resolve_process(device="cpu").local_rank,
        )
        return PhasedTrainDataset(stream, switch=switch, total=total), valid, test
