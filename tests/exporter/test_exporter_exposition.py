"""The scrape path (pre-rendered GPU lines, written without prometheus_client) serves exactly what
prometheus_client renders from the same snapshot and the same /proc."""
from __future__ import annotations

import dataclasses
import gzip
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import requests
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from exporter import exposition as exposition_module
from exporter.exposition import Exposition
from exporter.metrics import GPU_METRICS
from exporter.textformat import sample_lines
from stack import processes
from tests.support.exporter import Rig

TEXT = None  # what Prometheus gets without an Accept header: text 0.0.4
OPENMETRICS = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75," \
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"  # Prometheus 2's scrape Accept header
ACCEPTS = [TEXT, OPENMETRICS, "application/openmetrics-text; version=1.0.0; escaping=allow-utf-8",
           "text/plain; version=1.0.0; escaping=underscores",
           "application/openmetrics-text; version=1.0.0; escaping=dots"]


@pytest.fixture
def rig(tmp_path) -> Rig:
    """Two simulated H100s with every collector and one compute process, sampled until GPM reports."""
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "comm").write_text('py "train" \\ 1\n')  # label escaping: quote and backslash
    rig = Rig("healthy", gpus=2, proc_root=str(tmp_path), pid=4242)
    for _ in range(6):
        rig.step()
    return rig


def fake_proc(root: Path) -> str:
    """A /proc whose `self` holds still (unlike the test process's own): stat, limits and four open fds."""
    (root / "self" / "fd").mkdir(parents=True)
    (root / "stat").write_text("cpu  1 2 3 4\nbtime 1700000000\nprocesses 5\n")
    fields = ["S", *map(str, range(1, 19)), "123456", "987654321", "6789", *["0"] * 30]  # 20: start, 22: vsize, 23: rss
    (root / "self" / "stat").write_text("4242 (python3 (x)) " + " ".join(fields) + "\n")
    (root / "self" / "limits").write_text("Limit                     Soft Limit  Hard Limit  Units\n"
                                          "Max open files            1024        524288      files\n")
    for fd in range(4):
        (root / "self" / "fd" / str(fd)).write_text("")
    return str(root)


def serve(rig: Rig) -> Exposition:
    """The exposition the daemon builds, reading process_* from a /proc that holds still."""
    root = Path(rig.sampler.proc_root) / "fake-proc"
    return Exposition(rig.sampler, clock=rig.clock, proc=str(root) if root.exists() else fake_proc(root))


def reference(exposition: Exposition, accept: str | None) -> tuple[bytes, str]:
    """prometheus_client's own rendering of the same collectors (and its ProcessCollector, PlatformCollector)."""
    encoder, content_type = choose_encoder(accept)
    return encoder(exposition.registry), content_type


def families(body: bytes, content_type: str) -> list[tuple]:
    """The parsed families: name, type, help and samples (values as text, so that NaN equals NaN)."""
    parse = parse_openmetrics if content_type.startswith("application/openmetrics-text") else parse_text
    return [(f.name, f.type, f.documentation, [(s.name, s.labels, repr(s.value), s.timestamp) for s in f.samples])
            for f in parse(body.decode())]


def assert_same_as_prometheus_client(exposition: Exposition, accept: str | None) -> bytes:
    body, content_type = exposition.render(accept)
    expected, expected_type = reference(exposition, accept)
    assert content_type == expected_type
    assert families(body, content_type) == families(expected, expected_type)
    assert body == expected
    return body


@pytest.mark.parametrize("accept", ACCEPTS)
def test_scrape_path_output_is_prometheus_clients_byte_for_byte(rig, accept):
    body = assert_same_as_prometheus_client(serve(rig), accept)
    assert b'_ratio{gpu="1",' in body  # (escaping=dots doubles the underscores in names)
    assert b'process="py \\"train\\" \\\\ 1"' in body
    assert b"process_open_fds 4.0\n" in body or b"process__open__fds 4.0\n" in body


def test_a_filtered_scrape_negotiates_as_the_fast_path(rig):
    """name[] scrapes go through prometheus_client: the same format for the same Accept header, a version
    that is no number passed over (not a 500), and escaping=values leaving legacy names as they are."""
    exposition = serve(rig)
    for accept in ("application/openmetrics-text;version=1.0.x, text/plain", 'text/plain;version="1.0.0"',
                   "application/openmetrics-text;version=1.0.0;escaping=values", OPENMETRICS, TEXT):
        fast, fast_type = exposition.render(accept)
        only, only_type = exposition.render(accept, names=["nvml_up"])
        assert only_type == fast_type, accept
        wanted = [f for f in families(fast, fast_type) if f[0] == "nvml_up"]
        assert wanted and families(only, only_type) == wanted, accept


def test_openmetrics_ends_with_one_eof_and_counters_keep_their_total_suffix(rig):
    body, content_type = serve(rig).render(OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert body.count(b"# EOF") == 1 and body.endswith(b"\n# EOF\n")
    assert b"# TYPE nvml_gpu_energy_joules counter\n" in body and b"\nnvml_gpu_energy_joules_total{" in body
    text, _ = serve(rig).render(TEXT)
    assert b"# TYPE nvml_gpu_energy_joules_total counter\n" in text and b"# EOF" not in text


def test_special_values_and_label_escaping_match_prometheus_client(rig):
    """NaN, infinities, large and integral values, and label values with quotes, backslashes and newlines."""
    store, device = rig.sampler.store, rig.sampler.devices[0]
    sample = store.current.samples[0]
    values = {**sample.values,
              "nvml_gpu_utilization_ratio": {(): math.nan},
              "nvml_gpu_power_usage_watts": {(): math.inf},
              "nvml_gpu_temperature_celsius": {(): -math.inf},
              "nvml_gpu_memory_used_bytes": {(): 81559732224},
              "nvml_gpu_energy_joules_total": {(): 1e22},
              "nvml_gpu_memory_total_bytes": {(): 3},
              "nvml_gpu_xid_errors_total": {("79",): 2.5e-7},
              "nvml_gpu_process_memory_used_bytes": {("7", 'a"b\\c\nd', "", "", ""): 0.1}}
    store.publish(0, dataclasses.replace(sample, values=values, lines=sample_lines(device.index, device.uuid, values)))
    body = assert_same_as_prometheus_client(serve(rig), TEXT)
    assert_same_as_prometheus_client(serve(rig), OPENMETRICS)
    for line in (b"nvml_gpu_utilization_ratio{gpu=\"0\",uuid=\"%s\"} NaN",
                 b"nvml_gpu_power_usage_watts{gpu=\"0\",uuid=\"%s\"} +Inf",
                 b"nvml_gpu_temperature_celsius{gpu=\"0\",uuid=\"%s\"} -Inf",
                 b"nvml_gpu_memory_total_bytes{gpu=\"0\",uuid=\"%s\"} 3.0",
                 b"nvml_gpu_energy_joules_total{gpu=\"0\",uuid=\"%s\"} 1e+22"):
        assert line % device.uuid.encode() in body
    assert b'process="a\\"b\\\\c\\nd"' in body


def test_stale_and_lost_gpus_drop_their_series_like_the_collector(rig):
    exposition = serve(rig)
    rig.clock.advance(rig.sampler.hang_after + 1)
    rig.sampler.gpus[0].sample_once()  # GPU 1's sample is now stale
    body = assert_same_as_prometheus_client(exposition, TEXT)
    assert b'nvml_gpu_utilization_ratio{gpu="0",' in body and b'nvml_gpu_utilization_ratio{gpu="1",' not in body
    assert b'nvml_exporter_gpu_sample_age_seconds{gpu="1",' in body  # the self-metrics still say how old it is
    rig.sampler.store.publish(0, None)  # what the sampler publishes for a lost GPU
    body = assert_same_as_prometheus_client(exposition, OPENMETRICS)
    assert b'nvml_gpu_lost{gpu="0",' in body and b"nvml_gpu_utilization_ratio{" not in body
    assert b"nvml_up 0.0" in body
    rig.step()  # both GPUs answer again
    body = assert_same_as_prometheus_client(exposition, TEXT)
    assert b'nvml_gpu_utilization_ratio{gpu="0",' in body and b'nvml_gpu_utilization_ratio{gpu="1",' in body


def test_a_broken_sample_falls_back_to_prometheus_client_instead_of_failing_the_scrape(rig, caplog):
    sample = rig.sampler.store.current.samples[1]
    rig.sampler.store.publish(1, dataclasses.replace(sample, lines=()))
    body = assert_same_as_prometheus_client(serve(rig), OPENMETRICS)
    assert b'nvml_gpu_utilization_ratio{gpu="1",' in body
    assert "fast exposition failed" in caplog.text


def test_daemon_serves_both_formats_gzip_and_name_filter(tmp_path, start_service):
    exporter = start_service(processes.exporter(tmp_path, ["--simulate=healthy", "--simulate.gpus=2",
                                                           "--sample-interval=0.1"]))
    url = exporter.url + "/metrics"
    processes.wait_until(lambda: "nvml_gpu_sm_active_ratio{" in requests.get(url, timeout=5).text,
                         timeout=10, what="GPM metrics after two GPM samples")

    def series(families_) -> set:
        return {(s.name, tuple(sorted(s.labels.items()))) for f in families_ for s in f.samples
                if not s.name.startswith(("process_", "nvml_exporter_collector_duration"))}

    def both_formats() -> tuple[requests.Response, str]:
        text = requests.get(url, timeout=5)
        assert text.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        om = requests.get(url, timeout=5, headers={"Accept": OPENMETRICS, "Accept-Encoding": "gzip"}, stream=True)
        assert om.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
        assert om.headers["Content-Encoding"] == "gzip"
        om_text = gzip.decompress(om.raw.read()).decode()
        assert om_text.endswith("\n# EOF\n") and om_text.count("# EOF") == 1
        return text, om_text

    # the two scrapes may straddle a sample (every 0.1 s here) whose series differ: wait for a pair that
    # saw the same sample; a series missing from either format never gets there
    pairs: list[tuple[requests.Response, str]] = []

    def same_series() -> bool:
        pairs.append(both_formats())
        text, om_text = pairs[-1]
        return series(parse_text(text.text)) == series(parse_openmetrics(om_text))

    processes.wait_until(same_series, timeout=10, what="the text and OpenMetrics scrapes to serve the same series")
    text = pairs[-1][0]
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=text.text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    only = requests.get(url, params={"name[]": "nvml_gpu_temperature_celsius"}, timeout=5).text
    assert {f.name for f in parse_text(only)} == {"nvml_gpu_temperature_celsius"}


def test_the_sampler_does_not_import_the_scrape_side():
    """Data flows one way (NVML -> collectors -> sampler -> snapshot -> exposition): no import cycle."""
    import subprocess
    import sys
    code = "import sys, exporter.sampler; print('exporter.exposition' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "False"


def test_a_sample_formats_only_the_families_that_changed(rig):
    before = rig.sampler.store.current.samples[0]
    rig.step()
    after = rig.sampler.store.current.samples[0]
    names = [spec.name for spec in GPU_METRICS]
    static, moving = names.index("nvml_gpu_clock_max_hertz"), names.index("nvml_gpu_busy_seconds_total")
    assert after.lines[static] is before.lines[static]  # kept, not formatted again
    assert after.lines[moving] != before.lines[moving]
    assert after.lines == sample_lines(after.index, after.uuid, after.values)  # what a fresh rendering gives


def test_a_body_is_reused_for_the_same_snapshot_and_format_for_at_most_a_second(rig):
    exposition = serve(rig)
    assert exposition.reused(TEXT) is None  # nothing rendered yet
    text, content_type = exposition.render(TEXT)
    assert exposition.render(TEXT)[0] is text  # same snapshot, same format: not rendered again
    assert exposition.reused(TEXT) == (text, content_type) and exposition.reused(TEXT)[0] is text
    assert exposition.reused(TEXT, names=["nvml_up"]) is None and exposition.reused(ACCEPTS[-1]) is None
    assert exposition.render("text/plain; version=1.0.0")[0] is text  # the same body under another content type
    openmetrics, _ = exposition.render(OPENMETRICS)
    assert openmetrics is not text and openmetrics.endswith(b"# EOF\n")
    gzipped, _ = exposition.render(TEXT, gzipped=True)
    assert gzip.decompress(gzipped) == text and exposition.render(TEXT, gzipped=True)[0] is gzipped
    rig.clock.advance(exposition_module.REUSE_SECONDS)
    assert exposition.reused(TEXT) is None
    aged = exposition.render(TEXT)[0]
    assert aged is not text and b"nvml_exporter_snapshot_age_seconds 1.0\n" in aged  # rendered anew: ages move on
    rig.step()
    assert exposition.render(TEXT)[0] is not aged  # a new snapshot
    assert_same_as_prometheus_client(exposition, TEXT)
