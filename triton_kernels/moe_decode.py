"""The W4A16 MoE's decode path (a block per (token, expert) pair, moe_w4a16) in one launch, for an entry with
`one_launch`: the gate/up and down work items share one grid, so down's weight reads overlap gate/up's work and no
launch boundary sits between the two GEMMs.

Each program takes a ticket from an atomic counter; the tickets, not the program ids, order the work. Tickets
0 .. n_gate_up - 1 are gate/up items (pair, N tile of the intermediate, K split), the rest down items (pair, group
of N tiles of the hidden size, K split), pair by pair. A gate/up item adds its partials into the pair's fp32 sums
(`moe_gate_up.gate_up_sums`); the split that finishes a tile's h counts the pair's ready counter up (release). A
down item asks L2 for its words, waits until its pair's h is whole (acquire: the count reaches the intermediate's
N tiles), then runs the down kernel's block and top-k sums (`moe_down.down_block`, `down_sums`).

Every wait ends: a program holds a down ticket only after every gate/up ticket went to a program already running,
and gate/up items never wait, whatever the grid's size or the order in which the GPU starts programs. The last
program to finish zeroes the tickets and ready counters, so the scratch (`moe_w4a16.decode_scratch`) is zero
between launches and a CUDA graph replays the launch as is.

One kernel has one set of launch settings: the entry's gate/up and down configs must agree on ALIKE (`apart`).
"""

import triton
import triton.language as tl

from triton_kernels import pdl
from triton_kernels.moe_down import down_block, down_sums, prefetch_words
from triton_kernels.moe_gate_up import gate_up_sums, gate_up_tile
from triton_kernels.moe_layout import SLAB, UNPACK
from triton_kernels.moe_tiles import (SIGNATURE_DTYPES, expert_bases, flags, launch_options, layout_args, orient,
                                      resident_programs)

ALIKE = {"num_warps": None, "num_stages": None, "maxnreg": None, "swap": False, "lop3": False,
         "scales_ahead": False, "prescale": False, "mma_v2": False}  # key -> its value when absent
SYNC = 2  # the scratch's words before the ready counters: the ticket counter, the finished counter
_SYNC = tl.constexpr(SYNC)
PERSISTENT = True  # as many programs as the GPU holds at once, each taking tickets until they run out


@triton.jit
def _wait_until(counter, count):
    """Spin until the int32 at `counter` reaches `count`; acquire, then a CTA barrier: what was released before each
    count is visible to every thread of the program."""
    while tl.atomic_add(counter, 0, sem="acquire") < count:
        pass
    tl.debug_barrier()


@triton.jit
def _zero(ptr, n, BLOCK: tl.constexpr):
    """Zero the n int32 words at ptr."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        tl.store(ptr + start + offs, 0, mask=start + offs < n)


@triton.jit
def _gate_up_item(ticket, x_ptr, w_ptr, s_ptr, h_ptr, sums_ptr, counter_ptr, ready, ids_ptr, D, I, n_slabs,
                  per_split, split_k, tiles, stride_we, stride_se, w_row, s_row, stride_wn, up_w, up_s,
                  TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KMAJOR: tl.constexpr, MAGIC: tl.constexpr,
                  MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                  LOP3: tl.constexpr, AHEAD: tl.constexpr, PRESCALE: tl.constexpr):
    """Gate/up item `ticket` (pair, N tile of `tiles`, K split of split_k): its partials into the pair's sums; the
    split that writes the tile's h counts the pair's ready counter up (release)."""
    b, tile, split = ticket // (tiles * split_k), ticket // split_k % tiles, ticket % split_k
    lane = tl.arange(0, BM)
    pair = tl.where(lane == 0, b, -1)  # [BM]: the pair alone, in row 0
    acc_g, acc_u, n, n_mask = gate_up_tile(x_ptr, w_ptr, s_ptr, pair, tl.load(ids_ptr + b), tile, split, D, I,
                                           n_slabs, per_split, stride_we, stride_se, w_row, s_row, stride_wn, up_w,
                                           up_s, TOP_K, BM, BN, KMAJOR, MAGIC, MAGIC_VALUE, WIDE, EVEN_K, SWAP, LOP3,
                                           AHEAD, PRESCALE)
    first_row = orient(lane == 0, n, SWAP)[0]
    if gate_up_sums(acc_g, acc_u, first_row, sums_ptr + b * (2 * I), counter_ptr + b * tiles + tile,
                    h_ptr + (b * BM).to(tl.int64) * I, n, n_mask, split_k, I, SWAP):
        tl.debug_barrier()  # every thread's h stores precede the count that releases them
        tl.atomic_add(ready + b, 1, sem="release")


@triton.jit
def _down_item(item, h_ptr, w_ptr, s_ptr, out_ptr, y_ptr, counter_ptr, ready, ids_ptr, weights_ptr, D, I, n_slabs,
               per_split, split_k, groups, gu_tiles, stride_we, stride_se, w_row, s_row, stride_wn,
               TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TILES: tl.constexpr, KMAJOR: tl.constexpr,
               MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, EVEN_K: tl.constexpr,
               SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr, ONE_SLAB: tl.constexpr,
               PREFETCH: tl.constexpr, PRESCALE: tl.constexpr):
    """Down item `item` (pair, group of TILES N tiles of `groups`, K split of split_k): asks L2 for its words, waits
    until the pair's h is whole (its ready count reaches gu_tiles), then adds into the token's sums; the last of
    the token's items at the group writes y (`moe_down.down_sums`)."""
    b, group, split = item // (groups * split_k), item // split_k % groups, item % split_k
    e = tl.load(ids_ptr + b)
    if PREFETCH:  # the words do not depend on h
        w_base = expert_bases(w_ptr, s_ptr, e, stride_we, stride_se)[0]
        prefetch_words(w_base, group, split * per_split, w_row, stride_wn, BN, KMAJOR, TILES)
    _wait_until(ready + b, gu_tiles)
    lane = tl.arange(0, BM)
    down_block(h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, tl.where(lane == 0, b, -1), e, b * BM + lane, group, split,
               D, I, n_slabs, per_split, stride_we, stride_se, w_row, s_row, stride_wn, TOP_K, BM, BN, False, KMAJOR,
               TILES, MAGIC, MAGIC_VALUE, WIDE, EVEN_K, SWAP, LOP3, AHEAD, ONE_SLAB, False, PRESCALE)
    token = b // TOP_K
    down_sums(out_ptr + token * D, y_ptr + token * D, counter_ptr + token * groups + group, group * TILES, D,
              TOP_K * split_k, BN, TILES, False)


@triton.jit(do_not_specialize=["P", "gu_per_split", "gu_split", "dn_per_split", "dn_split"])
def _decode_moe_kernel(x_ptr, gu_w_ptr, gu_s_ptr, dn_w_ptr, dn_s_ptr, h_ptr, gu_sums_ptr, gu_counter_ptr, out_ptr,
                       y_ptr, dn_counter_ptr, sync_ptr, ids_ptr, weights_ptr, D, I, P, gu_slabs, gu_per_split,
                       gu_split, dn_slabs, dn_per_split, dn_split, gu_stride_we, gu_stride_se, gu_w_row, gu_s_row,
                       gu_stride_wn, up_w, up_s, dn_stride_we, dn_stride_se, dn_w_row, dn_s_row, dn_stride_wn,
                       TOP_K: tl.constexpr, BM: tl.constexpr, GU_BN: tl.constexpr, DN_BN: tl.constexpr,
                       TILES: tl.constexpr, KMAJOR: tl.constexpr, MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr,
                       WIDE: tl.constexpr, GU_EVEN_K: tl.constexpr, DN_EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                       LOP3: tl.constexpr, AHEAD: tl.constexpr, ONE_SLAB: tl.constexpr, PREFETCH: tl.constexpr,
                       PDL: tl.constexpr = False, PRESCALE: tl.constexpr = False, MMA_V2: tl.constexpr = False):
    """y [M, D] = the MoE of x [M, D] for P = M k pairs (ids_ptr: their experts, weights_ptr: their top-k weights):
    each program takes tickets until they run out, gate/up items then down items (module docstring). Scratch, zero
    on entry and on exit: the pairs' gate/up sums [P, 2 I] and counters [P, gate/up N tiles], the tokens' output
    sums [M, D] and counters [M, down groups], and sync_ptr [SYNC + P] (tickets, finished programs, each pair's
    ready count). h [P BM, I]: pair b's in row b BM. PREFETCH: the down items' L2 prefetch (PTX)."""
    pdl.enter(PDL)
    gu_tiles = tl.cdiv(I, GU_BN)
    groups = tl.cdiv(D, DN_BN) // TILES
    n_gate_up = P * gu_tiles * gu_split
    total = n_gate_up + P * groups * dn_split
    ready = sync_ptr + _SYNC
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while ticket < total:
        if ticket < n_gate_up:
            _gate_up_item(ticket, x_ptr, gu_w_ptr, gu_s_ptr, h_ptr, gu_sums_ptr, gu_counter_ptr, ready, ids_ptr, D,
                          I, gu_slabs, gu_per_split, gu_split, gu_tiles, gu_stride_we, gu_stride_se, gu_w_row,
                          gu_s_row, gu_stride_wn, up_w, up_s, TOP_K, BM, GU_BN, KMAJOR, MAGIC, MAGIC_VALUE, WIDE,
                          GU_EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
        else:
            _down_item(ticket - n_gate_up, h_ptr, dn_w_ptr, dn_s_ptr, out_ptr, y_ptr, dn_counter_ptr, ready, ids_ptr,
                       weights_ptr, D, I, dn_slabs, dn_per_split, dn_split, groups, gu_tiles, dn_stride_we,
                       dn_stride_se, dn_w_row, dn_s_row, dn_stride_wn, TOP_K, BM, DN_BN, TILES, KMAJOR, MAGIC,
                       MAGIC_VALUE, WIDE, DN_EVEN_K, SWAP, LOP3, AHEAD, ONE_SLAB, PREFETCH, PRESCALE)
        ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:  # the last program to finish:
        _zero(sync_ptr, P + _SYNC, 32)  # no one reads the tickets or ready counts any more


def apart(cfg):
    """The ALIKE keys on which entry cfg's gate/up and down configs differ."""
    g, d = cfg["gate_up"], cfg["down"]
    return [k for k, absent in ALIKE.items() if g.get(k, absent) != d.get(k, absent)]


def alike(cfg):
    """Entry cfg with `one_launch`, its down config taking gate/up's ALIKE settings (the tuner's candidate)."""
    g = cfg["gate_up"]
    down = {k: v for k, v in cfg["down"].items() if k not in ALIKE} | {k: g[k] for k in ALIKE if k in g}
    return {**cfg, "one_launch": True, "down": down}


def check_config(cfg):
    """Raise ValueError unless entry cfg can run in one launch: the decode path, gate/up and down alike."""
    if not cfg.get("decode", False):
        raise ValueError("moe (triton): one_launch needs the decode path (decode: true)")
    if apart(cfg):
        raise ValueError(f"moe (triton): one_launch runs gate/up and down in one kernel, so their configs must agree "
                         f"on {', '.join(apart(cfg))}: gate_up {cfg['gate_up']}, down {cfg['down']}")


def decode_constexprs(cfg, top_k, dtype, D, I, tiles, ptx=True):
    """The constexprs of `_decode_moe_kernel` under entry cfg (`tiles` down N tiles a program)."""
    g, d = cfg["gate_up"], cfg["down"]
    f = flags(g, ptx)
    return dict(TOP_K=top_k, BM=cfg["BM"], GU_BN=g["BN"], DN_BN=d["BN"], TILES=tiles, KMAJOR=cfg.get("kmajor", False),
                **UNPACK[dtype], GU_EVEN_K=D % SLAB == 0, DN_EVEN_K=I % SLAB == 0, SWAP=f["SWAP"], LOP3=f["LOP3"],
                AHEAD=f["AHEAD"], ONE_SLAB=triton.cdiv(I, SLAB) == 1 and tiles > 1, PREFETCH=ptx,
                PDL=cfg.get("pdl", False), PRESCALE=f["PRESCALE"], MMA_V2=f["MMA_V2"])


def decode_moe(x, experts, topk_ids, topk_weights, h, gu_sums, gu_counters, out, y, dn_counters, sync, cfg, splits,
               tiles, ptx, use_pdl):
    """Launch `_decode_moe_kernel` under entry cfg: y [M, D] from x [M, D]. splits: ((gate/up splits, slabs a
    split), (down splits, slabs a split)); tiles: down N tiles a program; the scratch from `decode_scratch`."""
    (gu_split, gu_per_split), (dn_split, dn_per_split) = splits
    M, D = x.shape
    P, I = topk_ids.numel(), experts.intermediate
    g, d = cfg["gate_up"], cfg["down"]
    items = P * (triton.cdiv(I, g["BN"]) * gu_split + triton.cdiv(D, d["BN"]) // tiles * dn_split)
    gu_layout = layout_args(experts.gate_up, experts.gate_up_scale, experts.kmajor, up=I)
    dn_layout = layout_args(experts.down, experts.down_scale, experts.kmajor)
    args = [
        x, experts.gate_up, experts.gate_up_scale, experts.down, experts.down_scale, h, gu_sums, gu_counters, out, y,
        dn_counters, sync, topk_ids, topk_weights, D, I, P, experts.gate_up_slabs, gu_per_split, gu_split,
        experts.down_slabs, dn_per_split, dn_split, experts.gate_up.stride(0), experts.gate_up_scale.stride(0),
        *(gu_layout[k] for k in ("w_row", "s_row", "stride_wn", "up_w", "up_s")), experts.down.stride(0),
        experts.down_scale.stride(0), *(dn_layout[k] for k in ("w_row", "s_row", "stride_wn"))]
    constexprs = {**decode_constexprs(cfg, topk_ids.shape[1], x.dtype, D, I, tiles, ptx), "PDL": use_pdl,
                  **launch_options(g, use_pdl)}
    programs = items
    if ptx and PERSISTENT:
        programs = min(items, resident_programs(_decode_moe_kernel, args, constexprs, x.device, x.dtype))
    _decode_moe_kernel[(programs,)](*args, **constexprs)


def decode_spec(cfg, top_k, dtype, key, D, I):
    """(kernel, signature, constexprs, aot options) of `_decode_moe_kernel` under entry cfg (hidden D, intermediate
    I, activations of `dtype`), compiled for arch `key` as the JIT specialises it (moe_tiles.aot_options' rules)."""
    g, d = cfg["gate_up"], cfg["down"]
    tiles = d.get("tiles", 1)
    x = SIGNATURE_DTYPES[dtype]
    pointers = dict(x_ptr=x, gu_w_ptr="i32", gu_s_ptr="bf16", dn_w_ptr="i32", dn_s_ptr="bf16", h_ptr=x,
                    gu_sums_ptr="fp32", gu_counter_ptr="i32", out_ptr="fp32", y_ptr=x, dn_counter_ptr="i32",
                    sync_ptr="i32", ids_ptr="i32", weights_ptr="fp32")
    ints = ["D", "I", "P", "gu_slabs", "gu_per_split", "gu_split", "dn_slabs", "dn_per_split", "dn_split",
            "gu_stride_we", "gu_stride_se", "gu_w_row", "gu_s_row", "gu_stride_wn", "up_w", "up_s", "dn_stride_we",
            "dn_stride_se", "dn_w_row", "dn_s_row", "dn_stride_wn"]
    signature = {**{k: f"*{v}" for k, v in pointers.items()},
                 **{k: "i64" if k.endswith("stride_we") or k.endswith("stride_se") else "i32" for k in ints}}
    kmajor = cfg.get("kmajor", False)
    ones = (["gu_w_row", "dn_w_row"] if kmajor else []) + (["dn_slabs"] if triton.cdiv(I, SLAB) == 1 else [])
    sizes = ["D", "I", "gu_stride_we", "gu_stride_se", "gu_w_row", "gu_s_row", "gu_stride_wn", "up_w", "up_s",
             "dn_stride_we", "dn_stride_se", "dn_w_row", "dn_s_row", "dn_stride_wn"]
    options = dict(arch=key, num_warps=g["num_warps"], num_stages=g["num_stages"], maxnreg=g.get("maxnreg"),
                   aligned=True, ones=ones, divisible=[n for n in sizes if n not in ones])
    return _decode_moe_kernel, signature, decode_constexprs(cfg, top_k, dtype, D, I, tiles), options
