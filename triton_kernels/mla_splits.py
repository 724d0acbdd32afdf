"""How the MLA attention splits a sequence's cache: the device-side rule both split kernels follow (`program_range`:
the Triton one in mla_attention.py, the Gluon one in mla_gluon.py), the tree mask's rule of the Triton kernels
(`visible`: the split kernel's and mla_two_pass.py's) and the host-side model that picks the split count
(`default_splits`), with its tables per arch (README.md, attention: the split model)."""

import functools
import heapq
import math

import triton
import triton.language as tl

D_LAT = 512  # value dim: the latent c
D_PE = 64  # rope part of an entry
ENTRY = D_LAT + D_PE

MIN_TILES_PER_SPLIT = 4  # a split reads at least this many KV tiles (unless a wave would be left half idle)
# Split-count candidates per arch: this many programs per resident slot of the GPU.
SPLIT_PER_SLOT = {"sm_90": (0.5, 1, 2, 4), "sm_120": (1,)}
# Split rule per arch: (window, whole). The cost is averaged over cache lengths max_len, max_len - BLOCK_N, ...
# (window of them): the kernel splits the actual length, which a padded cache (the model's, sized for the largest
# context) puts below max_len. whole: the counts that fill whole waves (floor) are candidates beside the ceil ones.
# (8, True) picks the fastest count, or one within 4.3% of it, in every case of bench/results/attention_h200_run5.md.
SPLIT_RULE = {"sm_90": (8, True), "sm_120": (8, True)}
MERGE_COST = {"sm_90": (4.0, 0.5), "sm_120": (4.0, 0.5)}  # merge: us per launch, us per MB of partials
# Tree attention with several splits: the last split takes the tiles holding tree entries (masked, slower) and the
# others split the prefix, so that no program runs a whole split and the masked tiles too; by default where the
# tree spans at most TAIL_SPLIT[arch] tiles (faster up to 2 tiles, slower at 3:
# bench/results/attention_h200_s10_tail_split.json). A masked tile costs about TAIL_TILE_COST unmasked ones.
TAIL_SPLIT = {"sm_90": 2, "sm_120": 2}
TAIL_TILE_COST = 2.0


@triton.jit
def program_range(length, T, pid_m, pid_s, num_splits, H: tl.constexpr, CAUSAL: tl.constexpr,
                  TAIL_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tree_start, start, end, n_full) of split pid_s of query tile pid_m for a sequence of `length` entries whose
    last T are the tree: its entries [start, end), the first n_full of its tiles wholly visible."""
    tree_start = length - T  # first new token's entry
    kv_end = length
    if CAUSAL:  # entries past this tile's last token are invisible to all its rows
        t_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // H, T - 1)
        kv_end = tree_start + t_last + 1
    if TAIL_SPLIT:  # the last split takes the tiles holding tree entries, the others split the prefix's tiles
        prefix_end = tree_start // BLOCK_N * BLOCK_N
        split_len = tl.cdiv(tl.cdiv(prefix_end, num_splits - 1), BLOCK_N) * BLOCK_N
        is_tail = pid_s == num_splits - 1
        start = tl.where(is_tail, prefix_end, pid_s * split_len)
        end = tl.where(is_tail, kv_end, tl.minimum(start + split_len, prefix_end))
    else:
        split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        start = pid_s * split_len
        end = tl.minimum(start + split_len, kv_end)
    n_full = tl.maximum(tl.minimum(end, tree_start) - start, 0) // BLOCK_N  # tiles with every entry visible
    return tree_start, start, end, n_full


@triton.jit
def visible(offs_m, offs_n, end, tree_start, T, b, mask_ptr, H: tl.constexpr, CAUSAL: tl.constexpr,
            GATHER: tl.constexpr = True):
    """[BM, BN] which entries offs_n each query row offs_m (row = t*H + h) sees, of those before `end`: the prefix
    (before tree_start), and of the last T entries (the tree) the ones its token's mask bits allow (mask_ptr:
    [B, T, ceil(T/32)] int32 words) or, CAUSAL, entries up to its own token's.

    GATHER: each entry's word loaded in one [BM, BN] gather; else the row's words one at a time ([BM] loads). The
    split kernel gathers (the word loop costs it 22-25 KB more shared memory on sm_120, past 101,376 B at 32x32);
    the scores pass loops (its 128x64 tile on sm_120: 168 registers a thread, 255 with the gather; up to 1.25x
    faster on the proxy, bench/results/attention_two_pass_h100.md)."""
    node = offs_n - tree_start  # [BN] new-token index of each entry (< 0: prefix)
    in_tree = node >= 0
    n_ok = offs_n < end
    t_row = offs_m // H
    if CAUSAL:
        seen = node[None, :] <= t_row[:, None]
    else:
        node_c = tl.maximum(node, 0)
        words = (T + 31) // 32
        if GATHER:
            word_ptr = mask_ptr + (b * T + t_row)[:, None] * words + (node_c // 32)[None, :]
            bits = tl.load(word_ptr, mask=(offs_m < T * H)[:, None] & (in_tree & n_ok)[None, :], other=0)
            bits = bits >> (node_c % 32)[None, :]
        else:
            word_of, bit = node_c // 32, node_c % 32  # [BN]
            row_words = mask_ptr + (b * T + tl.minimum(t_row, T - 1)) * words  # [BM]; rows past T*H never stored
            bits = tl.zeros([offs_m.shape[0], offs_n.shape[0]], dtype=tl.int32)
            for w in range(0, words):
                bits = tl.where((word_of == w)[None, :], tl.load(row_words + w)[:, None] >> bit[None, :], bits)
        seen = (bits & 1) != 0
    return n_ok[None, :] & (~in_tree[None, :] | seen)


def choose_splits(base, max_len, block_n, slots, per_slot, whole=False):
    """Splits per sequence: about per_slot programs per slot over `slots` resident programs with `base` programs
    per split (whole: at most that many, so the programs fill whole waves), each split reading at least
    MIN_TILES_PER_SPLIT tiles of the max_len-entry cache, unless so few splits would leave more than half of one
    wave's slots idle (short caches): then up to one wave of splits, down to one tile each."""
    want = math.floor(per_slot * slots / base) if whole else math.ceil(per_slot * slots / base)
    cap = max(1, triton.cdiv(max_len, block_n * MIN_TILES_PER_SPLIT))
    wave = max(1, slots // base)
    if cap < wave // 2:
        cap = min(wave, triton.cdiv(max_len, block_n))
    return max(1, min(want, cap))


def split_bounds(splits, length, block_n):
    """(start, end) entries of each of `splits` splits of `length` entries (the kernel's rule)."""
    split_len = triton.cdiv(triton.cdiv(length, splits), block_n) * block_n
    return [(min(length, s * split_len), min(length, (s + 1) * split_len)) for s in range(splits)]


def split_work(splits, length, block_n, tree=0, tail=False):
    """Each split's work in unmasked KV tiles, by the kernel's rule: a split's tiles before the tree's first entry
    run unmasked, the rest (the tree's, a ragged end) masked, each at TAIL_TILE_COST where there is a tree (tree:
    its entries at the end of the cache; 0: no tree mask, every tile alike). tail: the last split takes the tree's
    tiles (TAIL_SPLIT)."""
    tree_start = length - tree
    if tail and splits > 1:
        prefix = tree_start // block_n * block_n
        bounds = split_bounds(splits - 1, prefix, block_n) + [(prefix, length)]
    else:
        bounds = split_bounds(splits, length, block_n)
    masked_cost = TAIL_TILE_COST if tree else 1.0
    work = []
    for start, end in bounds:
        full = max(0, min(end, tree_start) - start) // block_n
        work.append(full + masked_cost * triton.cdiv(max(0, end - start - full * block_n), block_n))
    return work


def split_cost(splits, base, max_len, entry, slots, partial_bytes, merge_cost, tree=0, tail=False):
    """Modelled time (us) with `splits` splits: the split kernel's programs (`base` per split, each tile_us per KV
    tile of its split's work (split_work) + program_us, in launch order) list-scheduled over `slots`, plus the
    merge of `partial_bytes` per split."""
    work = split_work(splits, max_len, entry.tiles.block_n, tree, tail)
    free = [0.0] * slots  # heap of the times the slots become free
    for s in range(splits):
        for _ in range(base):
            heapq.heappush(free, heapq.heappop(free) + entry.tile_us * work[s] + entry.program_us)
    merge = merge_cost[0] + merge_cost[1] * splits * partial_bytes / 1e6 if splits > 1 else 0.0
    return max(free) + merge


@functools.lru_cache(maxsize=4096)
def default_splits(entry, rows, B, max_len, sms, key, value_bytes, tree=0, tail=False):
    """The split count of the least modelled time among SPLIT_PER_SLOT's candidates with `entry` (of
    mla_attention.CONFIGS), for B sequences of `rows` query rows over a max_len-entry cache on `sms` SMs of arch
    `key` (partials: value_bytes a value). tree: the entries under a tree mask at the end of the cache; tail: the
    last split takes the tree's tiles (each candidate count and one more, for the tail's split)."""
    block_m, block_n = entry.tiles.block_m, entry.tiles.block_n
    window, whole = SPLIT_RULE[key]
    grid_m = triton.cdiv(rows, block_m)
    slots = sms * entry.slots
    counts = {choose_splits(B * grid_m, max_len, block_n, slots, n, w) for n in SPLIT_PER_SLOT[key]
              for w in {False, whole}}
    if tail:
        counts = {s + k for s in counts for k in (0, 1)}
    part_bytes = B * rows * D_LAT * value_bytes
    lengths = [max_len - k * block_n for k in range(window) if max_len - k * block_n > 0]

    def cost(s):
        return sum(split_cost(s, B * grid_m, n, entry, slots, part_bytes, MERGE_COST[key], tree, tail)
                   for n in lengths)

    return min(sorted(counts), key=cost)


def tail_split_default(T, block_n, key):
    """Whether the last split takes a T-node tree's tiles by default: where they are at most TAIL_SPLIT[key]."""
    return triton.cdiv(T - 1, block_n) + 1 <= TAIL_SPLIT[key]
