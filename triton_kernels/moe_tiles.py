"""What the W4A16 GEMM kernels (`moe_gate_up.py`, `moe_down.py`) share: on the device the dequantisation of a slab
and its dot, tile pointers and a block's prologue; on the host the constexprs, launch options and layout arguments
of a kernel config, and the size of a persistent grid.

Tiles are [BM, BN] (token rows x weight columns) or, with SWAP, transposed [BN, BM]: the weights are then the MMA's
M operand, so BM tokens pad to 8, not 16 (README.md, MoE).
"""

import torch
import triton
import triton.language as tl

from triton_kernels import arch, pdl
from triton_kernels.moe_layout import GROUP, SLAB, SLAB_WORDS

_GROUP, _SLAB, _SLAB_WORDS = tl.constexpr(GROUP), tl.constexpr(SLAB), tl.constexpr(SLAB_WORDS)


@triton.jit
def unpack_group(words, m: tl.constexpr, MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr,
                 DTYPE: tl.constexpr, SWAP: tl.constexpr, LOP3: tl.constexpr):
    """Nibble pair m of half-slab words [16, BN] int32 (SWAP: [BN, 16]) -> one group [32, BN] DTYPE (SWAP:
    its transpose [BN, 32]), row 2w + j from word w's nibble at bit 4m + 16j, holding q exactly; q * 16 for odd
    m when WIDE (mantissa >= 8 bits, fp16), which reads those nibbles in place instead of shifting them down.
    LOP3: the mask and the OR as one 3-input PTX lop3 (ptxas takes one immediate an instruction, so it emits an
    AND and an OR for the plain form; inline PTX: not interpretable)."""
    if WIDE:
        SHIFT: tl.constexpr = 8 * (m // 2)
        MASK: tl.constexpr = 0x00F000F0 if m % 2 else 0x000F000F
        SCALE: tl.constexpr = 16 if m % 2 else 1
    else:
        SHIFT: tl.constexpr = 4 * m
        MASK: tl.constexpr = 0x000F000F
        SCALE: tl.constexpr = 1
    shifted = words >> SHIFT
    if LOP3 and SWAP:  # one lop3 writes a word's two values as the packed pair the MMA operand holds (the form
        # below costs Triton 3.9 two byte permutes a word to repack its halves). With pack=2 an asm instance takes
        # two elements of each input ($1 $2: the word twice, $3 $4, $5 $6)
        both = tl.reshape(tl.join(shifted, shifted), (words.shape[0], 2 * words.shape[1]))  # [BN, 32]
        pairs = tl.inline_asm_elementwise("lop3.b32 $0, $1, $3, $5, 0xEA;", "=r,r,r,r,r,r,r",
                                          [both, tl.full(both.shape, MASK, tl.int32),
                                           tl.full(both.shape, MAGIC * 65537, tl.int32)],
                                          dtype=tl.bfloat16 if MAGIC == 0x4300 else tl.float16, is_pure=True,
                                          pack=2)
        return pairs - (MAGIC_VALUE + 8.0 * SCALE)
    if LOP3:  # 0xEA: (a & b) | c
        pair = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [shifted, tl.full(words.shape, MASK, tl.int32),
                                          tl.full(words.shape, MAGIC * 65537, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        pair = (shifted & MASK) | (MAGIC * 65537)  # two 16-bit floats MAGIC_VALUE + SCALE * u per word
    lo = pair.to(tl.int16).to(DTYPE, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    if SWAP:  # [BN, 16, 2] -> [BN, 32]: a word's two rows are adjacent along K already
        v = tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))
    else:
        v = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (2 * words.shape[0], words.shape[1]))  # [32, BN]
    return v - (MAGIC_VALUE + 8.0 * SCALE)


@triton.jit
def load_slab(w_ptrs, w_row, w_mask):
    """The two half-slabs of words [16, BN] int32 at w_ptrs [16, BN] (or both transposed) and 16 rows (of
    stride w_row) further."""
    return tl.load(w_ptrs, mask=w_mask, other=0), tl.load(w_ptrs + 16 * w_row, mask=w_mask, other=0)


@triton.jit
def load_scales(s_ptrs, s_mask, s_row):
    """A slab's 8 group scales [BN, 8] (bf16) from s_ptrs [BN] (its first group's) and the row stride s_row."""
    return tl.load(s_ptrs[:, None] + (tl.arange(0, 8) * s_row)[None, :], mask=s_mask[:, None], other=0.0)


@triton.jit
def _group_scale(tile, g: tl.constexpr):
    """Column g [BN] fp32 of scales [BN, 8], by splits of the view [BN, 2, 2, 2] (g = 4a + 2b + c; the splits
    are shared by the 8 calls of a slab)."""
    lo, hi = tl.split(tl.reshape(tile.to(tl.float32), (tile.shape[0], 2, 2, 2)))  # [BN, 2, 2]: c
    v = hi if g % 2 else lo
    lo, hi = tl.split(v)  # [BN, 2]: b
    v = hi if (g // 2) % 2 else lo
    lo, hi = tl.split(v)  # [BN]: a
    return hi if g // 4 else lo


@triton.jit
def slab_dot(acc, a_ptrs, row_mask, k, K, w0, w1, s_ptrs, s_mask, stride_sg, s_tile,
             MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, DTYPE: tl.constexpr,
             EVEN_K: tl.constexpr, SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr,
             PRESCALE: tl.constexpr):
    """acc [BM, BN] += A [BM, 256] @ dequant(slab) [256, BN], scaling each group's partial product; with SWAP
    the transposed product acc [BN, BM] += dequant(slab)^T [BN, 256] @ A^T [256, BM].

    w0, w1 [16, BN] (SWAP: [BN, 16]): the slab's half-slabs of words (`load_slab`); a_ptrs [BM, 32] (SWAP:
    [32, BM]) point at the slab's first group (columns k [32]); A's columns at or past K read as 0 (no column
    mask when EVEN_K: K is a multiple of 256). Group 2m + t is nibble pair m of half t. Scales: loaded here from
    s_ptrs [BN] (the first group's; groups stride_sg apart), or with AHEAD taken from s_tile [BN, 8]
    (`load_scales`, loaded a slab ahead by the caller). PRESCALE: the dequantised weights times their scale in
    DTYPE (one rounding of q * scale, as a bf16 weight has), then one dot chain into acc: no fp32 multiply-add of
    each group's product.
    """
    for t in tl.static_range(2):
        words = w1 if t else w0
        for m in tl.static_range(4):
            g = 2 * m + t
            if SWAP:
                a_mask = row_mask[None, :] if EVEN_K else row_mask[None, :] & (k + g * _GROUP < K)[:, None]
            else:
                a_mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (k + g * _GROUP < K)[None, :]
            a = tl.load(a_ptrs + g * _GROUP, mask=a_mask, other=0.0).to(DTYPE)  # [BM, 32] (SWAP: [32, BM])
            w = unpack_group(words, m, MAGIC, MAGIC_VALUE, WIDE, DTYPE, SWAP, LOP3)  # [32, BN] (SWAP: [BN, 32])
            if AHEAD:
                scale = _group_scale(s_tile, g)
            else:
                scale = tl.load(s_ptrs + g * stride_sg, mask=s_mask, other=0.0).to(tl.float32)  # [BN]
            if WIDE:
                if m % 2:
                    scale = scale * 0.0625
            if PRESCALE:
                if SWAP:
                    acc = tl.dot(w * scale.to(DTYPE)[:, None], a, acc)
                else:
                    acc = tl.dot(a, w * scale.to(DTYPE)[None, :], acc)
            elif SWAP:
                acc += tl.dot(w, a) * scale[:, None]
            else:
                acc += tl.dot(a, w) * scale[None, :]
    return acc


@triton.jit
def orient(r, c, SWAP: tl.constexpr):
    """Row vector r [BM] and column vector c [BN] as broadcastable tile indices of a [BM, BN] tile, or of its
    transpose [BN, BM] with SWAP."""
    if SWAP:  # one return (Triton 3.6 rejects returns of different shapes in constexpr branches)
        r2, c2 = r[None, :], c[:, None]
    else:
        r2, c2 = r[:, None], c[None, :]
    return r2, c2


@triton.jit
def acc_zeros(BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr):
    """fp32 zeros [BM, BN], or [BN, BM] with SWAP."""
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    return acc


@triton.jit
def tile_cols(pid_n, stride_n, BN: tl.constexpr, KMAJOR: tl.constexpr, STEP: tl.constexpr = 1):
    """Offsets [BN / STEP] of N tile pid_n's columns (every STEP-th) within a row of words or scales: the columns
    themselves in the slab layout, each column times the column stride stride_n K-major."""
    cols = pid_n * BN + tl.arange(0, BN // STEP) * STEP  # [BN / STEP]
    if KMAJOR:
        cols = cols.to(tl.int64) * stride_n
    return cols


@triton.jit
def expert_bases(w_ptr, s_ptr, e, stride_we, stride_se):
    """Expert e's words and scales."""
    return w_ptr + e.to(tl.int64) * stride_we, s_ptr + e.to(tl.int64) * stride_se


@triton.jit
def tile_columns(tile, N, stride_wn, BN: tl.constexpr, KMAJOR: tl.constexpr, EVEN_N: tl.constexpr):
    """The prologue of N tile `tile`: its columns n [BN] and their mask (all-true, folded away, when EVEN_N: BN
    divides N), and the offsets of its columns within a row of words and of scales (`tile_cols`; the scales keep
    the slab layout)."""
    n = tile * BN + tl.arange(0, BN)  # [BN]
    return n, (n < N) | EVEN_N, tile_cols(tile, stride_wn, BN, KMAJOR), tile_cols(tile, 0, BN, False)


@triton.jit
def block_expert(block_expert_ptr, pid_b, BM: tl.constexpr):
    """(slots [BM], expert) of block pid_b; the expert is -1 for a block past the routed ones (nothing to do)."""
    return pid_b * BM + tl.arange(0, BM), tl.load(block_expert_ptr + pid_b)


@triton.jit
def block_pairs(sorted_ptr, rows, pid_b, BM: tl.constexpr, DECODE: tl.constexpr):
    """The (token, choice) pair id of each slot [BM], -1 for padding. DECODE: block b holds pair b alone, in row 0
    (the blocks' experts are topk_ids; no routing pass)."""
    if DECODE:
        pair = tl.where(tl.arange(0, BM) == 0, pid_b, -1)
    else:
        pair = tl.load(sorted_ptr + rows)
    return pair


@triton.jit
def work_item(item, split, block_expert_ptr, sorted_ptr, TILES: tl.constexpr, BM: tl.constexpr):
    """Work item `item` of a persistent grid over (routed block, N tile or group of TILES, K split), the split
    fastest: -> (block, tile, split index, slots [BM], expert, pair ids [BM]). A tile's splits are consecutive
    items, its split 0 at item - split index."""
    j = item % split
    t = (item // split) % TILES
    b = item // (split * TILES)
    rows, e = block_expert(block_expert_ptr, b, BM)  # [BM] slots
    pair = block_pairs(sorted_ptr, rows, b, BM, False)
    return b, t, j, rows, e, pair


@triton.jit
def tokens_of(pair, TOP_K: tl.constexpr):
    """The token rows [BM] int64 of pair ids [BM] (row 0 for a padding slot, -1)."""
    return tl.where(pair >= 0, pair // TOP_K, 0).to(tl.int64)


@triton.jit
def slab_ptrs(w_base, s_base, a_rows, w_cols, s_cols, slab, w_row, s_row, SWAP: tl.constexpr):
    """Pointers of slab `slab`: words [16, BN] (first half), activations [BM, 32] (first group) from row
    pointers a_rows [BM], scales [BN] (first group), and k [32] (the first group's columns); with SWAP words
    [BN, 16] and activations [32, BM]. w_row and s_row are the row strides of words and scales (1 for K-major
    words)."""
    k = tl.arange(0, _GROUP) + slab * _SLAB  # [32]
    word_rows, cols = orient((tl.arange(0, _SLAB_WORDS // 2) + slab * _SLAB_WORDS).to(tl.int64) * w_row, w_cols,
                             SWAP)
    a_r, a_k = orient(a_rows, k, SWAP)
    return w_base + word_rows + cols, a_r + a_k, s_base + (slab * 8) * s_row + s_cols, k


@triton.jit
def slab_scales(s_base, s_cols, slab, s_row, s_mask):
    """Slab `slab`'s 8 group scales [BN, 8] at columns s_cols (`load_scales`)."""
    return load_scales(s_base + (slab * 8) * s_row + s_cols, s_mask, s_row)


@triton.jit
def prefetch_slab(lines, slab, w_row):
    """Ask L2 for slab `slab`'s 32 rows of words from the 128-byte line offsets `lines` [1, BN / 32] of its first
    row."""
    rows = (slab * _SLAB_WORDS + tl.arange(0, _SLAB_WORDS))[:, None].to(tl.int64) * w_row  # [32, 1]
    pdl.prefetch_l2(lines + rows)  # [32, BN / 32]


# ------------------------------------------------------------------------------------------------ host side


def flags(kernel_cfg, ptx=True):
    """The constexprs of a kernel config (moe_configs): SWAP (`swap`: transposed tiles, `slab_dot`), LOP3 (`lop3`:
    dequantised with one PTX lop3, the same result as the plain form the interpreter runs, ptx=False), AHEAD
    (`scales_ahead`: each slab's scales loaded a slab early), PRESCALE (`prescale`: weights scaled before the MMA),
    MMA_V2 (`mma_v2`: dots compiled to mma.sync by `aot.mma_v2_only`; the constexpr keys the compiled kernel)."""
    return dict(SWAP=kernel_cfg.get("swap", False), LOP3=ptx and kernel_cfg.get("lop3", False),
                AHEAD=kernel_cfg.get("scales_ahead", False), PRESCALE=kernel_cfg.get("prescale", False),
                MMA_V2=kernel_cfg.get("mma_v2", False))


def launch_options(kernel_cfg, use_pdl):
    """Launch options of a kernel config: num_warps, num_stages, its register cap `maxnreg` if any and, with
    use_pdl, programmatic dependent launch."""
    return dict(num_warps=kernel_cfg["num_warps"], num_stages=kernel_cfg["num_stages"],
                **({"maxnreg": kernel_cfg["maxnreg"]} if kernel_cfg.get("maxnreg") else {}),
                **({"launch_pdl": True} if use_pdl else {}))


def layout_args(words, scales, kmajor, up=0):
    """Layout arguments of a GEMM kernel: row strides w_row / s_row, the K-major column stride stride_wn (0 in the
    slab layout) and with `up` (the intermediate size, gate/up only) the offsets up_w / up_s of the up columns."""
    if kmajor:  # words [E, N, KP/8], scales in the slab layout
        args = dict(w_row=1, s_row=scales.stride(1), stride_wn=words.stride(1))
        return {**args, **(dict(up_w=up * words.stride(1), up_s=up) if up else {})}
    args = dict(w_row=words.stride(1), s_row=scales.stride(1), stride_wn=0)
    return {**args, **(dict(up_w=up, up_s=up) if up else {})}


def aot_options(signature, kernel_cfg, key, kmajor, one_slab):
    """aot.compile_for keywords that compile a launch of a kernel config (moe_configs) on arch `key` as the JIT
    specialises it: 16-byte aligned pointers, sizes and strides multiples of 16, and as the constant 1 the row stride
    of K-major words and, with one_slab, the slab count."""
    ones = (["w_row"] if kmajor else []) + (["n_slabs"] if one_slab else [])
    sizes = ("D", "I", "stride_we", "stride_se", "w_row", "s_row", "stride_wn", "up_w", "up_s")
    return dict(arch=key, num_warps=kernel_cfg["num_warps"], num_stages=kernel_cfg["num_stages"],
                maxnreg=kernel_cfg.get("maxnreg"), aligned=True, ones=ones,
                divisible=[n for n in sizes if n in signature and n not in ones])


SIGNATURE_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
LAYOUT_SIGNATURE = dict(w_row="i32", s_row="i32", stride_wn="i32")

_RESIDENT = {}  # (kernel, device, dtype, constexprs) -> programs of a persistent kernel the GPU holds at once


def _occupancy(kernel, device):
    """CTAs of a compiled kernel that one SM of `device` holds at once, by its registers, shared memory and
    warps (the CUDA occupancy rules: registers allocated per warp in units of 256, 1 KB of shared memory reserved
    per CTA)."""
    kernel._init_handles()
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    warp_regs = triton.cdiv(max(kernel.n_regs, 1) * 32, 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // warp_regs // warps
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // (kernel.metadata.shared + 1024)
    by_warps = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return max(1, min(by_regs, by_smem, by_warps, 16))


def resident_programs(kernel, args, constexprs, device, dtype):
    """Programs of `kernel` (launched with args and constexprs) that the GPU holds at once: SMs x its CTAs an SM
    (`_occupancy` of the compiled kernel, compiled once here)."""
    key = (kernel.fn.__name__, device, dtype, *sorted(constexprs.items()))
    if key not in _RESIDENT:
        _RESIDENT[key] = arch.sm_count(device) * _occupancy(kernel.warmup(*args, **constexprs, grid=(1,)), device)
    return _RESIDENT[key]
