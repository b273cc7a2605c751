"""``--gpu NAME``: the memory common data-centre GPUs really expose to vLLM.

vLLM budgets ``total x --gpu-memory-utilization``, where ``total`` is what
``torch.cuda.mem_get_info()`` reports: the card's memory less what the driver keeps (ECC, the
CUDA context's reservation), about 0.5 to 1 GiB below ``nvidia-smi``'s figure and further below
the marketing one. An "H100 80GB" exposes about 79.1 GiB, not 80 and not 74.5 (80 GB in GiB).

Each value is the lowest commonly reported in vLLM's start-up log ("the current vLLM instance
can use total_gpu_memory (X GiB) x gpu_memory_utilization ...") and PyTorch's out-of-memory
message ("GPU 0 has a total capacity of X GiB") in public issue reports; readings vary by
0.1 to 0.3 GiB with the driver and ECC. For a card not listed, or the exact figure, pass
``--gpu-memory-gib``: ``python -c "import torch; print(torch.cuda.mem_get_info()[1] / 2**30)"``.

Example::

    >>> find_gpu("h100 80gb").name, find_gpu("H100-SXM").memory_gib
    ('H100-80GB', 79.11)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtax.errors import PlanError

__all__ = ["GPUS", "Gpu", "find_gpu"]


@dataclass(frozen=True, slots=True)
class Gpu:
    """One preset: its name, the GiB CUDA reports as total, and the other spellings it takes."""

    name: str
    memory_gib: float
    description: str
    aliases: tuple[str, ...] = ()


GPUS: tuple[Gpu, ...] = (
    Gpu("H100-80GB", 79.11, "NVIDIA H100 SXM 80GB HBM3", ("h100", "h100sxm", "h100sxm80gb")),
    Gpu("H100-PCIE", 79.11, "NVIDIA H100 PCIe 80GB HBM2e", ("h100pcie80gb",)),
    Gpu("H200", 139.81, "NVIDIA H200 141GB HBM3e", ("h200141gb", "h200sxm")),
    Gpu("B200", 178.35, "NVIDIA B200 180GB HBM3e", ("b200180gb", "b200192gb")),
    Gpu("A100-80GB", 79.15, "NVIDIA A100 80GB (SXM or PCIe)", ("a100sxm80gb", "a100pcie80gb")),
    Gpu("A100-40GB", 39.39, "NVIDIA A100 40GB (SXM or PCIe)", ("a100", "a100sxm40gb")),
    Gpu("L40S", 44.31, "NVIDIA L40S 48GB GDDR6", ("l40s48gb",)),
    Gpu("L4", 22.03, "NVIDIA L4 24GB GDDR6", ("l424gb",)),
    Gpu("A10G", 22.05, "NVIDIA A10G 24GB GDDR6 (AWS g5)", ("a10g24gb", "a10", "a1024gb")),
    Gpu("MI300X", 191.45, "AMD Instinct MI300X 192GB HBM3", ("mi300x192gb",)),
)


def _key(name: str) -> str:
    """A spelling reduced to letters and digits: "H100 80GB", "h100-80gb" and "H100_80GB" meet."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_KEY = {_key(k): gpu for gpu in GPUS for k in (gpu.name, *gpu.aliases)}


def find_gpu(name: str) -> Gpu:
    """The preset ``name`` spells; a :class:`PlanError` on ``--gpu`` listing the known names."""
    gpu = _BY_KEY.get(_key(name[:100]))
    if gpu is None:
        shown = name if len(name) <= 40 else name[:37] + "..."
        known = ", ".join(g.name for g in GPUS)
        raise PlanError(
            "--gpu",
            f"unknown GPU {shown!r} (known: {known}; for another, give --gpu-memory-gib)",
        )
    return gpu
