"""What a run or a benchmark ran on: the CPU model and its bf16 support, the cores, the GPU.

Speeds differ between machines, and the bf16 gain with them (AMX tiles give more than
AVX-512 BF16 instructions, and emulated bf16 is slower than float32), so every figure needs
its machine beside it: meta.json records describe(), and bench's reports print it.
"""

import os
import platform


def cpu_description(cpuinfo):
    """(model name, its bf16 support) from the text of /proc/cpuinfo. bf16 matmuls run on AMX
    tiles (Intel Sapphire Rapids and later) or AVX-512 BF16 instructions, or are emulated."""
    model, flags = "unknown", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    found = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"))
             if flag in flags]
    return model, ", ".join(found) if found else "none (emulated)"


def has_native_bf16(cpu_bf16):
    """Whether cpu_description's bf16 support names instructions, not emulation."""
    return "AMX" in cpu_bf16 or "AVX-512 BF16" in cpu_bf16


def this_cpu():
    """cpu_description of this machine (the platform's processor name where there is no
    /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_description(f.read())
    except OSError:
        return platform.processor() or "unknown", "unknown (no /proc/cpuinfo)"


def cores():
    """The cores this process may run on (a container or taskset may allow fewer than the
    machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def gpu_description(device):
    """The GPU's name and CUDA version for a CUDA device; None for any other. Asks only
    when the run uses the GPU, so a CPU run never starts CUDA. (torch is imported here, so
    that beast.flags can ask for the cores without it.)"""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"


def describe(device="cpu"):
    """The machine as meta.json records it; device is the learner's."""
    cpu, bf16 = this_cpu()
    return {"cpu": cpu, "cpu_bf16": bf16, "cores": cores(), "gpu": gpu_description(device)}


# A CUDA learner with at least this many cores is a GPU machine: its runs take the layout of
# docs/performance.md "What changes with the machine" for a GPU machine instead of the
# laptop's, which leaves such a machine's cores and GPU mostly idle.
GPU_MACHINE_MIN_CORES = 8


def is_gpu_machine(device_type, num_cores=None):
    """Whether a run whose learner is on device_type ("cuda", "cpu") takes the GPU
    machine's layout; num_cores: cores() when None."""
    return device_type == "cuda" and (num_cores or cores()) >= GPU_MACHINE_MIN_CORES
