"""Triton W4A16 grouped MoE: INT4 group-32 routed experts, bf16/fp16 activations (README.md, MoE).

Three launches per `moe` call and a cast, no host synchronisation:
1. `_route_kernel`: program 0 groups the (token, slot) pairs by expert into blocks of BM rows, padded per expert;
   the other programs zero the fp32 output and the split-K arrival counters.
2. gate/up (`moe_gate_up.py`): per (block, N tile, K split) gate and up partial GEMMs; the last split to arrive sums
   the partials and writes h = silu(gate) * up for its tile.
3. down (`moe_down.py`): per (block, N tiles, K split) h @ W_down^T, scaled by the top-k weight and atomically added
   into the token's fp32 output row (the reduction over k); then torch's cast to x's dtype.
With a `decode` config (few tokens) there are two launches: no routing pass (block b of the GEMMs holds pair b
alone), and the K splits of gate/up and the top-k pairs of a token in down add into fp32 sums that stay zeroed
between calls (`decode_scratch`); the last program to arrive at a tile's counter finishes it (h, or the output
in x's dtype: no cast) and zeroes the sums and the counter again.
The weights' layout: `moe_layout.py`; the configs: `moe_configs.py`.
"""

import itertools

import torch
import triton
import triton.language as tl

from triton_kernels import arch, pdl
from triton_kernels.aot import mma_v2_only
from triton_kernels.counters import arrival_counters
from triton_kernels.moe_configs import config_for
from triton_kernels.moe_down import down, down_spec, persistent_down
from triton_kernels.moe_gate_up import gate_up, gate_up_spec, planned_gate_up
from triton_kernels.moe_layout import UNPACK

DECODE_ROWS = 16  # the decode path's scratch is sized for this many tokens at least (see decode_scratch)


@triton.jit(do_not_specialize=["n_zero", "P", "CAPACITY", "NB_MAX"])
def _route_kernel(ids_ptr, sorted_ptr, block_expert_ptr, counts_ptr, offsets_ptr, rank_ptr, nb_ptr,
                  zero_ptr, n_zero, P, CAPACITY, NB_MAX,
                  BM: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program 0: sorted_ptr[slot] = pair id (or -1), block_expert_ptr[b] = expert of block b (or -1), nb_ptr[0]
    = the number of blocks filled (blocks 0 .. nb - 1).

    Other programs zero BLOCK-sized chunks of the int32/fp32 scratch at zero_ptr (n_zero 32-bit words).
    The phases are ordered by CTA barriers (bar.sync orders the global accesses, atomics included, of the
    threads it joins), so the atomics need no fences of their own.
    """
    pdl.enter(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if pid > 0:
        i = (pid - 1).to(tl.int64) * BLOCK + offs
        tl.store(zero_ptr + i, 0, mask=i < n_zero)
        return
    experts = tl.arange(0, E_PAD)
    tl.store(counts_ptr + experts, 0)
    for start in range(0, CAPACITY, BLOCK):
        tl.store(sorted_ptr + start + offs, -1, mask=start + offs < CAPACITY)
    for start in range(0, NB_MAX, BLOCK):
        tl.store(block_expert_ptr + start + offs, -1, mask=start + offs < NB_MAX)
    tl.debug_barrier()
    for start in range(0, P, BLOCK):
        p = start + offs
        e = tl.load(ids_ptr + p, mask=p < P, other=0)  # [BLOCK]
        rank = tl.atomic_add(counts_ptr + e, 1, mask=p < P, sem="relaxed")  # the pair's place among its expert's
        tl.store(rank_ptr + p, rank, mask=p < P)
    tl.debug_barrier()
    counts = tl.atomic_add(counts_ptr + experts, 0, sem="relaxed")  # [E_PAD], read at L2
    padded = (counts + BM - 1) // BM * BM
    tl.store(offsets_ptr + experts, tl.cumsum(padded, 0) - padded)
    tl.store(nb_ptr, tl.sum(padded, 0) // BM)
    tl.debug_barrier()
    for start in range(0, P, BLOCK):
        p = start + offs
        e = tl.load(ids_ptr + p, mask=p < P, other=0)
        slot = tl.load(offsets_ptr + e, mask=p < P, other=0) + tl.load(rank_ptr + p, mask=p < P, other=0)
        tl.store(sorted_ptr + slot, p, mask=p < P)
        tl.store(block_expert_ptr + slot // BM, e, mask=p < P)


def route(topk_ids, scratch, E, BM, capacity, nb_max, use_pdl=False):
    """Launch `_route_kernel` (it also zeroes `scratch`): -> (sorted pair ids [capacity], block experts [nb_max],
    the number of blocks filled [1])."""
    P = topk_ids.numel()
    ints = torch.empty(2 * 1024 + P + capacity + nb_max + 1, dtype=torch.int32, device=topk_ids.device)
    counts, offsets, nb = ints[:1024], ints[1024:2048], ints[-1:]
    rank, sorted_pairs = ints[2048 : 2048 + P], ints[2048 + P : 2048 + P + capacity]
    block_expert = ints[2048 + P + capacity : -1]
    e_pad = triton.next_power_of_2(E)
    if e_pad > 1024:
        raise ValueError(f"moe (triton): at most 1024 experts, got {E}")
    block = 1024
    _route_kernel[(1 + triton.cdiv(scratch.numel(), block),)](
        topk_ids, sorted_pairs, block_expert, counts, offsets, rank, nb, scratch, scratch.numel(), P, capacity, nb_max,
        BM=BM, E_PAD=e_pad, BLOCK=block, PDL=use_pdl, **({"launch_pdl": True} if use_pdl else {}))
    return sorted_pairs, block_expert, nb


def decode_scratch(device, M, top_k, D, I, gu_tiles, dn_tiles):
    """Zeroed scratch of the decode path, in one buffer that the kernels leave zeroed (counters.arrival_counters,
    owner "moe_w4a16"): gate/up counters [M k, gu_tiles] and down counters [M, dn_tiles] (int32), the pairs'
    fp32 gate/up sums [M k, 2 I] and the tokens' fp32 output sums [M, D]. Sized for max(M, DECODE_ROWS)
    tokens so that the CUDA graphs of the small buckets all capture the same buffer (a larger M grows it)."""
    def sizes(m):  # each section rounded up to 128 bytes (aligned vector loads)
        return [triton.cdiv(n, 32) * 32 for n in (m * top_k * gu_tiles, m * dn_tiles, m * top_k * 2 * I, m * D)]

    buf = arrival_counters("moe_w4a16", device, sum(sizes(max(M, DECODE_ROWS))))
    ends = list(itertools.accumulate(sizes(M)))
    gu_counters, dn_counters = buf[: ends[0]], buf[ends[0] : ends[1]]
    sums = buf[ends[1] : ends[2]].view(torch.float32)[: M * top_k * 2 * I].view(M * top_k, 2 * I)
    out = buf[ends[2] : ends[3]].view(torch.float32)[: M * D].view(M, D)
    return gu_counters, dn_counters, sums, out


def k_split(n_slabs, work, sms, waves):
    """(splits, slabs a split) along K so that about `waves` x SMs programs run, each split at least one slab."""
    split = max(1, min(n_slabs, triton.cdiv(waves * sms, max(work, 1))))
    per_split = triton.cdiv(n_slabs, split)
    return triton.cdiv(n_slabs, per_split), per_split


def expected_experts(E, pairs):
    """Expected distinct experts touched by `pairs` uniformly random choices (a static estimate for the grid)."""
    return min(E, pairs, max(1, round(E * (1 - (1 - 1 / E) ** pairs))))


def moe(x, topk_ids, topk_weights, experts, keep_sums=False, config=None):
    """Triton backend of ops.moe (see there): x [M, D] bf16/fp16, topk_ids [M, k] int32, topk_weights [M, k] fp32.
    keep_sums: the routing-pass path returns its fp32 sums, without the cast (the decode path writes x's dtype).
    `config`: an entry of moe_configs' form instead of the table's (`config_for`).
    """
    if x.dtype not in UNPACK:
        raise ValueError(f"moe (triton): x must be bfloat16 or float16, got {x.dtype}")
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise ValueError(f"moe (triton): topk_ids must be int32 and topk_weights float32, "
                         f"got {topk_ids.dtype} and {topk_weights.dtype}")
    x, topk_ids, topk_weights = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    M, D = x.shape
    top_k, E, I = topk_ids.shape[1], experts.num_experts, experts.intermediate
    P = M * top_k
    cfg = config or config_for(x.device, M, intermediate=I)
    if cfg.get("kmajor", experts.kmajor) != experts.kmajor:
        raise ValueError(f"moe (triton): config for kmajor={cfg['kmajor']}, experts laid out with "
                         f"kmajor={experts.kmajor}")
    g, d = cfg["gate_up"], cfg["down"]
    BM, decode = cfg["BM"], cfg.get("decode", False)
    nb_max = P if decode else triton.cdiv(P, BM) + min(E, P)
    capacity = nb_max * BM
    sms = arch.sm_count(x.device)
    est_blocks = P if decode else expected_experts(E, P) + triton.cdiv(P, BM)

    gu_tiles = triton.cdiv(I, g["BN"])
    gu_split, gu_per_split = k_split(experts.gate_up_slabs, est_blocks * gu_tiles, sms, g["waves"])
    dn_per_cta = d.get("tiles", 1)
    if dn_per_cta > 1 and D % (d["BN"] * dn_per_cta):
        if config is not None:
            raise ValueError(f"moe (triton): down tiles {dn_per_cta} x BN {d['BN']} must divide the hidden size {D}")
        dn_per_cta = 1  # a table entry's tiles on a hidden size they do not divide: one tile a program
    dn_tiles = triton.cdiv(D, d["BN"]) // dn_per_cta  # programs along N
    dn_split, dn_per_split = k_split(experts.down_slabs, est_blocks * dn_tiles, sms, d["waves"])

    dev = x.device
    ptx = dev.type == "cuda"  # inline PTX (lop3) compiles; the interpreter runs the plain forms
    # programmatic dependent launch (sm_90 and newer) of the GEMMs, and of the routing pass before them, where the
    # entry asks for it
    use_pdl = ptx and cfg.get("pdl", False) and pdl.active(x)
    h = torch.empty((capacity, I), dtype=x.dtype, device=dev)
    planned = not decode and g.get("device_split", False)
    if decode:  # no routing pass, no memset, no cast: zeroed sums and counters that the kernels zero again
        sorted_pairs = block_expert = topk_ids
        y = torch.empty((M, D), dtype=x.dtype, device=dev)
        gu_counters, dn_counters, part, out = decode_scratch(dev, M, top_k, D, I, gu_tiles, dn_tiles)
        counters = gu_counters
    else:
        n_counters = nb_max * gu_tiles if gu_split > 1 or planned else 0
        scratch = torch.empty(M * D + n_counters, dtype=torch.float32, device=dev)  # zeroed by _route_kernel
        sorted_pairs, block_expert, nb = route(topk_ids, scratch, E, BM, capacity, nb_max, use_pdl)
        out, counters = scratch[: M * D].view(M, D), scratch[M * D :].view(torch.int32)
        y, dn_counters = out, counters  # unused
        part = torch.empty((gu_split if gu_split > 1 else 0, capacity, 2 * I), dtype=torch.float32, device=dev)
    with mma_v2_only(g.get("mma_v2", False)):  # each kernel compiled (at its first launch) as its config asks
        if planned:
            planned_gate_up(x, experts, h, counters, sorted_pairs, block_expert, nb, g, BM, top_k, ptx, use_pdl)
        else:
            gate_up(x, experts, h, part, counters, sorted_pairs, block_expert, g, BM, top_k, nb_max, gu_split,
                    gu_per_split, decode, ptx, use_pdl)
    with mma_v2_only(d.get("mma_v2", False)):
        if not decode and d.get("persistent", False):
            persistent_down(h, experts, out, topk_weights, sorted_pairs, block_expert, nb, d, BM, top_k, dn_per_cta,
                            dn_split, dn_per_split, x.dtype, ptx, use_pdl)
        else:
            down(h, experts, out, y, dn_counters, topk_weights, sorted_pairs, block_expert, d, BM, top_k, nb_max,
                 dn_per_cta, dn_split, dn_per_split, decode, x.dtype, ptx, use_pdl)
    return y if decode else out if keep_sums else out.to(x.dtype)


def compile_specs(cfg, dtype=torch.bfloat16, top_k=8, key="sm_120", D=7168, I=256):
    """[(kernel, signature, constexprs, options)] of the two GEMM kernels that `moe` launches under entry `cfg` at
    hidden D / intermediate I, compiled for arch `key` as the JIT specialises them: `aot.compile_for(*spec[:3],
    **spec[3])` reports their resources without a GPU."""
    return [gate_up_spec(cfg, top_k, dtype, key, D, I), down_spec(cfg, top_k, dtype, key, D, I)]
