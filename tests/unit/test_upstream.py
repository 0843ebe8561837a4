"""The one address of the workarounds for megatron-core 0.19.2 (:mod:`tst_megatron.upstream`):
every entry points at code that exists and at a test file that exists, and the workarounds
the project's modules describe as such are listed."""

from __future__ import annotations

import importlib
import os

import pytest

pytest.importorskip("megatron.core")

from tst_megatron import upstream  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("entry", upstream.WORKAROUNDS, ids=lambda w: w.where.split(".")[-1])
def test_each_entry_points_at_code_and_a_test(entry):
    assert _resolve(entry.where) is not None
    assert os.path.isfile(os.path.join(ROOT, entry.test)), entry.test
    assert entry.symptom


def test_every_class_or_function_called_a_workaround_is_listed():
    """A docstring that says "Workaround" names code that :data:`WORKAROUNDS` must list."""
    listed = {w.where for w in upstream.WORKAROUNDS}
    found = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "tst_megatron")):
        for name in files:
            if not name.endswith(".py"):
                continue
            module = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
            mod = importlib.import_module(module.removesuffix(".__init__"))
            for attr, obj in vars(mod).items():
                doc = getattr(obj, "__doc__", None) or ""
                same_module = getattr(obj, "__module__", None) == mod.__name__
                if same_module and callable(obj) and "Workaround:" in doc:
                    found.add(f"{mod.__name__}.{attr}")
    assert found, "no docstring marks a workaround"
    assert found <= listed, sorted(found - listed)
