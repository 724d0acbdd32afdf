"""The Triton W4A16 MoE (triton_kernels/moe_w4a16.py) against the fp32 reference ops.moe_torch."""

import os

import pytest
import torch

import ops
from ops.moe import PackedExperts, moe_torch
from tests.conftest import compiled_in_child, gpu, kernel_dtypes, rel_err, requires_gpu, requires_triton

moe_w4a16 = pytest.importorskip("triton_kernels.moe_w4a16")


def device():
    return torch.device("cuda" if gpu() else "cpu")


def make_experts(E, D, I, seed=0):
    """Random compressed-tensors experts with scales spread over two decades (a wrong group shows)."""
    g = torch.Generator(device()).manual_seed(seed)

    def one(N, K):  # any int32 word is 8 valid nibbles
        words = torch.randint(-2**31, 2**31, (E, N, K // 8), generator=g, device=device(), dtype=torch.int32)
        scale = 10 ** (torch.rand(E, N, K // 32, generator=g, device=device()) * 2 - 3)
        return words, scale.to(torch.bfloat16)

    return (*one(2 * I, D), *one(D, I))


def make_routing(M, E, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).int()
    weights = torch.rand(M, k, generator=g)
    return ids.to(device()), weights.to(device())


def check(x, ids, weights, raw, dtype):
    prepared = moe_w4a16.prepare_moe(*raw)
    out = moe_w4a16.moe(x.to(dtype), ids, weights, prepared)
    ref = moe_torch(x.to(dtype).float(), ids, weights, PackedExperts(*raw))
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("panels", [(0, 0), (64, 128), (1, 1)], ids=["slab", "panel", "kmajor"])
@pytest.mark.parametrize("E,D,I", [(8, 512, 64), (6, 320, 96)], ids=lambda v: str(v))
def test_repack_round_trip_is_exact(E, D, I, panels):
    raw = make_experts(E, D, I)
    prepared = moe_w4a16.prepare_moe(*raw, panels=panels)
    assert (prepared.num_experts, prepared.hidden, prepared.intermediate) == (E, D, I)
    KP8 = -(-D // 256) * 32  # K padded to whole 256-wide slabs
    if panels == (0, 0):
        assert prepared.gate_up.shape == (E, KP8, 2 * I)
    elif panels == (1, 1):  # a column's words contiguous; scales in the slab layout
        assert prepared.gate_up.shape == (E, 2 * I, KP8, 1) and prepared.down.shape == (E, D, -(-I // 256) * 32, 1)
        assert prepared.gate_up_scale.shape == (E, KP8 // 4, 2 * I)
    else:  # gate and up each padded to whole 64-wide panels, down's D to 128-wide ones
        assert prepared.gate_up.shape == (E, 2 * -(-I // 64), KP8, 64)
        assert prepared.down.shape == (E, -(-D // 128), -(-I // 256) * 32, 128)
        assert (prepared.gate_up[:, -1, :, I % 64 or 64:] == moe_w4a16.PAD_WORD).all()
    for got, want in zip(moe_w4a16.unprepare_moe(prepared), raw):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_magic_constants_dequantise_exactly():
    """The bit trick per dtype, mirrored in torch (the interpreter cannot bitcast to bf16): a nibble OR-ed under
    MAGIC reads MAGIC_VALUE + u; for WIDE dtypes a nibble 4 bits up reads MAGIC_VALUE + 16 u."""
    u = torch.arange(16, dtype=torch.int32)
    for dtype, c in moe_w4a16.UNPACK.items():
        for shift, factor in [(0, 1)] + ([(4, 16)] if c["WIDE"] else []):
            bits = ((u << shift) | c["MAGIC"]).to(torch.int16).view(dtype).float()
            assert torch.equal(bits - (c["MAGIC_VALUE"] + 8 * factor), (u - 8).float() * factor), (dtype, shift)
    bf16_wide = ((u << 4) | moe_w4a16.UNPACK[torch.bfloat16]["MAGIC"]).to(torch.int16).view(torch.bfloat16).float()
    assert not torch.equal(bf16_wide, 128 + 16 * u.float())  # why bf16 is not WIDE: 7 mantissa bits


@requires_triton
def test_moe_narrow_unpack_path(monkeypatch):
    """The shift-per-group unpacking bf16 uses, run with fp16 operands (the interpreter's bf16 is unusable)."""
    monkeypatch.setitem(moe_w4a16.UNPACK, torch.float16, dict(moe_w4a16.UNPACK[torch.float16], WIDE=False))
    E, D, I, M = 6, 512, 64, 5
    raw = make_experts(E, D, I, seed=3)
    ids, weights = make_routing(M, E, 2, seed=3)
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(3)).to(device())
    check(x, ids, weights, raw, torch.float16)


@requires_triton
@pytest.mark.parametrize("E,D,I,extra", [(6, 512, 64, {}), (5, 320, 96, {}), (5, 320, 96, {"decode": True}),
                                          (6, 512, 64, {"decode": True})], ids=["even_n", "ragged_n", "decode", "decode_even_n"])
def test_moe_variant_configs(E, D, I, extra):
    """The `lean` configs (loop-carried slab pointers; no column masks when BN divides N) split over K, and the
    decode path (one block per pair, no routing pass; here with a repeated expert), with and without lean."""
    lean = not extra or D == 512
    cfg = {"BM": 16, "gate_up": dict(BN=32, waves=8, num_warps=4, num_stages=2, lean=lean),
           "down": dict(BN=128, waves=8, num_warps=4, num_stages=2, lean=lean), **extra}
    raw = make_experts(E, D, I, seed=4)
    ids, weights = make_routing(3, E, 2, seed=4)
    ids[2] = ids[0]  # two tokens on the same experts
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(4)).to(device()).to(kernel_dtypes()[0])
    out = moe_w4a16.moe(x, ids, weights, moe_w4a16.prepare_moe(*raw), config=cfg)
    assert rel_err(out, moe_torch(x.float(), ids, weights, PackedExperts(*raw))) < 1e-2


@requires_triton
@pytest.mark.parametrize("decode", [False, True], ids=["routing_pass", "decode"])
def test_moe_keep_sums(decode):
    """keep_sums: the routing-pass path returns its fp32 sums, which round to the default output bit for bit; the
    decode path writes x's dtype either way."""
    E, D, I = 6, 512, 64
    cfg = {"BM": 16, "decode": decode, "gate_up": dict(BN=32, waves=8, num_warps=4, num_stages=2),
           "down": dict(BN=128, waves=8, num_warps=4, num_stages=2)}
    raw = make_experts(E, D, I, seed=5)
    prepared = moe_w4a16.prepare_moe(*raw)
    ids, weights = make_routing(3, E, 2, seed=5)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(5)).to(device()).to(kernel_dtypes()[0])
    sums = moe_w4a16.moe(x, ids, weights, prepared, keep_sums=True, config=cfg)
    assert sums.dtype == (x.dtype if decode else torch.float32)
    assert torch.equal(sums.to(x.dtype), moe_w4a16.moe(x, ids, weights, prepared, config=cfg))


@requires_triton
@pytest.mark.parametrize("BM,panels,swap,D,I,down", [(8, (1, 1), True, 576, 96, dict(BN=32, tiles=2)),
                                                     (16, (0, 0), False, 384, 320, dict(BN=64, tiles=3))],
                         ids=["kmajor_bm8", "slab_bm16_down_split"])
def test_moe_decode_sums_are_zeroed_again(BM, panels, swap, D, I, down):
    """The decode path's fp32 sums and arrival counters (gate/up split over K's 3 slabs; down's top-k pairs, and
    its 2 slabs split too in the second case) are zero again after each call, so consecutive calls with other
    tokens and routings stay right; a hidden size not a multiple of the 256-wide slab, an intermediate not one
    of the gate/up tile, several down tiles a program, and a repeated expert."""
    from triton_kernels.counters import arrival_counters

    E = 5
    kernel = dict(BN=32 if BM == 16 else 64, waves=8, num_warps=4, num_stages=2, swap=swap, lop3=True,
                  prescale=swap, scales_ahead=True)
    cfg = {"BM": BM, "panels": panels, "decode": True, "gate_up": kernel, "down": dict(kernel, **down)}
    raw = make_experts(E, D, I, seed=8)
    prepared = moe_w4a16.prepare_moe(*raw, panels=panels)
    for M, seed in ((3, 8), (1, 9)):
        ids, weights = make_routing(M, E, 2, seed=seed)
        ids[-1] = ids[0]
        x = torch.randn(M, D, generator=torch.Generator().manual_seed(seed)).to(device()).to(kernel_dtypes()[0])
        out = moe_w4a16.moe(x, ids, weights, prepared, config=cfg)
        assert rel_err(out, moe_torch(x.float(), ids, weights, PackedExperts(*raw))) < 1e-2, M
        assert not arrival_counters("moe_w4a16", device(), 0).any(), M


@requires_triton
@pytest.mark.parametrize("panels,swap,waves,M,tiles,BM", [((1, 1), True, 64, 7, 3, 8), ((0, 0), False, 1, 3, 1, 16),
                                                         ((1, 1), True, 64, 20, 3, 16)],
                         ids=["kmajor_bm8_split_tiles3", "slab_bm16_items_a_program", "kmajor_bm16_split_tiles3"])
def test_moe_device_split(monkeypatch, panels, swap, waves, M, tiles, BM):
    """`device_split`: the routing pass's count of filled blocks decides gate/up's K split on the device
    (`_plan_split`), and `persistent` down takes its work items from that count. First case: 256 programs for at
    most 14 blocks x 2 tiles, so each tile's 3 slabs split 3 ways (partials summed in split order by the last to
    arrive), down 3 tiles an item (one slab: the pipelined tile loop); second: 8 programs, several work items
    each, no split, down's K loop; third: the first with BM 16 (the sm_90 entry for 65 <= M <= 128), experts
    with more than 8 rows. Ragged shapes and a repeated expert."""
    monkeypatch.setattr(moe_w4a16, "sm_count", lambda device: 4)
    E, D, I = (5, 576, 96) if swap else (6, 320, 96)
    kernel = dict(BN=64 if swap else 32, waves=waves, num_warps=4, num_stages=2, swap=swap, lop3=True,
                  prescale=swap, scales_ahead=True, device_split=True)
    cfg = {"BM": BM, "panels": panels, "gate_up": kernel,
           "down": dict(kernel, BN=64, tiles=tiles, persistent=True)}
    raw = make_experts(E, D, I, seed=10)
    ids, weights = make_routing(M, E, 2, seed=10)
    ids[-1] = ids[0]
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(10)).to(device()).to(kernel_dtypes()[0])
    out = moe_w4a16.moe(x, ids, weights, moe_w4a16.prepare_moe(*raw, panels=panels), config=cfg)
    assert rel_err(out, moe_torch(x.float(), ids, weights, PackedExperts(*raw))) < 1e-2


def assert_three_tokens_match(cfg, panels, E, D, I, seed):
    """Three tokens, the third routed like the first (a repeated expert), through `cfg` in the given layout,
    against the fp32 reference."""
    raw = make_experts(E, D, I, seed=seed)
    ids, weights = make_routing(3, E, 2, seed=seed)
    ids[2] = ids[0]
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(seed)).to(device()).to(kernel_dtypes()[0])
    out = moe_w4a16.moe(x, ids, weights, moe_w4a16.prepare_moe(*raw, panels=panels), config=cfg)
    assert rel_err(out, moe_torch(x.float(), ids, weights, PackedExperts(*raw))) < 1e-2


@requires_triton
@pytest.mark.parametrize("panels,bn,extra", [((64, 128), (64, 128), {"lean": True}), ((64, 64), (32, 64), {}),
                                             ((64, 128), (64, 128), {"lean": True, "decode": True}),
                                             ((64, 64), (32, 32), {"lean": True, "tiles": 2})],
                         ids=["panel_lean", "panel_bn_lt_panel", "panel_decode", "panel_down_tiles2"])
def test_moe_panel_layout(panels, bn, extra):
    """The panel layout on ragged shapes (I and D not multiples of the panel: padded panels), a repeated expert,
    split over K; tiles as wide as the panel or narrower; two down tiles a program."""
    E, D, I = 5, 320, 96
    lean, decode = extra.get("lean", False), extra.get("decode", False)
    cfg = {"BM": 16, "panels": panels, "decode": decode,
           "gate_up": dict(BN=bn[0], waves=8, num_warps=4, num_stages=2, lean=lean),
           "down": dict(BN=bn[1], waves=8, num_warps=4, num_stages=2, lean=lean,
                        tiles=extra.get("tiles", 1))}
    assert_three_tokens_match(cfg, panels, E, D, I, seed=5)


@requires_triton
@pytest.mark.parametrize("BM,panels,extra", [(8, (0, 0), {}), (16, (64, 128), {"lean": True, "tiles": 2}),
                                             (8, (64, 64), {"decode": True}),
                                             (8, (0, 0), {"scales_ahead": True, "waves": 1, "D": 608}),
                                             (16, (64, 128), {"scales_ahead": True, "swap": False, "waves": 1,
                                                              "D": 608}),
                                             (16, (64, 128), {"scales_ahead": True, "tiles": 2}),
                                             (8, (0, 0), {"scales_ahead": True, "tiles": 2, "I": 320}),
                                             (16, (0, 0), {"prescale": True, "waves": 1, "D": 608}),
                                             (8, (64, 128), {"prescale": True, "tiles": 2}),
                                             (16, (0, 0), {"prescale": True, "swap": False}),
                                             (16, (1, 1), {"prescale": True, "waves": 1, "D": 608}),
                                             (8, (1, 1), {"scales_ahead": True, "tiles": 2}),
                                             (16, (1, 1), {"scales_ahead": True, "tiles": 2, "I": 320}),
                                             (8, (1, 1), {"scales_ahead": True, "decode": True}),
                                             (8, (1, 1), {"scales_ahead": True, "mma_v2": True})],
                         ids=["bm8_slab", "bm16_panel_lean_tiles2", "bm8_panel_decode", "bm8_scales_ahead",
                              "unswapped_panel_scales_ahead", "panel_ahead_tiles2",
                              "tiles2_two_slabs_ahead", "prescaled", "bm8_prescaled_tiles2",
                              "unswapped_prescaled", "kmajor_prescaled", "kmajor_bm8_ahead_tiles2",
                              "kmajor_two_slabs_ahead_tiles2", "kmajor_decode_ahead", "kmajor_mma_v2"])
def test_moe_swapped_tiles(BM, panels, extra):
    """`swap` (transposed tiles: weights as the MMA's M operand, tokens its N) on ragged shapes, split over K, a
    repeated expert; with BM 8 (fewer rows than tl.dot's usual 16), panels, lean pointers, two down tiles a
    program (down's K in one slab: the pipelined tile loop, scales a tile ahead; or in two), K-major words
    (panel 1), the decode path,
    `scales_ahead` (three slabs in one split: scales carried across slabs), also unswapped, and `prescale`
    (weights scaled before the MMA); `lop3` runs on the GPU (the interpreter runs the plain form)."""
    E, D, I = 5, extra.get("D", 320), extra.get("I", 96)
    kernel = dict(BN=64, waves=extra.get("waves", 8), num_warps=4, num_stages=2, swap=extra.get("swap", True),
                  lop3=True, lean=extra.get("lean", False), scales_ahead=extra.get("scales_ahead", False),
                  prescale=extra.get("prescale", False), mma_v2=extra.get("mma_v2", False))
    cfg = {"BM": BM, "panels": panels, "decode": extra.get("decode", False), "gate_up": kernel,
           "down": dict(kernel, BN=64 // extra.get("tiles", 1), tiles=extra.get("tiles", 1))}  # tiles x BN | D
    assert_three_tokens_match(cfg, panels, E, D, I, seed=6)


def test_configs_by_intermediate_size():
    """moe_configs.BY_INTERMEDIATE: EP8's experts (intermediate 2048) take the prescaled M = 1 entry and 16-row
    blocks up to M = 128; other sizes the table's entries as they are."""
    from triton_kernels.moe_configs import config_for

    cpu = torch.device("cpu")
    assert config_for(cpu, 1, intermediate=2048)["gate_up"]["prescale"]
    assert config_for(cpu, 1, intermediate=2048)["down"]["prescale"]
    assert config_for(cpu, 64, intermediate=2048)["BM"] == 16
    assert config_for(cpu, 64, intermediate=2048)["gate_up"]["maxnreg"] is None
    assert config_for(cpu, 4, intermediate=2048) == config_for(cpu, 4)
    for M in (1, 4, 33, 64, 129):
        assert config_for(cpu, M, intermediate=256) == config_for(cpu, M)


def test_configs_on_a_newer_triton(monkeypatch):
    """moe_configs.NEWER_TRITON: on a Triton newer than the one the table was tuned on, every sm_90 entry of the
    TP8 shape compiles its dots to mma.sync (prescaled from 129 tokens on); EP8's prescaled M = 1 entry does too
    (NEWER_TRITON_BY_INTERMEDIATE), its 16-row blocks at 34-128 tokens do not; on the tuned Triton nothing changes."""
    from triton_kernels import moe_configs

    cpu = torch.device("cpu")
    monkeypatch.setattr(moe_configs, "triton_version", lambda: moe_configs.TUNED_TRITON)
    tuned = {M: moe_configs.config_for(cpu, M) for M in (1, 4, 9, 33, 65, 129, 600)}
    ep8 = {M: moe_configs.config_for(cpu, M, intermediate=2048) for M in (1, 4, 64)}
    assert not any(cfg[k].get("mma_v2") for cfg in [*tuned.values(), *ep8.values()] for k in ("gate_up", "down"))
    monkeypatch.setattr(moe_configs, "triton_version", lambda: (3, 9))
    for M, cfg in tuned.items():
        newer = moe_configs.config_for(cpu, M)
        assert newer["gate_up"]["mma_v2"] and newer["down"]["mma_v2"], M
        assert newer["gate_up"].get("prescale", False) == (M >= 129 or cfg["gate_up"].get("prescale", False)), M
        assert {k: v for k, v in newer.items() if k not in ("gate_up", "down")} == \
            {k: v for k, v in cfg.items() if k not in ("gate_up", "down")}
    assert moe_configs.config_for(cpu, 1, intermediate=2048) == moe_configs.with_variant(ep8[1], "mma_v2")
    assert moe_configs.config_for(cpu, 1, intermediate=2048)["gate_up"]["prescale"]
    assert moe_configs.config_for(cpu, 4, intermediate=2048) == moe_configs.config_for(cpu, 4)
    assert moe_configs.config_for(cpu, 64, intermediate=2048) == ep8[64]


def test_mma_v2_only_sets_and_restores_the_switch(monkeypatch):
    """`aot.mma_v2_only`: DISABLE_MMA_V3 (read by Triton while it compiles) is set while enabled only, and put back
    as it was afterwards, also when the launch raises."""
    from triton_kernels.aot import mma_v2_only

    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    with mma_v2_only():
        assert os.environ["DISABLE_MMA_V3"] == "1"
    assert "DISABLE_MMA_V3" not in os.environ
    with mma_v2_only(False):
        assert "DISABLE_MMA_V3" not in os.environ
    monkeypatch.setenv("DISABLE_MMA_V3", "0")
    with pytest.raises(RuntimeError), mma_v2_only():
        raise RuntimeError("launch failed")
    assert os.environ["DISABLE_MMA_V3"] == "0"


MMA_OF_ENTRY = """
import json
import torch
from triton_kernels.aot import compile_kernel
from triton_kernels.moe_configs import CONFIGS, with_variant
from triton_kernels.moe_w4a16 import compile_specs, jit_specialisation
cfg = dict(CONFIGS["sm_90"])[1]
out = {}
for name, entry in (("tuned", cfg), ("mma_v2", with_variant(cfg, "mma_v2"))):
    kernel, launch = compile_specs(entry, arch=90)[0]
    ptx = compile_kernel(kernel, *launch, **jit_specialisation(kernel, *launch[:2])).asm["ptx"]
    out[name] = dict(wgmma="wgmma.mma_async" in ptx, mma_sync="mma.sync.aligned" in ptx)
print(json.dumps(out))
"""


def test_mma_v2_entries_compile_to_mma_sync():
    """The M = 1 entry's gate/up for sm_90: with `mma_v2` its dots are mma.sync on any Triton; as tuned, they are
    mma.sync on the Triton the table was tuned on (3.6) and wgmma on newer ones (3.9), which is why
    moe_configs.NEWER_TRITON exists."""
    from triton_kernels.moe_configs import TUNED_TRITON, triton_version

    out = compiled_in_child(MMA_OF_ENTRY)
    assert out["mma_v2"] == dict(wgmma=False, mma_sync=True), out
    assert out["tuned"]["wgmma"] == (triton_version() > TUNED_TRITON), out


@requires_triton
def test_moe_rejects_config_for_another_layout():
    raw = make_experts(4, 256, 64)
    ids, weights = make_routing(2, 4, 2)
    x = torch.randn(2, 256).half().to(device())
    cfg = {"BM": 16, "gate_up": dict(BN=64, waves=1, num_warps=4, num_stages=2),
           "down": dict(BN=128, waves=1, num_warps=4, num_stages=2)}
    with pytest.raises(ValueError, match="must divide the layout's panel"):
        moe_w4a16.moe(x, ids, weights, moe_w4a16.prepare_moe(*raw, panels=(32, 128)), config=cfg)
    with pytest.raises(ValueError, match="must divide the hidden size"):
        moe_w4a16.moe(x, ids, weights, moe_w4a16.prepare_moe(*raw, panels=(0, 0)),
                      config={**cfg, "down": dict(cfg["down"], tiles=3)})
    with pytest.raises(ValueError, match="config for panels"):
        moe_w4a16.moe(x, ids, weights, moe_w4a16.prepare_moe(*raw, panels=(0, 0)), config={**cfg, "panels": (64, 128)})


@requires_triton
@pytest.mark.parametrize("dtype", kernel_dtypes()[:1] if not gpu() else kernel_dtypes(), ids=str)
@pytest.mark.parametrize("M", [1, 3, 17, 64], ids=lambda m: f"M{m}")
def test_moe_matches_reference(M, dtype):
    E, D, I, k = 8, 320, 96, 3  # D and I not multiples of the 256-wide slab: padding and group boundaries
    raw = make_experts(E, D, I, seed=M)
    ids, weights = make_routing(M, E, k, seed=M)
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(M)).to(device())
    check(x, ids, weights, raw, dtype)


@requires_triton
def test_moe_degenerate_routing():
    """Experts with no tokens, all tokens on one expert (more than one block of rows), top-k equal to E."""
    dtype = kernel_dtypes()[0]
    E, D, I, M = 4, 256, 64, 20
    raw = make_experts(E, D, I, seed=1)
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(1)).to(device())
    _, weights = make_routing(M, E, 2, seed=1)
    one_expert = torch.stack([torch.full((M,), 2), torch.arange(M) % 2], 1).int().to(device())  # 1, 3 idle
    check(x, one_expert, weights, raw, dtype)
    everyone = torch.stack([torch.randperm(E) for _ in range(M)]).int().to(device())
    check(x, everyone, torch.rand(M, E).to(device()), raw, dtype)


@requires_triton
def test_moe_through_the_op_boundary():
    raw = make_experts(4, 256, 32, seed=2)
    ids, weights = make_routing(5, 4, 2, seed=2)
    x = torch.randn(5, 256).to(device()).to(kernel_dtypes()[0])
    with ops.using(moe="triton"):
        prepared = ops.prepare_moe(*raw)
        assert prepared.backend == "triton"
        out = ops.moe(x, ids, weights, prepared)
    with ops.using(moe="torch"):
        ref = ops.moe(x.float(), ids, weights, ops.prepare_moe(*raw))
        with pytest.raises(ValueError, match="prepared for 'triton'"):
            ops.moe(x, ids, weights, prepared)
    assert rel_err(out, ref) < 1e-2


@requires_triton
def test_moe_rejects_bad_inputs():
    prepared = moe_w4a16.prepare_moe(*make_experts(4, 256, 32))
    ids, weights = make_routing(2, 4, 2)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        moe_w4a16.moe(torch.randn(2, 256).to(device()), ids, weights, prepared)
    with pytest.raises(ValueError, match="int32"):
        moe_w4a16.moe(torch.randn(2, 256).half().to(device()), ids.long(), weights, prepared)


@requires_gpu
@pytest.mark.parametrize("M", [1, 8, 64, 256], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("E,I", [(384, 256), (48, 2048)], ids=["tp8", "ep8"])
def test_moe_k26_shapes_gpu(M, E, I):
    raw = make_experts(E, 7168, I, seed=M)
    ids, weights = make_routing(M, E, 8, seed=M)
    x = torch.randn(M, 7168, device="cuda")
    check(x, ids, weights, raw, torch.bfloat16)


@requires_gpu
@pytest.mark.parametrize("variant", ["default", "k_swap8_pre", "device_split", "prescale", "mma_v2",
                                     "mma_v2_prescale"])
def test_moe_variants_in_a_graph_gpu(variant):
    """The entries (the two-launch decode path with programmatic dependent launch up to M = 4, the routing pass
    above) and the variants (the routing-pass entry at small M, the device-split gate/up with the persistent
    down) at the TP8 expert shape on 16 experts, M = 1, 3, 24 and 100 (the BM 16 entry), eager and replayed three
    times in a CUDA graph (where launches overlap, and the decode path's sums and counters must be zero again after
    each replay), against the fp32 reference."""
    from triton_kernels.moe_configs import config_for, with_variant

    raw = make_experts(16, 7168, 256, seed=7)
    for M in (1, 3, 24, 100):
        cfg = config_for(device(), M) if variant == "default" else with_variant(config_for(device(), M), variant)
        prepared = moe_w4a16.prepare_moe(*raw, panels=cfg.get("panels", (0, 0)))
        ids, weights = make_routing(M, 16, 8, seed=M)
        x = torch.randn(M, 7168, device="cuda").to(torch.bfloat16)
        ref = moe_torch(x.float(), ids, weights, PackedExperts(*raw))
        assert rel_err(moe_w4a16.moe(x, ids, weights, prepared, config=cfg), ref) < 1e-2
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe_w4a16.moe(x, ids, weights, prepared, config=cfg)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_w4a16.moe(x, ids, weights, prepared, config=cfg)
        out.fill_(float("nan"))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < 1e-2, (variant, M)


AOT_CHECK = """
import json
from triton_kernels.aot import compile_for
from triton_kernels.moe_configs import CONFIGS
from triton_kernels.moe_w4a16 import compile_specs
print(json.dumps([(kernel.__name__, max_m, vars(compile_for(kernel, *launch)))
                  for max_m, cfg in CONFIGS["sm_120"] for kernel, launch in compile_specs(cfg)]))
"""


PTX_COMPILE = """
import json
import sys
import torch
from triton_kernels.aot import compile_for
from triton_kernels.moe_configs import config_for, with_variant
from triton_kernels.moe_w4a16 import compile_specs, jit_specialisation
cfg = config_for(torch.device("cpu"), int(sys.argv[2]))
cfg = cfg if sys.argv[1] == "default" else with_variant(cfg, sys.argv[1])
print(json.dumps([dict(arch=arch, maxnreg=launch[5],
                       **vars(compile_for(kernel, *launch, **jit_specialisation(kernel, *launch[:2]))))
                  for arch in (90, 120) for kernel, launch in compile_specs(cfg, arch=arch)]))
"""


@pytest.mark.parametrize("variant,M", [("default", 1), ("device_split", 16), ("default", 100)])
def test_inline_ptx_variants_compile(variant, M):
    """sm_90 entries and variants with inline PTX (lop3, L2 prefetch, grid dependency control), which the
    interpreter cannot run, assemble for sm_90 without spills (a kernel capped at `maxnreg` registers, measured
    faster so, may spill up to 64 bytes: the M <= 128 entry's gate/up spills 12 under Triton 3.6, none under 3.9
    with NEWER_TRITON's mma.sync, 48 with wgmma)
    and for sm_120 (within its shared memory; they do not run there: sm_120's own entries are held to no spills
    by test_sm120_configs_fit. The BM 16 entry's persistent down spills 16 bytes for sm_120 under Triton 3.6,
    none under 3.9)."""
    from triton_kernels.aot import SM120_SHARED_LIMIT

    results = compiled_in_child(PTX_COMPILE, variant, str(M))
    assert all(res["spill_bytes"] <= (64 if res["maxnreg"] else 0) for res in results if res["arch"] == 90), results
    assert all(res["shared"] <= SM120_SHARED_LIMIT for res in results if res["arch"] == 120), results


def test_sm120_configs_fit():
    """Every sm_120 config compiles for sm_120 within its shared memory and without spills.

    Runs in a subprocess: under TRITON_INTERPRET=1 the kernels are interpreter objects that cannot be compiled.
    """
    from triton_kernels.aot import SM120_SHARED_LIMIT
    from triton_kernels.moe_configs import CONFIGS

    results = compiled_in_child(AOT_CHECK)
    assert len(results) == 2 * len(CONFIGS["sm_120"])
    for name, max_m, res in results:
        assert res["shared"] <= SM120_SHARED_LIMIT and res["spill_bytes"] == 0, (name, max_m, res)
