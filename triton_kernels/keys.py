"""Order-preserving integer keys of floats, shared by the kernels that select by value (DDTree's top-k and tree
build, the router's top-k): a float's int32 bits b become ordered as the floats with b < 0 ? b ^ 0x7FFFFFFF : b."""

import triton
import triton.language as tl


@triton.jit
def ordered(x):
    """fp32 -> int32 with the same order; -0.0 maps to +0.0."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def unordered(o):
    """The inverse of `ordered` (-0.0 comes back as +0.0)."""
    bits = tl.where(o < 0, o ^ 0x7FFFFFFF, o)
    return bits.to(tl.float32, bitcast=True)
