"""Tensor parallelism: which slice of the model this rank holds, and the two collectives that join ranks."""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallel:
    """tp_size ranks split heads, expert/MLP intermediates and the lm_head vocabulary; this is rank `rank`.

    With `group=None` and tp_size > 1 the rank runs alone: collectives return the local partial results,
    which is what a single-GPU benchmark of one TP8 rank needs. With a process group they sum/gather.
    """

    tp_size: int = 1
    rank: int = 0
    group: object = None

    def __post_init__(self):
        if self.tp_size < 1 or not 0 <= self.rank < self.tp_size:
            raise ValueError(f"parallel: rank {self.rank} out of range for tp_size {self.tp_size}")

    @classmethod
    def from_process_group(cls, group=None):
        return cls(dist.get_world_size(group), dist.get_rank(group), group or dist.group.WORLD)

    @property
    def joined(self):
        return self.tp_size > 1 and self.group is not None

    def all_reduce(self, x):
        """Sum partial results over ranks (in place where possible); identity alone."""
        if self.joined:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x):
        """Concatenate each rank's slice along the last dim (the vocabulary of the logits)."""
        if not self.joined:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, size, what, multiple=1):
        """(start, length) of this rank's slice of a dim of `size`."""
        if size % (self.tp_size * multiple):
            raise ValueError(f"{what} of {size} does not split over tp_size {self.tp_size} in multiples of {multiple}")
        length = size // self.tp_size
        return self.rank * length, length
