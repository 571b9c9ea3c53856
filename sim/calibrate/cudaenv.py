"""The one place that imports numba-cuda: a numpy shim, simulator detection, the device's identity.

numba-cuda 0.30.4 still calls `np.row_stack`, which numpy 2.5 removed; the shim is installed here, once,
before the first import. With NUMBA_ENABLE_CUDASIM=1 Numba's CUDA simulator stands in for the GPU: kernels
run on the CPU (one Python thread per CUDA thread), timings mean nothing, no CUDA toolkit is needed.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys

import numpy as np

from sim.errors import InputError

_cuda = None


def simulator_requested() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0")


def load():
    """numba.cuda, imported once (the simulator when NUMBA_ENABLE_CUDASIM=1)."""
    global _cuda
    if _cuda is not None:
        return _cuda
    if not hasattr(np, "row_stack"):  # numba-cuda 0.30.4 under numpy >= 2.5
        np.row_stack = np.vstack
    import numba

    if simulator_requested() and not numba.config.ENABLE_CUDASIM and "numba.cuda" not in sys.modules:
        numba.config.reload_config()  # numba was imported before the variable was set (a test run, say)
    if importlib.util.find_spec("numba_cuda") is None and not numba.config.ENABLE_CUDASIM:
        raise InputError("calibrate", "numba-cuda", "not installed",
                         "GPU calibration needs numba-cuda: pip install 'expertsim[cuda]'")
    from numba import cuda

    _cuda = cuda
    return cuda


def simulating() -> bool:
    """True when numba.cuda is Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)."""
    load()
    return _config_sim()


def _config_sim() -> bool:
    import numba

    return bool(numba.config.ENABLE_CUDASIM)


def require_gpu():
    """numba.cuda with a usable device (or the simulator); else a one-line InputError."""
    cuda = load()
    if _config_sim():
        return cuda
    try:
        ok = cuda.is_available()
    except Exception as exc:  # a broken driver install: say what numba said, on one line
        raise InputError("calibrate", "gpu", type(exc).__name__, " ".join(str(exc).split())[:200]) from None
    if not ok:
        raise InputError("calibrate", "gpu", "none found",
                         "numba-cuda sees no CUDA GPU (run on a machine with an NVIDIA driver, or set "
                         "NUMBA_ENABLE_CUDASIM=1 to run the kernels in the simulator)")
    return cuda


def _driver_version_string() -> str | None:
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        text = pynvml.nvmlSystemGetDriverVersion()
        return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version(), "numpy": np.__version__}
    for name in ("numba", "numba-cuda", "cuda-bindings"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def device_info() -> dict:
    """Name, compute capability, memory, multiprocessors, driver and CUDA versions of the current device."""
    cuda = require_gpu()
    info: dict = {"simulator": _config_sim(), "platform": platform.platform(), **{"software": _versions()}}
    if _config_sim():
        info.update(name="Numba CUDA simulator", compute_capability="sim", multiprocessors=1,
                    memory_total_bytes=None, l2_bytes=None, driver_version=None, cuda_driver_api=None,
                    cuda_runtime=None)
        return info
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    major, minor = dev.compute_capability
    free, total = cuda.current_context().get_memory_info()
    try:
        from numba.cuda.cudadrv.driver import driver

        api = driver.get_version()
        api = f"{api[0]}.{api[1]}" if isinstance(api, tuple) else str(api)
    except Exception:
        api = None
    try:
        rt = cuda.runtime.get_version()
        rt = f"{rt[0]}.{rt[1]}"
    except Exception:
        rt = None
    info.update(name=name, compute_capability=f"{major}.{minor}", multiprocessors=int(dev.MULTIPROCESSOR_COUNT),
                memory_total_bytes=int(total), memory_free_bytes=int(free), l2_bytes=int(dev.L2_CACHE_SIZE),
                driver_version=_driver_version_string(), cuda_driver_api=api, cuda_runtime=rt)
    return info


def free_memory_bytes() -> float:
    cuda = require_gpu()
    free, _ = cuda.current_context().get_memory_info()
    return float(free)
