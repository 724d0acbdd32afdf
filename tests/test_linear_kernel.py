"""The dense-projection skinny GEMM (`triton_kernels/linear.py`) against the fp32 reference, its launch plan, the
per-shape adoption behind `ops.linear`, and its sm_120 configs' resources (interpreter on CPU, compiled on a GPU)."""

import pytest
import torch

import ops
from triton_kernels import arch, tuning
from triton_kernels import linear as lk
from tests.conftest import TRITON_DEVICE, compiled_in_child, kernel_dtypes, rel_err, requires_gpu, requires_triton

DEV = TRITON_DEVICE
C = lk.Config
CASES = [  # (config, M, N, K): M not a power of two, N and K off the tiles, one K split or several, pdl (GPU)
    (C("gemv", 32, 256, 4, 3, 2), 1, 200, 700),
    (C("gemv", 64, 128, 4, 4, 8, True), 1, 96, 1024),
    (C("swap", 64, 128, 4, 4, 2), 1, 130, 1000),
    (C("swap", 64, 128, 4, 4, 2), 5, 200, 700),
    (C("swap", 64, 128, 4, 4, 8, True), 33, 64, 2048),
    (C("swap", 128, 128, 4, 3, 2), 17, 300, 384),
    (C("swap", 64, 256, 4, 3, 1), 65, 130, 300),
    (C("dot", 32, 128, 4, 4, 2), 9, 72, 1100),
    (C("dot", 32, 128, 4, 4, 16), 3, 40, 256),
    (C("gemv", 16, 512, 8, 4, 1), 1, 200, 300),  # K shorter than the K tile: the masked tail alone, no split
    (C("gemv", 8, 1024, 4, 3, 2), 1, 20, 2100),  # 8-row tiles, three K splits, the last one ragged
]


def operands(M, N, K, dtype, seed, rows_strided=True):
    """x [M, K] (rows strided, not 16-byte aligned, unless rows_strided is False), w [N, K], fp32 x @ w^T."""
    gen = torch.Generator().manual_seed(seed)
    pad = 3 if rows_strided else 0
    x = torch.randn(M, K + pad, generator=gen).to(dtype).to(DEV)[:, pad:]
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(DEV)
    return x, w, torch.nn.functional.linear(x.float(), w.float())


@requires_triton
@pytest.mark.parametrize("cfg,M,N,K", CASES, ids=lambda v: v.kind if isinstance(v, lk.Config) else str(v))
def test_linear_kernel_matches_reference(cfg, M, N, K):
    x, w, ref = operands(M, N, K, kernel_dtypes()[0], M + N + K)
    for _ in range(2):  # the arrival counters are back at zero after a launch
        out = lk.linear_kernel(x, w, cfg)
        assert out.shape == (M, N) and rel_err(out, ref) < 5e-3


TMA_CASES = [  # tiles through tensor descriptors: rows past M, a ragged N and K (zero-filled), one K split or several
    (C("swap", 64, 128, 4, 4, 8, tma=True), 33, 130, 1096),
    (C("swap", 128, 64, 8, 4, 1, tma=True), 65, 130, 296),
    (C("dot", 32, 128, 4, 4, 2, tma=True), 9, 72, 1096),
]


@requires_triton
@pytest.mark.parametrize("cfg,M,N,K", TMA_CASES, ids=lambda v: v.kind if isinstance(v, lk.Config) else str(v))
def test_linear_kernel_tma_tiles_match_reference(cfg, M, N, K):
    x, w, ref = operands(M, N, K, kernel_dtypes()[0], M + N + K, rows_strided=False)
    assert lk.tma_ok(x, w) and not lk.tma_ok(x[:, 3:], w)  # misaligned rows fall back to pointers
    for _ in range(2):
        assert rel_err(lk.linear_kernel(x, w, cfg), ref) < 5e-3
    assert rel_err(lk.linear_kernel(x[:, 3:], w[:, 3:], cfg), ref - x[:, :3].float() @ w[:, :3].float().T) < 5e-3


@requires_triton
@pytest.mark.parametrize("cfg,M,N,K", [CASES[1], CASES[4], CASES[7], TMA_CASES[0]],
                         ids=lambda v: v.kind if isinstance(v, lk.Config) else str(v))
def test_linear_kernel_unsummed_partials(cfg, M, N, K):
    """raw: every K split's fp32 partial [splits, M, N] left for the caller (the router's select sums them): summed
    in split order they are what the kernel writes summed itself (to the bit under the interpreter; on a GPU
    checked to the tolerance only, the bits not yet checked there)."""
    dtype = kernel_dtypes()[0]
    x, w, _ = operands(M, N, K, dtype, M + N + K, rows_strided=False)
    parts = lk.linear_kernel(x, w, cfg, raw=True)
    splits = lk.plan(cfg, M, N, K, arch.sm_count(x.device), arch.current(x.device)).splits
    assert parts.dtype == torch.float32 and parts.shape == (splits, M, N) and splits > 1
    total = torch.zeros(M, N, device=parts.device)
    for part in parts:
        total += part
    y = lk.linear_kernel(x, w, cfg)
    assert torch.equal(total.to(dtype), y) if not x.is_cuda else rel_err(total.to(dtype), y) < 5e-3


GLU_CASES = [CASES[0], CASES[3], CASES[7], CASES[10], TMA_CASES[2]]  # gemv ragged, swap, dot, 3 ragged splits, TMA


def silu_mul_rows(gate_up):
    """silu(gate) * up of [gate ; up] rows in one launch of glue's own kernel (what the fused load must equal)."""
    from triton_kernels.glue import _silu_mul_kernel

    M, I = gate_up.shape[0], gate_up.shape[1] // 2
    act = torch.empty(M, I, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(M, (I + 1023) // 1024)](gate_up, act, I, BLOCK=1024)
    return act


@requires_triton
@pytest.mark.parametrize("cfg,M,N,K", GLU_CASES, ids=lambda v: v.kind if isinstance(v, lk.Config) else str(v))
def test_linear_kernel_glu_is_the_kernel_on_silu_mul(cfg, M, N, K):
    """glu: x is [gate ; up] and the kernel forms silu(gate) * up as it loads: the bits of the silu kernel's
    output run through the same config (the activation rounded the same way, the same tiles summed)."""
    dtype = kernel_dtypes()[0]
    gate_up, w, _ = operands(M, N, 2 * K, dtype, M + N + K, rows_strided=False)
    w = w[:, :K].contiguous()
    fused = lk.linear_kernel(gate_up, w, cfg, glu=True)
    act = silu_mul_rows(gate_up)
    assert torch.equal(fused, lk.linear_kernel(act, w, cfg))
    ref = torch.nn.functional.linear((torch.nn.functional.silu(gate_up[:, :K].float()) * gate_up[:, K:].float()),
                                     w.float())
    assert rel_err(fused, ref) < 1e-2
    with pytest.raises(ValueError, match="2 x"):
        lk.linear_kernel(act, w, cfg, glu=True)


NORM_CASES = [CASES[0], CASES[1], CASES[9], CASES[10]]  # ragged K, pdl (GPU), K under one tile, 3 ragged splits


@requires_triton
@pytest.mark.parametrize("residual,extra,x_fp32", [(False, False, False), (True, False, False), (True, True, True)],
                         ids=["rms", "add", "add_extra_fp32"])
@pytest.mark.parametrize("cfg,M,N,K", NORM_CASES, ids=lambda v: v.kind if isinstance(v, lk.Config) else str(v))
def test_gemv_norm_prologue_is_the_norm_then_the_kernel(cfg, M, N, K, residual, extra, x_fp32):
    """norm: the gemv computes rms_norm((x (+ extra)) (+ residual)) as it loads x: h as glue's norm kernel stores
    it, and y the kernel's on the norm kernel's output (bit for bit in the interpreter; on a GPU the rstd's sum
    runs in another order, so y may move by a last bit)."""
    from triton_kernels import glue

    dtype = kernel_dtypes()[0]
    gen = torch.Generator().manual_seed(K + N)
    x, r, e = (torch.randn(1, K, generator=gen).to(DEV) for _ in range(3))
    x = x if x_fp32 else x.to(dtype)
    r, e = r.to(dtype), e.to(dtype)
    nw = (1 + torch.randn(K, generator=gen) / 4).to(dtype).to(DEV)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(DEV)
    h_out = torch.empty(1, K, dtype=dtype, device=DEV) if residual else None
    norm = lk.Norm(nw, 1e-6, r if residual else None, e if extra else None, h_out)
    y = lk.linear_kernel(x, w, cfg, norm=norm)
    if residual:
        h, normed = glue.add_rms_norm(x, r, nw, 1e-6, e if extra else None)
        assert torch.equal(h_out, h)
    else:
        normed = glue.rms_norm(x, nw, 1e-6)
    chain = lk.linear_kernel(normed, w, cfg)
    assert y.dtype == dtype and (torch.equal(y, chain) if not y.is_cuda else rel_err(y, chain) < 2e-3)
    assert rel_err(y, torch.nn.functional.linear(normed.float(), w.float())) < 1e-2


def test_norm_prologue_refuses_other_kernels():
    x, w, nw = torch.randn(1, 8), torch.randn(4, 8), torch.ones(8)
    for cfg, x_cols, kw in [(lk.SWAP, 8, {}), (lk.GEMV, 16, dict(glu=True))]:
        with pytest.raises(ValueError, match="norm prologue"):
            lk.linear_kernel(x.repeat(1, x_cols // 8), w, cfg, norm=lk.Norm(nw, 1e-6), **kw)
    with pytest.raises(ValueError, match="norm prologue"):
        lk.linear_kernel(torch.randn(1, 2 * lk.NORM_MAX_K), torch.randn(4, 2 * lk.NORM_MAX_K), lk.GEMV,
                         norm=lk.Norm(torch.ones(2 * lk.NORM_MAX_K), 1e-6))


@requires_triton
def test_linear_kernel_weight_rows_strided():
    """A weight view whose rows are further apart than K (a slice of a wider buffer)."""
    x, w, ref = operands(4, 72, 300, kernel_dtypes()[0], 1)
    wide = torch.zeros(72, 316, dtype=w.dtype, device=w.device)
    wide[:, 16:] = w
    assert rel_err(lk.linear_kernel(x, wide[:, 16:], lk.SWAP), ref) < 5e-3


def test_cases_cover_split_paths():
    """One K split and several; partials summed 4 at a time (a count not a multiple of 4 among them) and 1."""
    plans = [(lk.plan(cfg, M, N, K, 4, "sm_90"), cfg) for cfg, M, N, K in CASES + TMA_CASES]
    splits = [p.splits for p, _ in plans]
    assert min(splits) == 1 and max(splits) > 4
    loads = {(lk.reduce_loads(cfg, p.block_m), p.splits % 4 != 0) for p, cfg in plans if p.splits > 4}
    assert (4, True) in loads and any(lk.reduce_loads(cfg, p.block_m) == 1 for p, cfg in plans if p.splits > 1)


@requires_gpu
@pytest.mark.parametrize("M", [1, 2, 4, 9, 17, 33, 65])
def test_linear_kernel_bf16_at_step_shape(M):
    """bf16 on the GPU (the interpreter computes bf16 tl.dot wrongly), the default config at q_b's shape."""
    x, w, ref = operands(M, 1536, 1536, torch.bfloat16, M)
    assert rel_err(lk.linear_kernel(x, w), ref) < 1e-2


@requires_gpu
@pytest.mark.parametrize("N,K,M", [(*nk, m) for nk, e in lk.ADOPTED["sm_90"].items() for m in e])
def test_adopted_configs_bf16_at_their_shapes(N, K, M):
    """Every adopted config, bf16, at the (N, K) and the largest M of the bucket it was adopted for, x contiguous
    as the model's (so the tensor-descriptor tiles run where the config asks for them)."""
    x, w, ref = operands(M, N, K, torch.bfloat16, N + K + M, rows_strided=False)
    assert rel_err(lk.linear_kernel(x, w, lk.ADOPTED["sm_90"][(N, K)][M]), ref) < 1e-2


@requires_gpu
def test_linear_kernel_replays_in_a_cuda_graph():
    """Split-K launches captured back to back, two of them with programmatic dependent launch, replay correctly
    (each resets its arrival counters)."""
    picked = CASES[:2] + CASES[4:6] + CASES[-1:]
    cases = [(cfg, *operands(M, N, K, torch.bfloat16, M + N)) for cfg, M, N, K in picked]
    outs = [lk.linear_kernel(x, w, cfg) for cfg, x, w, _ in cases]  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [lk.linear_kernel(x, w, cfg) for cfg, x, w, _ in cases]
    for _ in range(3):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for out, (_, _, _, ref) in zip(outs, cases):
            assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("M,N,K", [(1, 20480, 7168), (33, 2112, 7168), (65, 128, 7168), (9, 1536, 1536)])
def test_plan(M, N, K):
    """Splits fill about `waves` programs per SM, each a whole number of K tiles; stages fit the budget."""
    for cfg in (lk.GEMV, lk.SWAP, C("swap", 128, 128, 4, 3, 4)):
        if cfg.kind == "gemv" and M > 1:
            continue
        for key in arch.ARCHS:
            p = lk.plan(cfg, M, N, K, 132, key)
            assert p.k_per_split % cfg.block_k == 0 and (p.splits - 1) * p.k_per_split < K <= p.splits * p.k_per_split
            assert p.tiles * p.splits <= max(p.tiles, round(cfg.waves * 132) + p.tiles)
            assert 2 <= p.stages <= cfg.stages
            assert p.stages == 2 or p.stages * (cfg.block_n + p.block_m) * cfg.block_k * 2 <= lk.SHARED_BUDGET[key]


def test_buckets():
    assert [lk.bucket_of(m) for m in (1, 2, 3, 4, 5, 9, 16, 17, 33, 64, 65, 66)] == \
        [1, 2, 4, 4, 9, 9, 17, 17, 33, 65, 65, None]


def test_adopted_tables_are_valid():
    for key, table in lk.ADOPTED.items():
        for (N, K), entries in table.items():
            for bucket, cfg in entries.items():
                assert bucket in lk.BUCKETS and isinstance(cfg, lk.Config), (key, N, K, bucket)
                assert cfg.kind in ("gemv", "dot", "swap") and (cfg.kind != "gemv" or bucket == 1)


def test_linear_op_defaults_to_the_adopted_table(monkeypatch):
    """On a GPU the op runs triton_kernels.linear.linear, which runs the kernel only where ADOPTED lists the shape
    and M bucket; forcing torch still runs cuBLAS."""
    assert ops.current("linear", "cuda", torch.bfloat16) == "triton"
    assert ops.current("linear", "cpu", torch.bfloat16) == "torch"
    with ops.using(linear="torch"):
        assert ops.current("linear", "cuda", torch.bfloat16) == "torch"
    calls = []
    monkeypatch.setattr(lk, "linear_kernel", lambda x, w, cfg: calls.append(cfg) or x @ w.T)
    monkeypatch.setitem(lk.ADOPTED, arch.current(torch.device("cpu")), {(6, 8): {4: lk.SWAP}})
    w = torch.randn(6, 8).half()
    for M in (1, 3, 4, 5):
        x = torch.randn(M, 8).half()
        assert torch.equal(lk.linear(x, w), x @ w.T)
    assert calls == [lk.SWAP, lk.SWAP]  # M = 3 and 4 (bucket 4); M = 1 and 5 went to F.linear
    lk.linear(torch.randn(3, 9).half(), torch.randn(6, 9).half())  # a shape not in the table
    lk.linear(torch.randn(4, 8), torch.randn(6, 8))  # fp32: cuBLAS (the kernel is adopted for 16-bit operands)
    assert lk.linear(torch.randn(0, 8).half(), w).shape == (0, 6)  # no rows
    assert len(calls) == 2


def test_glu_fits_the_shared_memory_budget():
    """Gate and up tiles beside W's in one stage: on sm_120 not at 65-128 rows with 256-wide K tiles."""
    wide = C("swap", 64, 256, 4, 3, 1, tma=True)
    assert not lk.glu_fits(wide, 65, "sm_120") and lk.glu_fits(wide, 33, "sm_120") and lk.glu_fits(wide, 65, "sm_90")
    assert lk.glu_fits(lk.GEMV, 1, "sm_120")
    stages = [lk.plan(C("swap", 64, 128, 4, 4, 1), 33, 7168, 256, 170, "sm_120", glu).stages for glu in (False, True)]
    assert stages == [3, 2]  # the stages cut to the budget with the up tile counted
    with arch.using("sm_120"), pytest.raises(ValueError, match="no room"):
        lk.linear_kernel(torch.zeros(65, 512), torch.zeros(8, 256), wide, glu=True)


def test_linear_kernel_rejects_what_it_cannot_run():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="one row"):
        lk.linear_kernel(x, w, lk.GEMV)
    with pytest.raises(ValueError, match="M <="):
        lk.linear_kernel(torch.randn(lk.MAX_ROWS + 1, 8), w, lk.SWAP)


def sm120_resources():
    """Resources of every sm_120 config (defaults, adopted, the shipped tuned file's and the router's) compiled for
    sm_120 at K2.6-like strides, per BLOCK_M it can run with, with programmatic dependent launch as the GPU runs
    them (needs real @triton.jit objects); the shared expert's down projection (N x 256) also with glu."""
    from triton_kernels.aot import compile_for
    from triton_kernels.router import MANY_ROWS, ONE_ROW

    tuned = tuning.table("linear", "sm_120") or {}
    configs = set(lk.DEFAULTS["sm_120"].values())
    configs |= {cfg for entries in lk.ADOPTED["sm_120"].values() for cfg in entries.values()}
    configs |= {lk.Config(**cfg) for entries in tuned.values() for cfg in entries.values() if cfg != "cublas"}
    specs = {(cfg, M, False, False) for cfg in configs for M in ((1,) if cfg.kind == "gemv" else (2, 17, 33, 65))}
    specs |= {(cfg, M, True, False) for cfg in (ONE_ROW["sm_120"], MANY_ROWS["sm_120"])  # the router's: raw
              for M in ((1,) if cfg.kind == "gemv" else (2, 17, 33, 65))}
    downs = [(lk.Config(**cfg), int(M)) for shape, entries in tuned.items() if shape.endswith("x256")
             for M, cfg in entries.items() if cfg != "cublas"]
    specs |= {(cfg, M, False, True) for cfg, M in downs if lk.glu_fits(cfg, M, "sm_120")}  # as glue.mlp runs them
    out = []
    for cfg, M, raw, glu in sorted(specs):
        # with glue.norm_linear's prologue (residual and extra), or the router's (residual, the normed row stored)
        prologue = lk.Norm(None, 0, True, normed=True) if raw else lk.Norm(None, 0, True, True)
        for norm in [None] + ([prologue] if cfg.kind == "gemv" else []):  # K = the hidden size
            kernel, signature, constexprs, options = lk.kernel_spec(cfg, M, 7168, 7168, 170, "sm_120", raw, glu, norm)
            res = compile_for(kernel, signature, constexprs, **options)
            out.append(dict(config=list(cfg), glu=glu, norm=norm is not None, block_m=constexprs.get("BLOCK_M", 1),
                            **vars(res)))
    return out


def test_linear_configs_compile_for_sm120():
    code = ("import json; from tests.test_linear_kernel import sm120_resources as r; "
            "print(json.dumps(r()))")
    for res in compiled_in_child(code):
        assert res["shared"] <= arch.SHARED_LIMIT["sm_120"] and res["spill_bytes"] == 0, res
