"""The recompute side of the physics: how long the demo's model takes to prefill ``c`` tokens
after an ``s``-token prefix already in the device pool, against recomputing all ``s + c``
tokens in one forward (what an engine without kvtier does) -- per attention path for the
queries that follow a prefix. The ratio full / after-prefix is the most a hit of ``s`` tokens
can save, and ``(s + c) / c`` what it would save if compute were proportional to the tokens
computed."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..demo.model import PREFIX_ATTENTIONS as ATTENTIONS
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import ConfigError
from kvtier.report import progress, table


#: No cache is built here (it runs the demo model's prefill):
#: `kvtier --config FILE` says the file does not apply (`kvtier.cli`).
BUILDS_CACHE = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-size", default="small",
                   help="demo model size (tiny, small, medium, large, 8b)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--cases", default="0:512,0:2048,512:512,2048:512,2048:2048,8192:1024",
                   help="comma-separated prefix:computed token counts (multiples of the page "
                        "size)")
    p.add_argument("--attention", default=None,
                   help="comma-separated attention paths for queries after a prefix "
                        f"({', '.join(ATTENTIONS)}; default: both on accelerators, blocks on "
                        "CPU)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions (median)")
    p.add_argument("--json", help="write every result here")


def _cases(text: str, page_size: int) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            s, c = (int(x) for x in item.split(":"))
        except ValueError:
            raise ConfigError(f"--cases: expected prefix:computed, got {item!r}",
                              key="cases", value=item) from None
        if s < 0 or c < 1 or s % page_size or c % page_size:
            raise ConfigError(f"--cases: {item!r} needs prefix >= 0 and computed >= 1, both "
                              f"multiples of the page size {page_size}", key="cases",
                              value=item)
        out.append((s, c))
    return out


def _median_s(fn, repeat: int, device: torch.device) -> float:
    fn()                                         # warm up (kernels, allocator)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    from ..demo import model as demo_model
    from ..demo.model import DemoModel
    if args.repeat < 1:
        raise ConfigError(f"--repeat must be >= 1, got {args.repeat}", key="repeat",
                          value=args.repeat)
    cases = _cases(args.cases, args.page_size)
    device = torch.device(args.device)
    paths = (args.attention.split(",") if args.attention else
             (["blocks"] if device.type == "cpu" else list(ATTENTIONS)))
    for a in paths:
        if a not in ATTENTIONS:
            raise ConfigError(f"--attention: {a!r} is not one of {ATTENTIONS}",
                              key="attention", value=a)
    longest = max(s + c for s, c in cases)
    model = DemoModel(args.model_size, page_size=args.page_size, device=device,
                      dtype=args.dtype, max_forward_tokens=longest)
    ps = args.page_size
    pool = DeviceKVPool.empty(model.spec, longest // ps, device=device)
    gen = torch.Generator().manual_seed(0)
    rows, results = [], []
    saved = demo_model.PREFIX_ATTENTION
    try:
        for s, c in progress(cases, desc="prefill cases"):
            n = s + c
            toks = model.as_tokens(torch.randint(0, model.vocab_size, (n,), generator=gen))
            pages = list(range(n // ps))
            full = _median_s(lambda t=toks, p=pages: model.prefill(t, pool, [], p), args.repeat,
                             device)
            row = {"prefix": s, "computed": c, "full_s": full}
            if s:
                model.prefill(toks[:s], pool, [], pages[:s // ps])       # the prefix's KV
                for a in paths:
                    demo_model.PREFIX_ATTENTION = a
                    row[f"{a}_s"] = _median_s(
                        lambda t=toks, pre=pages[:s // ps], new=pages[s // ps:]:
                        model.prefill(t, pool, pre, new),
                        args.repeat, device)
            results.append(row)
            cells = [s, c, f"{1e3 * full:.1f}", f"{n / full:,.0f}"]
            for a in paths:
                t = row.get(f"{a}_s")
                cells += ["" if t is None else f"{1e3 * t:.1f}",
                          "" if t is None else f"{full / t:.2f}x"]
            cells.append(f"{n / c:.2f}x" if s else "")
            rows.append(cells)
    finally:
        demo_model.PREFIX_ATTENTION = saved
    head = ["prefix", "computed", "full ms", "full tok/s"]
    for a in paths:
        head += [f"after prefix ms ({a})", f"saved ({a})"]
    head.append("proportional")
    print(f"demo model {args.model_size} ({model.num_params / 1e9:.2f} B params, "
          f"{args.dtype}) on {device}: prefill of `computed` tokens after `prefix` cached "
          f"tokens vs all in one forward (median of {args.repeat}); saved = full / after "
          "prefix; proportional = what saving would be if time were proportional to tokens "
          "computed")
    print(table(head, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_size": args.model_size, "dtype": args.dtype,
                       "device": str(device), "cases": results}, f, indent=2)
    return 0
