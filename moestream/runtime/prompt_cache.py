"""The prompt cache: a new sequence starts from the longest prefix it shares with an earlier one, so a chat client
or an agent that resends the whole conversation each turn pays only for what is new.

The prefix comes from the sequence cache that still holds it (a free one is taken as it is, a running one's rows
are copied), or from a host-RAM copy of a cache that has since been reused: an LRU tier within a byte budget
(llama-server's --cache-ram). Only whole micro-batches are reused, rows that the prompt's prefill computed from
position 0 in --ubatch steps, so the rest of a prompt runs in the micro-batches a cold prefill would and gives
the same bits. Rows of generated tokens came from decode steps, whose bits differ from a prefill's: never reused.
A recurrent state (qwen35moe's delta-net) cannot be rewound, so a copy is kept in host RAM at the last micro-batch
boundary before the prompt's end (where the same prompt sent again starts) and at its end when that is one (where
a longer one starts); such a model's prefix is reusable only where a state was kept.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moestream.errors import MoestreamError
from moestream.options import PROMPT_CACHE_RAM_MIB
from moestream.runtime.kv_cache import KVRows, SequenceCache

HOST = torch.device("cpu")


@dataclass
class Prefix:
    """What a sequence cache, or a host copy of one, holds that a later prompt can start from."""

    tokens: list[int]  # prompt tokens of whole micro-batches run as prefill from position 0
    states: dict[int, dict] = field(default_factory=dict)  # position -> recurrent states there, on the host
    recurrent: bool = False  # whether the model carries a state (then only positions in states are reusable)

    def reusable(self, prompt: list[int], ubatch: int) -> int:
        """Tokens of prompt this prefix stands for: the shared part in whole micro-batches, at least one token
        left to run (its logits give the first new token), and for a recurrent model only where a state was
        kept."""
        limit, n = min(len(self.tokens), len(prompt) - 1), 0
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        n -= n % ubatch
        if self.recurrent:
            return max((p for p in self.states if p <= n), default=0)
        return n

    def covers(self, other: Prefix) -> bool:
        """Whether every prompt other could serve, self serves as well."""
        n = len(other.tokens)
        return self.tokens[:n] == other.tokens and set(other.states) <= set(self.states)

    @property
    def end(self) -> int:
        """How many rows a copy needs: up to the last reusable position."""
        return max(self.states, default=0) if self.recurrent else len(self.tokens)


@dataclass
class Saved:
    """A prefix copied to host RAM with its KV rows."""

    prefix: Prefix
    rows: KVRows

    @property
    def nbytes(self) -> int:
        states = sum(s.nbytes for at in self.prefix.states.values() for s in at.values())
        return self.rows.nbytes + states


@dataclass
class PromptCacheStats:
    hits: int = 0  # requests that started from a cached prefix
    tokens: int = 0  # prompt tokens they did not run
    host_hits: int = 0  # of the hits, those copied back from host RAM
    host_saves: int = 0  # prefixes copied to host RAM
    host_evictions: int = 0  # and dropped from it for room


class PromptCache:
    """Which sequence cache (and host copy) holds which prefix, and a cache for each new prompt."""

    def __init__(self, ubatch: int, ram_bytes: int | None = PROMPT_CACHE_RAM_MIB << 20):
        """ram_bytes: the host tier's budget (0: no host tier; None: no limit, as llama-server's -1)."""
        if ubatch < 1 or (ram_bytes is not None and ram_bytes < 0):
            raise MoestreamError("the prompt cache needs --ubatch >= 1 and --cache-ram >= 0 MiB (or -1: no limit)")
        self.ubatch, self.ram_bytes = ubatch, ram_bytes
        self.held: weakref.WeakKeyDictionary[SequenceCache, Prefix] = weakref.WeakKeyDictionary()
        self.prompts: weakref.WeakKeyDictionary[SequenceCache, list[int]] = weakref.WeakKeyDictionary()
        self.used: weakref.WeakKeyDictionary[SequenceCache, int] = weakref.WeakKeyDictionary()
        self.host: OrderedDict[int, Saved] = OrderedDict()  # least recently used first
        self.stats = PromptCacheStats()
        self.host_bytes = 0  # kept as a sum: /metrics reads it from another thread
        self._ids = itertools.count()

    def take(
        self,
        prompt: list[int],
        free: list[SequenceCache],
        running: list[SequenceCache],
        grow: Callable[[], SequenceCache] | None,
        reuse: bool = True,
    ) -> tuple[SequenceCache, int]:
        """A cache for prompt (taken out of free, or grown when grow is given) with its first n tokens already
        in it (n_past = n), and n. The cache holding the longest reusable prefix is taken as it is; otherwise a
        fresh or the least recently used free cache gets the prefix copied in from a running cache or from host
        RAM. What a free cache held that is about to be overwritten goes to host RAM first."""
        if not free and grow is None:
            raise MoestreamError("no sequence cache is free")
        here = max(((self._reusable(c, prompt) if reuse else 0, c) for c in free), key=_first, default=(0, None))
        sources: list[tuple[int, SequenceCache | Saved]] = []
        if reuse:
            sources = [(self._reusable(c, prompt), c) for c in running]
            sources += [(s.prefix.reusable(prompt, self.ubatch), s) for s in self.host.values()]
        there = max(sources, key=_first, default=(0, None))
        if here[0] > 0 and here[0] >= there[0]:
            n, cache, source = here[0], here[1], here[1]
            free.remove(cache)
        else:
            n, source = there if there[0] else (0, None)
            cache = self._spare(free, grow)
        states = self._states(source, n)
        if isinstance(source, Saved):  # most recently used before making room for what the cache held
            self.host.move_to_end(next(k for k, s in self.host.items() if s is source))
        self._save(cache, n)
        cache.reset()
        if n:
            self._fill(cache, n, source, states)
        self.held[cache] = Prefix(list(prompt[:n]), {n: states} if states else {}, bool(cache.recurrent))
        self.prompts[cache] = list(prompt)
        self.used[cache] = next(self._ids)
        return cache, n

    def release(self, cache: SequenceCache) -> None:
        """A free cache is let go: what it holds goes to host RAM first."""
        self._save(cache, 0)
        self.prompts.pop(cache, None)
        self.used.pop(cache, None)

    def prefilled(self, cache: SequenceCache) -> None:
        """After a chunk of the prompt ran in cache (whole micro-batches from a boundary, the last maybe partial):
        its whole micro-batches extend the prefix it holds. A recurrent model's state is kept at the last boundary
        before the prompt's end (where the same prompt sent again starts) and at its end when that is one (where a
        longer one starts): a chunk ends there (chunk)."""
        prompt, held, n = self.prompts.get(cache), self.held.get(cache), cache.n_past
        if prompt is None or held is None or n > len(prompt):
            return
        whole = n - n % self.ubatch
        if whole > len(held.tokens):
            held.tokens = prompt[:whole]
        if n % self.ubatch:
            return
        before = (len(prompt) - 1) // self.ubatch * self.ubatch
        if held.recurrent and n in (before, len(prompt)):
            kept = {p: s for p, s in held.states.items() if p == before}
            held.states = kept | {n: {il: s.copy(HOST) for il, s in cache.recurrent.items()}}

    def chunk(self, cache: SequenceCache, n: int) -> int:
        """How many of the next n prompt tokens one call may run in cache for what prefilled keeps: a recurrent
        state is copied only between calls, and the one a resent prompt starts from lies at the last boundary
        before its end, so a chunk stops there."""
        prompt, held, at = self.prompts.get(cache), self.held.get(cache), cache.n_past
        if prompt is None or held is None or not held.recurrent:
            return n
        stop = (len(prompt) - 1) // self.ubatch * self.ubatch
        return stop - at if at < stop < at + n else n

    def clear(self) -> None:
        self.held.clear()
        self.prompts.clear()
        self.host.clear()
        self.host_bytes = 0

    def _reusable(self, cache: SequenceCache, prompt: list[int]) -> int:
        held = self.held.get(cache)
        return 0 if held is None or cache.broken else held.reusable(prompt, self.ubatch)

    def _spare(self, free: list[SequenceCache], grow: Callable[[], SequenceCache] | None) -> SequenceCache:
        """A cache to overwrite: a free one holding nothing reusable, else a new one while the pool may grow, else
        the least recently used free one (what it holds goes to host RAM)."""
        empty = [c for c in free if (held := self.held.get(c)) is None or held.end == 0 or c.broken]
        if empty or grow is None:
            cache = empty[0] if empty else min(free, key=lambda c: self.used.get(c, -1))
            free.remove(cache)
            return cache
        return grow()

    def _states(self, source: SequenceCache | Saved | None, n: int) -> dict:
        """The recurrent states source kept at position n ({} for an attention-only model)."""
        if source is None:
            return {}
        held = source.prefix if isinstance(source, Saved) else self.held[source]
        return held.states.get(n, {})

    def _fill(self, cache: SequenceCache, n: int, source: SequenceCache | Saved, states: dict) -> None:
        """Put source's first n rows and the states there in cache (a cache is its own source when taken as it
        is: its rows are in place)."""
        if isinstance(source, Saved):
            cache.kv.copy_prefix(source.rows.first(n))
            self.stats.host_hits += 1
        elif source is not cache:
            cache.kv.copy_prefix(source.kv.rows(n))
        for il, state in cache.recurrent.items():
            state.copy_(states[il])
        cache.n_past = n
        self.stats.hits += 1
        self.stats.tokens += n

    def _save(self, cache: SequenceCache, keep: int) -> None:
        """Copy what cache holds beyond its first keep rows to host RAM, within the budget, before it is
        overwritten (unless a host copy already covers it, or it is broken)."""
        held = self.held.pop(cache, None)
        if held is None or cache.broken or held.end <= keep or self.ram_bytes == 0:
            return
        prefix = Prefix(held.tokens[: held.end], held.states, held.recurrent)
        if any(s.prefix.covers(prefix) for s in self.host.values()):
            return
        need = Saved(prefix, cache.kv.rows(prefix.end)).nbytes  # views: nothing copied yet
        if self.ram_bytes is not None and need > self.ram_bytes:
            return
        for key in [k for k, s in self.host.items() if prefix.covers(s.prefix)]:
            self.host_bytes -= self.host.pop(key).nbytes
        while self.ram_bytes is not None and self.host and self.host_bytes + need > self.ram_bytes:
            self.host_bytes -= self.host.popitem(last=False)[1].nbytes
            self.stats.host_evictions += 1
        self.host[next(self._ids)] = Saved(prefix, cache.kv.rows(prefix.end, HOST))
        self.host_bytes += need
        self.stats.host_saves += 1


def metrics(prompts: PromptCache | None) -> dict[tuple[str, str, str], float]:
    """The server's /metrics lines of a prompt cache (zeros when it is off): (name, type, help) -> value."""
    s, host = (prompts.stats, prompts.host_bytes) if prompts is not None else (PromptCacheStats(), 0)
    return {
        ("moestream_prompt_cache_hits_total", "counter", "requests that started from a cached prefix"): s.hits,
        ("moestream_prompt_cache_tokens_total", "counter", "prompt tokens taken from the cache, not run"): s.tokens,
        ("moestream_prompt_cache_host_bytes", "gauge", "bytes of prefixes held in host RAM (--cache-ram)"): host,
    }


def _first(pair: tuple) -> int:
    return pair[0]
