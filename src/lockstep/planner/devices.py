"""The devices the planner knows: GPU kinds from vendor datasheets, and this machine's CPU cores.

GPU figures are the datasheets' dense (no-sparsity) bf16 tensor-core FLOP/s, HBM capacity and
bandwidth, NVLink bandwidth per direction (half the quoted bidirectional total) and the NIC per GPU
of the reference server (DGX A100: 8 x HDR 200 Gb/s; DGX H100/H200: 8 x NDR 400 Gb/s):
- A100: NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/
  a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): 312 TFLOPS bf16; 40 GB HBM2 at
  1,555 GB/s or 80 GB HBM2e at 2,039 GB/s (SXM); NVLink 600 GB/s.
- H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (resources.nvidia.com/en-us-tensor-core/
  nvidia-tensor-core-gpu-datasheet): 1,979 TFLOPS bf16 "with sparsity", so 989 dense; 80 GB HBM3
  at 3.35 TB/s; NVLink 900 GB/s.
- H200 SXM: NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): the same
  989 dense bf16 TFLOPS; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
"""

from __future__ import annotations

from lockstep.planner.types import GIB, Cluster, Device, PlanRefused

GB = 1e9

GPUS: dict[str, Device] = {
    "A100-40G": Device("A100-40G", "gpu", flops=312e12, memory=40 * GIB, memory_bw=1555 * GB, link_bw=300 * GB,
                       network_bw=25 * GB, source="NVIDIA A100 datasheet (SXM4 40GB)"),
    "A100-80G": Device("A100-80G", "gpu", flops=312e12, memory=80 * GIB, memory_bw=2039 * GB, link_bw=300 * GB,
                       network_bw=25 * GB, source="NVIDIA A100 datasheet (SXM4 80GB)"),
    "H100-SXM": Device("H100-SXM", "gpu", flops=989e12, memory=80 * GIB, memory_bw=3350 * GB, link_bw=450 * GB,
                       network_bw=50 * GB, source="NVIDIA H100 datasheet (SXM5)"),
    "H200": Device("H200", "gpu", flops=989e12, memory=141 * GB, memory_bw=4800 * GB, link_bw=450 * GB,
                   network_bw=50 * GB, source="NVIDIA H200 datasheet (SXM)"),
}
"""GPU kinds by name; `--gpus KIND:COUNT` picks one."""


def gpu(kind: str) -> Device:
    key = {k.lower(): k for k in GPUS}.get(kind.strip().lower())
    if key is None:
        raise PlanRefused("devices", f"unknown GPU kind {kind!r}; known kinds: {', '.join(GPUS)}")
    return GPUS[key]


def parse_gpus(text: str) -> Cluster:
    """`KIND:COUNT`, e.g. `H100-SXM:16`."""
    kind, sep, count = text.rpartition(":")
    if not sep or not count.strip().lstrip("-").isdigit():
        raise PlanRefused("devices", f"--gpus expects KIND:COUNT (e.g. H100-SXM:8), got {text!r}; "
                                     f"known kinds: {', '.join(GPUS)}")
    return Cluster(gpu(kind), int(count))
