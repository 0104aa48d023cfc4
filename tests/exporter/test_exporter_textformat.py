"""The text format's pieces the exporter writes itself (`exporter.textformat`) are prometheus_client's:
float values, the Accept header's negotiation and gzip's, over generated inputs; where prometheus_client
falls short of HTTP (q-values, case, a version that is no number), the exporter follows HTTP."""
from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client.exposition import choose_encoder
from prometheus_client.exposition import gzip_accepted as prometheus_gzip_accepted
from prometheus_client.utils import floatToGoString

from exporter.metrics import COUNTER, GAUGE, MetricSpec
from exporter.textformat import float_text, gzip_accepted, header, negotiate


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-2**70, 2**70))
@example(1e22)
@example(123456789.0)
@example(81559732224.0)  # prometheus-client 0.25 wrote 8.1559732224e+010
@example(-0.0)
def test_float_text_is_prometheus_clients_float_to_go_string(value):
    assert float_text(value) == floatToGoString(value)


_MEDIA = st.sampled_from(["application/openmetrics-text", "text/plain", "*/*", "text/html", " text/plain ",
                          "application/openmetrics-text ", "application/json"])
# (no q-values and no spaces around "=": prometheus_client ignores both, the exporter does not)
_PARAMETER = st.sampled_from(["version=1.0.0", "version=0.0.1", "version=0.0.4", "version=2.0.0", "version=1",
                              "version=10", " version=1.0.0", "escaping=dots", "escaping=values",
                              "escaping=allow-utf-8", "escaping=underscores", "escaping=bogus", "charset=utf-8",
                              "version=", "=", ""])
_ENTRY = st.builds(lambda media, parameters: ";".join([media, *parameters]), _MEDIA, st.lists(_PARAMETER, max_size=3))


@given(st.none() | st.builds(",".join, st.lists(_ENTRY, max_size=4)))
@example("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
         "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # Prometheus 2's: q-values in the order of the entries
def test_accept_negotiation_is_prometheus_clients(accept):
    encoder, content_type = choose_encoder(accept)
    chosen = negotiate(accept)
    assert chosen.content_type == content_type
    assert chosen.openmetrics == content_type.startswith("application/openmetrics-text")
    assert chosen.escaping == getattr(encoder, "keywords", {}).get("escaping", "underscores")


def test_a_version_that_is_no_number_is_passed_over_where_prometheus_client_raises():
    accept = "application/openmetrics-text; version=1.0.x, text/plain"
    with pytest.raises(TypeError):
        choose_encoder(accept)
    assert negotiate(accept).content_type == "text/plain; version=0.0.4; charset=utf-8"
    # nor is a version that is no number echoed into the reply's headers
    for version in ("2.0\rSet-Cookie: x=1", "1.0.0.garbage", "2.x", "1" * 5000):  # (int() refuses 4,300 digits)
        assert negotiate(f"application/openmetrics-text;version={version}").content_type == \
            "text/plain; version=0.0.4; charset=utf-8"


@given(st.text(alphabet=st.sampled_from("application/openmetrics-text;version=q,.0123456789 \"\r*")) | st.text())
def test_any_accept_or_accept_encoding_header_gets_an_answer(header):
    """Whatever a client sends: a format and a yes or no for gzip, never an exception (a 500)."""
    assert negotiate(header).content_type.endswith(("charset=utf-8", "escaping=underscores", "escaping=dots",
                                                    "escaping=values", "escaping=allow-utf-8"))
    assert gzip_accepted(header) in (True, False)


PROMETHEUS_TEXT_FIRST = "text/plain;version=0.0.4;q=0.6,application/openmetrics-text;version=1.0.0;" \
                        "escaping=underscores;q=0.5,*/*;q=0.4"  # scrape_protocols: [PrometheusText0.0.4, ...]


@pytest.mark.parametrize("accept, content_type", [
    (PROMETHEUS_TEXT_FIRST, "text/plain; version=0.0.4; charset=utf-8"),
    ("application/openmetrics-text;version=1.0.0;q=0, text/plain;version=1.0.0",
     "text/plain; version=1.0.0; charset=utf-8; escaping=underscores"),
    ("text/plain;version=1.0.0;q=0, application/openmetrics-text;version=1.0.0;q=0.5",
     "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"),
    ("application/openmetrics-text;q=0", "text/plain; version=0.0.4; charset=utf-8"),
    ("text/plain;version=1.0.0;q=0.5, application/openmetrics-text;version=1.0.0;q=0.5",  # equal: as listed
     "text/plain; version=1.0.0; charset=utf-8; escaping=underscores"),
    ("text/plain;q=0.9, application/openmetrics-text;version=1.0.0;q=0.9",  # equal: more than 0.0.4 wins
     "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"),
    ('Application/OpenMetrics-Text; Version = "1.0.0"; ESCAPING=allow-utf-8',
     "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=allow-utf-8"),
])
def test_q_values_case_and_quotes_are_read_as_http_says(accept, content_type):
    """q-values choose (Prometheus sends its scrape_protocols' order as q-values; q=0 is "not at all"),
    media types and parameter names in any case, values quoted or not."""
    assert negotiate(accept).content_type == content_type


@given(st.none() | st.builds(",".join, st.lists(st.sampled_from(["gzip", "GZIP;q=0.5", " gzip ", "deflate", "br",
                                                                 "x-gzip", "*", "identity;q=1", ""]), max_size=4)))
def test_gzip_negotiation_is_prometheus_clients(accept_encoding):
    assert gzip_accepted(accept_encoding) == prometheus_gzip_accepted(accept_encoding)


def test_gzip_with_q_0_is_not_accepted():
    """Where prometheus_client still compresses: gzip;q=0 means "not gzip"."""
    for accept in ("gzip;q=0", "GZIP; q=0.0, identity", "gzip;q=0, deflate"):
        assert prometheus_gzip_accepted(accept) and not gzip_accepted(accept)


@pytest.mark.parametrize("kind", [GAUGE, COUNTER])
def test_help_and_type_lines_are_prometheus_clients(kind):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    class Registry:
        def collect(self):
            family = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
            return [family("odd_help_total" if kind == COUNTER else "odd_help", help_text)]

    help_text = 'Help with a "quote", a back\\slash\nand a line break.'
    spec = MetricSpec("odd_help_total" if kind == COUNTER else "odd_help", kind, help_text)
    assert header(spec, openmetrics=False) == generate_latest(Registry())
    assert header(spec, openmetrics=True) + b"# EOF\n" == generate_openmetrics(Registry())
