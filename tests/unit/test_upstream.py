"""The one address of the workarounds for megatron-core 0.19.2 (:mod:`tst_megatron.upstream`):
every entry points at code that exists and at a test file that exists, the upstream code each
answers is still in the installed release (its probe: fails on an upgrade that changes it),
and the workarounds the project's modules describe as such are listed."""

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


@pytest.mark.parametrize(
    "entry", [w for w in upstream.WORKAROUNDS if w.probe], ids=lambda w: w.where.split(".")[-1]
)
def test_the_upstream_code_each_workaround_answers_is_still_there(entry):
    """Fails once the installed megatron-core / Megatron-LM no longer has the code a workaround
    answers: rerun the entry's test without the workaround, and delete it if upstream fixed it."""
    import inspect

    where, fragment = entry.probe
    source = inspect.getsource(_resolve(where))
    assert fragment in source, (
        f"{where} no longer has {fragment!r}: upstream changed the code behind "
        f"{entry.where} ({entry.symptom}); rerun {entry.test} without it"
    )


def test_every_workaround_but_the_cpu_runtime_has_a_probe():
    # the CPU redirections have their own version check (cpu.check_version, test_compat.py)
    without = sorted(w.where.split(".")[-1] for w in upstream.WORKAROUNDS if not w.probe)
    assert without == ["enable"], without


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
