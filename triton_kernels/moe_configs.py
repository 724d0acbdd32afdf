"""Launch configurations of the W4A16 MoE kernels, as data: per architecture, per bucket of M (tokens).

Each entry: BM (token rows per block: the MMA's M, padded to 16, or with `swap` its N, padded to 8), and per kernel
BN (N tile), waves (K splits are chosen so that about waves x SMs programs run, from the expected number of distinct
experts touched), num_warps and num_stages. sm_120 entries must fit 101,376 bytes of shared memory without spills
(tests/test_moe_kernel.py); gate/up BN=64 at 4 warps spilled 116 bytes under Triton 3.6 (255 registers), so sm_120
keeps BN=32 (sm_120 entries: unswapped, not re-timed). The sm_90 entries: see the comment above them.
"""

import functools

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
    # session 5 (bench/results/moe_variants_h200_s5.md, H200 11:46 UTC): `device_split` (gate/up K splits decided on
    # the device from the blocks the routing pass filled, down on a persistent grid) for 5 <= M <= 33: with the
    # verify step's expert counts 61.9 / 103.9 us against 70.3 / 120.6 at M = 9 / 33, but 84.6 against 79.5 at
    # M = 16, and with uniform routing 83.7 / 204.1 against 78.0 / 199.2 at M = 8 / 32; slower from M = 65 on
    # session 6 (bench/results/moe_variants_h200_s6.md, H200 13:41 UTC), the verify step's expert counts: BM 16 (an
    # expert with 9-16 tokens read once, not twice) with the device-decided split for 65 <= M <= 128 (M = 65: 123.4
    # against 132.9 us), the M > 256 entry (BM 16, scales ahead, not prescaled) from M = 129 on (164.5 against 197.2;
    # 170.1 with the split). Uniform routing, slower but above 50%: M = 128 419.1 against 375.0 us (63% against 70%),
    # M = 256 465.3 against 448.1 (61% against 63%); M = 64 stays BM 8 (BM 16: 323-341 against 288.5 us).
    # session 9 (bench/results/moe_variants_h200_s9.md, H200 18:16 UTC): up to M = 33 the group scale multiplies
    # each group's MMA product again, not the weights (the prescaled form's 16 MMAs a slab chained through one
    # accumulator): M = 1 17.8-17.9 against 19.9-20.0 us (32% against 28% of the read bandwidth), 2 / 4 / 8 / 16
    # 29.5 / 43.9 / 80.7 / 133.4 against 29.7 / 45.4 / 84.2 / 138.4, the step's M = 9 / 33 59.5 / 98.9 against
    # 62.2 / 103.1; slower from M = 64 (the step's M = 65 146.6 against 131.5). Capped at 128 registers (161-168
    # uncapped), the M <= 128 entry's gate/up fits 4 programs an SM, not 3, and is faster that way (18:24 UTC): the
    # step's M = 65 125.4 against 131.4 us, uniform M = 64 / 128 274.5 / 344.9 against 284.6 / 358.1; at M = 2 / 4
    # 28.2 / 43.6 against 29.6 / 43.8 (so the M <= 4 entry's too); slower at M = 1, in the device-split entry
    # (the step's M = 9 / 33: 61.7 / 102.2 against 59.7 / 99.3) and the BM 16 one (M = 129: 217 against 164)
    # The lead's closing step run (bench/results/step_h200_run15.json, 14:04 UTC) put the BM 16 split entry's
    # 65 <= M <= 128 back on BM 8: in the verify at budget 64 (65 tokens) its gate/up + down took 5894 + 3015 us
    # over the 60 layers against BM 8's 5285 + 3152 in run 13 (the bench's synthetic step routing spreads the
    # tokens differently); from M = 129 the M > 256 entry stays (7571 + 4161 against 7497 + 4419 us)
    # session 12 (bench/results/step_h200_s12_routed_pdl_{on,off}.json, H200 22:20 UTC, the verify at 4k, same
    # call): `pdl` on the routing pass and the GEMMs after it in the 5 <= M <= 33 entry (its persistent grids hold
    # no empty blocks): budget 8 / 32 7.74 / 11.02 against 7.82 / 11.08 ms; on the 34-128 and 129+ entries (static
    # grids, most blocks empty) slower: budget 64 / 128 13.98 / 19.50 against 13.71 / 19.11 ms. The 5-33 entry's
    # scheme (device split, persistent down, `pdl`) on the 34-128 and 129+ entries' tiles (22:30 UTC, same call,
    # bench/results/step_h200_s12_split_pdl_base.json for the base): 13.67 / 20.66 against 13.55 / 19.13 ms; alone
    # (moe_step_h200_s12_split_pdl.json) 131.3 / 213.4 against 129.3 / 195.6 us a layer
    "sm_90": [
        (1, dict(BM=8, panels=(1, 1), decode=True, pdl=True,
                 gate_up=dict(BN=64, waves=2, num_warps=4, num_stages=3, swap=True, lop3=True,
                              scales_ahead=True),
                 down=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True,
                           scales_ahead=True, tiles=2))),
        (4, dict(BM=8, panels=(1, 1), decode=True,
                 gate_up=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True,
                              scales_ahead=True, maxnreg=128),
                 down=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True,
                           scales_ahead=True, tiles=4))),
        (33, dict(BM=8, panels=(1, 1), pdl=True,
                  gate_up=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True,
                               scales_ahead=True, device_split=True),
                  down=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True,
                            scales_ahead=True, tiles=4, persistent=True))),
        (128, dict(BM=8, panels=(1, 1),
                   gate_up=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True,
                                scales_ahead=True, maxnreg=128),
                   down=dict(BN=64, waves=4, num_warps=4, num_stages=3, swap=True, lop3=True,
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


# sm_90 variants under test, as overrides of an entry's per-kernel dicts (not used by config_for). The variants
# measured in sessions 2-6 were removed once measured slower (numbers: triton_kernels/README.md and
# bench/results/moe_variants_h200_*.md). Other config keys the kernels take (tests/test_moe_kernel.py runs them):
# `lean` (slab pointers carried across the K loop, no column masks when BN divides N), `decode` (top level: a block
# per (token, expert) pair, no routing pass, memset or cast), `device_split` (gate/up, with the routing pass: a
# persistent grid whose K split is chosen on the device), `persistent` (down, with the routing pass: a persistent
# grid over the filled blocks), `pdl` (top level: programmatic dependent launch of the GEMMs, and of the routing
# pass before them), `panels` (top level: the weight layout the config expects). `python bench/bench_moe.py
# --variants` times them (TP8 shape).
VARIANTS = {
    # the round 3 entry for 8 <= M <= 256 (routing pass, BM 8, K-major, prescaled), at M <= 4
    "k_swap8_pre": dict(decode=False, pdl=False, gate_up=dict(waves=4, prescale=True, maxnreg=None),
                        down=dict(tiles=4, prescale=True)),
    # the routing-pass entries with gate/up's K split decided on the device from the blocks the routing pass
    # filled (`device_split`: moe_w4a16._planned_gate_up_kernel) instead of the host's estimate for uniform
    # routing, and down on a persistent grid over those blocks (`persistent`) instead of a program for every block
    # of the static bound (empty blocks included): in the sm_90 entries for 5 <= M <= 33 and 65 <= M <= 128
    "device_split": dict(gate_up=dict(device_split=True), down=dict(persistent=True)),
    # the weights scaled before the MMA (`prescale`) and gate/up uncapped, as the entries up to M = 128 were
    # until session 9
    "prescale": dict(gate_up=dict(prescale=True, maxnreg=None), down=dict(prescale=True)),
    # 16-row blocks (uncapped: at 128 registers gate/up spills) on an entry's kernels: an expert's tokens at EP8
    # (48 experts) fill them from M = 64 on
    "bm16": dict(BM=16, gate_up=dict(maxnreg=None)),
    # plain launches (no programmatic dependent launch)
    "plain": dict(pdl=False),
    # the dots compiled to mma.sync, not wgmma (aot.mma_v2_only), as Triton 3.6 compiles the BM 8 entries
    "mma_v2": dict(gate_up=dict(mma_v2=True), down=dict(mma_v2=True)),
    "mma_v2_prescale": dict(gate_up=dict(mma_v2=True, prescale=True), down=dict(mma_v2=True, prescale=True)),
}


# Entries by intermediate size (the MoE's static shape) where CONFIGS' entries, tuned at the TP8 rank's 256, lose:
# arch -> intermediate -> {bucket's max M: VARIANTS name applied to that entry}. EP8 (48 experts, intermediate 2048;
# H200 18:43 UTC, bench/results/moe_variants_h200_s9.md section 7): M = 1 prescaled 72.8 against 82.7 us, 16-row
# blocks at M = 64 / 128 477.1 / 808.5 against 572.1 / 1037.8 us
BY_INTERMEDIATE = {"sm_90": {2048: {1: "prescale", 128: "bm16"}}}


# Entries for a Triton newer than the device's 3.6, where the table above was tuned: arch -> {bucket's max M: VARIANTS
# name}. Triton 3.9 lowers the BM 8 entries' dots (the swapped tile's N is 8) to wgmma, where 3.6 kept mma.sync,
# and waits for each group's product. The verify step's own MoE calls (bench/probe_moe_step.py, H200, 2026-12-02
# 09:03-09:06 UTC, us a layer at M = 1 / 9 / 33 / 129; bench/results/moe_step_h200_s23_*.json): Triton 3.6's
# entries 20.1 / 57.2 / 99.4 / 195.6; on 3.9 22.3 / 78.0 / 146.9 / 247.6, with `mma_v2` 19.9 / 57.5 / 100.3 / 240.8,
# with `mma_v2_prescale` 19.7 / 60.7 / 106.6 / 206.8. M = 34-128 was not timed on 3.9; it takes `mma_v2` as the
# BM 8 entries below it do. Where BY_INTERMEDIATE has an entry, NEWER_TRITON_BY_INTERMEDIATE's variant (if any)
# applies on top of it instead
NEWER_TRITON = {"sm_90": {1: "mma_v2", 4: "mma_v2", 33: "mma_v2", 128: "mma_v2", None: "mma_v2_prescale"}}
# EP8 on Triton 3.9 (bench_moe.py --variants --shape ep8, an H100, 2026-12-06 04:20 UTC, us; both Tritons in one
# call, bench/results/moe_variants_ep8_h100_s26_triton{36,39}.md): M = 1, the prescaled entry 94.3 on 3.9's wgmma,
# 86.9 with `mma_v2` (3.6: 87.0). M = 64 / 128, BM 16: 522.8 / 903.2 on wgmma, `mma_v2` 561.2 / 929.0,
# `mma_v2_prescale` 510.7 / 899.4 (2% / 0.4%, not adopted; 3.6: 529.5 / 806.0, so M = 128 is 12% slower on 3.9)
NEWER_TRITON_BY_INTERMEDIATE = {"sm_90": {2048: {1: "mma_v2"}}}
TUNED_TRITON = (3, 6)


@functools.cache
def triton_version():
    """(major, minor) of the Triton that compiles the kernels."""
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


def with_variant(cfg, name):
    """Entry `cfg` with the overrides of VARIANTS[name]: per-kernel dicts merged, other keys set."""
    over = VARIANTS[name]
    return {**cfg, **over, **{kernel: {**cfg[kernel], **over.get(kernel, {})} for kernel in ("gate_up", "down")}}


def layout_for(device):
    """(gate/up panel, down panel) of the weight layout for `device`'s architecture (sm_90's elsewhere)."""
    return LAYOUTS.get(arch_of(device), LAYOUTS["sm_90"])


def sm_count(device):
    """SMs of a CUDA device; 4 elsewhere (the interpreter's stand-in, so that grids stay small)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def arch_of(device):
    """'sm_<major><minor>' of a CUDA device; sm_90 (the tuned default) elsewhere."""
    if device.type != "cuda":
        return "sm_90"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def config_for(device, M, table=None, intermediate=None):
    """The entry for M tokens on `device`'s architecture (sm_90's for an architecture without its own), with the
    BY_INTERMEDIATE override of its bucket for experts of that intermediate size, if any, and on a Triton newer
    than TUNED_TRITON the NEWER_TRITON_BY_INTERMEDIATE one on top of it (the NEWER_TRITON one where BY_INTERMEDIATE
    has none)."""
    arch = arch_of(device)
    max_m, cfg = next((max_m, cfg) for max_m, cfg in (table or CONFIGS).get(arch, CONFIGS["sm_90"])
                      if max_m is None or M <= max_m)
    by_size = BY_INTERMEDIATE.get(arch, {}).get(intermediate, {}).get(max_m)
    names = [by_size] if by_size else []
    if triton_version() > TUNED_TRITON:
        newer = (NEWER_TRITON_BY_INTERMEDIATE.get(arch, {}).get(intermediate, {}) if by_size
                 else NEWER_TRITON.get(arch, {}))
        names.append(newer.get(max_m))
    for name in filter(None, names):
        cfg = with_variant(cfg, name)
    return cfg
