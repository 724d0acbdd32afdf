"""Programmatic dependent launch (PDL) along the chain of small kernels of a decode or verify step.

A step is hundreds of short kernels in a row; between two of them the GPU idles while the second launches and
ramps up. Launched with PDL (sm_90 and newer), a kernel's programs may start while the kernel before it still
runs: each program first waits (`gdc_wait`) until the previous grid has completed and its writes are visible,
before it reads or writes anything, then at once lets the next kernel launch (`gdc_launch_dependents`). The
next kernel's launch and ramp then overlap this one's work. Where the release sits does not affect correctness
(a dependent still waits for the whole grid before its own first access), only how early it takes SM slots.
A kernel whose grid fills the GPU for a while (the attention's split kernel) releases at its end instead, so the
next kernel's programs do not sit beside it waiting.
"""

import triton
import triton.language as tl

from triton_kernels import arch

ENABLED = True  # False: plain launches everywhere (for A/B timing of whole steps)


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the previous grid to complete (its writes visible); before any load or store of the kernel."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has released (or exited)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of a kernel on the chain: wait for the previous grid, then release the next one."""
    wait(PDL)
    release(PDL)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines holding ptrs (a hint: no result to wait for; PTX prefetch, so not interpretable). A
    kernel launched with PDL issues it for constant data (weights) before its `wait`."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def active(t):
    """Whether kernels reading tensor `t` launch with PDL (a GPU of compute capability 9.0 or newer)."""
    return ENABLED and t.is_cuda and arch.capability(arch.device_arch(t.device)) >= 90


def options(t):
    """Launch keywords and the PDL constexpr for a kernel on the chain: `kernel[grid](..., **options(x))`."""
    return dict(PDL=True, launch_pdl=True) if active(t) else dict(PDL=False)
