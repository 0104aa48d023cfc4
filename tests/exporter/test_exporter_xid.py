"""XID events: shutdown order, no spinning, re-registration of a returned GPU, a rate-limited log."""
from __future__ import annotations

import ctypes
import logging

from stack.processes import wait_until
from tests.support.exporter import Rig
from tests.support.nvml_faults import Fault


def watched(rig: Rig, gpu: int) -> bool:
    """True when `gpu` is registered on the watcher's event set and the simulated driver delivers on it."""
    address = ctypes.cast(rig.sampler.xid._event_set, ctypes.c_void_p).value
    event_set = rig.lib._event_sets.get(address)
    return event_set is not None and gpu in event_set.gpus and event_set.error is None


def test_stop_joins_the_xid_thread_and_frees_the_event_set_before_nvml_shuts_down():
    rig = Rig(gpus=1, collectors=["xid", "gpm"])
    rig.sampler.xid.start()
    rig.step()
    rig.step()
    thread = rig.sampler.xid._thread
    assert rig.sampler.stop()
    assert not thread.is_alive()  # joined: nothing waits on the event set when NVML shuts down
    assert rig.lib.calls["nvmlEventSetFree"] == 1
    assert rig.lib.calls["nvmlGpmSampleFree"] == 2
    rig.nvml.shutdown()
    assert rig.lib.calls["nvmlShutdown"] == 1


def test_the_xid_thread_ends_instead_of_spinning_when_nvml_is_shut_down_under_it():
    rig = Rig(gpus=1, collectors=["xid"])
    rig.sampler.xid.start()
    rig.lib.nvmlShutdown()
    wait_until(lambda: not rig.sampler.xid._thread.is_alive(), timeout=5, what="the XID thread to end")
    assert rig.lib.calls["nvmlEventSetWait"] < 5


def test_a_gpu_back_from_being_lost_is_registered_for_xid_events_again():
    faults = [Fault(gpu=1, function="*", error="GpuIsLost", at=2, until=4), Fault(gpu=1, xid=79, at=6, times=1)]
    rig = Rig(gpus=2, faults=faults, collectors=["memory", "xid"])
    rig.sampler.xid.start()
    try:
        for _ in range(4):
            rig.step()  # t = 4: lost at 2 (which drops its event registration), back at 4
        assert not rig.sampler.gpus[1].lost
        wait_until(lambda: watched(rig, 1), timeout=5, what="re-registration")
        rig.step(2.0)  # t = 6: XID 79
        uuid = rig.sampler.devices[1].uuid
        wait_until(lambda: rig.step(0.01) or rig.value("nvml_gpu_xid_errors_total", gpu="1", uuid=uuid,
                                                           xid="79", gpu_instance=""),
                   timeout=5, what="XID 79 counted")
    finally:
        rig.sampler.stop()


def test_an_xid_storm_logs_one_line_per_gpu_and_xid_a_minute(caplog):
    caplog.set_level(logging.WARNING, logger="exporter.collectors.xid")
    rig = Rig(gpus=1, faults=[Fault(gpu=0, xid=79, times=40)], collectors=["xid"])
    rig.sampler.xid.start()
    try:
        wait_until(lambda: rig.sampler.xid_counts.counts(0).get(("79", "")) == 40, timeout=10, what="40 XIDs")
    finally:
        rig.sampler.stop()
    lines = [r.getMessage() for r in caplog.records if "XID 79" in r.getMessage()]
    assert lines == ["GPU 0: XID 79: GPU has fallen off the bus"]


def test_a_gpu_lost_for_good_does_not_mask_the_other_gpus_xids():
    # GPU 1 falls off the bus and never comes back; the shared event set then answers GPU_IS_LOST
    faults = [Fault(gpu=1, function="*", error="GpuIsLost", at=2), Fault(gpu=0, xid=48, at=3, times=2)]
    rig = Rig(gpus=2, faults=faults, collectors=["throttle", "xid"])  # throttle: an NVML call every sample
    rig.sampler.xid.start()
    try:
        rig.step()
        rig.step()  # t = 2: GPU 1 lost
        assert rig.sampler.gpus[1].lost
        rig.step()  # t = 3: two XID 48 on GPU 0
        uuid = rig.sampler.devices[0].uuid
        wait_until(lambda: rig.step(0.01) or rig.value("nvml_gpu_xid_errors_total", gpu="0", uuid=uuid,
                                                           xid="48", gpu_instance="") == 2,
                   timeout=10, what="GPU 0's XIDs counted")
    finally:
        rig.sampler.stop()
