"""The public launch scripts of :mod:`tests.e2e.mlm_launch_scripts`, shrunk to 2 CPU gloo
processes (:data:`~tests.e2e.mlm_launch_scripts.SHRUNK`: the same flags with sizes cut and the
flags a CPU run cannot take dropped, each named with its reason), train 4 iterations through
the TST switch at 2 in Megatron-LM's own loop (``pretrain()`` through the launcher's ``main``,
in-process in spawned children: :func:`tests.distributed.test_megatron_lm._pretrain_child`)."""

from __future__ import annotations

import math
import re

import pytest

from tests.e2e import mlm_launch_scripts as scripts

pytest.importorskip("megatron.training")

#: One ``training_log`` line: its iteration and the ``key: value`` fields after it.
_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
_FIELD = re.compile(r"\s*([a-z][a-z -]*?): ([0-9.E+-]+)\s*$")


def logged(text: str) -> dict:
    """``{iteration: {key: value}}`` from the last rank's ``training_log`` lines."""
    out = {}
    for iteration, rest in _LINE.findall(text):
        fields = (_FIELD.match(part) for part in rest.split("|"))
        out[int(iteration)] = {m.group(1): float(m.group(2)) for m in fields if m}
    return out


@pytest.fixture(scope="module")
def local_files(tmp_path_factory):
    from tests.e2e.local_data import build_local_files

    return build_local_files(str(tmp_path_factory.mktemp("launch-files")))


def test_shrink_edits_only_the_listed_flags():
    argv = ["--a", "1", "--modules", "x", "y", "--flag", "--b", "'9,1,0'", "--path", "P/ckpt"]
    out = scripts.shrink(argv, {"--a": "2", "--modules": ["z"]}, ["--flag"], {"P": "/tmp/r"})
    assert out == ["--a", "2", "--modules", "z", "--b", "'9,1,0'", "--path", "/tmp/r/ckpt"]
    with pytest.raises(KeyError):
        scripts.shrink(argv, {}, ["--absent"])


@pytest.mark.parametrize("name", sorted(scripts.SHRUNK))
def test_shrunk_script_keeps_every_other_flag_of_the_script(name):
    entry = scripts.SHRUNK[name]
    argv = scripts.shrunk(name, {}, "/tmp/run")
    flags = [w for w in entry["script"]["argv"] if w.startswith("--")]
    kept = [f for f in flags if f not in entry["drop"]]
    added = ["--tst-phase1-iters", "--device"]
    assert [w for w in argv if w.startswith("--") and w not in added] == kept


@pytest.mark.parametrize("name", sorted(scripts.SHRUNK))
def test_shrunk_script_trains_through_the_switch_on_2_cpu_processes(name, local_files, tmp_path):
    from tests.distributed.harness import run_distributed
    from tests.distributed.test_megatron_lm import _pretrain_child

    argv = scripts.shrunk(name, local_files, str(tmp_path))
    (first,), (last,) = run_distributed(_pretrain_child, 2, runs=[argv])  # main() returned
    lines = logged(last)
    assert sorted(lines) == [1, 2, 3, 4], last[-3000:]
    for i in (1, 2):  # phase 1: the multi-hot cross-entropy, no next-token loss
        assert "lm loss" not in lines[i] and math.isfinite(lines[i]["mce loss"]), lines[i]
        assert lines[i]["mce loss"] > 0
    for i in (3, 4):  # phase 2: the next-token loss
        assert math.isfinite(lines[i]["lm loss"]) and lines[i]["lm loss"] > 0, lines[i]
    assert "TST: phase 1 (bags) from iteration 0, until 2" in first
    assert "TST: phase 2 (next-token) from iteration 2 (switch at 2)" in first
    assert first.count("TST: phase 2") == 1
    assert re.findall(r"validation loss at iteration (\d+) \|", last) == ["2", "4"]
