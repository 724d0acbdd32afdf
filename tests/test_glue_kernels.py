"""Triton RMSNorm, RoPE and router against their torch references (interpreter on CPU, compiled on a GPU)."""

import pytest
import torch

import ops
from ops.moe import route_torch
from ops.norm import rms_norm_torch
from ops.rope import apply_rope_torch
from triton_kernels import arch
from tests.conftest import TRITON_DEVICE, compiled_in_child, kernel_dtypes, rel_err, requires_triton

DEV = TRITON_DEVICE


@requires_triton
@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("shape", [(1, 7168), (3, 5, 1536), (7, 512), (2, 33)])
def test_rms_norm_matches_reference(shape, dtype):
    from triton_kernels.glue import rms_norm

    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=gen)).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(DEV)
    out = rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, rms_norm_torch(x, w, 1e-6)) < 5e-3


@requires_triton
def test_rms_norm_of_a_column_slice():
    """The model norms ckv[:, :512] of a [N, 576] projection: rows strided by 576."""
    from triton_kernels.glue import rms_norm

    ckv = torch.randn(6, 576, dtype=torch.float16).to(DEV)
    w = torch.rand(512, dtype=torch.float16).to(DEV)
    out = rms_norm(ckv[:, :512], w, 1e-6)
    assert out.is_contiguous()
    assert rel_err(out, rms_norm_torch(ckv[:, :512], w, 1e-6)) < 5e-3


@requires_triton
@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("N,H,R", [(1, 1, 64), (5, 8, 64), (3, 3, 16)])
def test_rope_matches_reference(N, H, R, dtype):
    from triton_kernels.glue import apply_rope

    gen = torch.Generator().manual_seed(N * H + R)
    x = torch.randn(N, H, R, generator=gen).to(dtype).to(DEV)
    positions = torch.tensor([0, 1, 4097, 131071, 262143, 17, 3][:N]).to(DEV)
    yarn = dict(type="yarn", factor=64.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                mscale=1.0, mscale_all_dim=1.0)
    inv_freq, _ = ops.yarn_inv_freq(R, 50000.0, yarn)
    inv_freq = inv_freq.to(DEV)
    out = apply_rope(x, positions, inv_freq, 1.25)
    assert out.shape == x.shape and out.is_contiguous()
    assert rel_err(out, apply_rope_torch(x, positions, inv_freq, 1.25)) < 5e-3


@requires_triton
def test_rope_of_strided_views():
    """q_pe is a split of [N, H, 192] rows and k_pe a [N, 1, 64] column slice of the kv projection."""
    from triton_kernels.glue import apply_rope

    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    q = torch.randn(4, 8, 192, dtype=torch.float16).to(DEV)
    ckv = torch.randn(4, 576, dtype=torch.float16).to(DEV)
    positions = torch.tensor([3, 9, 1000, 5]).to(DEV)
    for view in (q[..., 128:], ckv[:, None, 512:]):
        out = apply_rope(view, positions, inv_freq.to(DEV))
        assert rel_err(out, apply_rope_torch(view, positions, inv_freq.to(DEV))) < 5e-3


@requires_triton
def test_rope_rejects_a_rope_dim_that_is_not_twice_a_power_of_two():
    from triton_kernels.glue import apply_rope

    with pytest.raises(ValueError, match="power of two"):
        apply_rope(torch.zeros(1, 1, 12).to(DEV), torch.zeros(1, dtype=torch.int64).to(DEV), torch.ones(6).to(DEV))


@requires_triton
@pytest.mark.parametrize("M,E,D,top_k,n_group,topk_group,norm", [
    (1, 384, 7168, 8, 1, 1, True),  # K2.6, one token
    (19, 64, 200, 4, 4, 2, True),  # grouped, D not a multiple of the tile
    (5, 48, 64, 6, 1, 1, False),
    (3, 8, 32, 8, 2, 2, True),  # top_k = E
])
def test_router_matches_reference(M, E, D, top_k, n_group, topk_group, norm):
    from triton_kernels.router import route

    dtype = kernel_dtypes()[0]
    gen = torch.Generator().manual_seed(M * E + D)
    x = torch.randn(M, D, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(E, D, generator=gen) / D ** 0.5).to(dtype).to(DEV)
    bias = (0.1 * torch.randn(E, generator=gen)).to(DEV)
    weights, ids = route(x, w, bias, top_k, n_group, topk_group, 2.5, norm)
    ref_weights, ref_ids = route_torch(x, w, bias, top_k, n_group, topk_group, 2.5, norm)
    assert ids.dtype == torch.int32 and torch.equal(ids.cpu(), ref_ids.cpu())
    assert rel_err(weights, ref_weights) < 1e-4


def sm120_resources():
    """Resources of each glue kernel compiled for sm_120 with programmatic dependent launch, as the GPU runs them
    (needs real @triton.jit objects: no interpreter)."""
    from triton_kernels.absorb import OUTPUT_TILES, _absorb_output_kernel, _absorb_query_kernel
    from triton_kernels.aot import compile_for
    from triton_kernels.glue import _head_norm_rope_kernel, _rms_norm_kernel, _rope_kernel
    from triton_kernels.router import BLOCK_E, LOGITS_TILE, SELECT_WARPS, _logits_kernel, _select_kernel

    return [
        compile_for(_rms_norm_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", stride_x="i32",
                                           stride_out="i32", D="i32", eps="fp32"), dict(BLOCK_D=8192, PDL=True), num_warps=8),
        compile_for(_rope_kernel, dict(x_ptr="*bf16", pos_ptr="*i64", freq_ptr="*fp32", out_ptr="*bf16",
                                       stride_xn="i32", stride_xh="i32", H="i32", factor="fp32"),
                    dict(HALF=32, BLOCK_H=64, PDL=True)),
        compile_for(_head_norm_rope_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", pos_ptr="*i64", freq_ptr="*fp32",
                                                 out_ptr="*bf16", stride_xn="i32", stride_xh="i32", H="i32", eps="fp32",
                                                 factor="fp32"), dict(HALF=64, BLOCK_H=8, PDL=True)),
        compile_for(_logits_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", part_ptr="*fp32", M="i32", E="i32", D="i32",
                                         d_per_split="i32"),
                    dict(BLOCK_M=LOGITS_TILE["sm_120"][0], BLOCK_E=BLOCK_E, BLOCK_D=LOGITS_TILE["sm_120"][1],
                         EVEN_D=True, PDL=True), num_stages=3, aligned=True, divisible=("D", "d_per_split")),
        compile_for(_select_kernel, dict(part_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i32",
                                         M="i32", E="i32", splits="i32", group_size="i32", n_group="i32",
                                         topk_group="i32", top_k="i32", scaling="fp32"),
                    dict(NORM=True, BLOCK_E=512, BLOCK_G=1, BLOCK_K=8, BLOCK_S=16, PDL=True),
                    num_warps=SELECT_WARPS["sm_120"]),
        compile_for(_absorb_query_kernel, dict(qn_ptr="*bf16", qp_ptr="*bf16", w_ptr="*bf16", pos_ptr="*i64",
                                               freq_ptr="*fp32", out_ptr="*bf16", N="i32", H="i32", stride_qn="i32",
                                               stride_qnh="i32", stride_qp="i32", stride_qph="i32", stride_wh="i32",
                                               stride_wd="i32", factor="fp32", ckv_ptr="*bf16", lw_ptr="*bf16",
                                               starts_ptr="*i32", kv_ptr="*bf16", T="i32", stride_ckv="i32",
                                               stride_kb="i64", eps="fp32"),
                    dict(DN=128, R=512, HALF=32, BLOCK_N=16, BLOCK_C=64, WRITE=True, LATENT=512, PDL=True),
                    aligned=True),
        *(compile_for(_absorb_output_kernel, dict(o_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", N="i32", H="i32",
                                                  stride_on="i32", stride_oh="i32", stride_wh="i32", stride_wd="i32"),
                      dict(R=512, DV=128, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_K=block_k, PDL=True),
                      num_stages=stages, aligned=True)
          for block_n in (16, 64) for _, block_d, block_k, stages in OUTPUT_TILES["sm_120"]),
    ]


def test_glue_kernels_compile_for_sm120():
    code = ("import json; from tests.test_glue_kernels import sm120_resources as r; "
            "print(json.dumps([vars(x) for x in r()]))")
    for res in compiled_in_child(code):
        assert res["shared"] <= arch.SHARED_LIMIT["sm_120"] and res["spill_bytes"] == 0, res


@requires_triton
@pytest.mark.parametrize("fp32_x", [False, True], ids=["x", "fp32_x"])
@pytest.mark.parametrize("extra", [False, True], ids=["two", "extra"])
@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("M,D", [(1, 7168), (5, 100)])
def test_add_rms_norm_matches_reference(M, D, dtype, extra, fp32_x):
    """extra: a third input (a MoE's shared expert output) added to x first, rounded as a separate add; fp32_x: x
    as fp32 sums (a MoE's routed output with keep_sums), rounded to the residual's dtype first."""
    from ops.norm import add_rms_norm_torch
    from triton_kernels.glue import add_rms_norm

    gen = torch.Generator().manual_seed(M + D)
    x, r, e = (torch.randn(3, M, D, generator=gen) * 4).to(DEV)
    x, r, e = (x if fp32_x else x.to(dtype)), r.to(dtype), (e.to(dtype) if extra else None)
    w = torch.rand(D, generator=gen).to(dtype).to(DEV)
    h, out = add_rms_norm(x, r, w, 1e-6, e)
    ref_h, ref_out = add_rms_norm_torch(x, r, w, 1e-6, e)
    assert h.dtype == dtype and torch.equal(h, ref_h)  # the adds round exactly like torch's
    x = x.to(dtype)
    if extra:
        assert torch.equal(h, (x + e) + r) and not torch.equal(h, x + (e + r))  # in that order
    assert rel_err(out, ref_out) < 5e-3


@requires_triton
@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("B,T", [(3, 5), (2, 20)])
def test_absorb_query_writes_the_latent_entries(dtype, B, T):
    """With a LatentWrite the query kernel also writes the new tokens' entries [norm(c) ; rope(k_pe)] (ckv's rows
    strided, as the model's q_a/kv_a output is; 40 tokens span three query blocks), and nothing else."""
    from ops.absorb import LatentWrite, absorb_query_torch
    from triton_kernels.absorb import absorb_query

    L, N = 48, B * T
    gen = torch.Generator().manual_seed(7 + T)
    ckv = torch.randn(N, 700, generator=gen).to(dtype).to(DEV)[:, 100:676]
    w = torch.rand(512, generator=gen).to(dtype).to(DEV)
    positions = torch.randint(0, 200000, (N,), generator=gen).to(DEV)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)).to(DEV)
    starts = torch.tensor([0, 17, 25][:B], dtype=torch.int32).to(DEV)
    cache = torch.randn(B, L, 576, generator=gen).to(dtype).to(DEV)
    ref = cache.clone()
    q = torch.randn(N, 2, 96, generator=gen).to(dtype).to(DEV)
    w_uk = (torch.randn(2, 32, 128, generator=gen) / 6).to(dtype).to(DEV)
    args = (q[..., :32], q[..., 32:], w_uk, positions, inv_freq, 1.1)
    out = absorb_query(*args, LatentWrite(cache, ckv, w, 1e-6, starts))
    assert rel_err(out, absorb_query_torch(*args, LatentWrite(ref, ckv, w, 1e-6, starts))) < 5e-3
    written = torch.zeros(B, L, dtype=torch.bool)
    for b, s in enumerate(starts.tolist()):
        written[b, s:s + T] = True
    assert torch.equal(cache[~written.to(DEV)], ref[~written.to(DEV)])  # nothing else touched
    assert rel_err(cache[written.to(DEV)], ref[written.to(DEV)]) < 5e-3


@requires_triton
@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("N,H,hd", [(5, 8, 128), (3, 3, 64)])
def test_head_norm_rope_matches_reference(N, H, hd, dtype):
    """Rows of a projection's output viewed as heads (strided rows), as the drafter passes them."""
    from ops.rope import head_norm_rope_torch
    from triton_kernels.glue import head_norm_rope

    gen = torch.Generator().manual_seed(N * H + hd)
    x = (3 * torch.randn(N, H * hd + 16, generator=gen)).to(dtype).to(DEV)[:, 16:].view(N, H, hd)
    w = (1 + 0.1 * torch.randn(hd, generator=gen)).to(dtype).to(DEV)
    positions = torch.randint(0, 100000, (N,), generator=gen).to(DEV)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)).to(DEV)
    out = head_norm_rope(x, w, 1e-6, positions, inv_freq, 1.2)
    ref = head_norm_rope_torch(x, w, 1e-6, positions, inv_freq, 1.2)
    assert out.shape == (N, H, hd) and out.is_contiguous() and rel_err(out, ref) < 5e-3


def test_head_norm_rope_rejects_mismatched_shapes():
    import ops

    with pytest.raises(ValueError, match="head_norm_rope"):
        ops.head_norm_rope(torch.zeros(2, 4, 64), torch.ones(32), 1e-6, torch.zeros(2, dtype=torch.int64),
                           torch.ones(32))


def test_absorb_query_rejects_a_latent_write_that_does_not_fit():
    import ops

    q, w_uk, positions = torch.zeros(4, 2, 96), torch.zeros(2, 32, 128), torch.zeros(4, dtype=torch.int64)
    write = ops.LatentWrite(torch.zeros(2, 8, 576), torch.zeros(4, 576), torch.ones(512), 1e-6,
                            torch.zeros(2, dtype=torch.int32))
    args = (q[..., :32], q[..., 32:], w_uk, positions, torch.ones(32), 1.0)
    ops.absorb_query(*args, write)
    for bad in (write._replace(ckv=torch.zeros(3, 576)), write._replace(starts=torch.zeros(3, dtype=torch.int32)),
                write._replace(norm_weight=torch.ones(500))):
        with pytest.raises(ValueError, match="write"):
            ops.absorb_query(*args, bad)


@requires_triton
@pytest.mark.parametrize("M,I", [(1, 768), (3, 1500)])
def test_mlp_matches_reference(M, I):
    from ops.mlp import mlp_torch
    from triton_kernels.glue import mlp

    dtype = kernel_dtypes()[0]
    gen = torch.Generator().manual_seed(I)
    x = torch.randn(M, 96, generator=gen).to(dtype).to(DEV)
    gate_up = (torch.randn(2 * I, 96, generator=gen) / 10).to(dtype).to(DEV)
    down = (torch.randn(96, I, generator=gen) / 30).to(dtype).to(DEV)
    assert rel_err(mlp(x, gate_up, down), mlp_torch(x, gate_up, down)) < 5e-3


@requires_triton
@pytest.mark.parametrize("M", [1, 3])
def test_mlp_forms_the_activation_in_the_down_projection(M, monkeypatch):
    """Where the down projection runs the skinny GEMM, mlp hands it [gate ; up] and launches no silu kernel: the
    bits of gate/up, the silu kernel, then the same config on its output."""
    import torch.nn.functional as F

    from tests.test_linear_kernel import silu_mul_rows
    from triton_kernels import glue, linear

    dtype, I = kernel_dtypes()[0], 200
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, 96, generator=gen).to(dtype).to(DEV)
    gate_up = (torch.randn(2 * I, 96, generator=gen) / 10).to(dtype).to(DEV)
    down = (torch.randn(96, I, generator=gen) / 30).to(dtype).to(DEV)
    cfg = linear.Config("gemv", 16, 128, 4, 3, 2) if M == 1 else linear.Config("dot", 32, 128, 4, 4, 2)
    expected = linear.linear_kernel(silu_mul_rows(F.linear(x, gate_up)), down, cfg)
    monkeypatch.setattr(linear, "kernel_config", lambda x, w: cfg if w is down else None)
    monkeypatch.setattr(glue, "_silu_mul_kernel", None)  # launching it would fail
    assert torch.equal(glue.mlp(x, gate_up, down), expected)


@requires_triton
@pytest.mark.parametrize("M,max_d", [(1, None), (1, 64), (3, None)], ids=["fused", "too-wide", "rows"])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_linear_fuses_one_row_on_the_gemv(M, max_d, residual, monkeypatch):
    """One row on a gemv config within NORM_IN_GEMV_MAX_D: one launch of the gemv with the norm prologue (the norm
    kernels would fail); otherwise the norm kernel then the projection. Both against the torch reference."""
    from ops.norm import norm_linear_torch
    from triton_kernels import glue, linear

    dtype, D = kernel_dtypes()[0], 96
    gen = torch.Generator().manual_seed(M + D)
    x, r, e = (torch.randn(M, D, generator=gen).to(dtype).to(DEV) for _ in range(3))
    nw = (1 + torch.randn(D, generator=gen) / 4).to(dtype).to(DEV)
    w = (torch.randn(40, D, generator=gen) / 10).to(dtype).to(DEV)
    cfg = linear.Config("gemv", 16, 64, 4, 3, 2) if M == 1 else linear.Config("dot", 32, 64, 4, 4, 2)
    monkeypatch.setattr(linear, "kernel_config", lambda x, weight: cfg if weight is w else None)
    monkeypatch.setitem(glue.NORM_IN_GEMV_MAX_D, arch.current(x.device), max_d or D)
    fused = M == 1 and max_d is None
    if fused:
        monkeypatch.setattr(glue, "_rms_norm_kernel", None)
        monkeypatch.setattr(glue, "_add_rms_norm_kernel", None)
    args = (x, nw, 1e-6, w) + ((r, e) if residual else ())
    h, y = glue.norm_linear(*args)
    h_ref, y_ref = norm_linear_torch(*args)
    assert torch.equal(h, h_ref) if residual else h is x
    assert y.shape == (M, 40) and rel_err(y, y_ref) < 1e-2


def test_norm_linear_rejects_what_does_not_fit():
    x, nw, w = torch.zeros(2, 8), torch.ones(8), torch.zeros(4, 8)
    assert ops.norm_linear(x, nw, 1e-6, w)[1].shape == (2, 4)
    for args, kw in [((x, torch.ones(7), 1e-6, w), {}), ((x, nw, 1e-6, torch.zeros(4, 6)), {}),
                     ((x, nw, 1e-6, w.double()), {}), ((x, nw, 1e-6, w), dict(extra=x)),
                     ((x, nw, 1e-6, w), dict(residual=torch.zeros(3, 8))), ((x[0], nw, 1e-6, w), {})]:
        with pytest.raises(ValueError, match="norm_linear"):
            ops.norm_linear(*args, **kw)


@requires_triton
def test_router_logits_kernel_past_the_skinny_gemm():
    """More tokens than the skinny GEMM takes: the logits kernel (several token blocks, a ragged last one, D off
    the tile), then the select kernel."""
    from triton_kernels import linear as lk
    from triton_kernels import router

    dtype = kernel_dtypes()[0]
    gen = torch.Generator().manual_seed(3)
    M = lk.MAX_ROWS + 2
    x = torch.randn(M, 300, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(48, 300, generator=gen) / 17).to(dtype).to(DEV)
    bias = (0.1 * torch.randn(48, generator=gen)).to(DEV)
    weights, ids = router.route(x, w, bias, 8, 4, 2, 2.5)
    ref_weights, ref_ids = route_torch(x, w, bias, 8, 4, 2, 2.5)
    assert torch.equal(ids.cpu(), ref_ids.cpu()) and rel_err(weights, ref_weights) < 1e-4


ROUTER_ON_LINEAR = [  # (router table, its linear Config, tokens, D, seed): K-split partials the select sums
    ("ONE_ROW", ("gemv", 8, 512, 4, 4, 2), 1, 1100, 11),
    ("ONE_ROW", ("gemv", 16, 256, 4, 6, 2), 1, 1100, 11),
    ("MANY_ROWS", ("dot", 32, 128, 4, 4, 2, False, True), 5, 1096, 5),
    ("MANY_ROWS", ("swap", 64, 128, 4, 4, 2, False, True), 33, 1096, 33),
]


@requires_triton
@pytest.mark.parametrize("attr,cfg,M,D,seed", ROUTER_ON_LINEAR, ids=["gemv-bn8", "gemv-bn16", "dot-M5", "swap-M33"])
def test_router_logits_on_the_skinny_gemm(monkeypatch, attr, cfg, M, D, seed):
    """The logits as the skinny GEMM's unsummed K-split partials (several splits, a K off the tile), summed by the
    select kernel: one token on the gemv (`ONE_ROW`), several on the dot tiles through tensor descriptors
    (`MANY_ROWS`: rows past M not loaded): the reference's experts and weights."""
    from ops.moe import route_torch
    from triton_kernels import linear as lk
    from triton_kernels import router

    monkeypatch.setitem(getattr(router, attr), arch.current(torch.device(DEV)), lk.Config(*cfg))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=gen).to(kernel_dtypes()[0]).to(DEV)
    w = (torch.randn(40, D, generator=gen) / 33).to(x.dtype).to(DEV)
    bias = (0.01 * torch.randn(40, generator=gen)).to(DEV)
    assert router.logits(x, w).shape[0] > 1  # several K splits
    weights, ids = router.route(x, w, bias, 6, 1, 1, 2.5)
    ref_w, ref_ids = route_torch(x.float(), w.float(), bias, 6, 1, 1, 2.5)
    assert torch.equal(ids, ref_ids) and rel_err(weights, ref_w) < 1e-4


@requires_triton
def test_router_sums_many_k_splits(monkeypatch):
    """On a GPU the logits kernel splits D over up to 16 programs; here 8, with the SMs of a larger GPU."""
    from triton_kernels import linear as lk
    from triton_kernels import router

    monkeypatch.setattr(arch, "sm_count", lambda device: 64)
    dtype = kernel_dtypes()[0]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(lk.MAX_ROWS + 1, 1000, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(40, 1000, generator=gen) / 40).to(dtype).to(DEV)
    bias = torch.zeros(40).to(DEV)
    assert router.logits(x, w).shape[0] == 8
    weights, ids = router.route(x, w, bias, 6, 1, 1, 1.0)
    ref_weights, ref_ids = route_torch(x, w, bias, 6, 1, 1, 1.0)
    assert torch.equal(ids.cpu(), ref_ids.cpu()) and rel_err(weights, ref_weights) < 1e-4


@requires_triton
@pytest.mark.parametrize("M,x_fp32,fused", [(1, False, True), (1, True, True), (1, False, False), (3, False, True)],
                         ids=["one_row", "one_row_fp32_x", "one_row_unfused", "three_rows"])
def test_norm_route_is_the_norm_then_the_router(monkeypatch, M, x_fp32, fused):
    """norm_route: h and the normed rows as glue's add_rms_norm gives them, and the experts and weights that the
    router picks from those rows (one row: the norm in the logits gemv's prologue, a K off the tile;
    unfused or several rows: the norm kernel, then `route`)."""
    from triton_kernels import glue, router

    norm_kernel = glue.add_rms_norm
    monkeypatch.setitem(router.NORM_IN_LOGITS_MAX_D, arch.current(torch.device(DEV)), router.NORM_MAX_K if fused else 0)
    if fused and M == 1:
        monkeypatch.setattr(glue, "add_rms_norm", None)  # the fused path launches no norm kernel
    dtype = kernel_dtypes()[0]
    gen = torch.Generator().manual_seed(M + 7)
    D, E = 1100, 48
    x = torch.randn(M, D, generator=gen).to(torch.float32 if x_fp32 else dtype).to(DEV)
    r = torch.randn(M, D, generator=gen).to(dtype).to(DEV)
    nw = (1 + torch.randn(D, generator=gen) / 4).to(dtype).to(DEV)
    w = (torch.randn(E, D, generator=gen) / D ** 0.5).to(dtype).to(DEV)
    bias = (0.1 * torch.randn(E, generator=gen)).to(DEV)
    h, normed, weights, ids = router.norm_route(x, r, nw, 1e-6, w, bias, 6, 4, 2, 2.5)
    ref_h, ref_normed = norm_kernel(x, r, nw, 1e-6)
    assert torch.equal(h, ref_h)
    assert torch.equal(normed, ref_normed) if not normed.is_cuda else rel_err(normed, ref_normed) < 1e-2
    ref_weights, ref_ids = route_torch(normed, w, bias, 6, 4, 2, 2.5)
    assert torch.equal(ids.cpu(), ref_ids.cpu()) and rel_err(weights, ref_weights) < 1e-4


def _stable_top_k(x, w, bias, top_k, n_group, topk_group):
    """Reference ids where ties go to the lower group and the lower expert (stable descending sorts)."""
    choice = (x.float() @ w.float().T).sigmoid() + bias.float()  # logits exact, as the kernel's
    M, E = choice.shape
    group_score = choice.view(M, n_group, -1).sort(dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
    kept = group_score.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group]
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
    choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    return choice.sort(dim=-1, descending=True, stable=True).indices[:, :top_k].to(torch.int32)


@requires_triton
def test_router_ties_go_to_the_lower_expert():
    """Logits exact in fp32 (small integers over a power of two), experts in equal pairs and groups g and g + 3
    equal: the last pick and the kept group fall in a tie."""
    from triton_kernels import router

    dtype = kernel_dtypes()[0]
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-2, 3, (4, 96), generator=gen).to(dtype).to(DEV)
    groups = (torch.randint(-2, 3, (3, 3, 96), generator=gen) / 64).repeat_interleave(2, 1).repeat(2, 1, 1)
    w = groups.reshape(36, 96).to(dtype).to(DEV)  # 6 groups of 6 experts
    bias = torch.zeros(36).to(DEV)
    for n_group, topk_group in ((1, 1), (6, 1), (6, 3)):
        weights, ids = router.route(x, w, bias, 5, n_group, topk_group, 1.0)
        assert torch.equal(ids.cpu(), _stable_top_k(x.cpu(), w.cpu(), bias.cpu(), 5, n_group, topk_group))


@requires_triton
@pytest.mark.parametrize("N,H,dn,R", [(1, 8, 128, 512), (19, 4, 32, 512), (70, 2, 32, 128)])
def test_absorb_query_matches_reference(N, H, dn, R):
    from ops.absorb import absorb_query_torch
    from triton_kernels.absorb import absorb_query

    dtype = kernel_dtypes()[0]
    gen = torch.Generator().manual_seed(N + R)
    q = torch.randn(N, H, dn + 64, generator=gen).to(dtype).to(DEV)  # q_nope and q_pe are views, as in the model
    w_kv = (torch.randn(H, dn + 32, R, generator=gen) / dn ** 0.5).to(dtype).to(DEV)
    positions = torch.randint(0, 150000, (N,), generator=gen).to(DEV)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)).to(DEV)
    args = (q[..., :dn], q[..., dn:], w_kv[:, :dn], positions, inv_freq, 1.2)
    out, ref = absorb_query(*args), absorb_query_torch(*args)
    assert out.shape == (N, H, R + 64)
    assert rel_err(out[..., :R], ref[..., :R]) < 5e-3 and rel_err(out[..., R:], ref[..., R:]) < 5e-3


@requires_triton
@pytest.mark.parametrize("N,H,dv,R", [(1, 8, 128, 512), (19, 4, 32, 512), (70, 2, 64, 256)])
def test_absorb_output_matches_reference(N, H, dv, R):
    from ops.absorb import absorb_output_torch
    from triton_kernels.absorb import absorb_output

    dtype = kernel_dtypes()[0]
    gen = torch.Generator().manual_seed(N + dv)
    o_lat = torch.randn(N, H, R, generator=gen).to(dtype).to(DEV)
    w_kv = (torch.randn(H, 16 + dv, R, generator=gen) / R ** 0.5).to(dtype).to(DEV)
    out, ref = absorb_output(o_lat, w_kv[:, 16:]), absorb_output_torch(o_lat, w_kv[:, 16:])
    assert out.shape == (N, H * dv) and rel_err(out, ref) < 5e-3


def test_outgrown_arrival_counters_stay_alive():
    """A graph captured with a counter buffer keeps replaying into it after a larger request replaces it."""
    import weakref

    from triton_kernels.counters import arrival_counters

    small = arrival_counters("test_outgrown", "cpu", 16)
    alive = weakref.ref(small)
    del small
    large = arrival_counters("test_outgrown", "cpu", 10_000)
    assert large.numel() >= 10_000 and not large.any()
    assert alive() is not None and arrival_counters("test_outgrown", "cpu", 1) is large
