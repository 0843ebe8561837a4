"""megatron-core's ``GPTDataset`` / ``MockGPTDataset`` (or a blend) of ``T``-token samples,
built by ``BlendedMegatronDatasetBuilder`` (:func:`build_datasets`), and the data boundary:
token ids are checked once where data enters (:func:`check_data_files`,
:func:`check_mock_data`), so no training step reads values back to check them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from types import SimpleNamespace
from typing import Optional

import megatron.core.datasets.utils as dataset_utils
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset, MockGPTLowLevelDataset
from megatron.core.datasets.indexed_dataset import _IndexReader
from megatron.core.datasets.utils import get_blend_from_list

from tst_megatron.data.files import atomic_path, data_identity, open_data_file, token_ranges
from tst_megatron.data.index_cache import CachedGPTDatasetConfig, build_splits, cache_dir_of
from tst_megatron.errors import ConfigError
from tst_megatron.runtime import resolve_process


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """Megatron-LM's data flags of the same names and defaults (``data_path``: the words
    joined by spaces)."""

    mock_data: bool = False
    data_path: Optional[str] = None
    split: Optional[str] = "969,30,1"
    data_cache_path: Optional[str] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask_in_dataloader: bool = True
    mmap_bin_files: bool = True
    allow_ambiguous_pad_tokens: bool = False
    mid_level_dataset_surplus: float = 0.005
    num_dataset_builder_threads: int = 1


def data_settings(args) -> DataSettings:
    """:class:`DataSettings` from Megatron-LM's ``get_args()``: the words of ``--data-path``
    or of the ``--data-args-path`` file (Megatron-LM's ``get_blend_and_blend_per_split``);
    neither: mock data.

    Raises:
        OSError: the ``--data-args-path`` file cannot be read.
    """
    words = args.data_path
    if getattr(args, "data_args_path", None):
        with open(args.data_args_path) as f:
            words = f.read().split()
    return DataSettings(
        mock_data=bool(args.mock_data or not words),
        data_path=" ".join(words) if words else None,
        split=args.split,
        data_cache_path=args.data_cache_path,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
        allow_ambiguous_pad_tokens=getattr(args, "allow_ambiguous_pad_tokens", False),
        mid_level_dataset_surplus=getattr(args, "mid_level_dataset_surplus", 0.005),
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
    )


def data_prefixes(data_path: str) -> list[str]:
    """The dataset prefixes of ``--data-path`` (``"A"``, ``"A B"`` or ``"0.7 A 0.3 B"``)."""
    return get_blend_from_list(data_path.split())[0]


def dataset_pad_id(dataset) -> Optional[int]:
    """The id megatron-core's built ``dataset`` (a ``GPTDataset`` or a blend of them) treats
    as padding, zeroed and left out of the loss: ``MegatronDataset._pad_token_id``, the
    tokenizer's pad unless it has none or (without ``--allow-ambiguous-pad-tokens``) it is
    also another special token. None when there is none (megatron-core's -1)."""
    while hasattr(dataset, "datasets"):  # a BlendedDataset: all its parts share the tokenizer
        dataset = dataset.datasets[0]
    pad = getattr(dataset, "_pad_token_id", None)
    return None if pad is None or pad < 0 else int(pad)


def check_data_files(
    data_path: str,
    vocab_size: int,
    *,
    cache_path: Optional[str] = None,
    pad_id: Optional[int] = None,
    pad_flag: bool = False,
) -> None:
    """Checks that every dataset prefix of ``--data-path`` has a consistent ``.bin`` and
    ``.idx`` holding only token ids in ``[0, vocab_size)``, none equal to ``pad_id`` (which
    megatron-core would silently zero). Scans are cached (:func:`token_ranges`).

    Args:
        data_path: ``--data-path``.
        vocab_size: ids of the tokenizer (or ``--vocab-size``).
        cache_path: ``--data-cache-path`` (where stamps go).
        pad_id: :func:`dataset_pad_id` of the run's training dataset; None: none to refuse.
        pad_flag: ``--allow-ambiguous-pad-tokens`` is set (it can make EOS/EOD the pad id);
            the error line then names it.

    Raises:
        ConfigError: the first missing, truncated, malformed or empty file; else one line per
            file holding an id outside ``[0, vocab_size)`` or the pad id.
    """
    files = [open_data_file(prefix) for prefix in data_prefixes(data_path)]
    count = (pad_id,) if pad_id is not None else ()
    problems = []
    for file, stats in zip(files, token_ranges(files, cache_path=cache_path, count=count)):
        if stats.min < 0 or stats.max >= vocab_size:
            bad = stats.min if stats.min < 0 else stats.max
            problems.append(
                f"--data-path: {file.prefix}.bin holds token id {bad}, outside the vocabulary "
                f"[0, {vocab_size}); preprocess with the tokenizer of --tokenizer-model or "
                "raise --vocab-size"
            )
        if pad_id is not None and stats.count(pad_id):
            problems.append(
                f"--data-path: {file.prefix}.bin holds {stats.count(pad_id)} tokens of id "
                f"{pad_id}, the pad id of --tokenizer-model; megatron-core's GPTDataset would "
                "replace each by 0 and drop it from the loss: use a tokenizer whose pad token "
                "never occurs in the data (no pad_token, or a dedicated special token)"
                + (", or drop --allow-ambiguous-pad-tokens" if pad_flag else "")
            )
    if problems:
        raise ConfigError("\n".join(problems))


def check_mock_data(tokenizer, vocab_size: int) -> None:
    """Checks that megatron-core's mock documents (``(1, 2, ...) % tokenizer.vocab_size``, then
    ``tokenizer.eod``) lie in ``[0, vocab_size)``.

    Raises:
        ConfigError: the tokenizer's ids or EOD fall outside ``[0, vocab_size)``.
    """
    top = max(tokenizer.vocab_size - 1, tokenizer.eod)
    if tokenizer.eod < 0 or top >= vocab_size:
        bad = tokenizer.eod if tokenizer.eod < 0 else top
        raise ConfigError(
            f"--mock-data: the mock documents hold token id {bad}, outside the vocabulary "
            f"[0, {vocab_size}); make --vocab-size match the tokenizer"
        )


def blend_identity(prefixes) -> str:
    """The data identity of a blend's files (:func:`~tst_megatron.data.files.data_identity`
    of each prefix, in order), one hex digest; ``""`` for none (mock data)."""
    if not prefixes:
        return ""
    parts = [data_identity(p) for p in dict.fromkeys(prefixes)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _dataset_config(
    data, tokenizer, seq_length, seed, blend, identity: str = ""
) -> CachedGPTDatasetConfig:
    return CachedGPTDatasetConfig(
        data_identity=identity,
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        blend=blend,
        split=data.split,
        path_to_cache=data.data_cache_path,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=data.reset_attention_mask
        and data.create_attention_mask_in_dataloader,
        mmap_bin_files=data.mmap_bin_files,
        allow_ambiguous_pad_tokens=data.allow_ambiguous_pad_tokens,
        mid_level_dataset_surplus=data.mid_level_dataset_surplus,
        num_dataset_builder_threads=data.num_dataset_builder_threads,
    )


_SPLIT_NAMES = ("training", "validation", "test")


def check_split(config, documents: dict, samples: tuple) -> None:
    """Checks that every split asked for samples gets a document of each dataset;
    megatron-core (``round(bookend * documents)``) loops forever on an empty one. An empty
    split asked for none is dropped (its ``config.split_matrix`` entry set to None).

    Args:
        config: the ``GPTDatasetConfig``; its ``split_matrix`` may be edited.
        documents: ``{prefix: documents}`` (sequences in the ``.idx``).
        samples: samples asked of each split, ``(train, valid, test)``.

    Raises:
        ConfigError: a split asked for samples gets no document.
    """
    for i, bookends in enumerate(config.split_matrix):
        if bookends is None:
            continue
        for prefix, n in documents.items():
            counts = [
                int(round(b[1] * n)) - int(round(b[0] * n)) if b else 0 for b in config.split_matrix
            ]
            if counts[i] > 0:
                continue
            if samples[i]:
                shares = ", ".join(f"{name} {c}" for name, c in zip(_SPLIT_NAMES, counts))
                raise ConfigError(
                    f"--split {config.split} gives the {_SPLIT_NAMES[i]} split none of the {n} "
                    f"documents of {prefix} ({shares}); give it a larger share"
                )
            config.split_matrix = list(config.split_matrix)
            config.split_matrix[i] = None
            break


def build_datasets(data, tokenizer, *, seq_length: int, samples: tuple[int, int, int], seed: int):
    """``(train, valid, test)`` datasets of ``seq_length``-token samples (None for an empty
    split asked for 0 samples), index caches per :mod:`.index_cache`. Call on every rank.

    Raises:
        ConfigError: a split asked for samples has no document (:func:`check_split`), or a
            damaged index cache on a rank that only reads it.
    """
    if data.mock_data:
        blend, prefixes, cls = None, None, MockGPTDataset
        documents = {"--mock-data": MockGPTLowLevelDataset.size}
    else:
        blend = get_blend_from_list(data.data_path.split())
        prefixes, cls = blend[0], GPTDataset
        documents = {p: open_data_file(p).sequences for p in dict.fromkeys(prefixes)}
    identity = blend_identity(prefixes)  # read before the caches: they are keyed by it
    config = _dataset_config(data, tokenizer, seq_length, seed, blend, identity)
    check_split(config, documents, samples)
    process = resolve_process(device="cpu")
    if prefixes and process.local_rank == 0:  # one per node: node-local cache directories too
        directory = cache_dir_of(config.path_to_cache, prefixes)
        note_data_change(directory, prefixes, config.data_identity, quiet=process.rank != 0)
    return build_splits(
        cls, list(samples), config, local_rank=process.local_rank, prefixes=prefixes
    )


#: The record, in a cache directory, of the data identity its caches were last built for.
IDENTITY_RECORD = "tst_data_identity.json"


def note_data_change(directory: str, prefixes, identity: str, quiet: bool = False):
    """Compare ``identity`` (:func:`blend_identity` of ``prefixes``) with the one recorded in
    the cache ``directory`` for the same prefixes; when it differs, print a ``note:`` (unless
    ``quiet``; the caches are keyed by it, so they are built again) and return it. Then record
    ``identity`` (atomically). Call on one rank per node."""
    record = os.path.join(directory, IDENTITY_RECORD)
    key = " ".join(prefixes)
    try:
        with open(record) as f:
            seen = json.load(f)
        seen = seen if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        seen = {}
    note = None
    if seen.get(key) not in (None, identity):
        note = (
            f"the data of --data-path changed since the caches in {directory} were built "
            "(re-preprocessed or replaced under the same prefix): its index caches and TST "
            "sample orders are built again for the new data"
        )
        if not quiet:
            print(f"note: {note}", flush=True)
    if seen.get(key) != identity:
        seen[key] = identity
        try:
            os.makedirs(directory, exist_ok=True)
            with atomic_path(record) as tmp, open(tmp, "w") as f:
                json.dump(seen, f, sort_keys=True)
        except OSError:  # a read-only cache directory: the caches' own checks report it
            pass
    return note


def training_windows(data, *, phase1_samples: int, phase2_samples: int, per_sample: int) -> int:
    """``T``-token windows to ask of the training split for ``phase1_samples`` blocks of
    ``per_sample`` windows plus ``phase2_samples`` windows, with one spare block per dataset
    (each stream may end in a partial block)."""
    streams = 1 if data.mock_data else len(data_prefixes(data.data_path))
    return phase1_samples * per_sample + phase2_samples + per_sample * streams


def use_prebuilt_dataset_helpers() -> None:
    """Make ``megatron.core.datasets.utils.compile_helpers`` a no-op when the compiled helper
    imports: the megatron-core 0.19.2 wheel ships it without the Makefile that
    ``initialize_megatron``'s ``make`` needs, so the run would exit. Call before ``pretrain()``."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # a source checkout: let Megatron-LM compile it
    dataset_utils.compile_helpers = lambda: None


# --- the epoch arithmetic of a resume (training.checks.resume.epoch_problems) ---


def epoch_layout(tokens_per_epoch: int, num_samples: int, seq_length: int, extra: int = 1):
    """``(epochs, separate final epoch)`` of the index megatron-core 0.19.2's ``GPTDataset``
    builds for ``num_samples`` windows of ``seq_length`` tokens (+ ``extra``, its
    ``add_extra_token_to_sequence``) over a split of ``tokens_per_epoch`` tokens: its
    ``_get_num_epochs``, and the 0.80 threshold of ``_build_document_sample_shuffle_indices``.
    Its documents are shuffled by these two: the same windows, in the same order, iff equal."""
    config = SimpleNamespace(sequence_length=seq_length, add_extra_token_to_sequence=extra)
    stand_in = SimpleNamespace(num_samples=num_samples, config=config)
    epochs = GPTDataset._get_num_epochs(stand_in, tokens_per_epoch)
    if epochs == 1:
        return 1, False
    sans_final = ((epochs - 1) * tokens_per_epoch - extra) // seq_length
    per_epoch = (tokens_per_epoch - extra) // seq_length
    return epochs, num_samples - sans_final < int(0.80 * per_epoch)


def train_split_tokens(prefix: str, split: str) -> int:
    """Tokens of the training split of the dataset ``prefix`` under ``--split``: its sequences
    ``[round(a * n), round(b * n))`` of the first row of megatron-core's split matrix
    (``BlendedMegatronDatasetBuilder``), summed from the ``.idx`` (not the ``.bin``)."""
    reader = _IndexReader(prefix + ".idx", False)  # its arrays view its mmap: keep it open
    lengths = reader.sequence_lengths
    n = float(lengths.shape[0])
    (a, b), *_ = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    total = int(lengths[int(round(a * n)) : int(round(b * n))].sum())
    del lengths, reader
    return total
