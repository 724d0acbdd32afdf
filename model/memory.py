"""Free memory per device, and one refusal for an allocation that cannot fit, made before it is tried (a CPU
allocation past what is free is not refused by the allocator: touching it summons the OOM killer)."""

import os

import torch


class OutOfMemory(MemoryError):
    """An allocation larger than what the device has free; the message gives both sizes."""


def size_text(nbytes):
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def free_bytes(device):
    """Bytes an allocation on `device` can still get (CUDA: free plus what torch holds unused; CPU: the kernel's
    MemAvailable), or None where that is unknown (meta)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_fits(what, nbytes, device):
    """Raise OutOfMemory naming `what` and both sizes if `nbytes` more do not fit on `device`."""
    free = free_bytes(device)
    if free is not None and nbytes > free:
        raise OutOfMemory(f"out of memory: {what} needs {size_text(nbytes)} on {torch.device(device)}, "
                          f"{size_text(free)} free")


def tensor_bytes(shape, dtype):
    n = dtype.itemsize
    for dim in shape:
        n *= dim
    return n
