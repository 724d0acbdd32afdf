"""DDTree on the GPU: drafter top-k keys, best-first tree build, target sampling + walk, KV compaction.

Semantics (tie rules, hash, key layouts) are those of `ops.tree`; the derivations are in README.md (DDTree).
No launcher reads a tensor back to the host.
"""

import torch
import triton
import triton.language as tl

from triton_kernels import arch, pdl, tuning
from triton_kernels.counters import arrival_counters
from triton_kernels.keys import ordered, unordered

MAX_BUDGET = 512  # the build packs slot and rank into 9 bits each
MAX_DEPTH = 15  # and the depth into 4 bits
MAX_MERGE = 8192  # top-k: at most this many candidates (chunks x K) in one row's merge
MAX_CHUNK = 16384  # and this many lanes a chunk (in registers at 16 warps; the sm_120 check compiles this size)
SEL_TILE = 4096  # lanes one selection scan covers (it packs two counts into 15-bit fields)
MASK_TILE = 2048  # words of the ancestor mask built at once (rows x words): few row blocks, few dependent loads

# Configs as data per arch: top-k rows (K up to, chunk: lanes a program selects from in one load, least warps,
# lanes a selection scan takes at once, register cap or None), the last also for larger K; the sampling pass's BLOCK
# over the vocabulary, its warps, register cap, target programs an SM and loads in flight a loop step; warps of the
# one-program-per-tree heap build (its heap lives in registers: one warp keeps every reduction inside shuffles),
# the budget from which the depth-synchronous build replaces the heap loop, and that build's warps. sm_90: the
# fastest measured (bench/results/tree_h200_s5.md); sm_120: compile-checked (tests/test_tree_ops.py), untimed.
CONFIGS = {
    "sm_90": dict(topk=((8, 2048, 4, 2048, None), (64, 4096, 8, 2048, 64), (MAX_BUDGET, 4096, 8, SEL_TILE, None)),
                  block_v=2048, warps_v=8, maxnreg_v=48, programs_per_sm=8, unroll_v=4, build_warps=1, levels_from=8,
                  levels_warps=8),
    "sm_120": dict(topk=((MAX_BUDGET, 4096, 4, SEL_TILE, None),), block_v=1024, warps_v=4, maxnreg_v=None,
                   programs_per_sm=4, unroll_v=4, build_warps=1, levels_from=64, levels_warps=2),
}


@triton.jit
def _mix32(x):
    """The mixer of ops.tree.mix32 on uint32 (wrapping products)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    return x ^ (x >> 16)


@triton.jit
def _bitonic_stage(x, s: tl.constexpr, LOGN: tl.constexpr, DESC: tl.constexpr):
    """Stage s of a bitonic network on a [2^LOGN] vector: sorts blocks of 2^s that hold two opposite sorted
    halves, block i descending when bit s of its start is DESC's opposite. Each compare-exchange views x as
    [outer, 2, inner] and picks the pair's halves with masked sums (exact: one term is non-zero)."""
    n: tl.constexpr = 1 << LOGN
    half = tl.arange(0, 2)[None, :, None]  # [1, 2, 1]
    for u in tl.static_range(0, s):  # partner distance 2^(s-1-u)
        y = tl.reshape(x, [n >> (s - u), 2, 1 << (s - 1 - u)])
        a = tl.sum(tl.where(half == 0, y, 0), 1)  # [outer, inner]
        b = tl.sum(tl.where(half == 1, y, 0), 1)
        up = ((tl.arange(0, n >> (s - u)) >> u) & 1)[:, None] == DESC  # [outer, 1] block sorted ascending
        first = tl.where(up, tl.minimum(a, b), tl.maximum(a, b))
        second = tl.where(up, tl.maximum(a, b), tl.minimum(a, b))
        x = tl.reshape(tl.where(half == 0, first[:, None, :], second[:, None, :]), [n])
    return x


@triton.jit
def _sort(x, LOGN: tl.constexpr, DESC: tl.constexpr):
    """Bitonic sort of a [2^LOGN] vector: descending (DESC = 1) or ascending (0)."""
    for s in tl.static_range(1, LOGN + 1):
        x = _bitonic_stage(x, s, LOGN, DESC)
    return x


# ---- draft top-k: one launch; chunks select their local top K, the last chunk of a row to arrive merges ----

@triton.jit
def _threshold(o, K, lo, hi, BITS: tl.constexpr):
    """(thr, need): the K-th largest of ordered int32 values o (only their top BITS bits vary within a sign for
    this dtype), by bisection on those top bits between lo and hi (count(o >= lo << (32 - BITS)) >= K), as the
    largest thr with count(o >= thr) >= K; and how many of the values equal to thr are among the K."""
    lo = tl.zeros([], tl.int64) + lo
    hi = tl.zeros([], tl.int64) + hi
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((o >= (mid << (32 - BITS)).to(tl.int32)).to(tl.int32), 0) >= K
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    thr = (lo << (32 - BITS)).to(tl.int32)
    return thr, K - tl.sum((o > thr + ((1 << (32 - BITS)) - 1)).to(tl.int32), 0)


@triton.jit
def _pick(o, thr, need, n_gt, n_eq, BITS: tl.constexpr):
    """The winners among a tile of lanes o that follows n_gt lanes above thr and n_eq equal to it (equal ones win
    in lane order): (selected, position among the K in lane order, n_gt and n_eq after the tile). One scan counts
    both kinds (above: low 15 bits; equal: high bits)."""
    gt = o > thr + ((1 << (32 - BITS)) - 1)
    eq = (o >= thr) & ~gt
    packed = gt.to(tl.int32) + (eq.to(tl.int32) << 15)  # a tile holds at most SEL_TILE lanes
    scan = tl.cumsum(packed, 0)
    e = n_eq + (scan >> 15)
    total = tl.sum(packed, 0)
    return (gt | (eq & (e <= need)), n_gt + (scan & 32767) + tl.minimum(e, need) - 1, n_gt + (total & 32767),
            n_eq + (total >> 15))


@triton.jit
def _store_topk(lp_ptr, tok_ptr, out, key, lse, mask):
    hi = key >> 32
    tl.store(lp_ptr + out, unordered(hi.to(tl.int32)) - lse, mask=mask)
    tl.store(tok_ptr + out, 2147483647 - (key - (hi << 32)), mask=mask)


@triton.jit
def _topk_merge(cval_ptr, cid_ptr, pmax_ptr, psum_ptr, pthr_ptr, lp_ptr, tok_ptr, row, K, CHUNKS,
                BITS: tl.constexpr, MP: tl.constexpr, MT: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr):
    """Row `row`'s top K among its chunks' candidates (chunk-major, each chunk's in id order: lane order is id
    order), sorted, as log-probs through the log-sum-exp of the chunks' (max, sum exp). The row's K-th largest lies
    between the largest chunk threshold and the largest chunk max. The winners are gathered in the row's first K
    candidate slots, in tiles of MT lanes."""
    cs = tl.arange(0, CP)  # [CP]
    pm = tl.load(pmax_ptr + row * CHUNKS + cs, mask=cs < CHUNKS, other=float("-inf"), cache_modifier=".cg")
    ps = tl.load(psum_ptr + row * CHUNKS + cs, mask=cs < CHUNKS, other=0.0, cache_modifier=".cg")
    m = tl.max(pm, 0)
    lse = m + tl.log(tl.sum(ps * tl.exp(pm - m), 0))
    M = CHUNKS * K
    base = row.to(tl.int64) * M
    i = tl.arange(0, MP)  # [MP]
    o = tl.load(cval_ptr + base + i, mask=i < M, other=-2147483648, cache_modifier=".cg")  # [MP] ordered values
    lo = tl.max(tl.load(pthr_ptr + row * CHUNKS + cs, mask=cs < CHUNKS, other=-2147483648, cache_modifier=".cg"), 0)
    thr, need = _threshold(o, K, lo >> (32 - BITS), ordered(m) >> (32 - BITS), BITS)
    n_gt = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for j in tl.static_range(MP // MT):
        t = j * MT + tl.arange(0, MT)  # [MT]
        if MP != MT:
            o = tl.load(cval_ptr + base + t, mask=t < M, other=-2147483648, cache_modifier=".cg")
        sel, pos, n_gt, n_eq = _pick(o, thr, need, n_gt, n_eq, BITS)
        ids = tl.load(cid_ptr + base + t, mask=sel, cache_modifier=".cg")
        tl.debug_barrier()  # the tile is read before winners overwrite slots < K (of this tile or an earlier one)
        tl.store(cval_ptr + base + pos, o, mask=sel)
        tl.store(cid_ptr + base + pos, ids, mask=sel)
    tl.debug_barrier()
    ks = tl.arange(0, KP)  # [KP]
    top_o = tl.load(cval_ptr + base + ks, mask=ks < K, other=-2147483648)
    top_id = tl.load(cid_ptr + base + ks, mask=ks < K, other=0)
    key = tl.sort((top_o.to(tl.int64) << 32) | (2147483647 - top_id).to(tl.int64), descending=True)  # [KP]
    _store_topk(lp_ptr, tok_ptr, row.to(tl.int64) * K + ks, key, lse, ks < K)


@triton.jit(do_not_specialize=["V", "K", "CHUNKS"])
def _topk_kernel(x_ptr, cval_ptr, cid_ptr, pmax_ptr, psum_ptr, pthr_ptr, count_ptr, lp_ptr, tok_ptr, V, K, CHUNKS,
                 BITS: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr, MP: tl.constexpr, MT: tl.constexpr,
                 KP: tl.constexpr, CP: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): chunk c's (max, sum exp, K-th largest) and its K best (ordered value, id), in id order (a
    chunk holds at least K lanes; padding lanes rank last), picked in tiles of TILE lanes. The row's last program
    to arrive merges."""
    pdl.enter(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * V
    offs = c * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    tl.store(pmax_ptr + row * CHUNKS + c, m)
    tl.store(psum_ptr + row * CHUNKS + c, tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0))
    o = tl.where(offs < V, ordered(x), -2147483648)  # [CHUNK] int32
    # KP >= K disjoint groups: their KP maxima are KP lanes >= the least of them, so the K-th largest is too
    lo = tl.min(tl.max(tl.reshape(o, [KP, CHUNK // KP]), 1), 0)
    thr, need = _threshold(o, K, lo >> (32 - BITS), ordered(m) >> (32 - BITS), BITS)
    tl.store(pthr_ptr + row * CHUNKS + c, thr)
    out = (row.to(tl.int64) * CHUNKS + c) * K
    n_gt = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for j in tl.static_range(CHUNK // TILE):
        if CHUNK != TILE:  # a large chunk: its tiles again (from cache), so the scans stay small
            offs = c * CHUNK + j * TILE + tl.arange(0, TILE)  # [TILE]
            x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            o = tl.where(offs < V, ordered(x), -2147483648)
        sel, pos, n_gt, n_eq = _pick(o, thr, need, n_gt, n_eq, BITS)
        tl.store(cval_ptr + out + pos, o, mask=sel)
        tl.store(cid_ptr + out + pos, offs, mask=sel)
    tl.debug_barrier()  # every candidate is stored before the arrival is counted
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == CHUNKS - 1:
        _topk_merge(cval_ptr, cid_ptr, pmax_ptr, psum_ptr, pthr_ptr, lp_ptr, tok_ptr, row, K, CHUNKS, BITS, MP, MT,
                    KP, CP)
        tl.atomic_xchg(count_ptr + row, 0)


# ---- tree build: one program per tree; a heap loop (small budgets) or depth-synchronous rounds (large) ----

@triton.jit
def _init_tree(root_ptr, o_tok, o_par, o_dep, o_fc, o_ns, b, base, N1, NP1: tl.constexpr):
    """Every node as padding (token 0, parent -1, depth 0, no links), the root's token at node 0."""
    nodes = tl.arange(0, NP1)  # [NP1]
    in_tree = nodes < N1
    root = tl.load(root_ptr + b)
    tl.store(o_tok + base + nodes, tl.where(nodes == 0, root, 0), mask=in_tree)
    tl.store(o_par + base + nodes, tl.full([NP1], -1, tl.int32), mask=in_tree)
    tl.store(o_dep + base + nodes, tl.zeros([NP1], tl.int32), mask=in_tree)
    tl.store(o_fc + base + nodes, tl.full([NP1], -1, tl.int32), mask=in_tree)
    tl.store(o_ns + base + nodes, tl.full([NP1], -1, tl.int32), mask=in_tree)
    tl.debug_barrier()


@triton.jit
def _ancestor_mask(o_par, o_mask, base, N1, L, W, WP: tl.constexpr, ROWS: tl.constexpr):
    """Rows-parallel ancestor-or-self bits from the parents already written (bit j % 32 of word j // 32)."""
    words = tl.arange(0, WP)  # [WP]
    for r0 in range(0, N1, ROWS):
        rows = r0 + tl.arange(0, ROWS)  # [ROWS]
        cur = rows
        acc = tl.zeros([ROWS, WP], tl.int32)
        for _ in range(L + 1):
            live = (cur >= 0) & (rows < N1)
            bit = tl.full([ROWS], 1, tl.int32) << (cur & 31)
            hit = (words[None, :] == (cur >> 5)[:, None]) & live[:, None]  # [ROWS, WP]
            acc = acc | tl.where(hit, bit[:, None], 0)
            cur = tl.load(o_par + base + cur, mask=live, other=-1)
        out = o_mask + (base + rows)[:, None] * W + words[None, :]
        tl.store(out, acc, mask=(rows < N1)[:, None] & (words < W)[None, :])


@triton.jit
def _pack(score, slot, rank, depth, prev):
    """Heap key: [ordered score : 32 | 511 - slot : 9 | rank : 9 | depth : 4 | prev sibling : 10]."""
    low = ((511 - slot).to(tl.int64) << 23) | (rank.to(tl.int64) << 14) | (depth.to(tl.int64) << 10) | prev
    return (ordered(score).to(tl.int64) << 32) | low


@triton.jit
def _dead_key():
    return tl.full([], -2147483648, tl.int64) << 32


@triton.jit(do_not_specialize=["N", "K", "KS", "L", "W"])
def _tree_build_kernel(lp_ptr, tok_ptr, root_ptr, o_tok, o_par, o_dep, o_fc, o_ns, o_mask, o_num,
                       N, K, KS, L, W, NP: tl.constexpr, NP1: tl.constexpr, WP: tl.constexpr,
                       ROWS: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    b = tl.program_id(0)
    lp_b = lp_ptr + b.to(tl.int64) * L * KS
    tok_b = tok_ptr + b.to(tl.int64) * L * KS
    base = b.to(tl.int64) * (N + 1)
    _init_tree(root_ptr, o_tok, o_par, o_dep, o_fc, o_ns, b, base, N + 1, NP1)

    slots = tl.arange(0, NP)  # [NP] slot p: the next candidate child of node p
    dead = tl.full([NP], -2147483648, tl.int64) << 32
    zero = tl.zeros([], tl.int32)
    keys = tl.where(slots == 0, _pack(tl.load(lp_b), zero, zero, zero + 1, zero), dead)  # [NP] int64
    pscore = tl.zeros([NP], tl.float32)  # score of node p
    count = tl.full([], 1, tl.int32)
    for n in range(1, N + 1):
        best = tl.max(keys, 0)
        ok = best != _dead_key()
        hi = best >> 32
        low = best - (hi << 32)
        score = unordered(hi.to(tl.int32))
        slot = (511 - ((low >> 23) & 511)).to(tl.int32)
        rank = ((low >> 14) & 511).to(tl.int32)
        depth = ((low >> 10) & 15).to(tl.int32)
        prev = (low & 1023).to(tl.int32)
        ps = tl.max(tl.where(slots == slot, pscore, float("-inf")), 0)
        tok = tl.load(tok_b + (depth - 1) * KS + rank, mask=ok, other=0)
        tl.store(o_tok + base + n, tok, mask=ok)
        tl.store(o_par + base + n, slot, mask=ok)
        tl.store(o_dep + base + n, depth, mask=ok)
        tl.store(o_fc + base + slot, n, mask=ok & (rank == 0))
        tl.store(o_ns + base + prev, n, mask=ok & (rank > 0))
        has_sib = ok & (rank + 1 < K)
        lp_sib = tl.load(lp_b + (depth - 1) * KS + rank + 1, mask=has_sib, other=0.0)
        sib = tl.where(has_sib, _pack(ps + lp_sib, slot, rank + 1, depth, zero + n), _dead_key())
        has_child = ok & (depth < L) & (n < N)
        lp_child = tl.load(lp_b + depth * KS, mask=has_child, other=0.0)
        child = tl.where(has_child, _pack(score + lp_child, zero + n, zero, depth + 1, zero), _dead_key())
        keys = tl.where(slots == slot, sib, keys)
        keys = tl.where(slots == n, child, keys)
        pscore = tl.where(slots == n, score, pscore)
        count += ok.to(tl.int32)
    tl.store(o_num + b, count)
    tl.debug_barrier()
    _ancestor_mask(o_par, o_mask, base, N + 1, L, W, WP, ROWS)


@triton.jit
def _lkey(score, ppos, rank, depth, old):
    """Level-build key: [ordered score : 32 | 1023 - parent position : 10 | 511 - rank : 9 | depth : 4 |
    old index : 9]; descending = pop order."""
    low = (((1023 - ppos).to(tl.int64) << 22) | ((511 - rank).to(tl.int64) << 13) | (depth.to(tl.int64) << 9)
           | old.to(tl.int64))
    return (ordered(score).to(tl.int64) << 32) | low


@triton.jit
def _lfields(key):
    """(score, parent position, rank, depth, old index) of level-build keys."""
    hi = key >> 32
    low = key - (hi << 32)
    return (unordered(hi.to(tl.int32)), (1023 - ((low >> 22) & 1023)).to(tl.int32),
            (511 - ((low >> 13) & 511)).to(tl.int32), ((low >> 9) & 15).to(tl.int32), (low & 511).to(tl.int32))


@triton.jit(do_not_specialize=["N", "K", "KS", "L", "W"])
def _tree_levels_kernel(lp_ptr, tok_ptr, root_ptr, o_tok, o_par, o_dep, o_fc, o_ns, o_mask, o_num, s_int, s_flt,
                        N, K, KS, L, W, NP: tl.constexpr, NP1: tl.constexpr, WP: tl.constexpr,
                        ROWS: tl.constexpr, LOG: tl.constexpr, PDL: tl.constexpr):
    """U = the best N nodes of depth <= d, sorted (lanes < NP; position = lane + 1; the root is position 0).
    Round d adds the depth-d children of U's depth-(d-1) nodes in batches of NP: sort the batch, merge, keep N.
    Keys order by (score, parent position in the round's U, rank): the heap's order, ties included."""
    pdl.enter(PDL)
    b = tl.program_id(0)
    lp_b = lp_ptr + b.to(tl.int64) * L * KS
    tok_b = tok_ptr + b.to(tl.int64) * L * KS
    base = b.to(tl.int64) * (N + 1)
    s_pref = s_int + b.to(tl.int64) * (4 * NP)  # [NP] per parent j: first flat candidate index
    s_ppos = s_pref + NP  # [NP] per parent j: its position
    s_new = s_ppos + NP  # [NP + 1] old position -> new position; then the sibling sort
    s_psc = s_flt + b.to(tl.int64) * NP  # [NP] per parent j: its score
    _init_tree(root_ptr, o_tok, o_par, o_dep, o_fc, o_ns, b, base, N + 1, NP1)

    lane = tl.arange(0, NP)  # [NP] U, and a batch of candidates
    two = tl.arange(0, 2)[:, None]  # [2, 1]
    dead = tl.full([NP], -2147483648, tl.int64) << 32
    zero = tl.zeros([NP], tl.int32)
    first = lane < K  # depth 1: the root's children by rank, already in pop order
    keys = tl.where(first, _lkey(tl.load(lp_b + lane, mask=first, other=0.0), zero, lane, zero + 1, lane), dead)
    d = tl.full([], 2, tl.int32)
    while d <= L:
        score, ppos, rank, depth, old = _lfields(keys)
        is_p = (keys != dead) & (depth == d - 1)
        j = tl.cumsum(is_p.to(tl.int32), 0) - 1  # [NP] parent index j among U's depth-(d-1) nodes
        # child r of parent j has >= (pos_j - 1) + (j + 1)(r + 1) nodes before it: r < (N - pos_j) // (j + 1);
        # and it must score at least as well as U's N-th node (all of U beats it otherwise): a binary search
        thr = (tl.max(tl.where(lane == N - 1, keys, dead), 0) >> 32).to(tl.int32)  # ordered; lowest if not full
        lo = zero
        hi = zero + K
        for _ in tl.static_range(LOG + 1):  # lo: the first rank whose child scores below thr
            mid = (lo + hi) >> 1
            go = is_p & (lo < hi)
            keep = ordered(score + tl.load(lp_b + (d - 1) * KS + mid, mask=go, other=0.0)) >= thr
            lo = tl.where(go & keep, mid + 1, lo)
            hi = tl.where(go & ~keep, mid, hi)
        c = tl.where(is_p, tl.minimum(lo, (N - lane - 1) // (tl.maximum(j, 0) + 1)), 0)
        incl = tl.cumsum(c, 0)
        n_p = tl.sum(is_p.to(tl.int32), 0)
        M = tl.sum(c, 0)
        tl.store(s_pref + j, incl - c, mask=is_p)
        tl.store(s_ppos + j, lane + 1, mask=is_p)
        tl.store(s_psc + j, score, mask=is_p)
        tl.debug_barrier()
        for f0 in range(0, M, NP):
            f = f0 + lane
            fresh = f < M
            lo = zero
            hi = zero + n_p
            for _ in tl.static_range(LOG):  # parent of f: the last j with pref[j] <= f
                mid = (lo + hi) >> 1
                go = fresh & (hi - lo > 1)
                below = tl.load(s_pref + mid, mask=go, other=0) <= f
                lo = tl.where(go & below, mid, lo)
                hi = tl.where(go & ~below, mid, hi)
            r = f - tl.load(s_pref + lo, mask=fresh, other=0)
            ps = tl.load(s_psc + lo, mask=fresh, other=0.0)
            pp = tl.load(s_ppos + lo, mask=fresh, other=0)
            lp = tl.load(lp_b + (d - 1) * KS + r, mask=fresh, other=0.0)
            cand = _sort(tl.where(fresh, _lkey(ps + lp, pp, r, zero + d, zero), dead), LOG, 0)  # ascending
            both = tl.reshape(tl.where(two == 0, keys[None, :], cand[None, :]), [2 * NP])  # U then cand: bitonic
            both = tl.reshape(_bitonic_stage(both, LOG + 1, LOG + 1, 1), [2, NP])  # merged, descending
            keys = tl.sum(tl.where(two == 0, both, 0), 0)  # the first NP
            keys = tl.where(lane < N, keys, dead)
        tl.debug_barrier()
        score, ppos, rank, depth, old = _lfields(keys)
        moved = (keys != dead) & (depth < d)
        tl.store(s_new + tl.where(moved, old + 1, 0), lane + 1, mask=moved)
        tl.store(s_new, 0)
        tl.debug_barrier()
        ppos = tl.load(s_new + ppos, mask=keys != dead, other=0)
        keys = tl.where(keys != dead, _lkey(score, ppos, rank, depth, lane), dead)
        tl.debug_barrier()
        d = tl.where(n_p > 0, d + 1, L + 1)

    score, ppos, rank, depth, old = _lfields(keys)
    live = keys != dead
    n = lane + 1
    tok = tl.load(tok_b + (depth - 1) * KS + rank, mask=live, other=0)
    tl.store(o_tok + base + n, tok, mask=live)
    tl.store(o_par + base + n, ppos, mask=live)
    tl.store(o_dep + base + n, depth, mask=live)
    tl.store(o_fc + base + ppos, n, mask=live & (rank == 0))
    tl.store(o_num + b, 1 + tl.sum(live.to(tl.int32), 0))
    # next sibling: nodes sorted by (parent, rank) sit next to their siblings in rank order
    sib = _sort(tl.where(live, (ppos << 20) | (rank << 10) | n, 2147483647), LOG, 0)  # [NP] ascending
    tl.store(s_new + lane, sib)
    tl.debug_barrier()
    after = tl.load(s_new + lane + 1, mask=lane + 1 < NP, other=2147483647)
    same = (sib != 2147483647) & ((after >> 20) == (sib >> 20))
    tl.store(o_ns + base + (sib & 1023), after & 1023, mask=same)
    tl.debug_barrier()
    _ancestor_mask(o_par, o_mask, base, N + 1, L, W, WP, ROWS)


# ---- accept: per-node sampling over vocabulary splits, then one program per tree reduces and walks ----

@triton.jit(do_not_specialize=["N1", "SPLIT", "inv_t"])  # V and CHUNK specialised: vector loads
def _sample_kernel(x_ptr, num_ptr, seed_ptr, step_ptr, floor_ptr, pval_ptr, pidx_ptr, V, N1, CHUNK, SPLIT, inv_t,
                   GREEDY: tl.constexpr, HAS_FLOOR: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (b * (N+1) + node, c): the (max key, lowest id) of split c (CHUNK lanes, a multiple of BLOCK x
    UNROLL). Each lane keeps its running best (a later lane of the same slot wins only if strictly larger, so the
    lowest id of equal keys stays), one reduction at the end; UNROLL loads in flight per loop step."""
    pdl.enter(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    b = row // N1
    node = row - b * N1
    limit = tl.where(node < tl.load(num_ptr + b), V, 0)  # padding nodes read nothing
    seed = tl.load(seed_ptr + b)
    step = tl.load(step_ptr + b)
    key = _mix32(seed.to(tl.uint32) ^ 0x243F6A88)
    key = _mix32(key ^ (seed >> 32).to(tl.uint32))
    key = _mix32(key ^ step.to(tl.uint32))
    key = _mix32(key ^ (step >> 32).to(tl.uint32))
    key = _mix32(key ^ node.to(tl.uint32))
    floor = float("-inf")
    if HAS_FLOOR:
        floor = tl.load(floor_ptr + row)
    x_row = x_ptr + row.to(tl.int64) * V
    start = c * CHUNK
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # [BLOCK] per-lane running max
    best_idx = tl.zeros([BLOCK], tl.int32) + start
    for off in range(start, start + CHUNK, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            offs = off + u * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
            ok = offs < limit
            x = tl.load(x_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
            if GREEDY:
                k = x
            else:
                xs = x * inv_t
                h = _mix32(_mix32(key ^ offs.to(tl.uint32)) ^ 0x85A308D3)
                r = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
                k = tl.where(ok & (xs >= floor), xs - tl.log(-tl.log(r)), float("-inf"))
            take = k > best
            best = tl.where(take, k, best)
            best_idx = tl.where(take, offs, best_idx)
    m = tl.max(best, 0)
    tl.store(pval_ptr + row * SPLIT + c, m)
    tl.store(pidx_ptr + row * SPLIT + c, tl.min(tl.where(best == m, best_idx, 2147483647), 0))


@triton.jit
def _samples(pval_ptr, pidx_ptr, b, N1, SPLIT, rows, live, SP: tl.constexpr):
    """[R] the sample at nodes `rows` of tree b (where `live`) from their splits' partials: the first split holding
    the max wins (lower token ids win ties)."""
    cs = tl.arange(0, SP)  # [SP]
    part = (b * N1 + rows) * SPLIT
    ok = live[:, None] & (cs < SPLIT)[None, :]
    v = tl.load(pval_ptr + part[:, None] + cs[None, :], mask=ok, other=float("-inf"),
                cache_modifier=".cg")  # [R, SP] in one load
    m = tl.max(v, 1)
    first = tl.min(tl.where(v == m[:, None], cs[None, :], SP), 1)
    return tl.load(pidx_ptr + part + first, mask=live, other=0, cache_modifier=".cg")


@triton.jit(do_not_specialize=["N1", "L", "SPLIT"])
def _walk_kernel(pval_ptr, pidx_ptr, tok_ptr, par_ptr, path_ptr, len_ptr, next_ptr, N1, L, SPLIT,
                 NP1: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
    """Tree b: each node's sample; the nodes whose token is their parent's sample marked in parallel, so that a
    walk step is one reduction (the lowest marked child of the current node)."""
    pdl.enter(PDL)
    b = tl.program_id(0)
    nodes = tl.arange(0, NP1)  # [NP1]
    sampled = _samples(pval_ptr, pidx_ptr, b, N1, SPLIT, nodes, nodes < N1, SP)  # [NP1]
    toks = tl.load(tok_ptr + b.to(tl.int64) * N1 + nodes, mask=nodes < N1, other=-1)
    pars = tl.load(par_ptr + b.to(tl.int64) * N1 + nodes, mask=nodes < N1, other=-1)
    good = (pars >= 0) & (toks == _samples(pval_ptr, pidx_ptr, b, N1, SPLIT, tl.maximum(pars, 0), pars >= 0, SP))
    path_b = path_ptr + b * (L + 1)
    tl.store(path_b, 0)
    cur = tl.zeros([], tl.int32)
    walking = tl.full([], 1, tl.int32)
    length = tl.full([], 1, tl.int32)
    for d in range(1, L + 1):
        child = tl.min(tl.where(good & (pars == cur), nodes, NP1), 0)
        walking = walking & (child < NP1).to(tl.int32)
        tl.store(path_b + d, tl.where(walking != 0, child, -1))
        cur = tl.where(walking != 0, child, cur)
        length += walking
    tl.store(len_ptr + b, length)
    tl.store(next_ptr + b, tl.sum(tl.where(nodes == cur, sampled, 0), 0).to(tl.int64))


# ---- compaction: programs (layer, b) move cache rows, programs (layers + chunk, b) gather hidden rows ----

@triton.jit(do_not_specialize=["layers", "L1"])  # sizes and strides specialised: vector loads and stores
def _compact_kernel(kv_ptr, starts_ptr, path_ptr, len_ptr, hid_ptr, out_ptr, layers, L1, D, F,
                    s_layer, s_b, s_pos, h_b, h_n, LP: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
                    PDL: tl.constexpr):
    pdl.enter(PDL)
    p = tl.program_id(0)
    b = tl.program_id(1)
    i = tl.arange(0, LP)  # [LP] path position
    valid = (i < tl.load(len_ptr + b)) & (i < L1)
    src = tl.load(path_ptr + b * L1 + i, mask=valid, other=0).to(tl.int64)
    if p < layers:
        start = tl.load(starts_ptr + b).to(tl.int64)
        base = kv_ptr + p.to(tl.int64) * s_layer + b.to(tl.int64) * s_b
        move = valid & (src != i)  # a node already in place (the chain's prefix) needs no copy
        for d0 in range(0, D, BD):  # one round for D <= BD
            cols = d0 + tl.arange(0, BD)  # [BD]
            m = move[:, None] & (cols < D)[None, :]
            rows = tl.load(base + (start + src)[:, None] * s_pos + cols[None, :], mask=m)  # [LP, BD]
            tl.debug_barrier()  # every source read before any destination (one may be another's source)
            tl.store(base + (start + i)[:, None] * s_pos + cols[None, :], rows, mask=m)
    else:
        cols = (p - layers) * BF + tl.arange(0, BF)  # [BF]
        m = valid[:, None] & (cols < F)[None, :]
        h = tl.load(hid_ptr + b.to(tl.int64) * h_b + src[:, None] * h_n + cols[None, :], mask=m, other=0.0)
        out = out_ptr + (b.to(tl.int64) * L1 + i)[:, None] * F + cols[None, :]
        tl.store(out, h, mask=(i < L1)[:, None] & (cols < F)[None, :])


# ---- launchers ----

def config_for(device, budget):
    """The config for trees of `budget` nodes (top-k's K, the build's budget, accept's nodes past the root) on the
    arch in force for `device`: the tuned file's (tuning.py) where it has one for the budget, else CONFIGS'."""
    key = arch.current(device)
    return tuning.tree_entry(key, budget) or CONFIGS[key]


def _cap(maxnreg):
    """Launch keywords for a register cap (None: the compiler's choice)."""
    return {} if maxnreg is None else dict(maxnreg=maxnreg)


def _split(rows, V, block, programs):
    """Vocabulary splits per row so that rows x splits fills about `programs` programs; chunk a `block` multiple."""
    split = max(1, min(triton.cdiv(V, block), triton.cdiv(programs, rows), 64))
    chunk = triton.cdiv(triton.cdiv(V, split), block) * block
    return triton.cdiv(V, chunk), chunk


def _value_bits(dtype):
    """Bits of the ordered fp32 key that can differ for this input dtype (sign, exponent, mantissa)."""
    return {torch.bfloat16: 16, torch.float16: 19}.get(dtype, 32)


def topk_plan(V, k, cfg):
    """The top-k launch for K = k over V lanes from the config's rows (K up to, chunk, least warps, scan tile,
    register cap): chunk lanes (at least K; chunks x K candidates fit one merge), chunks a row, merge lanes,
    warps, scan tile lanes, register cap."""
    rows = cfg["topk"]
    kp = triton.next_power_of_2(max(k, 2))
    chunk, least_warps, tile, maxnreg = next((r[1:] for r in rows if k <= r[0]), rows[-1][1:])
    chunk = max(min(chunk, triton.next_power_of_2(V)), kp,
                triton.next_power_of_2(triton.cdiv(V, MAX_MERGE // kp)))
    if chunk > MAX_CHUNK:
        raise ValueError(f"draft_topk (triton): V = {V} with k = {k} needs chunks of {chunk} > {MAX_CHUNK}")
    chunks = triton.cdiv(V, chunk)
    mp = triton.next_power_of_2(chunks * k)
    return (chunk, chunks, mp, min(16, max(least_warps, max(chunk, mp) // 1024)), min(chunk, tile, SEL_TILE),
            maxnreg)


def draft_topk(logits, k):
    x = logits.contiguous()
    B, L, V = x.shape
    dev = x.device
    rows = B * L
    cfg = config_for(dev, k)
    chunk, chunks, mp, warps, tile, maxnreg = topk_plan(V, k, cfg)
    cval = torch.empty(rows, chunks, k, dtype=torch.int32, device=dev)
    cid = torch.empty(rows, chunks, k, dtype=torch.int32, device=dev)
    pmax = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    psum = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    pthr = torch.empty(rows, chunks, dtype=torch.int32, device=dev)
    lp = torch.empty(B, L, k, dtype=torch.float32, device=dev)
    tokens = torch.empty(B, L, k, dtype=torch.int64, device=dev)
    counters = arrival_counters("ddtree_topk", dev, rows)
    _topk_kernel[(rows, chunks)](x, cval, cid, pmax, psum, pthr, counters, lp, tokens, V, k, chunks,
                                 BITS=_value_bits(x.dtype), CHUNK=chunk, TILE=tile, MP=mp, MT=min(mp, SEL_TILE),
                                 KP=triton.next_power_of_2(max(k, 2)), CP=triton.next_power_of_2(max(chunks, 2)),
                                 num_warps=warps, **_cap(maxnreg),
                                 **pdl.options(x))
    return lp, tokens


def build_tree(logprobs, tokens, root_tokens, budget):
    B, L, KS = logprobs.shape
    if budget > MAX_BUDGET or L > MAX_DEPTH:
        raise ValueError(f"build_tree (triton): budget {budget} <= {MAX_BUDGET} and L {L} <= {MAX_DEPTH} required")
    N = budget
    N1 = N + 1
    W = triton.cdiv(N1, 32)
    dev = logprobs.device
    cfg = config_for(dev, budget)
    lp, tok = logprobs.contiguous(), tokens.contiguous()
    tokens_out = torch.empty(B, N1, dtype=torch.int64, device=dev)
    parents, depths, first_child, next_sibling = (torch.empty(B, N1, dtype=torch.int32, device=dev) for _ in range(4))
    mask = torch.empty(B, N1, W, dtype=torch.int32, device=dev)
    num_nodes = torch.empty(B, dtype=torch.int32, device=dev)
    NP = triton.next_power_of_2(N)
    args = (lp, tok, root_tokens.contiguous(), tokens_out, parents, depths, first_child, next_sibling, mask, num_nodes)
    NP1, WP = triton.next_power_of_2(N1), triton.next_power_of_2(W)
    sizes = dict(NP=NP, NP1=NP1, WP=WP, ROWS=min(NP1, max(32, MASK_TILE // WP)))
    if N >= cfg["levels_from"]:
        s_int = torch.empty(B, 4 * NP, dtype=torch.int32, device=dev)
        s_flt = torch.empty(B, NP, dtype=torch.float32, device=dev)
        _tree_levels_kernel[(B,)](*args, s_int, s_flt, N, min(KS, N), KS, L, W, **sizes, LOG=NP.bit_length() - 1,
                                  num_warps=cfg["levels_warps"], **pdl.options(lp))
    else:
        _tree_build_kernel[(B,)](*args, N, min(KS, N), KS, L, W, **sizes, num_warps=cfg["build_warps"],
                                 **pdl.options(lp))
    return tokens_out, parents, depths, mask, first_child, next_sibling, num_nodes


def accept(tree, target_logits, temperature, floor, seeds, step):
    B, N1, V = target_logits.shape
    L = tree.max_depth
    x = target_logits.contiguous()
    cfg = config_for(x.device, N1 - 1)
    block = min(cfg["block_v"], triton.next_power_of_2(V))
    rows = B * N1
    unroll = max(1, min(cfg["unroll_v"], triton.cdiv(V, block)))
    split, chunk = _split(rows, V, block * unroll, cfg["programs_per_sm"] * arch.sm_count(x.device))
    pval = torch.empty(rows, split, dtype=torch.float32, device=x.device)
    pidx = torch.empty(rows, split, dtype=torch.int32, device=x.device)
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    path = torch.empty(B, L + 1, dtype=torch.int32, device=x.device)
    path_len = torch.empty(B, dtype=torch.int32, device=x.device)
    next_token = torch.empty(B, dtype=torch.int64, device=x.device)
    _sample_kernel[(rows, split)](
        x, tree.num_nodes, seeds.contiguous(), step.contiguous(), floor if floor is not None else pval, pval, pidx,
        V, N1, chunk, split, inv_t, GREEDY=temperature == 0, HAS_FLOOR=floor is not None, BLOCK=block,
        UNROLL=unroll, num_warps=cfg["warps_v"], **_cap(cfg["maxnreg_v"]), enable_fp_fusion=False,
        **pdl.options(x))  # x / T and the noise rounded as in torch
    _walk_kernel[(B,)](pval, pidx, tree.tokens, tree.parents, path, path_len, next_token, N1, L, split,
                       NP1=triton.next_power_of_2(max(N1, L + 1)), SP=triton.next_power_of_2(split), num_warps=4,
                       **pdl.options(x))
    return path, path_len, next_token


def compact(kv, starts, path, path_len, hidden):
    layers, _, _, D = kv.shape
    B, L1 = path.shape
    F = hidden.shape[-1]
    if kv.stride(-1) != 1 or hidden.stride(-1) != 1:
        raise ValueError("compact (triton): kv and hidden need a contiguous last dim")
    out = torch.empty(B, L1, F, dtype=hidden.dtype, device=hidden.device)
    BF = min(256, triton.next_power_of_2(F))
    grid = (layers + triton.cdiv(F, BF), B)
    _compact_kernel[grid](kv, starts, path.contiguous(), path_len, hidden, out, layers, L1, D, F,
                          kv.stride(0), kv.stride(1), kv.stride(2), hidden.stride(0), hidden.stride(1),
                          LP=triton.next_power_of_2(L1), BD=min(1024, triton.next_power_of_2(D)), BF=BF, num_warps=8,
                          **pdl.options(kv))
    return out
