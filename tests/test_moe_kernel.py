"""The Triton W4A16 MoE (triton_kernels/moe_w4a16.py) against the fp32 reference ops.moe_torch."""

import json
import os

import pytest
import torch

import ops
from ops.moe import PackedExperts, moe_torch
from tests.conftest import compiled_in_child, gpu, kernel_dtypes, rel_err, requires_gpu, requires_triton

moe_w4a16 = pytest.importorskip("triton_kernels.moe_w4a16")
from triton_kernels import arch, moe_configs, moe_layout, tuning  # noqa: E402


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
    prepared = moe_layout.prepare_moe(*raw)
    out = moe_w4a16.moe(x.to(dtype), ids, weights, prepared)
    ref = moe_torch(x.to(dtype).float(), ids, weights, PackedExperts(*raw))
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("kmajor", [False, True], ids=["slab", "kmajor"])
@pytest.mark.parametrize("E,D,I", [(8, 512, 64), (6, 320, 96)], ids=lambda v: str(v))
def test_repack_round_trip_is_exact(E, D, I, kmajor):
    raw = make_experts(E, D, I)
    prepared = moe_layout.prepare_moe(*raw, kmajor=kmajor)
    assert (prepared.num_experts, prepared.hidden, prepared.intermediate) == (E, D, I)
    KD8, KI8 = -(-D // 256) * 32, -(-I // 256) * 32  # K padded to whole 256-wide slabs, in words
    if kmajor:  # a column's words contiguous
        assert prepared.gate_up.shape == (E, 2 * I, KD8) and prepared.down.shape == (E, D, KI8)
    else:
        assert prepared.gate_up.shape == (E, KD8, 2 * I) and prepared.down.shape == (E, KI8, D)
    assert prepared.gate_up_scale.shape == (E, KD8 // 4, 2 * I)  # scales in the slab layout either way
    assert (prepared.gate_up_slabs, prepared.down_slabs) == (KD8 // 32, KI8 // 32)
    for got, want in zip(moe_layout.unprepare_moe(prepared), raw):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_magic_constants_dequantise_exactly():
    """The bit trick per dtype, mirrored in torch (the interpreter cannot bitcast to bf16): a nibble OR-ed under
    MAGIC reads MAGIC_VALUE + u; for WIDE dtypes a nibble 4 bits up reads MAGIC_VALUE + 16 u."""
    u = torch.arange(16, dtype=torch.int32)
    for dtype, c in moe_layout.UNPACK.items():
        for shift, factor in [(0, 1)] + ([(4, 16)] if c["WIDE"] else []):
            bits = ((u << shift) | c["MAGIC"]).to(torch.int16).view(dtype).float()
            assert torch.equal(bits - (c["MAGIC_VALUE"] + 8 * factor), (u - 8).float() * factor), (dtype, shift)
    bf16_wide = ((u << 4) | moe_layout.UNPACK[torch.bfloat16]["MAGIC"]).to(torch.int16).view(torch.bfloat16).float()
    assert not torch.equal(bf16_wide, 128 + 16 * u.float())  # why bf16 is not WIDE: 7 mantissa bits


@requires_triton
def test_moe_narrow_unpack_path(monkeypatch):
    """The shift-per-group unpacking bf16 uses, run with fp16 operands (the interpreter's bf16 is unusable)."""
    monkeypatch.setitem(moe_layout.UNPACK, torch.float16, dict(moe_layout.UNPACK[torch.float16], WIDE=False))
    E, D, I, M = 6, 512, 64, 5
    raw = make_experts(E, D, I, seed=3)
    ids, weights = make_routing(M, E, 2, seed=3)
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(3)).to(device())
    check(x, ids, weights, raw, torch.float16)


@requires_triton
@pytest.mark.parametrize("E,D,I,decode", [(6, 512, 64, False), (5, 320, 96, False), (5, 320, 96, True),
                                           (6, 512, 64, True)], ids=["routing", "routing_ragged", "decode_ragged",
                                                                     "decode"])
def test_moe_split_over_k(E, D, I, decode):
    """The routing-pass path and the decode path (one block per pair, no routing pass; here with a repeated expert),
    both split over K, at a hidden size of whole slabs and a ragged one."""
    cfg = {"BM": 16, "decode": decode, "gate_up": dict(BN=32, waves=8, num_warps=4, num_stages=2),
           "down": dict(BN=128, waves=8, num_warps=4, num_stages=2)}
    raw = make_experts(E, D, I, seed=4)
    ids, weights = make_routing(3, E, 2, seed=4)
    ids[2] = ids[0]  # two tokens on the same experts
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(4)).to(device()).to(kernel_dtypes()[0])
    out = moe_w4a16.moe(x, ids, weights, moe_layout.prepare_moe(*raw), config=cfg)
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
    prepared = moe_layout.prepare_moe(*raw)
    ids, weights = make_routing(3, E, 2, seed=5)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(5)).to(device()).to(kernel_dtypes()[0])
    sums = moe_w4a16.moe(x, ids, weights, prepared, keep_sums=True, config=cfg)
    assert sums.dtype == (x.dtype if decode else torch.float32)
    assert torch.equal(sums.to(x.dtype), moe_w4a16.moe(x, ids, weights, prepared, config=cfg))


@requires_triton
@pytest.mark.parametrize("BM,kmajor,swap,D,I,down", [(8, True, True, 576, 96, dict(BN=32, tiles=2)),
                                                     (16, False, False, 384, 320, dict(BN=64, tiles=3))],
                         ids=["kmajor_bm8", "slab_bm16_down_split"])
def test_moe_decode_sums_are_zeroed_again(BM, kmajor, swap, D, I, down):
    """The decode path's fp32 sums and arrival counters (gate/up split over K's 3 slabs; down's top-k pairs, and
    its 2 slabs split too in the second case) are zero again after each call, so consecutive calls with other
    tokens and routings stay right; a hidden size not a multiple of the 256-wide slab, an intermediate not one
    of the gate/up tile, several down tiles a program, and a repeated expert."""
    from triton_kernels.counters import arrival_counters

    E = 5
    kernel = dict(BN=32 if BM == 16 else 64, waves=8, num_warps=4, num_stages=2, swap=swap, lop3=True,
                  prescale=swap, scales_ahead=True)
    cfg = {"BM": BM, "kmajor": kmajor, "decode": True, "gate_up": kernel, "down": dict(kernel, **down)}
    raw = make_experts(E, D, I, seed=8)
    prepared = moe_layout.prepare_moe(*raw, kmajor=kmajor)
    for M, seed in ((3, 8), (1, 9)):
        ids, weights = make_routing(M, E, 2, seed=seed)
        ids[-1] = ids[0]
        x = torch.randn(M, D, generator=torch.Generator().manual_seed(seed)).to(device()).to(kernel_dtypes()[0])
        out = moe_w4a16.moe(x, ids, weights, prepared, config=cfg)
        assert rel_err(out, moe_torch(x.float(), ids, weights, PackedExperts(*raw))) < 1e-2, M
        assert not arrival_counters("moe_w4a16", device(), 0).any(), M


@requires_triton
@pytest.mark.parametrize("kmajor,swap,waves,M,tiles,BM", [(True, True, 64, 7, 3, 8), (False, False, 1, 3, 1, 16),
                                                          (True, True, 64, 20, 3, 16)],
                         ids=["kmajor_bm8_split_tiles3", "slab_bm16_items_a_program", "kmajor_bm16_split_tiles3"])
def test_moe_device_split(monkeypatch, kmajor, swap, waves, M, tiles, BM):
    """`device_split`: the routing pass's count of filled blocks decides gate/up's K split on the device
    (`_plan_split`), and `persistent` down takes its work items from that count. First case: 256 programs for at
    most 14 blocks x 2 tiles, so each tile's 3 slabs split 3 ways (partials summed in split order by the last to
    arrive), down 3 tiles an item (one slab: the pipelined tile loop); second: 8 programs, several work items
    each, no split, down's K loop; third: the first with BM 16 (the sm_90 entry for 65 <= M <= 128), experts
    with more than 8 rows. Ragged shapes and a repeated expert."""
    monkeypatch.setattr(arch, "sm_count", lambda device: 4)
    E, D, I = (5, 576, 96) if swap else (6, 320, 96)
    kernel = dict(BN=64 if swap else 32, waves=waves, num_warps=4, num_stages=2, swap=swap, lop3=True,
                  prescale=swap, scales_ahead=True, device_split=True)
    cfg = {"BM": BM, "kmajor": kmajor, "gate_up": kernel,
           "down": dict(kernel, BN=64, tiles=tiles, persistent=True)}
    raw = make_experts(E, D, I, seed=10)
    ids, weights = make_routing(M, E, 2, seed=10)
    ids[-1] = ids[0]
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(10)).to(device()).to(kernel_dtypes()[0])
    out = moe_w4a16.moe(x, ids, weights, moe_layout.prepare_moe(*raw, kmajor=kmajor), config=cfg)
    assert rel_err(out, moe_torch(x.float(), ids, weights, PackedExperts(*raw))) < 1e-2


def assert_three_tokens_match(cfg, E, D, I, seed):
    """Three tokens, the third routed like the first (a repeated expert), through `cfg` in its layout, against the
    fp32 reference."""
    raw = make_experts(E, D, I, seed=seed)
    ids, weights = make_routing(3, E, 2, seed=seed)
    ids[2] = ids[0]
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(seed)).to(device()).to(kernel_dtypes()[0])
    out = moe_w4a16.moe(x, ids, weights, moe_layout.prepare_moe(*raw, kmajor=cfg["kmajor"]), config=cfg)
    assert rel_err(out, moe_torch(x.float(), ids, weights, PackedExperts(*raw))) < 1e-2


SWAPPED_CASES = [  # BM, kmajor, the config's changes, id
    (8, False, {}, "bm8_slab"),
    (16, False, {"tiles": 2}, "bm16_slab_tiles2"),
    (8, False, {"decode": True}, "bm8_slab_decode"),
    (8, False, {"scales_ahead": True, "waves": 1, "D": 608}, "bm8_scales_ahead"),
    (16, False, {"scales_ahead": True, "swap": False, "waves": 1, "D": 608}, "unswapped_scales_ahead"),
    (16, True, {"scales_ahead": True, "tiles": 2}, "bm16_kmajor_ahead_tiles2"),
    (8, False, {"scales_ahead": True, "tiles": 2, "I": 320}, "tiles2_two_slabs_ahead"),
    (16, False, {"prescale": True, "waves": 1, "D": 608}, "prescaled"),
    (8, False, {"prescale": True, "tiles": 2}, "bm8_prescaled_tiles2"),
    (16, False, {"prescale": True, "swap": False}, "unswapped_prescaled"),
    (16, True, {"prescale": True, "waves": 1, "D": 608}, "kmajor_prescaled"),
    (8, True, {"scales_ahead": True, "tiles": 2}, "kmajor_bm8_ahead_tiles2"),
    (16, True, {"scales_ahead": True, "tiles": 2, "I": 320}, "kmajor_two_slabs_ahead_tiles2"),
    (8, True, {"scales_ahead": True, "decode": True}, "kmajor_decode_ahead"),
    (8, True, {"scales_ahead": True, "mma_v2": True}, "kmajor_mma_v2"),
]


@requires_triton
@pytest.mark.parametrize("BM,kmajor,extra", [c[:3] for c in SWAPPED_CASES], ids=[c[3] for c in SWAPPED_CASES])
def test_moe_swapped_tiles(BM, kmajor, extra):
    """`swap` (transposed tiles: weights as the MMA's M operand, tokens its N) on ragged shapes, split over K, a
    repeated expert; with BM 8 (fewer rows than tl.dot's usual 16), two down tiles a program (down's K in one slab:
    the pipelined tile loop, scales a tile ahead; or in two), K-major words, the decode path, `scales_ahead` (three
    slabs in one split: scales carried across slabs), also unswapped, and `prescale` (weights scaled before the
    MMA); `lop3` runs on the GPU (the interpreter runs the plain form)."""
    E, D, I = 5, extra.get("D", 320), extra.get("I", 96)
    kernel = dict(BN=64, waves=extra.get("waves", 8), num_warps=4, num_stages=2, swap=extra.get("swap", True),
                  lop3=True, scales_ahead=extra.get("scales_ahead", False), prescale=extra.get("prescale", False),
                  mma_v2=extra.get("mma_v2", False))
    cfg = {"BM": BM, "kmajor": kmajor, "decode": extra.get("decode", False), "gate_up": kernel,
           "down": dict(kernel, BN=64 // extra.get("tiles", 1), tiles=extra.get("tiles", 1))}  # tiles x BN | D
    assert_three_tokens_match(cfg, E, D, I, seed=6)


def base_entry(key, M):
    """The CONFIGS entry of M's bucket on `key`, and the bucket's max M."""
    return next((max_m, cfg) for max_m, cfg in moe_configs.CONFIGS[key] if max_m is None or M <= max_m)


def test_configs_resolve_by_intermediate_size_and_triton(monkeypatch, python_tables):
    """config_for: every bucket's entry as it is, or with BY_INTERMEDIATE's override for experts of that
    intermediate size; on a Triton newer than TUNED_TRITON with NEWER_TRITON's (NEWER_TRITON_BY_INTERMEDIATE's on top
    of a BY_INTERMEDIATE override); on the tuned Triton never."""
    cpu = torch.device("cpu")
    for newer in (False, True):
        version = (moe_configs.TUNED_TRITON[0], moe_configs.TUNED_TRITON[1] + newer)
        monkeypatch.setattr(moe_configs, "triton_version", lambda version=version: version)
        for key in arch.ARCHS:
            with arch.using(key):
                for max_m, _ in moe_configs.CONFIGS[key]:
                    M = max_m or 1000
                    for I in (256, 2048):
                        _, want = base_entry(key, M)
                        by_size = moe_configs.BY_INTERMEDIATE[key].get(I, {}).get(max_m)
                        if by_size:
                            want = moe_configs.with_overrides(want, by_size)
                        later = (moe_configs.NEWER_TRITON_BY_INTERMEDIATE[key].get(I, {}) if by_size
                                 else moe_configs.NEWER_TRITON[key]).get(max_m)
                        if newer and later:
                            want = moe_configs.with_overrides(want, later)
                        want = {**want, "kmajor": moe_configs.KMAJOR[key]}  # no tuned file: the arch's layout
                        assert moe_configs.config_for(cpu, M, intermediate=I) == want, (key, newer, M, I)


def test_every_config_runs_on_its_layout(shipped_tables):
    """Every entry expects the layout `prepare_moe` chooses for its experts: the Python table's the arch's (KMAJOR),
    the shipped tuned file's the one its entries for that intermediate size name; and each kernel's N tiles a
    program divide K2.6's hidden size."""
    cpu = torch.device("cpu")
    for key in arch.ARCHS:
        shipped = tuning.table("moe", key) or {}
        with arch.using(key):
            for size, rows in shipped.items():
                layout = moe_configs.kmajor_for(cpu, int(size))
                assert all(cfg.get("kmajor", layout) == layout for _, cfg in rows if cfg), (key, size)
                assert moe_configs.config_for(cpu, 10**6, int(size))["kmajor"] == layout, (key, size)
        python = [cfg for _, cfg in moe_configs.CONFIGS[key]]
        assert all(cfg.get("kmajor", False) == moe_configs.KMAJOR[key] for cfg in python), key
        for cfg in python + [cfg for rows in shipped.values() for _, cfg in rows if cfg]:
            assert 7168 % (cfg["down"]["BN"] * cfg["down"].get("tiles", 1)) == 0, key


@requires_triton
def test_a_tuned_layout_is_the_one_the_experts_get(monkeypatch, tmp_path):
    """A tuned file whose entries for an intermediate size name the other layout: `prepare_moe` lays those experts
    out that way, and the Python table's buckets that the file leaves null run in it; a file mixing layouts for
    one size is refused, naming the size."""
    key = arch.current()
    other = not moe_configs.KMAJOR[key]
    kernel = dict(BN=32, waves=1, num_warps=4, num_stages=2)
    path = tmp_path / "tuned.json"
    rows = [[2, dict(BM=16, kmajor=other, gate_up=kernel, down=dict(kernel, BN=64))], [None, None]]
    path.write_text(json.dumps(dict(format=tuning.FORMAT, header=dict(arch=key), moe={"64": rows})))
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    tuning.use(None)
    try:
        raw = make_experts(4, 256, 64)
        assert moe_layout.prepare_moe(*raw).kmajor == other
        assert moe_configs.config_for(raw[0].device, 100, intermediate=64)["kmajor"] == other
        assert moe_layout.prepare_moe(*make_experts(4, 256, 128)).kmajor == moe_configs.KMAJOR[key]
        ids, weights = make_routing(5, 4, 2)
        x = torch.randn(5, 256, device=ids.device).half()
        want = moe_torch(x.float(), ids, weights, PackedExperts(*raw))
        out = moe_w4a16.moe(x, ids, weights, moe_layout.prepare_moe(*raw))
        assert ((out.float() - want).norm() / want.norm()) < 1e-2
        rows[1][1] = dict(rows[0][1], kmajor=not other)
        path.write_text(json.dumps(dict(format=tuning.FORMAT, header=dict(arch=key), moe={"64": rows})))
        tuning.use(None)
        with pytest.raises(ValueError, match="moe.64: expected entries of one layout"):
            tuning.tables(key)
    finally:
        tuning.use(None)


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
from triton_kernels.aot import compile_kernel
from triton_kernels.moe_configs import CONFIGS, MMA_V2, with_overrides
from triton_kernels.moe_w4a16 import compile_specs
cfg = dict(CONFIGS["sm_90"])[1]
out = {}
for name, entry in (("tuned", cfg), ("mma_v2", with_overrides(cfg, MMA_V2))):
    kernel, signature, constexprs, options = compile_specs(entry, key="sm_90")[0]
    ptx = compile_kernel(kernel, signature, constexprs, **options).asm["ptx"]
    out[name] = dict(wgmma="wgmma.mma_async" in ptx, mma_sync="mma.sync.aligned" in ptx)
print(json.dumps(out))
"""


def test_mma_v2_entries_compile_to_mma_sync():
    """The M = 1 entry's gate/up for sm_90: with `mma_v2` its dots are mma.sync on any Triton; as tuned, they are
    mma.sync on the Triton the table was tuned on (3.6) and wgmma on newer ones (3.9), which is why
    moe_configs.NEWER_TRITON exists."""
    out = compiled_in_child(MMA_OF_ENTRY)
    assert out["mma_v2"] == dict(wgmma=False, mma_sync=True), out
    assert out["tuned"]["wgmma"] == (moe_configs.triton_version() > moe_configs.TUNED_TRITON), out


@requires_triton
def test_moe_rejects_config_for_another_layout():
    raw = make_experts(4, 256, 64)
    ids, weights = make_routing(2, 4, 2)
    x = torch.randn(2, 256).half().to(device())
    cfg = {"BM": 16, "gate_up": dict(BN=64, waves=1, num_warps=4, num_stages=2),
           "down": dict(BN=128, waves=1, num_warps=4, num_stages=2)}
    with pytest.raises(ValueError, match="must divide the hidden size"):
        moe_w4a16.moe(x, ids, weights, moe_layout.prepare_moe(*raw, kmajor=False),
                      config={**cfg, "down": dict(cfg["down"], tiles=3)})
    with pytest.raises(ValueError, match="config for kmajor"):
        moe_w4a16.moe(x, ids, weights, moe_layout.prepare_moe(*raw, kmajor=False), config={**cfg, "kmajor": True})


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
    prepared = moe_layout.prepare_moe(*make_experts(4, 256, 32))
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


GRAPH_OVERRIDES = {"default": {}, "prescale": moe_configs.PRESCALE, "bm16": moe_configs.BM16,
                   "mma_v2": moe_configs.MMA_V2, "mma_v2_prescale": moe_configs.MMA_V2_PRESCALE}


@requires_gpu
@pytest.mark.parametrize("override", list(GRAPH_OVERRIDES))
def test_moe_entries_in_a_graph_gpu(override):
    """The entries of the arch in force (on sm_90: the two-launch decode path with programmatic dependent launch up
    to M = 4, the device-split gate/up with the persistent down to 33, the routing pass above), as they are and with
    each override the tables apply (moe_configs), at the TP8 expert shape on 16 experts, M = 1, 3, 24 and 100,
    eager and replayed three times in a CUDA graph (where launches overlap, and the decode path's sums and counters
    must be zero again after each replay), against the fp32 reference."""
    raw = make_experts(16, 7168, 256, seed=7)
    for M in (1, 3, 24, 100):
        cfg = moe_configs.with_overrides(moe_configs.config_for(device(), M), GRAPH_OVERRIDES[override])
        prepared = moe_layout.prepare_moe(*raw, kmajor=cfg.get("kmajor", False))
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
        assert rel_err(out, ref) < 1e-2, (override, M)


RESOURCES = """
import json
import os
import sys
import torch
from triton_kernels import arch, tuning
os.environ.pop(tuning.ENV_VAR, None)  # the shipped tuned files, whatever file the caller names
from triton_kernels.aot import compile_for
from triton_kernels.moe_configs import CONFIGS, config_for
from triton_kernels.moe_w4a16 import compile_specs
tables, target = sys.argv[1], sys.argv[2]
with arch.using(tables):
    tuning.use(tuning.DEFAULTS)
    entries = [(max_m, config_for(torch.device("cpu"), max_m or 1000, intermediate=I), I)
               for max_m, _ in CONFIGS[tables] for I in (256, 2048)]
    tuning.use(None)
    entries += [(max_m, cfg, int(I)) for I, rows in (tuning.table("moe", tables) or {}).items()
                for max_m, cfg in rows if cfg]  # the shipped tuned file's
print(json.dumps([dict(max_m=max_m, I=I, kernel=kernel.__name__, maxnreg=options["maxnreg"],
                       **vars(compile_for(kernel, signature, constexprs, **dict(options, arch=target))))
                  for max_m, cfg, I in entries
                  for kernel, signature, constexprs, options in compile_specs(cfg, key=target, I=I)]))
"""


def test_sm120_configs_fit():
    """Every sm_120 entry (TP8 and EP8 intermediate sizes; the Python table's and the shipped tuned file's)
    compiles for sm_120 as the JIT specialises it, within sm_120's shared memory and without spills. Runs in a
    subprocess: under TRITON_INTERPRET=1 the kernels are interpreter objects that cannot be compiled."""
    results = compiled_in_child(RESOURCES, "sm_120", "sm_120")
    tuned = sum(cfg is not None for rows in (tuning.table("moe", "sm_120") or {}).values() for _, cfg in rows)
    assert len(results) == 2 * (2 * len(moe_configs.CONFIGS["sm_120"]) + tuned)
    for res in results:
        assert res["shared"] <= arch.SHARED_LIMIT["sm_120"] and res["spill_bytes"] == 0, res


def test_sm90_configs_compile():
    """Every sm_90 entry, with the inline PTX the interpreter cannot run (lop3, L2 prefetch, grid dependency
    control), assembles for sm_90 within its shared memory and without spills, but for a kernel capped at `maxnreg`
    registers (measured faster so), which may spill up to 64 bytes (the M <= 128 entry's gate/up spills 12 under
    Triton 3.6)."""
    for res in compiled_in_child(RESOURCES, "sm_90", "sm_90"):
        assert res["shared"] <= arch.SHARED_LIMIT["sm_90"], res
        assert res["spill_bytes"] <= (64 if res["maxnreg"] else 0), res
