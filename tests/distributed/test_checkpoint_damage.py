"""A damaged or crafted latest checkpoint of a real run stops a real launch before any work, on
1 and 2 processes: one ``error:`` line (rank 0 prints it, every rank exits with status 2, the
dry run prints the same line), naming the newest intact checkpoint and ``--ckpt-step``; no
model is built and no planted code runs. Resuming with the flag it names continues exactly as
the uninterrupted run (the loss and grad norm of the last iteration).

The damages are those an outside round reproduced (each gave a traceback, most after the model
and data were built): a deleted ``.metadata`` or ``metadata.json``, a tracker naming a missing
iteration, a truncated shard, 8 bytes overwritten at a shard's start; and a ``.metadata`` whose
pickle calls ``os.system``. ``tests/unit/test_checkpoint_input.py`` covers each format and
damage at the checker.
"""

from __future__ import annotations

import os
import pickle
import shutil

import pytest

pytest.importorskip("megatron.training")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.distributed.test_launch_errors import _launch_and_dry_run_child  # noqa: E402
from tests.launcher import BASE, NO_DROPOUT, log_lines, pretrain_child  # noqa: E402
from tests.unit.test_checkpoint_input import Plant  # noqa: E402

LINE = BASE + NO_DROPOUT + ["--ckpt-format", "torch_dist", "--save-interval", "1"]


def _truncate(folder):
    shard = folder / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)


def _overwrite_start(folder):
    shard = sorted(folder.glob("*.distcp"))[-1]
    with open(shard, "r+b") as f:
        f.write(b"\xde\xad\xbe\xef" * 2)


def _plant(folder):
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(Plant(folder.parent.parent / "code_ran"), f)


#: name -> (damage to the root's iter_0000006, fragments of the one line)
DAMAGE = {
    ".metadata deleted": (lambda f: (f / ".metadata").unlink(), [".metadata is missing"]),
    "metadata.json deleted": (lambda f: (f / "metadata.json").unlink(), ["metadata.json is"]),
    "tracker names 7": (
        lambda f: (f.parent / "latest_checkpointed_iteration.txt").write_text("7"),
        ["iter_0000007 (the tracker file's checkpoint) does not exist"],
    ),
    "shard truncated": (_truncate, ["__0_0.distcp holds", "(truncated)"]),
    "shard start overwritten": (_overwrite_start, ["is damaged (BadZipFile"]),
    "crafted .metadata": (_plant, ["posix.system", "--trust-checkpoint"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_damaged_checkpoint_is_one_line_and_the_flag_it_names_resumes_exactly(tmp_path, world):
    root = tmp_path / "run"
    (first, *_), *ranks = run_distributed(
        pretrain_child, world_size=world, runs=[LINE + ["--save", str(root)]]
    )
    last = ranks[-1][0] if ranks else first
    reference = log_lines(last, keys=("lm loss", "grad norm"))
    assert sorted(reference) == [1, 2, 3, 4, 5, 6], last[-3000:]
    cases = {}
    for name, (damage, _) in DAMAGE.items():
        copy = tmp_path / name.replace(" ", "_")
        shutil.copytree(root, copy / "ckpt")
        damage(copy / "ckpt" / "iter_0000006")
        cases[name] = LINE + ["--load", str(copy / "ckpt"), "--save", str(copy / "ckpt")]
    results = run_distributed(_launch_and_dry_run_child, world_size=world, cases=cases)
    for name, (_, fragments) in DAMAGE.items():
        status, out, err, dry_lines = results[0][name]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 2 and len(errors) == 1, (name, err[-3000:])
        assert all(f in errors[0] for f in fragments), (name, errors)
        if name == "tracker names 7":
            assert (
                "newest intact checkpoint is iter_0000006: use it with --ckpt-step 6" in errors[0]
            )
        elif name != "crafted .metadata":
            assert (
                "newest intact checkpoint is iter_0000005: use it with --ckpt-step 5" in errors[0]
            )
        assert errors == dry_lines, (name, errors, dry_lines)
        assert "Traceback" not in out + err and "building GPT model" not in out, name
        for status_r, out_r, err_r, _ in (r[name] for r in results[1:]):
            assert status_r == 2 and "error:" not in out_r + err_r, (name, err_r[-2000:])
        assert not (tmp_path / name.replace(" ", "_") / "code_ran").exists(), name
    # the flag the line names: iteration 6 trained again from iteration 5 equals the first run
    damaged = str(tmp_path / ".metadata_deleted" / "ckpt")
    resumed = run_distributed(
        pretrain_child,
        world_size=world,
        runs=[LINE + ["--load", damaged, "--save", damaged, "--ckpt-step", "5"]],
    )
    again = log_lines(resumed[-1][0], keys=("lm loss", "grad norm"))
    assert sorted(again) == [6] and again[6] == reference[6], (again, reference[6])
