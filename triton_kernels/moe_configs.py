"""Launch configurations of the W4A16 MoE kernels, as data: per architecture (`arch` keys), per bucket of M tokens.

An entry: BM (token rows a block: the MMA's M, padded to 16, or with `swap` its N, padded to 8), `kmajor` (the
weight layout it expects, moe_layout), `decode` (no routing pass: a block per (token, expert) pair, split-K and
top-k sums the kernels zero again), `pdl` (programmatic dependent launch of the routing pass and the GEMMs), and
per kernel (`gate_up`, `down`): BN (N tile), waves (K splits aim at about waves x SMs programs, from the expected
number of experts touched), num_warps, num_stages, `maxnreg` (register cap), `swap` (transposed tiles: weights as
the MMA's M operand), `lop3` (dequantisation by one PTX lop3), `scales_ahead` (a slab's scales loaded a slab early),
`prescale` (weights scaled before the MMA), `mma_v2` (dots compiled to mma.sync, not wgmma); gate/up only:
`device_split` (persistent grid, K split chosen on the device from the blocks the routing pass filled); down only:
`tiles` (N tiles a program, one after the other), `persistent` (persistent grid over the filled blocks).
"""

import functools

from triton_kernels import arch, tuning

_SWAP = dict(BN=64, num_warps=4, num_stages=3, swap=True, lop3=True, scales_ahead=True)

# Each bucket's entry is the fastest measured at the TP8 rank's shape (384 experts, intermediate 256) on the verify
# step's routing: bench/results/step_h200_run15.json. The rules: BM 8 swapped tiles while an expert rarely gets more
# than 8 tokens (M <= 128); the decode path up to M = 4, where a token's pairs mostly hit distinct experts; the
# device-chosen split with the persistent down for 5 <= M <= 33, where the static grid is mostly empty blocks;
# gate/up capped at 128 registers where 4 programs an SM beat 3.
CONFIGS = {
    "sm_90": [
        (1, dict(BM=8, kmajor=True, decode=True, pdl=True,
                 gate_up=dict(_SWAP, waves=2), down=dict(_SWAP, waves=4, tiles=2))),
        (4, dict(BM=8, kmajor=True, decode=True,
                 gate_up=dict(_SWAP, waves=4, maxnreg=128), down=dict(_SWAP, waves=4, tiles=4))),
        (33, dict(BM=8, kmajor=True, pdl=True,
                  gate_up=dict(_SWAP, waves=4, device_split=True), down=dict(_SWAP, waves=4, tiles=4, persistent=True))),
        (128, dict(BM=8, kmajor=True,
                   gate_up=dict(_SWAP, waves=4, maxnreg=128), down=dict(_SWAP, waves=4, tiles=4))),
        (None, dict(BM=16, kmajor=True,
                    gate_up=dict(_SWAP, waves=2, num_stages=4), down=dict(_SWAP, waves=2, tiles=4))),
    ],
    # Compile-checked for sm_120 (101,376 bytes of shared memory, no spills: tests/test_moe_kernel.py), not timed.
    # Gate/up keeps BN 32: BN 64 at 4 warps spills under Triton 3.6.
    "sm_120": [
        (4, dict(BM=16, decode=True, gate_up=dict(BN=32, waves=4, num_warps=4, num_stages=3),
                 down=dict(BN=128, waves=4, num_warps=4, num_stages=2))),
        (16, dict(BM=16, gate_up=dict(BN=32, waves=4, num_warps=4, num_stages=3),
                  down=dict(BN=128, waves=4, num_warps=4, num_stages=2))),
        (None, dict(BM=16, gate_up=dict(BN=32, waves=2, num_warps=4, num_stages=3),
                    down=dict(BN=128, waves=2, num_warps=4, num_stages=2))),
    ],
}

# The weight layout `prepare_moe` chooses once at load: K-major words where the entries' swapped tiles read them.
# A tuned file's entries for an intermediate size name their own (`kmajor_for`).
KMAJOR = {"sm_90": True, "sm_120": False}

# Overrides of an entry (per-kernel dicts merged), applied by the tables below.
PRESCALE = dict(gate_up=dict(prescale=True, maxnreg=None), down=dict(prescale=True))
BM16 = dict(BM=16, gate_up=dict(maxnreg=None))  # 16-row blocks (uncapped: at 128 registers gate/up spills)
MMA_V2 = dict(gate_up=dict(mma_v2=True), down=dict(mma_v2=True))
MMA_V2_PRESCALE = dict(gate_up=dict(mma_v2=True, prescale=True), down=dict(mma_v2=True, prescale=True))

# By intermediate size (the experts' static shape): arch -> intermediate -> {bucket's max M: override}. At the EP8
# rank's shape (48 experts, intermediate 2048) an expert gets 8 tokens from M = 48 on, so 16-row blocks win up to
# M = 128, and at M = 1 the prescaled weights (bench/results/moe_variants_ep8_h100_s26_triton36.md).
BY_INTERMEDIATE = {"sm_90": {2048: {1: PRESCALE, 128: BM16}}, "sm_120": {}}

# The tables were tuned on Triton TUNED_TRITON. Newer Tritons lower the BM 8 entries' dots (a swapped tile's N is 8)
# to wgmma, which waits for each group's product: their dots are compiled to mma.sync again, prescaled above M = 128
# (bench/results/moe_step_h200_s23_triton39_mma_v2.json). arch -> {bucket's max M: override}; where BY_INTERMEDIATE
# overrides the bucket, NEWER_TRITON_BY_INTERMEDIATE's override (if any) applies on top of it instead.
TUNED_TRITON = (3, 6)
NEWER_TRITON = {"sm_90": {1: MMA_V2, 4: MMA_V2, 33: MMA_V2, 128: MMA_V2, None: MMA_V2_PRESCALE}, "sm_120": {}}
NEWER_TRITON_BY_INTERMEDIATE = {"sm_90": {2048: {1: MMA_V2}}, "sm_120": {}}


@functools.cache
def triton_version():
    """(major, minor) of the Triton that compiles the kernels."""
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


def with_overrides(cfg, over):
    """Entry `cfg` with the overrides `over`: per-kernel dicts merged, other keys set."""
    return {**cfg, **over, **{kernel: {**cfg[kernel], **over.get(kernel, {})} for kernel in ("gate_up", "down")}}


def kmajor_for(device, intermediate=None):
    """The expert layout for experts of that intermediate size on the arch in force for `device`: the one the tuned
    file's entries for that size name, else KMAJOR."""
    key = arch.current(device)
    tuned = tuning.moe_layout(key, intermediate)
    return KMAJOR[key] if tuned is None else tuned


def config_for(device, M, intermediate=None):
    """The entry for M tokens on the arch in force for `device` (`arch.current`): the tuned file's entry for the
    bucket, where the file in force has one (tuning.py), else `table_entry`'s in the layout `kmajor_for` gives."""
    key = arch.current(device)
    tuned = tuning.moe_entry(key, M, intermediate)
    if tuned is not None:
        return tuned
    return {**table_entry(key, M, intermediate), "kmajor": kmajor_for(device, intermediate)}


def table_entry(key, M, intermediate=None):
    """The Python table's entry for M tokens on arch `key`, with the BY_INTERMEDIATE override of its bucket for
    experts of that intermediate size, if any, and on a Triton newer than TUNED_TRITON the
    NEWER_TRITON_BY_INTERMEDIATE one on top of it (the NEWER_TRITON one where BY_INTERMEDIATE has none)."""
    max_m, cfg = next((max_m, cfg) for max_m, cfg in CONFIGS[key] if max_m is None or M <= max_m)
    by_size = BY_INTERMEDIATE[key].get(intermediate, {}).get(max_m)
    overrides = [by_size] if by_size else []
    if triton_version() > TUNED_TRITON:
        newer = NEWER_TRITON_BY_INTERMEDIATE[key].get(intermediate, {}) if by_size else NEWER_TRITON[key]
        overrides.append(newer.get(max_m))
    for over in filter(None, overrides):
        cfg = with_overrides(cfg, over)
    return cfg
