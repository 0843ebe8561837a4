"""No conversion deletes or overwrites a checkpoint, its input, or anything but its own output.

Each case runs ``tools/convert_checkpoint.py`` as a user would, on folders laid out as
Megatron-LM writes them (the guard runs before the checkpoint is read, so the shards' bytes
need not be real), and checks one ``error:`` line, exit status 2, and every file still there
byte for byte. A real run's checkpoint goes through the same cases in
``tests/distributed/test_conversion_mlm.py``.
"""

import contextlib
import hashlib
import importlib.util
import io
import os

import pytest

from tst_megatron.conversion import hf_files, output

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*argv):
    """``tools/convert_checkpoint.py`` run in this process: ``(status, stdout, stderr)``."""
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", os.path.join(ROOT, "tools", "convert_checkpoint.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = tool.main([str(a) for a in argv])
    return status, out.getvalue(), err.getvalue()


def snapshot(folder):
    """``{relative path: sha256}`` of every file under ``folder``, and every folder."""
    files = {}
    for root, dirs, names in os.walk(folder):
        for d in dirs:
            files[os.path.relpath(os.path.join(root, d), folder) + "/"] = "dir"
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                files[os.path.relpath(os.path.join(root, n), folder)] = hashlib.sha256(
                    f.read()
                ).hexdigest()
    return files


def make_checkpoint(root):
    """A Megatron-LM ``--save`` root: tracker, two ``iter_*`` with ``.distcp`` shards."""
    os.makedirs(root)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("6")
    for it in (4, 6):
        d = os.path.join(root, f"iter_{it:07d}")
        os.makedirs(d)
        for name in ("__0_0.distcp", "__1_0.distcp", "common.pt", ".metadata"):
            with open(os.path.join(d, name), "wb") as f:
                f.write(os.urandom(64))
    return root


def make_export(folder):
    """A previous export's files (as :func:`hf_files.write_hf_dir` writes them)."""
    os.makedirs(folder)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        with open(os.path.join(folder, name), "w") as f:
            f.write("{}")
    return folder


def _refused(status, stderr, *words):
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --save "), stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("force", [False, True])
def test_export_onto_its_own_checkpoint_is_refused_and_loses_nothing(tmp_path, force):
    ck = make_checkpoint(str(tmp_path / "ck"))
    make_export(str(tmp_path / "ck_other" / "hf1"))  # other exports in a parent
    before, others = snapshot(str(tmp_path / "ck")), snapshot(str(tmp_path / "ck_other"))
    extra = ["--force"] if force else []
    cases = [
        (["--load", ck, "--save", ck], "holds --load"),  # the case
        (["--load", ck + "/iter_0000006", "--save", ck], "holds --load"),  # an ancestor
        (["--load", ck, "--save", str(tmp_path)], "holds --load"),  # the root above it
        (["--load", ck, "--save", ck + "/hf"], "inside --load"),  # into the checkpoint
        (["--load", ck, "--save", ck + "/iter_0000004"], "inside --load"),
        (["--load", ck + "/iter_0000004", "--save", ck + "/iter_0000006"], "holds a Megatron"),
        (["--load", ck, "--save", str(tmp_path / "ck_other")], "files an export does not"),
    ]
    for argv, words in cases:
        status, _, stderr = _cli("export", *argv, *extra)
        _refused(status, stderr, words)
        assert snapshot(ck) == before and snapshot(str(tmp_path / "ck_other")) == others, argv
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck_other"]  # no temporary left behind


def test_another_runs_checkpoint_and_files_are_never_replaced(tmp_path):
    a = make_checkpoint(str(tmp_path / "a"))
    b = make_checkpoint(str(tmp_path / "b"))
    user = tmp_path / "notes"
    user.mkdir()
    (user / "README").write_text("mine")
    release = tmp_path / "rel"  # a weights-only checkpoint not made by our import
    os.makedirs(release / "release")
    (release / "latest_checkpointed_iteration.txt").write_text("release")
    keep = {p: snapshot(p) for p in (b, str(user), str(release))}
    for save, words in ((b, "holds a Megatron checkpoint (iter_0000004)"), (str(user), "(README)"),
                        (str(release), "holds a Megatron checkpoint")):  # fmt: skip
        _refused(*_cli("export", "--load", a, "--save", save, "--force")[::2], words)
        _refused(*_cli("import", "--load", a, "--save", save, "--force")[::2], words)
    assert {p: snapshot(p) for p in keep} == keep
    # a file where a folder is to go
    (tmp_path / "file").write_text("x")
    _refused(*_cli("export", "--load", a, "--save", tmp_path / "file", "--force")[::2], "not a")


def test_import_onto_its_own_hugging_face_input_is_refused(tmp_path):
    src = make_export(str(tmp_path / "hfmodel"))
    before = snapshot(src)
    for save in (src, str(tmp_path), src + "/megatron"):
        _refused(*_cli("import", "--load", src, "--save", save, "--force")[::2], "--load")
    assert snapshot(src) == before


def test_force_replaces_only_a_previous_output(tmp_path):
    previous = make_export(str(tmp_path / "hf"))
    with pytest.raises(FileExistsError, match=r"\(a previous export\); pass --force"):
        output.check_output(previous, reads={}, force=False, kind="export")
    output.check_output(previous, reads={}, force=True, kind="export")  # allowed
    # an export is not an import, and an import's folder is not an export
    with pytest.raises(output.RefusedOutput, match="files an import does not write"):
        output.check_output(previous, reads={}, force=True, kind="import")
    imported = tmp_path / "imp"
    os.makedirs(imported / "release")
    (imported / "latest_checkpointed_iteration.txt").write_text("release")
    (imported / output.IMPORT_MARKER).write_text("imported from x")
    output.check_output(str(imported), reads={}, force=True, kind="import")
    with pytest.raises(output.RefusedOutput, match="holds a Megatron checkpoint"):
        output.check_output(str(imported), reads={}, force=True, kind="export")
    # an import that a run then saved into is a checkpoint: refused
    os.makedirs(imported / "iter_0000002")
    with pytest.raises(output.RefusedOutput, match=r"holds a Megatron checkpoint \(iter_"):
        output.check_output(str(imported), reads={}, force=True, kind="import")
    # an empty folder is filled without --force; a shard export is recognised by its files
    (tmp_path / "empty").mkdir()
    output.check_output(str(tmp_path / "empty"), reads={}, force=False, kind="export")
    sharded = make_export(str(tmp_path / "sharded"))
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (tmp_path / "sharded" / name).write_text("x")
    output.check_output(sharded, reads={}, force=True, kind="export")


def test_forced_export_replaces_a_previous_export_atomically(tmp_path):
    """``write_hf_dir`` with ``force`` swaps the folder in whole; a tokenizer inside the
    folder it replaces is refused (it is read); no temporary stays behind."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    out = str(tmp_path / "hf")
    hf_files.write_hf_dir(out, config, {"a": __import__("torch").zeros(2)})
    first = snapshot(out)
    assert oct(os.stat(out).st_mode & 0o077) != "0o0"  # not mkdtemp's 0700
    hf_files.write_hf_dir(out, config, {"a": __import__("torch").ones(2)}, force=True)
    assert snapshot(out).keys() == first.keys() and snapshot(out) != first
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    with pytest.raises(output.RefusedOutput, match="holds --tokenizer-model"):
        output.check_output(
            out,
            reads={"--tokenizer-model": os.path.join(out, "t.model")},
            force=True,
            kind="export",
        )


def test_a_checkpoint_before_the_switch_is_named_as_a_phase_1_model():
    """The export's note (``tools/convert_checkpoint.py`` prints it): a checkpoint of a TST
    run before N1 holds a model trained on bags only."""
    from tests.unit.test_dry_run import SMALL
    from tst_megatron.conversion import _phase1_position
    from tst_megatron.loop.plan import run_plan
    from tst_megatron.training.validate import check

    args = check(SMALL, dry_run=True).args
    n1 = run_plan(args).n1
    assert n1 > 1
    assert _phase1_position(args, f"ck/iter_{n1 - 1:07d}") == (n1 - 1, n1)
    assert _phase1_position(args, f"ck/iter_{n1:07d}/") is None  # the switch: phase 2's model
    assert _phase1_position(args, "ck/release") is None
    args.tst_bag_size = None  # not a TST run
    assert _phase1_position(args, "ck/iter_0000001") is None
