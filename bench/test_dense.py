"""Dense projections and glue of one K2.6 TP8 rank (and its DFlash drafter) at the verify's row counts.

Projections: every weight of the model and drafter that goes through `ops.linear` (read off both built on the meta
device), M = 1-65 rows, `ops.linear` (the Triton GEMM where `linear`'s table adopts it, cuBLAS elsewhere) beside
cuBLAS (`F.linear`). Weights cold in L2: each call reads its own copy, rotating through >= 256 MiB of copies, all
calls of a case in one CUDA graph (median of 10 replays). Bytes: the weight; FLOPs: 2 M N K.

Norm + projection (`ops.norm_linear`) at one row, fused and as two ops, weights rotated as above.

Glue: the router (scores, grouped top-8), the absorbed query (with its RoPE) and output, the norms and the
drafter's per-head norm + RoPE at 1-129 rows: 20 calls back to back in one CUDA graph, `do_bench`'s method
(L2 flushed before each replay), median / 20, so a figure is the op's in-step cost (kernel and launch gap).
Bytes: weights, inputs and outputs, each once. Every float output is checked against the torch reference.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import ops
from bench.common import bench_flushed, bench_graph, capture, record, rel_err

MS = (1, 2, 4, 9, 17, 33, 65)
ROTATE_BYTES = 256 << 20
MIN_CALLS = 8
ROWS = (1, 9, 33, 65, 129)
REPEAT = 20


def projection_shapes():
    """{(N, K): [names]} of the weights one TP8 rank of K2.6 and its drafter run through ops.linear."""
    from bench.bench_step import drafter_config
    from model.config import preset
    from model.model import KimiModel
    from model.parallel import Parallel
    from spec.drafter import DFlashDrafter

    target = KimiModel(preset("kimi-k2.6"), Parallel(8, 0), torch.bfloat16, "meta")
    drafter = DFlashDrafter(drafter_config(target.cfg), torch.bfloat16, "meta", target.par)
    attn, dense, moe, layer = target.layers[1].self_attn, target.layers[0].mlp, target.layers[1].mlp, drafter.layers[0]
    named = [("q_a+kv_a", attn.down_proj_weight), ("q_b", attn.q_b_proj.weight), ("o_proj", attn.o_proj.weight),
             ("shared gate_up", moe.shared_experts.gate_up.weight),
             ("shared down", moe.shared_experts.down_proj.weight),
             ("dense gate_up", dense.gate_up.weight), ("dense down", dense.down_proj.weight),
             ("lm_head", target.lm_head.weight), ("draft q", layer.self_attn.q_proj.weight),
             ("draft k/v", layer.self_attn.k_proj.weight), ("draft o", layer.self_attn.o_proj.weight),
             ("draft gate_up", layer.mlp.gate_up.weight), ("draft down", layer.mlp.down_proj.weight),
             ("draft fc", drafter.fc.weight)]
    shapes = {}
    for name, w in named:
        shapes.setdefault(tuple(w.shape), []).append(name)
    return shapes


SHAPES = projection_shapes()
LINEAR = [(N, K, M, impl) for N, K in SHAPES for M in MS for impl in ("ops", "cublas")]


@pytest.fixture(scope="module")
def weights():
    """weights(N, K, n): n copies of a random [N, K] bf16 weight (the latest shape's kept)."""
    latest = {}

    def get(N, K, n):
        if (N, K) not in latest:
            latest.clear()
            torch.cuda.empty_cache()
            latest[N, K] = ([], torch.Generator("cuda").manual_seed(0))
        copies, gen = latest[N, K]
        while len(copies) < n:
            copies.append(torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / K ** 0.5)
        return copies

    yield get
    latest.clear()


@pytest.mark.parametrize("N,K,M,impl", LINEAR, ids=[f"{N}x{K}-M{M}-{impl}" for N, K, M, impl in LINEAR])
def test_linear(benchmark, ceilings, weights, N, K, M, impl):
    copies = weights(N, K, 1 if benchmark.disabled else max(2, math.ceil(ROTATE_BYTES / (N * K * 2))))
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(M))
    fn = F.linear if impl == "cublas" else ops.linear
    with ops.using(linear="triton"):
        out = fn(x, copies[0])
        if benchmark.disabled:
            return
        err = rel_err(out, F.linear(x.float(), copies[0].float()))
        us = bench_graph(benchmark, [lambda w=copies[i % len(copies)]: fn(x, w)
                                     for i in range(max(MIN_CALLS, len(copies)))])
    record(benchmark, ceilings, us, f"linear {N}x{K} M={M} {impl}", nbytes=N * K * 2, flops=2 * M * N * K,
           used_by=", ".join(SHAPES[N, K]), rel_err=err)
    assert err < 1e-2


NORM_LINEAR = [(N, K, impl) for N, K in ((2112, 7168), (1536, 1536), (20480, 7168)) for impl in ("fused", "chain")]


@pytest.mark.parametrize("N,K,impl", NORM_LINEAR, ids=[f"{N}x{K}-{impl}" for N, K, impl in NORM_LINEAR])
def test_norm_linear(benchmark, ceilings, weights, N, K, impl):
    """One row through a norm and the projection that reads it: `ops.norm_linear` (fused: the norm in the gemv's
    prologue) against the norm kernel then `ops.linear` (chain). At the hidden size as the layer's input norm runs
    it (a MoE's fp32 routed sums + shared output + residual), at q_a's width as its norm alone."""
    copies = weights(N, K, 1 if benchmark.disabled else max(2, math.ceil(ROTATE_BYTES / (N * K * 2))))
    gen = torch.Generator("cuda").manual_seed(N)
    x, r, e = (torch.randn(1, K, device="cuda", generator=gen) for _ in range(3))
    nw = (1 + torch.randn(K, device="cuda", generator=gen) / 4).bfloat16()
    add = K == 7168
    x, r, e = (x, r.bfloat16(), e.bfloat16()) if add else (x.bfloat16(), None, None)

    def fused(w):
        return ops.norm_linear(x, nw, 1e-6, w, r, e)[1]

    def chain(w):
        normed = ops.add_rms_norm(x, r, nw, 1e-6, e)[1] if add else ops.rms_norm(x, nw, 1e-6)
        return ops.linear(normed, w)

    fn = fused if impl == "fused" else chain
    with ops.using(linear="triton", norm_linear="triton", add_rms_norm="triton", rms_norm="triton"):
        out = fn(copies[0])
        if benchmark.disabled:
            return
        with ops.using(norm_linear="torch"):
            err = rel_err(out, ops.norm_linear(x, nw, 1e-6, copies[0], r, e)[1])
        us = bench_graph(benchmark, [lambda w=copies[i % len(copies)]: fn(w)
                                     for i in range(max(MIN_CALLS, len(copies)))])
    inputs = K * ((4 + 2 + 2 + 2) if add else 2) + K * 2  # x (fp32 with the add), residual, extra, h; norm weight
    record(benchmark, ceilings, us, f"norm_linear {N}x{K} M=1 {impl}", nbytes=N * K * 2 + inputs, flops=2 * N * K,
           rel_err=err)
    assert err < 1e-2


def glue_case(op, n, gen):
    """(a thunk calling `op` on n rows, bytes, FLOPs) at one TP8 rank's shapes."""
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16() * scale

    positions = torch.arange(n, device="cuda") + 4000
    inv_freq = 1.0 / (10000 ** (torch.arange(32, device="cuda").float() / 32))
    if op == "router":
        x, w, bias = randn(n, 7168), randn(384, 7168, scale=1 / 85), 0.01 * torch.randn(384, device="cuda")
        return lambda: ops.route(x, w, bias, 8, 1, 1, 2.827), (384 + n) * 7168 * 2, 2 * n * 384 * 7168
    if op == "absorb_query":
        q, w = randn(n, 8, 192), randn(8, 128, 512, scale=1 / 12)
        return (lambda: ops.absorb_query(q[:, :, :128], q[:, :, 128:], w, positions, inv_freq, 1.0),
                (8 * 128 * 512 + n * 8 * (192 + 576)) * 2, 2 * n * 8 * 128 * 512)
    if op == "absorb_output":
        o, w = randn(n, 8, 512), randn(8, 128, 512, scale=1 / 22)
        return lambda: ops.absorb_output(o, w), (8 * 128 * 512 + n * 8 * (512 + 128)) * 2, 2 * n * 8 * 512 * 128
    if op == "rms_norm":
        x, w = randn(n, 7168), randn(7168)
        return lambda: ops.rms_norm(x, w, 1e-6), (2 * n + 1) * 7168 * 2, None
    if op == "add_rms_norm":
        x, h, w = randn(n, 7168), randn(n, 7168), randn(7168)
        return lambda: ops.add_rms_norm(x, h, w, 1e-6), (4 * n + 1) * 7168 * 2, None
    q, w = randn(n, 8, 128), randn(128)  # the drafter's queries: 8 of 64 heads of 128
    inv_freq = 1.0 / (1e6 ** (torch.arange(64, device="cuda").float() / 64))
    return lambda: ops.head_norm_rope(q, w, 1e-6, positions, inv_freq), 2 * n * 8 * 128 * 2 + 128 * 2, None


GLUE_OPS = ("router", "absorb_query", "absorb_output", "rms_norm", "add_rms_norm", "head_norm_rope")
GLUE = [(op, n) for op in GLUE_OPS for n in ROWS]


def floats(out):
    """The floating-point tensors of an op's output (a tensor or a tuple)."""
    outs = out if isinstance(out, tuple) else (out,)
    return [t for t in outs if t.is_floating_point()]


@pytest.mark.parametrize("op,n", GLUE, ids=[f"{op}-rows{n}" for op, n in GLUE])
def test_glue(benchmark, ceilings, op, n):
    fn, nbytes, flops = glue_case(op, n, torch.Generator("cuda").manual_seed(n))
    with ops.using(**{op: "triton"}):
        out = floats(fn())
        if benchmark.disabled:
            return
        with ops.using(**{op: "torch"}):
            err = max(rel_err(a, b) for a, b in zip(out, floats(fn())))
        us = bench_flushed(benchmark, capture([fn] * REPEAT).replay, warmup_ms=10, rep_ms=100) / REPEAT
    record(benchmark, ceilings, us, f"glue {op} n={n}", nbytes=nbytes, flops=flops, rel_err=err)
    assert err < 1e-2
