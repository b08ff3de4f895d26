"""Registers and spills of overlay ddtree's tree conv1d kernel at each tile config, compiled for
the H200 (sm_90a) on a machine without a GPU, with the ptxas Triton ships.

Run 25 found the kernel's time following its channel programs rather than the bytes they move;
a kernel that spills its registers to local memory is one way that happens, and this shows which
launches do before a GPU sweep (``bench/conv1d_tree_verify.py --configs``) times them. The local
Triton may be newer than the GPU machine's, so its counts are a guide, not the device's own.

    ddtree-deploy overlay export ddtree@0.3.0-rc.11 /tmp/rc11
    python tools/conv1d_registers.py /tmp/rc11/files/sglang/kernels/ops/speculative/ddtree_conv1d.py \\
        --sglang-file .../sglang/kernels/ops/mamba/causal_conv1d_triton.py 65x32x128x4 65x32x16x4
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.nvidia.compiler import get_ptxas

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.ddtree.triton_cpu import hopper_ptx, load_module, sglang_conv_kernel  # noqa: E402

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "conv_state_ptr": "*bf16",
            "conv_state_indices_ptr": "*i32", "inter_ptr": "*bf16", "inter_indices_ptr": "*i32",
            "parent_ptr": "*i32", "o_ptr": "*bf16"}
# The strides that are 1 in a server's verify; Triton specialises an integer argument equal to 1.
UNIT_STRIDES = ("stride_x_dim", "stride_w_width", "stride_state_token", "stride_state_indices", "stride_inter_win",
                "stride_inter_indices", "stride_parent_token", "stride_o_dim")


def ptx(kernel: triton.JITFunction, nodes: int, channels: int, rows: int, warps: int) -> str:
    """The PTX of one launch: a Qwen3.6-style layer (width 4, bias, SiLU, windows saved), bf16."""
    np2 = triton.next_power_of_2(nodes)
    constants = {"pad_slot_id": -1, "HAS_BIAS": True, "KERNEL_WIDTH": 4, "SILU_ACTIVATION": True, "NP2_STATELEN": 4,
                 "NP2_SEQLEN": np2, "BLOCK_N": channels, "ROWS": min(rows, np2), "SAVE_INTERMEDIATE": True,
                 **dict.fromkeys(UNIT_STRIDES, 1)}
    signature = {name: "constexpr" if name in constants else POINTERS.get(name, "i32") for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name in POINTERS}
    return hopper_ptx(kernel, signature, constants, warps, aligned)


def registers(ptx_text: str) -> tuple[int, int]:
    """(registers a thread, bytes it spills) as ptxas reports them for sm_90a."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx_text)
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(path), "-o", str(path) + ".cubin"],
                                capture_output=True, text=True, check=True).stderr
    used = re.search(r"Used (\d+) registers", report)
    spilled = re.search(r"(\d+) bytes spill stores", report)
    assert used and spilled, report
    return int(used.group(1)), int(spilled.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ddtree_file", help="the overlay's ddtree_conv1d.py (rc.11 or later)")
    parser.add_argument("--sglang-file", required=True, help="sglang 0.5.17's kernels/ops/mamba/causal_conv1d_triton.py")
    parser.add_argument("launches", nargs="+", metavar="NODESxCHANNELSxROWSxWARPS")
    args = parser.parse_args(argv)
    sglang_conv_kernel(args.sglang_file)
    kernel = load_module(args.ddtree_file, "ddtree_conv1d")._ddtree_conv1d_tree_kernel
    for launch in args.launches:
        nodes, channels, rows, warps = (int(n) for n in launch.split("x"))
        used, spilled = registers(ptx(kernel, nodes, channels, rows, warps))
        print(f"{nodes} nodes, {channels}x{min(rows, triton.next_power_of_2(nodes))} tile, {warps} warps: "
              f"{used} registers, {spilled} bytes spilled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
