"""Busy and idle seconds are exact between scrapes: utilization alternating 100 % / 0 % every 2 s,
scraped every 30 s, gives rate(nvml_gpu_busy_seconds_total[2m]) = 0.50 +- 0.05 and the same for idle
seconds (fake clock, 10 simulated minutes). The simulated driver's sample buffer runs dry while the
GPU idles, as a real one does."""
from __future__ import annotations

import pytest

from exporter.collectors.utilization import RATES_PERIOD
from exporter.simulated import DeviceTraits, H
from tests.support.exporter import Rig


def prometheus_rate(points: list[tuple[float, float]], at: float, window: float = 120.0) -> float:
    """rate(x[window]) at time `at` from (time, value) scrapes, as Prometheus computes it without
    extrapolation: the increase between the first and last scrape inside the window, per second."""
    inside = [(t, v) for t, v in points if at - window < t <= at]
    (t0, v0), (t1, v1) = inside[0], inside[-1]
    return (v1 - v0) / (t1 - t0)


@pytest.mark.parametrize("scrape_offset", [0.0, 0.7, 1.3, 2.9])
@pytest.mark.parametrize("sample_interval", [1.0, 3.0])
def test_busy_rate_at_30s_scrapes_reads_half(scrape_offset, sample_interval):
    rig = Rig("input-bound", gpus=1, collectors=["utilization"], interval=sample_interval)
    uuid = rig.sampler.devices[0].uuid
    rig.step(scrape_offset or sample_interval)
    elapsed, next_scrape, scrapes, idle, gauges = 0.0, 30.0, [], [], []
    while elapsed < 600:
        rig.step()
        elapsed += sample_interval
        if elapsed >= next_scrape:
            scrapes.append((elapsed, rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid)))
            idle.append((elapsed, rig.value("nvml_gpu_idle_seconds_total", gpu="0", uuid=uuid)))
            gauges.append(rig.value("nvml_gpu_utilization_ratio", gpu="0", uuid=uuid))
            next_scrape += 30.0
    rates = [prometheus_rate(scrapes, at) for at, _ in scrapes[4:]]
    assert all(0.45 <= rate <= 0.55 for rate in rates), rates
    idle_rates = [prometheus_rate(idle, at) for at, _ in idle[4:]]
    assert all(0.45 <= rate <= 0.55 for rate in idle_rates), idle_rates
    # The instantaneous gauge only ever shows 0 or 1 at these scrapes: it cannot tell this story.
    assert set(gauges) <= {0.0, 1.0}


def test_idle_seconds_follow_the_idle_threshold():
    rig = Rig("input-bound", gpus=1, collectors=["utilization"])
    uuid = rig.sampler.devices[0].uuid
    rig.step()
    start = rig.value("nvml_gpu_idle_seconds_total", gpu="0", uuid=uuid)
    for _ in range(40):
        rig.step()
    assert rig.value("nvml_gpu_idle_seconds_total", gpu="0", uuid=uuid) - start == pytest.approx(20, abs=0.5)


def test_an_empty_answer_from_the_sample_buffer_is_idle_time_not_an_error():
    rig = Rig("healthy", gpus=1, collectors=["utilization"])
    uuid = rig.sampler.devices[0].uuid
    rig.step()
    rig.lib.nvmlDeviceGetSamples = lambda handle, kind, since: (H.NVML_VALUE_TYPE_UNSIGNED_INT, [])  # count 0, SUCCESS
    start = rig.value("nvml_gpu_idle_seconds_total", gpu="0", uuid=uuid)
    for _ in range(5):
        rig.step()
    # idle once more than two driver sample periods go uncovered: what the newest sample may lag
    lag = 2 * DeviceTraits().sample_period
    assert rig.value("nvml_gpu_idle_seconds_total", gpu="0", uuid=uuid) - start == pytest.approx(5 - lag, abs=0.1)
    assert rig.series("nvml_exporter_errors_total") == []


def test_garbage_utilization_is_clamped_to_one():
    rig = Rig("healthy", gpus=1, collectors=["utilization"])
    uuid = rig.sampler.devices[0].uuid
    real_samples, real_rates = rig.lib.nvmlDeviceGetSamples, rig.lib.nvmlDeviceGetUtilizationRates

    def garbage_samples(handle, kind, since):
        value_type, samples = real_samples(handle, kind, since)
        for sample in samples:
            sample.sampleValue.uiVal = 4_294_967_295  # seen from H100s on driver 550
        return value_type, samples

    def garbage_rates(handle):
        rates = real_rates(handle)
        rates.gpu = 4_294_967_295
        return rates
    rig.lib.nvmlDeviceGetSamples, rig.lib.nvmlDeviceGetUtilizationRates = garbage_samples, garbage_rates
    rig.step()
    start = rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid)
    for _ in range(10):
        rig.step()
    assert rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid) - start == pytest.approx(10, abs=0.2)
    assert rig.value("nvml_gpu_utilization_ratio", gpu="0", uuid=uuid) == 1.0


def test_one_short_gap_between_two_samples_does_not_bias_what_follows():
    rig = Rig("healthy", gpus=1, collectors=["utilization"])
    uuid = rig.sampler.devices[0].uuid
    real = rig.lib.nvmlDeviceGetSamples

    def with_a_sample_1ms_after_another(handle, kind, since):
        value_type, samples = real(handle, kind, since)
        if rig.lib._t() == 5.0:  # once: the driver squeezed in an extra sample
            extra = type(samples[-1])(timeStamp=samples[-2].timeStamp + 1000)
            extra.sampleValue.uiVal = samples[-1].sampleValue.uiVal
            samples.insert(-1, extra)
        return value_type, samples
    rig.lib.nvmlDeviceGetSamples = with_a_sample_1ms_after_another
    for _ in range(10):
        rig.step()
    busy0 = rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid)
    truth0 = rig.lib.workload.busy_seconds(0, rig.lib._t())
    for _ in range(30):
        rig.step()
    truth = rig.lib.workload.busy_seconds(0, rig.lib._t()) - truth0
    assert rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid) - busy0 == pytest.approx(truth, rel=0.01)


def test_the_first_poll_credits_nothing_from_before_the_exporter_started():
    rig = Rig("healthy", gpus=1, collectors=["utilization"])
    uuid = rig.sampler.devices[0].uuid
    rig.step(15.0)  # the driver's buffer already holds the last ~12 s of a busy GPU
    assert rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid) == 0
    assert rig.value("nvml_gpu_idle_seconds_total", gpu="0", uuid=uuid) == 0
    truth0 = rig.lib.workload.busy_seconds(0, rig.lib._t())
    for _ in range(5):
        rig.step()
    truth = rig.lib.workload.busy_seconds(0, rig.lib._t()) - truth0
    assert rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid) == pytest.approx(truth, abs=0.15)


@pytest.mark.parametrize(("sample_period", "rel"), [(None, 0.01), (1 / 6, 0.02), (1.0, 0.02)],
                         ids=["driver-default", "1/6 s", "1 s"])
def test_a_busy_gpu_reads_busy_whatever_the_jitter_and_period_of_the_drivers_samples(sample_period, rel):
    # the simulated driver's samples come every period (0.1 s by default), each up to +-15 % off its slot
    devices = {} if sample_period is None else {0: DeviceTraits(sample_period=sample_period)}
    rig = Rig("healthy", gpus=1, collectors=["utilization"], devices=devices)
    uuid = rig.sampler.devices[0].uuid
    for _ in range(10):
        rig.step()
    busy0, idle0, truth0 = (rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid),
                            rig.value("nvml_gpu_idle_seconds_total", gpu="0", uuid=uuid),
                            rig.lib.workload.busy_seconds(0, rig.lib._t()))
    for _ in range(60):
        rig.step()
    truth = rig.lib.workload.busy_seconds(0, rig.lib._t()) - truth0  # ~93 % of 60 s
    assert rig.value("nvml_gpu_busy_seconds_total", gpu="0", uuid=uuid) - busy0 == pytest.approx(truth, rel=rel)
    assert rig.value("nvml_gpu_idle_seconds_total", gpu="0", uuid=uuid) - idle0 == 0


def test_the_gpu_ratio_comes_from_the_sample_buffer_and_the_rates_call_is_rare():
    rig = Rig("healthy", gpus=1, collectors=["utilization"])
    uuid = rig.sampler.devices[0].uuid
    samples = round(3 * RATES_PERIOD / rig.sampler.interval)  # RATES_PERIOD is in seconds
    for _ in range(samples):
        rig.step()
        assert 0.85 < rig.value("nvml_gpu_utilization_ratio", gpu="0", uuid=uuid) <= 1
        assert 0.3 < rig.value("nvml_gpu_memory_controller_utilization_ratio", gpu="0", uuid=uuid) < 0.5
    assert rig.lib.calls["nvmlDeviceGetUtilizationRates"] == 3  # the memory-controller ratio, every RATES_PERIOD
    assert rig.lib.calls["nvmlDeviceGetSamples"] == samples


def test_while_the_sample_buffer_is_dry_the_rates_call_answers():
    # busy 2 s / idle 2 s: the driver's buffer gets no samples while the GPU idles
    rig = Rig("input-bound", gpus=1, collectors=["utilization"], interval=0.5)
    uuid = rig.sampler.devices[0].uuid
    ratios, rates_calls = [], []
    for _ in range(40):
        before = rig.lib.calls["nvmlDeviceGetUtilizationRates"]
        rig.step()
        ratios.append(rig.value("nvml_gpu_utilization_ratio", gpu="0", uuid=uuid))
        rates_calls.append(rig.lib.calls["nvmlDeviceGetUtilizationRates"] - before)
    assert set(ratios) == {0.0, 1.0}
    assert all(calls == 1 for ratio, calls in zip(ratios, rates_calls) if ratio == 0.0)
    assert sum(rates_calls) < len(rates_calls)


def test_without_the_sample_buffer_the_rates_call_answers_every_sample():
    rig = Rig("healthy", gpus=1, collectors=["utilization"], binding_lacks=("nvmlDeviceGetSamples",))
    for _ in range(5):
        rig.step()
    assert rig.lib.calls["nvmlDeviceGetUtilizationRates"] == 5
    assert 0.8 < rig.value("nvml_gpu_utilization_ratio", gpu="0", uuid=rig.sampler.devices[0].uuid) <= 1
