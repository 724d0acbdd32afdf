import torch
import torch.nn.functional as F

from ops._backend import dispatch, register


def linear(x, weight):
    """A dense projection without bias: y = x @ weight^T, fp32 accumulation (F.linear without the bias).

    x: [..., K]; weight: [N, K]. Returns [..., N] in x's dtype. On a GPU the Triton backend (the default) runs
    the skinny GEMM only at the shapes and row counts where it was measured faster than cuBLAS
    (`triton_kernels.linear.ADOPTED`), cuBLAS elsewhere; `use(linear="torch")` forces cuBLAS everywhere.
    """
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit [..., K], [N, K]")
    rows = x.reshape(-1, x.shape[-1])
    return dispatch("linear", x.device, x.dtype)(rows, weight).view(*x.shape[:-1], weight.shape[0])


def linear_torch(x, weight):
    return F.linear(x, weight)


register("linear", linear_torch, "triton_kernels.linear:linear", triton_dtypes=(torch.float16, torch.bfloat16))
