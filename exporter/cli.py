"""`dualtrack-exporter` / `python -m exporter`: flags, start-up, signal handling, exit codes.

Exit codes: 0 clean stop (SIGTERM/SIGINT), 1 no NVIDIA driver/NVML or a runtime failure (such as a
port already in use), 2 a bad flag, environment variable or config file.
Every flag has an environment equivalent: --web.listen-address is DUALTRACK_EXPORTER_WEB_LISTEN_ADDRESS,
--collector.processes is DUALTRACK_EXPORTER_COLLECTOR_PROCESSES=true|false. Flags win over the environment.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from exporter import __version__, kernellog, privileges
from exporter.collectors import ALL, podresources
from exporter.exposition import Exposition
from exporter.nvml import Nvml, NvmlUnavailable
from exporter.sampler import Sampler
from exporter.simulated import SCENARIOS, SimulatedNVML
from exporter.web import WebServer
from exporter.webconfig import WebConfigError, load_web_config
from exporter.webflags import add_web_arguments

PROG = "dualtrack-exporter"
ENV_PREFIX = "DUALTRACK_EXPORTER_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
log = logging.getLogger("exporter")


class UsageError(Exception):
    """A bad flag, environment variable or config file: exit 2 with this one-line message."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one clear line instead of the usage block
        raise UsageError(message)


def _number(kind: type, noun: str, valid: Callable[[float], bool], requirement: str):
    """An argparse type: `text` as a `kind` for which `valid` holds, else "... must be <requirement>"."""
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {noun}") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {requirement}")
        return value
    return check


def _positive(kind: type, minimum: float = 0.0):
    return _number(kind, kind.__name__, lambda value: value > minimum, f"greater than {minimum:g}")


_ratio = _number(float, "number", lambda value: 0.0 <= value <= 1.0, "between 0 and 1")


def _run_as(text: str) -> tuple[int, int] | None:
    try:
        return privileges.parse_run_as(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _scenarios(text: str) -> tuple[str, ...]:
    """--simulate: one scenario for every GPU, or a comma-separated list (GPU i runs the i-th, cycling)."""
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown scenario {', '.join(map(repr, unknown))}; "
                                         f"choose from {', '.join(SCENARIOS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Per-GPU NVML metrics for Prometheus, sampled in the background. "
                     f"Every flag can also be set as an environment variable {ENV_PREFIX}<FLAG> "
                     "(upper case, dots and dashes as underscores).")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    add_web_arguments(parser)
    parser.add_argument("--sample-interval", type=_positive(float, 0.01), default=1.0, metavar="SECONDS",
                        help="seconds between two NVML samples of a GPU (default %(default)s)")
    parser.add_argument("--idle-threshold", type=_ratio, default=0.05, metavar="RATIO",
                        help="utilization below which a GPU counts as idle (default %(default)s)")
    parser.add_argument("--run-as", dest="run_as", type=_run_as, default=None, metavar="UID[:GID]",
                        help="started as root: open the kernel log and the listening socket, then serve as this "
                        "user and group, with no supplementary group and no capability (docs/security.md); "
                        "empty: stay as started (default)")
    parser.add_argument("--log.level", dest="log_level", default="info",
                        choices=("debug", "info", "warn", "error"), help="log level (default %(default)s)")
    collectors = parser.add_argument_group("collectors", "turn each collector on or off")
    for collector in ALL:
        collectors.add_argument(f"--collector.{collector.name}", dest=f"collector_{collector.name}",
                                action=argparse.BooleanOptionalAction, default=collector.default_enabled,
                                help=f"{collector.help} (default: %(default)s)")
    collectors.add_argument("--collector.podresources.socket", dest="collector_podresources_socket",
                            default=podresources.DEFAULT_SOCKET, metavar="PATH",
                            help="kubelet pod-resources socket read by --collector.podresources (default %(default)s)")
    collectors.add_argument("--collector.xid.kernel-log", dest="collector_xid_kernel_log", default=None,
                            metavar="PATH", help="kernel log read by --collector.xid for the XIDs NVML does not "
                            f"deliver, matched to GPUs by PCI bus id (default {kernellog.DEFAULT_PATH}; none under "
                            "--simulate); empty: not read")
    simulate = parser.add_argument_group("simulated GPUs", "for machines without GPUs (demos, previews); "
                                         "never on unless --simulate is given")
    simulate.add_argument("--simulate", type=_scenarios, default=None, metavar="SCENARIO[,SCENARIO...]",
                          help=f"serve simulated H100s running a scenario: {', '.join(SCENARIOS)}; a "
                          "comma-separated list gives GPU i the i-th scenario (cycling)")
    simulate.add_argument("--simulate.gpus", dest="simulate_gpus", type=_positive(int), default=2, metavar="N",
                          help="number of simulated GPUs (default %(default)s)")
    simulate.add_argument("--simulate.call-cost", dest="simulate_call_cost", default=0.0,
                          type=_number(float, "float", lambda value: value >= 0, "0 or more"),
                          metavar="SECONDS", help="simulated latency of every NVML call (default %(default)s)")
    simulate.add_argument("--simulate.phase-seconds", dest="simulate_phase_seconds", type=_positive(float),
                          default=300.0, metavar="SECONDS", help="length of each demo phase (default %(default)s)")
    simulate.add_argument("--simulate.leak-minutes", dest="simulate_leak_minutes", type=_positive(float),
                          default=30.0, metavar="MINUTES",
                          help="memory-leak scenario: minutes until memory is full (default %(default)s)")
    simulate.add_argument("--simulate.processes", dest="simulate_processes", default=None, metavar="FILE",
                          help="the host processes the simulated GPUs run, a 'GPU PID' line each (read at "
                          "every sample; default: the exporter's own PID on every GPU)")
    return parser


def env_name(option: str) -> str:
    """--web.listen-address -> DUALTRACK_EXPORTER_WEB_LISTEN_ADDRESS."""
    return ENV_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", option.lstrip("-")).upper()


def env_arguments(parser: argparse.ArgumentParser, environ: dict[str, str]) -> list[str]:
    """Flags equivalent to the DUALTRACK_EXPORTER_* variables set, for every option of the parser."""
    arguments = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        option = action.option_strings[0]
        name = env_name(option)
        if name not in environ:
            continue
        value = environ[name]
        if isinstance(action, argparse.BooleanOptionalAction):
            if value.lower() not in _TRUE | _FALSE:
                raise UsageError(f"{name}={value!r}: expected true or false")
            arguments.append(option if value.lower() in _TRUE else action.option_strings[1])
        else:
            arguments.append(f"{option}={value}")
    return arguments


def parse_args(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse the environment, then the command line (which wins); raises UsageError."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    given = {_option(arg) for arg in argv if arg.startswith("--")}
    from_env = [flag for flag in env_arguments(parser, dict(os.environ if environ is None else environ))
                if _option(flag) not in given]
    try:
        return parser.parse_args(from_env + argv)
    except UsageError as exc:
        match = re.match(r"argument (\S+):", str(exc))
        culprit = match and match.group(1).split("/")[0]
        if culprit in {_option(flag) for flag in from_env}:
            raise UsageError(f"{exc} (from {env_name(culprit)})") from None
        raise


def _option(argument: str) -> str:
    """--no-collector.x=... -> --collector.x"""
    return argument.split("=")[0].replace("--no-", "--", 1)


def open_nvml(args: argparse.Namespace, simulator: Callable[..., SimulatedNVML] = SimulatedNVML) -> Nvml:
    """Real NVML, or `simulator` when --simulate is given; raises NvmlUnavailable."""
    if args.simulate is None:
        import pynvml
        lib = pynvml
    else:
        lib = simulator(args.simulate, args.simulate_gpus, call_cost=args.simulate_call_cost,
                        phase_seconds=args.simulate_phase_seconds, leak_minutes=args.simulate_leak_minutes,
                        processes=args.simulate_processes)
    nvml = Nvml(lib)
    nvml.init()
    return nvml


def main(argv: Sequence[str] | None = None, simulator: Callable[..., SimulatedNVML] = SimulatedNVML) -> int:
    """The daemon; `simulator` builds the NVML stand-in under --simulate (the tests inject faults there)."""
    try:
        args = parse_args(argv)
        web_config = load_web_config(args.web_config_file) if args.web_config_file else None
        if args.collector_podresources:
            podresources.configure(args.collector_podresources_socket)
    except (UsageError, WebConfigError, podresources.NotInstalled) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.replace("warn", "warning").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        nvml = open_nvml(args, simulator)
    except NvmlUnavailable as exc:
        print(f"{PROG}: error: {exc} (no GPU here? --simulate=demo serves simulated GPUs)", file=sys.stderr)
        return 1
    if args.simulate:
        log.warning("SIMULATED GPUs (scenario %s): these metrics do not come from real hardware",
                    ",".join(args.simulate))
    return serve(args, nvml, web_config, stop)


def kernel_log_path(args: argparse.Namespace) -> str:
    """The kernel log read for XIDs: --collector.xid.kernel-log; not given, the host's, unless the GPUs
    are simulated (their bus ids are made up); "" when not read."""
    if args.collector_xid_kernel_log is not None:
        return args.collector_xid_kernel_log
    return "" if args.simulate else kernellog.DEFAULT_PATH


def serve(args: argparse.Namespace, nvml: Nvml, web_config, stop: threading.Event) -> int:
    """Run the sampler and the web server until `stop` is set."""
    enabled = [c.name for c in ALL if getattr(args, f"collector_{c.name}")]
    try:
        sampler = Sampler(nvml, enabled, interval=args.sample_interval, idle_threshold=args.idle_threshold,
                          simulated=args.simulate is not None, xid_kernel_log=kernel_log_path(args))
    except Exception as exc:  # noqa: BLE001 - e.g. the GPU list cannot be read at all
        print(f"{PROG}: error: cannot enumerate GPUs: {exc}", file=sys.stderr)
        return 1
    if sampler.kernel_log:
        sampler.kernel_log.open()  # with the privilege the exporter started with: held open after --run-as

    def begin() -> None:
        """Once the listening socket is bound and before the first accept: drop root, start sampling."""
        if args.run_as:
            privileges.drop(*args.run_as)
            log.info("serving as uid %d, gid %d, with no capability", *args.run_as)
        sampler.start()

    exposition = Exposition(sampler)
    server = WebServer(render=exposition.render, reused=exposition.reused, listen_address=args.web_listen_address,
                       telemetry_path=args.web_telemetry_path, web_config=web_config, ready=sampler.ready)
    try:
        server.start(before_serving=begin)
    except (OSError, privileges.PrivilegeError) as exc:
        reason = exc if isinstance(exc, privileges.PrivilegeError) else \
            f"cannot listen on {args.web_listen_address}: {exc.strerror or exc}"
        print(f"{PROG}: error: {reason}", file=sys.stderr)
        sampler.stop()
        return 1
    log.info("sampling %d GPU(s) every %gs with collectors: %s", len(sampler.devices), args.sample_interval,
             ", ".join(enabled))
    while not stop.wait(min(args.sample_interval, 1.0)):
        sampler.watchdog()
    log.info("shutting down")
    server.shutdown()
    if sampler.stop():
        nvml.shutdown()  # not while a sampler thread is stuck inside NVML
    return 0
