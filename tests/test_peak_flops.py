"""MFU was computed against one constant (the H200's measured matmul rate) whatever GPU ran it."""

from __future__ import annotations

import pytest
import torch

from recipes.plan.peak_flops import PeakRates, spec_peak
from tests.train_runner import metrics, run_train


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0),
                                        ("NVIDIA B200", 2250.0), ("NVIDIA A100-SXM4-80GB", None)])
def test_spec_peak_by_device_name(name: str, peak: float | None) -> None:
    assert spec_peak(name) == peak


def test_both_mfu_figures_on_an_h200_the_spec_one_elsewhere_and_the_override_wins() -> None:
    scalars, text = PeakRates.for_device("NVIDIA H200").report(494.5)
    assert scalars == {"mfu": 494.5 / 989.0, "mfu_matmul": 494.5 / 756.0}
    assert text == " | MFU 50.0% of 989 spec, 65.4% of 756 matmul"
    assert PeakRates.for_device("NVIDIA B200").report(1125.0)[0] == {"mfu": 0.5}
    assert PeakRates.for_device("NVIDIA A100-SXM4-80GB").report(100.0) == ({}, "")
    assert PeakRates.for_device("NVIDIA A100-SXM4-80GB", 312.0).report(156.0)[0] == {"mfu": 0.5}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_on_a_gpu_logs_the_spec_mfu(tmp_path) -> None:
    run_train(tmp_path, "mfu", ["model=glm5_tiny", "precision=bf16", "train.steps=2", "logging.mode=disabled",
                                "train.save_final=false", "train.peak_tflops=1000"])
    rows = [r for r in metrics(tmp_path / "mfu") if "loss" in r]  # step rows (drift rows hold dsa/*)
    assert len(rows) == 2
    assert all(abs(r["mfu"] - r["tflops_per_gpu"] / 1000.0) < 1e-12 for r in rows)


def test_a_gpu_step_logs_model_tflops_per_gpu_beside_both_mfu_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step record of a CUDA run (faked here: world size 2, no GPU touched) carries the model
    TFLOP/s per GPU as its own key, ``mfu`` against the spec peak and ``mfu_matmul`` against the
    measured matmul rate, each under ``throughput/`` in wandb, and the console names both peaks.
    The FLOP model is 1e12 FLOP per token and 2,000 tokens in 0.5 s: 4e3 tokens/s, so 4e15 FLOP/s
    over 2 GPUs = 2,000 TFLOP/s per GPU (exact in binary floating point)."""
    from types import SimpleNamespace

    from recipes import loop
    from recipes.observe.metrics import wandb_key

    logged: list[tuple[int, dict[str, float], str]] = []
    logger = SimpleNamespace(log=lambda step, scalars, console: logged.append((step, scalars, console)))
    trainer = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]))
    flops = SimpleNamespace(per_token=lambda seq_length: 1e12)
    monkeypatch.setattr(loop, "peak_memory_gib", lambda device: 1.0)
    monkeypatch.setattr(loop.dist, "get_world_size", lambda: 2)
    loop._log_step(logger, 3, 2.5, 1.0, trainer, step_time=0.5, seq_length=16, tokens_per_step=2000,
                   flops=flops, peaks=PeakRates(spec=4000.0, matmul=2500.0), device=torch.device("cuda"),
                   total_steps=10, extra={}, timing="")
    (step, scalars, console), = logged
    assert step == 3 and scalars["tflops_per_gpu"] == 2000.0
    assert scalars["mfu"] == 0.5 and scalars["mfu_matmul"] == 0.8
    assert " | 2000 TFLOP/s/GPU | MFU 50.0% of 4000 spec, 80.0% of 2500 matmul | " in console
    assert [wandb_key(k) for k in ("tflops_per_gpu", "mfu", "mfu_matmul")] == [
        "throughput/tflops_per_gpu", "throughput/mfu", "throughput/mfu_matmul"]
