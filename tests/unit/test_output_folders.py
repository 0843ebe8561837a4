"""Every folder a run writes is probed before any work (``tst_megatron/training/checks/
outputs.py``): Megatron-LM 0.19.2 finds a read-only ``--save`` only at its first save, after
training up to it. The read-only folder is a read-only tmpfs (``mount -t tmpfs -o ro``; as
root, ``chmod 555`` is no test); skipped where this process cannot mount one."""

from __future__ import annotations

import contextlib
import io
import subprocess

import pytest

pytest.importorskip("megatron.training")

from tests.unit.test_checkpoint_input import DRY  # noqa: E402


@contextlib.contextmanager
def tmpfs(folder, options: str):
    """A tmpfs mounted at ``folder`` with ``options`` (skips the test where mount fails)."""
    folder.mkdir(exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def _dry(argv) -> tuple[int, str, str]:
    from tst_megatron.training.dry_run import dry_run

    out, err = io.StringIO(), io.StringIO()
    status = dry_run(argv, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_a_read_only_save_is_one_line_in_the_dry_run_and_at_launch(tmp_path, run_launcher):
    with tmpfs(tmp_path / "ro", "ro,size=1M") as ro:
        save, tb = str(ro / "ck"), str(ro)
        status, _, err = _dry(DRY + ["--save", save, "--save-interval", "2"])
        (line,) = _errors(err)
        assert status == 2 and f"--save {save} (its parent {ro}) cannot be written" in line, err
        assert "Read-only file system" in line, line
        done = run_launcher(*DRY, "--save", save, "--save-interval", "2", "--tensorboard-dir", tb)
        errors = _errors(done.stderr)
        assert done.returncode == 2, done.stderr[-3000:]
        assert len(errors) == 2, errors
        assert f"error: --save {save} cannot be created (Read-only file system)" in errors[0]
        assert f"error: --tensorboard-dir {tb} cannot be written" in errors[1], errors
        assert "building GPT model" not in done.stdout and "Traceback" not in done.stderr


def test_a_save_on_a_too_small_filesystem_is_a_note_of_the_dry_run(tmp_path):
    with tmpfs(tmp_path / "small", "size=64k") as small:
        status, out, _ = _dry(DRY + ["--save", str(small / "ck"), "--save-interval", "2"])
        assert status == 0, out
        notes = [x for x in out.splitlines() if "free there, below one checkpoint" in x]
        assert len(notes) == 1 and "MiB" in notes[0], out
    # where there is room: no note
    status, out, _ = _dry(DRY + ["--save", str(tmp_path / "ck"), "--save-interval", "2"])
    assert status == 0 and "below one checkpoint" not in out, out


def test_the_probe_creates_and_removes_and_names_what_fails(tmp_path):
    from tst_megatron.training.checks.outputs import probe

    target = tmp_path / "a" / "b"
    assert probe(str(target), create=False) == "is not a folder"
    assert probe(str(target), create=True) is None and list(target.iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert probe(str(blocker / "sub"), create=True).startswith("cannot be created")


def test_a_dry_run_names_the_output_folders_it_cannot_probe_here(tmp_path):
    status, out, _ = _dry(DRY + ["--tensorboard-dir", "/nowhere/on/this/machine/tb"])
    assert status == 0, out
    assert "assumed: not here, so not probed for writing: /nowhere/on/this/machine/tb" in out
