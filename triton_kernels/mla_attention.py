"""Tree-masked absorbed-MLA attention over the latent cache (split-KV flash-decoding), and the cache writer.

All H heads x T new tokens of a sequence form one query block of R = T*H rows (row r = t*H + h, q[b] viewed
as [R, 576]), so every KV tile loaded is shared by all of them and the prefix is read once per split.
Grid (query tiles, splits, B). A split covers a contiguous range of the sequence's entries, sized on the device
from cache_lens (no host sync, CUDA-graph safe: mla_splits.program_range); tiles wholly inside the prefix run
unmasked, the rest (the last T entries, the tree) apply the bit mask or, with mask None (prefill), the causal
rule. With one split the kernel writes the output; otherwise it writes per-split (o, log2-sum-exp) and
`_merge_kernel` combines them. On sm_90 the split kernel is by default the Gluon one (mla_gluon.py). The
derivations: the attention section of README.md.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton_kernels import arch, mla_two_pass, pdl, tuning
from triton_kernels.mla_splits import (D_LAT, D_PE, ENTRY, default_splits, program_range, tail_split_default,
                                       visible)
from triton_kernels.mla_two_pass import TwoPassTiles


class Tiles(NamedTuple):
    """The split kernel's tiles and launch: query rows and cache entries a tile, warps, pipeline stages, and
    `unchain` (QK^T computed once per program, not once per warpgroup: `_softmax_step`)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    unchain: bool


class Entry(NamedTuple):
    """One row of CONFIGS: the tiles for query blocks of up to max_rows rows, and its split-count cost model."""

    max_rows: int | None  # R = T*H up to this (None: any); the first entry that fits is used
    tiles: Tiles
    slots: int  # programs resident per SM (shared memory, registers)
    tile_us: float  # a program's time per KV tile
    program_us: float  # a program's fixed time: prologue, partial store, masked tail
    partials: torch.dtype | None  # dtype of the per-split outputs (None: q's)
    tma: bool = False  # the unmasked loop's tiles through tensor descriptors


class Config(NamedTuple):
    """A call's choices where the tables' are not wanted (tests, sweeps); None takes the table's: tiles and
    partials (CONFIGS), splits (the split model, mla_splits.default_splits), tma (CONFIGS), tail_split (the last
    split takes the tree's tiles: mla_splits.TAIL_SPLIT), gluon (the Gluon split kernel: GLUON, where it can run;
    True raises where it cannot), two_pass (the two-pass kernels, mla_two_pass.py: True with TWO_PASS's tiles, a
    TwoPassTiles with those, False never; None: the tuned file's bucket, else TWO_PASS's rule)."""

    tiles: Tiles | None = None
    splits: int | None = None
    partials: torch.dtype | None = None
    tma: bool | None = None
    tail_split: bool | None = None
    gluon: bool | None = None
    two_pass: TwoPassTiles | bool | None = None


# Per arch, the first entry whose max_rows covers T*H. sm_90: the fastest measured (bench/results/attention_h200_run4.md;
# the tile times fitted to it); TMA tiles where T*H > 16. sm_120: compile-checked only (101,376 bytes, no spills:
# tests/test_attention_kernel.py), untimed (its tile times guessed).
CONFIGS = {
    "sm_90": [
        Entry(16, Tiles(16, 32, 4, 3, False), 2, 1.28, 10.0, None),  # 93 KB of shared memory, mma.sync
        Entry(64, Tiles(64, 64, 8, 2, True), 1, 3.2, 10.0, None, True),  # 229 KB: one per SM, wgmma
        Entry(None, Tiles(64, 64, 8, 2, True), 1, 3.2, 10.0, torch.float32, True),
    ],
    "sm_120": [
        Entry(16, Tiles(16, 32, 4, 2, False), 1, 1.28, 10.0, torch.float32),
        Entry(None, Tiles(32, 32, 8, 2, False), 1, 1.6, 10.0, torch.float32),
    ],
}
# Pipeline stages of the masked tail loop (a few tiles): on sm_90 one, which frees the shared memory of a second
# pipeline for larger tiles; on sm_120 (mma.sync) the pipelined tail uses less shared memory. None: the entry's.
TAIL_STAGES = {"sm_90": 1, "sm_120": None}
# Softmax sums kept per column and summed once after the loop (triton_kernels/README.md, MLA attention: row sums
# once): on sm_120's mma.sync tiles 2 barriers a KV tile fewer; on the proxy 1.6-9.7% faster than a row sum a tile
# from 32k entries on, 2% slower at one row over 4k (bench/results/split_sums_once_h100.md). On sm_90 the 64-row
# wgmma tiles would spill more (64 -> 208 B), so sm_90 keeps the row sum a tile.
SUMS_ONCE = {"sm_90": False, "sm_120": True}
# The split kernel in Gluon (`mla_gluon.py`: Hopper, bf16, the 64x64 tiles) by default, where it can run: 1.05-1.5x
# faster than Triton's at every timed shape (bench/results/attention_gluon_h200_s14_seesaw.json).
GLUON = {"sm_90": True, "sm_120": False}
# Tree attention in two passes (mla_two_pass.py) where T*H >= min_rows: (min_rows, tiles, values programs per SM).
# sm_120: 1.4-1.6x faster than the split kernel from 136 to 520 rows on the proxy; at 72 rows its grids are under
# a wave and it can lose (bench/results/attention_two_pass_h100.md), so the tuned file decides there. sm_90 keeps
# its wgmma kernels.
TWO_PASS = {"sm_90": None, "sm_120": (128, TwoPassTiles(128, 64, 4, 3, 32, 256, 4, 3), 4)}
# The merge's (BLOCK_S splits a step, BLOCK_D values of a row a program, warps) by the splits' next power of two (at
# most MERGE_MAX_SPLITS_BLOCK): the fastest measured with 16-bit partials (bench/results/attention_merge_h200_s13.md).
MERGE_MAX_SPLITS_BLOCK = 512
MERGE_BLOCKS = {512: (512, 32, 2), 256: (256, 64, 2), 128: (128, 64, 2), 64: (16, 512, 2), 32: (32, 512, 2),
                16: (16, 512, 2), 8: (8, 512, 2)}


@triton.jit
def _scores(q_lat, q_pe, kv_base, offs_n, n_ok, sm_scale_log2, UNCHAIN: tl.constexpr):
    """Scores [BM, BN] of a query block against one KV tile (log2 domain), and the tile's latent [BN, 512] (its
    values)."""
    row = offs_n.to(tl.int64)[:, None] * 576
    k_lat = tl.load(kv_base + row + tl.arange(0, 512)[None, :], mask=n_ok[:, None], other=0.0)  # [BN, 512]
    k_pe = tl.load(kv_base + row + 512 + tl.arange(0, 64)[None, :], mask=n_ok[:, None], other=0.0)  # [BN, 64]
    return _sum_scores(q_lat, k_lat, tl.dot(q_pe, tl.trans(k_pe)), sm_scale_log2, UNCHAIN), k_lat


@triton.jit
def _tma_scores(q_lat, q_pe, lat_desc, pe_desc, row, sm_scale_log2, UNCHAIN: tl.constexpr):
    """_scores for a tile wholly inside the cache, loaded through tensor descriptors (TMA): no address registers."""
    k_lat = lat_desc.load([row, 0])  # [BN, 512]
    k_pe = pe_desc.load([row, 0])  # [BN, 64]
    return _sum_scores(q_lat, k_lat, tl.dot(q_pe, tl.trans(k_pe)), sm_scale_log2, UNCHAIN), k_lat


@triton.jit
def _sum_scores(q_lat, k_lat, s_pe, sm_scale_log2, UNCHAIN: tl.constexpr):
    """(q_lat k_lat^T + s_pe) * scale, [BM, BN] fp32."""
    if UNCHAIN:  # scaled before the sum: `dot + x` would become the dot's accumulator, chaining the two dots
        return tl.dot(q_lat, tl.trans(k_lat)) * sm_scale_log2 + s_pe * sm_scale_log2
    return (tl.dot(q_lat, tl.trans(k_lat)) + s_pe) * sm_scale_log2


@triton.jit
def _probs(s, m_i, l_i, dtype: tl.constexpr, SUMS_ONCE: tl.constexpr):
    """Online-softmax update of (max, sum) with log2-domain scores s [BM, BN]: (max, sum, p, acc rescale).
    SUMS_ONCE: the sums l_i are [BM, BN], per column, summed once after the loop (`SUMS_ONCE`)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BM]; m_i starts finite, so no inf - inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [BM, BN]
    if SUMS_ONCE:
        l_i = l_i * alpha[:, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, p.to(dtype), alpha


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, live, UNCHAIN: tl.constexpr, SUMS_ONCE: tl.constexpr):
    """Online-softmax step with a tile of log2-domain scores s [BM, BN] and its values v [BN, DV].

    UNCHAIN: the softmax runs under `if live` (always true at run time), a branch Triton's layout choice does
    not look through, so QK^T is not a chained dot: its warps split S's columns (each warpgroup computes its
    half once) instead of every warpgroup computing the whole S (see triton_kernels/README.md).
    """
    if UNCHAIN:
        if live:
            m_new, l_i, p, alpha = _probs(s, m_i, l_i, v.dtype, SUMS_ONCE)
        else:
            m_new, p, alpha = m_i, s.to(v.dtype), m_i
    else:
        m_new, l_i, p, alpha = _probs(s, m_i, l_i, v.dtype, SUMS_ONCE)
    acc = acc * alpha[:, None] + tl.dot(p, v)  # [BM, 512]
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["T", "rows_kb"])
def _mla_split_kernel(
    q_ptr, kv_ptr, lens_ptr, mask_ptr, out_ptr, o_part_ptr, lse_part_ptr, lat_desc, pe_desc,
    T, rows_kb, sm_scale_log2,
    H: tl.constexpr, CAUSAL: tl.constexpr, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TAIL_STAGES: tl.constexpr, UNCHAIN: tl.constexpr, TMA: tl.constexpr, TAIL_SPLIT: tl.constexpr = False,
    SUMS_ONCE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Split pid 1 of query tile pid 0 of sequence pid 2: o = softmax(q K^T) V over the split's entries (rows
    t*H + h of q viewed [T*H, 576]), written to out (DIRECT: one split) or as partials o [B, splits, rows, 512]
    and their log2-sum-exp [B, splits, rows]. TMA: the unmasked tiles through descriptors lat_desc / pe_desc."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    num_splits = tl.num_programs(1)
    rows = T * H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row = t*H + h
    m_ok = offs_m < rows
    offs_lat = tl.arange(0, 512)

    pdl.wait(PDL)  # released at the end (pdl.py): the merge's programs do not wait beside this grid
    length = tl.load(lens_ptr + b)
    tree_start, start, end, n_full = program_range(length, T, pid_m, pid_s, num_splits, H, CAUSAL, TAIL_SPLIT,
                                                   BLOCK_M, BLOCK_N)
    # an empty split (no entry) loads no query and stores no o, only lse = -inf
    q_ok = m_ok & (start + 0 * offs_m < end)

    q_rows = q_ptr + (b.to(tl.int64) * rows + offs_m)[:, None] * 576
    q_lat = tl.load(q_rows + offs_lat[None, :], mask=q_ok[:, None], other=0.0)  # [BM, 512]
    q_pe = tl.load(q_rows + 512 + tl.arange(0, 64)[None, :], mask=q_ok[:, None], other=0.0)  # [BM, 64]
    kv_base = kv_ptr + b.to(tl.int64) * rows_kb * 576  # rows_kb: cache stride in entries; keeps 16-byte alignment

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    if SUMS_ONCE:
        l_i = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, 512], dtype=tl.float32)
    offs_tile = tl.arange(0, BLOCK_N)
    n_all = tl.full([BLOCK_N], 1, tl.int1)
    for i in range(n_full):
        if TMA:  # descriptors over the cache as [rows, 576]: [BN, 512] latent and [BN, 64] rope tiles
            s, v = _tma_scores(q_lat, q_pe, lat_desc, pe_desc, b * rows_kb + start + i * BLOCK_N, sm_scale_log2,
                               UNCHAIN)
        else:
            s, v = _scores(q_lat, q_pe, kv_base, start + i * BLOCK_N + offs_tile, n_all, sm_scale_log2, UNCHAIN)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, rows > 0, UNCHAIN, SUMS_ONCE)
    for j0 in tl.range(start + n_full * BLOCK_N, end, BLOCK_N, num_stages=TAIL_STAGES):  # the last few tiles
        offs_n = j0 + offs_tile  # [BN]
        n_ok = offs_n < end
        s, v = _scores(q_lat, q_pe, kv_base, offs_n, n_ok, sm_scale_log2, UNCHAIN)
        s = tl.where(visible(offs_m, offs_n, end, tree_start, T, b, mask_ptr, H, CAUSAL), s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, rows > 0, UNCHAIN, SUMS_ONCE)

    if SUMS_ONCE:
        l_i = tl.sum(l_i, 1)  # [BM]
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [BM, 512]
    if DIRECT:
        o_rows = out_ptr + (b.to(tl.int64) * rows + offs_m)[:, None] * 512
        tl.store(o_rows + offs_lat[None, :], o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:
        part_row = (b.to(tl.int64) * num_splits + pid_s) * rows + offs_m  # [BM]
        tl.store(o_part_ptr + part_row[:, None] * 512 + offs_lat[None, :], o.to(o_part_ptr.dtype.element_ty),
                 mask=q_ok[:, None])
        # [BM] log2-sum-exp of the split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_part_ptr + part_row, lse, mask=m_ok)
    pdl.release(PDL)


@triton.jit(do_not_specialize=["rows", "num_splits"])
def _merge_kernel(o_part_ptr, lse_part_ptr, out_ptr, rows, num_splits,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """One pass over the splits, BLOCK_S at a time (all of them in one step when BLOCK_S >= num_splits)."""
    pdl.enter(PDL)
    r = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    part0 = b.to(tl.int64) * num_splits * rows + r  # split 0 of this row
    m = tl.full([1], -1.0e30, dtype=tl.float32)  # finite start: empty splits (lse -inf) weigh exp2(-inf) = 0
    w_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_ok = s0 + offs_s < num_splits
        part = part0 + (s0 + offs_s) * rows  # [BS]
        lse = tl.load(lse_part_ptr + part, mask=s_ok, other=float("-inf"))  # [BS]
        o_ok = s_ok & (lse > float("-inf"))  # an empty split stored no o
        o = tl.load(o_part_ptr + part[:, None] * 512 + offs_d[None, :], mask=o_ok[:, None], other=0.0)  # [BS, BD]
        o = o.to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, 0))
        keep = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)  # [BS]
        acc = acc * keep + tl.sum(w[:, None] * o, 0)
        w_sum = w_sum * keep + tl.sum(w, 0)
        m = m_new
    out = acc / w_sum
    tl.store(out_ptr + (b.to(tl.int64) * rows + r) * 512 + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["T", "stride_kb", "L_max"])
def _write_kv_kernel(kv_ptr, entries_ptr, starts_ptr, T, stride_kb, L_max, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0)
    b = tl.program_id(1)
    pos = tl.load(starts_ptr + b).to(tl.int64) + t
    offs = tl.arange(0, BLOCK_D)
    d_ok = offs < D
    row = tl.load(entries_ptr + (b.to(tl.int64) * T + t) * D + offs, mask=d_ok)  # [BLOCK_D]
    tl.store(kv_ptr + b.to(tl.int64) * stride_kb + pos * D + offs, row.to(kv_ptr.dtype.element_ty),
             mask=d_ok & (pos + 0 * offs < L_max))


def entry_for(rows, key):
    """The CONFIGS entry for a query block of `rows` = T*H rows on arch `key`."""
    return next(entry for entry in CONFIGS[key] if entry.max_rows is None or rows <= entry.max_rows)


def merge_blocks(num_splits, key=None):
    """(BLOCK_S, BLOCK_D, warps) of the merge for `num_splits` splits on arch `key` (None: the arch in force): the
    tuned file's (tuning.py) where it lists the splits' power of two, else MERGE_BLOCKS'."""
    splits_block = min(triton.next_power_of_2(num_splits), MERGE_MAX_SPLITS_BLOCK)
    tuned = tuning.merge_entry(key or arch.current(), splits_block)
    return tuned or MERGE_BLOCKS.get(splits_block, (splits_block, D_LAT, 4))


def with_tuned(config, key, rows, max_len, dtype):
    """`config` with the tuned file's choices (tuning.py) for `rows` query rows over max_len cache entries where it
    leaves them None."""
    tuned = tuning.attention_entry(key, rows, max_len)
    if not tuned:
        return config
    partials = {"fp32": torch.float32, "q": dtype, None: None}[tuned.get("partials")]
    tiles = tuned.get("tiles")
    two_pass = tuned.get("two_pass")
    found = dict(tiles=Tiles(*tiles) if tiles else None, splits=tuned.get("splits"), partials=partials,
                 tma=tuned.get("tma"), tail_split=tuned.get("tail_split"),
                 two_pass=TwoPassTiles(*two_pass) if isinstance(two_pass, list) else two_pass)
    return config._replace(**{name: value for name, value in found.items() if getattr(config, name) is None})


def _check(q, kv_cache, value_dim):
    if value_dim != D_LAT or q.shape[-1] != ENTRY or kv_cache.shape[-1] != ENTRY:
        raise ValueError(f"mla_attention (triton): needs entry {ENTRY} and value_dim {D_LAT}, got q "
                         f"{tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}, value_dim {value_dim}")
    if q.dtype != kv_cache.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"mla_attention (triton): q {q.dtype} and kv_cache {kv_cache.dtype} must share a float dtype")
    if q.is_cuda and q.dtype == torch.float32:
        raise ValueError("mla_attention (triton): fp32 tiles do not fit shared memory on a GPU; use bf16/fp16 "
                         "(fp32 runs under TRITON_INTERPRET only) or the torch backend")
    if not q.is_contiguous() or kv_cache.stride(2) != 1 or kv_cache.stride(1) != ENTRY or kv_cache.stride(0) % ENTRY:
        raise ValueError("mla_attention (triton): q must be contiguous and kv_cache rows contiguous [.., L, 576]")


class Plan(NamedTuple):
    """What a call runs: the entry (its tiles as the call's config sets them), the tail stages, splits, partials'
    dtype, TMA tiles, tail split, the Gluon launcher (None: the Triton kernel) and the two-pass tiles (None: the
    split kernel)."""

    entry: Entry
    tail_stages: int
    splits: int
    partials: torch.dtype
    tma: bool
    tail_split: bool
    gluon: object
    two_pass: TwoPassTiles | None = None


def two_pass_table(key):
    """TWO_PASS's (min_rows, tiles, values programs per SM) for arch `key`; sm_120's where the arch has none (a
    call that asks for the two passes)."""
    return TWO_PASS[key] or TWO_PASS["sm_120"]


def two_pass_tiles(caller, config, key, rows, causal):
    """The two-pass kernels' tiles for a call, or None for the split kernel: the caller's `Config.two_pass` (True:
    TWO_PASS's tiles); else the split kernel where the caller names its tiles or the Gluon kernel; else the tuned
    file's choice (config: the caller's with the file's); else TWO_PASS's rule."""
    table = two_pass_table(key)
    if caller.two_pass is None and (caller.tiles is not None or caller.gluon):
        return None
    choice = config.two_pass
    if choice is None:
        choice = bool(TWO_PASS[key]) and not causal and rows >= table[0]
    if isinstance(choice, TwoPassTiles):
        return choice
    return table[1] if choice else None


def two_pass_plan(q, kv_cache, config, key, tiles):
    """The `Plan` of a two-pass call: the splits from config or `mla_two_pass.default_splits`, q's partials."""
    B, T, H, _ = q.shape
    per_sm = two_pass_table(key)[2]
    splits = config.splits or mla_two_pass.default_splits(tiles, T * H, B, kv_cache.shape[1],
                                                          arch.sm_count(q.device), per_sm)
    entry = entry_for(T * H, key)
    return Plan(entry, entry.tiles.stages, splits, config.partials or q.dtype, False, False, None, tiles)


def plan(q, kv_cache, causal, config=None):
    """The `Plan` of a call on q [B, T, H, 576] over kv_cache [B, L_max, 576] (causal: no tree mask): the tables'
    choices for the arch in force (`arch.current`) and the tuned file's (`with_tuned`), overridden by `config` (a
    Config) where it says."""
    B, T, H, _ = q.shape
    rows = T * H
    key = arch.current(q.device)
    caller = config or Config()
    config = with_tuned(caller, key, rows, kv_cache.shape[1], q.dtype)
    if config.partials not in (None, torch.float32, q.dtype):
        raise ValueError(f"mla_attention (triton): partials must be torch.float32 or q's {q.dtype}, "
                         f"got {config.partials}")
    two_pass = two_pass_tiles(caller, config, key, rows, causal)
    if two_pass:  # a split count the file pins is for the kernel its entry names
        splits = caller.splits or (config.splits if caller.two_pass is None and config.two_pass else None)
        return two_pass_plan(q, kv_cache, config._replace(splits=splits), key, two_pass)
    entry = entry_for(rows, key)
    if config.tiles is not None:
        entry = entry._replace(tiles=Tiles(*config.tiles))
    partials = config.partials or entry.partials or q.dtype
    tail = not causal and (tail_split_default(T, entry.tiles.block_n, key) if config.tail_split is None
                           else config.tail_split)
    splits = config.splits or default_splits(entry, rows, B, kv_cache.shape[1], arch.sm_count(q.device), key,
                                             partials.itemsize, tree=0 if causal else T, tail=tail)
    gluon_partials = config.partials or q.dtype  # the Gluon kernel's default: 16-bit partials
    gluon = gluon_launcher(config.gluon, key, q, kv_cache, entry.tiles, gluon_partials)
    return Plan(entry, TAIL_STAGES[key] or entry.tiles.stages, splits, gluon_partials if gluon else partials,
                entry.tma if config.tma is None else config.tma, tail, gluon)


def mla_attention(q, kv_cache, cache_lens, tree_mask, scale, value_dim=D_LAT, config=None):
    """Triton twin of ops.mla_attention: q [B, T, H, 576], kv_cache [B, L_max, 576], cache_lens [B] int32,
    tree_mask [B, T, ceil(T/32)] int32 or None (causal), -> [B, T, H, 512] in q's dtype. `config`: a Config whose
    fields override the tables' choices (`plan`)."""
    _check(q, kv_cache, value_dim)
    B, T, H, _ = q.shape
    rows = T * H
    causal = tree_mask is None
    p = plan(q, kv_cache, causal, config)
    block_m, block_n, warps, stages, unchain = p.entry.tiles
    out = torch.empty(B, T, H, D_LAT, dtype=q.dtype, device=q.device)
    direct = p.splits == 1  # the partials (o / l) are the output: no merge
    if direct:  # the Gluon kernel stores lse too
        o_part, lse_part = out, torch.empty(B, 1, rows, dtype=torch.float32, device=q.device) if p.gluon else out
    else:
        o_part = torch.empty(B, p.splits, rows, D_LAT, dtype=p.partials, device=q.device)
        lse_part = torch.empty(B, p.splits, rows, dtype=torch.float32, device=q.device)
    mask = cache_lens if causal else tree_mask.contiguous()
    sm_scale_log2 = scale * 1.4426950408889634  # the kernels exponentiate with exp2
    if p.two_pass:
        mla_two_pass.run(q, kv_cache, cache_lens, mask, o_part, lse_part, p.splits, sm_scale_log2, causal,
                         p.two_pass)
        return _merged(o_part, lse_part, out, rows, p.splits, B, direct, q)
    if p.gluon:
        p.gluon(q, kv_cache, cache_lens, mask, o_part, lse_part, p.splits, sm_scale_log2, causal, p.tail_split)
        return _merged(o_part, lse_part, out, rows, p.splits, B, direct, q)
    lat_desc, pe_desc = _descriptors(kv_cache, block_n) if p.tma and kv_cache.data_ptr() % 16 == 0 else (None, None)
    _mla_split_kernel[(triton.cdiv(rows, block_m), p.splits, B)](
        q, kv_cache, cache_lens, mask, out, o_part, lse_part, lat_desc, pe_desc,
        T, kv_cache.stride(0) // ENTRY, sm_scale_log2,
        H=H, CAUSAL=causal, DIRECT=direct, BLOCK_M=block_m, BLOCK_N=block_n, TAIL_STAGES=p.tail_stages,
        UNCHAIN=unchain, TMA=lat_desc is not None, TAIL_SPLIT=p.tail_split and not direct,
        SUMS_ONCE=SUMS_ONCE[arch.current(q.device)], num_warps=warps, num_stages=stages, **pdl.options(q),
    )
    return _merged(o_part, lse_part, out, rows, p.splits, B, direct, q)


def gluon_launcher(gluon, key, q, kv_cache, tiles, partials):
    """The Gluon split kernel's launcher (`mla_gluon.split`) where a call runs it with `partials` (dtype), else
    None: asked for (gluon True; an error where it cannot run) or by GLUON[key] (gluon None) where it can."""
    if gluon is False or (gluon is None and not GLUON[key]):
        return None
    try:
        from triton_kernels import mla_gluon
    except (ImportError, AttributeError) as err:  # a Triton without Gluon's Hopper API (it has it from 3.6)
        if gluon:
            raise ValueError(f"mla_attention (triton): gluon=True needs Triton's Gluon for Hopper: {err}") from err
        return None
    if mla_gluon.usable(q, kv_cache, tiles, partials):
        return mla_gluon.split
    if gluon:
        raise ValueError(f"mla_attention (triton): gluon=True needs a Hopper GPU running sm_90's tables, bf16 q, "
                         f"the 64x64 tiles and 16-bit partials where T*H <= 64, got {q.device} {q.dtype} "
                         f"{tuple(tiles)} {partials}")
    return None


def _merged(o_part, lse_part, out, rows, num_splits, B, direct, q):
    """out, after the merge kernel has combined the splits' partials into it (unless the split kernel wrote it)."""
    if not direct:
        block_s, block_d, warps = merge_blocks(num_splits, arch.current(q.device))
        _merge_kernel[(rows, D_LAT // block_d, B)](
            o_part, lse_part, out, rows, num_splits, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=warps,
            **pdl.options(q),
        )
    return out


def _descriptors(kv_cache, block_n):
    """Tensor descriptors over kv_cache's rows as one [rows, 576] matrix: [BN, 512] latent and [BN, 64] rope tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = (kv_cache.shape[0] - 1) * (kv_cache.stride(0) // ENTRY) + kv_cache.shape[1]
    lat = kv_cache.as_strided((rows, D_LAT), (ENTRY, 1))
    pe = kv_cache.as_strided((rows, D_PE), (ENTRY, 1), kv_cache.storage_offset() + D_LAT)
    return (TensorDescriptor(lat, [rows, D_LAT], [ENTRY, 1], [block_n, D_LAT]),
            TensorDescriptor(pe, [rows, D_PE], [ENTRY, 1], [block_n, D_PE]))


def split_kernel_spec(entry, key, causal, H=8, partials="fp32"):
    """(kernel, signature, constexprs, options) of `_mla_split_kernel` as `mla_attention` launches it with `entry`'s
    tiles on arch `key` (a tree with the tail split, or causal with one split), for aot.compile_for."""
    block_m, block_n, warps, stages, unchain = entry.tiles
    signature = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "lens_ptr": "*i32", "mask_ptr": "*i32", "out_ptr": "*bf16",
                 "o_part_ptr": f"*{partials}", "lse_part_ptr": "*fp32", "T": "i32", "rows_kb": "i32",
                 "sm_scale_log2": "fp32"}
    if entry.tma:
        signature.update(lat_desc=f"tensordesc<bf16[{block_n}, 512]>", pe_desc=f"tensordesc<bf16[{block_n}, 64]>")
    constexprs = dict(H=H, CAUSAL=causal, DIRECT=causal, BLOCK_M=block_m, BLOCK_N=block_n,
                      TAIL_STAGES=TAIL_STAGES[key] or stages, UNCHAIN=unchain, TMA=entry.tma, TAIL_SPLIT=not causal,
                      SUMS_ONCE=SUMS_ONCE[key],
                      PDL=True, **({} if entry.tma else {"lat_desc": None, "pe_desc": None}))
    return _mla_split_kernel, signature, constexprs, dict(arch=key, num_warps=warps, num_stages=stages, aligned=True)


def write_kv(kv_cache, entries, starts):
    """Triton twin of ops.write_kv: kv_cache[b, starts[b] + t] = entries[b, t], in place (rows past L_max dropped)."""
    B, T, D = entries.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != D or not entries.is_contiguous():
        raise ValueError("write_kv (triton): kv_cache rows and entries must be contiguous")
    _write_kv_kernel[(T, B)](kv_cache, entries, starts, T, kv_cache.stride(0), kv_cache.shape[1],
                             D=D, BLOCK_D=triton.next_power_of_2(D), **pdl.options(entries))
    return kv_cache
