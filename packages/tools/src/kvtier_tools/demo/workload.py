"""Workloads the demo replays: multi-turn conversations whose histories grow every round.

A `Workload` is an ordered list of `Request` s (prompt token ids) grouped into rounds, so
results can be shown per round. `multiturn` follows SGLang's ``bench_multiturn``: each client
holds a conversation; every round it sends its whole history plus a new user turn, and the
answer is appended to the history before its next round. Token ids are random but fixed by the
seed, so every configuration replays exactly the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from kvtier.errors import InputError


class WorkloadError(InputError):
    """A workload parameter is invalid (``field`` names it). Trace files have their own
    errors (`kvtier_tools.trace.TraceError`); both are `InputError`."""


@dataclass(frozen=True)
class Request:
    """One prompt to prefill. ``client`` is the conversation (-1 when unknown), ``round`` the
    group it is plotted in; ``arrival_ms`` is the trace timestamp (0 for generated ones)."""

    index: int
    client: int
    round: int
    tokens: np.ndarray
    output_len: int = 0
    arrival_ms: float = 0.0

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Workload:
    """Requests in replay order, each tagged with a round in ``[0, num_rounds)``."""

    name: str
    requests: tuple[Request, ...]
    num_rounds: int
    description: str = ""

    @property
    def total_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def max_tokens(self) -> int:
        return max((r.num_tokens for r in self.requests), default=0)

    def __len__(self) -> int:
        return len(self.requests)


def _positive(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise WorkloadError(f"{name} must be an int >= {minimum}, got {value!r}", field=name)
    return int(value)


def _length(rng: np.random.Generator, mean: int, jitter: float) -> int:
    """A length drawn uniformly from ``mean * [1 - jitter, 1 + jitter]`` (at least 1)."""
    if jitter == 0 or mean == 0:
        return mean
    lo = max(1, int(round(mean * (1.0 - jitter))))
    hi = max(lo, int(round(mean * (1.0 + jitter))))
    return int(rng.integers(lo, hi + 1))


def multiturn(clients: int, rounds: int, *, first_tokens: int = 1024, turn_tokens: int = 160,
              answer_tokens: int = 96, system_tokens: int = 0, jitter: float = 0.25,
              vocab_size: int = 4096, seed: int = 0, shuffle: bool = True) -> Workload:
    """``clients`` conversations of ``rounds`` rounds each, replayed round by round.

    Round 0 of a client is ``system_tokens`` (shared by every client) plus its own first user
    turn of about ``first_tokens``; each later round appends the previous answer (about
    ``answer_tokens``) and a new user turn (about ``turn_tokens``) to the history. Lengths vary
    by ``+-jitter``; within a round clients arrive in a random order (``shuffle``), as they do
    under load, so an LRU tier sees a realistic mix rather than a fixed cycle.
    """
    clients = _positive("clients", clients)
    rounds = _positive("rounds", rounds)
    first_tokens = _positive("first_tokens", first_tokens)
    turn_tokens = _positive("turn_tokens", turn_tokens)
    answer_tokens = _positive("answer_tokens", answer_tokens, 0)
    system_tokens = _positive("system_tokens", system_tokens, 0)
    vocab_size = _positive("vocab_size", vocab_size, 2)
    if not isinstance(jitter, (int, float)) or not 0.0 <= jitter < 1.0:
        raise WorkloadError(f"jitter must be a number in [0, 1), got {jitter!r}", field="jitter")
    rng = np.random.default_rng([int(seed), 0x6D74])     # "mt": independent of other streams
    system = rng.integers(0, vocab_size, system_tokens, dtype=np.int64)
    histories = [np.concatenate([system, rng.integers(0, vocab_size,
                                                      _length(rng, first_tokens, jitter),
                                                      dtype=np.int64)])
                 for _ in range(clients)]
    requests: list[Request] = []
    for r in range(rounds):
        order = rng.permutation(clients) if shuffle else np.arange(clients)
        for c in order.tolist():
            if r > 0:
                turn = rng.integers(0, vocab_size, _length(rng, turn_tokens, jitter),
                                    dtype=np.int64)
                histories[c] = np.concatenate([histories[c], turn])
            prompt = histories[c]
            prompt.setflags(write=False)
            answer_len = _length(rng, answer_tokens, jitter)
            requests.append(Request(len(requests), c, r, prompt, answer_len))
            # the answer the model "gave" becomes part of the history of the next round
            histories[c] = np.concatenate([prompt, rng.integers(0, vocab_size, answer_len,
                                                                dtype=np.int64)])
    desc = (f"multi-turn: {clients} clients x {rounds} rounds, first turn ~{first_tokens}, "
            f"+~{answer_tokens} answer +~{turn_tokens} user tokens per round"
            + (f", {system_tokens}-token shared system prompt" if system_tokens else ""))
    return Workload("multiturn", tuple(requests), rounds, desc)


def round_of(index: int, count: int, rounds: int) -> int:
    """Round of the ``index``-th of ``count`` requests split into ``rounds`` equal groups."""
    return min(rounds - 1, index * rounds // max(count, 1))


def long_context(documents: int, rounds: int, *, min_tokens: int = 8192,
                 max_tokens: int = 32768, question_tokens: int = 160, jitter: float = 0.25,
                 vocab_size: int = 4096, seed: int = 0, shuffle: bool = True) -> Workload:
    """Long-context questions: ``documents`` long documents (lengths uniform in
    ``[min_tokens, max_tokens]``), each asked ``rounds`` times, once a round, a new question
    of about ``question_tokens`` after the whole document (what a RAG or code assistant sends).
    Every ask reuses its document's KV; between two asks of a document the others are asked,
    so a small L1 has lost it by then."""
    documents = _positive("documents", documents)
    rounds = _positive("rounds", rounds)
    min_tokens = _positive("min_tokens", min_tokens)
    max_tokens = _positive("max_tokens", max_tokens)
    question_tokens = _positive("question_tokens", question_tokens)
    vocab_size = _positive("vocab_size", vocab_size, 2)
    if max_tokens < min_tokens:
        raise WorkloadError(f"max_tokens {max_tokens} < min_tokens {min_tokens}",
                            field="max_tokens")
    if not isinstance(jitter, (int, float)) or not 0.0 <= jitter < 1.0:
        raise WorkloadError(f"jitter must be a number in [0, 1), got {jitter!r}", field="jitter")
    rng = np.random.default_rng([int(seed), 0x6C67])     # "lg": independent of other streams
    docs = [rng.integers(0, vocab_size, int(rng.integers(min_tokens, max_tokens + 1)),
                         dtype=np.int64) for _ in range(documents)]
    requests: list[Request] = []
    for r in range(rounds):
        order = rng.permutation(documents) if shuffle else np.arange(documents)
        for d in order.tolist():
            q = rng.integers(0, vocab_size, _length(rng, question_tokens, jitter),
                             dtype=np.int64)
            prompt = np.concatenate([docs[d], q])
            prompt.setflags(write=False)
            requests.append(Request(len(requests), d, r, prompt, 0))
    desc = (f"long context: {documents} documents of {min_tokens}-{max_tokens} tokens, each "
            f"asked {rounds} times (a ~{question_tokens}-token question after it)")
    return Workload("long", tuple(requests), rounds, desc)
