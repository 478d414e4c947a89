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
    """Peak process RSS (CPU, sampled every 10 ms) or peak allocated CUDA memory, in MB."""

    def __init__(self, device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
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
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, psutil.Process().memory_info().rss / 2**20)
        return False
