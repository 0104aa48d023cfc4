"""trainer_hook and the device: no CUDA initialisation, no sync on the training thread, GPU identity."""
from __future__ import annotations

import sys

import pytest
import torch

from exporter.simulated import DeviceTraits, SimulatedNVML
from tests.support.hook import SyncCounter, record_lines
from trainer_hook import TrainingMonitor, _torch


def monitor(tmp_path, **kwargs) -> TrainingMonitor:
    kwargs.setdefault("job", "device")
    kwargs.setdefault("run", "r1")
    kwargs.setdefault("pushgateway", False)
    kwargs.setdefault("record_path", tmp_path / "record.jsonl")
    return TrainingMonitor(**kwargs)


def test_cuda_ready_never_asks_the_driver_before_cuda_is_initialised(monkeypatch):
    """is_available() may initialise the driver (and poison fork for DataLoader workers)."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert _torch.cuda_ready() is False
    assert asked == []


def test_a_step_tensor_is_read_on_the_worker_not_the_training_thread(tmp_path):
    counter = SyncCounter()
    with monitor(tmp_path) as m:
        step = torch.tensor(5)
        with counter:
            m.log({"loss": torch.tensor(1.0)}, step=step)
            step += 1  # updated in place by the loop: the logged step stays 5
            m.log({"loss": 2.0})
            m.log({"loss": 3.0, "step": torch.tensor(9.0)})
            m.log({"loss": 4.0}, step=torch.tensor(float("nan")))  # counted as the next step
    assert counter.syncs == 0
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert [x["step"] for x in steps] == [5, 6, 9, 10]


def test_a_steps_tensors_are_copied_once_per_dtype_and_keep_their_logged_values(tmp_path):
    """One on-device copy (a stack) per (device, dtype) per log(), not one per tensor; in-place
    updates after log() do not change what was logged; dtypes are not mixed into one copy."""
    losses = {f"loss{i}": torch.tensor(float(i), requires_grad=True) * 2 for i in range(30)}
    counter = SyncCounter()
    with monitor(tmp_path) as m:
        with counter:
            m.log(losses, step=0)
        assert counter.syncs == 0
        copies = [op for op in counter.ops if op.split(".")[0] in ("clone", "stack", "cat", "_to_copy", "copy_")]
        assert copies == ["stack.default"], counter.ops
        counter = SyncCounter()
        tokens = torch.tensor(123_456_789)  # not representable in float16
        with counter:
            m.log({"half": torch.tensor(0.5, dtype=torch.float16), "tokens_seen": tokens,
                   "vector": torch.ones(2)}, step=1)
        assert counter.syncs == 0
        tokens += 1  # in place, after log()
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert steps[0]["values"] == {f"loss{i}": 2.0 * i for i in range(30)}
    assert steps[1]["values"] == {"half": 0.5, "tokens_seen": 123_456_789.0}


@pytest.mark.parametrize("name, uuid, visible, expected", [
    ("NVIDIA H100 80GB HBM3", "8d3c2b1a-0000-1111-2222-333344445555", "",
     "GPU-8d3c2b1a-0000-1111-2222-333344445555"),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "5b1c0f3e-aaaa-bbbb-cccc-ddddeeeeffff", "",
     "MIG-5b1c0f3e-aaaa-bbbb-cccc-ddddeeeeffff"),
    ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "5b1c0f3e-aaaa-bbbb-cccc-ddddeeeeffff",
     "MIG-5b1c0f3e-aaaa-bbbb-cccc-ddddeeeeffff", "MIG-5b1c0f3e-aaaa-bbbb-cccc-ddddeeeeffff"),
    ("NVIDIA H100 80GB HBM3", "GPU-8d3c2b1a-0000-1111-2222-333344445555", "0",
     "GPU-8d3c2b1a-0000-1111-2222-333344445555"),
], ids=["whole-device", "mig-by-name", "mig-visible-devices", "already-prefixed"])
def test_gpu_info_spells_uuids_as_nvidia_smi_does(name, uuid, visible, expected):
    assert _torch.device_uuid(name, uuid, visible) == expected


def test_a_legacy_mig_name_in_cuda_visible_devices_is_spelled_as_nvml_names_the_mig_device(monkeypatch):
    """`MIG-GPU-<uuid>/<gi>/<ci>` (drivers before R470; CUDA still takes it) is the MIG device NVML
    calls `MIG-<uuid>`, the exporter's mig_uuid: the hook asks NVML (here the simulator, as pynvml)."""
    lib = SimulatedNVML("healthy", 2, devices={1: DeviceTraits(mig=True, compute_instances=2)})
    lib.nvmlInit()
    parent = lib.nvmlDeviceGetHandleByIndex(1)
    devices = [lib.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot) for slot in range(4)]
    [second] = [d for d in devices
                if (lib.nvmlDeviceGetGpuInstanceId(d), lib.nvmlDeviceGetComputeInstanceId(d)) == (2, 1)]
    legacy, expected = f"MIG-{lib.nvmlDeviceGetUUID(parent)}/2/1", lib.nvmlDeviceGetUUID(second)
    lib.nvmlShutdown()
    monkeypatch.setitem(sys.modules, "pynvml", lib)
    assert expected.startswith("MIG-") and not expected.startswith("MIG-GPU-")
    assert _torch.device_uuid("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "ignored", legacy) == expected
    # a name NVML does not know, or no NVML at all, stays as given
    assert _torch.device_uuid("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "x", legacy.replace("/2/1", "/5/0")) \
        == legacy.replace("/2/1", "/5/0")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert _torch.device_uuid("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "x", legacy) == legacy


@pytest.mark.gpu
def test_on_a_gpu_logged_values_wait_for_their_stream_and_nothing_syncs(tmp_path):
    """A value made on a side stream by a long kernel is read only once that kernel is done; the
    training thread makes no device read; gpu_info carries nvidia-smi's UUID; the record has cuda."""
    import subprocess
    torch.cuda.init()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout.strip()
    side = torch.cuda.Stream()
    big = torch.randn(8192, 8192, device="cuda")
    counter = SyncCounter()
    with monitor(tmp_path, push_interval=0.05, listen_port=0) as m:
        with counter:
            for step in range(5):
                with torch.cuda.stream(side):
                    value = (big @ big).sum() * 0 + step  # slow to compute: step only when done
                    m.log({"loss": value}, step=torch.tensor(step, device="cuda"))
        assert counter.syncs == 0
        assert m._gpus() == (("0", smi),)
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert [(x["step"], x["values"]["loss"]) for x in steps] == [(s, float(s)) for s in range(5)]
    assert any(x.get("cuda", {}).get("allocated", 0) > 0 for x in steps)


def test_a_key_that_changes_kind_between_steps_keeps_its_values(tmp_path):
    """The same keys as the previous step take a shortcut; a change of type or dtype leaves it."""
    with monitor(tmp_path) as m:
        m.log({"loss": torch.tensor(1.0), "acc": torch.tensor(0.5)})
        m.log({"loss": torch.tensor(2.0), "acc": torch.tensor(0.25)})
        m.log({"loss": torch.tensor(3.0), "acc": 0.125})
        m.log({"loss": torch.tensor(4.0), "acc": torch.tensor(7, dtype=torch.int64)})
        m.log({"loss": torch.tensor(5.0), "acc": torch.ones(2)})
        m.log({"loss": torch.tensor(6.0), "acc": torch.tensor(0.5)})
        m.log({"loss": 7.0, "acc": 3})
        m.log({"loss": 8.0, "acc": 10**400})  # an int as before, but beyond a float's range
        m.log({"loss": 9.0, "acc": True})
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert [x["values"] for x in steps] == [
        {"loss": 1.0, "acc": 0.5}, {"loss": 2.0, "acc": 0.25}, {"loss": 3.0, "acc": 0.125},
        {"loss": 4.0, "acc": 7.0}, {"loss": 5.0}, {"loss": 6.0, "acc": 0.5},
        {"loss": 7.0, "acc": 3.0}, {"loss": 8.0}, {"loss": 9.0, "acc": 1.0}]
    assert m._latest.dropped["out_of_range"] == 1


def test_a_batch_id_tensor_keeps_the_value_it_had_at_log(tmp_path):
    """The loop may reuse its batch-index tensor: updating it after log() does not change the batch
    id the record and the non-finite gauges name."""
    with monitor(tmp_path, push_interval=3600.0) as m:  # nothing is read before close()
        batch = torch.tensor(41)
        m.log({"loss": float("nan")}, step=0, batch_id=batch)
        batch += 1  # in place, after log()
    steps, _ = record_lines(tmp_path / "record.jsonl")
    assert steps[0]["batch_id"] == 41
    assert m._latest.first_nonfinite_batch_id == 41


def test_samples_tokens_and_batch_id_tensors_are_read_after_their_event(tmp_path, monkeypatch):
    """On a GPU, samples/tokens/batch-id tensors are device values like the others: the step's event
    must cover them even when every logged value is a Python number (otherwise the worker could
    read them before the training stream wrote them). CPU only here: the tensors handed to the
    hook's event maker are what matters."""
    from trainer_hook import monitor as monitor_module
    marked: list[list[float]] = []
    monkeypatch.setattr(monitor_module, "ready_events",
                        lambda tensors: marked.append(sorted(float(t) for t in tensors)) or ())
    with monitor(tmp_path) as m:
        m._cuda_possible = True  # as with a CUDA build of torch
        m.log({"loss": 1.0}, step=0, samples=torch.tensor(8), tokens=torch.tensor(512),
              batch_id=torch.tensor(3))
        m.log({"loss": 1.0}, step=1, samples=8, batch_id=4)  # host numbers: nothing to wait for
    assert marked == [[3.0, 8.0, 512.0]]
