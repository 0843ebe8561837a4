"""Data rules: the data and tokenizer flags the launcher cannot honour or Megatron-LM stops
on after set-up, and (in a launch) the ``.bin``/``.idx`` files themselves."""

from __future__ import annotations

import os
from typing import Optional

from tst_megatron.data.files import open_data_file
from tst_megatron.data.gpt_datasets import DataSettings, data_prefixes
from tst_megatron.errors import ConfigError


def data_problems(args) -> list[str]:
    """A ``--data-args-path`` that is unreadable, no text, empty or without ``--split``
    (``validate_args`` defaults the split only for ``--data-path``), one line each. Reads that
    file. (The data flags the launcher does not honour are refused with its other refused
    flags, :data:`tst_megatron.training.flags.REFUSED_FLAGS`.) A ``--num-workers`` below 0."""
    problems = []
    path = getattr(args, "data_args_path", None)
    if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
        problems.append(f"--data-args-path {path}: no readable file there")
    elif path:
        try:
            with open(path) as f:
                words = f.read().split()
        except ValueError as exc:  # UnicodeDecodeError
            words = None
            problems.append(f"--data-args-path {path} is not a text file ({exc})")
        if words == []:
            problems.append(
                f"--data-args-path {path} is empty: it should hold what --data-path would "
                "(prefixes, optionally with weights)"
            )
        if not args.split:
            problems.append("--data-args-path needs --split (e.g. --split 969,30,1)")
    if args.num_workers < 0:
        problems.append(f"--num-workers must be 0 or more (got {args.num_workers})")
    return problems


def data_file_problems(data: Optional[DataSettings]) -> list[str]:
    """In a launch: each dataset prefix of ``--data-path`` (or ``--data-args-path``) of the
    line's ``data`` settings has a ``.bin`` and ``.idx`` that agree (:func:`open_data_file`:
    header and sizes, O(1) reads), one line per bad prefix. The token ids are scanned later,
    with the tokenizer (:func:`check_data_files`). ``data`` None (an unreadable
    ``--data-args-path``, :func:`data_problems`' line): nothing."""
    if data is None or data.mock_data:
        return []
    problems = []
    for prefix in data_prefixes(data.data_path):
        try:
            open_data_file(prefix)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


#: The files each tokenizer type reads, by flag (a Hugging Face ``--tokenizer-model`` may be
#: a hub name: not listed).
_TOKENIZER_FILES = {
    "SentencePieceTokenizer": ("--tokenizer-model",),
    "GPTSentencePieceTokenizer": ("--tokenizer-model",),
    "Llama2Tokenizer": ("--tokenizer-model",),
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
}


def tokenizer_problems(args, *, launch: bool) -> list[str]:
    """The tokenizer settings Megatron-LM's ``set_global_variables`` stops on: a type without
    its ``--vocab-size`` / ``--tokenizer-model`` (``--tokenizer-type`` defaults to
    ``GPT2BPETokenizer``, as in ``pretrain_gpt.py``), and in a
    ``launch`` (not a dry run, which may run where the cluster's files are not) a tokenizer
    file that does not exist (a Hugging Face ``--tokenizer-model`` may be a hub name)."""
    tokenizer_type = args.tokenizer_type
    if tokenizer_type == "NullTokenizer" and not (args.vocab_size and args.vocab_size >= 2):
        return [f"--tokenizer-type NullTokenizer needs --vocab-size >= 2 (got {args.vocab_size})"]
    if tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        return [
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a directory or hub name)"
        ]
    problems = []
    hf = hf_tokenizer_model(args)
    if hf and os.path.exists(hf):  # here: the dry run checks it as the launch does
        problems += hf_tokenizer_problems(
            hf, trust_remote_code=getattr(args, "trust_remote_code", False)
        )
    if not launch:
        return problems
    if hf and not os.path.exists(hf) and looks_like_a_path(hf):
        problems.append(
            f"--tokenizer-model {hf} is not a folder or file here (a Hugging Face hub name is "
            "'org/name')"
        )
    for flag in _TOKENIZER_FILES.get(tokenizer_type, ()):
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if not path or not os.path.isfile(path):
            problems.append(f"--tokenizer-type {tokenizer_type}: {flag} {path} is not a file")
    return problems


def hf_tokenizer_model(args) -> Optional[str]:
    """``--tokenizer-model`` of a ``HuggingFaceTokenizer`` (a folder, a file or a hub name),
    else None."""
    if args.tokenizer_type != "HuggingFaceTokenizer":
        return None
    return args.tokenizer_model or None


def looks_like_a_path(name: str) -> bool:
    """``name`` is meant as a path, not a hub name (``org/name`` or ``name``): it starts with
    ``/``, ``.`` or ``~``, or has more than one ``/``."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def hf_tokenizer_problems(path: str, *, trust_remote_code: bool = False) -> list[str]:
    """A Hugging Face tokenizer folder or file on this machine that ``transformers``'
    ``AutoTokenizer`` cannot load from local files, as megatron-core's
    ``HuggingFaceTokenizer`` would at set-up (one line). Loaded with
    ``trust_remote_code=False``: a tokenizer that needs its own code is not run here (with
    ``--trust-remote-code`` the load is left to the launch). Nothing when ``transformers`` is
    not installed (megatron-core then names it)."""
    if trust_remote_code:
        return []
    try:
        # transformers: heavy, imported when used
        from transformers import AutoTokenizer
    except ImportError:
        return []
    try:
        AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # any failure to load is the user's one line
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        return [
            f"--tokenizer-model {path}: Hugging Face's AutoTokenizer cannot load it here "
            f"({type(exc).__name__}: {why})"
        ]
    return []


def problems(launch) -> list[str]:
    """The data and tokenizer rules of a :class:`~tst_megatron.training.checks.Launch`."""
    return data_problems(launch.args) + tokenizer_problems(launch.args, launch=launch.launch)


def file_problems(launch) -> list[str]:
    """The data files (:func:`data_file_problems`): in a launch; in a dry run when they are on
    this machine (it may run where the cluster's files are not: :func:`files_not_here`)."""
    if launch.launch or not files_not_here(launch.args, launch.data):
        return data_file_problems(launch.data)
    return []


def files_not_here(args, data: Optional[DataSettings]) -> list[str]:
    """The data (``.bin``/``.idx``) and tokenizer files of the line (``args`` and their
    ``data`` settings; None: an unreadable ``--data-args-path``) that are not on this machine:
    what a dry run cannot check (its ``assumed:`` line names them)."""
    missing, prefixes = [], []
    unread = [getattr(args, "data_args_path", None) or "--data-path"]
    if data is None:  # an unreadable --data-args-path: the data rules report it
        missing = [path for path in unread if not os.path.isfile(path)]
    elif not data.mock_data and data.data_path:
        try:
            prefixes = data_prefixes(data.data_path)
        except (ValueError, AssertionError, ConfigError):  # the data rules report it
            missing = unread
    for prefix in prefixes:
        missing += [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    for flag in _TOKENIZER_FILES.get(args.tokenizer_type, ()):
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if path and not os.path.isfile(path):
            missing.append(path)
    hf = hf_tokenizer_model(args)
    if hf and not os.path.exists(hf) and looks_like_a_path(hf):
        missing.append(hf)
    return missing


def hub_tokenizer(args) -> Optional[str]:
    """A Hugging Face ``--tokenizer-model`` that is not on this machine and reads as a hub
    name: what a dry run cannot check (its ``assumed:`` line names it)."""
    hf = hf_tokenizer_model(args)
    if hf and not os.path.exists(hf) and not looks_like_a_path(hf):
        return hf
    return None
