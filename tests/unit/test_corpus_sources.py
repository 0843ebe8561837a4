"""The corpus builder's extra offline sources (longer horizons need more text than the stdlib)."""

import gzip
import json
import os
import sysconfig

import pytest

from tst_megatron.data import corpus
from tst_megatron.data.corpus import build_corpus


def _texts(path):
    return [json.loads(line)["text"] for line in open(path, encoding="utf-8")]


def test_sources_concatenate_in_order_and_max_bytes_stops(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "1.txt").write_text("alpha " * 10)  # 60 bytes
    (a / "2.txt").write_text("beta " * 10)  # 50 bytes
    (b / "3.md").write_text("gamma")
    stats = build_corpus([str(b), str(a)], str(tmp_path / "c.jsonl"))
    assert _texts(tmp_path / "c.jsonl") == ["gamma", "alpha " * 10, "beta " * 10]
    assert stats == {"documents": 3, "bytes": 5 + 60 + 50, "duplicates": 0, "skipped": []}
    # max_bytes stops after the document reaching the cap (65 >= 64), not before it
    stats = build_corpus([str(b), str(a)], str(tmp_path / "d.jsonl"), max_bytes=64)
    assert stats == {"documents": 2, "bytes": 65, "duplicates": 0, "skipped": []}


def test_bad_source_name_fails_before_writing(tmp_path):
    with pytest.raises(ValueError, match="'nope' is not python-stdlib, python-site-packages"):
        build_corpus(["python-stdlib", "nope"], str(tmp_path / "x.jsonl"))
    assert list(tmp_path.iterdir()) == []


def test_site_packages_reads_installed_code_without_tests(tmp_path):
    stats = build_corpus("python-site-packages", str(tmp_path / "s.jsonl"), max_documents=20)
    texts = _texts(tmp_path / "s.jsonl")
    assert stats["documents"] == 20 and all(t.strip() for t in texts)
    # the first file, found independently: sorted .py paths under purelib, no test dirs
    root = os.path.realpath(sysconfig.get_paths()["purelib"])
    first = min(
        os.path.join(d, f)
        for d, _, files in os.walk(root)
        for f in files
        if f.endswith(".py")
        and not f.startswith("__editable__")
        and not {"tests", "test", "__pycache__", "idle_test", "site-packages"}
        & set(os.path.relpath(d, root).split(os.sep))
    )
    assert texts[0] == open(first, encoding="utf-8", errors="replace").read()


def test_site_packages_skips_editable_finders_that_name_the_checkout(tmp_path, monkeypatch):
    # pip writes __editable___<project>_finder.py with the checkout's absolute path: a corpus
    # with it changes with where the project is cloned
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "mod.py").write_text("x = 1")
    (site / "__editable___proj_0_1_0_finder.py").write_text("MAPPING = {'proj': '/work/x'}")
    paths = dict(sysconfig.get_paths(), purelib=str(site), platlib=str(site))
    monkeypatch.setattr(sysconfig, "get_paths", lambda: paths)
    build_corpus("python-site-packages", str(tmp_path / "s.jsonl"))
    assert _texts(tmp_path / "s.jsonl") == ["x = 1"]


def test_system_docs_reads_plain_and_gzip_text(tmp_path):
    root = tmp_path / "doc"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "README").write_text("readme text")
    with gzip.open(root / "pkg" / "changelog.Debian.gz", "wt") as f:
        f.write("pkg (1.0) unstable; urgency=low")
    (root / "pkg" / "logo.png").write_bytes(b"\x89PNG")
    (root / "pkg" / "broken.txt.gz").write_bytes(b"not gzip")
    texts = list(corpus.system_docs_documents(str(root)))
    assert texts == ["readme text", "pkg (1.0) unstable; urgency=low"]
    with pytest.raises(ValueError, match="system-docs needs"):
        list(corpus.system_docs_documents(str(tmp_path / "missing")))


def test_unique_drops_repeated_documents_only(tmp_path):
    """``unique``: the second and later copies of a text are dropped (a licence text shipped
    by many packages), near-copies and the first copy are kept; without it all are kept."""
    src = tmp_path / "docs"
    src.mkdir()
    for name, text in [("a.txt", "GPL text"), ("b.txt", "GPL text"), ("c.txt", "GPL text.")]:
        (src / name).write_text(text)
    stats = build_corpus(str(src), str(tmp_path / "u.jsonl"), unique=True)
    assert _texts(tmp_path / "u.jsonl") == ["GPL text", "GPL text."]
    assert stats == {"documents": 2, "bytes": 17, "duplicates": 1, "skipped": []}
    build_corpus(str(src), str(tmp_path / "all.jsonl"))
    assert _texts(tmp_path / "all.jsonl") == ["GPL text", "GPL text", "GPL text."]
