"""Accelerators remat can plan for without having them: peak rates, memory, host link.

Numbers are the vendors' datasheet figures (dense, no sparsity); ``ROOFLINE_EFFICIENCY`` scales them
to what kernels reach in practice. Sources are given per entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from remat.errors import InvalidValue, close_matches

__all__ = ["DEVICES", "DeviceSpec", "get_device"]

#: Share of the datasheet peak that real kernels sustain. Large GEMMs reach 60-80% of tensor-core
#: peak; streaming kernels 80-90% of HBM bandwidth. One conservative figure each, applied to every
#: device, so that estimates err on the slow side.
ROOFLINE_EFFICIENCY = {"flops": 0.6, "bandwidth": 0.8, "host_link": 0.8}


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """A device for estimated mode."""

    name: str
    """Short name, e.g. ``"h100"``."""
    memory_bytes: int
    """Device memory, bytes."""
    flops: dict[str, float] = field(default_factory=dict)
    """Datasheet peak FLOP/s per dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``), dense."""
    bandwidth_bytes_per_s: float
    """Device memory bandwidth, bytes/s."""
    host_link_bytes_per_s: float
    """Host link bandwidth in one direction (PCIe or NVLink-C2C), bytes/s."""
    kernel_overhead_us: float = 4.0
    """Launch overhead per kernel, microseconds."""
    kernel_scratch: dict[tuple[str, int], int] = field(default_factory=dict, compare=False, repr=False)
    """What the device's kernels allocate beyond their tensors, per op and the bytes it made, as a real
    step measured it (NOTE [ What each kernel allocates ] in remat.measure.tracer); empty where no
    real step ran. Fake steps under this spec peak by as much more at each such op."""

    def peak_flops(self, dtype: str) -> float:
        if dtype in self.flops:
            return self.flops[dtype]
        # A dtype without a tensor-core rate (e.g. bf16 on a T4) runs at the fp32 rate.
        return self.flops["float32"]


_T = 1e12
_GB = 1e9
_GiB = 2**30

DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA H100 SXM5 datasheet: BF16/FP16 989 TFLOPS dense, FP32 67 TFLOPS, HBM3 3.35 TB/s, 80 GB;
    # host link PCIe Gen5 x16 64 GB/s per direction.
    "h100": DeviceSpec(
        name="h100",
        memory_bytes=80 * _GiB,
        flops={"bfloat16": 989 * _T, "float16": 989 * _T, "float32": 67 * _T},
        bandwidth_bytes_per_s=3350 * _GB,
        host_link_bytes_per_s=64 * _GB,
    ),
    # NVIDIA H200 SXM datasheet: same compute as H100 SXM, HBM3e 4.8 TB/s, 141 GB.
    "h200": DeviceSpec(
        name="h200",
        memory_bytes=141 * 10**9,
        flops={"bfloat16": 989 * _T, "float16": 989 * _T, "float32": 67 * _T},
        bandwidth_bytes_per_s=4800 * _GB,
        host_link_bytes_per_s=64 * _GB,
    ),
    # NVIDIA A100 datasheet: BF16 312 TFLOPS dense, FP32 19.5 TFLOPS; 80GB SXM HBM2e 2039 GB/s;
    # 40GB 1555 GB/s; PCIe Gen4 x16 32 GB/s per direction.
    "a100-80gb": DeviceSpec(
        name="a100-80gb",
        memory_bytes=80 * _GiB,
        flops={"bfloat16": 312 * _T, "float16": 312 * _T, "float32": 19.5 * _T},
        bandwidth_bytes_per_s=2039 * _GB,
        host_link_bytes_per_s=32 * _GB,
    ),
    "a100-40gb": DeviceSpec(
        name="a100-40gb",
        memory_bytes=40 * _GiB,
        flops={"bfloat16": 312 * _T, "float16": 312 * _T, "float32": 19.5 * _T},
        bandwidth_bytes_per_s=1555 * _GB,
        host_link_bytes_per_s=32 * _GB,
    ),
    # NVIDIA L4 datasheet: BF16 121 TFLOPS dense (242 with sparsity), FP32 30.3 TFLOPS,
    # GDDR6 300 GB/s, 24 GB, PCIe Gen4 x16.
    "l4": DeviceSpec(
        name="l4",
        memory_bytes=24 * _GiB,
        flops={"bfloat16": 121 * _T, "float16": 121 * _T, "float32": 30.3 * _T},
        bandwidth_bytes_per_s=300 * _GB,
        host_link_bytes_per_s=32 * _GB,
    ),
    # GeForce RTX 4090 (Ada whitepaper): FP16/BF16 tensor with FP32 accumulate 165 TFLOPS dense,
    # FP32 82.6 TFLOPS, GDDR6X 1008 GB/s, 24 GB, PCIe Gen4 x16.
    "rtx4090": DeviceSpec(
        name="rtx4090",
        memory_bytes=24 * _GiB,
        flops={"bfloat16": 165 * _T, "float16": 165 * _T, "float32": 82.6 * _T},
        bandwidth_bytes_per_s=1008 * _GB,
        host_link_bytes_per_s=32 * _GB,
    ),
    # GeForce RTX 3090 (Ampere GA102 whitepaper): FP16/BF16 tensor with FP32 accumulate 71 TFLOPS,
    # FP32 35.6 TFLOPS, GDDR6X 936 GB/s, 24 GB, PCIe Gen4 x16.
    "rtx3090": DeviceSpec(
        name="rtx3090",
        memory_bytes=24 * _GiB,
        flops={"bfloat16": 71 * _T, "float16": 71 * _T, "float32": 35.6 * _T},
        bandwidth_bytes_per_s=936 * _GB,
        host_link_bytes_per_s=32 * _GB,
    ),
    # NVIDIA T4 datasheet: FP16 65 TFLOPS (no BF16 tensor cores), FP32 8.1 TFLOPS, GDDR6 320 GB/s,
    # 16 GB, PCIe Gen3 x16 16 GB/s.
    "t4": DeviceSpec(
        name="t4",
        memory_bytes=16 * _GiB,
        flops={"float16": 65 * _T, "float32": 8.1 * _T},
        bandwidth_bytes_per_s=320 * _GB,
        host_link_bytes_per_s=16 * _GB,
    ),
    # This kind of machine: 2 CPU cores, AVX-512-class FMA at ~3 GHz (~100 GFLOP/s fp32), ~20 GB/s
    # of DRAM bandwidth for one process. Used to check estimated mode against measured mode.
    "cpu": DeviceSpec(
        name="cpu",
        memory_bytes=24 * _GiB,
        flops={"float32": 100e9, "bfloat16": 50e9},
        bandwidth_bytes_per_s=20 * _GB,
        host_link_bytes_per_s=20 * _GB,
        kernel_overhead_us=10.0,
    ),
}


def get_device(device: str | DeviceSpec) -> DeviceSpec:
    """A spec by name (``"h100"``, ``"rtx4090"``, ...) or a ``DeviceSpec`` given as is."""
    if isinstance(device, DeviceSpec):
        return device
    key = device.lower().replace("_", "-")
    if key in DEVICES:
        return DEVICES[key]
    close = close_matches(key, DEVICES, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise InvalidValue(
        f"unknown device {device!r}: expected one of {', '.join(DEVICES)}, or a "
        f"remat.devices.DeviceSpec for another.{hint}"
    )
