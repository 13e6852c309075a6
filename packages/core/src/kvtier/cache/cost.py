"""The cost-aware fetch: load only the leading pages whose loading beats recomputing them.

`CostModel` keeps, online, the bandwidth each tier's loads achieve (moving averages of the
bytes moved and the seconds taken, per tier and engine: the L2 -> L1 loads of the transfer
engine, the L3 -> L2 reads of the store) and the engine's recompute rate (tokens/s, given
in the config or reported through ``TieredKVCache.observe_recompute``). For each fetch
`best_split` picks how many of the match's pages to load: the count ``k`` that minimises the
modelled time to the first token, with the H2D load overlapped with the prefill layer by
layer (layer ``i`` of the prefill waits only for layer ``i`` of the prefix) and the L3 read
of the pages not yet in L2 before it::

    T(k) = l3(k) + max(h2d(k), comp(k)) + min(h2d(k), comp(k)) / layers
    l3(k)   = pages of the first k not yet in L2 x page_bytes / L3 bandwidth
              (+ the fixed cost of waiting for an L3 read at all, where the engine has one)
    h2d(k)  = k x page_bytes / L2 -> L1 bandwidth
    comp(k) = fixed + max(0, c - knee) / recompute rate + attn x pairs(n, c)
    c       = tokens computed anyway + (hit pages - k) x page_size  (the last c of n tokens)
    pairs   = (n^2 - (n - c)^2) / 2  (query-key pairs of attention over the context)

The recompute rate, ``fixed``, ``knee`` and ``attn`` come from a fit of the engine's recent
prefills (see `_Marginal`): a prefill costs ``fixed`` whatever it computes up to ``knee``
tokens (0 where its cost is a line), and ``attn`` is 0 until the engine reports each
prefill's context (``observe_recompute(..., context=n)``) and the data tell it apart. The
fixed cost is the same for every split, but loads overlap it. A split that loads fewer pages
than were hit is taken only where it is modelled `SKIP_GAIN` faster than loading them all:
skipping a page for less is a bet on the model, not on the measurement.

Until a rate is known nothing is cut (every hit is loaded, and the load measures it). A store
call still running counts in the L3 bandwidth as soon as it is slower than the EWMA, so a
tier that stalls mid-run (a hung disk) is skipped from the next fetch on instead of waited
for; its background reads go on and measure it again when it recovers.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, TypeVar

from ..errors import ConfigError

_Model = TypeVar("_Model", bound="CostModel")

__all__ = ["CostModel", "ReportedCostModel", "TimedStore", "best_split", "split_time",
           "check_rate", "pairs", "merge_rates", "load_seconds", "group_bytes", "RATE_NAMES"]

#: The keys of `CostModel.rates` (what one process reports to another).
RATE_NAMES = ("recompute_tokens_per_s", "recompute_fixed_s", "recompute_attn_s_per_pair",
              "recompute_knee_tokens", "l2_load_bytes_per_s", "l3_read_bytes_per_s")

#: A split that loads fewer pages than were hit must be modelled at least this much (a
#: fraction of loading them all) faster: on an H100 the demo's prefills vary by several % at
#: equal work, and a split chasing less than that skipped pages for nothing.
SKIP_GAIN = 0.02


def pairs(context: int | None, computed: int) -> float:
    """Query-key pairs of computing the last ``computed`` of ``context`` tokens causally
    (``(n^2 - s^2) / 2``, s = n - computed); 0 when the context is not known."""
    if context is None:
        return 0.0
    n = max(int(context), int(computed))
    s = n - int(computed)
    return (n * n - s * s) / 2.0


def check_rate(name: str, value: Any) -> float:
    """``value`` as a finite rate > 0, else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number > 0, got {value!r}", key=name, value=value)
    v = float(value)
    if not (v > 0) or math.isinf(v):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}", key=name,
                          value=value)
    return v


def split_time(k: int, *, l2_pages: int, l3_pages: int, l3_ready: int = 0, compute_tokens: int,
               page_size: int, page_bytes: int, h2d_bps: float, l3_bps: float | None,
               recompute_tps: float, layers: int = 1, attn_s: float = 0.0,
               context: int | None = None, l3_fixed_s: float = 0.0, groups: int = 0,
               recompute_fixed_s: float = 0.0, knee_tokens: float = 0.0) -> float:
    """Modelled seconds to the first token when the first ``k`` of the ``l2_pages +
    l3_pages`` hit pages are loaded and the rest recomputed (see the module doc);
    ``l3_ready`` of the L3 pages are already in L2. ``l3_bps`` None: L3 pages cost no read.
    ``context``: the request's tokens (for the attention term ``attn_s`` per pair);
    ``l3_fixed_s``: what waiting for any L3 read costs beyond its bytes (vLLM: the request
    leaves the batch until the read is reported); ``groups`` (>= 2): the L3 read streams in
    that many layer groups, each loaded and computed as it lands (`kvtier.cache.stream`), so
    only its first group comes before the prefill and the rest runs beside it.
    ``recompute_fixed_s``, ``knee_tokens``: a prefill costs the fixed seconds for up to that
    many tokens, then each token more at ``recompute_tps``."""
    n = l2_pages + l3_pages
    if not 0 <= k <= n:
        raise ValueError(f"k={k} outside [0, {n}]")
    from_l3 = max(0, k - l2_pages - l3_ready)
    t3 = from_l3 * page_bytes / l3_bps if from_l3 and l3_bps is not None else 0.0
    fixed = l3_fixed_s if t3 else 0.0
    h = k * page_bytes / h2d_bps
    tokens = compute_tokens + (n - k) * page_size
    c = recompute_fixed_s + max(0.0, tokens - knee_tokens) / recompute_tps + \
        (attn_s * pairs(context, tokens) if attn_s else 0.0)
    rest = max(h, c) + min(h, c) / max(1, layers)
    if groups >= 2 and t3:       # the fixed cost comes whole before the first group
        return fixed + t3 / groups + max(t3 * (groups - 1) / groups, rest)
    return fixed + t3 + rest


def best_split(*, l2_pages: int, l3_pages: int, l3_ready: int = 0, compute_tokens: int,
               page_size: int, page_bytes: int, h2d_bps: float | None, l3_bps: float | None,
               recompute_tps: float | None, layers: int = 1, attn_s: float = 0.0,
               context: int | None = None, l3_fixed_s: float = 0.0, groups: int = 0,
               recompute_fixed_s: float = 0.0, knee_tokens: float = 0.0,
               skip_gain: float = SKIP_GAIN) -> int:
    """How many leading hit pages to load: the fastest split, or every page where that is not
    ``skip_gain`` (a fraction) faster than loading them all (ties load more). Unknown rates
    (None) cut nothing -- except a collapsed L3 (``l3_bps`` 0): its pages not in L2 are
    never waited for."""
    n = l2_pages + l3_pages
    if n == 0:
        return 0
    ready = l2_pages + min(l3_ready, l3_pages)
    if l3_bps is not None and l3_bps <= 0:          # stalled: only what is in L2 already
        n = ready
        l3_bps = None
    if recompute_tps is None or h2d_bps is None:
        return n
    kw = dict(l2_pages=l2_pages, l3_pages=l3_pages, l3_ready=l3_ready,
              compute_tokens=compute_tokens, page_size=page_size, page_bytes=page_bytes,
              h2d_bps=h2d_bps, l3_bps=l3_bps, recompute_tps=recompute_tps, layers=layers,
              attn_s=attn_s, context=context, l3_fixed_s=l3_fixed_s, groups=groups,
              recompute_fixed_s=recompute_fixed_s, knee_tokens=knee_tokens)
    best_k, best_t = n, split_time(n, **kw)
    t_all = best_t
    for k in range(n - 1, -1, -1):
        t = split_time(k, **kw)
        if t < best_t * (1 - 1e-9):
            best_k, best_t = k, t
    return best_k if best_t < t_all * (1 - skip_gain) else n


class _Rate:
    """A rate (units per second) as the ratio of moving averages of the amounts moved and
    the seconds they took, so large transfers weigh more than small ones whose time is
    mostly fixed cost."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self._amount = 0.0
        self._seconds = 0.0
        self.samples = 0

    @property
    def value(self) -> float | None:
        if not self.samples:
            return None
        return self._amount / max(self._seconds, 1e-12)

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0:
            return
        a = 1.0 if not self.samples else self.alpha
        self._amount = (1 - a) * self._amount + a * amount
        self._seconds = (1 - a) * self._seconds + a * max(seconds, 1e-9)
        self.samples += 1


class _Mean:
    """An exponential moving average of a quantity (None until observed)."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.value: float | None = None

    def observe(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


class _Marginal:
    """The engine's recompute cost as ``fixed + max(0, tokens - knee) / rate + attn x pairs``,
    fitted by least squares to the last `WINDOW` prefills. The split decision needs the
    marginal ``rate``: a prefill pays its fixed cost whether a prefix is loaded or not, and
    folding that cost into tokens/s makes recompute look several times slower than it is (on
    the H200, 70 ms fixed + 75K tokens/s read as 5K tokens/s and let a 13K-tokens/s L3
    through).

    The knee: a GPU's prefill costs about the same up to some hundreds of tokens (the host
    launching kernels, the weights read once), then rises (on an H100, the demo's 8B model:
    21-25 ms up to ~700 tokens, then 31K tokens/s). A line fitted to prefills that mostly sit
    on the flat part has almost no slope, which reads as recompute for free: the online line
    swung 12K-714K tokens/s over one run and the split skipped in-place L3 pages at 350K
    tokens/s, pushing prefills past the knee (66% of the ideal under load, against 72% on a
    machine where it skipped none). So the fit tries knees at quantiles of the window's
    prefill sizes and keeps one only where it explains them `KNEE_GAIN` better than a line,
    with `KNEE_SUPPORT` of the prefills above it to measure the slope.

    The third term is attention over the context: computing positions ``s..n`` costs about
    ``(n^2 - s^2) / 2`` query-key pairs, which makes a token at position 30K several times
    dearer than one at 1K (on the H200, 8B shape: 33K tokens/s from position 0, 13K at 24K).
    It is fitted only when the engine reports the context (``pairs``); every coefficient
    stays >= 0 (the best fit over the subsets of terms that keeps them so).

    The window remembers long: telling a fixed cost from a per-token one needs prefills of
    different lengths, and in a multi-turn run the long first prompts come early, the short
    suffixes after. A moving average with the rates' 0.3 forgot the long ones within a dozen
    requests (on the H200's DeepSeek-V2-Lite shape, 36 ms fixed + 72-86K tokens/s, it settled
    at 6.4K tokens/s and let a 52K-tokens/s disk through)."""

    #: Prefills the fit is made over (the most recent).
    WINDOW = 256
    #: A knee is kept only where its squared error is at most this share of a line's.
    KNEE_GAIN = 0.8
    #: ... and at least this share of the window (and 3 prefills) lie above it.
    KNEE_SUPPORT = 0.1
    #: Where knees are tried: these quantiles of the window's prefill sizes.
    KNEE_QUANTILES = (0.2, 0.35, 0.5, 0.65, 0.8)
    #: Once the window holds `REFIT_FROM` prefills, the fit is made again only after this
    #: many new ones (a fit costs ~0.5 ms of numpy; a serving engine observes every step).
    REFIT_EVERY = 8
    REFIT_FROM = 32

    #: feature scales (kilo-tokens, mega-pairs) keep the least squares well conditioned
    _SCALE = (1.0, 1e-3, 1e-6)
    _SUBSETS = ((0, 1, 2), (1, 2), (0, 1), (1,))

    def __init__(self, alpha: float):
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=self.WINDOW)
        self.samples = 0
        self._ratio = _Rate(alpha)
        self._fit: tuple[float, float, float, float] | None = None
        self._new = 0                       # prefills observed since the last fit
        self._lock = threading.Lock()       # the window and the count against the fit

    def observe(self, tokens: float, seconds: float, pairs: float = 0.0) -> None:
        if tokens <= 0:
            return
        with self._lock:
            self._obs.append((float(tokens), max(0.0, float(pairs)), float(seconds)))
            self.samples += 1
            self._new += 1
        self._ratio.observe(tokens, seconds)

    def _solve(self) -> tuple[float, float, float, float] | None:
        """(fixed s, s per token above the knee, s per pair, knee tokens), or None until the
        data tell them apart. The fit is made over a copy of the window; a reader on another
        thread meanwhile gets the last fit."""
        with self._lock:
            if not self._new or (self._new < self.REFIT_EVERY
                                 and len(self._obs) >= self.REFIT_FROM):
                return self._fit
            self._new = 0
            obs = list(self._obs)
        self._fit = fit = self._fit_of(obs) if len(obs) >= 3 else None
        return fit

    def _fit_of(self, obs: list[tuple[float, float, float]]
                ) -> tuple[float, float, float, float] | None:
        import numpy as np
        n, p, t = np.array(obs).T
        line = self._best(n, p, t, 0.0, self._SUBSETS)
        knee: tuple[float, np.ndarray, float] | None = None
        least = max(3, int(self.KNEE_SUPPORT * len(n)))
        for k in sorted(set(np.quantile(n, self.KNEE_QUANTILES).round().tolist())):
            if k <= 0 or int((n > k).sum()) < least:
                continue
            fit = self._best(n, p, t, k, ((0, 1, 2), (0, 1)))   # a floor needs its level
            if fit is not None and (knee is None or fit[0] < knee[0]):
                knee = fit
        if knee is not None and (line is None or knee[0] <= self.KNEE_GAIN * line[0]):
            line = knee
        if line is None:
            return None
        c = line[1] * np.array(self._SCALE)
        return (float(c[0]), float(c[1]), float(c[2]), float(line[2]))

    @staticmethod
    def _best(n: Any, p: Any, t: Any, knee: float, subsets: Any) -> Any:
        """(squared error, scaled coefficients, knee) of the best fit over ``subsets`` of the
        terms that keeps every coefficient >= 0 and the slope > 0; None if none does."""
        import numpy as np
        x = np.stack([np.ones_like(n), np.maximum(0.0, n - knee), p], 1) * \
            np.array(_Marginal._SCALE)
        best = None
        for cols in subsets:
            a = x[:, cols]
            if np.linalg.cond(a.T @ a) > 1e9:
                continue                      # a term the data do not vary in
            coef = np.linalg.lstsq(a, t, rcond=None)[0]
            if not np.isfinite(coef).all() or (coef < 0).any() or coef[cols.index(1)] <= 0:
                continue
            err = float(((a @ coef - t) ** 2).sum())
            if best is None or err < best[0] - 1e-12 * float((t * t).sum()):
                full = np.zeros(3)
                full[list(cols)] = coef
                best = (err, full, knee)
        return best

    @property
    def value(self) -> float | None:
        """Marginal tokens/s (above the knee) once the data tell slope from fixed cost; until
        then the plain ratio (an underestimate: it counts the fixed cost too)."""
        fit = self._solve()
        if fit is not None:
            return max(1.0 / fit[1], self._ratio.value or 0.0)
        return self._ratio.value

    @property
    def attn_s(self) -> float:
        """Seconds per query-key pair of attention (0 until fitted)."""
        fit = self._solve()
        return 0.0 if fit is None else fit[2]

    @property
    def fixed_s(self) -> float | None:
        fit = self._solve()
        if fit is not None:
            return fit[0]
        return None if not self.samples else 0.0

    @property
    def knee_tokens(self) -> float:
        """Tokens a prefill computes for its fixed cost alone (0: none fitted)."""
        fit = self._solve()
        return 0.0 if fit is None else fit[3]


class CostModel:
    """Measured rates and the split decision of one controller (thread-safe)."""

    #: How often (seconds) an L3 read the split would skip is made anyway, in the background,
    #: so that the L3 rate stays measured: a disk that was slow (or stalled) and recovers is
    #: used again.
    L3_PROBE_INTERVAL_S = 5.0
    #: Pages such a probe reads (enough for a rate, not a whole long document).
    L3_PROBE_PAGES = 8
    #: The first read (before the rate is known) takes `L3_PROBE_PAGES` pages or this many
    #: bytes, whichever is more: 8 pages of an 8B model's 8 MiB, 256 pages of 256 KiB.
    L3_PROBE_BYTES = 64 << 20

    def __init__(self, *, enabled: bool = True, recompute_tokens_per_s: float | None = None,
                 alpha: float = 0.3, engine: str = "", store: str = ""):
        if recompute_tokens_per_s is not None:
            recompute_tokens_per_s = check_rate("recompute_tokens_per_s",
                                                recompute_tokens_per_s)
        if not (0 < alpha <= 1):
            raise ConfigError(f"cost_ewma_alpha must be in (0, 1], got {alpha!r}",
                              key="cost_ewma_alpha", value=alpha)
        self.enabled = enabled
        self.engine = engine
        self.store = store
        self._lock = threading.Lock()
        self._given_rate = recompute_tokens_per_s
        self._recompute = _Marginal(alpha)
        self._h2d = _Rate(alpha)
        self._l3 = _Rate(alpha)
        self._inflight: dict[int, tuple[float, int]] = {}   # call id -> (t0, bytes)
        self._l3_wait = _Mean(alpha)        # fixed cost of waiting for an L3 read
        self._next_call = 0
        self._last_l3 = -math.inf            # when an L3 read last started

    @classmethod
    def from_config(cls: type[_Model], cfg: Any) -> _Model:
        """The model a `CacheConfig` describes (``cost_aware_fetch``, ``recompute_tokens_per_s``,
        ``cost_ewma_alpha``; named after its engine and store)."""
        return cls(enabled=cfg.cost_aware_fetch, alpha=cfg.cost_ewma_alpha,
                   recompute_tokens_per_s=cfg.recompute_tokens_per_s,
                   engine=cfg.transfer_engine, store=cfg.l3_store or "")

    # ----- observations ---------------------------------------------------------------------
    def observe_recompute(self, tokens: int, seconds: float,
                          context: int | None = None, *, num_pairs: float | None = None
                          ) -> None:
        """The engine computed ``tokens`` prefill tokens in ``seconds``; ``context``: the
        request's length (the tokens were its last ones), for the attention term. A step of
        several requests gives its query-key pairs summed over them as ``num_pairs``."""
        if tokens > 0 and seconds >= 0 and math.isfinite(seconds):
            n = pairs(context, tokens) if num_pairs is None else max(0.0, float(num_pairs))
            with self._lock:
                self._recompute.observe(tokens, seconds, n)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """An L2 -> L1 load of ``nbytes`` took ``seconds`` (`load_seconds`)."""
        if nbytes > 0 and seconds >= 0 and math.isfinite(seconds):
            with self._lock:
                self._h2d.observe(nbytes, seconds)

    def observe_l3_wait(self, seconds: float, nbytes_read: int, nbytes_loaded: int) -> None:
        """A request waited ``seconds`` for a load that read ``nbytes_read`` from L3 and
        loaded ``nbytes_loaded`` into L1: what the rates do not explain of it is the fixed
        cost of an L3 read (`l3_fixed_s`)."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        l3, h2d = self.l3_bytes_per_s, self.h2d_bytes_per_s
        if not l3 or not h2d:
            return
        with self._lock:
            self._l3_wait.observe(max(0.0, seconds - nbytes_read / l3 - nbytes_loaded / h2d))

    @property
    def l3_fixed_s(self) -> float:
        """Measured fixed cost of waiting for an L3 read (0 until observed)."""
        return self._l3_wait.value or 0.0

    def l3_call_started(self, nbytes: int) -> int:
        with self._lock:
            self._last_l3 = time.perf_counter()
            self._next_call += 1
            self._inflight[self._next_call] = (time.perf_counter(), nbytes)
            return self._next_call

    def l3_call_ended(self, call: int, nbytes_done: int, *, whole: bool = True) -> None:
        """``whole`` False: a streamed read's layer group. Its rate is not a whole read's (on
        an H100 the groups of one read, each read beside the prefill, came 3x slower), so it
        goes into the L3 rate only while none is measured; a stalled one still lowers it
        while it runs."""
        with self._lock:
            t0, _ = self._inflight.pop(call, (None, 0))
            if t0 is not None and (whole or self._l3.value is None):
                self._l3.observe(nbytes_done, time.perf_counter() - t0)

    # ----- rates ----------------------------------------------------------------------------
    @property
    def recompute_tokens_per_s(self) -> float | None:
        return self._given_rate if self._given_rate is not None else self._recompute.value

    @property
    def h2d_bytes_per_s(self) -> float | None:
        return self._h2d.value

    @property
    def l3_bytes_per_s(self) -> float | None:
        """EWMA of L3 reads, lowered to what a store call still running implies when that
        is less (towards 0 while a call makes no progress: a stalled store)."""
        with self._lock:
            bw = self._l3.value
            now = time.perf_counter()
            for t0, nbytes in self._inflight.values():
                elapsed = now - t0
                if bw is not None and elapsed > 0 and nbytes / elapsed < bw:
                    bw = nbytes / elapsed
        return bw

    @property
    def recompute_attn_s(self) -> float:
        """Fitted seconds per query-key pair of attention (0: not fitted, or given rate)."""
        return 0.0 if self._given_rate is not None else self._recompute.attn_s

    @property
    def recompute_fixed_s(self) -> float | None:
        """The fitted fixed cost of one prefill (the same for every split; loads overlap it)."""
        return None if self._given_rate is not None else self._recompute.fixed_s

    @property
    def recompute_knee_tokens(self) -> float:
        """Tokens a prefill computes for its fixed cost alone (0: none fitted, or given rate)."""
        return 0.0 if self._given_rate is not None else self._recompute.knee_tokens

    def rates(self) -> dict[str, float | None]:
        return {"recompute_tokens_per_s": self.recompute_tokens_per_s,
                "recompute_fixed_s": self.recompute_fixed_s,
                "recompute_attn_s_per_pair": self.recompute_attn_s,
                "recompute_knee_tokens": self.recompute_knee_tokens,
                "l2_load_bytes_per_s": self.h2d_bytes_per_s,
                "l3_read_bytes_per_s": self.l3_bytes_per_s,
                "l3_wait_fixed_s": self.l3_fixed_s}

    def l3_slower_than_recompute(self, page_size: int, page_bytes: int) -> bool:
        """Would reading a page from L3 take longer than recomputing it (rates known)?"""
        r, bw = self.recompute_tokens_per_s, self.l3_bytes_per_s
        return r is not None and bw is not None and page_bytes / max(bw, 1e-30) > page_size / r

    def stream_pays(self, pages: int, page_bytes: int, min_read_s: float) -> bool:
        """Should an L3 read of ``pages`` stream layer group by layer group: would its whole
        read take at least ``min_read_s`` at the measured rate (``min_read_s`` 0: always;
        rate unknown or collapsed: no)?"""
        if min_read_s <= 0:
            return True
        bw = self.l3_bytes_per_s
        return bw is not None and bw > 0 and pages * page_bytes / bw >= min_read_s

    def wants_l3_probe(self) -> bool:
        """Should an L3 read the split skips be made anyway (none started for
        `L3_PROBE_INTERVAL_S`, none in flight)? True claims the probe."""
        with self._lock:
            now = time.perf_counter()
            if self._inflight or now - self._last_l3 < self.L3_PROBE_INTERVAL_S:
                return False
            self._last_l3 = now
            return True

    def pages_readable_in(self, seconds: float, page_bytes: int, limit: int,
                          behind: int = 0) -> int:
        """How many pages (at most ``limit``) an L3 read started now lands within ``seconds``
        at the measured rate (0 while the rate is unknown), behind ``behind`` pages of reads
        already queued or running (they share the store's rate): a request that waits that
        long for its turn gets them for nothing."""
        bw = self.l3_bytes_per_s
        if not bw or seconds <= 0 or page_bytes <= 0:
            return 0
        n = int((seconds - self.l3_fixed_s) * bw // page_bytes) - max(0, behind)
        return max(0, min(limit, n))

    # ----- the decision ---------------------------------------------------------------------
    def split(self, *, l2_pages: int, l3_pages: int, in_place: bool = False, l3_ready: int = 0,
              compute_tokens: int, page_size: int, page_bytes: int, layers: int,
              context: int | None = None, groups: int = 0) -> tuple[int, int]:
        """The cost split of a request's leading ``l2_pages`` L2 hits and the ``l3_pages`` L3
        hits after them, as every path makes it (the in-process cache, the planner of a
        serving engine): how many of each to load, the rest (and ``compute_tokens`` more)
        being recomputed. ``in_place``: the L3 pages load straight from the store's memory, as
        L2 pages do (no read to wait for); ``l3_ready``: L3 pages already read into L2;
        ``groups``: the read streams in that many layer groups (`split_time`)."""
        if not self.enabled or l2_pages + l3_pages == 0:
            return l2_pages, l3_pages
        l2, l3, ready = (l2_pages + l3_pages, 0, 0) if in_place else \
            (l2_pages, l3_pages, l3_ready)
        k = self.pages_to_load(l2_pages=l2, l3_pages=l3, l3_ready=ready,
                               compute_tokens=compute_tokens, page_size=page_size,
                               page_bytes=page_bytes, layers=layers, context=context,
                               groups=groups)
        return min(l2_pages, k), min(l3_pages, max(0, k - l2_pages))

    def first_read_cap(self, pages: int, page_bytes: int = 0) -> int:
        """Until the L3 rate is measured, a read takes only `L3_PROBE_PAGES` pages, or
        `L3_PROBE_BYTES` of ``page_bytes`` pages where that is more: the first L3 hit of a
        slow store must not stall a request on a long prefix (on the H200, 2.9 GB from a
        1.35 GB/s disk held one request 2.2 s; 64 MiB takes 50 ms there), while a probe of
        small pages must not cut a long document (on the CPU demo, 8 of a 64-page document
        cost long context 14%); the probe measures the rate, and the rest of the hit is
        recomputed this once."""
        if self.enabled and self.l3_bytes_per_s is None:
            cap = self.L3_PROBE_PAGES
            if page_bytes > 0:
                cap = max(cap, self.L3_PROBE_BYTES // page_bytes)
            return min(pages, cap)
        return pages

    def pages_to_load(self, *, l2_pages: int, l3_pages: int, l3_ready: int,
                      compute_tokens: int, page_size: int, page_bytes: int,
                      layers: int, context: int | None = None, groups: int = 0) -> int:
        if not self.enabled:
            return l2_pages + l3_pages
        return best_split(l2_pages=l2_pages, l3_pages=l3_pages, l3_ready=l3_ready,
                          compute_tokens=compute_tokens, page_size=page_size,
                          page_bytes=page_bytes, h2d_bps=self.h2d_bytes_per_s,
                          l3_bps=self.l3_bytes_per_s if l3_pages > l3_ready else None,
                          recompute_tps=self.recompute_tokens_per_s, layers=layers,
                          attn_s=self.recompute_attn_s, context=context,
                          l3_fixed_s=self.l3_fixed_s, groups=groups,
                          recompute_fixed_s=self.recompute_fixed_s or 0.0,
                          knee_tokens=self.recompute_knee_tokens)


def group_bytes(page_bytes: int, num_layers: int, group: tuple[int, int], pages: int) -> int:
    """Bytes of layers ``group`` = (lo, hi) of ``pages`` pages."""
    lo, hi = group
    return pages * page_bytes * (hi - lo) // max(1, num_layers)


def load_seconds(handle: Any, started: float) -> float:
    """How long a landed load took, for its bandwidth: the engine's own measure of its copies
    where it has one (`TransferHandle.busy_seconds`), else from ``started`` to now."""
    busy = handle.busy_seconds() if hasattr(handle, "busy_seconds") else None
    if isinstance(busy, (int, float)) and not isinstance(busy, bool) and busy >= 0:
        return float(busy)
    return time.perf_counter() - started


def _reported(value: Any) -> float | None:
    """A reported rate as a finite float >= 0, else None (never trusted blindly)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) and v >= 0 else None


def merge_rates(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two processes' `CostModel.rates` as one (tensor-parallel ranks of one engine: a load is
    done when the slowest rank's is): the lower of each rate and knee, the higher of each
    cost."""
    if not a or not b:
        return a or b
    out: dict[str, Any] = {}
    for name in RATE_NAMES:
        x, y = _reported(a.get(name)), _reported(b.get(name))
        if x is None or y is None:
            out[name] = x if y is None else y
        elif name.endswith(("_per_s", "_knee_tokens")):
            out[name] = min(x, y)
        else:
            out[name] = max(x, y)
    return out


class ReportedCostModel(CostModel):
    """A cost model whose rates are measured in another process (the data path's
    `CostModel.rates`, handed to `adopt`): the split decision of a scheduler that moves no
    data. A recompute rate given in the config still wins; what was never reported is
    unknown (nothing is cut for it); a value that is not a finite number >= 0 is ignored."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._rates: dict[str, float | None] = dict.fromkeys(RATE_NAMES)
        self.reports = 0

    def adopt(self, rates: dict[str, Any] | None) -> None:
        if not isinstance(rates, dict):
            return
        with self._lock:
            for name in RATE_NAMES:
                if name in rates:
                    self._rates[name] = _reported(rates[name])
            self.reports += 1

    def _get(self, name: str) -> float | None:
        with self._lock:
            return self._rates[name]

    @property
    def recompute_tokens_per_s(self) -> float | None:
        if self._given_rate is not None:
            return self._given_rate
        return self._get("recompute_tokens_per_s") or None

    @property
    def h2d_bytes_per_s(self) -> float | None:
        return self._get("l2_load_bytes_per_s") or None

    @property
    def l3_bytes_per_s(self) -> float | None:
        """As reported: 0 is a stalled store (its pages are not waited for)."""
        return self._get("l3_read_bytes_per_s")

    @property
    def recompute_attn_s(self) -> float:
        if self._given_rate is not None:
            return 0.0
        return self._get("recompute_attn_s_per_pair") or 0.0

    @property
    def recompute_fixed_s(self) -> float | None:
        return None if self._given_rate is not None else self._get("recompute_fixed_s")

    @property
    def recompute_knee_tokens(self) -> float:
        if self._given_rate is not None:
            return 0.0
        return self._get("recompute_knee_tokens") or 0.0


class TimedStore:
    """An `L3Store` seen through the cost model: every ``batch_get`` is timed (its bytes
    read per second go into the L3 rate; a call still running counts while it runs). All
    other attributes are the store's."""

    def __init__(self, store: Any, cost: CostModel, page_bytes: int, *,
                 groups: tuple[tuple[int, int], ...] = (), num_layers: int = 1):
        self._store = store
        self._cost = cost
        self._page_bytes = page_bytes
        self._groups = groups
        self._num_layers = max(1, num_layers)

    def batch_get(self, keys, host_pages, *args: Any, **kwargs: Any):
        return self._timed(self._page_bytes, True, "batch_get", keys, host_pages, *args,
                           **kwargs)

    def batch_get_layers(self, keys, host_pages, group: int, through: int | None = None):
        """A streamed read of layer groups ``group`` through ``through``, timed like
        ``batch_get`` for its bytes (into the L3 rate only while none is measured:
        `CostModel.l3_call_ended`)."""
        last = group if through is None else through
        n = len(self._groups)
        ok = all(isinstance(g, int) and not isinstance(g, bool) for g in (group, last)) \
            and 0 <= group <= last < n
        nbytes = group_bytes(self._page_bytes, self._num_layers,
                             (self._groups[group][0], self._groups[last][1]), 1) if ok else 0
        if through is None:
            return self._timed(nbytes, False, "batch_get_layers", keys, host_pages, group)
        return self._timed(nbytes, False, "batch_get_layers", keys, host_pages, group,
                           through)

    def _timed(self, page_bytes: int, whole: bool, op: str, keys, *args: Any, **kwargs: Any):
        """The store's ``op`` of ``keys``, its bytes read (``page_bytes`` per page that came
        back) over its seconds into the L3 rate."""
        call = self._cost.l3_call_started(len(keys) * page_bytes)
        done = 0
        try:
            out = getattr(self._store, op)(keys, *args, **kwargs)
            if isinstance(out, list):
                done = sum(1 for v in out if v is True)
            return out
        finally:
            self._cost.l3_call_ended(call, done * page_bytes, whole=whole)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
