"""The Grafana dashboards as code: builds dashboards/*.json with grafana-foundation-sdk's typed builders.

    python dashboards/generate.py           # write dashboards/gpu-fleet.json and training-run.json
    python dashboards/generate.py --check   # exit 1 if a committed file differs from what this builds

The JSON files are what Grafana provisions (grafana/provisioning, docker-compose.yml, Kubernetes);
this module is where they are edited. The two joins every Infra panel of the Training run makes (a
run's whole GPUs, a run's MIG instances, only while the run is live on them) are written once here.
Needs the `dashboards` extra (grafana-foundation-sdk); the wheel does not ship this module.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from grafana_foundation_sdk.builders import (
    common,
    dashboard,
    heatmap,
    prometheus,
    stat,
    statetimeline,
    statushistory,
    table,
    timeseries,
    xychart,
)
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm
from grafana_foundation_sdk.models import xychart as xm

HERE = Path(__file__).resolve().parent
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

# --- selectors and joins -------------------------------------------------------------------------------
HOST = 'instance=~"$instance"'
HOST_GPU = f'{HOST}, gpu=~"$gpu"'
RUN = 'job=~"$job", run=~"$run", instance=~"$instance"'
JOB_RUN = 'job=~"$job", run=~"$run"'
#: a rank counts for the Infra panels only while its run is live on its GPU: running, pushed in the last 2 min
LIVE = ('* on (job, run, rank, instance) group_left () (training_run_state{state="running"} == 1) '
        'and on (job, run, rank, instance) (time() - training_last_push_timestamp_seconds < 120)')
#: the run's whole GPUs, one rank per GPU: the exporter's GPU of each rank (a MIG rank's parent GPU), or
#: the hook's training_gpu_info where the recording rule has no series yet
RUN_GPUS = (f'topk by (uuid) (1, max by (uuid, run, rank) (((job_run_rank_gpu:training_gpu_info:nvml{{{RUN}}} '
            f'and on (job, run, rank, instance, gpu) training_gpu_info{{uuid=~"$gpu"}}) '
            f'or training_gpu_info{{{RUN}, uuid=~"$gpu"}}) {LIVE}))')
#: the run's MIG GPU instances, joined on (uuid, gpu_instance)
RUN_MIG = (f'max by (uuid, gpu_instance, run, rank) (job_run_rank_gpu:training_gpu_info:nvml'
           f'{{{RUN}, gpu_instance!="", mig_uuid=~"$gpu"}} {LIVE})')
#: a run's hyper-parameters (training_run_info's labels) joined to a per-run value, over the last 30 days
HPARAMS = f'max without (rank, instance) (last_over_time(training_run_info{{{JOB_RUN}}}[30d]))'


def on_run_gpus(expr: str) -> str:
    """A whole-GPU exporter series of the run's GPUs, labelled with run and rank."""
    return f"({expr}) * on (uuid) group_left (run, rank) {RUN_GPUS}"


def on_run_mig(expr: str) -> str:
    """A MIG GPU-instance exporter series of the run's instances, labelled with run and rank."""
    return f"({expr}) * on (uuid, gpu_instance) group_left (run, rank) {RUN_MIG}"


def with_hparams(expr: str, keep: str = "") -> str:
    """A per-run value with the run's hyper-parameters as labels (a row of the runs table)."""
    return f"({expr}) * on (job, run) group_right ({keep}) {HPARAMS}"


def rate(metric: str, selector: str = RUN) -> str:
    return f"rate({metric}{{{selector}}}[$__rate_interval])"


def increase(metric: str, selector: str = RUN) -> str:
    return f"increase({metric}{{{selector}}}[$__rate_interval])"


def logged_mean(key: str) -> str:
    """Exact mean of a logged key per rank over the interval, from the hook's sums and counts."""
    selector = f'key="{key}", {RUN}'
    return (f"max without (key) ({rate('training_logged_value_sum', selector)} / "
            f"{rate('training_logged_value_count', selector)})")


def logged_mean_or_last(key: str, gauge: str) -> str:
    """`logged_mean`, or the last logged value (older hooks send no sums and counts)."""
    return f"({logged_mean(key)}) or {gauge}{{{RUN}}}"


def run_mean(key: str, gauge: str) -> str:
    """Exact mean of a logged key per run (all its ranks), or the mean of the last logged values."""
    selector = f'key="{key}", {RUN}'
    return (f"(sum by (job, run) ({rate('training_logged_value_sum', selector)}) / "
            f"sum by (job, run) ({rate('training_logged_value_count', selector)})) "
            f"or avg by (job, run) ({gauge}{{{RUN}}})")


# --- legends -----------------------------------------------------------------------------------------
RANK = "{{run}} · rank {{rank}} · {{instance}}"
GPU = "{{run}} r{{rank}} · {{instance}} GPU {{gpu}}"
MIG = GPU + " MIG {{gpu_instance}}"
FLEET_GPU = "{{instance}} · GPU {{gpu}}"


def legend(base: str, suffix: str = "") -> str:
    return f"{base} {suffix}" if suffix else base


# --- queries and panels ------------------------------------------------------------------------------
Query = tuple[str, str]  # (legend, expr)
REF_IDS = "ABCDEFGHIJ"


def targets(queries: Sequence[Query], *, instant: bool = False, fmt: pm.PromQueryFormat | None = None
            ) -> list[prometheus.Dataquery]:
    built = []
    for ref, (legend_format, expr) in zip(REF_IDS, queries):
        query = prometheus.Dataquery().ref_id(ref).datasource(DATASOURCE).expr(expr).legend_format(legend_format)
        query = query.instant() if instant else query.range()
        built.append(query.format(fmt) if fmt is not None else query)
    return built


def thresholds(*steps: tuple[float, str]) -> dashboard.ThresholdsConfig:
    """Absolute thresholds: green from the bottom, then each (value, colour)."""
    return dashboard.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=None, color="green"), *(dm.Threshold(value=v, color=c) for v, c in steps)])


def colour(mode: dm.FieldColorModeId) -> dashboard.FieldColor:
    return dashboard.FieldColor().mode(mode)


def list_legend(show: bool = True) -> common.VizLegendOptions:
    return (common.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST).placement(cm.LegendPlacement.BOTTOM)
            .show_legend(show).calcs([]))


def tooltip(mode: cm.TooltipDisplayMode, sort: cm.SortOrder) -> common.VizTooltipOptions:
    return common.VizTooltipOptions().mode(mode).sort(sort)


def common_panel(panel, title: str, description: str, width: int, height: int, unit: str | None,
                 queries: Sequence[Query], *, instant: bool = False, fmt=None):
    panel = (panel.title(title).description(description).datasource(DATASOURCE).span(width).height(height)
             .targets(targets(queries, instant=instant, fmt=fmt)))
    return panel.unit(unit) if unit is not None else panel


def graph(title: str, description: str, unit: str, queries: Sequence[Query], *, width: int = 12, height: int = 8,
          min_value: float | None = None, max_value: float | None = None, bars: bool = False,
          log_scale: bool = False, decimals: int | None = None,
          dashed_threshold: float | None = None, repeat: str | None = None) -> timeseries.Panel:
    """A time-series panel in the dashboards' one style (lines, or bars for counts per interval)."""
    panel = (common_panel(timeseries.Panel(), title, description, width, height, unit, queries)
             .color_scheme(colour(dm.FieldColorModeId.PALETTE_CLASSIC))
             .draw_style(cm.GraphDrawStyle.BARS if bars else cm.GraphDrawStyle.LINE).line_width(1)
             .fill_opacity(80 if bars else 10).show_points(cm.VisibilityMode.NEVER).span_nulls(False)
             .stacking(common.StackingConfig().mode(cm.StackingMode.NONE).group("A"))
             .thresholds_style(common.GraphThresholdsStyleConfig().mode(
                 cm.GraphTresholdsStyleMode.DASHED if dashed_threshold is not None else cm.GraphTresholdsStyleMode.OFF))
             .thresholds(thresholds(*(((dashed_threshold, "red"),) if dashed_threshold is not None else ())))
             .legend(list_legend()).tooltip(tooltip(cm.TooltipDisplayMode.MULTI, cm.SortOrder.DESCENDING)))
    if log_scale:
        panel = panel.scale_distribution(common.ScaleDistributionConfig().type(cm.ScaleDistribution.LOG).log(10))
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    if decimals is not None:
        panel = panel.decimals(decimals)
    if repeat is not None:
        panel = panel.repeat(repeat).repeat_direction("h")
    return panel


def single(title: str, description: str, unit: str, queries: Sequence[Query], *, width: int, height: int = 4,
           text_mode: cm.BigValueTextMode = cm.BigValueTextMode.AUTO, area: bool = False, instant: bool = False,
           decimals: int | None = None, colour_by: Sequence[tuple[float, str]] = ()) -> stat.Panel:
    """A stat panel: the last value of each series."""
    panel = (common_panel(stat.Panel(), title, description, width, height, unit, queries, instant=instant)
             .color_scheme(colour(dm.FieldColorModeId.THRESHOLDS)).thresholds(thresholds(*colour_by))
             .reduce_options(common.ReduceDataOptions().values(False).calcs(["lastNotNull"]).fields(""))
             .color_mode(cm.BigValueColorMode.VALUE if colour_by else cm.BigValueColorMode.NONE)
             .graph_mode(cm.BigValueGraphMode.AREA if area else cm.BigValueGraphMode.NONE)
             .justify_mode(cm.BigValueJustifyMode.AUTO).orientation(cm.VizOrientation.AUTO).text_mode(text_mode))
    return panel.decimals(decimals) if decimals is not None else panel


def organize(exclude: Sequence[str], rename: dict[str, str] | None = None) -> dm.DataTransformerConfig:
    options: dict = {"excludeByName": dict.fromkeys(exclude, True)}
    if rename:
        options["renameByName"] = rename
    return dm.DataTransformerConfig(id_val="organize", options=options)


MERGE = dm.DataTransformerConfig(id_val="merge", options={})


class TableColumns(cogbuilder.Builder[dm.Panel]):
    """A table panel with column options (alignment, filters) that the SDK's table builder has no setter for."""

    def __init__(self, panel: table.Panel, columns: common.TableFieldOptions) -> None:
        self._panel, self._columns = panel, columns

    def build(self) -> dm.Panel:
        built = self._panel.build()
        built.field_config.defaults.custom = self._columns.build()
        return built


def grid(title: str, description: str, unit: str, queries: Sequence[Query], transformations: list,
         *, width: int = 12, height: int = 8, sort_by: str | None = None) -> TableColumns:
    """A table of instant queries, one column per query after the transformations, filterable by column."""
    panel = (common_panel(table.Panel(), title, description, width, height, unit, queries, instant=True,
                          fmt=pm.PromQueryFormat.TABLE)
             .thresholds(thresholds()).show_header(True).cell_height(cm.TableCellHeight.SM)
             .footer(common.TableFooterOptions().show(False).reducer(["sum"]).fields(""))
             .transformations(transformations))
    if sort_by is not None:
        panel = panel.sort_by([common.TableSortByFieldState().display_name(sort_by).desc(False)])
    return TableColumns(panel, common.TableFieldOptions().align(cm.FieldTextAlignment.AUTO).filterable(True))


def timeline(title: str, description: str, queries: Sequence[Query], mapping: dict[str, tuple[str, str]]
             ) -> statetimeline.Panel:
    """A state timeline of 0/1 series, each value named and coloured by `mapping`."""
    options = {value: dm.ValueMappingResult(text=text, color=color, index=index)
               for index, (value, (text, color)) in enumerate(mapping.items())}
    return (common_panel(statetimeline.Panel(), title, description, 12, 8, "none", queries)
            .color_scheme(colour(dm.FieldColorModeId.THRESHOLDS)).thresholds(thresholds())
            .mappings([dm.ValueMap(options=options)]).fill_opacity(80).line_width(0)
            .show_value(cm.VisibilityMode.NEVER).row_height(0.9).legend(list_legend(False))
            .tooltip(tooltip(cm.TooltipDisplayMode.SINGLE, cm.SortOrder.NONE)).merge_values(True)
            .align_value(cm.TimelineValueAlignment.LEFT))


def against(x_title: str, title: str, description: str, unit: str, x: Query, y: Query, y_title: str
            ) -> xychart.Panel:
    """An XY chart of each run's value (y) against its step or time since start (x)."""
    return (common_panel(xychart.Panel(), title, description, 8, 8, unit, [x, y], fmt=pm.PromQueryFormat.TABLE)
            .color_scheme(colour(dm.FieldColorModeId.PALETTE_CLASSIC)).thresholds(thresholds())
            .show(xm.ScatterShow.LINES).line_width(1).point_size(common.ScaleDimensionConfig().fixed(2))
            .series_mapping(xm.SeriesMapping.AUTO).dims(xychart.XYDimensionConfig().x(x_title))
            .legend(list_legend()).tooltip(tooltip(cm.TooltipDisplayMode.SINGLE, cm.SortOrder.NONE))
            .transformations([MERGE, organize(["Time", "job"], {"Value #A": x_title, "Value #B": y_title}),
                              dm.DataTransformerConfig(id_val="partitionByValues",
                                                       options={"fields": ["run"], "keepFields": False})]))


def alerts(title: str, description: str, label_filter: str, *, width: int, height: int) -> dashboard.Panel:
    """Grafana's alert list (no typed builder for it in the SDK: its options are set as one object)."""
    return (dashboard.Panel().type("alertlist").title(title).description(description).span(width).height(height)
            .options({"viewMode": "list", "groupMode": "default", "groupBy": [], "maxItems": 20, "sortOrder": 1,
                      "dashboardAlerts": False, "alertName": "", "alertInstanceLabelFilter": label_filter,
                      "stateFilter": {"firing": True, "pending": True, "noData": False, "normal": False,
                                      "error": True}}))


# --- the dashboards ----------------------------------------------------------------------------------
def base(uid: str, title: str, description: str, tags: list[str]) -> dashboard.Dashboard:
    """Settings both dashboards share: read-only, shared crosshair, a menu of dualtrack's dashboards."""
    return (dashboard.Dashboard(title).uid(uid).description(description).tags(tags).readonly()
            .tooltip(dm.DashboardCursorSync.CROSSHAIR).refresh("30s").timezone("browser").time("now-1h", "now")
            .fiscal_year_start_month(0).live_now(False)
            .link(dashboard.DashboardLink("dualtrack").type(dm.DashboardLinkType.DASHBOARDS).tags(["dualtrack"])
                  .as_dropdown(True).include_vars(False).keep_time(True).target_blank(False).icon("external link")
                  .tooltip("").url(""))
            .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
                           .regex("").hide(dm.VariableHide.DONT_HIDE).multi(False).include_all(False))
            .annotation(Annotation(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"),
                                   name="Annotations & Alerts", hide=True, icon_color="rgba(0, 211, 255, 1)",
                                   type_val="dashboard", builtIn=1)))


def query_variable(name: str, label: str, query: str, *, multi: bool = True, regex: str = ""
                   ) -> dashboard.QueryVariable:
    return (dashboard.QueryVariable(name).label(label).datasource(DATASOURCE).query(query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).multi(multi).include_all(multi).all_value(".*")
            .sort(dm.VariableSort.ALPHABETICAL_ASC).regex(regex).hide(dm.VariableHide.DONT_HIDE))


class Annotation(cogbuilder.Builder[dm.AnnotationQuery]):
    """An annotation query with fields the SDK's AnnotationQuery model lacks (Grafana's built-in marker,
    and the Prometheus annotation's step, title, tag and text formats), written beside its own."""

    def __init__(self, datasource: dm.DataSourceRef, *, name: str, icon_color: str, hide: bool = False,
                 type_val: str | None = None, expr: str | None = None, **fields: object) -> None:
        self._annotation = dm.AnnotationQuery(name=name, datasource=datasource, enable=True, hide=hide,
                                              icon_color=icon_color, type_val=type_val, expr=expr)
        self._fields = fields

    def build(self) -> dm.AnnotationQuery:
        annotation, fields = self._annotation, self._fields
        annotation.to_json = lambda: {**dm.AnnotationQuery.to_json(annotation), **fields}  # type: ignore[method-assign]
        return annotation


def alert_annotation(name: str, colour_name: str, expr: str, title_format: str, tag_keys: str, text_format: str
                     ) -> Annotation:
    """Firing alerts as markers on every graph (Grafana's Prometheus annotation fields)."""
    return Annotation(DATASOURCE, name=name, icon_color=colour_name, expr=expr, step="60s", titleFormat=title_format,
                      tagKeys=tag_keys, textFormat=text_format)


def gpu_fleet() -> dashboard.Dashboard:
    """Every host and GPU the exporters see."""
    board = (base("dualtrack-gpu-fleet", "dualtrack · GPU fleet",
                  "Every host and GPU the dualtrack exporters see: utilization, memory, power, thermals, clocks, "
                  "throttling, interconnect, errors, processes and exporter health.", ["dualtrack", "gpu", "fleet"])
             .with_variable(query_variable("instance", "Host", "label_values(nvml_up, instance)"))
             .with_variable(query_variable("gpu", "GPU", 'label_values(nvml_gpu_info{instance=~"$instance"}, gpu)'))
             .annotation(alert_annotation(
                 "GPU alerts", "orange", 'ALERTS{alertstate="firing", instance=~"$instance"}',
                 "{{alertname}} · {{instance}} GPU {{gpu}}", "severity,instance",
                 "{{alertname}} ({{severity}}) on {{instance}} GPU {{gpu}}. The summary, description and runbook "
                 "link are in the \"Alerts of these hosts\" panel.")))

    NOT_IDLE, CORRECTED, UNCORRECTED = 'reason!="gpu_idle", ', 'error="corrected", ', 'error="uncorrected", '

    def fleet(metric: str, extra: str = "") -> str:
        return f"{metric}{{{extra}{HOST_GPU}}}"

    for panel in [
        single("Exporters up", "Exporters whose NVML is reachable (nvml_up) out of those Prometheus scrapes.", "none",
               [("NVML up", 'sum(nvml_up{instance=~"$instance"})'),
                ("scraped", 'count(up{job="dualtrack-exporter", instance=~"$instance"})')], width=4),
        single("GPUs", "GPUs reported by the exporters.", "none",
               [("GPUs", f"count({fleet('nvml_gpu_info')})")], width=4),
        single("Mean utilization", "NVML utilization averaged over the selected GPUs.", "percentunit",
               [("utilization", f"avg({fleet('nvml_gpu_utilization_ratio')})")], width=4, area=True),
        single("Total power", "Power draw summed over the selected GPUs.", "watt",
               [("power", f"sum({fleet('nvml_gpu_power_usage_watts')})")], width=4, area=True),
        single("Hottest GPU", "Highest GPU temperature among the selected GPUs.", "celsius",
               [("max", f"max({fleet('nvml_gpu_temperature_celsius')})")], width=4, area=True,
               colour_by=[(80, "orange"), (90, "red")]),
        single("GPUs lost", "GPUs that were seen and are now unreachable (fallen off the bus).", "none",
               [("lost", f"sum({fleet('nvml_gpu_lost')})")], width=4, decimals=0, colour_by=[(1, "red")]),
        common_panel(statushistory.Panel(), "Utilization heat map",
                     "NVML utilization of every GPU over time, one row per host and GPU: dark/green idle, red busy. "
                     "Striped rows are GPUs alternating between busy and idle (input-bound).", 24, 8, "percentunit",
                     [(FLEET_GPU, fleet("nvml_gpu_utilization_ratio"))])
        .min(0).max(1).color_scheme(colour(dm.FieldColorModeId.CONTINUOUS_GR_YL_RD)).thresholds(thresholds())
        .fill_opacity(80).line_width(0).show_value(cm.VisibilityMode.NEVER).row_height(0.9)
        .legend(list_legend(False)).tooltip(tooltip(cm.TooltipDisplayMode.SINGLE, cm.SortOrder.NONE))
        .max_data_points(120),
        graph("Memory used", "Used share of each GPU's memory. A staircase that never comes down is a leak.",
              "percentunit",
              [(FLEET_GPU, f"{fleet('nvml_gpu_memory_used_bytes')} / {fleet('nvml_gpu_memory_total_bytes')}")],
              min_value=0, max_value=1),
        graph("Power vs limit", "Power draw per GPU and its enforced power limit.", "watt",
              [(legend(FLEET_GPU, "power"), fleet("nvml_gpu_power_usage_watts")),
               (legend(FLEET_GPU, "limit"), fleet("nvml_gpu_power_limit_watts"))], min_value=0),
        graph("Temperature", "GPU core and memory (HBM) temperature; dashed: 85 °C, where GPUTemperatureHigh warns "
              "for the core.", "celsius",
              [(legend(FLEET_GPU, "core"), fleet("nvml_gpu_temperature_celsius")),
               (legend(FLEET_GPU, "memory"), fleet("nvml_gpu_memory_temperature_celsius"))], dashed_threshold=85),
        graph("Clocks", "SM and memory clocks per GPU and their maxima.", "hertz",
              [(legend(FLEET_GPU, "{{clock}}"), fleet("nvml_gpu_clock_hertz", 'clock=~"sm|memory", ')),
               (legend(FLEET_GPU, "{{clock}} max"), fleet("nvml_gpu_clock_max_hertz", 'clock=~"sm|memory", '))],
              min_value=0),
        timeline("Throttle reasons", "Active NVML clock throttle reasons per GPU (idle clock-down excluded): power "
                 "cap, thermal and hardware slowdowns show as coloured bands.",
                 [(legend(FLEET_GPU, "{{reason}}"),
                   f"max by (instance, gpu, reason) ({fleet('nvml_gpu_throttle_active', NOT_IDLE)})")],
                 {"0": ("-", "transparent"), "1": ("throttled", "red")}),
        graph("PCIe throughput", "PCIe receive and transmit throughput per GPU.", "binBps",
              [(legend(FLEET_GPU, "{{direction}}"), fleet("nvml_gpu_pcie_throughput_bytes_per_second"))], min_value=0),
        graph("NVLink throughput", "NVLink data received and transmitted per GPU (all links).", "binBps",
              [(legend(FLEET_GPU, "{{direction}}"),
                f"sum by (instance, gpu, direction) ({rate('nvml_gpu_nvlink_data_bytes_total', HOST_GPU)})")],
              min_value=0),
        graph("ECC errors and XIDs", "New ECC errors (corrected/uncorrected) and XID errors per interval. "
              "Uncorrected ECC and XIDs 48/63/64/74/79 need attention (GPUXidError).", "none",
              [(legend(FLEET_GPU, "ECC {{error}}"),
                f"sum by (instance, gpu, error) ({increase('nvml_gpu_ecc_errors_total', HOST_GPU)})"),
               (legend(FLEET_GPU, "XID {{xid}}"),
                f"sum by (instance, gpu, xid) ({increase('nvml_gpu_xid_errors_total', HOST_GPU)})")],
              min_value=0, bars=True, decimals=0),
        graph("Processes: SM utilization", "Share of time each GPU process ran kernels on the SMs (NVML per-process "
              "samples, nvidia-smi pmon's sm). On a shared or time-sliced GPU it tells which process computes, where "
              "the GPU's own utilization is one number for all: a process of no run that computes is a co-tenant "
              "(dualtrack explain). Empty where the driver has no per-process utilization (MIG, some boards).",
              "percentunit", [(legend(FLEET_GPU, "{{process}} pid {{pid}}"),
                               fleet("nvml_gpu_process_sm_utilization_ratio"))], width=24, min_value=0, max_value=1),
        grid("Processes", "Processes holding GPU memory (host PIDs; the exporter needs the host PID namespace to "
             "name them).", "bytes", [("__auto", fleet("nvml_gpu_process_memory_used_bytes"))],
             [organize(["Time", "__name__", "job", "uuid"], {"Value": "GPU memory"})]),
        grid("Memory health and XIDs (since exporter start)", "Counters per GPU: ECC errors, memory repairs "
             "(remapped rows on Ampere and newer, retired pages before) and XID errors.", "none",
             [("ECC corrected", f"sum by (instance, gpu) ({fleet('nvml_gpu_ecc_errors_total', CORRECTED)})"),
              ("ECC uncorrected",
               f"sum by (instance, gpu) ({fleet('nvml_gpu_ecc_errors_total', UNCORRECTED)})"),
              ("remapped rows / retired pages", f"sum by (instance, gpu) ({fleet('nvml_gpu_remapped_rows_total')}) "
               f"or sum by (instance, gpu) ({fleet('nvml_gpu_retired_pages_total')})"),
              ("XID errors", f"sum by (instance, gpu) ({fleet('nvml_gpu_xid_errors_total')}) "
               f"or sum by (instance, gpu) (0 * {fleet('nvml_gpu_info')})")],
             [MERGE, organize(["Time"], {"Value #A": "ECC corrected", "Value #B": "ECC uncorrected",
                                         "Value #C": "remapped rows / retired pages", "Value #D": "XID errors"})]),
        grid("GPU inventory", "Every GPU: model, UUID, PCI bus id, whether it is simulated, and the driver.", "none",
             [("__auto", f"{fleet('nvml_gpu_info')} * on (instance) group_left (driver_version, cuda_driver_version) "
               'nvml_driver_info{instance=~"$instance"}')],
             [organize(["Time", "__name__", "job", "Value"])]),
        timeline("Collectors", "Whether each collector of each exporter succeeded on its last run (failures are "
                 "counted by reason in Collector errors).",
                 [("{{instance}} {{collector}}", 'nvml_exporter_collector_success{instance=~"$instance"}')],
                 {"0": ("failing", "red"), "1": ("ok", "green")}),
        graph("Snapshot age", "Age of each exporter's latest NVML snapshot. It stays near the sample interval; a "
              "growing age means the sampler is stuck (a hung NVML call).", "s",
              [("{{instance}}", 'nvml_exporter_snapshot_age_seconds{instance=~"$instance"}')], min_value=0),
        graph("Collector errors", "NVML errors per second by exporter and collector (0 when healthy).",
              "suffix: errors/s",
              [("{{instance}} {{collector}}", "sum by (instance, collector) "
                f"({rate('nvml_exporter_errors_total', HOST)}) or sum by (instance, collector) "
                '(0 * nvml_exporter_collector_success{instance=~"$instance"})')], min_value=0),
        graph("Power from the energy counter", "Average power between samples computed from NVML's energy counter: "
              "unlike the sampled power draw it misses no short spikes.", "watt",
              [(FLEET_GPU, rate("nvml_gpu_energy_joules_total", HOST_GPU))], min_value=0),
        graph("Fan speed", "Fan speed per GPU and fan, as a share of its maximum.", "percentunit",
              [(legend(FLEET_GPU, "fan {{fan}}"), fleet("nvml_gpu_fan_speed_ratio"))], min_value=0, max_value=1),
        graph("GPU busy and idle share", "Busy share: the rate of busy seconds, i.e. mean utilization (a steady 40 % "
              "reads 40 %). Idle share: time below the exporter's idle threshold. They need not add up to 100 %. A GPU "
              "alternating between busy and idle faster than the scrape (an input-bound job) shows a high idle share "
              "here while its sampled utilization looks random.", "percentunit",
              [(legend(FLEET_GPU, "busy"), rate("nvml_gpu_busy_seconds_total", HOST_GPU)),
               (legend(FLEET_GPU, "idle"), rate("nvml_gpu_idle_seconds_total", HOST_GPU))], min_value=0, max_value=1),
        graph("SM, tensor and DRAM activity", "Share of time the SMs, tensor cores and DRAM interface were active "
              "(NVML GPM: Hopper and newer; empty on older GPUs).", "percentunit",
              [(legend(FLEET_GPU, "SM"), fleet("nvml_gpu_sm_active_ratio")),
               (legend(FLEET_GPU, "tensor"), fleet("nvml_gpu_tensor_active_ratio")),
               (legend(FLEET_GPU, "DRAM"), fleet("nvml_gpu_dram_active_ratio"))], min_value=0, max_value=1),
        alerts("Alerts of these hosts", "Alerts Prometheus evaluates for the selected hosts, with summary, "
               "description and runbook link (expand an alert). The orange markers on the graphs are the same alerts "
               "in time.", '{instance=~"$instance"}', width=24, height=8),
    ]:
        board = board.with_panel(panel)
    return board


def model(title: str, description: str, unit: str, queries: Sequence[Query], **options) -> timeseries.Panel:
    """A Model-track panel of the Training run: one series per rank."""
    return graph(f"Model · {title}", description, unit, queries, **options)


def infra(title: str, description: str, unit: str, queries: Sequence[Query], **options) -> timeseries.Panel:
    """An Infra-track panel of the Training run: the run's GPUs (and MIG instances) while it runs on them."""
    return graph(f"Infra · {title}", description, unit, queries, **options)


def whole(metric_expr: str, suffix: str = "") -> Query:
    """The run's whole GPUs' `metric_expr`, legend GPU plus `suffix`."""
    return legend(GPU, suffix), on_run_gpus(metric_expr)


def mig(metric_expr: str, suffix: str) -> Query:
    """The run's MIG instances' `metric_expr`, legend MIG plus `suffix`."""
    return legend(MIG, suffix), on_run_mig(metric_expr)


def run_stat(title: str, description: str, expr: str, *, unit: str = "none", decimals: int | None = 0,
             text_mode: cm.BigValueTextMode = cm.BigValueTextMode.VALUE_AND_NAME, legend_format: str = "{{run}}"
             ) -> stat.Panel:
    return single(title, description, unit, [(legend_format, expr)], width=3, instant=True, text_mode=text_mode,
                  decimals=decimals)


def training_run() -> dashboard.Dashboard:
    """Runs compared, then one run's Model and Infra tracks side by side."""
    board = (base("dualtrack-training-run", "dualtrack · Training run",
                  "Training runs: compare a sweep against the step and over each run's own life, then one run's Model "
                  "track (hook) and Infra track (its GPUs while it runs on them) side by side on one time axis with a "
                  "shared crosshair.", ["dualtrack", "training", "gpu"])
             .with_variable(query_variable("job", "Job", "label_values(training_steps_total, job)", multi=False))
             .with_variable(query_variable("hparam", "Hyper-parameter", 'label_names(training_run_info{job=~"$job"})',
                                           multi=False, regex="/^(?!(job|run|rank|instance|__name__)$).+/"))
             .with_variable(query_variable("hvalue", "Value", 'label_values(training_run_info{job=~"$job"}, $hparam)'))
             .with_variable(query_variable(
                 "run", "Run", 'label_values(training_run_info{job=~"$job", $hparam=~"$hvalue"}, run)'))
             .with_variable(query_variable(
                 "instance", "Host", f'label_values(training_steps_total{{{JOB_RUN}}}, instance)'))
             .with_variable(query_variable(
                 "gpu", "GPU", f'label_values(training_gpu_info{{{RUN}}}, uuid)'))
             .with_variable(query_variable(
                 "key", "Custom key", f'label_values(training_logged_value_count{{{JOB_RUN}}}, key)',
                 regex="/^(?!(loss|grad_norm|learning_rate|epoch)$).+/"))
             .annotation(alert_annotation(
                 "Run alerts", "red", f'ALERTS{{alertstate="firing", {JOB_RUN}}}', "{{alertname}} · {{run}}",
                 "severity,run", "{{alertname}} ({{severity}}): run {{run}} rank {{rank}} on {{instance}}. The "
                 "summary, description and runbook link are in the \"Alerts of these runs\" panel."))
             .annotation(alert_annotation(
                 "GPU alerts", "orange", 'ALERTS{alertstate="firing"} * on (uuid) group_left (run, rank) max by '
                 f'(uuid, run, rank) (training_gpu_info{{{RUN}, uuid=~"$gpu"}} {LIVE})',
                 "{{alertname}} · GPU {{gpu}} of {{run}}", "severity,run",
                 "{{alertname}} ({{severity}}): GPU {{gpu}} ({{uuid}}) on {{instance}}, which run {{run}} rank "
                 "{{rank}} trains on. The summary, description and runbook link are in the \"Alerts of these runs\" "
                 "panel.")))

    record = "where to look in the record (./dualtrack-records/)"
    for panel in [
        run_stat("Run state", "Current state pushed by the hook: running, finished or failed.",
                 f"max by (run, state) (training_run_state{{{RUN}}}) == 1", decimals=None,
                 text_mode=cm.BigValueTextMode.NAME, legend_format="{{run}}: {{state}}"),
        run_stat("Step", "Latest step of each run (max over its ranks).", f"max by (run) (training_step{{{RUN}}})"),
        run_stat("Samples/s", "Samples per second, all ranks of the run together.",
                 f"sum by (run) ({rate('training_samples_total')})", unit="short", decimals=None),
        run_stat("Step of max grad norm", "The step at which the largest gradient norm of the last push window was "
                 "seen: where a spike happened, to look up in the record (./dualtrack-records/).",
                 f"max by (run) (training_grad_norm_max_step{{{RUN}}})"),
        run_stat("Non-finite steps", "Steps that logged a NaN or Inf value since the run started.",
                 f"sum by (run) (training_nonfinite_steps_total{{{RUN}}})"),
        run_stat("First non-finite step", "First step of the current streak of non-finite steps (-1: none): "
                 f"{record} for the bad batch.", f"min by (run) (training_first_nonfinite_step{{{RUN}}})"),
        run_stat("Last non-finite step", "Most recent step that logged a NaN or Inf value.",
                 f"max by (run) (training_last_nonfinite_step{{{RUN}}})"),
        run_stat("GPU busy share", "Mean GPU utilization of the runs' GPUs over the interval: the busy seconds' rate "
                 "(the exporter integrates utilization every sample), so a steady 40 % reads 40 %.",
                 f"avg by (run) ({on_run_gpus('instance_gpu:nvml_gpu_busy_seconds:rate5m')} or "
                 f"{on_run_mig('instance_gpu_mig:nvml_gpu_mig_busy:avg5m')})", unit="percentunit", decimals=None),
    ]:
        board = board.with_panel(panel)

    step = ("{{run}}", f"max by (job, run) (training_step{{{RUN}}})")
    board = board.with_row(dashboard.Row("Compare runs: against the step, and against the time since each run's start")
                           .collapsed(False))
    for panel in [
        against("step", "Loss vs step", "Mean loss of each selected run against its step: runs of a sweep overlaid on "
                "the same x-axis, whatever their speed. Exact mean of every logged value over the interval where the "
                "hook sends sums and counts, else the last logged value.", "none",
                step, ("{{run}}", run_mean("loss", "training_loss")), "loss"),
        against("step", "Gradient norm vs step", "Mean gradient norm of each run against its step.", "none",
                step, ("{{run}}", run_mean("grad_norm", "training_grad_norm")), "grad norm"),
        against("step", "Learning rate vs step", "The schedule of each run against its step.", "none",
                step, ("{{run}}", f"avg by (job, run) (training_learning_rate{{{RUN}}})"), "learning rate"),
        against("step", "Throughput vs step", "Samples per second of each run (all ranks) against its step.", "short",
                step, ("{{run}}", f"sum by (job, run) ({rate('training_samples_total')})"), "samples/s"),
        against("seconds since start", "Loss vs time since start", "Mean loss of each run against the seconds since "
                "that run started: compares wall-clock efficiency of runs started at different times.", "none",
                ("{{run}}", f"time() - min by (job, run) (training_start_timestamp_seconds{{{RUN}}})"),
                ("{{run}}", run_mean("loss", "training_loss")), "loss"),
        graph("Step rate across ranks: min, median, max", "Steps per second of each run's slowest, median and fastest "
              "rank (5 min rates). A min far below the median is a straggler: the whole run waits for it at every "
              "synchronisation.", "none",
              [(f"{{{{run}}}} {name.rsplit('_', 1)[1]}", f"{name}{{{JOB_RUN}}}") for name in (
                  "job_run:training_steps:rate5m_min", "job_run:training_steps:rate5m_median",
                  "job_run:training_steps:rate5m_max")], width=8),
        runs_table(),
        alerts("Alerts of these runs", "Alerts Prometheus evaluates for the selected runs (with Run = All, the GPU "
               "alerts too; their orange markers are on the graphs), with summary, description and runbook link: "
               "expand an alert to read them. The red markers on the graphs are the same alerts on the time axis.",
               '{run=~"$run"}', width=8, height=9),
    ]:
        board = board.with_panel(panel)

    board = board.with_row(dashboard.Row(
        "Model track (the hook) | Infra track (the run's GPUs while it runs on them)").collapsed(False))
    busy = "instance_gpu_mig:nvml_gpu_mig_busy:avg5m"
    for panel in side_by_side(busy):
        board = board.with_panel(panel)

    board = board.with_row(dashboard.Row("Step time and tokens").collapsed(False))
    for panel in [
        common_panel(heatmap.Panel(), "Step time distribution", "How long steps took (the hook's histogram), per "
                     "interval: one band is a steady run; a second band of slow steps is a periodic stall (data "
                     "loading, checkpoints, a straggling rank).", 12, 8, "s",
                     [("{{le}}", f"sum by (le) ({increase('training_step_duration_seconds_bucket')})")],
                     fmt=pm.PromQueryFormat.HEATMAP)
        .hide_from(common.HideSeriesConfig().legend(False).tooltip(False).viz(False))
        .scale_distribution(common.ScaleDistributionConfig().type(cm.ScaleDistribution.LINEAR))
        .calculate(False).y_axis(heatmap.YAxisConfig().axis_placement(cm.AxisPlacement.LEFT).unit("s")).cell_gap(1)
        .color(heatmap.HeatmapColorOptions().mode("scheme").scheme("Oranges").steps(64).scale("exponential")
               .exponent(0.5).fill("dark-orange").reverse(False))
        .rows_frame(heatmap.RowsHeatmapOptions().layout("auto"))
        .filter_values(heatmap.FilterValueRange().le(1e-09))
        .show_tooltip().show_y_histogram().show_legend().exemplars_color("rgba(255,0,255,0.7)"),
        graph("Mean step time", "Mean seconds per step of each rank (histogram sum / count).", "s",
              [(RANK,
                f"{rate('training_step_duration_seconds_sum')} / {rate('training_step_duration_seconds_count')}")],
              width=6),
        graph("Tokens/s", "Tokens per second of each rank, for runs that pass tokens= to log().", "short",
              [(RANK, rate("training_tokens_total"))], width=6),
    ]:
        board = board.with_panel(panel)

    board = board.with_row(dashboard.Row("Goodput: GPU-seconds that counted, tokens per joule, ETA").collapsed(False))
    for panel in [
        graph("Goodput", "Share of the run's GPU-seconds in steps that counted: not waiting for data or idle, not "
              "skipped (loss-scale overflow) nor non-finite (NaN/Inf), not stalled or restarting (rules/goodput.yml).",
              "percentunit", [("{{run}}", f"job_run:training_goodput:ratio_rate5m{{{JOB_RUN}}}")], width=6),
        single("Goodput over the range", "The run's goodput averaged over the dashboard's time range: the share of "
               "its GPU-seconds that counted.", "percentunit",
               [("{{run}}", f"avg_over_time(job_run:training_goodput:ratio_rate5m{{{JOB_RUN}}}[$__range])")],
               width=6, height=8, instant=True, text_mode=cm.BigValueTextMode.VALUE_AND_NAME),
        graph("Tokens per joule", "Tokens per joule of the run's GPUs' energy counter, while the run runs on them "
              "(samples per joule for runs that log no tokens).", "short",
              [("{{run}}", f"job_run:training_tokens_per_joule:rate5m{{{JOB_RUN}}} or "
                f"job_run:training_samples_per_joule:rate5m{{{JOB_RUN}}}")], width=6),
        single("ETA", "Time left at the last 5 minutes' step rate, for runs that log max_steps (log(max_steps=N)); "
               "the slowest rank's.", "s", [("{{run}}", f"job_run:training_eta_seconds:rate5m{{{JOB_RUN}}}")],
               width=6, height=8, instant=True, text_mode=cm.BigValueTextMode.VALUE_AND_NAME),
        graph("Goodput lost, by reason", "Share of the run's GPU-seconds lost to each reason: non-finite steps, "
              "steps skipped for loss-scale overflow, waiting (for data, or the GPU idle), running without "
              "stepping, a restart under way (rules/goodput.yml).", "percentunit",
              [("{{run}} {{reason}}", f"job_run_reason:training_lost:ratio_rate5m{{{JOB_RUN}}}")], width=24),
        graph("MFU", "Model FLOPs utilization: the run's model FLOP/s (training_model_flops_total: flops_per_token "
              "or flops_per_sample x what it logs, else 6 x parameters x tokens) over the dense peak FLOP/s of its "
              "GPUs at the run's precision (NVIDIA's datasheets, rules/gpu_peaks.yml). Empty for GPU models not in "
              "the table and MIG instances. TrainingMFUDrop fires after 15 min below the second line: 75 % of the "
              "run's last-hour median.", "percentunit",
              [("{{run}}", f"job_run:training_mfu:ratio{{{JOB_RUN}}}"),
               ("{{run}} 75 % of last-hour median",
                f"0.75 * quantile_over_time(0.5, job_run:training_mfu:ratio{{{JOB_RUN}}}[1h])")],
              width=24, min_value=0),
        graph("Paused, by reason", "Share of the run's wall time its ranks spent inside monitor.paused(reason) "
              "(checkpoints, evaluations: the integrations pause around the framework's own), by reason; it does "
              "not count towards goodput. Up to 15 min a pause holds back the hang and stall alerts; past it, "
              "TrainingPauseTooLong fires.", "percentunit",
              [("{{run}} {{reason}}", f"job_run:training_paused:ratio_rate5m{{{JOB_RUN}}}")],
              width=12, min_value=0, max_value=1),
        graph("Replica divergence", "DDP: compared steps at which a rank's post-reduction gradient norm was not the "
              "one its peers hold (bit for bit); any value above 0 is a corrupted replica "
              "(TrainingReplicaDivergence).", "short",
              [(RANK, f"training_replica_divergent_steps_total{{{RUN}}}")], width=12, min_value=0),
    ]:
        board = board.with_panel(panel)

    board = board.with_row(dashboard.Row("Custom keys").collapsed(False))
    board = board.with_panel(graph(
        "$key", "A custom key logged by the run (one panel per key, repeated over the Key variable): exact mean over "
        "the interval from the hook's sums and counts.", "none", [(RANK, logged_mean("$key"))], width=8,
        repeat="key"))

    per_run = dashboard.Row("Run $run").repeat("run")
    for panel in [
        graph("Data wait and GPU idle of $run", "This run's data-wait share (the hook) and the idle share of its GPUs "
              "(the exporter): both high together is an input-bound run.", "percentunit",
              [(legend(RANK, "data wait"), rate("training_data_wait_seconds_total")),
               whole("rate(nvml_gpu_idle_seconds_total[$__rate_interval])", "GPU idle"),
               mig(f"1 - {busy}", "GPU idle (5 min mean)")], width=6, min_value=0, max_value=1),
        graph("Gradient norm of $run", "This run's gradient-norm window maximum per rank (log scale).", "none",
              [(RANK, f"training_grad_norm_max{{{RUN}}}")], width=6, log_scale=True),
        graph("GPU memory of $run", "Memory used on this run's GPUs, and their total.", "bytes",
              [whole("nvml_gpu_memory_used_bytes", "used"), whole("nvml_gpu_memory_total_bytes", "total"),
               mig("nvml_gpu_mig_memory_used_bytes", "used"), mig("nvml_gpu_mig_memory_total_bytes", "total")],
              width=6),
        graph("Loss of $run", "This run's mean loss per rank.", "none",
              [(RANK, logged_mean_or_last("loss", "training_loss"))], width=6),
    ]:
        per_run = per_run.with_panel(panel)
    return board.with_row(per_run)


def runs_table() -> table.Panel:
    """Every selected run with its hyper-parameters and its whole life's figures."""
    def over_life(function: str, metric: str, aggregate: str) -> str:
        return f"{aggregate} by (job, run) ({function}({metric}{{{JOB_RUN}}}[30d]))"

    duration = (f"({over_life('max_over_time', 'training_last_update_timestamp_seconds', 'max')} - "
                f"{over_life('min_over_time', 'training_start_timestamp_seconds', 'min')})")
    return grid(
        "Runs over their own life", "Every selected run with its hyper-parameters (the labels of training_run_info) "
        "and, over the run's whole life (the last 30d Prometheus keeps, whatever the dashboard's range): state, "
        "duration, steps, final and best loss, mean throughput (samples over the run's duration) and non-finite "
        "steps. Sort by a column to rank the sweep.", "none",
        [("state", with_hparams(f"topk by (job, run) (1, max by (job, run, state) (last_over_time(training_run_state"
                                f"{{{JOB_RUN}}}[30d]) == 1))", keep="state")),
         ("duration (h)", with_hparams(f"{duration} / 3600")),
         ("steps", with_hparams(over_life("max_over_time", "training_step", "max"))),
         ("final loss", with_hparams(over_life("last_over_time", "training_loss", "avg"))),
         ("best loss", with_hparams(over_life("min_over_time", "training_loss", "min"))),
         ("samples/s", with_hparams(f"{over_life('max_over_time', 'training_samples_total', 'sum')} / {duration}")),
         ("non-finite steps", with_hparams(over_life("max_over_time", "training_nonfinite_steps_total", "sum")))],
        [MERGE, organize(["Time", "__name__", "Value #A"],
                         {"Value #B": "duration (h)", "Value #C": "steps", "Value #D": "final loss",
                          "Value #E": "best loss", "Value #F": "samples/s", "Value #G": "non-finite steps"})],
        width=16, height=9, sort_by="best loss")


def side_by_side(busy: str) -> list:
    """The Model track (left) and the Infra track (right), row by row on one time axis."""
    return [
        model("Data-wait share", "Seconds the loop waited for its next batch per second of wall time "
              "(monitor.loader). Above the dashed 30 % for minutes fires TrainingDataLoaderBottleneck. Under DDP "
              "(watch(model) times the all-reduces), each rank's share of step time spent waiting in the collectives: "
              "the rank the others wait for waits least (TrainingStragglerRank).", "percentunit",
              [(RANK, rate("training_data_wait_seconds_total")),
               (legend(RANK, "collective wait"), f"job_run_rank:training_collective_wait:ratio2m{{{RUN}}}")],
              min_value=0, max_value=1, dashed_threshold=0.3),
        infra("GPU busy and idle share (heartbeat)", "Busy share: the rate of busy seconds, i.e. the mean utilization "
              "(a steady 40 % reads 40 %). Idle share: the share of time spent below the exporter's idle threshold. "
              "They need not add up to 100 %. A GPU waiting for data shows a high idle share next to a high data-wait "
              "share on the left; the heartbeat itself (seconds of busy, seconds of idle) is faster than a 15 s scrape "
              "and shows here, not in raw utilization. A run on a MIG GPU instance: its instance's busy share (mean "
              "utilization, or GPM SM activity where the driver reports none) and 1 minus it, as 5-min means (MIG has "
              "no busy/idle counters).", "percentunit",
              [whole("rate(nvml_gpu_busy_seconds_total[$__rate_interval])", "busy"),
               whole("rate(nvml_gpu_idle_seconds_total[$__rate_interval])", "idle"),
               mig(busy, "busy (5 min mean)"), mig(f"1 - {busy}", "idle (5 min mean)")],
              min_value=0, max_value=1, dashed_threshold=0.5),
        model("Gradient norm", "Mean gradient norm per rank (exact where the hook sends sums and counts) and its "
              "window maximum (dashed; log scale). TrainingGradientExplosion compares the window maximum with the "
              "run's own median.", "none",
              [(RANK, logged_mean_or_last("grad_norm", "training_grad_norm")),
               (legend(RANK, "window max"), f"training_grad_norm_max{{{RUN}}}")], log_scale=True),
        infra("SM, tensor and DRAM activity", "Share of time the SMs, the tensor cores and the DRAM interface were "
              "active (NVML GPM, Hopper and newer; empty on older GPUs). Utilization says a kernel ran; these say how "
              "much of the GPU it used. A run on a MIG GPU instance: its instance's own GPM activity.", "percentunit",
              [whole("nvml_gpu_sm_active_ratio", "SM"), whole("nvml_gpu_tensor_active_ratio", "tensor"),
               whole("nvml_gpu_dram_active_ratio", "DRAM"), mig("nvml_gpu_mig_sm_active_ratio", "SM"),
               mig("nvml_gpu_mig_tensor_active_ratio", "tensor"), mig("nvml_gpu_mig_dram_active_ratio", "DRAM")],
              min_value=0, max_value=1),
        model("CUDA memory allocated vs reserved", "What the program holds (allocated) and what PyTorch's caching "
              "allocator keeps from the driver (reserved). A staircase in allocated is the program's leak (tensors "
              "kept across steps); reserved far above allocated is the allocator's cache, not a leak. CUDA runs only.",
              "bytes", [(legend(RANK, "allocated"), f"training_cuda_memory_allocated_bytes{{{RUN}}}"),
                        (legend(RANK, "reserved"), f"training_cuda_memory_reserved_bytes{{{RUN}}}")]),
        infra("GPU memory used vs total, OOM trend", "Memory used on the run's GPUs (NVML: every process and the CUDA "
              "context), the total, and where the last hour's slope puts used memory in 4 h (dashed): when it "
              "crosses the total, GPUMemoryLeakSuspected fires, well before the OOM. A run on a MIG GPU instance: its "
              "parent GPU's and its instance's own memory (the instance fills first).", "bytes",
              [whole("nvml_gpu_memory_used_bytes", "used"), whole("nvml_gpu_memory_total_bytes", "total"),
               whole("instance_gpu:nvml_gpu_memory_used_bytes:predict_linear1h_4h", "trend in 4 h"),
               mig("nvml_gpu_mig_memory_used_bytes", "used"), mig("nvml_gpu_mig_memory_total_bytes", "total")]),
        model("Loss", "Mean loss per rank over the interval (exact, from the hook's sums and counts; the last logged "
              "value from older hooks) and the largest loss of each push window (dashed), so a one-step spike between "
              "two pushes is never missed.", "none",
              [(RANK, logged_mean_or_last("loss", "training_loss")),
               (legend(RANK, "window max"), f"training_loss_max{{{RUN}}}")]),
        infra("Power vs limit", "Power draw of the run's GPUs and their power limit. A sawtooth between idle and full "
              "power is the input-bound heartbeat.", "watt",
              [whole("nvml_gpu_power_usage_watts"), whole("nvml_gpu_power_limit_watts", "limit")]),
        model("Step rate", "Steps per second of each rank.", "none", [(RANK, rate("training_steps_total"))]),
        infra("Utilization", "Kernel utilization (share of time a kernel ran) and memory-controller utilization of the "
              "run's GPUs, as sampled; at a 15 s scrape a 2 s heartbeat aliases, so read the busy/idle shares above "
              "for it. Per process: the SM utilization of every process on those GPUs, the run's own and any other "
              "(a process of no run that computes is a co-tenant, which dualtrack explain names).", "percentunit",
              [whole("nvml_gpu_utilization_ratio", "kernels"),
               whole("nvml_gpu_memory_controller_utilization_ratio", "memory"),
               whole("nvml_gpu_process_sm_utilization_ratio", "SM · {{process}} pid {{pid}}")],
              min_value=0, max_value=1),
        model("Throughput", "Samples per second of each rank.", "short", [(RANK, rate("training_samples_total"))]),
        infra("PCIe throughput", "Host↔GPU traffic of the run's GPUs: input batches arrive this way.", "binBps",
              [whole("nvml_gpu_pcie_throughput_bytes_per_second", "{{direction}}")]),
        model("Non-finite and skipped steps", "Steps with a NaN or Inf value per interval, and steps the GradScaler "
              "skipped for an overflow (runs with a scaler; an fp16 overflow is not a NaN loss).", "none",
              [(legend(RANK, "non-finite"), increase("training_nonfinite_steps_total")),
               (legend(RANK, "skipped"), increase("training_skipped_steps_total"))], bars=True),
        infra("Temperature", "Core temperature of the run's GPUs (dashed: 85 °C, GPUTemperatureHigh).", "celsius",
              [whole("nvml_gpu_temperature_celsius")], dashed_threshold=85),
        model("Allocator retries and OOMs", "Allocations the CUDA caching allocator retried after freeing its cache, "
              "and out-of-memory errors, per interval: retries climbing before an OOM mean memory pressure. CUDA runs "
              "only.", "none",
              [(legend(RANK, "retries"), increase("training_cuda_alloc_retries_total")),
               (legend(RANK, "OOMs"), increase("training_cuda_ooms_total"))], bars=True),
        infra("GPU memory of the run's processes", "GPU memory NVML attributes to each process of the run (its PID "
              "in its own namespace and start time joined with the hook's training_process_info pid and start_time, "
              "which needs no privilege; else its PID namespace and PID in it with pid_namespace and pid; a run with "
              "neither on the pid): the run's own share of the memory above.", "bytes",
              [("{{run}} r{{rank}} · pid {{pid}} · {{instance}} GPU {{gpu}}",
                "nvml_gpu_process_memory_used_bytes * on (namespace_pid, start_time) group_left (run, rank) "
                "max by (namespace_pid, start_time, run, rank) (label_join(training_process_info"
                f'{{{RUN}, start_time!=""}}, "namespace_pid", "", "pid")) or nvml_gpu_process_memory_used_bytes '
                "* on (pid_namespace, namespace_pid) group_left (run, rank) "
                "max by (pid_namespace, namespace_pid, run, rank) (label_join(training_process_info"
                f'{{{RUN}, pid_namespace!=""}}, "namespace_pid", "", "pid")) or nvml_gpu_process_memory_used_bytes '
                "* on (pid) group_left (run, rank) max by (pid, run, rank) "
                f'(training_process_info{{{RUN}, pid_namespace="", start_time=""}})')]),
        model("Learning rate", "Learning rate per rank, as logged.", "none",
              [(RANK, f"training_learning_rate{{{RUN}}}")]),
        infra("Throttle reasons", "Share of time each GPU was throttled, per reason (idle clock-down excluded).",
              "percentunit", [whole('rate(nvml_gpu_throttle_seconds_total{reason!="gpu_idle"}[$__rate_interval])',
                                    "{{reason}}")], min_value=0, max_value=1),
        model("Loss scale", "fp16 loss scale of the GradScaler (log scale): it halves at each overflow (a skipped "
              "step, counted in the panel above) and grows back; a scale that keeps falling is "
              "TrainingLossScaleCollapse. Runs that watch a GradScaler only.", "none",
              [(RANK, f"training_loss_scale{{{RUN}}}")], log_scale=True),
        infra("SM clock vs max", "SM clock of the run's GPUs and its maximum: a clock well below the maximum "
              "under load is throttling.", "hertz",
              [whole('nvml_gpu_clock_hertz{clock="sm"}'), whole('nvml_gpu_clock_max_hertz{clock="sm"}', "max")]),
    ]


DASHBOARDS: dict[str, Callable[[], dashboard.Dashboard]] = {
    "gpu-fleet.json": gpu_fleet, "training-run.json": training_run}


def numbered(board: dashboard.Dashboard) -> dict:
    """The dashboard as JSON, panels (also those in collapsed rows) numbered in order from 1.

    Two fields this SDK release always writes are left out: `style` (gone from Grafana's dashboard schema)
    and the variables' placeholder `id` (all zeros; Grafana's schema has no such field).
    """
    document = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    document.pop("style", None)
    for variable in document["templating"]["list"]:
        variable.pop("id", None)
    number = 0
    for panel in document["panels"]:
        for each in (panel, *panel.get("panels", ())):
            number += 1
            each["id"] = number
    return document


def render(name: str) -> str:
    return json.dumps(numbered(DASHBOARDS[name]()), indent=2, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed dashboard differs from the built one")
    args = parser.parse_args(argv)
    stale = []
    for name in DASHBOARDS:
        text, path = render(name), HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"dashboards/{', '.join(stale)} differ from dashboards/generate.py: run `python dashboards/generate.py`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
