"""The per-op backend table: which implementation (torch reference or Triton kernel) each op runs.

Set it in code (`ops.use(moe="triton")`), from a spec string (`ops.use_spec("moe=triton,attention=torch")`,
what the CLI flag `--kernels` passes), or from the environment variable SPEC_KERNELS (same syntax, read at
import). An op without an explicit choice runs Triton when a CUDA device is present and the op has a kernel,
the torch reference otherwise. A SPEC_KERNELS value that does not parse does not break `import ops`: none of it
is applied, and every use of the table (an op's dispatch, `current`, `table`) raises ValueError saying why.
"""

import importlib
import os

import torch

BACKENDS = ("torch", "triton")
ENV_VAR = "SPEC_KERNELS"

_torch_impls: dict = {}
_triton_impls: dict = {}  # name -> "module:function", imported on first use
_choice: dict = {}
_follows: dict = {}  # companion function -> the op whose backend it follows (prepare_moe -> moe)
_triton_dtypes: dict = {}  # op -> the activation dtypes its kernel takes on a GPU (absent: any)
_env_problem = None  # why SPEC_KERNELS could not be applied, raised at use


def register(name, torch_impl, triton_impl=None, follows=None, triton_dtypes=None):
    """Declare op `name` with its torch reference and optionally its Triton launcher ("module:function").

    A companion (`follows="moe"`) has no switch of its own: it runs whatever backend its op runs.
    `triton_dtypes` limits the default choice of Triton to activations of those dtypes (an explicit choice
    still runs the kernel, which then raises its own clear error).
    """
    _torch_impls[name] = torch_impl
    if triton_impl is not None:
        _triton_impls[name] = triton_impl
    if follows is not None:
        _follows[name] = follows
    if triton_dtypes is not None:
        _triton_dtypes[name] = tuple(triton_dtypes)
    if _env_problem is not None:  # SPEC_KERNELS may name an op registered after `ops` was imported
        apply_env()


def op_names():
    return tuple(sorted(n for n in _torch_impls if n not in _follows))


def has_triton(name):
    return name in _triton_impls


def _triton_runnable():
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def use(**choices):
    """Choose backends per op, e.g. `use(moe="triton", attention="torch")`; `None` restores the default."""
    for name, backend in choices.items():
        if name not in op_names():
            raise ValueError(f"unknown op {name!r}; known ops: {', '.join(op_names())}")
        if backend is None:
            _choice.pop(name, None)
            continue
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} for op {name!r}; choose one of {BACKENDS}")
        if backend == "triton" and not has_triton(name):
            raise ValueError(f"op {name!r} has no Triton kernel; only 'torch' is available")
        _choice[name] = backend


def use_spec(spec):
    """Apply a spec string `op=backend,op=backend`; `all=triton` sets every op that has a kernel."""
    choices = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, backend = item.partition("=")
        if not sep:
            raise ValueError(f"bad kernel choice {item!r}: expected op=backend")
        name, backend = name.strip(), backend.strip()
        if name == "all":
            choices.update({n: backend for n in op_names() if backend == "torch" or has_triton(n)})
        else:
            choices[name] = backend
    use(**choices)


def current(name, device=None, dtype=None):
    """The backend op `name` runs now, for activations of `dtype` on `device` (None: this machine's default)."""
    if _env_problem is not None:
        raise ValueError(_env_problem)
    name = _follows.get(name, name)
    if name in _choice:
        return _choice[name]
    on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    dtype_ok = dtype is None or dtype in _triton_dtypes.get(name, (dtype,))
    return "triton" if has_triton(name) and on_gpu and dtype_ok else "torch"


def table(device=None):
    """{op: backend} for activations on `device` (None: this machine's default device)."""
    return {name: current(name, device) for name in op_names()}


def use_kernel_configs(path, device=None):
    """The tuned kernel configs in force (`triton_kernels.tuning`): `path` (a tuned file, "defaults" for the
    Python tables; None: SPEC_KERNEL_CONFIGS's or the package's file for the arch), loaded and checked now for the
    arch in force on `device`: ValueError naming the file and the key."""
    from triton_kernels import arch, tuning

    if path is not None:
        tuning.use(path)
    tuning.tables(arch.current(device))


def dispatch(name, device=None, dtype=None):
    """The callable implementing op `name` under the current backend, for activations of `dtype` on `device`."""
    if current(name, device, dtype) == "torch":
        return _torch_impls[name]
    if not _triton_runnable():
        raise RuntimeError(f"op {name!r} is set to triton but there is no CUDA device (and TRITON_INTERPRET!=1)")
    impl = _triton_impls[name]
    if isinstance(impl, str):
        module, _, attr = impl.partition(":")
        impl = getattr(importlib.import_module(module), attr)
        _triton_impls[name] = impl
    return impl


class using:
    """Context manager: `with ops.using(moe="triton"): ...` restores the previous choices on exit."""

    def __init__(self, **choices):
        self.choices = choices

    def __enter__(self):
        self.saved = dict(_choice)
        use(**self.choices)

    def __exit__(self, *exc):
        _choice.clear()
        _choice.update(self.saved)


def apply_env():
    """Apply SPEC_KERNELS, all of it or none: a value that does not parse is kept as the problem `current`
    raises (so `import ops` works and any use of an op says what is wrong)."""
    global _env_problem
    _env_problem, spec = None, os.environ.get(ENV_VAR)
    if not spec:
        return
    saved = dict(_choice)
    try:
        use_spec(spec)
    except ValueError as err:
        _choice.clear()
        _choice.update(saved)
        _env_problem = f"{ENV_VAR}={spec!r}: {err}"


def env_problem():
    """Why SPEC_KERNELS could not be applied, or None."""
    return _env_problem
