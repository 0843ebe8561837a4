"""megatron-core's null tokenizer, as the pinned release (>=0.19,<0.20) defines it.

``NullTokenizer(n)`` has ``n`` ids, the last of which is EOD, and its library name is
``"null-text"``. The runtime's CPU redirections (``tst_megatron.runtime.cpu``) list their own
modules.
"""

from __future__ import annotations

from tst_megatron.errors import ConfigError


def null_tokenizer(vocab_size: int):
    """megatron-core's null tokenizer with exactly ``vocab_size`` ids ``0..vocab_size-1``,
    the last one EOD.

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
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=vocab_size
    )
