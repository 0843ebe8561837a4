"""The public launch scripts of :mod:`tests.e2e.mlm_launch_scripts`, shrunk to 2 CPU gloo
processes (:data:`~tests.e2e.mlm_launch_scripts.SHRUNK`: the same flags with sizes cut and the
flags a CPU run cannot take dropped, each named with its reason), train 4 iterations through
the TST switch at 2 in Megatron-LM's own loop (``pretrain()`` through the launcher's ``main``,
in-process in spawned children: :func:`tests.distributed.test_megatron_lm._pretrain_child`).

Measured (``pytest --durations=0`` on 2 cores shared with other jobs, load average 20-30):
gpt-oss 183 s, DeepSeek-V3 177 s, GPT-3 145 s, Llama 3 132 s, Mixtral 79 s, Qwen3 59 s, the
local files 70 s; at load average 4, GPT-3 25 s (local files 8 s) and the torchrun test 25 s.
All training tests are ``slow``. Two torch_dist saves (the switch and the
end) are a large share of each run."""

from __future__ import annotations

import math
import re

import pytest

from tests.e2e import mlm_launch_scripts as scripts

pytest.importorskip("megatron.training")

#: One ``training_log`` line: its iteration and the ``key: value`` fields after it.
_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
_FIELD = re.compile(r"\s*([a-z][a-z_0-9 -]*?):\s+([0-9.E+-]+)\s*$")


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
    files = {k: f"/files/{k}" for k in ("sp", "sp_data", "vocab", "merges", "hf", "bpe_data")}
    argv = scripts.shrunk(name, files, "/tmp/run")
    flags = [w for w in entry["script"]["argv"] if w.startswith("--")]
    kept = [f for f in flags if f not in entry["drop"]]
    added = ["--tst-phase1-iters", "--device"] + entry.get("add", [])
    assert [w for w in argv if w.startswith("--") and w not in added] == kept


@pytest.mark.slow  # 1.5-6 minutes each on 2 busy cores (see the module docstring)
@pytest.mark.parametrize("name", sorted(scripts.SHRUNK))
def test_shrunk_script_trains_through_the_switch_on_2_cpu_processes(name, local_files, tmp_path):
    from tests.distributed.harness import run_distributed
    from tests.launcher import pretrain_child as _pretrain_child

    argv = scripts.shrunk(name, local_files, str(tmp_path))
    (first,), (last,) = run_distributed(_pretrain_child, 2, runs=[argv])  # main() returned
    lines = logged(last)
    assert sorted(lines) == [1, 2, 3, 4], last[-3000:]
    for i in (1, 2):  # phase 1: the multi-hot cross-entropy, no next-token loss
        assert "lm loss" not in lines[i] and math.isfinite(lines[i]["mce loss"]), lines[i]
        assert lines[i]["mce loss"] > 0
    for i in (3, 4):  # phase 2: the next-token loss (and DeepSeek-V3's MTP loss)
        assert math.isfinite(lines[i]["lm loss"]) and lines[i]["lm loss"] > 0, lines[i]
        if "--mtp-num-layers" in argv:
            assert math.isfinite(lines[i]["mtp_1 loss"]) and lines[i]["mtp_1 loss"] > 0
    if name == "gpt3_175b":  # its --step-batch-size-schedule, shrunk to "0:2 128:4"
        assert {i: lines[i]["consumed samples"] for i in lines} == {1: 2, 2: 4, 3: 8, 4: 12}
    assert "TST: phase 1 (bags) from iteration 0, until 2" in first
    assert "TST: phase 2 (next-token) from iteration 2 (switch at 2)" in first
    assert first.count("TST: phase 2") == 1
    assert re.findall(r"validation loss at iteration (\d+) \|", last) == ["2", "4"]
    # the script's --save: the switch checkpoint (TST) and pretrain()'s final one (GPT-3's
    # schedule changes the batch at the switch too, and Megatron-LM's train() saves on a
    # change of the micro-batch count: iteration 2 once more)
    saved = [int(i) for i in re.findall(r"saving checkpoint at iteration\s+(\d+) to", first)]
    assert saved == ([2, 2, 4] if name == "gpt3_175b" else [2, 4]), first[-3000:]


@pytest.mark.slow
def test_shrunk_script_under_torchrun_exits_0(tmp_path):
    """The launcher as a user starts it: ``torchrun --nproc_per_node 2
    examples/pretrain_gpt_tst.py`` with the shrunk Llama 3 8B line (mock data)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = scripts.shrunk("llama3_8b_fp8", {}, str(tmp_path))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", "examples/pretrain_gpt_tst.py", *argv]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-5000:]
    lines = logged(result.stdout)
    assert sorted(lines) == [1, 2, 3, 4], result.stdout[-3000:]
    assert all(math.isfinite(lines[i]["mce loss"]) for i in (1, 2))
    assert all(math.isfinite(lines[i]["lm loss"]) for i in (3, 4))
    assert "TST: phase 2 (next-token) from iteration 2 (switch at 2)" in result.stdout
