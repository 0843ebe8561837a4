"""``convert_checkpoint.py import`` reads a Hugging Face folder as input that may be hostile:
every file it reads is a file of that folder (no absolute path or ``..`` in the index's
``weight_map``, no symlink leaving it), ``tokenizer.model`` must be a SentencePiece model,
and the config's sizes are checked against the safetensors headers before any model is
built (a 10^6-layer or 10^7-vocabulary config over small weights is refused at once). Each
is one line and writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("megatron.training")

from tests.unit.test_conversion_rules import _args, _megatron_state  # noqa: E402
from tst_megatron.conversion import hf, hf_files, import_checkpoint, rules  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hf_dir(folder, shard="20KB") -> str:
    """A small Qwen3-MoE Hugging Face folder, sharded (an index with a weight_map)."""
    args = _args()
    state = rules.megatron_to_hf(
        _megatron_state(args), rules.ARCHITECTURES["qwen3_moe"], hf.shapes_of(args)
    )
    hf_files.write_hf_dir(
        str(folder), hf.hf_config(args, dtype="float32"), state, max_shard_size=shard
    )
    return str(folder)


def _cli_import(hf_dir, save):
    command = [sys.executable, "tools/convert_checkpoint.py", "import", "--load", hf_dir]
    command += ["--save", save]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _edit_index(hf_dir, change):
    path = os.path.join(hf_dir, "model.safetensors.index.json")
    index = json.load(open(path))
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = change(index["weight_map"][name])
    json.dump(index, open(path, "w"))


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda f: "../" + f, "is not a file name inside the folder"),
        (lambda f: "/etc/" + f, "is not a file name inside the folder"),
    ],
)
def test_a_weight_map_entry_outside_the_folder_is_one_line_and_writes_nothing(
    tmp_path, change, words
):
    hf_dir = _hf_dir(tmp_path / "hf")
    _edit_index(hf_dir, change)
    result = _cli_import(hf_dir, str(tmp_path / "out"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1 and words in errors[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_a_shard_symlinked_out_of_the_folder_is_refused(tmp_path):
    hf_dir = _hf_dir(tmp_path / "hf")
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(os.path.join(hf_dir, shard), outside)
    os.symlink(outside, os.path.join(hf_dir, shard))
    with pytest.raises(ValueError, match="leads outside"):
        hf_files.read_hf_dir(hf_dir)


def test_a_symlinked_or_false_tokenizer_is_one_line_and_writes_nothing(tmp_path):
    hf_dir = _hf_dir(tmp_path / "hf")
    private = tmp_path / "private.key"
    private.write_text("SECRET")
    private.chmod(0o600)
    os.symlink(private, os.path.join(hf_dir, "tokenizer.model"))
    result = _cli_import(hf_dir, str(tmp_path / "out"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "leads outside" in errors[0], result.stderr
    assert not (tmp_path / "out").exists()
    os.unlink(os.path.join(hf_dir, "tokenizer.model"))
    with open(os.path.join(hf_dir, "tokenizer.model"), "w") as f:
        f.write("not a model")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        import_checkpoint(hf_dir, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("num_hidden_layers", 10**6, "says num_hidden_layers 1000000, but the weights hold 2"),
        ("vocab_size", 10**7, "says vocab_size 10000000 x hidden_size 24"),
    ],
)
def test_a_config_larger_than_its_weights_is_refused_at_once_without_a_model(
    tmp_path, monkeypatch, field, value, words
):
    hf_dir = _hf_dir(tmp_path / "hf")
    path = os.path.join(hf_dir, "config.json")
    config = json.load(open(path))
    config[field] = value
    json.dump(config, open(path, "w"))
    from tst_megatron import conversion

    def no_model(ns):
        raise AssertionError("a model was built")

    monkeypatch.setattr(conversion, "build_model", no_model)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=words):
        import_checkpoint(hf_dir, str(tmp_path / "out"))
    # "at once": not a walk over 10^6 layers or 10^7 rows (minutes); the margin is for a machine
    # busy with another test worker
    assert time.perf_counter() - start < 10.0
    assert not (tmp_path / "out").exists()


def test_the_moe_layer_frequency_is_found_in_linear_time():
    """Against the plain search (every n from 1, the first whose every-n-th layers are the
    MoE layers), then at 10^6 layers."""
    for layers in range(1, 13):
        for sparse in ([], [0], [1], list(range(0, layers, 2)), list(range(0, layers, 3))):
            sparse = [i for i in sparse if i < layers]
            plain = next(
                (f for f in range(1, layers + 1) if sparse == list(range(0, layers, f))), None
            )
            assert hf.moe_layer_freq(sparse, layers) == plain, (layers, sparse)
        assert hf.moe_layer_freq([0, 2, 3], layers) is None
    start = time.perf_counter()
    assert hf.moe_layer_freq(list(range(0, 10**6, 4)), 10**6) == 4
    # the plain search is quadratic: hours at 10^6 layers; the margin is for a busy machine
    assert time.perf_counter() - start < 10.0
