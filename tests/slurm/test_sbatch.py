"""slurm/pretrain_tst_moe.sbatch submitted to a real Slurm (one node, 2 CPUs) with sbatch --wait.

The CPU variant of the template (``TST_DEVICE=cpu``, GPU resources overridden on the sbatch
command line) trains a tiny MoE GPT with EP=2 on 2 srun tasks through the TST switch:
  - uninterrupted, it finishes, writes checkpoints (at the switch and the end), TensorBoard
    events and a log per job name;
  - preempted (``scancel --batch --signal=USR1``, what ``--signal=B:USR1@N`` delivers) in
    phase 1, it saves at the end of the current step, requeues itself, resumes in phase 1 at
    the right data position, crosses the switch and ends with the uninterrupted run's losses.
The tasks run Megatron-LM's own loop (``examples/pretrain_gpt_tst.py``). The ``line`` variant
submits a user's own launch line as the template's arguments (the public Llama 3 8B line of
``tests/e2e/mlm_launch_scripts.py``, shrunk to a CPU, 40 iterations, the switch at 20): the
template adds only --exit-signal-handler and reads the line's own --save. The reference is
the uninterrupted run's own log, printed by Megatron-LM's ``training_log`` to 7 digits; a
resumed run that replays or skips data, or restores a wrong phase or optimizer state, prints
different numbers (resume is exact on CPU, see tests/distributed/test_megatron_lm.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.local_cluster import LocalSlurm, Unavailable

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "slurm" / "pretrain_tst_moe.sbatch"
N, N1 = 40, 20  # iterations; the switch
TINY = {  # the template's variables: a 2-layer MoE GPT, EP=2, TST S=4 for the first half
    "TST_DEVICE": "cpu",
    "PYTHON": sys.executable,
    "TST_ROOT": str(REPO),
    "VOCAB_SIZE": "128",
    "NUM_LAYERS": "2",
    "HIDDEN_SIZE": "64",
    "NUM_ATTENTION_HEADS": "4",
    "FFN_HIDDEN_SIZE": "128",
    "SEQ_LENGTH": "64",
    "NUM_EXPERTS": "4",
    "MOE_FFN_HIDDEN_SIZE": "64",
    "MOE_ROUTER_TOPK": "2",
    "TP": "1",
    "PP": "1",
    "EP": "2",
    "CP": "1",
    "MICRO_BATCH_SIZE": "2",
    "GLOBAL_BATCH_SIZE": "4",
    "TRAIN_ITERS": str(N),
    "TST_BAG_SIZE": "4",
    "TST_PHASE1_FRACTION": str(N1 / N),
    "LR": "3e-3",
    "LR_WARMUP_ITERS": "2",
    "LOG_INTERVAL": "1",
    "EVAL_INTERVAL": str(N1),
    "EVAL_ITERS": "1",
    "SAVE_INTERVAL": "1000",
    "EXTRA_ARGS": "--make-vocab-size-divisible-by 64",
}
CPU_RESOURCES = [
    "--nodes=1",
    "--ntasks-per-node=2",
    "--cpus-per-task=1",
    "--gpus-per-node=0",
    "--time=15",
]
ITERATION = re.compile(  # Megatron-LM's training_log line
    r"^ \[[^\]]*\] iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|"
)
#: The launcher reports phase 1's bag loss as "mce loss" and phase 2's as "lm loss"
#: (Megatron-LM keeps printing "mce loss: 0" after the switch).
PHASE2_LOSS, PHASE1_LOSS = re.compile(r"\| lm loss: (\S+) \|"), re.compile(r"\| mce loss: (\S+) \|")
SWITCH = f"TST: phase 2 (next-token) from iteration {N1} (switch at {N1})"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    slurm = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        slurm.start()
    except Unavailable as exc:
        slurm.stop()
        pytest.skip(f"no local Slurm cluster: {exc}")
    yield slurm
    slurm.stop()


#: The template's settings per variant: as a HybridModel, and with megatron-core's distributed
#: optimizer (every published MoE recipe's setting; its resume is megatron-core's
#: ``dp_reshardable`` checkpoint, mended by ``tst_megatron.upstream.distributed_optimizer_resume``).
#: The template's own line as it is (the plain optimizer) is not submitted on its own: both
#: variants run it with one change each, the ``line`` variant runs the GPT launcher with the
#: plain optimizer, and ``tests/slurm/test_template.py`` checks the line itself (each pair of
#: Slurm jobs costs about 85 s).
VARIANTS = {
    # megatron-core's HybridModel: the same 2 MoE blocks as 4 layers, the hybrid launcher
    "hybrid": {"HYBRID_LAYER_PATTERN": "*E*E"},
    "distopt": {
        "EXTRA_ARGS": TINY["EXTRA_ARGS"]
        + " --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
    },
}


def users_line(workdir: Path) -> list:
    """The ``line`` variant's arguments: the launcher and a public Megatron-LM line (Llama 3 8B,
    shrunk: :func:`tests.e2e.mlm_launch_scripts.shrunk`) at this test's length, its --save and
    --load in ``workdir/mine/ckpt``."""
    from tests.e2e.mlm_launch_scripts import shrink, shrunk

    argv = shrunk("llama3_8b_fp8", {}, str(workdir / "mine"))
    length = {"--train-samples": str(4 * N), "--lr-decay-samples": str(4 * N)}
    length |= {"--tst-phase1-iters": str(N1), "--eval-interval": str(N1), "--save-interval": "1000"}
    return [str(REPO / "examples" / "pretrain_gpt_tst.py"), *shrink(argv, length)]


def submit(
    cluster: LocalSlurm, workdir: Path, name: str, variant: str
) -> tuple[subprocess.Popen, str]:
    """``sbatch --wait`` the template as job ``name`` from ``workdir`` with the settings of
    ``variant`` (:data:`VARIANTS`; ``line``: :func:`users_line` as its arguments and none of
    its variables); returns (sbatch, job id)."""
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    line = users_line(workdir) if variant == "line" else []
    variables = (
        {k: TINY[k] for k in ("PYTHON", "TST_ROOT")} if line else {**TINY, **VARIANTS[variant]}
    )
    env = cluster.env(**variables, RUNS_DIR=str(workdir / "runs"))
    proc = subprocess.Popen(
        ["sbatch", "--parsable", "--wait", f"--job-name={name}", *CPU_RESOURCES, str(TEMPLATE)]
        + line,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    job_id = proc.stdout.readline().strip().split(";")[0]
    if not job_id.isdigit():
        proc.kill()
        pytest.fail(f"sbatch did not submit: {job_id!r} {proc.stderr.read()}")
    return proc, job_id


def finish(
    cluster: LocalSlurm, proc: subprocess.Popen, job_id: str, log: Path, timeout: float = 300
) -> str:
    """Wait for ``sbatch --wait``; fail with the log if the job failed; return the log text."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        cluster.run("scancel", job_id, check=False)
        proc.kill()
        pytest.fail(f"job {job_id} still running after {timeout} s:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert proc.returncode == 0, f"job {job_id} failed ({proc.returncode}):\n{text[-3000:]}"
    return text


def iterations(log: str) -> dict:
    """``{iteration: (consumed samples, loss string)}``; each iteration must appear once, with
    the phase-1 loss up to ``N1`` and the next-token loss after."""
    seen = {}
    for line in log.splitlines():
        match = ITERATION.match(line)
        if match:
            it, total, samples = map(int, match.groups())
            assert it not in seen, f"iteration {it} was trained twice"
            assert total == N
            loss = (PHASE1_LOSS if it <= N1 else PHASE2_LOSS).search(line)
            assert loss, f"iteration {it} has no {'mce' if it <= N1 else 'lm'} loss: {line}"
            if it <= N1:
                assert not PHASE2_LOSS.search(line), line
            seen[it] = (samples, loss.group(1))
    return seen


@pytest.fixture(scope="module", params=sorted(VARIANTS) + ["line"])
def uninterrupted(cluster, tmp_path_factory, request):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    start = time.monotonic()
    proc, job_id = submit(cluster, workdir, "tst-a", request.param)
    text = finish(cluster, proc, job_id, workdir / "logs" / f"tst-a-{job_id}.out")
    return workdir, job_id, text, time.monotonic() - start, request.param


def test_tst_run_through_the_switch(cluster, uninterrupted):
    workdir, job_id, text, seconds, variant = uninterrupted
    print(f"uninterrupted job ({variant}): {seconds:.1f} s")
    # both srun tasks joined one world (Slurm's variables exported under torchrun's names)
    assert "using world size: 2, data-parallel size: 2," in text
    script = "pretrain_hybrid_tst.py" if variant == "hybrid" else "pretrain_gpt_tst.py"
    assert f"launcher examples/{script}," in text
    assert ("GPTModel IS DEPRECATED" in text) == (variant != "hybrid")  # megatron-core's warning
    steps = iterations(text)
    assert sorted(steps) == list(range(1, N + 1))
    assert steps[N][0] == N * 4  # global batch 4
    assert f"TST: phase 1 (bags) from iteration 0, until {N1}" in text and SWITCH in text
    assert float(steps[N][1]) < float(steps[N1 + 1][1])  # it learns in phase 2
    mine = variant == "line"  # the line's own --save and --tensorboard-dir
    ckpt = workdir / "mine" / "ckpt" if mine else workdir / "runs" / "tst-a" / "checkpoints"
    assert (workdir / "runs").exists() != mine  # nothing of the job's folder for the line
    assert sorted(p.name for p in ckpt.iterdir()) == [
        f"iter_{N1:07d}",
        f"iter_{N:07d}",
        "latest_checkpointed_iteration.txt",
        "tst_exit.json",
    ]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(N)
    assert '"status": "finished"' in (ckpt / "tst_exit.json").read_text()
    assert "(finished); latest checkpoint" in text  # the script read the launcher's marker
    tensorboard = workdir / "mine" / "tb" if mine else workdir / "runs" / "tst-a" / "tensorboard"
    assert list(tensorboard.glob("events.out.tfevents.*"))
    assert cluster.job_field(job_id, "JobState") == "COMPLETED"
    assert cluster.job_field(job_id, "Restarts") == "0"


def task_pids(cluster, job_id: str) -> list[int]:
    """The job's training tasks (step 0's processes with a task id), from ``scontrol listpids``."""
    rows = [
        line.split() for line in cluster.run("scontrol", "listpids", job_id).stdout.splitlines()
    ]
    pids = [int(r[0]) for r in rows[1:] if len(r) == 5 and r[2] == "0" and r[3] != "-"]
    assert len(pids) == 2, rows  # 2 srun tasks
    return pids


def wait_for_pending(pids: list[int], signum: int, deadline: float) -> None:
    """Wait until ``signum`` is pending in each of ``pids`` (``SigPnd``/``ShdPnd``, proc(5))."""
    bit = 1 << (signum - 1)
    while True:
        pending = []
        for pid in pids:
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            )
            pending.append(bool((int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)) & bit))
        if all(pending):
            return
        assert time.monotonic() < deadline, f"signal {signum} not pending in {pids}: {pending}"
        time.sleep(0.05)


def test_preempted_job_requeues_and_matches_uninterrupted_run(cluster, uninterrupted, tmp_path):
    _, _, reference_text, _, variant = uninterrupted
    reference = iterations(reference_text)
    start = time.monotonic()
    proc, job_id = submit(cluster, tmp_path, "tst-b", variant)
    log = tmp_path / "logs" / f"tst-b-{job_id}.out"
    deadline = time.monotonic() + 180  # the preemption notice, once training is under way
    while not (log.exists() and re.search(r"^ \[[^\]]*\] iteration\s+2/", log.read_text(), re.M)):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(
                f"job {job_id} did not reach iteration 2:\n{log.read_text()[-3000:] if log.exists() else ''}"
            )
        time.sleep(0.1)
    # Phase 1 lasts under a second here (40 ms a step) and the notice travels scancel -> the
    # script's trap -> scancel -> the tasks: on a busy machine that took 17 steps. So the tasks
    # are held (SIGSTOP) until the SIGTERM the notice becomes is pending in each, then let go.
    tasks = task_pids(cluster, job_id)
    for pid in tasks:
        os.kill(pid, signal.SIGSTOP)
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    try:
        wait_for_pending(tasks, signal.SIGTERM, deadline=time.monotonic() + 120)
    finally:
        for pid in tasks:
            with contextlib.suppress(ProcessLookupError):  # a task that died: its own failure
                os.kill(pid, signal.SIGCONT)
    text = finish(cluster, proc, job_id, log)
    print(f"preempted + requeued job: {time.monotonic() - start:.1f} s")

    first, second = text.split("start 2:", 1)  # the requeued run's header
    assert "exiting program after receiving SIGTERM" in first, first[-3000:]
    saved = re.search(r"successfully saved checkpoint from iteration\s+(\d+) ", first)
    assert saved, first[-3000:]
    k = int(saved.group(1))
    assert 2 <= k < N1, f"the signal should land in phase 1 (before {N1}), it landed after {k}"
    assert "requeueing job" in first
    loaded = second.index("successfully loaded checkpoint from")
    assert re.search(rf"successfully loaded checkpoint from .* at iteration {k}\b", second)
    assert second.index(f"TST: phase 1 (bags) from iteration {k}, until {N1}") > loaded
    assert second.index(SWITCH) > loaded
    steps = iterations(text)
    assert sorted(steps) == list(range(1, N + 1))  # each step once: no replay, no gap
    assert max(iterations(first)) == k
    # Megatron-LM's training_log prints a run's first iteration without resetting its sums, so
    # the line after it (iteration k + 2) is the mean of iterations k + 1 and k + 2 (as lines 1
    # and 2 of every run): compare that one line with the reference's mean, the rest exactly.
    # Resumed at N1 - 1, iterations k + 1 and k + 2 log different keys (mce, lm): each halved.
    samples, printed = steps.pop(k + 2)
    if k + 1 == N1:
        expected = float(reference[k + 2][1]) / 2
    else:
        expected = (float(reference[k + 1][1]) + float(reference[k + 2][1])) / 2
    assert samples == reference[k + 2][0]
    assert abs(float(printed) - expected) <= 2e-6 * expected, (printed, expected)
    assert steps == {i: v for i, v in reference.items() if i != k + 2}, (
        "losses or consumed samples differ from the uninterrupted run"
    )
    print(
        f"preempted after iteration {k}; final lm loss {steps[N][1]} (requeued) vs "
        f"{reference[N][1]} (uninterrupted)"
    )
    assert steps[N][1] == reference[N][1]
    assert cluster.job_field(job_id, "JobState") == "COMPLETED"
    assert cluster.job_field(job_id, "Restarts") == "1"
