"""Ask L2 for weights that a later kernel of the step will read (`ops.prefetch_l2`).

Much of a decode or verify step is short, latency-bound kernels (norms, the absorbed projections, attention over a
short cache) that leave DRAM nearly idle. A weight a later kernel of the layer streams (o_proj, q_b, W_UK/W_UV) can
be pulled into L2 during them, from a second stream, so that kernel reads at L2 speed. One thread per 4 KB chunk
issues `cp.async.bulk.prefetch.L2` (sm_90 and newer): fire and forget, so the kernel ends as soon as the requests
are issued and nothing waits on it. A prefetch changes no value.
"""

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 4096  # bytes a bulk-prefetch instruction asks for
CHUNKS_PER_PROGRAM = 32  # one warp a program, one chunk a thread: the requests spread over many SMs' TMA units


@triton.jit(do_not_specialize=["n_bytes"])
def _prefetch_l2_kernel(ptr, n_bytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """ptr: a 16-byte aligned byte pointer; bytes [0, n_bytes) are asked for, n_bytes rounded down to 16."""
    start = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK  # [BLOCK] chunk starts
    size = tl.minimum(tl.maximum(n_bytes - start, 0), CHUNK).to(tl.int32) // 16 * 16  # [BLOCK] 0: nothing
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
        "mov.u32 $0, 0;\n\t}", "=r,l,r", [ptr + start, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(*tensors):
    """Triton twin of ops.prefetch_l2: one launch per tensor (contiguous, 16-byte aligned, on a CUDA device of
    compute capability 9.0 or newer; elsewhere nothing is done)."""
    for t in tensors:
        if not t.is_cuda or torch.cuda.get_device_capability(t.device)[0] < 9:
            continue
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"prefetch_l2 (triton): needs a contiguous, 16-byte aligned tensor, got shape "
                             f"{tuple(t.shape)} strides {t.stride()} at address {t.data_ptr():#x}")
        n_bytes = t.numel() * t.element_size()
        grid = triton.cdiv(triton.cdiv(n_bytes, CHUNK_BYTES), CHUNKS_PER_PROGRAM)
        if grid:
            _prefetch_l2_kernel[(grid,)](t.view(-1).view(torch.uint8), n_bytes, CHUNK=CHUNK_BYTES,
                                         BLOCK=CHUNKS_PER_PROGRAM, num_warps=1)
