"""What the training batches contain, checked on an index-coded corpus.

Every token of the corpus is a distinct id, so a window is known by its first token and two
windows are adjacent in the text when the first one's last label is the second one's first
token. The properties are of the batches, not of the code that makes them:
- phase 1 reads contiguous ``S*T``-token samples;
- phase 2 reads the windows phase 1 left, each once before any repeats, in an order whose
  micro-batches hold adjacent windows no more often than chance (phase 2 on the old code
  served the ``S`` windows of each unused block back to back: at ``S = 4`` three pairs in
  four were adjacent);
- Megatron-LM's sampler and ``DataLoader`` (what the launcher's ``pretrain()`` reads through)
  give every DP rank its share of the same global batches, the same after a resume and with
  ``--num-workers``, and never mix the phases in a micro-batch;
- a blend's phase-1 samples are contiguous text of one dataset.
"""

import itertools

import numpy as np
import pytest
import torch

from tests.unit.test_data_boundary import null_tokenizer, write_dataset
from tst_megatron.data.gpt_datasets import DataSettings, build_datasets
from tst_megatron.data.stream import TrainStream
from tst_megatron.loop.datasets import PhasedTrainDataset

T = 8


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
    tok = null_tokenizer(vocab)
    cache = str(tmp_path / "cache")
    data = DataSettings(data_path=prefixes, split="100,0,0", data_cache_path=cache)
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
    stream = TrainStream(corpus, windows_per_sample=S, phase1_samples=n1, seed=7)
    used = set()
    for i in range(n1):
        sample = stream.phase1_sample(i)
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])  # contiguous S*T+1
        used |= {int(t) for t in sample["tokens"][::T]}  # first tokens of its S windows
    assert len(used) == n1 * S
    with pytest.raises(IndexError, match=f"phase-1 sample {n1} is past the {n1} planned"):
        stream.phase1_sample(n1)
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


def megatron_loader(dataset, *, consumed, micro_batch_size, dp_rank, dp_size, num_workers):
    """The training ``DataLoader`` Megatron-LM's ``build_pretraining_data_loader`` builds for
    ``--dataloader-type single`` (its ``MegatronPretrainingSampler`` from ``consumed``
    samples, ``--num-workers`` processes), for one data-parallel rank; no pinned memory on a
    CPU."""
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
    )
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, persistent_workers=num_workers > 0
    )


def _steps(loader, micro_batches: int, first_step: int, last_step: int):
    """``{step: [first token of each sample]}`` and the token lengths of each step, reading
    ``micro_batches`` micro-batches per step from ``first_step`` to ``last_step``."""
    batches = iter(loader)
    firsts, lengths = {}, {}
    for step in range(first_step, last_step):
        micro = [next(batches) for _ in range(micro_batches)]
        firsts[step] = [int(t) for m in micro for t in m["tokens"][:, 0]]
        lengths[step] = {int(m["tokens"].shape[1]) for m in micro}
    return firsts, lengths


@pytest.mark.parametrize("bag", [1, 2])
def test_megatron_lm_loader_same_on_dp_ranks_after_resume_and_with_workers(corpus, bag):
    """Global batch 8, 6 steps, the switch after 2 (16 samples). A DP=1 run (micro-batch 2,
    4 micro-batches per step) against two DP ranks (2 micro-batches each), a run resumed at
    step 3 (consumed samples 24) and one with 2 DataLoader workers."""
    n1, steps, gbs = 2, 6, 8
    switch = n1 * gbs if bag > 1 else 0
    stream = TrainStream(corpus, windows_per_sample=bag, phase1_samples=switch, seed=3)
    dataset = PhasedTrainDataset(stream, switch=switch, total=steps * gbs)

    def read(*, consumed=0, dp_rank=0, dp_size=1, num_workers=0):
        loader = megatron_loader(
            dataset,
            consumed=consumed,
            micro_batch_size=2,
            dp_rank=dp_rank,
            dp_size=dp_size,
            num_workers=num_workers,
        )
        micro = gbs // (2 * dp_size)
        return _steps(loader, micro, consumed // gbs, steps)

    one, lengths = read()
    # the reference, written plainly: step k holds samples [8k, 8k + 8) of the run, phase-1
    # samples of the stream before the switch, then its phase-2 samples
    for step in range(steps):
        want = []
        for i in range(step * gbs, (step + 1) * gbs):
            s = stream.phase1_sample(i) if i < switch else stream.phase2_sample(i - switch)
            want.append(int(s["tokens"][0]))
        assert one[step] == want, step
        assert lengths[step] == {T * bag if step < n1 and bag > 1 else T}, step  # one phase
    ranks = [read(dp_rank=r, dp_size=2)[0] for r in range(2)]
    for step in range(steps):
        a, b = ranks[0][step], ranks[1][step]
        assert sorted(a + b) == sorted(one[step]) and not set(a) & set(b), step
    resumed, _ = read(consumed=3 * gbs, num_workers=2)
    assert resumed == {k: v for k, v in one.items() if k >= 3}
    workers, _ = read(num_workers=2)
    assert workers == one


def test_blend_phase1_samples_are_contiguous_text_of_one_dataset(tmp_path):
    docs_a, end_a = index_coded_documents(300, seed=1)
    docs_b, _ = index_coded_documents(300, first_id=end_a, seed=2)
    a = write_dataset(tmp_path / "a", docs_a)
    b = write_dataset(tmp_path / "b", docs_b)
    train = _datasets(tmp_path, f"0.6 {a} 0.4 {b}", 400)
    S, n1 = 4, 40
    stream = TrainStream(train, windows_per_sample=S, phase1_samples=n1, seed=2)
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
    # through Megatron-LM's loader: micro-batches of one phase, S*T then T tokens
    dataset = PhasedTrainDataset(stream, switch=n1, total=n1 + 8)
    loader = megatron_loader(
        dataset, consumed=n1 - 4, micro_batch_size=4, dp_rank=0, dp_size=1, num_workers=0
    )
    shapes = [tuple(batch["tokens"].shape) for batch in loader]
    assert shapes == [(4, S * T), (4, T), (4, T)]


def test_a_resume_on_other_data_reads_what_the_note_says(tmp_path):
    """``checks.resume.order_notes``: a resume after the switch (step 3 of 6, the switch after
    2, S = 2, global batch 8) with another ``--data-path`` reads that data's windows only,
    none of the blocks phase 1 would have read of it in the first N1 steps, and the same
    samples an uninterrupted run on it reads from that step. The two corpora's token ids are
    disjoint, so a sample is known to come from one or the other."""
    S, n1, steps, gbs, at = 2, 2, 6, 8, 3
    switch = n1 * gbs
    docs_x, end = index_coded_documents(400, seed=1)
    docs_y, _ = index_coded_documents(400, first_id=end, seed=2)
    corpus_x = _datasets(tmp_path / "x", write_dataset(tmp_path / "x.ic", docs_x), 600)
    corpus_y = _datasets(tmp_path / "y", write_dataset(tmp_path / "y.ic", docs_y), 600)
    y_ids = range(end, end + sum(len(d) for d in docs_y))

    def run(corpus, consumed):
        stream = TrainStream(corpus, windows_per_sample=S, phase1_samples=switch, seed=3)
        dataset = PhasedTrainDataset(stream, switch=switch, total=steps * gbs)
        loader = megatron_loader(
            dataset, consumed=consumed, micro_batch_size=2, dp_rank=0, dp_size=1, num_workers=0
        )
        return stream, _steps(loader, gbs // 2, consumed // gbs, steps)[0]

    _, on_x = run(corpus_x, 0)
    stream_y, resumed = run(corpus_y, at * gbs)  # the checkpoint of step 3, resumed on Y
    _, uninterrupted_y = run(corpus_y, 0)
    read = [t for step in resumed.values() for t in step]
    assert all(t in y_ids for t in read) and not set(read) & {t for s in on_x.values() for t in s}
    phase1_blocks_of_y = {
        int(t) for i in range(switch) for t in stream_y.phase1_sample(i)["tokens"][::T]
    }
    assert not set(read) & phase1_blocks_of_y  # "leaving out the blocks phase 1 would have read"
    assert resumed == {k: v for k, v in uninterrupted_y.items() if k >= at}
