"""SIMULATED hardware: accelerator profiles used by rollart's cost models.

Nothing here touches a real device. Each profile gives the peak numbers a roofline cost model
needs; achieved fractions (MFU, bandwidth efficiency) live in ``rollart.sim.costs``, except a
bandwidth share measured for one GPU, which its profile carries (the H20's, below).

Sources (dense, i.e. without 2:4 sparsity; SXM parts):

- H100 SXM5 80 GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, 80 GB (NVIDIA H100 Tensor Core GPU
  datasheet, "BF16 Tensor Core 1,979 TFLOPS*" with *sparsity, i.e. 989 dense).
- H800 SXM5 80 GB: the export variant of H100 with the same SMs and HBM3 and cut NVLink
  (400 GB/s); 989 TFLOP/s, 3.35 TB/s (NVIDIA H800 datasheet; the RollArt paper §2 uses these).
- H20 96 GB: 148 TFLOP/s bf16 dense, 4.0 TB/s HBM3, 96 GB (NVIDIA HGX H20 product brief; RollArt
  paper §2: "~148 TFLOP/s, 4.0 TB/s"). A memory-bound decode step reaches 0.34 of that
  bandwidth, MEASURED (``H20_DECODE_BW_EFFICIENCY``), not the 0.7 assumed for other GPUs.
- H200 SXM 141 GB: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, 141 GB (NVIDIA H200 datasheet).
- ``cpu``: this development machine's class, 2 vCPUs of an AMD EPYC Zen 4 with AVX512-BF16.
  Estimate: 2 cores x 3.0 GHz x 64 bf16 FLOP/cycle (two 256-bit FMA pipes running VDPBF16PS)
  = 0.384 TFLOP/s peak; ~20 GB/s of DRAM bandwidth for a 2-vCPU share of a socket; 8 GiB.

Relative cost (for equal-cost pools): H800 = 1.0 by definition. H20 = 1/3, derived from the
paper's equal-cost pools (64 H800 + 24 H20 costs the same as 72 H800, so 24 H20 = 8 H800).
H100 = 1.0 (same silicon as H800). H200 = 1.25 (assumption: list prices ~25% above H100).
CPU = 0.01 (assumption; only used for env pools, never compared to GPUs).

``link_bytes_per_s``: one node's cross-cluster NIC, 200 Gb Ethernet = 25e9 B/s line rate (RollArt
§7.1: "400 Gb InfiniBand inside a cluster, 200 Gb Ethernet across clusters"; protocol overhead
ignored). It is NOT backed out of the paper's Table 4 naive times (that would make the weight-sync
benchmark circular). ``h2d_bytes_per_s`` is host-to-device copy over PCIe Gen5 x16 (64 GB/s
raw; ~25 GB/s achieved with pinned memory is the usual measured figure, e.g. NVIDIA
``nvbandwidth`` / ``bandwidthTest`` results on Hopper hosts), used for applying weights that
are already staged in host memory.

``nvlink_bytes_per_s``: per-direction NVLink bandwidth one GPU has to its peers, which bounds a
ring all-reduce between the tensor-parallel ranks of an engine. H800: 400 GB/s total
bidirectional (NVIDIA H800 datasheet) = 200 GB/s per direction. H100 / H200 SXM: 900 GB/s total
= 450 GB/s per direction (datasheets). H20: 900 GB/s NVLink (HGX H20 product brief) = 450 GB/s
per direction. ``allreduce_latency_s``: fixed cost of one NCCL all-reduce launch, 10 us
(ASSUMPTION: the order of nccl-tests' small-message all-reduce latency on one NVLink node).
"""

from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class HardwareProfile:
    """Peak capabilities of one accelerator (SIMULATED; see module docstring for sources).

    Attributes:
        name: label used in pools and outputs (``"h800"``).
        flops: dense bf16 FLOP/s.
        hbm_bytes_per_s: memory bandwidth in bytes/s.
        memory_bytes: device memory in bytes.
        relative_cost: price relative to one H800 (equal-cost pool sizing).
        link_bytes_per_s: cross-cluster weight-transfer bandwidth in bytes/s.
        h2d_bytes_per_s: host-to-device copy bandwidth in bytes/s.
        nvlink_bytes_per_s: per-direction GPU-to-GPU bandwidth in bytes/s (TP all-reduce).
        allreduce_latency_s: fixed seconds per all-reduce call.
        bw_efficiency: share of ``hbm_bytes_per_s`` this GPU reaches when a step is
            memory-bound, where it was measured for this GPU (the H20:
            ``H20_DECODE_BW_EFFICIENCY``); ``None`` (the other built-in profiles): the
            engine's ``costs.Efficiency.bw_efficiency``.
    """

    name: str
    flops: float
    hbm_bytes_per_s: float
    memory_bytes: float
    relative_cost: float
    link_bytes_per_s: float = 25 * GIGA
    h2d_bytes_per_s: float = 25 * GIGA
    nvlink_bytes_per_s: float = 450 * GIGA
    allreduce_latency_s: float = 10e-6
    bw_efficiency: float | None = None

    def __post_init__(self) -> None:
        for field in ("flops", "hbm_bytes_per_s", "memory_bytes", "relative_cost",
                      "link_bytes_per_s", "h2d_bytes_per_s", "nvlink_bytes_per_s",
                      "allreduce_latency_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"HardwareProfile {self.name!r}: {field} must be > 0, "
                                 f"got {getattr(self, field)!r}")
        if self.bw_efficiency is not None and not 0.0 < self.bw_efficiency <= 1.0:
            raise ValueError(f"HardwareProfile {self.name!r}: bw_efficiency must be in (0, 1] "
                             f"or None, got {self.bw_efficiency!r}")


H800 = HardwareProfile("h800", 989 * TERA, 3.35 * TERA, 80 * GIGA, 1.0,
                       nvlink_bytes_per_s=200 * GIGA)
#: Share of the H20's peak HBM bandwidth (4.0 TB/s) a decode step reaches, MEASURED: Qwen
#: documentation, "Speed Benchmark" / 效率评估
#: (https://qwen.readthedocs.io/zh-cn/latest/getting_started/speed_benchmark.html), Qwen3-8B and
#: Qwen3-32B, BF16, one H20 96GB, SGLang 0.4.6.post1, batch size 1, input length 1, 2048
#: generated tokens (``calibration.QWEN_DOCS_H20_SGLANG_BS1``): Qwen3-8B generates them in
#: 2049 / 81.73 = 25.1 s, 12.2 ms per token for 16.4 GB of bf16 weights; Qwen3-32B in
#: 2049 / 20.72 = 98.9 s, 48.3 ms for 65.6 GB. Fitting step = bytes / B + layers x c to both
#: (36 and 64 layers) gives c ~ 8 us per layer and B ~ 1.37 TB/s: the time is achieved
#: bandwidth, not a per-step overhead; 1.37 / 4.0 = 0.34. Only the input-length-1 points are
#: used; the same page's 6k and 14k points are matched out of sample within 6%
#: (tests/unit/test_sim_serving_calibration.py). Batch 1 is the only published H20
#: measurement found; the paper's §3 decode-heavy ratio at 128 requests lands in its band with
#: it (tests/unit/test_sim_calibration.py), an independent indication at large batch.
H20_DECODE_BW_EFFICIENCY = 0.34

H20 = HardwareProfile("h20", 148 * TERA, 4.0 * TERA, 96 * GIGA, 1.0 / 3.0,
                      bw_efficiency=H20_DECODE_BW_EFFICIENCY)
H100 = HardwareProfile("h100", 989 * TERA, 3.35 * TERA, 80 * GIGA, 1.0)
H200 = HardwareProfile("h200", 989 * TERA, 4.8 * TERA, 141 * GIGA, 1.25)
CPU = HardwareProfile("cpu", 0.384 * TERA, 20 * GIGA, 8 * GIGA, 0.01,
                      link_bytes_per_s=1 * GIGA, h2d_bytes_per_s=20 * GIGA,
                      nvlink_bytes_per_s=20 * GIGA)

HARDWARE: dict[str, HardwareProfile] = {p.name: p for p in (H800, H20, H100, H200, CPU)}


def get_hardware(name: str) -> HardwareProfile:
    """The profile called ``name`` (case-insensitive). Raises ``KeyError`` naming the choices."""
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise KeyError(f"unknown hardware {name!r}; known: {sorted(HARDWARE)}") from None


def equal_cost_count(budget: float, hardware: HardwareProfile) -> int:
    """How many whole ``hardware`` devices a ``budget`` (in H800 units) buys (floor)."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    # The epsilon keeps 24 * (1/3) == 8.0 from flooring to 7 through float rounding.
    return int(budget / hardware.relative_cost + 1e-9)
