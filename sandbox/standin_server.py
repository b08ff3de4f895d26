"""A stand-in for `python -m sglang.launch_server`, for tests and the sandbox only (stdlib, python >= 3.8).

It speaks the part of SGLang's HTTP API that ddtree-deploy's probes use: `/health`,
`/health_generate`, `/server_info` (the version from sglang's dist-info and the args it was started
with, resolved to snake_case like SGLang's ServerArgs), `/generate` (greedy output ids derived from
the prompt by a hash, with `meta_info.spec_accept_length`/`spec_verify_ct`, and with `return_logprob` the top
`top_logprobs_num` (at most 2) log-probs per token as `meta_info.output_top_logprobs`: the token taken
and a runner-up that is never the corrupted token; a speculative server dies on `return_logprob` with
a Traceback, as SGLang 0.5.17's DFLASH and DDTREE schedulers do), and `/metrics` (with
`--enable-metrics`, as in SGLang). Like the real server it first loads the host's sglang package:
here every module is byte-compiled (results cached by content hash), and a failure prints a
Traceback and exits 1. Then, like SGLang's argparse, it refuses (exit 2, a usage error in its log)
an argument that is not a field of the host's own `ServerArgs` (so an overlay whose `server.args`
need a patch that is not applied fails as it would for real); the switches below are its own.

Test switches (argument, or the environment variable DDTREE_STANDIN_<NAME upper-cased>):
  --standin-crash-after S     exit 1 with a Traceback S seconds after start
  --standin-hang-unready      listen, but answer 503 on the health paths forever
  --standin-corrupt-outputs   change output ids from index 5 on (a lossy "speculative" decoder)
  --standin-start-delay S     sleep S seconds before listening (a slow model load)
  --standin-ignore-sigterm    this process and its children ignore SIGTERM (stop must escalate)
  --fork-children N           N child processes in the same group, like SGLang's scheduler/detokenizer
  --standin-accept-length X   uniform rounds of this acceptance length (default: simulated rounds, see Model)
  --standin-block-size S      the draft block when --speculative-dflash-block-size is not given (default 8)
  --standin-tie-flips GAP     speculative decoding takes the runner-up wherever its log-prob is within GAP
                              nats of the top token (what bf16 verify numerics do at near-ties)
  --standin-lossy-from-budget B  DDTREE at a budget >= B changes output ids as --standin-corrupt-outputs does
  --standin-max-ddtree-budget B  DDTREE at a budget > B dies at start-up with a Traceback (state does not fit)
  --standin-first-sample-delay S  the first request with top_p < 1 holds every request S seconds
                              (flashinfer's sampling JIT compile in SGLang's scheduler), unless the
                              server is plain and runs --sampling-backend pytorch
  --standin-compile-only      compile the package and exit (0 ok, 1 Traceback): warms the cache
  --package-root DIR          where sglang/ lives (default: where this python imports it from)
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, NoReturn, Optional, Tuple

VOCAB = 32000
CORRUPT_FROM = 5
BLOCK = 8  # the draft block size S when --speculative-dflash-block-size is not given
DFLASH_P = 0.7  # per-depth acceptance of the chain (and of every algorithm but DDTREE)
TOKEN_S, ROUND_S, TREE_NODE_S = 0.0002, 0.0003, 0.000001  # simulated time: plain token, round, tree node


def accept_probability(algorithm: Optional[str], budget: int) -> float:
    """Per-depth acceptance: DDTREE's rises with the budget and saturates; the chain's is fixed."""
    return DFLASH_P + 0.25 * budget / (budget + 48.0) if algorithm == "DDTREE" else DFLASH_P


def _unit(key: str, round_index: int, depth: int) -> float:
    digest = hashlib.sha256(("%s|%d|%d" % (key, round_index, depth)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64
# What SGLang's ServerArgs resolves when a flag is not given (the subset probes look at).
DEFAULTS: Dict[str, Any] = {
    "model_path": "standin-model", "tokenizer_path": None, "host": "127.0.0.1", "port": 30000,
    "dtype": "auto", "tp_size": 1, "dp_size": 1, "random_seed": None, "mem_fraction_static": None,
    "max_total_tokens": None, "attention_backend": None, "sampling_backend": None, "enable_metrics": False,
    "speculative_algorithm": None, "speculative_draft_model_path": None, "speculative_num_steps": None,
    "speculative_eagle_topk": None, "speculative_num_draft_tokens": None, "decode_log_interval": 40,
}


def log(message: str, level: str = "INFO") -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stderr.write("[%s] %s %s\n" % (stamp, level, message))
    sys.stderr.flush()


def fatal(exc: BaseException) -> NoReturn:
    """Die like an uncaught exception would: a top-level Traceback on stderr, exit 1."""
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    sys.stderr.flush()
    os._exit(1)


# ---------------------------------------------------------------- arguments

def parse_args(argv: List[str]) -> Dict[str, Any]:
    """argparse-free: `--key value`, `--key=value`, `--flag`, `--key v1 v2`; every key is kept."""
    parsed: Dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            continue
        key, eq, inline = token[2:].partition("=")
        values: List[str] = [inline] if eq else []
        while not eq and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        value = True if not values else _coerce(values[0]) if len(values) == 1 else [_coerce(v) for v in values]
        parsed[key.replace("-", "_")] = value
    return parsed


def _coerce(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def switch(args: Dict[str, Any], name: str, default: Any = None) -> Any:
    """A test switch from the args, else from DDTREE_STANDIN_<NAME>, else the default."""
    if name in args:
        return args[name]
    env = os.environ.get("DDTREE_STANDIN_" + name.replace("standin_", "", 1).upper())
    return default if env is None else _coerce(env)


# ---------------------------------------------------------------- loading the package

def package_dir(args: Dict[str, Any]) -> str:
    if args.get("package_root"):
        root = os.path.join(str(args["package_root"]), "sglang")
        if not os.path.isfile(os.path.join(root, "__init__.py")):
            raise ModuleNotFoundError("No module named 'sglang' under %s" % args["package_root"])
        return root
    spec = importlib.util.find_spec("sglang")  # finds without importing (the real one needs torch)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'sglang'")
    return next(iter(spec.submodule_search_locations))


def sglang_version(pkg: str) -> str:
    for dist in importlib.metadata.distributions(path=[os.path.dirname(pkg)]):
        if (dist.metadata["Name"] or "").lower() == "sglang":
            return str(dist.version)
    return "unknown"


def compile_package(pkg: str, cache_path: str) -> int:
    """Byte-compile every module of the package in memory; raise the first SyntaxError.

    Sources that compiled before (same content, same python) are skipped, so a restart costs a
    stat per file instead of ~15 s of compiling on a small machine. A file is read and hashed only
    when its stat (size, mtime, ctime, inode) differs from the last start's; those stats are kept
    per package next to the shared cache. Any write changes the ctime, so the gate still follows
    content, not timestamps. Nothing is written into the package.
    """
    tag = "%d.%d:" % sys.version_info[:2]
    known = set(_load(cache_path, []))
    stats_path = "%s.%s.stats" % (cache_path, hashlib.sha256(pkg.encode()).hexdigest()[:12])
    stats, seen = _load(stats_path, {}), {}
    racy = time.time_ns() - 2 * 10**9  # a file written this recently could change again within its mtime tick
    compiled = 0
    for folder, dirs, files in os.walk(pkg):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            st = os.stat(path)
            stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]  # ctime: utime cannot forge it
            key = stats[path][1] if path in stats and stats[path][0] == stamp else None
            if key not in known:
                with open(path, "rb") as f:
                    source = f.read()
                key = tag + hashlib.sha256(source).hexdigest()
                if key not in known:
                    compile(source, path, "exec", dont_inherit=True)
                    known.add(key)
                    compiled += 1
            if st.st_mtime_ns < racy:
                seen[path] = [stamp, key]
    if compiled:
        _save(cache_path, sorted(known))
    if seen != stats:
        _save(stats_path, seen)
    return compiled


def _load(path: str, default: Any) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _save(path: str, value: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def default_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "ddtree-standin", "compiled-ok.json")


# ---------------------------------------------------------------- the model

class Model:
    """Deterministic "decoding": greedy output ids are a hash chain of the prompt (sampled ones of the prompt
    and the seed, or of nothing reproducible without one).

    Speculative rounds are simulated per request: at each draft depth a hash of (prompt, round, depth)
    decides whether the target accepts, with a probability that DFLASH fixes and DDTREE raises with
    its budget (saturating: 0.76 at 16, 0.84 at 64, 0.91 at 256, 0.94 at 1024); a round commits the
    accepted run plus the bonus token. Per-request `meta_info` then carries what SGLang 0.5.17's
    tokenizer manager derives from those rounds (spec_verify_ct, spec_num_correct_drafts,
    spec_correct_drafts_histogram, and its misleading spec_accept_length and spec_accept_rate), and
    `--speculative-ddtree-debug` logs one `ddtree_debug {json}` line per request and round, shaped as
    the overlay's worker writes them. Each request takes simulated time per round (a batch shares it).
    """

    def __init__(self, args: Dict[str, Any]) -> None:
        self.algorithm = str(args.get("speculative_algorithm") or "").upper() or None
        self.corrupt = bool(switch(args, "standin_corrupt_outputs", False))
        flips = switch(args, "standin_tie_flips", None)
        self.tie_flips = float(flips) if flips is not None and self.algorithm else None
        fixed = switch(args, "standin_accept_length", None)
        self.fixed_accept = float(fixed) if fixed is not None else None  # uniform rounds of this mean
        self.block = int(args.get("speculative_dflash_block_size") or switch(args, "standin_block_size", BLOCK))
        self.budget = int(args.get("speculative_ddtree_budget") or 64)
        self.debug = bool(args.get("speculative_ddtree_debug")) and self.algorithm == "DDTREE"
        self.accept_p = accept_probability(self.algorithm, self.budget)
        lossy_from = switch(args, "standin_lossy_from_budget", None)
        if self.algorithm == "DDTREE" and lossy_from is not None and self.budget >= int(lossy_from):
            self.corrupt = True
        self.log_interval = max(1, int(args["decode_log_interval"]))
        self.lock = threading.Lock()
        torch_sampler = args.get("sampling_backend") == "pytorch" and not self.algorithm
        self.sample_compile_s = 0.0 if torch_sampler else float(switch(args, "standin_first_sample_delay", 0.0))
        self.requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_accept = 0.0
        # SGLang sets the spec_accept_length gauge only every decode_log_interval decode forwards, from
        # the tokens and forwards counted since the last time (so a few short requests leave it at 0)
        self.forwards = 0
        self.window_tokens = 0.0
        self.window_forwards = 0

    @property
    def draft_tokens(self) -> int:
        """SGLang's speculative_num_draft_tokens: the block for DFLASH, DDTREE's verify width (budget + 1)."""
        return self.budget + 1 if self.algorithm == "DDTREE" else self.block

    def generate(self, prompt: Any, params: Dict[str, Any], rid: Optional[str] = None, top_logprobs: int = 0
                 ) -> Dict[str, Any]:
        started = time.monotonic()
        key = prompt if isinstance(prompt, str) else json.dumps(prompt)
        count = int(params.get("max_new_tokens", 128))
        greedy = float(params.get("temperature", 1.0)) == 0.0
        if not greedy and float(params.get("top_p", 1.0)) < 1.0:
            with self.lock:  # compiled once, while the scheduler (every request) waits
                time.sleep(self.sample_compile_s)
                self.sample_compile_s = 0.0
        seed = params.get("sampling_seed")
        salt = "" if greedy else ("seed=%s" % seed if seed is not None else uuid.uuid4().hex)
        ids, top = self._decode(key + salt, count)
        rid = rid or uuid.uuid4().hex
        meta: Dict[str, Any] = {
            "id": rid, "prompt_tokens": len(key.split()) if isinstance(prompt, str) else len(prompt),
            "completion_tokens": count, "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": count},
        }
        forwards = count
        if self.algorithm and count:
            accepts = self._rounds(key + salt, count, rid)
            forwards = len(accepts)
            meta.update(self._spec_meta(count, accepts))
        if top_logprobs > 0:
            meta["output_top_logprobs"] = [[[lp, token, None] for lp, token in row[:top_logprobs]] for row in top]
        meta["e2e_latency"] = time.monotonic() - started
        with self.lock:
            self.requests += 1
            self.prompt_tokens += meta["prompt_tokens"]
            self.generation_tokens += count
            self._count_forwards(count, forwards)
        cost = forwards * (ROUND_S + TREE_NODE_S * self.budget if self.algorithm == "DDTREE" else
                           ROUND_S if self.algorithm else TOKEN_S)
        return {"text": " ".join("t%d" % i for i in ids), "output_ids": ids, "meta_info": meta, "cost_s": cost}

    def _rounds(self, key: str, count: int, rid: str) -> List[int]:
        """Acceptance lengths (bonus included) of the rounds that decode `count` tokens after the prefill's."""
        if self.fixed_accept is not None:
            rounds = max(1, math.ceil(count / self.fixed_accept))
            return [count // rounds + (1 if r < count % rounds else 0) for r in range(rounds)]
        accepts: List[int] = []
        depth = min(self.block - 1, self.budget if self.algorithm == "DDTREE" else self.block - 1)
        while sum(accepts) < count - 1 or not accepts:
            hits = [_unit(key, len(accepts), d) < self.accept_p for d in range(depth)]
            accepted = hits.index(False) if False in hits else depth
            accepts.append(accepted + 1)
            if self.debug:
                self._log_round(rid, key, len(accepts) - 1, accepted + 1)
        return accepts

    def _spec_meta(self, count: int, accepts: List[int]) -> Dict[str, Any]:
        """What SGLang's tokenizer manager puts in meta_info (0.5.17, _calculate_spec_decoding_metrics)."""
        correct = sum(a - 1 for a in accepts)
        histogram = [0] * max(accepts)
        for a in accepts:
            histogram[a - 1] += 1  # entry k: rounds that accepted k drafts
        proposed = len(accepts) * (self.draft_tokens - 1)
        return {"spec_verify_ct": len(accepts), "spec_accept_length": count / len(accepts),
                "spec_accept_rate": correct / proposed if proposed else 0.0, "spec_num_correct_drafts": correct,
                "spec_num_proposed_drafts": proposed, "spec_correct_drafts_histogram": histogram,
                "spec_accept_histogram": histogram}

    def _log_round(self, rid: str, key: str, round_index: int, accept: int) -> None:
        """One line per request and round, as ddtree_worker_v2.py's _log_debug writes them."""
        depth = self.block - 1
        agree = [(1 if _unit(key, round_index, d) < DFLASH_P else 0) if d < accept - 1 else 0 if d == accept - 1
                 else -1 for d in range(depth)]
        record = {"rid": rid, "budget": self.budget, "tree_nodes": self.budget,
                  "tree_depth": min(depth, self.budget.bit_length()), "accepted_nodes": accept - 1,
                  "accept_length": accept, "draft_top1_agree": agree}
        log("ddtree_debug %s" % json.dumps(record))

    def _count_forwards(self, tokens: int, forwards: int) -> None:
        for _ in range(forwards):  # one decode forward at a time, as the scheduler counts them
            self.forwards += 1
            self.window_forwards += 1
            self.window_tokens += tokens / forwards
            if self.forwards % self.log_interval == 0:
                self.last_accept = self.window_tokens / self.window_forwards if self.algorithm else 0.0
                self.window_tokens, self.window_forwards = 0.0, 0

    def _decode(self, key: str, count: int) -> "Tuple[List[int], List[List[Tuple[float, int]]]]":
        """Output ids and, per position, the (log-prob, id) of the top token and its runner-up."""
        ids: List[int] = []
        top: List[List[Tuple[float, int]]] = []
        state = hashlib.sha256(key.encode()).digest()
        for i in range(count):
            state = hashlib.sha256(state).digest()
            token = int.from_bytes(state[:4], "big") % VOCAB
            runner_up = (token + 2 + int.from_bytes(state[4:8], "big") % (VOCAB - 2)) % VOCAB
            best = -0.05 - state[8] / 255.0
            gap = 4.0 * (state[9] / 255.0) ** 2
            top.append([(best, token), (best - gap, runner_up)])
            if self.tie_flips is not None and gap <= self.tie_flips:
                token = runner_up
                state = hashlib.sha256(state + b"flip").digest()  # the context differs from here on
            ids.append((token + 1) % VOCAB if self.corrupt and i >= CORRUPT_FROM else token)
        return ids, top

    def metrics(self, model_name: str) -> str:
        labels = '{model_name="%s"}' % model_name
        with self.lock:
            rows = [
                ("sglang:num_running_reqs", "gauge", "The number of running requests.", 0),
                ("sglang:spec_accept_length", "gauge", "Mean acceptance length of speculative decoding.",
                 self.last_accept),
                ("sglang:num_requests_total", "counter", "Number of requests processed.", self.requests),
                ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens),
                ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
                 self.generation_tokens),
            ]
        out = []
        for name, kind, doc, value in rows:  # the shape prometheus_client's generate_latest writes
            out += ["# HELP %s %s" % (name, doc), "# TYPE %s %s" % (name, kind),
                    "%s%s %s" % (name, labels, float(value))]
        return "\n".join(out) + "\n"


# ---------------------------------------------------------------- HTTP

class Handler(BaseHTTPRequestHandler):
    server: "StandinServer"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        srv = self.server
        if self.path in ("/health", "/health_generate"):
            self._send(503 if srv.hang_unready else 200, b"")
        elif self.path in ("/server_info", "/get_server_info"):
            self._json(200, srv.server_info())
        elif self.path == "/metrics" and srv.args.get("enable_metrics"):
            self._send(200, srv.model.metrics(str(srv.args["model_path"])).encode(), "text/plain; version=0.0.4")
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        if self.path != "/generate":
            self._json(404, {"detail": "Not Found"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        except ValueError as exc:
            self._json(400, {"error": {"message": "invalid JSON: %s" % exc}})
            return
        prompt = body.get("text", body.get("input_ids"))
        if prompt is None:
            self._json(400, {"error": {"message": "Either text or input_ids should be provided."}})
            return
        params = body.get("sampling_params") or {}
        batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        model = self.server.model
        rid = body.get("rid")
        top = min(2, int(body.get("top_logprobs_num") or 0)) if body.get("return_logprob") else 0
        if body.get("return_logprob") and model.algorithm:
            fatal(ValueError("%s speculative decoding does not support return_logprob." % model.algorithm))
        if batch:
            rids = rid if isinstance(rid, list) else []
            answers = [model.generate(p, params, rids[i] if i < len(rids) else None, top) for i, p in enumerate(prompt)]
        else:
            answers = [model.generate(prompt, params, rid if isinstance(rid, str) else None, top)]
        time.sleep(max(a.pop("cost_s") for a in answers))  # a batch's requests share their rounds
        self._json(200, answers if batch else answers[0])

    def _json(self, status: int, value: Any) -> None:
        self._send(status, json.dumps(value).encode(), "application/json")

    def _send(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # uvicorn's access-log shape
        sys.stderr.write('INFO:     %s - "%s" %s\n' % (self.client_address[0], self.requestline, args[1]))
        sys.stderr.flush()


class StandinServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, args: Dict[str, Any], version: str) -> None:
        self.args, self.version = args, version
        self.model = Model(args)
        if self.model.algorithm in ("DFLASH", "DDTREE"):  # resolved as SGLang's ServerArgs resolves them
            self.args = dict(args, speculative_num_draft_tokens=self.model.draft_tokens,
                             speculative_dflash_block_size=self.model.block)
        self.hang_unready = bool(switch(args, "standin_hang_unready", False))
        self.started = time.time()
        super().__init__((str(args["host"]), int(args["port"])), Handler)

    def server_info(self) -> Dict[str, Any]:
        return dict(self.args, version=self.version, startup_time=self.started,
                    internal_states=[{"avg_spec_accept_length": self.model.last_accept}])


# ---------------------------------------------------------------- start-up

def fork_children(count: int, ignore_sigterm: bool) -> "List[subprocess.Popen[bytes]]":
    """Children stay in our process group (no new session), as SGLang's scheduler and detokenizer do."""
    code = ("import signal,time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_sigterm else "")
            + "while True: time.sleep(3600)\n")
    return [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL) for _ in range(count)]


def arm_crash(after_s: float) -> None:
    def crash() -> None:
        time.sleep(after_s)
        try:
            raise RuntimeError("stand-in crash requested after %.1fs (standin_crash_after), exiting at t=%.6f"
                               % (after_s, time.time()))
        except RuntimeError as exc:
            fatal(exc)
    threading.Thread(target=crash, daemon=True).start()


MISSING = {"missing": True}  # stands for a default computed at run time (SGLang resolves it; we do not)


def server_args_schema(pkg: str, cache_path: str) -> Dict[str, Any]:
    """The `ServerArgs` fields of the host's own server_args.py and their literal defaults.

    Parsing that file takes ~0.15 s, so the result is kept next to the compile cache, keyed by the
    file's content hash. Empty if the file cannot be read or parsed.
    """
    try:
        with open(os.path.join(pkg, "srt", "server_args.py"), "rb") as f:
            source = f.read()
    except OSError:
        return {}
    cached = "%s.schema-%s.json" % (cache_path, hashlib.sha256(source).hexdigest()[:16])
    schema = _load(cached, None)
    if schema is None:
        schema = parse_schema(source)
        _save(cached, schema)
    return dict(schema)


def parse_schema(source: bytes) -> Dict[str, Any]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    schema: Dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
            for field in node.body:
                if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
                    schema[field.target.id] = literal_default(field.value)
    return schema


def literal_default(value: Optional[ast.expr]) -> Any:
    if value is None:
        return MISSING
    try:
        return ast.literal_eval(value)
    except ValueError:
        return MISSING


OWN_SWITCHES = ("standin_", "fork_children", "package_root")


def refuse_unknown(given: Dict[str, Any], schema: Dict[str, Any]) -> None:
    """Exit 2 with argparse's usage error for an argument `ServerArgs` has no field for."""
    unknown = [k for k in given if schema and k not in schema and not k.startswith(OWN_SWITCHES)]
    if unknown:
        sys.stderr.write("usage: launch_server.py [-h] --model-path MODEL_PATH ...\n"
                         "launch_server.py: error: unrecognized arguments: %s\n"
                         % " ".join("--" + k.replace("_", "-") for k in unknown))
        sys.stderr.flush()
        os._exit(2)


def refuse_budget(args: Dict[str, Any]) -> None:
    """Die like a DDTREE server whose per-node state cannot fit at this budget (--standin-max-ddtree-budget)."""
    limit = switch(args, "standin_max_ddtree_budget", None)
    budget = int(args.get("speculative_ddtree_budget") or 64)
    if limit is not None and str(args.get("speculative_algorithm")).upper() == "DDTREE" and budget > int(limit):
        fatal(RuntimeError("DDTREE budget %d needs more verify memory than is free (stand-in limit %s)"
                           % (budget, limit)))


def main(argv: Optional[List[str]] = None) -> int:
    args = dict(DEFAULTS, **parse_args(sys.argv[1:] if argv is None else argv))
    log("server_args=%s" % json.dumps(args, sort_keys=True))
    ignore_sigterm = bool(switch(args, "standin_ignore_sigterm", False))
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    crash_after = switch(args, "standin_crash_after")
    if crash_after is not None:
        arm_crash(float(crash_after))
    try:
        pkg = package_dir(args)
        cache = str(switch(args, "standin_compile_cache", default_cache()))
        compiled = compile_package(pkg, cache)
        version = sglang_version(pkg)
    except (SyntaxError, ImportError, OSError) as exc:
        fatal(exc)
    log("loaded sglang %s from %s (%d modules compiled)" % (version, pkg, compiled))
    given = parse_args(sys.argv[1:] if argv is None else argv)
    schema = server_args_schema(pkg, cache)
    refuse_unknown(given, schema)
    # Like SGLang's ServerArgs: a field an overlay added resolves to its default when not given.
    defaults = {name: value for name, value in schema.items() if value != MISSING}
    args = dict(DEFAULTS, **dict(defaults, **given))
    if switch(args, "standin_compile_only", False):
        return 0
    refuse_budget(args)
    children = fork_children(int(switch(args, "fork_children", 0)), ignore_sigterm)
    log("started %d child processes: %s" % (len(children), [c.pid for c in children]))
    time.sleep(float(switch(args, "standin_start_delay", 0.0)))
    try:
        server = StandinServer(args, version)
    except OSError as exc:
        fatal(exc)
    log("Uvicorn running on http://%s:%s" % (args["host"], args["port"]))
    log("The server is fired up and ready to roll!")
    server.serve_forever(poll_interval=0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
