"""MLA tree attention sweep: `ops.mla_attention` (Triton) at one K2.6 TP8 rank (H 8) and a whole layer's heads
(H 64), batch 1, bf16, over the latent cache (576 = 512 latent + 64 rope) at contexts 4k / 32k / 128k and trees of
1-128 nodes (random: each node's parent a uniformly random earlier node); the verify step's shapes (T = budget + 1
in a cache padded past the length, as the step benchmark's: STEP_CASES); two causal prompt chunks (PREFILL).

Each case captures one CUDA graph of R launches over R different caches (R x cache >= 256 MiB, so each launch
finds its cache cold in L2, as the model's layers would) and reports graph time / R. Bytes: the cache up to the
length plus q and the output; FLOPs: 2 x H x T x keys x (576 + 512). Each case is checked against the fp32 torch
reference.
"""

import math
import random

import pytest
import torch

import ops
from bench.common import bench_graph, record, rel_err

SCALE = 0.1446802
CONTEXTS = (4096, 32768, 131072)
HEADS = (8, 64)
TREE_SIZES = (1, 8, 32, 64, 128)
ROTATE_BYTES = 256 << 20
PREFILL = ((4096, 8, 4096), (32768, 8, 2048))  # (L, H, T): causal prompt chunks, no tree mask
STEP_CACHE = 32898  # entries of the step benchmark's cache (32k context + the largest tree + 1)
STEP_CASES = ((32768, 8, 33, 97), (32768, 8, 9, 121), (32768, 8, 65, 65), (32768, 8, 1, 129)) + tuple(
    (4096, 8, T, STEP_CACHE - 4096 - T) for T in (1, 9, 33, 65, 129))  # (context, H, T, cache entries past L)
CASES = ([(L, H, T, False, 0) for L in CONTEXTS for H in HEADS for T in TREE_SIZES]
         + [(L, H, T, True, 0) for L, H, T in PREFILL]
         + [(context + T, H, T, False, pad) for context, H, T, pad in STEP_CASES])  # (L, H, T, causal, pad)


def case_id(L, H, T, causal, pad):
    return f"L{L}-H{H}-T{T}" + ("-causal" if causal else "") + (f"-pad{pad}" if pad else "")


def random_tree_mask(T, seed):
    """A random tree of T nodes (each node's parent a uniformly random earlier one), packed [1, T, ceil(T/32)]."""
    rng = random.Random(seed)
    dense = torch.zeros(1, T, T, dtype=torch.bool)
    parents = [-1] + [rng.randrange(t) for t in range(1, T)]
    for t in range(T):
        n = t
        while n >= 0:
            dense[0, t, n] = True
            n = parents[n]
    return ops.pack_tree_mask(dense).to("cuda")


def costs(L, H, T, causal):
    """(bytes, FLOPs) of one case: the cache up to L, q and the output; the score and value products (a causal
    chunk's queries see L - T + their position keys, a tree's every key)."""
    keys = L - T + (T + 1) / 2 if causal else L
    return L * 576 * 2 + T * H * (576 + 512) * 2, 2 * H * T * keys * (576 + 512)


@pytest.mark.parametrize("L,H,T,causal,pad", CASES, ids=[case_id(*c) for c in CASES])
def test_attention(benchmark, ceilings, L, H, T, causal, pad):
    torch.manual_seed(0)
    rotate = 1 if benchmark.disabled else min(256, max(2, math.ceil(ROTATE_BYTES / ((L + pad) * 576 * 2))))
    caches = [torch.randn(1, L + pad, 576, dtype=torch.bfloat16, device="cuda") for _ in range(rotate)]
    q = torch.randn(1, T, H, 576, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((1,), L, dtype=torch.int32, device="cuda")
    mask = None if causal else random_tree_mask(T, 0)
    with ops.using(attention="triton"):
        out = ops.mla_attention(q, caches[0], lens, mask, SCALE)
        if benchmark.disabled:
            return
        with ops.using(attention="torch"):
            err = rel_err(out, ops.mla_attention(q.float(), caches[0].float(), lens, mask, SCALE))
        us = bench_graph(benchmark, [lambda kv=kv: ops.mla_attention(q, kv, lens, mask, SCALE) for kv in caches])
    nbytes, flops = costs(L, H, T, causal)
    record(benchmark, ceilings, us, "attention " + case_id(L, H, T, causal, pad), nbytes=nbytes, flops=flops,
           rotate=rotate, rel_err=err)
    assert err < 1e-2
