"""The run plan (:class:`tst_megatron.loop.plan.RunPlan`) is built once per launch: the
launch checks, the dry run's report, the datasets provider and the forward step all read the
same object, and its counts are Megatron-LM's (checked against plain arithmetic here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.training")

from tests.launcher import BASE, ROOT  # noqa: E402

#: In a child process (the launch enables the CPU runtime and Megatron-LM's globals): the
#: launcher's main() with pretrain() replaced by a recorder, the launch rules wrapped to see
#: what they get; then the dry run with its report wrapped. Prints the identities as JSON.
CHILD = r"""
import json, sys
from unittest import mock
from tst_megatron.training import checks, cli, dry_run, validate
import megatron.training.training as training

seen = {}
real_problems = checks.launch_problems
def rules(launch):
    seen.setdefault("checks", []).append(launch.plan)
    return real_problems(launch)
def pretrain(cfg, datasets, model_type, forward_step, model_provider=None):
    seen["datasets"], seen["forward"] = datasets.plan, forward_step.plan
real_describe = dry_run.describe
def describe(args, plan, *pattern):
    seen["dry run"] = plan
    seen["dry run checks"] = seen["checks"][-1]
    return real_describe(args, plan, *pattern)
argv = json.loads(sys.argv[1])
with mock.patch.object(validate, "launch_problems", rules), \
        mock.patch.object(training, "pretrain", pretrain):
    cli.main(argv)
    launch_plan = seen["checks"][0]
    with mock.patch.object(dry_run, "describe", describe):
        assert dry_run.dry_run(argv + ["--dry-run"]) == 0
p = launch_plan
print("RESULT " + json.dumps({
    "datasets": seen["datasets"] is p,
    "forward": seen["forward"] is p,
    "dry run": seen["dry run"] is seen["dry run checks"],
    "counts": [p.n, p.n1, p.switch_sample, p.total_samples, [list(b) for b in p.global_batches]],
    "phase1": [list(b) for b in p.batches_in_phase(1)],
    "phase2": [list(b) for b in p.batches_in_phase(2)],
}))
"""


def _run(argv):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(argv)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def test_the_checks_the_dry_run_the_datasets_and_the_forward_step_share_one_plan():
    r = _run(BASE)
    assert r["datasets"] and r["forward"] and r["dry run"]
    # 6 iterations of global batch 4; N1 = 3 (--tst-phase1-iters 3)
    assert r["counts"] == [6, 3, 3 * 4, 6 * 4, [[0, 4]]]
    assert r["phase1"] == r["phase2"] == [[0, 4]]


def test_a_step_batch_size_schedule_is_counted_per_phase():
    """Global batch 4 from sample 0 and 8 from sample 20 (token 320 at --seq-length 16, in
    Megatron-LM's calculator): 5 steps of 4, then 8 per step; N1
    = 6 is one step of 8 after sample 20 (switch sample 28); 8 steps read 20 + 3 x 8 = 44."""
    argv = list(BASE) + ["--step-batch-size-schedule", "0:4 320:8"]
    i = argv.index("--global-batch-size")
    del argv[i : i + 2]
    argv[argv.index("--train-iters") + 1] = "8"
    argv[argv.index("--tst-phase1-iters") + 1] = "6"
    r = _run(argv)
    assert r["datasets"] and r["forward"]
    assert r["counts"] == [8, 6, 5 * 4 + 8, 5 * 4 + 3 * 8, [[0, 4], [20, 8]]]
    assert r["phase1"] == [[0, 4], [20, 8]] and r["phase2"] == [[20, 8]]
