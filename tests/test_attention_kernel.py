"""Triton MLA attention (+ write_kv) vs the fp32 torch reference: random trees, ragged batches, splits, sm_120 fit."""

import random
import sys

import pytest
import torch

import ops
from ops.attention import mla_attention_torch, pack_tree_mask, write_kv_torch
from tests.conftest import compiled_in_child, gpu, kernel_dtypes, rel_err, requires_gpu, requires_triton
from tests.tree_ref import tree_visibility
from triton_kernels import arch
from triton_kernels.mla_attention import Config, Tiles
from triton_kernels.mla_two_pass import TwoPassTiles

SCALE = 0.1446802  # K2.6 softmax scale (ModelConfig.softmax_scale)


def random_parents(kind, T, rng):
    if kind == "chain":
        return [t - 1 for t in range(T)]
    if kind == "star":
        return [-1] + [0] * (T - 1)
    if kind == "deep":  # mostly extends the newest node
        return [-1] + [t - 1 if rng.random() < 0.8 else rng.randrange(t) for t in range(1, T)]
    if kind == "padded":  # a random tree on the first half, the rest padding that sees only itself
        half = max(1, T // 2)
        return [-1] + [rng.randrange(t) for t in range(1, half)] + [-1] * (T - half)
    return [-1] + [rng.randrange(t) for t in range(1, T)]  # wide: uniform random parent


def make_case(B, T, H, lens, kind, dtype, device, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    L_max = max(lens) + 5
    q = torch.randn(B, T, H, 576, generator=gen).to(device=device, dtype=dtype)
    kv = torch.randn(B + 1, L_max, 576, generator=gen).to(device=device, dtype=dtype)[:B]  # a larger cache's rows
    cache_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    if kind == "causal":
        return q, kv, cache_lens, None
    dense = torch.stack([tree_visibility(random_parents(kind, T, rng)) for _ in range(B)])
    return q, kv, cache_lens, pack_tree_mask(dense).to(device)


def device():
    return "cuda" if gpu() else "cpu"


def bound(dtype):
    return 1e-4 if dtype == torch.float32 and not gpu() else 1e-2


BIG = Tiles(64, 64, 4, 2, False)  # larger tiles for the larger cases: fewer interpreted steps
UNCHAINED = Tiles(64, 64, 8, 2, True)  # QK^T once per program (the softmax behind a branch)
CASES = [  # B, T, H, lens, tree kind, num_splits (None: the launcher's choice), tiles (None: the launcher's)
    (1, 1, 8, [37], "chain", None, None),
    (3, 2, 16, [5, 70, 133], "wide", 3, None),
    (2, 7, 1, [7, 100], "star", None, None),
    (2, 16, 8, [200, 17], "deep", 2, BIG),
    (1, 64, 8, [150], "wide", None, BIG),
    (2, 64, 1, [64, 97], "padded", 5, BIG),
    (2, 16, 16, [90, 161], "chain", 1, BIG),
    (2, 33, 8, [33, 90], "causal", 1, BIG),
    (2, 33, 2, [40, 131], "causal", 3, None),
    (2, 9, 8, [50, 120], "deep", 2, Tiles(32, 32, 4, 2, False)),
    (1, 20, 4, [77], "causal", 1, Tiles(64, 32, 4, 2, False)),
    (2, 16, 8, [200, 17], "wide", 2, UNCHAINED),
    (1, 5, 3, [70], "chain", None, UNCHAINED),
    (2, 33, 2, [40, 131], "causal", 1, UNCHAINED),
    (1, 7, 8, [90], "deep", 3, Tiles(32, 32, 4, 2, True)),
]


@requires_triton
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("B,T,H,lens,kind,splits,tiles", CASES,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-{c[4]}-S{c[5]}" + ("-unchained" if c[6] and c[6].unchain else "")
                              + (f"-{c[6].block_m}x{c[6].block_n}" if c[6] else "") for c in CASES])
def test_mla_attention_matches_reference(B, T, H, lens, kind, splits, tiles, dtype):
    from triton_kernels.mla_attention import mla_attention

    q, kv, cache_lens, mask = make_case(B, T, H, lens, kind, dtype, device(), seed=B * 1000 + T * 10 + H)
    if gpu() and tiles is not None and not tiles.unchain:
        tiles = None  # on the GPU the launcher's own tiles; the unchained cases keep theirs
    out = mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(tiles=tiles, splits=splits))
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert out.shape == (B, T, H, 512) and out.dtype == dtype
    assert not out.isnan().any()
    assert rel_err(out, ref) < bound(dtype)


SUMS_ONCE_CASES = [
    (3, 2, 16, [5, 70, 133], "wide", 3, None),
    (2, 9, 8, [50, 120], "deep", 2, Tiles(32, 32, 4, 2, False)),
    (2, 33, 2, [40, 131], "causal", 1, UNCHAINED),
    (1, 7, 8, [90], "deep", 3, Tiles(32, 32, 4, 2, True)),
]


@requires_triton
@pytest.mark.parametrize("sums_once", [True, False], ids=["sums-once", "row-sum-a-tile"])
@pytest.mark.parametrize("B,T,H,lens,kind,splits,tiles", SUMS_ONCE_CASES,
                         ids=[f"B{c[0]}-T{c[1]}-{c[4]}-S{c[5]}" for c in SUMS_ONCE_CASES])
def test_softmax_sums_per_tile_or_once_match_reference(monkeypatch, B, T, H, lens, kind, splits, tiles, sums_once):
    """Both forms of the softmax sums (`SUMS_ONCE`: sm_120's per column, summed after the loop; sm_90's a row sum
    a tile), whatever the arch in force here, with splits, trees, causal and unchained tiles."""
    from triton_kernels import mla_attention

    monkeypatch.setitem(mla_attention.SUMS_ONCE, arch.current(device()), sums_once)
    dtype = kernel_dtypes()[0]
    q, kv, cache_lens, mask = make_case(B, T, H, lens, kind, dtype, device(), seed=B * 100 + T)
    if gpu() and tiles is not None and not tiles.unchain:
        tiles = None  # as test_mla_attention_matches_reference
    out = mla_attention.mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(tiles=tiles, splits=splits))
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert not out.isnan().any() and rel_err(out, ref) < bound(dtype)


SMALL_TWO_PASS = TwoPassTiles(16, 16, 4, 1, 16, 256, 4, 1)  # few interpreted steps; on a GPU the table's tiles
TWO_PASS_CASES = [  # B, T, H, lens, tree kind, num_splits (None: the launcher's)
    (1, 1, 8, [37], "chain", None),
    (3, 2, 16, [5, 70, 133], "wide", 3),
    (2, 9, 8, [50, 120], "deep", 2),
    (2, 33, 2, [40, 131], "causal", 3),
    (1, 7, 8, [90], "padded", 1),
    (2, 16, 8, [200, 17], "star", 5),  # more splits than the short sequence's tiles: empty splits
    (1, 40, 2, [75], "wide", 2),  # two mask words a token
]


@requires_triton
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("B,T,H,lens,kind,splits", TWO_PASS_CASES,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-{c[4]}-S{c[5]}" for c in TWO_PASS_CASES])
def test_two_pass_matches_reference(B, T, H, lens, kind, splits, dtype):
    """The two-pass kernels (mla_two_pass.py): trees, causal, one split (the output direct), several, empty ones,
    ragged last tiles and a cache whose rows are a larger cache's."""
    from triton_kernels.mla_attention import mla_attention

    q, kv, cache_lens, mask = make_case(B, T, H, lens, kind, dtype, device(), seed=B * 1000 + T * 10 + H)
    tiles = True if gpu() else SMALL_TWO_PASS
    out = mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(splits=splits, two_pass=tiles))
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert out.shape == (B, T, H, 512) and out.dtype == dtype
    assert not out.isnan().any()
    assert rel_err(out, ref) < bound(dtype)


@requires_triton
@pytest.mark.parametrize("T,H,lens", [(5, 8, [70]), (9, 4, [45]), (3, 4, [20]), (2, 8, [33])],
                         ids=["32+8 rows", "32+4 rows", "12 rows", "16 rows"])
def test_two_pass_short_last_row_block(T, H, lens):
    """The scores pass's last row block of at most TAIL_M rows (one token's heads past whole 32-row blocks, or
    all the rows) runs as a TAIL_M-row tile: the output is the reference's."""
    from triton_kernels.mla_attention import mla_attention

    dtype = kernel_dtypes()[0]
    q, kv, cache_lens, mask = make_case(1, T, H, lens, "wide", dtype, device(), seed=T * 10 + H)
    tiles = TwoPassTiles(32, 16, 4, 1, 16, 256, 4, 1)
    out = mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(splits=2, two_pass=tiles))
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert not out.isnan().any() and rel_err(out, ref) < bound(dtype)


@requires_triton
@pytest.mark.parametrize("two_pass", [False, True], ids=["split kernel", "two passes"])
def test_cache_past_the_lengths_is_never_read_into_the_output(two_pass):
    """NaN in every cache row past each sequence's length (the two passes load clamped rows there, unmasked):
    the output is the reference's."""
    from triton_kernels.mla_attention import mla_attention

    dtype = kernel_dtypes()[0]
    q, kv, cache_lens, mask = make_case(2, 5, 4, [23, 50], "wide", dtype, device(), seed=5)
    for b, length in enumerate(cache_lens.tolist()):
        kv[b, length:] = float("nan")
    config = Config(splits=2, two_pass=(True if gpu() else SMALL_TWO_PASS) if two_pass else False)
    out = mla_attention(q, kv, cache_lens, mask, SCALE, config=config)
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert not out.isnan().any() and rel_err(out, ref) < bound(dtype)


@pytest.mark.parametrize("key,T,causal,config,expected", [
    ("sm_120", 16, False, None, True),  # 128 rows of a tree
    ("sm_120", 15, False, None, False),  # 120 rows: the split kernel
    ("sm_120", 33, True, None, False),  # causal (prefill): the split kernel
    ("sm_120", 33, False, False, False),
    ("sm_90", 33, False, None, False),
    ("sm_90", 33, False, True, True),  # asked for: sm_120's tiles
    ("sm_120", 33, False, Config(tiles=Tiles(16, 32, 4, 2, False)), False),  # split-kernel tiles named
])
def test_two_pass_runs_for_tall_trees_on_sm120(python_tables, key, T, causal, config, expected):
    """TWO_PASS's rule (the Python tables; a tuned file may choose per bucket)."""
    from triton_kernels.mla_attention import TWO_PASS, plan

    q = torch.zeros(1, T, 8, 576, dtype=torch.float16)
    kv = torch.zeros(1, 4096, 576, dtype=torch.float16)
    with arch.using(key):
        chosen = plan(q, kv, causal, config if isinstance(config, Config) else Config(two_pass=config)).two_pass
    assert chosen == (TWO_PASS["sm_120"][1] if expected else None)


@requires_triton
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
def test_partials_in_the_inputs_dtype(dtype):
    """Per-split outputs stored in q's dtype (half the merge traffic) stay within the bound."""
    from triton_kernels.mla_attention import mla_attention

    q, kv, cache_lens, mask = make_case(2, 7, 8, [90, 161], "wide", dtype, device(), seed=11)
    out = mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(splits=4, partials=dtype))
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert not out.isnan().any()
    assert rel_err(out, ref) < bound(dtype)
    with pytest.raises(ValueError, match="partials"):
        mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(partials=torch.int32))


@requires_triton
@pytest.mark.parametrize("splits", [2, 5])
def test_tail_split_takes_the_tree_tiles(splits):
    """With the last split on the tree's tiles (TAIL_SPLIT): a tree alone (no prefix tile), a tree starting inside a
    tile and one spanning three 16-entry tiles, more splits than prefix tiles; the cache past each length is NaN."""
    from triton_kernels.mla_attention import mla_attention

    dtype = kernel_dtypes()[0]
    q, kv, cache_lens, mask = make_case(3, 33, 2, [33, 75, 130], "deep", dtype, device(), seed=splits)
    for b, length in enumerate(cache_lens.tolist()):
        kv[b, length:] = float("nan")
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    for tail in (True, False):
        config = Config(tiles=Tiles(16, 16, 4, 2, False), splits=splits, tail_split=tail)
        out = mla_attention(q, kv, cache_lens, mask, SCALE, config=config)
        assert not out.isnan().any()
        assert rel_err(out, ref) < bound(dtype)


@requires_triton
@pytest.mark.parametrize("splits", [40, 300])
def test_merge_of_many_splits(splits):
    """The merge's blocks (MERGE_BLOCKS: 40 splits 16 a step, 300 at once), most splits empty on a short cache."""
    from triton_kernels.mla_attention import mla_attention

    dtype = kernel_dtypes()[0]
    q, kv, cache_lens, mask = make_case(1, 2, 4, [700], "chain", dtype, device(), seed=splits)
    out = mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(tiles=Tiles(16, 16, 4, 2, False), splits=splits))
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert rel_err(out, ref) < bound(dtype)


# (T*H, cache entries L_max, splits) measured fastest on the H200 (bench/results/attention_h200_run5.md), where the
# split rule picks it (20 of the run's 25 cases; in the other 5 its pick is within 4.3% of the fastest); L_max 32,898
# is the verify step's padded cache
H200_SPLITS = [(8, 32768, 256), (64, 32768, 128), (512, 32768, 16), (1024, 32768, 8), (2048, 32768, 4),
               (4096, 32768, 2), (8192, 32768, 1), (256, 131072, 33), (512, 131072, 16), (2048, 131072, 4),
               (4096, 131072, 2), (8192, 131072, 1), (264, 32898, 26), (520, 32898, 14), (8, 32898, 258)]


@pytest.mark.parametrize("rows,L,splits", H200_SPLITS, ids=[f"R{r}-L{L}" for r, L, _ in H200_SPLITS])
def test_split_rule_picks_the_h200_winners(rows, L, splits):
    from triton_kernels.mla_attention import entry_for
    from triton_kernels.mla_splits import default_splits

    entry = entry_for(rows, "sm_90")
    assert default_splits(entry, rows, 1, L, 132, "sm_90", (entry.partials or torch.bfloat16).itemsize) == splits


# (T*H, cache entries L_max, splits) on short caches, where a split's 4-tile floor would leave most of the GPU idle:
# the rule's count (up to one wave of splits, down to one tile each) measured 7-33% faster than the floor's in all
# 14 cases timed (bench/results/attention_h200_s7_short_splits.json)
H200_SHORT_SPLITS = [(8, 1024, 32), (64, 1024, 16), (8, 4096, 128), (64, 4096, 64), (8, 8192, 256),
                     (64, 8192, 128), (8, 16384, 264), (64, 16384, 132), (8, 4227, 133), (72, 4235, 66)]


@pytest.mark.parametrize("rows,L,splits", H200_SHORT_SPLITS, ids=[f"R{r}-L{L}" for r, L, _ in H200_SHORT_SPLITS])
def test_split_rule_fills_a_wave_on_short_caches(rows, L, splits):
    from triton_kernels.mla_attention import entry_for
    from triton_kernels.mla_splits import default_splits

    entry = entry_for(rows, "sm_90")
    assert default_splits(entry, rows, 1, L, 132, "sm_90", (entry.partials or torch.bfloat16).itemsize) == splits


# (T*H, T, cache entries L_max, splits) with the tail split, where its pick was measured faster than the count
# next to it (bench/results/attention_h200_s10_tail_split.json)
H200_TAIL_SPLITS = [(8, 1, 32768, 257), (512, 64, 32768, 17), (512, 8, 32768, 17), (2048, 32, 32768, 5),
                    (264, 33, 32898, 27)]


@pytest.mark.parametrize("rows,T,L,splits", H200_TAIL_SPLITS,
                         ids=[f"R{r}-T{t}-L{L}" for r, t, L, _ in H200_TAIL_SPLITS])
def test_tail_split_rule_picks_the_h200_winners(rows, T, L, splits):
    from triton_kernels.mla_attention import entry_for
    from triton_kernels.mla_splits import default_splits, tail_split_default

    entry = entry_for(rows, "sm_90")
    assert tail_split_default(T, entry.tiles.block_n, "sm_90")
    assert default_splits(entry, rows, 1, L, 132, "sm_90", (entry.partials or torch.bfloat16).itemsize, tree=T,
                          tail=True) == splits


def test_tail_split_work_and_default():
    """The split model's work per split: the tail split holds the tree's tiles at TAIL_TILE_COST each, the others
    the prefix's; without it the last split holds both. A tree over three tiles keeps the whole-length splits
    (the 4k step's T 129 measured 4-9% slower with the tail split)."""
    from triton_kernels.mla_splits import TAIL_TILE_COST, split_work, tail_split_default

    assert split_work(3, 200, 64, tree=8, tail=True) == [2, 1, TAIL_TILE_COST]  # prefix [0, 192): 3 tiles
    assert split_work(2, 200, 64, tree=8, tail=False) == [2, 1 + TAIL_TILE_COST]  # [0, 128), [128, 200)
    assert split_work(3, 200, 64, tree=9, tail=True) == [1, 1, 2 * TAIL_TILE_COST]  # the tree from entry 191
    assert split_work(2, 200, 64, tree=0) == [2, 2]  # no tree: every tile alike
    assert tail_split_default(65, 64, "sm_90") and not tail_split_default(129, 64, "sm_90")


def kernel_programs(splits, rows, length, entry):
    """Non-empty programs the split kernel runs for a length-entry sequence (its device-side split rule)."""
    from triton import cdiv

    block_m, block_n = entry.tiles.block_m, entry.tiles.block_n
    split_len = cdiv(cdiv(length, splits), block_n) * block_n
    return sum(1 for s in range(splits) if s * split_len < length) * cdiv(rows, block_m)


@pytest.mark.parametrize("length", [32898, 32801, 32770], ids=["at-L_max", "step-T33", "L_max-2-tiles"])
def test_split_rule_keeps_the_step_shape_in_one_wave(length):
    """The verify step's shape (T 33 x H 8 at 32k, cache sized 32,898): the split rule (costs averaged over 8
    lengths below L_max, whole-wave counts) keeps the split kernel within one wave of 132 SMs at every length the
    step runs (one more split, 27, takes two waves at 32,801 entries: 142 us against 80 on the H200)."""
    from triton_kernels.mla_attention import entry_for
    from triton_kernels.mla_splits import default_splits

    entry = entry_for(264, "sm_90")
    assert kernel_programs(27, 264, 32801, entry) == 135
    assert kernel_programs(default_splits(entry, 264, 1, 32898, 132, "sm_90", 4), 264, length, entry) <= 132


@requires_triton
def test_more_splits_than_tiles_leaves_empty_splits_harmless():
    from triton_kernels.mla_attention import mla_attention

    q, kv, cache_lens, mask = make_case(2, 3, 4, [3, 40], "wide", torch.float16, device(), seed=7)
    out = mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(splits=6))
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert rel_err(out, ref) < 1e-2


LOAD_CASES = [  # B, T, H, lens, tree kind, num_splits, tiles (None: the launcher's)
    (2, 16, 8, [200, 17], "deep", 2, BIG),
    (2, 5, 3, [150, 70], "wide", 3, UNCHAINED),
]


@requires_triton
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("B,T,H,lens,kind,splits,tiles", LOAD_CASES,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-S{c[5]}" for c in LOAD_CASES])
def test_both_tile_load_paths_match_reference(B, T, H, lens, kind, splits, tiles, dtype, tma):
    """tma=True: the tiles wholly inside the prefix come through tensor descriptors over the cache's rows (a larger
    cache's first B sequences, so the descriptor spans rows of another sequence too); False: pointer loads."""
    from triton_kernels.mla_attention import mla_attention

    q, kv, cache_lens, mask = make_case(B, T, H, lens, kind, dtype, device(), seed=B * 10 + T)
    tiles = None if gpu() and dtype != torch.float32 else tiles
    out = mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(tiles=tiles, splits=splits, tma=tma))
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert not out.isnan().any()
    assert rel_err(out, ref) < bound(dtype)


@requires_triton
def test_registered_behind_the_op():
    q, kv, cache_lens, mask = make_case(2, 5, 8, [12, 70], "deep", torch.float16, device(), seed=3)
    with ops.using(attention="triton"):
        out = ops.mla_attention(q, kv, cache_lens, mask, SCALE)
    with ops.using(attention="torch"):
        ref = ops.mla_attention(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert rel_err(out, ref) < 1e-2


@requires_triton
def test_rejects_other_value_dims():
    from triton_kernels.mla_attention import mla_attention

    q = torch.randn(1, 1, 2, 576, dtype=torch.float16, device=device())
    kv = torch.randn(1, 8, 576, dtype=torch.float16, device=device())
    with pytest.raises(ValueError, match="value_dim"):
        mla_attention(q, kv, torch.tensor([8], dtype=torch.int32, device=device()), None, SCALE, value_dim=256)


@requires_triton
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
def test_write_kv_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 40, 576, generator=gen).to(device=device(), dtype=dtype)
    entries = torch.randn(3, 7, 576, generator=gen).to(device=device(), dtype=dtype)
    starts = torch.tensor([0, 13, 33], dtype=torch.int32, device=device())
    expected = kv.clone()
    write_kv_torch(expected, entries, starts)
    with ops.using(write_kv="triton"):
        ops.write_kv(kv, entries, starts)
    assert torch.equal(kv, expected)


AOT_CHECK = """
import json, sys
from triton_kernels.aot import compile_for
from triton_kernels.mla_attention import CONFIGS, split_kernel_spec
causal, key = sys.argv[1] == "causal", sys.argv[2]
report = []
for entry in CONFIGS[key]:
    kernel, signature, constexprs, options = split_kernel_spec(entry, key, causal)
    res = compile_for(kernel, signature, constexprs, **options)
    report.append([entry.tiles.block_m, entry.tiles.block_n, res.shared, res.registers, res.spill_bytes])
print(json.dumps(report))
"""


def aot_report(mode, key):
    """Compile each entry of the split kernel for arch `key` in a child process (the interpreter cannot compile)."""
    return compiled_in_child(AOT_CHECK, mode, key)


@pytest.mark.parametrize("mode", ["tree", "causal"])
def test_sm120_configs_fit_shared_memory(mode):
    """Compile every sm_120 entry ahead of time: within its shared memory, no spills."""
    for block_m, block_n, shared, registers, spills in aot_report(mode, "sm_120"):
        assert shared <= arch.SHARED_LIMIT["sm_120"] and spills == 0, (block_m, block_n, shared, registers, spills)


TWO_PASS_AOT = """
import json, sys
from triton_kernels.aot import compile_for
from triton_kernels.mla_attention import TWO_PASS
from triton_kernels.mla_two_pass import kernel_specs
report = []
for splits in (1, 2):
    for kernel, signature, constexprs, options in kernel_specs(TWO_PASS["sm_120"][1], "sm_120", splits=splits):
        res = compile_for(kernel, signature, constexprs, **options)
        report.append([kernel.__name__, res.shared, res.registers, res.spill_bytes])
print(json.dumps(report))
"""


def test_two_pass_sm120_tiles_fit_shared_memory():
    """Both passes with sm_120's tiles, compiled for sm_120: within its shared memory, no spills."""
    for name, shared, registers, spills in compiled_in_child(TWO_PASS_AOT):
        assert shared <= arch.SHARED_LIMIT["sm_120"] and spills == 0, (name, shared, registers, spills)


def test_sm90_configs_fit_shared_memory():
    """Every sm_90 entry (the 64x64 ones unchained, P moved between warpgroups through shared memory, and with
    TMA tiles) fits 227 KB."""
    for block_m, block_n, shared, _, _ in aot_report("tree", "sm_90"):
        assert shared <= arch.SHARED_LIMIT["sm_90"], (block_m, block_n, shared)


GLUON_CASES = [  # B, T, H, lens, tree kind, num_splits (None: the launcher's), tail split
    (1, 1, 8, [37], "chain", None, None),
    (1, 1, 64, [4100], "chain", 7, False),  # odd and even tile counts a split, a ragged last tile (seesaw's pairs)
    (3, 2, 16, [5, 70, 133], "wide", 3, False),
    (2, 16, 8, [200, 17], "deep", 2, True),
    (1, 64, 8, [150], "wide", None, None),
    (2, 33, 8, [33, 90], "causal", 1, None),
    (2, 33, 2, [40, 131], "causal", 3, None),
    (1, 9, 8, [4105], "deep", 20, True),
    (2, 9, 8, [1000, 77], "padded", 6, False),
]


@requires_gpu
@pytest.mark.parametrize("B,T,H,lens,kind,splits,tail", GLUON_CASES,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-{c[4]}-S{c[5]}-tail{c[6]}" for c in GLUON_CASES])
def test_gluon_split_kernel_matches_reference(B, T, H, lens, kind, splits, tail):
    """The split kernel hand-scheduled in Gluon (`mla_gluon`, Hopper), with both rings (T*H up to 64 and above):
    ragged batches, trees and causal rows, the tail split, one split and several, odd and even tile counts a split
    (its pairs), the cache past each length NaN (never read)."""
    from triton_kernels.mla_attention import mla_attention

    if not arch.hopper_features(torch.device("cuda")):
        pytest.skip("the Gluon kernel is Hopper's (wgmma)")
    q, kv, cache_lens, mask = make_case(B, T, H, lens, kind, torch.bfloat16, "cuda", seed=B * 100 + T + H)
    for b, length in enumerate(lens):
        kv[b, length:] = float("nan")
    out = mla_attention(q, kv, cache_lens, mask, SCALE,
                        config=Config(tiles=UNCHAINED, splits=splits, tail_split=tail, gluon=True))
    ref = mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2


@requires_triton
def test_gluon_split_kernel_is_refused_where_it_cannot_run():
    from triton_kernels.mla_attention import mla_attention

    q, kv, cache_lens, mask = make_case(1, 2, 8, [40], "chain", torch.float16, device(), seed=3)
    with pytest.raises(ValueError, match="gluon"):
        mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(tiles=UNCHAINED, gluon=True))


def test_gluon_default_falls_back_where_triton_lacks_gluon(monkeypatch):
    """With a Triton whose Gluon cannot be imported the sm_90 default runs the Triton kernel; gluon=True says why."""
    import triton_kernels
    from triton_kernels.mla_attention import gluon_launcher

    monkeypatch.delattr(triton_kernels, "mla_gluon", raising=False)  # imported by an earlier test
    monkeypatch.setitem(sys.modules, "triton_kernels.mla_gluon", None)  # its import raises ImportError
    q, kv = torch.zeros(1, 1, 8, 576), torch.zeros(1, 4, 576)
    assert gluon_launcher(None, "sm_90", q, kv, UNCHAINED, torch.bfloat16) is None
    with pytest.raises(ValueError, match="Gluon"):
        gluon_launcher(True, "sm_90", q, kv, UNCHAINED, torch.bfloat16)


def test_gluon_partials_fit_their_ring_slot():
    """A warpgroup stages its [64, 256] partials in one ring slot: bf16 ones fit every ring, fp32 ones only a ring of
    64-entry tiles (a slot of 32 entries is half their size)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from triton_kernels.mla_gluon import RINGS, ring_for, stages_partials

    for max_rows, ring in RINGS:
        assert stages_partials(ring, torch.bfloat16)
        assert stages_partials(ring, torch.float32) == (ring[0] >= 64), ring
        assert ring_for(max_rows or 10_000) == ring


@requires_gpu
def test_fp32_partials_beyond_gluon_slots_run_the_triton_kernel():
    """fp32 partials where the Gluon kernel's slots cannot stage them: the op falls back to the Triton kernel (right
    answer), and gluon=True is refused."""
    from triton_kernels.mla_attention import mla_attention

    if not arch.hopper_features(torch.device("cuda")):
        pytest.skip("the Gluon kernel is Hopper's (wgmma)")
    q, kv, cache_lens, mask = make_case(1, 8, 8, [3000], "deep", torch.bfloat16, "cuda", seed=11)
    out = mla_attention(q, kv, cache_lens, mask, SCALE, config=Config(splits=6, partials=torch.float32))
    assert rel_err(out, mla_attention_torch(q.float(), kv.float(), cache_lens, mask, SCALE)) < 1e-2
    with pytest.raises(ValueError, match="partials"):
        mla_attention(q, kv, cache_lens, mask, SCALE,
                      config=Config(tiles=UNCHAINED, splits=6, partials=torch.float32, gluon=True))


GLUON_AOT = """
import json
from triton_kernels.mla_gluon import RINGS, compile_report
print(json.dumps([[ring, causal, tail, *vars(compile_report(causal=causal, tail_split=tail, ring=ring)).values()]
                  for _, ring in RINGS for causal, tail in ((False, True), (True, False), (False, False))]))
"""


def test_gluon_split_kernel_fits_sm90():
    """The Gluon kernel compiled for sm_90 without a GPU with each ring (tree with and without the tail split, causal):
    Q and the ring fit 227 KB, and nothing spills (Triton 3.6 and 3.9: 0 bytes; the MMAs' descriptors are addressed
    in the loop, `_opaque_zero`)."""
    for ring, causal, tail, shared, registers, spills in compiled_in_child(GLUON_AOT):
        assert shared <= arch.SHARED_LIMIT["sm_90"] and spills == 0, (ring, causal, tail, shared, registers, spills)
