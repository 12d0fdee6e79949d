"""Dense bf16 tensor-core peaks of known GPUs, for model FLOPs utilisation (MFU).

Figures are TFLOP/s without 2:4 sparsity, from NVIDIA's datasheets (which print the sparse figure,
twice these): A100 312, H100 SXM 989 (PCIe 756), H200 SXM 989 (NVL 835), B200 (HGX, 1000 W)
2250. A device matches the first entry whose key occurs in ``torch.cuda.get_device_name()``; the
more specific keys come first because "H100 PCIe" also contains "H100".
"""

from __future__ import annotations

BF16_DENSE_TFLOPS: tuple[tuple[str, float], ...] = (
    ("A100", 312.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("B200", 2250.0),
)


def bf16_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU called ``device_name``, or None when it is not listed."""
    for key, tflops in BF16_DENSE_TFLOPS:
        if key in device_name:
            return tflops
    return None


def mfu(achieved_tflops: float, device_name: str) -> float | None:
    """``achieved_tflops`` over the device's peak; None for a device not in the table (or CPU)."""
    peak = bf16_peak_tflops(device_name)
    return None if peak is None else achieved_tflops / peak
