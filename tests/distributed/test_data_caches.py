"""Index caches and the token-id check on 2 gloo processes: a shared cache directory and
two "nodes" with a cache directory each, built once per directory, never seen half-written;
a bad data file found by the launcher's datasets provider inside ``pretrain()`` is one
``error:`` line and status 2 on every rank."""

import contextlib
import io
import os

import numpy as np
import pytest
import torch

from tests.distributed.harness import run_distributed

VOCAB = 64


def write_dataset(prefix, documents):
    """Megatron .bin/.idx of ``documents`` (lists of ids) through megatron-core's builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for doc in documents:
        builder.add_document(torch.tensor(doc, dtype=torch.int32), [len(doc)])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def random_documents(n, seed=0):
    """``n`` documents of 5 to 39 random ids and the EOD id (``VOCAB - 1``)."""
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, VOCAB - 1, rng.integers(5, 40))) + [VOCAB - 1] for _ in range(n)]


def _build(prefix, cache, local_rank):
    from tests.unit.test_data_boundary import null_tokenizer
    from tst_megatron.data.gpt_datasets import DataSettings, build_datasets

    os.environ["LOCAL_RANK"] = str(local_rank)
    tok = null_tokenizer(VOCAB)
    data = DataSettings(data_path=prefix, split="90,10,0", data_cache_path=cache)
    train, valid, _ = build_datasets(data, tok, seq_length=16, samples=(60, 8, 0), seed=1)
    files = sorted(os.listdir(cache))
    # TST's sample orders: written once per cache directory, mapped by every rank
    from tst_megatron.data import stream as stream_module

    writes, write = [], stream_module.write_cache
    stream_module.write_cache = lambda *a: (writes.append(1), write(*a))
    try:
        stream = stream_module.open_stream(
            train,
            windows_per_sample=2,
            phase1_samples=10,
            seed=1,
            cache_dir=cache,
            local_rank=local_rank,
        )
    finally:
        stream_module.write_cache = write
    return {
        # megatron-core maps a cache it loads (np.memmap); what it computed is in memory
        "built": not isinstance(train.shuffle_index, np.memmap),
        "tokens": torch.stack([train[i]["tokens"] for i in range(len(train))]),
        "files": files,
        "stream_built": bool(writes),
        "stream_mapped": isinstance(stream.blocks, np.memmap),
        "stream": torch.stack(
            [stream.phase1_sample(i)["tokens"][::16] for i in range(10)]
            + [stream.phase2_sample(i)["tokens"][:2] for i in range(10)]
        ),
    }


def _child(rank, world, *, prefix, bad_prefix, root):
    import torch.distributed as dist

    from tst_megatron.data.gpt_datasets import check_data_files
    from tst_megatron.errors import ConfigError

    out = {}
    shared = os.path.join(root, "shared")
    out["shared"] = _build(prefix, shared, local_rank=rank)  # one node, 2 ranks
    out["shared_again"] = _build(prefix, shared, local_rank=rank)
    own = os.path.join(root, f"node{rank}")  # 2 nodes of 1 rank, each its own disk
    out["node_local"] = _build(prefix, own, local_rank=0)
    out["node_local_again"] = _build(prefix, own, local_rank=0)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.barrier()
    # token ids: the first start reads half of the .bin on each rank, rank 0 stamps it
    check_data_files(prefix, VOCAB, cache_path=shared)
    dist.barrier()
    out["stamps"] = sorted(n for n in os.listdir(shared) if n.endswith(".token-range.json"))
    try:
        check_data_files(bad_prefix, VOCAB, cache_path=shared)
        out["bad"] = None
    except ConfigError as exc:
        out["bad"] = str(exc)
    # the same through the launcher at TP=2, found by its datasets provider inside
    # pretrain(): one line from rank 0, status 2 on every rank
    from megatron.training.training import destroy_global_state

    from tst_megatron.training.cli import main

    argv = [
        *("--device", "cpu", "--data-path", bad_prefix, "--data-cache-path", shared),
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)),
        *("--tensor-model-parallel-size", "2", "--seq-length", "16"),
        *("--max-position-embeddings", "16", "--num-layers", "2", "--hidden-size", "32"),
        *("--num-attention-heads", "4", "--micro-batch-size", "2", "--train-iters", "4"),
        *("--tst-bag-size", "2", "--tst-phase1-iters", "2", "--lr", "1e-3"),
        *("--eval-interval", "2", "--split", "80,10,10"),
    ]
    err, code = io.StringIO(), None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code
    destroy_global_state()
    errors = [line for line in err.getvalue().splitlines() if "error:" in line]
    out["main"] = (code, errors)  # (not the warnings of Megatron-LM's first imports)
    return out


@pytest.mark.slow
def test_index_caches_shared_and_node_local(tmp_path):
    prefix = write_dataset(tmp_path / "data", random_documents(300))
    docs = random_documents(300)
    docs[-1][-2] = -1  # in rank 1's half of the .bin
    bad = write_dataset(tmp_path / "bad", docs)
    ranks = run_distributed(_child, 2, prefix=prefix, bad_prefix=bad, root=str(tmp_path))
    r0, r1 = ranks
    # shared: built once (rank 0), read by rank 1; then read by both
    assert (r0["shared"]["built"], r1["shared"]["built"]) == (True, False)
    assert not r0["shared_again"]["built"] and not r1["shared_again"]["built"]
    # node-local: each node's local rank 0 builds its own; then both read
    assert r0["node_local"]["built"] and r1["node_local"]["built"]
    assert not r0["node_local_again"]["built"] and not r1["node_local_again"]["built"]
    for key in ("shared", "node_local", "node_local_again"):
        assert torch.equal(r0[key]["tokens"], r1[key]["tokens"])
        assert torch.equal(r0[key]["tokens"], r0["shared"]["tokens"])
    # TST's sample orders: written by the same ranks, mapped everywhere, the same samples
    assert (r0["shared"]["stream_built"], r1["shared"]["stream_built"]) == (True, False)
    assert r0["node_local"]["stream_built"] and r1["node_local"]["stream_built"]
    for key in ("shared_again", "node_local_again"):
        assert not r0[key]["stream_built"] and not r1[key]["stream_built"]
    for key in ("shared", "shared_again", "node_local", "node_local_again"):
        assert r0[key]["stream_mapped"] and r1[key]["stream_mapped"]
        assert torch.equal(r0[key]["stream"], r1[key]["stream"])
        assert torch.equal(r0[key]["stream"], r0["shared"]["stream"])
    stream_files = {
        d: sorted(n for n in os.listdir(tmp_path / d) if "-TrainStream-" in n)
        for d in ("shared", "node0", "node1")
    }
    assert len(stream_files["shared"]) == 5  # order0, blocks, phase2, checks, description
    assert stream_files["shared"] == stream_files["node0"] == stream_files["node1"]
    # every cache file complete, no temporary or probe file left
    assert r0["node_local"]["files"] == r1["node_local"]["files"] == r0["shared"]["files"]
    assert len([n for n in r0["shared"]["files"] if n.endswith(".npy")]) == 6  # train, valid
    for d in ("shared", "node0", "node1"):
        assert [n for n in os.listdir(tmp_path / d) if n.startswith(".")] == []
    assert r0["stamps"] == r1["stamps"] and len(r0["stamps"]) == 1
    assert r0["bad"] == r1["bad"] and "bad.bin holds token id -1, outside" in r0["bad"]
    assert r0["main"] == (2, [f"error: {line}" for line in r0["bad"].splitlines()])
    assert r1["main"] == (2, []), r1["main"]


def _failing_child(rank, world, *, prefix, root, fail):
    """Each rank opens the TST stream of a shared cache directory; one rank fails."""
    from tests.unit.test_data_boundary import null_tokenizer
    from tst_megatron.data import stream as stream_module
    from tst_megatron.data.gpt_datasets import DataSettings, build_datasets
    from tst_megatron.errors import ConfigError

    os.environ["LOCAL_RANK"] = str(rank)
    cache = os.path.join(root, fail)
    data = DataSettings(data_path=prefix, split="90,10,0", data_cache_path=cache)
    train, _, _ = build_datasets(
        data, null_tokenizer(VOCAB), seq_length=16, samples=(60, 8, 0), seed=1
    )
    if fail == "builder" and rank == 0:  # rank 0 builds a shared directory: a full disk

        def full_disk(*args):
            raise OSError(28, "No space left on device")

        stream_module.write_cache = full_disk
    if fail == "reader" and rank == 1:  # rank 1 reads: the files not visible to it yet
        stream_module.cache_problem = lambda files, description: "x.npy is missing"
    try:
        stream_module.open_stream(
            train, windows_per_sample=2, phase1_samples=10, seed=1, cache_dir=cache, local_rank=rank
        )
        return None
    except ConfigError as exc:
        return str(exc)


@pytest.mark.parametrize("fail", ["builder", "reader"])
def test_a_rank_failing_to_build_or_read_the_orders_stops_every_rank(tmp_path, fail):
    """No rank is left waiting at the barrier: every rank raises the failing rank's error."""
    prefix = write_dataset(tmp_path / "data", random_documents(300))
    ranks = run_distributed(_failing_child, 2, prefix=prefix, root=str(tmp_path), fail=fail)
    expected = {
        "builder": "OSError: [Errno 28] No space left on device",
        "reader": "TST sample-order cache x.npy is missing; delete it (or the whole "
        "--data-cache-path directory) and restart to rebuild it",
    }[fail]
    assert ranks == [expected, expected]
