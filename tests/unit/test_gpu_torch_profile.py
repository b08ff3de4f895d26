"""tools/gpu/torch_profile.py's summary, read from a real torch profiler trace (CPU only here: the GPU
kernel lines of a CUDA trace are the same events with `cat: kernel`)."""

from __future__ import annotations

import gzip
from pathlib import Path
from types import ModuleType

import torch

from tests.gpu_tools import load_gpu_tool


def tool() -> ModuleType:
    return load_gpu_tool("torch_profile")


def traced(tmp_path: Path) -> Path:
    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            torch.mm(a, a)
        torch.softmax(a, dim=-1)
    path = tmp_path / "host.trace.json"
    prof.export_chrome_trace(str(path))
    zipped = tmp_path / "host.trace.json.gz"
    zipped.write_bytes(gzip.compress(path.read_bytes()))
    return zipped


def test_the_summary_counts_ops_per_step_from_a_real_trace(tmp_path: Path) -> None:
    lines = tool().summarize("cpu", [traced(tmp_path)], steps=2)
    assert lines[0].startswith("TPROF[cpu] 2 steps: GPU kernels 0.000 ms in 0 launches per step; wall span")
    mm = next(line for line in lines if line.endswith("aten::mm"))
    assert "cpu_op" in mm and "2.0x" in mm  # four calls over two steps
    assert any(line.endswith("aten::softmax") and "0.5x" in line for line in lines)
