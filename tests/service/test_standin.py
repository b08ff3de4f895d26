"""The stand-in server itself: argument handling, the compile gate, and the API shape the probes rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree_deploy import service
from ddtree_deploy.probing import http_request
from sandbox import standin_server
from tests.service.conftest import STANDIN, make_package_root

if TYPE_CHECKING:
    from ddtree_deploy.transport import LocalTransport
    from tests.service.conftest import ServiceHost


def test_args_resolve_like_server_args_and_keep_unknown_ones() -> None:
    parsed = standin_server.parse_args(["--model-path", "/m", "--port=31000", "--enable-metrics",
                                        "--speculative-ddtree-budget", "64", "--json-model-override-args", "a", "b",
                                        "--mem-fraction-static", "0.05"])
    assert parsed == {"model_path": "/m", "port": 31000, "enable_metrics": True, "speculative_ddtree_budget": 64,
                      "json_model_override_args": ["a", "b"], "mem_fraction_static": 0.05}


def _compile_only(root: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(STANDIN), "--standin-compile-only", "--package-root", str(root),
                           "--standin-compile-cache", str(cache)], capture_output=True, text=True, check=False)


def test_compile_gate_uses_content_not_timestamps(tmp_path: Path) -> None:
    root = make_package_root(tmp_path / "site")
    for path in root.rglob("*.py"):  # old files: their stats are remembered, so later starts only stat them
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns - 86_400 * 10**9))
    cache = tmp_path / "cache.json"
    first = _compile_only(root, cache)
    distinct = {path.read_bytes() for path in root.rglob("*.py")}  # equal sources compile once
    assert first.returncode == 0 and f"({len(distinct)} modules compiled)" in first.stderr
    again = _compile_only(root, cache)
    assert again.returncode == 0 and "(0 modules compiled)" in again.stderr
    assert len(json.loads(next(tmp_path.glob("cache.json.*.stats")).read_text())) == len(list(root.rglob("*.py")))
    target = root / "sglang" / "srt" / "speculative" / "spec_info.py"
    stat = target.stat()
    target.write_text("ALGORITHMS = ['EAGLE', 'DFLASH'\n\n")  # broken, in place: same size, inode and mtime
    assert target.stat().st_size == stat.st_size and target.stat().st_ino == stat.st_ino
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    broken = _compile_only(root, cache)
    assert broken.returncode == 1
    assert broken.stderr.count("Traceback (most recent call last):") == 1 and "SyntaxError" in broken.stderr
    assert str(target) in broken.stderr
    assert not list(root.rglob("__pycache__"))  # the package tree is never written


def test_missing_package_fails_like_an_import_error(tmp_path: Path) -> None:
    result = _compile_only(tmp_path, tmp_path / "cache.json")
    assert result.returncode == 1 and "ModuleNotFoundError" in result.stderr


def _generate(transport: LocalTransport, body: dict[str, Any]) -> Any:
    answer = http_request(transport, "/generate", method="POST", body=body)
    assert answer.status == 200, answer
    return json.loads(answer.body)


def test_generate_is_deterministic_greedy_with_spec_meta(svc_host: ServiceHost) -> None:
    transport = svc_host.transport(svc_host.spec())
    assert service.restart(transport, ["--speculative-algorithm", "DFLASH"]).ready
    greedy = {"temperature": 0, "max_new_tokens": 40}
    one = _generate(transport, {"text": "hello world", "sampling_params": greedy})
    two = _generate(transport, {"text": "hello world", "sampling_params": greedy})
    other = _generate(transport, {"text": "hello there", "sampling_params": greedy})
    assert one["output_ids"] == two["output_ids"] != other["output_ids"]
    assert len(one["output_ids"]) == 40
    meta = one["meta_info"]
    assert meta["completion_tokens"] == 40
    assert meta["spec_accept_length"] == 40 / meta["spec_verify_ct"] and meta["spec_accept_length"] > 1
    batch = _generate(transport, {"text": ["hello world", "hello there"], "sampling_params": greedy})
    assert [b["output_ids"] for b in batch] == [one["output_ids"], other["output_ids"]]
    sampled = [_generate(transport, {"text": "hello world", "sampling_params": {"temperature": 0.8}})
               for _ in range(2)]
    assert sampled[0]["output_ids"] != sampled[1]["output_ids"]


def test_plain_server_reports_no_speculative_meta(svc_host: ServiceHost) -> None:
    transport = svc_host.transport(svc_host.spec())
    assert service.restart(transport).ready
    meta = _generate(transport, {"text": "hi", "sampling_params": {"temperature": 0}})["meta_info"]
    assert "spec_accept_length" not in meta and meta["completion_tokens"] == 128  # SGLang's default


def test_server_info_has_version_and_every_arg(svc_host: ServiceHost) -> None:
    root = make_package_root(svc_host.root / "site-0.5.18", version="0.5.18")
    spec = svc_host.spec()
    spec = spec.model_copy(update={"args": [*spec.args, "--package-root", str(root)]})
    transport = svc_host.transport(spec)
    assert service.restart(transport, ["--speculative-algorithm", "DDTREE", "--ddtree-new-flag"]).ready
    info = json.loads(http_request(transport, "/server_info").body)
    assert info["version"] == "0.5.18"
    assert info["speculative_algorithm"] == "DDTREE" and info["ddtree_new_flag"] is True
    assert info["port"] == svc_host.port and info["tp_size"] == 1  # a default, as ServerArgs resolves it
