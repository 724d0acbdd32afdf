"""Small input checks shared by the public ops: one clear ValueError naming the argument."""


def check_dims(name, tensor, ndim):
    if tensor.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(tensor.shape)}")


def check_dtype(name, tensor, *dtypes):
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {dtypes}, got {tensor.dtype}")
