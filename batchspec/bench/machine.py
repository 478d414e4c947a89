"""What machine a benchmark ran on, and how much memory a cell took at its peak."""

from __future__ import annotations

import os
import platform
import threading

import psutil
import torch


def machine_info(device) -> dict:
    import transformers

    info = {
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class PeakMemory:
    """Peak process RSS (CPU) or peak allocated CUDA memory while the block ran, in MB.

    On Linux the kernel keeps the peak itself: writing 5 to /proc/self/clear_refs resets the high
    water mark (VmHWM in /proc/self/status) to the current RSS, and reading VmHWM afterwards gives
    the exact peak, with nothing running beside the timed code. Elsewhere (or where the file
    cannot be written) a thread samples RSS every 10 ms, which misses peaks shorter than that and
    wakes 100 times a second beside the run it measures, taking the GIL each time."""

    CLEAR_REFS, STATUS = "/proc/self/clear_refs", "/proc/self/status"

    def __init__(self, device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.peak_mb = 0.0
        self.sampled = False  # True when the fallback thread measured it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif not self._reset_high_water_mark():
            self.sampled = True
            proc = psutil.Process()
            self.peak_mb = proc.memory_info().rss / 2**20

            def sample():
                while not self._stop.wait(0.01):
                    self.peak_mb = max(self.peak_mb, proc.memory_info().rss / 2**20)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        if self.cuda:
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self.sampled:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, psutil.Process().memory_info().rss / 2**20)
        else:
            self.peak_mb = self._high_water_mark_kb() / 2**10
        return False

    def _reset_high_water_mark(self) -> bool:
        try:
            with open(self.CLEAR_REFS, "w") as f:
                f.write("5")
            return self._high_water_mark_kb() > 0
        except (OSError, ValueError):
            return False

    def _high_water_mark_kb(self) -> int:
        with open(self.STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])  # "VmHWM:    218324 kB"
        raise ValueError("no VmHWM in /proc/self/status")
