"""Phase-1 context parallelism splits the *latent* sequence: each CP chunk holds whole bags
and the targets of exactly those latent positions (megatron-core's 2*CP load-balanced order)."""

import torch
from megatron.core.utils import get_batch_on_this_cp_rank

from tst_megatron.superposition import align_bag_targets, fold_bags


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_cp_chunks_hold_whole_bags_and_their_targets():
    # get_batch_on_this_cp_rank asks the group for its size only once torch.distributed is up.
    torch.distributed.init_process_group(
        "gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0"
    )
    try:
        _check_cp_split()
    finally:
        torch.distributed.destroy_process_group()


def _check_cp_split():
    bag, latent, cp = 4, 8, 2
    x = torch.arange(bag * latent + 1).unsqueeze(0)  # token id = position in the sample
    bags = fold_bags(x[:, :-1], bag)
    targets, mask = align_bag_targets(x[:, 1:], torch.ones(1, bag * latent), bag)
    seen = []
    for rank in range(cp):
        local = get_batch_on_this_cp_rank(
            {"bags": bags, "targets": targets, "mask": mask}, cp_group=_Group(cp, rank)
        )
        assert local["bags"].shape == (1, latent // cp, bag)
        for j in range(latent // cp):
            first = int(local["bags"][0, j, 0])
            assert first % bag == 0, "a CP chunk split a bag"
            assert local["bags"][0, j].tolist() == list(range(first, first + bag))
            valid = local["mask"][0, j] > 0
            # slot k of the bag starting at `first` targets token first + bag + k
            expected = torch.arange(first + bag, first + 2 * bag)
            assert torch.equal(local["targets"][0, j][valid], expected[valid])
            seen.append(first // bag)
    assert sorted(seen) == list(range(latent))
    # load balancing: rank 0 holds chunks 0 and 3 of 4, rank 1 chunks 1 and 2
    assert seen[:4] == [0, 1, 6, 7]
