"""Zeroed int32 arrival counters for kernels whose last-arriving program finishes the work (split-K reductions).

Each kernel resets the counters it used, so they are zero between launches and CUDA graphs replay the launch as
is. Each owner (kernel family) has its own buffer per device, so kernels of different families running at once on
two streams never share a counter; two launches of one family must not run at once (the model runs each family on
one stream at a time: the shared expert's projections on the side stream overlap only the router and the MoE).
A buffer outgrown by a larger request is kept alive, not freed: graphs captured with it still replay into it.
"""

import torch

_buffers = {}  # (owner, device) -> int32 tensor
_outgrown = []  # buffers replaced by larger ones, kept for the graphs that captured them


def arrival_counters(owner, device, n):
    """At least n zeroed int32 counters on `device` for kernel family `owner` (grown, never shrunk or freed)."""
    key = (owner, torch.device(device))
    buf = _buffers.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _outgrown.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _buffers[key] = buf
    return buf
