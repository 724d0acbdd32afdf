"""The latent KV cache: contiguous, one row per sequence.

`kv[layer, b, i]` is entry i of sequence b: [c (kv_lora_rank) ; roped k_pe (qk_rope_head_dim)], 576 values
for K2.6. `lens[b]` (int32, on the device) counts the committed entries; a forward pass writes its T tokens
at lens[b] .. lens[b]+T-1 without committing them, and the caller commits with `advance` (prefill, plain
decode) or by compaction (tree verify). `host_lens` mirrors `lens` on the host so that overflow is caught
before a kernel writes out of range, without a device sync.
"""

import torch

from model.memory import check_fits, tensor_bytes


class LatentCache:
    def __init__(self, num_layers, batch, max_len, entry_dim, dtype, device):
        if batch < 1 or max_len < 1:
            raise ValueError(f"cache: batch {batch} and max_len {max_len} must be positive")
        shape = (num_layers, batch, max_len, entry_dim)
        check_fits(f"the latent cache ({batch} x {max_len} entries)", tensor_bytes(shape, dtype), device)
        self.kv = torch.zeros(num_layers, batch, max_len, entry_dim, dtype=dtype, device=device)
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.host_lens = [0] * batch

    @classmethod
    def for_model(cls, cfg, batch, max_len, dtype, device):
        return cls(cfg.num_hidden_layers, batch, max_len, cfg.cache_entry_dim, dtype, device)

    def row(self, b):
        """A one-sequence cache viewing row b (kv and lens share storage; host_lens is a copy: write it back)."""
        view = object.__new__(LatentCache)
        view.kv, view.lens, view.host_lens = self.kv[:, b : b + 1], self.lens[b : b + 1], [self.host_lens[b]]
        return view

    @property
    def batch(self):
        return self.kv.shape[1]

    @property
    def max_len(self):
        return self.kv.shape[2]

    def check_room(self, new_tokens, rows=None):
        """Raise if writing `new_tokens` more entries would pass the end of the cache."""
        for b in rows if rows is not None else range(self.batch):
            if self.host_lens[b] + new_tokens > self.max_len:
                raise ValueError(f"cache: sequence {b} holds {self.host_lens[b]} tokens; {new_tokens} more exceed "
                                 f"the context of {self.max_len}")

    def advance(self, counts):
        """Commit `counts` (a list of ints, one per sequence) new entries."""
        self.lens += torch.tensor(counts, dtype=torch.int32, device=self.lens.device)
        self.host_lens = [n + c for n, c in zip(self.host_lens, counts)]

    def set_host_lens(self, host_lens):
        self.host_lens = list(host_lens)

    def reset(self, rows=None):
        rows = list(range(self.batch)) if rows is None else list(rows)
        self.lens[rows] = 0
        for b in rows:
            self.host_lens[b] = 0
