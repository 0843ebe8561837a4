"""What differs between megatron-core releases, found by feature detection rather than by
version number, in one place. The supported range is ``>=0.19,<0.20``
(:data:`tst_megatron.runtime.cpu.SUPPORTED_MEGATRON_CORE`); the older answers below are kept
because they cost nothing and are tested by feature, not by version.

- The null tokenizer's library is ``"null"`` up to 0.16 and ``"null-text"`` from 0.17.
- Up to 0.17, ``NullTokenizer(n)`` has ``n + 1`` ids (it appends an EOD id); from 0.18 it has
  ``n`` ids, the last of which is EOD.

The runtime's CPU redirections (``tst_megatron.runtime.cpu``) list their own modules.
"""

from __future__ import annotations

import functools

from tst_megatron.errors import ConfigError


@functools.lru_cache(maxsize=None)
def null_tokenizer_library() -> str:
    """The ``metadata_path={"library": ...}`` name of megatron-core's null tokenizer:
    ``"null-text"`` where megatron-core knows that name (0.17+), else ``"null"``."""
    from megatron.core.tokenizers import megatron_tokenizer

    names = getattr(megatron_tokenizer, "TEXT_LIBRARIES", None) or getattr(
        megatron_tokenizer, "TOKENIZER_LIBRARIES", ()
    )
    return "null-text" if "null-text" in names else "null"


@functools.lru_cache(maxsize=None)
def null_tokenizer_adds_eod() -> bool:
    """Whether megatron-core's ``NullTokenizer(n)`` has ``n + 1`` ids (EOD appended; up to
    0.17) rather than ``n`` (the last one EOD; 0.18+). Asked of the class itself."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(2).vocab_size == 3


def null_tokenizer(vocab_size: int):
    """megatron-core's null tokenizer with exactly ``vocab_size`` ids ``0..vocab_size-1``,
    the last one EOD, in every supported release.

    Args:
        vocab_size: ids in the vocabulary (``--vocab-size``), >= 2.

    Returns:
        A ``megatron.core.tokenizers.MegatronTokenizer`` with ``vocab_size == vocab_size`` and
        ``eod == vocab_size - 1``.

    Raises:
        ConfigError: ``vocab_size < 2`` (names ``--vocab-size``).
    """
    from megatron.core.tokenizers import MegatronTokenizer

    if vocab_size < 2:
        raise ConfigError(f"--vocab-size {vocab_size} is too small for NullTokenizer; use >= 2")
    n = vocab_size - 1 if null_tokenizer_adds_eod() else vocab_size
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": null_tokenizer_library()}, vocab_size=n
    )
