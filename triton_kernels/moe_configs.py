"""Launch configurations of the W4A16 MoE kernels, as data: per architecture, per bucket of M (tokens).

Each entry: BM (token rows per block: the MMA's M, padded to 16, or with `swap` its N, padded to 8), and per kernel
BN (N tile), waves (K splits are chosen so that about waves x SMs programs run, from the expected number of distinct
experts touched), num_warps and num_stages. sm_120 entries must fit 101,376 bytes of shared memory without spills
(tests/test_moe_kernel.py); gate/up BN=64 at 4 warps spilled 116 bytes under Triton 3.6 (255 registers), so sm_120
keeps BN=32 (sm_120 entries: unswapped, not re-timed). The sm_90 entries: see the comment above them.
"""

import torch

CONFIGS = {
    # round 3 (bench/results/moe_variants_h200_s3.md, H200 2026-11-30 06:15 UTC; K-major words, LAYOUTS below):
    # k_swap8_pre up to M = 256 (BM 8, prescaled weights, scales a slab ahead, down's 4 pipelined tiles: 54-69% of
    # the read bandwidth at 8 <= M <= 256, 1.30-2.03x the swap16 entries at every M <= 256), k_ahead above (swap16
    # with K-major words, scales ahead; 52% at M = 512, where BM 8 reads an expert's words twice). Keyed on M at
    # the TP8 shape: at EP8 (48 experts) BM 8 passes 8 tokens an expert from M = 48 on (unmeasured there)
    # session 4 (bench/results/moe_variants_h200_s4.md, H200 08:40 UTC): the decode path (two launches: no routing
    # pass, memset or cast; split-K and top-k sums that the kernels zero again) on k_swap8_pre's kernels up to
    # M = 4, down 2 tiles a program at M = 1 (448 programs), 4 above: 20.3 against 27.7 us at M = 1, 31.0 / 46.0
    # against 35.3 / 50.6 at M = 2 / 4. Not at M = 8 (3-4% faster at TP8, where 64 pairs hit about 60 experts,
    # but at EP8 they hit about 36: an expert chosen by two tokens is read twice). M = 1 (09:03-09:11 UTC, three
    # calls, bench/results/moe_variants_h200_s4b.md): with `pdl` and 2 gate/up CTAs an SM, so that 2 down CTAs fit
    # beside them and ask L2 for their words while gate/up runs: 20.0 / 19.5 / 19.3-19.6 against 20.7 / 20.4 /
    # 20.3-20.5 us for the decode entry without; slower at M = 2 (32.0 against 30.4) and 4 (50.6 against 45.7)
    "sm_90": [
        (1, dict(BM=8, panels=(1, 1), decode=True, pdl=True,
                 gate_up=dict(BN=64, waves=2, num_warps=4, num_stages=3, swap=True, lop3=True, prescale=True,
                              scales_ahead=True),
                 down=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True, prescale=True,
                           scales_ahead=True, tiles=2))),
        (4, dict(BM=8, panels=(1, 1), decode=True,
                 gate_up=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True, prescale=True,
                              scales_ahead=True),
                 down=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True, prescale=True,
                           scales_ahead=True, tiles=4))),
        (256, dict(BM=8, panels=(1, 1),
                   gate_up=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True, prescale=True,
                                scales_ahead=True),
                   down=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True, prescale=True,
                             scales_ahead=True, tiles=4))),
        (None, dict(BM=16, panels=(1, 1),
                    gate_up=dict(BN=64, waves=2, num_warps=4, num_stages=4, swap=True, lop3=True, scales_ahead=True),
                    down=dict(BN=64, waves=2, num_warps=4, num_stages=3, swap=True, lop3=True, scales_ahead=True,
                              tiles=4))),
    ],
    "sm_120": [  # M <= 4: the decode path, untimed here (measured on sm_90; compiles within the limits)
        (4, dict(BM=16, decode=True, gate_up=dict(BN=32, waves=4, num_warps=4, num_stages=3),
                 down=dict(BN=128, waves=4, num_warps=4, num_stages=2))),
        (16, dict(BM=16, gate_up=dict(BN=32, waves=4, num_warps=4, num_stages=3),
                  down=dict(BN=128, waves=4, num_warps=4, num_stages=2))),
        (None, dict(BM=16, gate_up=dict(BN=32, waves=2, num_warps=4, num_stages=3),
                    down=dict(BN=128, waves=2, num_warps=4, num_stages=2))),
    ],
}


# Weight layout per architecture, chosen once at load by prepare_moe: (gate/up panel, down panel) widths, 0 for the
# slab layout, 1 for K-major words (README.md). A config runs on a panel layout when its BN divides the panel width.
LAYOUTS = {"sm_90": (1, 1), "sm_120": (0, 0)}


# sm_90 variants under test, as overrides of an entry's per-kernel dicts (not used by config_for); those measured
# slower in session 2's two H200 calls were dropped (bench/results/moe_variants_h200_s2*.md). Other config keys the
# kernels take (tests/test_moe_kernel.py runs them): `lean` (slab pointers carried across the K loop, no column
# masks when BN divides N), `decode` (top level: a block per (token, expert) pair, no routing pass, memset
# or cast: sums the kernels zero again, see moe_w4a16), `panels` (top level: the weight layout the config
# expects). Static SASS counts are in triton_kernels/README.md; `python bench/bench_moe.py --variants` times the variants (TP8 shape).
VARIANTS = {
    # `tiles` (down): N tiles a program computes one after the other, so the index loads, pointers and activations
    # of a block are set up once per `tiles` tiles (+1-3% at M >= 16 on the unswapped entries, H200 02:52 UTC;
    # where down's K is one slab the tile loop is now pipelined, see round 3 below)
    "dn_tiles2": dict(down=dict(tiles=2)),
    # BM 8 with swap: tokens pad to mma.sync's N = 8 (Triton keeps mma.sync there; half the HMMAs and scale FFMAs
    # a weight). `waves` = the CTAs an SM holds: 3 at 4 stages (61 KB), 4 at 3 stages (128 registers). Measured
    # (unswapped BM 16 base, 04:01 UTC): swap8_s3 the fastest at M = 8, 16, 64 (1-4% ahead of swap16), all BM 8
    # variants 22-25% slower at M = 512 (an expert's tokens need two blocks)
    "swap8": dict(BM=8, gate_up=dict(BN=64, swap=True, lop3=True, waves=3), down=dict(BN=64, swap=True, lop3=True)),
    "swap8_s3": dict(BM=8, gate_up=dict(BN=64, swap=True, lop3=True, num_stages=3, waves=4),
                     down=dict(BN=64, swap=True, lop3=True)),
    "swap8_dn2": dict(BM=8, gate_up=dict(BN=64, swap=True, lop3=True, waves=3),
                      down=dict(BN=64, swap=True, lop3=True, tiles=2)),
    # `scales_ahead` (per kernel): the group scales are plain loads (Triton's pipeliner stages only loads that feed
    # a dot), so every slab waited a global-load latency for them; these load slab + 1's [BN, 8] scales while slab
    # is computed (swap8_ahead's gate/up: 164 registers, 3 CTAs an SM). Measured on the unswapped base: `ahead`
    # 3-11% faster, swap8_ahead within 1-7% of swap8_s3 below M = 256
    "swap8_ahead": dict(BM=8, gate_up=dict(BN=64, swap=True, lop3=True, scales_ahead=True, waves=3),
                        down=dict(BN=64, swap=True, lop3=True, scales_ahead=True, tiles=2)),
    "ahead": dict(gate_up=dict(scales_ahead=True), down=dict(scales_ahead=True)),
    # round 3 (on the swap16 entries). `tiles` > 1 where down's K is one slab (TP8: I = 256) drops the K loop, so
    # the tile loop is the innermost and pipelined: tile t + 1's words stream in while tile t is computed (3
    # stages: 2 tiles, 16 KB of words, in flight a CTA), with `scales_ahead` its scales too
    "ahead_dn4": dict(gate_up=dict(scales_ahead=True), down=dict(scales_ahead=True, tiles=4, num_stages=3)),
    # `prescale` (per kernel): weights times their group scale in bf16 before the MMA, one dot chain a slab (no fp32
    # FFMA of each group's product). The scales then feed the dot, so Triton's pipeliner stages them with the words
    # (no plain LDG left in the loop), and registers drop (gate/up 198 -> 119: 3 CTAs an SM at 3 stages, 61 KB;
    # down 127 -> 64: 8 CTAs an SM). bf16 rounding of q * scale, as a bf16 checkpoint's weight has
    "pre": dict(gate_up=dict(prescale=True, num_stages=3, waves=3), down=dict(prescale=True)),
    # K-major words (`panels` (1, 1)): a column's slab words contiguous, the order the swapped tiles' shared-memory
    # copy wants, so the words load by 16-byte cp.async (4-byte before: one copy and its address arithmetic per
    # word); loop 3.87 -> 3.35 instructions a weight on the default's kernel
    "k_ahead": dict(panels=(1, 1), decode=False, gate_up=dict(scales_ahead=True),
                    down=dict(scales_ahead=True, tiles=4, num_stages=3)),
    # K-major, prescaled, scales a slab ahead (a prescaled group's scale vector no longer stages by itself there):
    # gate/up 2.96 instructions a weight, 126 registers, 58 KB (3 CTAs an SM); down 3.82, 91 registers
    "k_pre_ahead": dict(panels=(1, 1), gate_up=dict(prescale=True, scales_ahead=True, num_stages=3, waves=3),
                        down=dict(prescale=True, scales_ahead=True, tiles=4, num_stages=3)),
    # the same with `stack` (gate and up columns as one [2 BN, BM] tile: one dot and one wgmma wait a group, 8 a
    # slab instead of 16): gate/up 2.72 instructions a weight, 163 registers, 59 KB (3 CTAs an SM)
    "k_stack_pre": dict(panels=(1, 1), gate_up=dict(stack=True, prescale=True, scales_ahead=True, num_stages=3,
                                                    waves=3),
                        down=dict(prescale=True, scales_ahead=True, tiles=4, num_stages=3)),
    # BM 8 (mma.sync, no wgmma waits), K-major, prescaled: gate/up 2.89 instructions a weight, 118 registers, 42 KB
    # (4 CTAs an SM); at M = 512 an expert's tokens need two blocks (round 2: 0.75x there)
    "k_swap8_pre": dict(panels=(1, 1), BM=8, decode=False,
                        gate_up=dict(prescale=True, scales_ahead=True, num_stages=3, waves=4),
                        down=dict(prescale=True, scales_ahead=True, tiles=4, num_stages=3)),
    # session 4, the decode path (block b = pair b; splits and pairs add into sums the kernels zero again), measured
    # on k_swap8_pre's kernels at M = 1 / 2 / 4 / 8 (TP8, us; entries 20.3 / 31.0 / 46.0 / 79.1): down 2 tiles a
    # program 21.4 / 29.7 / 46.1 / 76.8, 4 tiles 21.8 / 30.4 / 46.1 / 75.6, gate/up splits for 2 CTAs an SM
    # 21.1 / 29.6 / 44.6 / 77.4, with `pdl` 21.6 / 28.7 / 45.7 / 78.4 (none kept: within the run's 1 us noise of
    # the entries, or slower). `pdl` with 2 gate/up CTAs an SM (2 down CTAs fit beside them, registers, and fetch
    # their words while gate/up runs; at 4 gate/up CTAs an SM there is no room) became the M = 1 entry (above)
    # session 4, M = 1 probes on the decode entry (H200 09:10-09:11 UTC, us at M = 1 against the entry's 20.4 / 20.3
    # and `pdl` with 2 gate/up CTAs an SM at 19.5 / 19.3, now the entry): gate/up `waves` 8 21.6, gate/up BN 32
    # 23.5, one down tile a program 21.3-21.6, `pdl` with waves 2 and one down tile 22.1-22.4, `pdl` with waves 3
    # 23.4, `pdl` waves 2 at 4 stages 20.3-20.5, `pdl` waves 1 at 4 stages 21.6-22.2 (all removed)
    # `pdl` (top level): programmatic dependent launch of the two GEMMs and of the cast to x's dtype (the down
    # kernel's programs start while the gate/up kernel's last ones run, and ask L2 for their words before waiting
    # for h; the cast starts while down runs); with the decode path (measured in round 3 with a memset and a cast,
    # which the decode path no longer has) and 2 down tiles a program (twice the programs at M = 1: 8 blocks of
    # 112 tiles) for M <= 16
    "pdl_k_stack_pre": dict(pdl=True, panels=(1, 1),
                            gate_up=dict(stack=True, prescale=True, scales_ahead=True, num_stages=3, waves=3),
                            down=dict(prescale=True, scales_ahead=True, tiles=4, num_stages=3)),
    "decode_pdl_k_stack_pre": dict(decode=True, pdl=True, panels=(1, 1),
                                   gate_up=dict(stack=True, prescale=True, scales_ahead=True, num_stages=3, waves=3),
                                   down=dict(prescale=True, scales_ahead=True, tiles=2, num_stages=3)),
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
