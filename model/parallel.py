"""Tensor parallelism: which slice of the model this rank holds, and the two collectives that join ranks.

A collective that fails (a peer rank died, or did not answer within the group's timeout, set where the group is
made: `spec.decode --collective-timeout`) raises CollectiveError naming this rank and the collective, so the
surviving ranks end with one line instead of hanging or printing a backend traceback.
"""

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective across tensor-parallel ranks failed: a peer died, hung past the timeout, or closed the group."""


def collective_failure(par, what, err):
    """A CollectiveError for `what` on rank `par`, from the backend's error (its first line, source path cut)."""
    detail = re.sub(r"^\[[^\]]*\]\s*", "", (str(err).strip().splitlines() or [""])[0])
    detail = detail.split(". This is typically")[0]
    return CollectiveError(f"tensor-parallel rank {par.rank} of {par.tp_size}: {what} failed, a peer rank died or "
                           f"stopped answering ({detail})")


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
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.tp_size, self.rank)):
            raise TypeError(f"parallel: tp_size and rank must be integers, got {self.tp_size!r}, {self.rank!r}")
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
            try:
                dist.all_reduce(x, group=self.group)
            except RuntimeError as err:
                raise collective_failure(self, "all_reduce", err) from None
        return x

    def all_gather_last(self, x):
        """Concatenate each rank's slice along the last dim (the vocabulary of the logits)."""
        if not self.joined:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        try:
            dist.all_gather(parts, x.contiguous(), group=self.group)
        except RuntimeError as err:
            raise collective_failure(self, "all_gather", err) from None
        return torch.cat(parts, dim=-1)

    def barrier(self):
        """Wait for every rank (no-op alone)."""
        if self.joined:
            try:
                dist.barrier(group=self.group)
            except RuntimeError as err:
                raise collective_failure(self, "barrier", err) from None

    def shard(self, size, what, multiple=1):
        """(start, length) of this rank's slice of a dim of `size`."""
        if size % (self.tp_size * multiple):
            raise ValueError(f"{what} of {size} does not split over tp_size {self.tp_size} in multiples of {multiple}")
        length = size // self.tp_size
        return self.rank * length, length
