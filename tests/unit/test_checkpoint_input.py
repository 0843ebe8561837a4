"""A checkpoint is read as input, never as code, and a damaged one is one line before any work
(``tst_megatron/data/checkpoint.py``, the launch's ``_checkpoints`` stage, the converter).

The planted pickles call ``os.system("touch <file>")``; the first test shows that reading them
the way Megatron-LM 0.19.2 and torch 2.13 do (``pickle.load`` of DCP's ``.metadata``,
``torch.load(weights_only=False)`` of a byte object) creates the file, so every "nothing was
written" below can fail. The checkpoints are written with torch's own ``dcp.save`` /
``torch.save`` in the layouts Megatron-LM writes (``tests/distributed/test_checkpoint_damage.py``
damages and resumes real ones).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import pickle
import shlex
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.training")

from tests.launcher import ROOT  # noqa: E402


class Plant:
    """Unpickled, it runs ``touch path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.path)}",))


def _saved(obj) -> io.BytesIO:
    data = io.BytesIO()
    torch.save(obj, data)
    data.seek(0)
    return data


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"seq_length": 16, "tst_bag_size": 2, **kw})


def write_torch_dist(folder, *, iteration=1, common=None, extra=None):
    """A ``torch_dist`` folder as megatron-core 0.19.2 writes it: DCP entries (tensors, and
    each ``ShardedObject`` as a byte object holding ``torch.save`` output, the common state as
    ``common_state/shard_0_1`` = ``[dict]``) plus ``metadata.json``."""
    import torch.distributed.checkpoint as dcp

    common = common if common is not None else {"args": _args(), "iteration": iteration}
    state = {
        "decoder.weight": torch.arange(64.0).reshape(8, 8),
        "optimizer.exp_avg": torch.ones(256),
        "common_state/shard_0_1": _saved([common]),
        "rng_state/shard_0_1": _saved([{"random_rng_state": (1, 2, 3)}]),
        **(extra or {}),
    }
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return folder


def write_torch(folder, *, iteration=1, payload=None):
    """A legacy ``torch`` folder: ``mp_rank_00/model_optim_rng.pt`` (and ``distrib_optim.pt``)."""
    (folder / "mp_rank_00").mkdir(parents=True)
    state = {"args": _args(), "iteration": iteration, "model": {"w": torch.ones(4)}}
    torch.save({**state, **(payload or {})}, folder / "mp_rank_00" / "model_optim_rng.pt")
    return folder


def write_torch_dcp(folder, *, iteration=1, args=None):
    """A ``torch_dcp`` folder (``dcp.save`` of Megatron-LM's state dict: ``args`` and
    ``iteration`` as top-level byte objects)."""
    import torch.distributed.checkpoint as dcp

    state = {"args": args if args is not None else _args(), "iteration": iteration}
    dcp.save({**state, "model": {"w": torch.ones(4)}}, checkpoint_id=str(folder), no_dist=True)
    return folder


def root_with(tmp_path, make, iterations=(1,), tracker=None):
    """A ``--save`` root holding ``iter_<i>`` made by ``make(folder, iteration=i)``."""
    root = tmp_path / "ckpt"
    for i in iterations:
        make(root / f"iter_{i:07d}", iteration=i)
    text = str(max(iterations)) if tracker is None else tracker
    (root / "latest_checkpointed_iteration.txt").write_text(text)
    return root


def _load_args(root, **kw):
    return argparse.Namespace(load=str(root), ckpt_step=None, finetune=False, **kw)


def _plant_metadata(folder, flag):
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(Plant(flag), f)


#: name -> how to build a root whose checkpoint at iteration 1 holds a planted pickle.
CRAFTED = {
    "torch_dist .metadata": lambda tmp, flag: _plant_metadata(
        write_torch_dist(tmp / "ckpt" / "iter_0000001"), flag
    ),
    "torch_dist common state": lambda tmp, flag: write_torch_dist(
        tmp / "ckpt" / "iter_0000001", common={"args": Plant(flag), "iteration": 1}
    ),
    "torch_dist another byte object": lambda tmp, flag: write_torch_dist(
        tmp / "ckpt" / "iter_0000001", extra={"rerun_state/shard_0_1": _saved([Plant(flag)])}
    ),
    "torch model_optim_rng.pt": lambda tmp, flag: write_torch(
        tmp / "ckpt" / "iter_0000001", payload={"rng_state": [Plant(flag)]}
    ),
    "torch_dcp .metadata": lambda tmp, flag: _plant_metadata(
        write_torch_dcp(tmp / "ckpt" / "iter_0000001"), flag
    ),
    "torch_dcp args": lambda tmp, flag: write_torch_dcp(
        tmp / "ckpt" / "iter_0000001", args=Plant(flag)
    ),
}


def _crafted(tmp_path, name):
    flag = tmp_path / "code_ran"
    CRAFTED[name](tmp_path, flag)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
    assert not flag.exists()  # writing it ran nothing
    return tmp_path / "ckpt", flag


def test_the_planted_pickles_run_code_when_read_as_megatron_lm_and_torch_read_them(tmp_path):
    """The reference: DCP's ``read_metadata`` (bare ``pickle.load``) and a byte object read
    with ``weights_only=False`` (``DefaultLoadPlanner.load_bytes``) run the planted command."""
    from torch.distributed.checkpoint import FileSystemReader

    root, flag = _crafted(tmp_path, "torch_dist .metadata")
    with contextlib.suppress(Exception):
        FileSystemReader(str(root / "iter_0000001")).read_metadata()
    assert flag.exists()
    flag.unlink()
    other = tmp_path / "other"
    other.mkdir()
    root, flag = _crafted(other, "torch_dist common state")
    data = _saved([{"args": Plant(flag)}])
    torch.load(data, weights_only=False)
    assert flag.exists()


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_a_crafted_checkpoint_is_one_line_naming_the_global_and_runs_nothing(tmp_path, name):
    """Each format's planted pickle: the launch's checkpoint stage and every read of the resume
    rules refuse it in one line naming ``posix.system`` and ``--trust-checkpoint``; the dry
    run prints that line; nothing ran."""
    from tst_megatron.data.resume import checkpoint_folder, checkpoint_to_resume
    from tst_megatron.errors import ConfigError
    from tst_megatron.training.dry_run import dry_run

    root, flag = _crafted(tmp_path, name)
    for read in (checkpoint_folder, checkpoint_to_resume):
        with pytest.raises(ConfigError) as refused:
            read(_load_args(root))
        (line,) = str(refused.value).splitlines()
        assert f"--load {root}" in line and "posix.system" in line, line
        assert "--trust-checkpoint" in line, line
    err = io.StringIO()
    argv = DRY + ["--load", str(root)]
    assert dry_run(argv, out=io.StringIO(), err=err) == 2
    errors = [x for x in err.getvalue().splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "posix.system" in errors[0], err.getvalue()
    assert not flag.exists(), name


@pytest.mark.parametrize("name", ["torch_dist .metadata", "torch model_optim_rng.pt"])
def test_use_checkpoint_args_reads_nothing_before_the_scan(tmp_path, name):
    """``--use-checkpoint-args`` makes Megatron-LM's ``load_args_from_checkpoint`` read the
    checkpoint inside argument validation (unrestricted for DCP's ``.metadata``): the launch's
    checkpoint stage runs before it."""
    from tst_megatron.training.dry_run import dry_run

    root, flag = _crafted(tmp_path, name)
    err = io.StringIO()
    argv = DRY + ["--load", str(root), "--use-checkpoint-args"]
    assert dry_run(argv, out=io.StringIO(), err=err) == 2
    errors = [x for x in err.getvalue().splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "posix.system" in errors[0], err.getvalue()
    assert not flag.exists(), name


#: A tiny CPU launch line for in-process dry runs.
DRY = [
    "--device", "cpu", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--train-iters", "6", "--lr", "1e-3", "--eval-interval", "6",
    "--eval-iters", "1", "--num-workers", "0",
    "--tst-bag-size", "2", "--tst-phase1-iters", "3",
]  # fmt: skip


@pytest.mark.parametrize("make", [write_torch_dist, write_torch, write_torch_dcp])
def test_a_real_checkpoint_of_each_format_is_intact_and_its_common_state_reads(tmp_path, make):
    from tst_megatron.data.checkpoint import inspect, read_common_state
    from tst_megatron.data.resume import checkpoint_to_resume

    root = root_with(tmp_path, make, iterations=(1, 2))
    folder = str(root / "iter_0000002")
    assert inspect(folder) is None and inspect(folder, crc=True) is None
    iteration, common = checkpoint_to_resume(_load_args(root))
    assert iteration == 2 and common["iteration"] == 2 and common["args"] == _args()
    assert read_common_state(folder)["format"] == make.__name__.removeprefix("write_")


def test_trust_checkpoint_reads_what_the_scan_refuses(tmp_path):
    """``--trust-checkpoint`` (the user made the file): no scan, Megatron-LM's own reads."""
    from tst_megatron.data.resume import checkpoint_folder

    root, flag = _crafted(tmp_path, "torch_dist .metadata")
    with contextlib.suppress(Exception):  # the planted object is no DCP Metadata
        checkpoint_folder(_load_args(root, trust_checkpoint=True))
    assert flag.exists()


def _truncate(folder):
    shard = next(folder.glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)


def _overwrite(offset):
    def damage(folder):
        shard = next(folder.glob("*.distcp"))
        with open(shard, "r+b") as f:
            f.seek(offset)
            f.write(b"\xde\xad\xbe\xef" * 2)

    return damage


#: damage to the newest checkpoint (iteration 3 of 1-3) -> a fragment of the one line.
DAMAGE = {
    ".metadata deleted": (lambda f: (f / ".metadata").unlink(), ".metadata is missing"),
    "metadata.json deleted": (
        lambda f: (f / "metadata.json").unlink(),
        "metadata.json is missing (its entries are a torch_dist checkpoint's)",
    ),
    "shard truncated": (_truncate, "bytes its entries need (truncated)"),
    "shard header overwritten": (_overwrite(0), "is damaged (BadZipFile"),
    "shard deleted": (lambda f: next(f.glob("*.distcp")).unlink(), "is missing (4 entries"),
    "folder emptied": (
        lambda f: [p.unlink() for p in list(f.iterdir())],
        "no checkpoint Megatron-LM reads is in it",
    ),
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_a_damaged_latest_checkpoint_is_one_line_naming_the_newest_intact_one(tmp_path, name):
    from tst_megatron.data.resume import checkpoint_folder
    from tst_megatron.errors import ConfigError

    root = root_with(tmp_path, write_torch_dist, iterations=(1, 2, 3))
    damage, fragment = DAMAGE[name]
    damage(root / "iter_0000003")
    with pytest.raises(ConfigError) as refused:
        checkpoint_folder(_load_args(root))
    (line,) = str(refused.value).splitlines()
    assert "iter_0000003 (the tracker file's checkpoint) is damaged" in line, line
    assert fragment in line, line
    assert "the newest intact checkpoint is iter_0000002" in line, line
    assert "--ckpt-step 2" in line, line
    # the flag it names resumes the intact one
    assert checkpoint_folder(_step(root, 2))[0] == 2


def _step(root, step):
    return argparse.Namespace(load=str(root), ckpt_step=step, finetune=False)


def test_tracker_and_folders_that_disagree_are_one_line(tmp_path):
    """A tracker naming a missing iteration, a garbage tracker, and a partial newer folder a
    killed save leaves (never named as intact)."""
    from tst_megatron.data.resume import checkpoint_folder
    from tst_megatron.errors import ConfigError

    root = root_with(tmp_path, write_torch_dist, iterations=(1, 2), tracker="7")
    with pytest.raises(ConfigError, match=r"iter_0000007 \(the tracker file's checkpoint\) does "
                       r"not exist; the newest intact checkpoint is iter_0000002"):  # fmt: skip
        checkpoint_folder(_load_args(root))
    (root / "latest_checkpointed_iteration.txt").write_text("x2")
    with pytest.raises(ConfigError, match="holds 'x2', not an iteration; the newest intact"):
        checkpoint_folder(_load_args(root))
    # a killed save of iteration 3: only a shard, no .metadata; the tracker still says 2
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    partial = root / "iter_0000003"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 100)
    assert checkpoint_folder(_load_args(root)) == (2, str(root / "iter_0000002"))
    # iteration 2 damaged too: the partial 3 is not offered
    (root / "iter_0000002" / ".metadata").unlink()
    with pytest.raises(ConfigError, match="the newest intact checkpoint is iter_0000001"):
        checkpoint_folder(_load_args(root))
    # nothing intact at all
    (root / "iter_0000001" / ".metadata").unlink()
    with pytest.raises(ConfigError, match="no intact checkpoint is in .* or start without"):
        checkpoint_folder(_load_args(root))


def test_bytes_changed_inside_a_tensor_are_found_by_their_crc_in_the_dry_run(tmp_path):
    """torch.load does not check a record's CRC-32, so such damage would resume as other
    numbers; reading every entry (the dry run and the converter) finds it, the launch's
    structural check does not (it reads no tensor data on every rank)."""
    from tst_megatron.data.checkpoint import inspect, read_dcp_metadata

    folder = write_torch_dist(tmp_path / "iter_0000001")
    metadata = read_dcp_metadata(str(folder))
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "optimizer.exp_avg")
    _overwrite(info.offset + info.length // 2)(folder)  # inside the tensor's 1 KiB of data
    assert inspect(str(folder)) is None
    problem = inspect(str(folder), crc=True)
    assert "optimizer.exp_avg" in problem and "CRC-32" in problem, problem


def test_any_exception_while_reading_is_one_line_never_a_traceback(tmp_path, monkeypatch):
    from tst_megatron.data import resume
    from tst_megatron.errors import ConfigError

    root = root_with(tmp_path, write_torch_dist)

    def boom(*a, **k):
        raise KeyError("surprise")

    monkeypatch.setattr(resume, "read_common_state", boom)
    with pytest.raises(ConfigError, match=r"iter_0000001 could not be read \(KeyError"):
        resume.checkpoint_to_resume(_load_args(root))
    monkeypatch.setattr(resume, "_inspected", boom)
    with pytest.raises(ConfigError, match=r"the checkpoint could not be read \(KeyError"):
        resume.checkpoint_folder(_step(tmp_path / "nothing_here", 1))


def test_the_converter_refuses_a_crafted_checkpoint_in_one_line(tmp_path):
    root, flag = _crafted(tmp_path, "torch_dist .metadata")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "export",
         "--load", str(root), "--save", str(tmp_path / "hf")],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300,
    )  # fmt: skip
    errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert "posix.system" in errors[0] and "--trust-checkpoint" in errors[0], errors
    assert "Traceback" not in done.stderr and not flag.exists()
    assert not (tmp_path / "hf").exists()


def test_the_converter_names_the_newest_intact_checkpoint_of_a_damaged_one(tmp_path):
    from tst_megatron.conversion import export_checkpoint
    from tst_megatron.errors import ConfigError

    root = root_with(tmp_path, write_torch_dist, iterations=(1, 2))
    _truncate(root / "iter_0000002")
    with pytest.raises(ConfigError, match="truncated.*iter_0000001: use it with --ckpt-step 1"):
        export_checkpoint(str(root), str(tmp_path / "hf"))


def _sha(folder) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _hidden(folder) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_conversion_that_fails_in_the_rename_leaves_no_temporary_and_the_previous_output(
    tmp_path, monkeypatch
):
    """A failure planted in the final rename (EBUSY, as ``--save .`` gave), an exception while
    writing, and the SystemExit a SIGTERM handler raises: no hidden folder is left, the
    previous export stays, the input is unchanged."""
    import transformers

    from tst_megatron.conversion import hf_files, output

    config = transformers.LlamaConfig(
        vocab_size=8, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    weights = {"model.embed_tokens.weight": torch.ones(8, 4)}
    source = tmp_path / "source.pt"
    torch.save(weights, source)
    before = hashlib.sha256(source.read_bytes()).hexdigest()
    out = tmp_path / "hf"
    hf_files.write_hf_dir(str(out), config, weights)
    previous = _sha(out)
    real = os.replace

    def busy(src, dst):
        if os.path.basename(str(src)).startswith(".hf.tmp-"):
            raise OSError(16, "Device or resource busy")
        return real(src, dst)

    monkeypatch.setattr(output.os, "replace", busy)
    with pytest.raises(OSError, match="busy"):
        hf_files.write_hf_dir(str(out), config, weights, force=True)
    monkeypatch.setattr(output.os, "replace", real)
    assert _hidden(tmp_path) == [] and _sha(out) == previous
    for failure in (RuntimeError("disk"), SystemExit(143)):
        with pytest.raises(type(failure)):
            with output.building(str(out)) as tmp:
                (tmp_path / tmp / "config.json").write_text("{}")
                raise failure
        assert _hidden(tmp_path) == [] and _sha(out) == previous
    assert hashlib.sha256(source.read_bytes()).hexdigest() == before


def test_an_empty_save_or_one_holding_the_current_folder_is_one_line(tmp_path, monkeypatch):
    from tst_megatron.conversion.output import RefusedOutput, check_output

    with pytest.raises(RefusedOutput, match="--save is empty"):
        check_output("", reads={"--load": str(tmp_path)}, force=True, kind="export")
    previous = tmp_path / "hf"
    previous.mkdir()
    (previous / "config.json").write_text("{}")
    monkeypatch.chdir(previous)
    with pytest.raises(RefusedOutput, match="holds the current folder"):
        check_output(".", reads={"--load": str(tmp_path / "ck")}, force=True, kind="export")


def test_an_empty_metadata_pointing_torch_at_a_rank_metadata_file_is_refused(tmp_path):
    """A ``.metadata`` that unpickles to a falsy object (an empty ``OrderedDict`` with the
    attributes torch reads) makes torch's DCP reader fall back to ``__0.metadata``, read with
    plain ``pickle`` (torch 2.13 ``state_dict_loader``): every ``__*.metadata`` is scanned and
    ``.metadata`` must be DCP ``Metadata``. Found by a review of this change."""
    from collections import OrderedDict

    from tst_megatron.data.checkpoint import UnsafeCheckpoint, inspect

    folder = tmp_path / "iter_0000001"
    folder.mkdir()
    empty = OrderedDict()
    empty.state_dict_metadata, empty.storage_data = {}, {}
    (folder / ".metadata").write_bytes(pickle.dumps(empty, protocol=2))
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    assert "not torch's DCP Metadata" in inspect(str(folder))
    flag = tmp_path / "code_ran"
    (folder / "__0.metadata").write_bytes(pickle.dumps(Plant(flag), protocol=2))
    with pytest.raises(UnsafeCheckpoint, match="posix.system"):
        inspect(str(folder))
    assert not flag.exists()


def test_a_pickle_before_a_zip_in_a_byte_object_is_scanned_as_torch_reads_it(tmp_path):
    """``zipfile`` accepts data before a zip; ``torch.load`` takes such bytes for its pre-1.6
    format and unpickles the leading pickle (``weights_only=False`` in DCP's ``load_bytes``).
    Found by a review of this change."""
    from tst_megatron.data.checkpoint import UnsafeCheckpoint, scan_torch_save

    flag = tmp_path / "code_ran"
    polyglot = pickle.dumps(Plant(flag), protocol=2) + _saved({"a": 1}).getvalue()
    with pytest.raises(UnsafeCheckpoint, match="posix.system"):
        scan_torch_save(io.BytesIO(polyglot), "entry")
    assert not flag.exists()


def test_the_folder_checked_is_the_one_megatron_lm_loads(tmp_path):
    """Megatron-LM 0.19.2's ``_load_base_checkpoint``: a truthy ``--ckpt-step`` applies to
    ``--pretrained-checkpoint`` too, ``--ckpt-step 0`` is ignored, and a newer global
    non-persistent checkpoint wins. Found by a review of this change."""
    from tst_megatron.data.resume import checkpoint_folder
    from tst_megatron.errors import ConfigError

    root = root_with(tmp_path, write_torch_dist, iterations=(1, 2))
    pretrained = argparse.Namespace(pretrained_checkpoint=str(root), ckpt_step=1)
    assert checkpoint_folder(pretrained, "--pretrained-checkpoint") == (
        1, str(root / "iter_0000001"),
    )  # fmt: skip
    assert checkpoint_folder(_step(root, 0)) == (2, str(root / "iter_0000002"))
    newer = root / "non_persistent"
    write_torch_dist(newer / "iter_0000003", iteration=3)
    (newer / "latest_checkpointed_iteration.txt").write_text("3")
    args = argparse.Namespace(load=str(root), ckpt_step=None, non_persistent_ckpt_type="global")
    assert checkpoint_folder(args) == (3, str(newer / "iter_0000003"))
    (newer / "iter_0000003" / ".metadata").unlink()
    with pytest.raises(ConfigError, match="non-persistent tracker's checkpoint"):
        checkpoint_folder(args)


def test_a_checkpoint_saved_with_numpy_1_is_not_called_unsafe():
    """numpy < 2 pickles arrays through ``numpy.core.multiarray._reconstruct`` (megatron-core's
    RNG state). Found by a review of this change."""
    from tst_megatron.data.checkpoint import scan_pickle

    legacy = (
        b"\x80\x02cnumpy.core.multiarray\n_reconstruct\nq\x00cnumpy\nndarray\nq\x01K\x00"
        b"\x85q\x02C\x01bq\x03\x87q\x04Rq\x05."
    )
    scan_pickle(io.BytesIO(legacy), "rng_state")


def test_the_converter_reads_a_checkpoint_without_its_common_state_in_one_line(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tst_megatron.conversion.megatron import read_args
    from tst_megatron.data.checkpoint import inspect

    folder = tmp_path / "iter_0000001"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(folder), no_dist=True)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    assert inspect(str(folder)) is None
    with pytest.raises(ValueError, match="common state could not be read .KeyError"):
        read_args(str(folder))
