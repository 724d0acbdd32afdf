"""Which architecture's tables and code paths apply on this device: the one answer every kernel module asks.

Every table of the kernels (launch configs, split rules, layouts) is keyed by the same string, 'sm_<major><minor>':
`ARCHS` lists the architectures that have tables. `current(device)` is the key in force for a device:
- the override, if one is set (environment variable SPEC_ARCH=sm_120, or `use("sm_120")` / `using("sm_120")`);
- else the GPU's own architecture if it has tables;
- else a fallback, announced once on stderr in one line: sm_120's tables for another sm_12x, sm_90's for the rest;
- without CUDA (the interpreter on CPU) sm_90's, silently.
`sm_count(device)` sizes grids at run time (4 on CPU, where the interpreter runs them); `shared_limit(arch)` is the
shared memory a block may use on an architecture; `hopper_features(device)` says whether code written for sm_90
alone (wgmma, the Gluon kernels for sm_90) may run.

The sm_120 proxy (SPEC_ARCH=sm_120 on a Hopper GPU) runs the project as it runs on sm_120 (RTX PRO 6000):
- every table takes its sm_120 entry and the code paths follow: no wgmma, no Gluon kernel for sm_90, no TMA multicast
  or clusters (sm_120 has none of them; plain TMA loads, which it has, run where an sm_120 entry asks for them);
- Triton still compiles for the GPU at hand, whose `tl.dot` it would lower to wgmma: the override sets
  DISABLE_MMA_V3=1, with which Triton 3.x lowers it to mma.sync as on sm_120 (set before the first kernel compiles:
  the environment variable is read at import, `use` must be called before any launch);
- shared memory: every sm_120 entry is compiled for sm_120 by the CPU tests and held to 101,376 bytes a block
  (`shared_limit("sm_120")`), so the proxy's kernels use no more than sm_120 has;
- grids come from the SM count of the GPU at hand, never a constant.
It models the code path and the relative speed of its kernels, not sm_120's absolute speed: bandwidth, L2 size and
SM count are the Hopper GPU's.
"""

import os
import sys
from contextlib import contextmanager

import torch

ENV_VAR = "SPEC_ARCH"
ARCHS = ("sm_90", "sm_120")  # architectures with tables
SHARED_LIMIT = {"sm_90": 232_448, "sm_120": 101_376}  # bytes of shared memory a block may use
WGMMA = ("sm_90",)  # architectures whose tensor cores take wgmma
CPU_ARCH = "sm_90"  # the tables the interpreter runs on CPU

_override = None  # the arch forced by `use` or SPEC_ARCH
_mma_v3_before = None  # DISABLE_MMA_V3 as it was before an override set it: (was set, value)
_warned = set()


def capability(arch):
    """The compute capability number of an arch key ('sm_120' -> 120), as Triton's GPUTarget takes it."""
    if not (isinstance(arch, str) and arch.startswith("sm_") and arch[3:].isdigit()):
        raise ValueError(f"arch: {arch!r} is not an architecture key like 'sm_90'")
    return int(arch[3:])


def device_arch(device=None):
    """The GPU's own architecture ('sm_90' on an H100), whatever the override; None for a CPU device or without CUDA.
    device None: the current CUDA device."""
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def fallback(arch):
    """The arch whose tables a GPU of `arch` (without tables of its own) runs."""
    return "sm_120" if capability(arch) // 10 == 12 else "sm_90"


def current(device=None):
    """The arch key whose tables and code paths apply to `device` (None: the current CUDA device, or the CPU)."""
    if _override is not None:
        return _override
    arch = device_arch(device)
    if arch is None:
        return CPU_ARCH
    if arch in ARCHS:
        return arch
    chosen = fallback(arch)
    if arch not in _warned:
        _warned.add(arch)
        print(f"warning: no kernel tables for {arch}; running {chosen}'s (set {ENV_VAR} to choose)", file=sys.stderr)
    return chosen


def overridden():
    """The arch forced by `use` or SPEC_ARCH, or None."""
    return _override


def use(arch):
    """Run `arch`'s tables and code paths on the device at hand (None: the device's own again). For an arch without
    wgmma on a CUDA machine this sets DISABLE_MMA_V3=1 (Triton then lowers tl.dot to mma.sync), put back as it was
    by use(None). Call it before the first kernel launch: kernels compiled already keep their code."""
    global _override, _mma_v3_before
    if arch is not None and arch not in ARCHS:
        raise ValueError(f"{ENV_VAR}: unknown arch {arch!r}; the archs with tables are {', '.join(ARCHS)}")
    if _mma_v3_before is not None:  # undo what the previous override set
        was_set, value = _mma_v3_before
        if was_set:
            os.environ["DISABLE_MMA_V3"] = value
        else:
            os.environ.pop("DISABLE_MMA_V3", None)
        _mma_v3_before = None
    _override = arch
    if arch is not None and arch not in WGMMA and torch.cuda.is_available():
        _mma_v3_before = ("DISABLE_MMA_V3" in os.environ, os.environ.get("DISABLE_MMA_V3"))
        os.environ["DISABLE_MMA_V3"] = "1"


@contextmanager
def using(arch):
    """`use(arch)` for the duration of a with block, then the override as it was."""
    before = _override
    use(arch)
    try:
        yield
    finally:
        use(before)


def sm_count(device):
    """SMs of a CUDA device (of the GPU at hand, also under an override); 4 elsewhere (the interpreter's stand-in,
    so that grids stay small)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def shared_limit(arch=None):
    """Bytes of shared memory a block may use on `arch` (None: the arch in force on the current device)."""
    return SHARED_LIMIT[arch or current()]


def hopper_features(device):
    """Whether code written for sm_90 alone (wgmma, the Gluon kernels for sm_90) may run on `device`: the arch in
    force is sm_90 and the GPU is one (not under an override, not on another GPU running sm_90's tables)."""
    return current(device) == "sm_90" and device_arch(device) == "sm_90"


if os.environ.get(ENV_VAR):
    use(os.environ[ENV_VAR].strip())
