"""ops.prefetch_l2: a hint that changes no value; its kernel compiles for sm_90 and sm_120, runs inside a CUDA graph,
and refuses tensors its bulk prefetch cannot address."""

import pytest
import torch

import ops
from tests.conftest import compiled_in_child, requires_gpu

COMPILE = """
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_kernels.aot import compile_for
from triton_kernels.prefetch import CHUNK_BYTES, CHUNKS_PER_PROGRAM, _prefetch_l2_kernel as k
sig, const = {"ptr": "*u8", "n_bytes": "i64"}, {"CHUNK": CHUNK_BYTES, "BLOCK": CHUNKS_PER_PROGRAM}
src = ASTSource(fn=k, signature={**sig, "CHUNK": "constexpr", "BLOCK": "constexpr"}, constexprs=const)
out = {}
for arch in (90, 120):
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 1}).asm["ptx"]
    res = compile_for(k, sig, const, arch=arch, num_warps=1, aligned=True)
    out[arch] = dict(vars(res), bulk=ptx.count("cp.async.bulk.prefetch.L2.global"))
print(json.dumps(out))
"""


def test_prefetch_kernel_compiles_for_sm90_and_sm120():
    for arch, res in compiled_in_child(COMPILE).items():
        assert res["bulk"] == 1 and res["spill_bytes"] == 0 and res["shared"] == 0, (arch, res)


def test_prefetch_does_nothing_off_the_gpu():
    from triton_kernels.prefetch import prefetch_l2

    w = torch.randn(33, 7)
    ops.prefetch_l2(w, w[:, 1:])  # the torch backend here: a no-op, whatever the layout
    prefetch_l2(w[:, 1:])  # the kernel's launcher skips CPU tensors
    ops.prefetch_l2()


@requires_gpu
def test_prefetch_changes_nothing_and_replays_in_a_graph():
    from triton_kernels.prefetch import prefetch_l2

    tensors = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (1, 8, 2049, 7168 * 1024 + 3)]
    before = [t.clone() for t in tensors]
    prefetch_l2(*tensors)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        prefetch_l2(*tensors)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


@requires_gpu
def test_prefetch_refuses_strided_or_unaligned_tensors():
    from triton_kernels.prefetch import prefetch_l2

    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous, 16-byte aligned"):
        prefetch_l2(w[:, 1:])
    with pytest.raises(ValueError, match="contiguous, 16-byte aligned"):
        prefetch_l2(w.view(-1)[1:])
