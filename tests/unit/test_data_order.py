"""What the training batches contain, checked on an index-coded corpus.

Every token of the corpus is a distinct id, so a window is known by its first token and two
windows are adjacent in the text when the first one's last label is the second one's first
token. The properties are of the batches, not of the code that makes them:
- phase 1 reads contiguous ``S*T``-token samples;
- phase 2 reads the windows phase 1 left, each once before any repeats, in an order whose
  micro-batches hold adjacent windows no more often than chance (phase 2 on the old code
  served the ``S`` windows of each unused block back to back: at ``S = 4`` three pairs in
  four were adjacent);
- the order is the same on every DP rank, after a resume and with ``--num-workers``;
- a blend's phase-1 samples are contiguous text of one dataset.
"""

import itertools

import numpy as np
import pytest
import torch

from tests.unit.test_data_boundary import write_dataset
from tst_megatron.training.config import DataArgs
from tst_megatron.training.data import BatchLayout, TrainStream, build_datasets, build_tokenizer

T = 8
CPU = torch.device("cpu")


def index_coded_documents(n_docs, first_id=0, seed=0):
    """Documents of consecutive, never repeated ids: the whole corpus is a permutation-free
    count ``first_id, first_id + 1, ...`` cut into documents of 5-40 tokens."""
    rng = np.random.default_rng(seed)
    docs, nxt = [], first_id
    for _ in range(n_docs):
        n = int(rng.integers(5, 40))
        docs.append(list(range(nxt, nxt + n)))
        nxt += n
    return docs, nxt


def _datasets(tmp_path, prefixes, samples):
    vocab = 1 << 20
    tok = build_tokenizer("NullTokenizer", vocab_size=vocab, model=None)
    data = DataArgs(data_path=prefixes, split="100,0,0", data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_datasets(data, tok, seq_length=T, samples=(samples, 0, 0), seed=1)
    return train


@pytest.fixture()
def corpus(tmp_path):
    docs, _ = index_coded_documents(800)  # one epoch: no window is read twice
    return _datasets(tmp_path, write_dataset(tmp_path / "ic", docs), 1200)


def first_token(sample) -> int:
    return int(sample["tokens"][0])


def adjacent(a, b) -> bool:
    """``b`` continues ``a`` in the text (a window's last label is the next one's first token)."""
    return int(a["labels"][-1]) == int(b["tokens"][0])


def test_phase2_reads_unused_windows_once_each_in_an_uncorrelated_order(corpus):
    S, n1 = 4, 60
    stream = TrainStream(corpus, bag_size=S, phase1_samples=n1, seed=7)
    used = set()
    for i in range(n1):
        sample = stream.phase1_sample(i)
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])  # contiguous S*T+1
        used |= {int(t) for t in sample["tokens"][::T]}  # first tokens of its S windows
    assert len(used) == n1 * S
    all_windows = {first_token(corpus[j]) for j in range(len(corpus))}
    unused = all_windows - used
    phase2 = []
    for i in itertools.count():
        try:
            phase2.append(stream.phase2_sample(i))
        except IndexError:
            break
    firsts = [first_token(s) for s in phase2]
    # every unused window once before any repeats (here: the whole unused set, no repeat)
    assert len(firsts) == len(set(firsts)) and set(firsts) <= unused
    assert len(unused - set(firsts)) < S, "phase 2 skipped unused windows"
    # micro-batches of 4 samples: share of sample pairs that continue each other
    b = 4
    pairs = [
        (x, y)
        for k in range(0, len(phase2) - b + 1, b)
        for x, y in itertools.permutations(phase2[k : k + b], 2)
    ]
    share = sum(adjacent(x, y) for x, y in pairs) / len(pairs)
    chance = 1 / len(phase2)  # a random other window continues x with probability ~1/W
    assert share <= 5 * chance, f"{share:.3f} of pairs are adjacent windows (chance {chance:.4f})"


@pytest.mark.parametrize("bag", [1, 2])
def test_phase2_order_same_on_dp_ranks_after_resume_and_with_workers(corpus, bag):
    def step_samples(stream, layout, phase, step):
        batches = stream.batches(phase, step, layout, device=CPU)
        return [t for b in batches for t in b["tokens"][:, 0].tolist()]

    n1 = 16
    one = BatchLayout(2, 1, 0, 4)  # DP 1: 8 samples per step
    ranks = [BatchLayout(2, 2, r, 2) for r in range(2)]  # DP 2: the same 8 samples per step
    # a stream per rank, as each rank builds its own; the resumed one first reads at step 2
    # and reads ahead with DataLoader workers
    streams = [TrainStream(corpus, bag_size=bag, phase1_samples=n1, seed=3) for _ in range(3)]
    resumed = TrainStream(corpus, bag_size=bag, phase1_samples=n1, seed=3, num_workers=2)
    try:
        for step in range(4):
            want = step_samples(streams[0], one, 2, step)
            got = [step_samples(s, lay, 2, step) for s, lay in zip(streams[1:], ranks)]
            assert sorted(got[0] + got[1]) == sorted(want) and not set(got[0]) & set(got[1])
            if step >= 2:
                assert step_samples(resumed, one, 2, step) == want
    finally:
        for s in streams + [resumed]:
            s.close()


def test_blend_phase1_samples_are_contiguous_text_of_one_dataset(tmp_path):
    docs_a, end_a = index_coded_documents(300, seed=1)
    docs_b, _ = index_coded_documents(300, first_id=end_a, seed=2)
    a = write_dataset(tmp_path / "a", docs_a)
    b = write_dataset(tmp_path / "b", docs_b)
    train = _datasets(tmp_path, f"0.6 {a} 0.4 {b}", 400)
    S, n1 = 4, 40
    stream = TrainStream(train, bag_size=S, phase1_samples=n1, seed=2)
    from_a = 0
    for i in range(n1):
        sample = stream.phase1_sample(i)
        tokens = torch.cat([sample["tokens"], sample["labels"][-1:]])
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
        # one dataset, consecutive windows of its text: ids count up within each document
        # and a document's successor in the stream starts where it ends, so the ids of a
        # contiguous stretch are all from one file
        assert bool((tokens < end_a).all()) or bool((tokens >= end_a).all())
        from_a += int(tokens[0] < end_a)
    assert 0.35 * n1 <= from_a <= 0.85 * n1  # the blend's weights, roughly (0.6 of samples)
    phase2 = [stream.phase2_sample(i) for i in range(64)]
    pairs = list(zip(phase2[:-1], phase2[1:]))
    assert sum(adjacent(x, y) for x, y in pairs) <= 3


def _train_child(rank, world, *, argv):
    from tst_megatron.training.config import parse_args
    from tst_megatron.training.trainer import train

    return train(parse_args(argv))


@pytest.mark.slow
def test_full_validation_reads_the_whole_split_every_time(tmp_path):
    """--full-validation (Megatron-LM's flag): every evaluation scores the same, whole split,
    so at LR 0 every round gives one number; --eval-iters rounds read other samples."""
    from tests.defaults import TEST_DEFAULTS
    from tests.distributed.harness import run_distributed

    docs, vocab = index_coded_documents(400)
    prefix = write_dataset(tmp_path / "v", [[t % 250 for t in d] for d in docs])
    argv = [
        *TEST_DEFAULTS,
        "--data-path", prefix, "--split", "80,20,0", "--data-cache-path", str(tmp_path),
        "--vocab-size", "256", "--num-layers", "1", "--hidden-size", "32",
        "--seq-length", "16", "--global-batch-size", "4", "--train-iters", "3",
        "--lr", "0", "--min-lr", "0", "--eval-interval", "1", "--eval-iters", "1",
        "--device", "cpu",
    ]  # fmt: skip
    (short,) = run_distributed(_train_child, 1, argv=argv)
    (full,) = run_distributed(_train_child, 1, argv=argv + ["--full-validation"])
    rounds = [full["valid"][i] for i in (1, 2, 3)]
    assert rounds[0] == rounds[1] == rounds[2]
    assert len({short["valid"][i] for i in (1, 2, 3)}) == 3  # one step of other samples each
    # the whole split: ~20% of ~8,800 tokens in 16-token windows, 4 per step
    assert not any(abs(full["valid"][1] - short["valid"][i]) < 1e-9 for i in (1, 2, 3))
