"""The dense peak FLOP/s table (dualtrack/gpu_peaks.py): NVML's names, the datasheets' dense figures,
and rules/gpu_peaks.yml generated from it."""
from __future__ import annotations

import yaml

from dualtrack import gpu_peaks
from exporter.simulated import DeviceTraits
from tests.support.paths import REPO
from trainer_hook.contract import PRECISIONS

#: What nvmlDeviceGetName returns on the boards the table must know (nvidia-smi --query-gpu=name).
NVML_NAMES = ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB",
              "NVIDIA A100 80GB PCIe", "NVIDIA A800-SXM4-80GB", "NVIDIA A800 80GB PCIe",
              "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H800", "NVIDIA H800 PCIe",
              "NVIDIA H20", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA L40S",
              "NVIDIA B200", "NVIDIA GB200")


def test_every_board_nvml_names_has_its_dense_peaks_at_each_training_precision():
    for name in NVML_NAMES:
        for precision in ("bf16", "fp16", "tf32", "fp32"):
            assert gpu_peaks.peak(name, precision), (name, precision)
    assert {p for _, peaks in gpu_peaks.PEAKS.values() for p in peaks} <= set(PRECISIONS)


def test_the_figures_are_the_datasheets_dense_ones():
    """Datasheets print tensor-core figures with 2:4 sparsity; dense is half (fp32: CUDA cores)."""
    with_sparsity = {("NVIDIA H100 80GB HBM3", "bf16"): 1979e12, ("NVIDIA H100 80GB HBM3", "tf32"): 989e12,
                     ("NVIDIA H100 PCIe", "bf16"): 1513e12, ("NVIDIA H200", "fp8"): 3958e12,
                     ("NVIDIA A100-SXM4-80GB", "bf16"): 624e12, ("NVIDIA L40S", "fp16"): 733e12,
                     ("NVIDIA B200", "bf16"): 4500e12,
                     # H100/H200 datasheets' NVL columns: TF32 835, BF16 1,671, FP8 3,341 with sparsity
                     ("NVIDIA H100 NVL", "bf16"): 1671e12, ("NVIDIA H200 NVL", "tf32"): 835e12,
                     ("NVIDIA H200 NVL", "fp8"): 3341e12,
                     # GH200 datasheet and H800 SXM datasheet: the H100 SXM figures
                     ("NVIDIA GH200 480GB", "bf16"): 1979e12, ("NVIDIA H800", "fp8"): 3958e12,
                     ("NVIDIA H800 PCIe", "bf16"): 1513e12, ("NVIDIA A800-SXM4-80GB", "tf32"): 312e12,
                     # HGX B200: TF32 18 PFLOPS for 8 GPUs; GB200 NVL72: BF16 10 PFLOPS per 2-GPU superchip
                     ("NVIDIA B200", "tf32"): 2250e12, ("NVIDIA GB200", "bf16"): 5000e12,
                     ("NVIDIA GB200", "fp8"): 10000e12, ("NVIDIA H20", "bf16"): 296e12}
    for (name, precision), sparse in with_sparsity.items():
        assert abs(gpu_peaks.peak(name, precision) - sparse / 2) <= 0.01 * sparse, (name, precision)
    assert gpu_peaks.peak("NVIDIA H100 80GB HBM3", "fp32") == 67e12
    assert gpu_peaks.peak("NVIDIA B200", "tf32") == 1125e12  # 18 PFLOPS / 8 GPUs / 2, exactly
    assert gpu_peaks.peak("NVIDIA H100 NVL", "fp32") == 60e12
    assert gpu_peaks.peak("NVIDIA A100-SXM4-80GB", "fp8") is None  # Ampere has no fp8 tensor cores


def test_unknown_models_have_no_peak():
    for name in ("NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", "NVIDIA H100", "NVIDIA GH200",
                 "nvidia h100 80gb hbm3", "NVIDIA H100 NVL ", ""):
        assert gpu_peaks.peak(name, "bf16") is None, name


def test_the_simulated_gpu_is_a_known_model():
    """The demo's fake GPU names itself as a real H100 does, so the demo has an MFU."""
    assert gpu_peaks.peak(DeviceTraits().name, "bf16") == 989.5e12


def test_rules_file_is_generated_from_the_table():
    generated = REPO / "rules" / "gpu_peaks.yml"
    assert generated.read_text() == gpu_peaks.render(), "run: python -m dualtrack.gpu_peaks > rules/gpu_peaks.yml"
    rules = yaml.safe_load(generated.read_text())["groups"][0]["rules"]
    table = {(rule["labels"]["name"], rule["labels"]["precision"]): float(rule["expr"][len("vector("):-1])
             for rule in rules}
    assert table == {(name, precision): flops for name, (_, peaks) in gpu_peaks.PEAKS.items()
                     for precision, flops in peaks.items()}
