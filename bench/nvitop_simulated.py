"""The real nvitop-exporter on dualtrack's simulated NVML, for bench/bench_exporter.py.

Run with a Python that has nvitop-exporter installed (a venv of its own: it is no dependency of
dualtrack), with the repository on PYTHONPATH:

    PYTHONPATH=. /path/to/venv/bin/python bench/nvitop_simulated.py --gpus 8 --call-cost 0.001 -- --port 9400
    PYTHONPATH=. /path/to/venv/bin/python bench/nvitop_simulated.py --gpus 8 --count 20   # NVML calls per GPU

nvitop reads NVML through the `pynvml` module (nvitop/api/libnvml.py does `import pynvml` and
`from pynvml import *`). Before nvitop is imported, `pynvml` is replaced in sys.modules by a copy of
the installed nvidia-ml-py module whose nvml* functions are SimulatedNVML's (those it does not
simulate raise NVMLError_FunctionNotFound, as on a driver without them). The copy has no
`_nvmlGetFunctionPointer`: nvitop then skips its ctypes re-implementations of a few calls (running
processes, memory info), which would call into libnvidia-ml.so, and calls pynvml's functions instead
(it logs that it takes the binding for a corrupted install: expected here).
Everything else (its Device API, caching, host metrics via psutil, prometheus_client, its HTTP
server, its refresh loop) is nvitop-exporter's own code, unchanged.
"""
from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Callable
from typing import Any

import pynvml

from exporter.simulated import NVML_H, SimulatedNVML
from tests.support.nvml_faults import FaultyNVML


def simulated_pynvml(lib: SimulatedNVML) -> types.ModuleType:
    """A `pynvml` module whose NVML functions are `lib`'s."""
    module = types.ModuleType("pynvml", pynvml.__doc__)
    module.__dict__.update({name: value for name, value in vars(pynvml).items() if not name.startswith("__")})
    module.__dict__.update(NVML_H)  # the constants the simulated driver speaks
    module._nvmlGetFunctionPointer = None  # no libnvidia-ml.so: nvitop keeps pynvml's own functions

    def function(name: str) -> Callable[..., Any]:
        simulated = getattr(type(lib), name, None)
        if simulated is None:
            def missing(*args: Any, **kwargs: Any) -> Any:
                raise pynvml.NVMLError_FunctionNotFound()
            missing.__name__ = name
            return missing

        def call(*args: Any, **kwargs: Any) -> Any:
            return simulated(lib, *args, **kwargs)
        call.__name__ = name
        return call

    for name, value in vars(pynvml).items():  # the binding's calls into the library, not its helpers
        if name.startswith("nvml") and isinstance(value, types.FunctionType) and (
                hasattr(type(lib), name) or "_nvmlGetFunctionPointer" in value.__code__.co_names):
            module.__dict__[name] = function(name)
    module.nvmlInitWithFlags = lambda flags: lib.nvmlInit()
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--call-cost", type=float, default=0.001, help="seconds every NVML call costs")
    parser.add_argument("--count", type=int, help="refresh every GPU this many times in-process and print "
                                                  "NVML calls per GPU per refresh, then exit")
    parser.add_argument("exporter_args", nargs="*", help="nvitop-exporter's own arguments (after --)")
    args = parser.parse_args()
    if args.count:
        counted = FaultyNVML("healthy", args.gpus)  # the simulator as the tests drive it: it counts its calls
        sys.modules["pynvml"] = simulated_pynvml(counted)
        return count_calls(counted, args.gpus, args.count)
    lib = SimulatedNVML("healthy", args.gpus, call_cost=args.call_cost)
    sys.modules["pynvml"] = simulated_pynvml(lib)
    from nvitop_exporter.cli import main as exporter_main
    sys.argv = ["nvitop-exporter", *args.exporter_args]
    return exporter_main()


def count_calls(lib: FaultyNVML, gpus: int, refreshes: int) -> int:
    """NVML calls per GPU per refresh of nvitop-exporter's update_device, after one warm-up refresh."""
    from nvitop import Device
    from nvitop_exporter.exporter import PrometheusExporter
    devices = Device.from_indices(range(Device.count()))
    exporter = PrometheusExporter(devices, hostname="bench", interval=1.0)
    for device in devices:
        exporter.update_device(device)
    before = sum(lib.calls.values())
    for _ in range(refreshes):
        for device in devices:
            exporter.update_device(device)
    print((sum(lib.calls.values()) - before) / refreshes / gpus)
    return 0


if __name__ == "__main__":
    sys.exit(main())
