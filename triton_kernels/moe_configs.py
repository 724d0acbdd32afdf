"""Launch configurations of the W4A16 MoE kernels, as data: per architecture, per bucket of M (tokens).

Each entry: BM (token rows per block: the MMA's M, padded to 16, or with `swap` its N, padded to 8), and per kernel
BN (N tile), waves (K splits are chosen so that about waves x SMs programs run, from the expected number of distinct
experts touched), num_warps and num_stages. sm_120 entries must fit 101,376 bytes of shared memory without spills
(tests/test_moe_kernel.py); gate/up BN=64 at 4 warps spilled 116 bytes under Triton 3.6 (255 registers), so sm_120
keeps BN=32. The sm_90 entries were the fastest or within 10% of the fastest of the five configs swept on an H200
(bench/results/moe_h200.md).
"""

import torch

CONFIGS = {
    "sm_90": [
        (16, dict(BM=16, gate_up=dict(BN=32, waves=4, num_warps=4, num_stages=4),
                  down=dict(BN=128, waves=4, num_warps=4, num_stages=2))),
        (128, dict(BM=16, gate_up=dict(BN=64, waves=4, num_warps=4, num_stages=4),
                   down=dict(BN=128, waves=4, num_warps=4, num_stages=2))),
        (None, dict(BM=16, gate_up=dict(BN=64, waves=2, num_warps=4, num_stages=4),
                    down=dict(BN=128, waves=2, num_warps=4, num_stages=2))),
    ],
    "sm_120": [
        (16, dict(BM=16, gate_up=dict(BN=32, waves=4, num_warps=4, num_stages=3),
                  down=dict(BN=128, waves=4, num_warps=4, num_stages=2))),
        (None, dict(BM=16, gate_up=dict(BN=32, waves=2, num_warps=4, num_stages=3),
                    down=dict(BN=128, waves=2, num_warps=4, num_stages=2))),
    ],
}


# Weight layout per architecture, chosen once at load by prepare_moe: (gate/up panel, down panel) widths, 0 for the
# slab layout (README.md). A config runs on a panel layout when its BN divides the panel width.
LAYOUTS = {"sm_90": (0, 0), "sm_120": (0, 0)}


# sm_90 variants under test, as overrides of an entry's per-kernel dicts (not used by config_for). `lean` carries
# the slab pointers across the K loop, drops column masks when BN divides N and loads a block's pair ids together
# with its expert; `decode` (top level) gives each (token, expert) pair its own block of rows and replaces the
# routing pass by a memset (for a few tokens: an expert chosen by two tokens is read twice). Static SASS counts
# per variant are in triton_kernels/README.md; `python bench/bench_moe.py --variants` times them (TP8 shape).
VARIANTS = {
    "lean": dict(gate_up=dict(lean=True), down=dict(lean=True)),
    "lean_gu64": dict(gate_up=dict(BN=64, lean=True), down=dict(lean=True)),
    # panel layouts (`panels`: the layout the bench prepares for the variant; README.md): a program's K range of
    # one panel is one contiguous stream. `panel` changes the layout only (at M <= 16 a gate/up tile of BN 32 is
    # half a 64-wide panel); `panel_gu32` keeps gate/up at BN 32 for every M (89 registers instead of 250 at BN
    # 64: 5 CTAs an SM instead of 2, ncu 2026-11-30); `gu32` is that without the panels; `panel_s2` trades
    # pipeline depth for occupancy (gate/up at M <= 16: 49 KB of shared memory, 4 CTAs an SM).
    "panel": dict(panels=(64, 128)),
    "panel_gu32": dict(panels=(32, 128), gate_up=dict(BN=32)),
    "gu32": dict(gate_up=dict(BN=32)),
    "panel_s2": dict(panels=(64, 128), gate_up=dict(num_stages=2)),
    "panel_decode": dict(panels=(32, 128), decode=True, gate_up=dict(BN=32)),
    # `prefetch` (distance in slabs): the weight words are loaded straight into registers (LDG; only the
    # activations go through cp.async stages), so a CTA has one slab's words in flight and none while it
    # dequantises; these ask L2 for slab + prefetch's words (one PTX prefetch per 128-byte line) first
    "prefetch": dict(gate_up=dict(prefetch=2), down=dict(prefetch=2)),
    "panel_prefetch": dict(panels=(64, 128), gate_up=dict(prefetch=2), down=dict(prefetch=2)),
    "panel_gu32_prefetch": dict(panels=(32, 128), gate_up=dict(BN=32, prefetch=2), down=dict(prefetch=2)),
    "panel_gu32_prefetch4": dict(panels=(32, 128), gate_up=dict(BN=32, prefetch=4), down=dict(prefetch=4)),
    # `tiles` (down): N tiles a program computes one after the other (unrolled), so the index loads, pointers and
    # activations of a block are set up once per `tiles` tiles (at I = 256 a down program has one slab: the code
    # outside the K loop is a third of its instructions, ncu 2026-11-30)
    "dn_tiles2": dict(down=dict(tiles=2)),
    "panel_gu32_prefetch_dn2": dict(panels=(32, 128), gate_up=dict(BN=32, prefetch=2), down=dict(tiles=2)),
    # `swap` (per kernel): the transposed tile acc^T [BN, BM] += W^T [BN, 32] @ A^T [32, BM], so the dequantised
    # weights are the MMA's M operand (registers) and BM tokens pad to the MMA's N = 8 instead of M = 16: half the
    # HMMAs and the scale FFMAs a weight at BM 8 (mma.sync m16n8k16); at BM 16 Triton 3.6 picks wgmma with the
    # weights as a register operand (HGMMA 64x16x16, no STS of weights). `lop3` (per kernel): the nibble mask and
    # the magic exponent as one PTX lop3 instead of an AND and an OR (inline PTX: GPU and compile tests only).
    # Static counts (sm_90, Triton 3.6, TP8, M <= 16 entry) in triton_kernels/README.md.
    "lop3": dict(gate_up=dict(lop3=True), down=dict(lop3=True)),
    # `waves` below = the CTAs an SM holds (registers and shared memory of the sm_90 build), so that at small M the
    # K splits fill one wave: swap8's gate/up holds 3 (61 KB), at 3 stages 4 (128 registers), swap16's 2
    "swap8": dict(BM=8, gate_up=dict(BN=64, swap=True, lop3=True, waves=3), down=dict(BN=64, swap=True, lop3=True)),
    "swap8_s3": dict(BM=8, gate_up=dict(BN=64, swap=True, lop3=True, num_stages=3),
                     down=dict(BN=64, swap=True, lop3=True)),
    "swap8_dn2": dict(BM=8, gate_up=dict(BN=64, swap=True, lop3=True, waves=3),
                      down=dict(BN=64, swap=True, lop3=True, tiles=2)),
    "swap16": dict(BM=16, gate_up=dict(BN=64, swap=True, lop3=True, waves=2), down=dict(BN=64, swap=True, lop3=True)),
    # `scales_ahead` (per kernel): the group scales are plain loads (Triton's pipeliner stages only loads that feed
    # a dot), so every slab waited a global-load latency for them; these load slab + 1's [BN, 8] scales while slab
    # is computed (swap8_ahead's gate/up: 164 registers, 3 CTAs an SM)
    "swap8_ahead": dict(BM=8, gate_up=dict(BN=64, swap=True, lop3=True, scales_ahead=True, waves=3),
                        down=dict(BN=64, swap=True, lop3=True, scales_ahead=True, tiles=2)),
    "ahead": dict(gate_up=dict(scales_ahead=True), down=dict(scales_ahead=True)),
}


def with_variant(cfg, name):
    """Entry `cfg` with the overrides of VARIANTS[name]: per-kernel dicts merged, other keys set."""
    over = VARIANTS[name]
    return {**cfg, **over, **{kernel: {**cfg[kernel], **over.get(kernel, {})} for kernel in ("gate_up", "down")}}


def layout_for(device):
    """(gate/up panel, down panel) of the weight layout for `device`'s architecture (sm_90's elsewhere)."""
    return LAYOUTS.get(arch_of(device), LAYOUTS["sm_90"])


def arch_of(device):
    """'sm_<major><minor>' of a CUDA device; sm_90 (the tuned default) elsewhere."""
    if device.type != "cuda":
        return "sm_90"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def config_for(device, M, table=None):
    """The entry for M tokens on `device`'s architecture (sm_90's for an architecture without its own)."""
    buckets = (table or CONFIGS).get(arch_of(device), CONFIGS["sm_90"])
    return next(cfg for max_m, cfg in buckets if max_m is None or M <= max_m)
