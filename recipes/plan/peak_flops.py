"""MFU against the GPU's spec peak (what most tools report), beside the measured matmul rate.

``mfu`` = model TFLOP/s per GPU / the device's dense BF16 tensor-core peak from NVIDIA's data
sheets (the "with sparsity" figures halved): H100 SXM and H200 989, H100 PCIe 756, H100 NVL and
H200 NVL 835, B200 2250 TFLOP/s. The device is matched by name (``torch.cuda.get_device_name``,
the most specific entry first); ``train.peak_tflops`` overrides the table (and is needed for a GPU
not in it, else ``mfu`` is not reported). ``mfu_matmul`` = the same TFLOP/s / the dense BF16
matmul rate measured on an H200 (:data:`recipes.observe.metrics.H200_BF16_TFLOPS`, 756), only on an H200:
it says how close the step comes to what the GPU's GEMMs reach in practice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes.observe.metrics import H200_BF16_TFLOPS

SPEC_DENSE_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("B200", 2250.0),
)
"""(name fragment, dense BF16 TFLOP/s), most specific first."""


def spec_peak(device_name: str) -> Optional[float]:
    """The table's peak for ``device_name`` (e.g. ``NVIDIA H200``), None for a GPU not in it."""
    return next((tflops for fragment, tflops in SPEC_DENSE_BF16_TFLOPS if fragment in device_name), None)


@dataclass(frozen=True)
class PeakRates:
    """The rates one GPU's MFU figures divide by (TFLOP/s; None: not reported)."""

    spec: Optional[float]
    matmul: Optional[float]

    @classmethod
    def for_device(cls, device_name: str, override: Optional[float] = None) -> PeakRates:
        """``override`` (``train.peak_tflops``) or the table's spec peak; the measured matmul rate
        on an H200 (not its NVL variant)."""
        spec = override if override is not None else spec_peak(device_name)
        h200 = "H200" in device_name and "NVL" not in device_name
        return cls(spec, H200_BF16_TFLOPS if h200 else None)

    def report(self, tflops: float) -> tuple[dict[str, float], str]:
        """The MFU scalars (``mfu``, ``mfu_matmul``) for ``tflops`` per GPU and their console text."""
        scalars, parts = {}, []
        if self.spec:
            scalars["mfu"] = tflops / self.spec
            parts.append(f"MFU {scalars['mfu']:.1%} of {self.spec:.0f} spec")
        if self.matmul:
            scalars["mfu_matmul"] = tflops / self.matmul
            parts.append(f"{scalars['mfu_matmul']:.1%} of {self.matmul:.0f} matmul")
        return scalars, ("" if not parts else " | " + ", ".join(parts))
