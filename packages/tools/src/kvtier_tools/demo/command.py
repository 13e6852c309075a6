"""``kvtier demo``: the command (its flags and its run); see `kvtier_tools.demo`."""

from __future__ import annotations

import argparse
import math


def _json_object(text: str) -> dict:
    """``--l3-config``: a JSON object, read as every config value is (`parse_json`: bounded
    nesting and integers, one-line errors)."""
    from kvtier.config import parse_json
    from kvtier.errors import ConfigError
    try:
        v = parse_json(text, "--l3-config")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], got {v}")
    return v


def _numbers(kind: type, name: str):
    """An argparse type: comma-separated finite numbers > 0 (a usage error otherwise)."""
    def parse(text: str) -> tuple:
        out = []
        for part in (p.strip() for p in text.split(",")):
            try:
                v = kind(part)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{name} takes comma-separated {kind.__name__}s, got {part!r}") from None
            if not math.isfinite(v) or v <= 0:
                raise argparse.ArgumentTypeError(f"{name} must be finite and > 0, got {part}")
            out.append(v)
        return tuple(out)
    return parse


def _millis(what: str, top: float | None = None):
    """An argparse type: milliseconds, finite and >= 0 (and <= ``top``)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(v) and v >= 0 and (top is None or v <= top)):
            bound = "finite and >= 0" if top is None else f"0 to {top:g} ms"
            raise argparse.ArgumentTypeError(f"{what} must be {bound}, got {text}")
        return v
    return parse


#: `kvtier_tools.demo.run.SETUPS` (spelled here: the flags are built without importing the run)
SETUPS = ("L1 only", "L1+L2", "L1+L2+L3", "L1+L2+L3 load all", "ideal (all in L1)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's flags (each maps onto a `kvtier_tools.demo.run.DemoConfig` field)."""
    from .model import MODEL_SIZES, describe_sizes
    g = p.add_argument_group("model")
    g.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                   help="model shape, random weights (default: small): "
                   + describe_sizes().replace("%", "%%") + ". MLA sizes tier DeepSeek-V2's "
                   "latent cache (one kv_lora_rank + rope row per token and layer)")
    g.add_argument("--device", default="cpu", help="torch device of the model and L1 (cpu, "
                   "cuda, cuda:1, ...)")
    g.add_argument("--dtype", default="float32", help="model and KV dtype (float32, bfloat16, "
                   "float16); the check is bitwise only for float32 on CPU")
    g.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads "
                   "(default on cpu: 1, leaving the other cores to kvtier's I/O threads)")
    g.add_argument("--max-forward-tokens", type=int, default=8192,
                   help="longest forward pass of a prefill (longer suffixes are chunked, as "
                   "engines' chunked prefill does)")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=["multiturn", "trace", "long"], default="multiturn")
    g.add_argument("--clients", type=int, default=8, help="multiturn: conversations; long: "
                   "documents")
    g.add_argument("--long-min-tokens", type=int, default=None,
                   help="long: shortest document (default 8192 on accelerators, 1024 on cpu)")
    g.add_argument("--long-max-tokens", type=int, default=None,
                   help="long: longest document (default 32768 on accelerators, 4096 on cpu)")
    g.add_argument("--rounds", type=int, default=8, help="multiturn: rounds per conversation; "
                   "trace: groups of requests in the per-round plot")
    g.add_argument("--first-tokens", type=int, default=1024,
                   help="multiturn: tokens of a conversation's first prompt (+-25%%)")
    g.add_argument("--turn-tokens", type=int, default=160,
                   help="multiturn: tokens of each later user turn; long: of each question "
                   "(+-25%%)")
    g.add_argument("--answer-tokens", type=int, default=96,
                   help="multiturn: tokens of each answer appended to the history (+-25%%)")
    g.add_argument("--system-tokens", type=int, default=0,
                   help="multiturn: shared system prompt tokens in front of every history")
    g.add_argument("--trace", metavar="PATH", help="trace: a Mooncake-format JSONL file")
    g.add_argument("--trace-block-tokens", type=int, default=16,
                   help="trace: tokens each 512-token block of the trace becomes (scale)")
    g.add_argument("--trace-requests", type=int, default=400,
                   help="trace: replay N requests")
    g.add_argument("--trace-start", type=int, default=0,
                   help="trace: skip the first N requests")
    g = p.add_argument_group("tiers and backends")
    g.add_argument("--l1-pages", type=int, default=None, help="device pool pages (default: "
                   "15%% of the workload's distinct pages, so that L1 alone thrashes)")
    g.add_argument("--l2-pages", type=int, default=None,
                   help="host pool pages (default: half the workload's distinct pages)")
    g.add_argument("--l3-bytes", type=int, default=None,
                   help="L3 store capacity in bytes (default: no limit)")
    g.add_argument("--host-allocator", default=None, help="host allocator by name (default: "
                   "mmap on cpu, so the file store can use O_DIRECT; torch-pinned elsewhere)")
    g.add_argument("--l3-store", default="file", help="L3 store by name (file: a temporary "
                   "directory unless --l3-config gives a root)")
    g.add_argument("--l3-config", type=_json_object, default={}, metavar="JSON",
                   help="the L3 store's config as a JSON object")
    g.add_argument("--transfer-engine", default="auto", help="transfer engine by name, or "
                   "auto: the best available for the device (reported)")
    g.add_argument("--write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    g.add_argument("--prefetch-policy", default="wait_complete",
                   choices=["best_effort", "wait_complete", "timeout"],
                   help="how long a request waits for L3 pages (requests arrive one at a "
                   "time, so best_effort gets only what landed by then)")
    g.add_argument("--no-cost-aware", action="store_true",
                   help="load every L2/L3 hit (default: the controller skips hit pages that "
                   "load slower than they recompute, at the rates it measures)")
    g.add_argument("--recompute-tokens-per-s", type=float, default=None,
                   help="the engine's prefill rate given to the controller (default: "
                   "measured as the demo runs)")
    g.add_argument("--setups", default=",".join(SETUPS),
                   help="comma-separated subset of: " + ", ".join(SETUPS) + " (default: all; "
                   "'L1+L2+L3 load all' is L1+L2+L3 loading every hit, what the cost-aware "
                   "split is judged against; the ideal keeps every page in L1, and every "
                   "speedup is reported as a %% of it)")
    g = p.add_argument_group("under load (after the serial replay; see docs/demo.md)")
    g.add_argument("--loads", "--load", type=_numbers(float, "--loads"), nargs="?",
                   const=(0.5, 0.8, 0.95), default=(), metavar="F[,F...]",
                   help="open loop: Poisson arrivals at these fractions of the L1-only "
                   "capacity (its service time with every conversation sending at once, measured "
                   "first; --load alone: 0.5,0.8,0.95); requests "
                   "queue FIFO, TTFT counts the wait, L3 prefetch starts at arrival")
    g.add_argument("--rate", type=_numbers(float, "--rate"), default=(), metavar="R[,R...]",
                   help="open loop: Poisson arrivals at these rates (requests/s)")
    g.add_argument("--concurrency", type=_numbers(int, "--concurrency"), default=(),
                   metavar="N[,N...]", help="closed loop: N users, each sending its "
                   "conversations' turns one after another")
    g.add_argument("--think-ms", type=_millis("think time"), default=0.0,
                   help="closed loop: a user's think time after a first token (default 0)")
    g.add_argument("--preload", action=argparse.BooleanOptionalAction, default=False,
                   help="load the next queued request's hits into L1 while the request ahead "
                   "prefills (default: every request's loads at its dispatch; on an H100 "
                   "this gained nothing, see docs/demo.md)")
    g.add_argument("--switch-interval-ms", type=_millis("the switch interval", 1000), default=0.1,
                   help="the interpreter's thread switch interval for every setup (kvtier's "
                   "threads run Python beside the prefill's launch; 0: CPython's 5 ms)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="weights, workload and check sampling")
    g.add_argument("--check", choices=["all", "sample", "none"], default="sample",
                   help="compare prefills on restored KV with a full recompute: every "
                   "request, a sample (the first L1 reuse and first L2/L3 load of each setup "
                   "plus --check-rate of the rest), or none")
    g.add_argument("--check-rate", type=float, default=0.1)
    g.add_argument("--check-mode", choices=["logits", "bitwise"], default="logits",
                   help="logits: prefill as engines do (one forward) and compare the first "
                   "token and logits with a full recompute within a tolerance; bitwise: "
                   "prefill one page per forward (~10x slower) and compare logits and every "
                   "KV page bit for bit (CPU float32). Restored pages are checked against "
                   "their digests at commit in both")
    g.add_argument("--out", default="kvtier-demo-out",
                   help="directory for results.json, tables.md and demo.png")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                   help="serve every setup's kvtier metrics (Prometheus text format) at "
                   "http://127.0.0.1:PORT/metrics while the demo runs; 0 picks a free port "
                   "(bound before the model is built: a port in use fails at once)")
    g.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics exporter binds to (loopback unless told)")
    g.add_argument("--digests", type=_digests, default=None, metavar="PATH",
                   help="page digests read at start (if the file exists) and merged into at "
                   "the end: demo processes sharing one L3 (a shm arena, a file store root) "
                   "check the pages each other computed bit for bit")
    g.add_argument("--corrupt-restore", action="store_true",
                   help="testing: flip one bit of the first page each request restores "
                   "from L2/L3, to show that the digest check fails the run (exit 2)")


def _digests(text: str) -> str:
    """``--digests``: a digests file that reads (or none yet), checked before the model is
    built."""
    import os

    from .digest import load_known
    where = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(where) or not os.access(where, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"--digests {text}: {where} is not a directory this "
                                         "process can write")
    try:
        load_known(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def config_from_args(args: argparse.Namespace):
    from .run import DemoConfig
    data = {
        "model_size": args.model_size, "device": args.device, "dtype": args.dtype,
        "page_size": args.page_size, "threads": args.threads, "workload": args.workload,
        "clients": args.clients, "rounds": args.rounds, "first_tokens": args.first_tokens,
        "turn_tokens": args.turn_tokens, "answer_tokens": args.answer_tokens,
        "system_tokens": args.system_tokens, "trace": args.trace,
        "trace_block_tokens": args.trace_block_tokens, "trace_requests": args.trace_requests,
        "trace_start": args.trace_start, "long_min_tokens": args.long_min_tokens,
        "long_max_tokens": args.long_max_tokens, "check_mode": args.check_mode,
        "max_forward_tokens": args.max_forward_tokens, "cost_aware": not args.no_cost_aware,
        "recompute_tokens_per_s": args.recompute_tokens_per_s,
        "l1_pages": args.l1_pages, "l2_pages": args.l2_pages, "l3_bytes": args.l3_bytes,
        "host_allocator": args.host_allocator, "l3_store": args.l3_store,
        "l3_config": args.l3_config, "transfer_engine": args.transfer_engine,
        "write_policy": args.write_policy, "prefetch_policy": args.prefetch_policy,
        "setups": tuple(s.strip() for s in args.setups.split(",") if s.strip()),
        "seed": args.seed, "check": args.check, "check_rate": args.check_rate,
        "out": args.out, "plot": not args.no_plot, "progress": not args.no_progress,
        "metrics_port": args.metrics_port, "metrics_host": args.metrics_host,
        "loads": tuple(args.loads), "rates": tuple(args.rate),
        "concurrency": tuple(args.concurrency), "think_ms": args.think_ms,
        "digests": args.digests, "preload": args.preload,
        "switch_interval_ms": args.switch_interval_ms,
    }
    return DemoConfig.from_dict(data)


def run(args: argparse.Namespace) -> int:
    import sys
    import time

    from .output import tables, write_outputs
    from .run import run_demo
    cfg = config_from_args(args)
    t0 = time.perf_counter()
    report = run_demo(cfg, corrupt_restore=args.corrupt_restore)
    files = write_outputs(report, cfg.out)
    print(tables(report))
    for run in report.runs:
        if run.store_stats:
            shown = {k: v for k, v in run.store_stats.items() if k not in ("root", "name")}
            print(f"{run.name}: L3 store {run.l3}: {shown}", file=sys.stderr)
    checked = sum(r.checks for r in report.runs)
    pages = sum(x.restored_checked for r in report.runs for x in r.results)
    print(f"\ncorrectness: {pages} restored page(s) matched their digest at commit bit for "
          f"bit; {checked} prefill(s) on restored KV matched a full recompute "
          f"({'bit for bit' if report.runs and _bitwise(report) else _tol(report)}); "
          f"{time.perf_counter() - t0:.0f} s in all; files: "
          + ", ".join(files.values()), file=sys.stderr)
    return 0


def _bitwise(report) -> bool:
    return all(r.check is None or r.check.exact for run in report.runs for r in run.results)




def _tol(report) -> str:
    tols = {r.check.tolerance for run in report.runs for r in run.results if r.check}
    return "within relative tolerance " + "/".join(f"{t:g}" for t in sorted(tols)) + \
        " of max(1, max |logit|), same first token"
