"""Ahead-of-time compilation for architectures this machine cannot run (sm_120), to check resource limits.

`compile_for(kernel, signature, constexprs, arch="sm_120", num_warps=4, num_stages=2)` compiles a @triton.jit
kernel for the given arch (an `arch` key) without a GPU and returns its shared memory, registers and spill bytes,
read from ptxas's report; `compile_kernel` (same arguments) returns the compiled kernel itself, `resources` reads
a compiled kernel's (a Gluon kernel's too).
"""

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from triton_kernels import arch as archs


@dataclass
class Resources:
    shared: int
    registers: int
    spill_bytes: int


def _ptxas_report(ptx, arch):
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path if callable(get_ptxas) else get_ptxas()
    target = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas, "-v", f"-arch={target}", str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ptxas failed: {proc.stderr.strip()}")
    report = proc.stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    return (int(regs.group(1)) if regs else 0), sum(spills)


def resources(compiled):
    """The shared memory, registers and spill bytes of a compiled kernel."""
    registers, spills = _ptxas_report(compiled.asm["ptx"], compiled.metadata.target.arch)
    return Resources(shared=compiled.metadata.shared, registers=registers, spill_bytes=spills)


def compile_for(kernel, *args, **options):
    """Compile `kernel` (`compile_kernel`'s arguments) and report its resources (no GPU needed)."""
    return resources(compile_kernel(kernel, *args, **options))


@contextlib.contextmanager
def mma_v2_only(enabled=True):
    """While enabled: DISABLE_MMA_V3 set, which Triton reads while it compiles a kernel (and keys its disk cache on), so
    that the kernel's dots lower to mma.sync, not wgmma; put back as it was afterwards. Around a launch, it applies to
    the kernels that launch compiles (a kernel taking it as a constexpr, MMA_V2, is cached apart)."""
    if not enabled:
        yield
        return
    before = os.environ.get("DISABLE_MMA_V3")
    os.environ["DISABLE_MMA_V3"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DISABLE_MMA_V3"]
        else:
            os.environ["DISABLE_MMA_V3"] = before


def compile_kernel(kernel, signature, constexprs, arch="sm_120", num_warps=4, num_stages=2, maxnreg=None,
                   aligned=False, divisible=(), ones=()):
    """The compiled `kernel` for `arch` (an `arch` key; its .asm holds the PTX and cubin).

    aligned=True marks every pointer argument 16-byte aligned, as the JIT does for torch tensors at run time
    (without it, loads are not vectorised, nor pipelined, and shared memory is under-counted); `divisible`
    names integer arguments that are multiples of 16 at run time, which the JIT marks the same way, and `ones`
    those equal to 1, which the JIT compiles as constants. maxnreg caps the registers a thread, as the launch
    option does. A true MMA_V2 constexpr compiles the dots to mma.sync, as its launch does (`mma_v2_only`).
    """
    signature = {k: v for k, v in signature.items() if k not in ones}
    constexprs = {**constexprs, **{k: 1 for k in ones}}
    full = {**signature, **{k: "constexpr" for k in constexprs}}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, ty in full.items() if (aligned and ty.startswith("*")) or name in divisible}
    src = ASTSource(fn=kernel, signature=full, constexprs=constexprs, attrs=attrs)
    with mma_v2_only(constexprs.get("MMA_V2", False)):
        compiled = triton.compile(src, target=GPUTarget("cuda", archs.capability(arch), 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages,
                                           **({"maxnreg": maxnreg} if maxnreg else {})})
    return compiled
