"""Command-line flags from dataclass fields: the ``--tst-*`` flags are generated from
:class:`~tst_megatron.superposition.schedule.TSTConfig`, so a flag, its choices and its help
text cannot drift from the field they set."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import typing
from typing import Literal, Optional


def flag_name(name: str, *, prefix: str = "", negate: bool = False) -> str:
    """``("bag_size", prefix="tst-")`` -> ``"--tst-bag-size"``; ``negate`` gives ``--no-...``."""
    return "--" + ("no-" if negate else "") + prefix + name.replace("_", "-")


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict:
    """The docstring under each field of dataclass ``cls`` (the help text of its flag), with
    whitespace collapsed and ``%`` escaped for argparse: ``{field name: text}``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split()).replace("%", "%%")
    return docs


def unwrap(hint):
    """``Optional[X]`` -> ``X``; any other type hint unchanged."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


@functools.lru_cache(maxsize=None)
def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


def field_choices(cls, name: str) -> Optional[tuple]:
    """The values field ``name`` of dataclass ``cls`` may take (its ``Literal[...]``), or
    None when it is not a choice."""
    hint = unwrap(_type_hints(cls)[name])
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None
