"""Zeroed int32 arrival counters for kernels whose last-arriving program finishes the work (split-K reductions).

Each kernel resets the counters it used, so they are zero between launches and CUDA graphs replay the launch as
is. Each owner (kernel family) has its own buffer per device, so kernels running at once on two streams never
share a counter.
"""

import torch

_buffers = {}  # (owner, device) -> int32 tensor


def arrival_counters(owner, device, n):
    """At least n zeroed int32 counters on `device` for kernel family `owner` (grown, never shrunk)."""
    key = (owner, torch.device(device))
    buf = _buffers.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _buffers[key] = buf
    return buf
