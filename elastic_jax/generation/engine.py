"""A continuous-batching engine over the paged per-head cache (paged.py).

Requests arrive at any time (`Engine.submit`) and wait in a queue; each `Engine.step`
  1. admits waiting requests, first come first served, while a batch row is free and the pool
     has the pages the request may ever need (reserved at once, so that decoding never runs
     out of pages halfway; see below): each admitted request is prefilled alone
     (`prefill.whole`, or `prefill.by_layer` past `prefill_chunk`), which decides its routing
     as `generate` does, its per-head keys and values are copied into its pages
     (`paged.copy_in`), and its first token is chosen from the prefill's logits;
     with `prefill_layers` set, prefills are interleaved with decoding instead: an admitted
     request's prefill runs layer by layer (`prefill.layer_steps`), at most `prefill_layers`
     layers of prefill work per step (oldest first), so that the requests already decoding
     wait for a few layers of a newcomer's prompt at each step, not for all of it; the
     request decodes from the step its last layer ran;
  2. advances every decoding request by one token in one jitted decode step over the fixed
     batch of `max_batch` rows (`model.decode_step` over a `paged.PagedCache`; empty rows sit
     at position -1 and write nothing), each row with its own position, stop tokens, limit and
     sampling settings;
  3. ends the requests that stopped (EOS or stop token, their limit, or a cancel) and returns
     their pages to the pool at once.
It returns the step's events: (request, new tokens, finished?).

Reservation: at admission the request reserves the pages of its prompt plus max_new_tokens
positions, every full head taking a page per `page_size` positions and every streaming head
its fixed sink-and-ring slot. Under elastic attention the modes are known only after the
prefill, so it reserves as if every head needed the larger of the two and shrinks the
reservation to the exact need once its routing is decided. Pages are taken from the
reservation as the slots fill; what was not taken returns when the request ends. A request
whose reservation exceeds the whole pool is refused when submitted.

Why layers and not token chunks are the unit of interleaving: a layer's router reads the
keys of the prompt's last tokens (prefill.py's docstring), so a prompt cannot be cut along
its tokens before routing; a layer over the whole prompt is the smallest piece of prefill
that decides its heads exactly as the one-shot prefill does.

Not here: preemption, stop strings (stop on token ids).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.config import ModelConfig
from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation import paged, prefill
from elastic_jax.generation.generate import SamplingConfig
from elastic_jax.heads import FORWARD, check_attention
from elastic_jax.model import Params, decode_step, split_layers
from elastic_jax.router import RouterConfig


@dataclasses.dataclass(eq=False)
class Request:
  """A submitted request: the handle `submit` returns. tokens: the new tokens so far (the stop
  or EOS token included); finish: None while it runs, then "eos", "stop" (a stop token),
  "length" or "cancelled"; full: the modes its prefill decided [L, K] (True: full)."""
  id: int
  prompt: list[int]
  max_new_tokens: int
  stop: frozenset
  sampling: SamplingConfig
  tokens: list[int] = dataclasses.field(default_factory=list)
  finish: str | None = None
  full: np.ndarray | None = None
  row: int | None = None

  @property
  def positions(self) -> int:
    """Positions its cache ever holds: the prompt and every new token but the last."""
    return len(self.prompt) + self.max_new_tokens - 1


@dataclasses.dataclass(frozen=True)
class Event:
  request: Request
  tokens: tuple[int, ...]          # new this step
  finished: bool


def _choose_rows(logits_bv, temperature_b, top_p_b, seed_b, count_b):
  """Each row's next token: the argmax where its temperature is 0, else sampled (top-p) with
  the key of (its seed, its token count), so that a request draws the same tokens in any
  batch."""
  greedy = jnp.argmax(logits_bv, -1).astype(jnp.int32)

  def sample(_):
    t = jnp.where(temperature_b > 0, temperature_b, 1.0)[:, None]
    logits = (logits_bv - jnp.max(logits_bv, -1, keepdims=True)) / t
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, -1)
    probs = jax.nn.softmax(sorted_logits, -1)
    keep = jnp.cumsum(probs, -1) - probs < top_p_b[:, None]
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed_b, count_b)
    pick = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, sorted_logits)
    drawn = jnp.take_along_axis(order, pick[:, None], -1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature_b > 0, drawn, greedy)

  return jax.lax.cond(jnp.any(temperature_b > 0), sample, lambda _: greedy, None)


_choose = jax.jit(_choose_rows)


@functools.partial(jax.jit, static_argnames=("cfg", "rcfg", "impl"), donate_argnames=("cache",))
def _step(params, cache, tok_b, pos_b, temperature_b, top_p_b, seed_b, count_b, *, cfg, rcfg,
          impl="reference"):
  """One decode step of the whole batch: (next tokens [B], the cache)."""
  logits, cache = decode_step(params, tok_b, pos_b, cache, cfg=cfg, rcfg=rcfg, impl=impl)
  return _choose_rows(logits, temperature_b, top_p_b, seed_b, count_b), cache


def _pool_pages(num_pages, memory_fraction, page_bytes: int) -> int:
  if (num_pages is None) == (memory_fraction is None):
    raise ElasticJaxError("give exactly one of num_pages and memory_fraction")
  if num_pages is not None:
    if not isinstance(num_pages, (int, np.integer)) or num_pages < 1:
      raise ElasticJaxError(f"num_pages must be an integer >= 1, got {num_pages!r}")
    return int(num_pages)
  if not 0 < memory_fraction <= 1:
    raise ElasticJaxError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
  stats = jax.devices()[0].memory_stats() or {}
  if not stats.get("bytes_limit"):
    raise ElasticJaxError("memory_fraction needs a device that reports its memory; give "
                          "num_pages instead")
  free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  return max(1, int(memory_fraction * free) // page_bytes)


class Engine:
  """Continuous batching over a paged per-head cache (module docstring).

  params, cfg, attention, rcfg, router_params, gates ([L, K], the same for every request),
  attn_impl, prefill_chunk: as `generate`'s. prefill_layers: None, each prefill runs whole
  at its admission; n >= 1, prefills interleaved with decoding, n layers per step (module
  docstring). num_pages or memory_fraction: the pool, in pages
  or as a fraction of the device's free memory. page_size: tokens per page. max_batch: rows of
  the decode step (requests decoding at once). max_seq_len: the longest prompt plus
  max_new_tokens a request may have (default: the model's). eos_ids: tokens that end every
  request. layer_loop: "scan" or "split" (`generate`'s). decode_impl: the attention over
  pages (`paged.paged_kernel`): "reference" (plain jnp; reads every slot's whole page table),
  "pallas_gpu" (the Triton kernel, which reads only each slot's own pages; ":interpret" on a
  CPU) or "auto" (the kernel on a GPU)."""

  def __init__(self, params: Params, cfg: ModelConfig, *, attention: str = "elastic",
               rcfg: RouterConfig | None = None, router_params: Params | None = None,
               gates=None, num_pages: int | None = None, memory_fraction: float | None = None,
               page_size: int = 16, max_batch: int = 8, max_seq_len: int | None = None,
               eos_ids: Sequence[int] = (), attn_impl: str = "auto",
               prefill_chunk: int | None = 8192, layer_loop: str = "scan",
               decode_impl: str = "reference", prefill_layers: int | None = None):
    check_attention(attention, FORWARD)
    if attention == "elastic" and router_params is None:
      raise ElasticJaxError("attention='elastic' needs trained routers (router_params)")
    for name, value in (("page_size", page_size), ("max_batch", max_batch),
                        ("prefill_layers", 1 if prefill_layers is None else prefill_layers)):
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ElasticJaxError(f"{name} must be an integer >= 1, got {value!r}")
    self.prefill_layers = prefill_layers
    if layer_loop not in ("scan", "split"):
      raise ElasticJaxError(f"layer_loop must be scan or split, got {layer_loop!r}")
    paged.paged_kernel(decode_impl, cfg.head_dim, page_size)   # refused here, not at a step
    self.decode_impl = decode_impl
    self.cfg, self.rcfg = cfg, rcfg or RouterConfig()
    self.params, self.attention, self.router_params = params, attention, router_params
    self.attn_impl, self.prefill_chunk, self.page_size = attn_impl, prefill_chunk, page_size
    self.max_seq_len = self._max_seq_len(cfg, max_seq_len)
    self.eos = frozenset(int(x) for x in eos_ids)
    self.known_full = self._known_modes(gates)
    dtype = jax.tree.leaves(params)[0].dtype
    self.num_pages = _pool_pages(num_pages, memory_fraction,
                                 2 * page_size * cfg.head_dim * jnp.dtype(dtype).itemsize)
    self.stream_pages = paged.stream_pages(self.rcfg.streaming, page_size)
    slot_pages = max(paged.full_pages(self.max_seq_len, page_size), self.stream_pages)
    shape = (max_batch, cfg.num_layers, cfg.num_kv_heads)
    self.alloc = paged.PageAllocator(self.num_pages)
    self.tables = paged.PageTables(*shape, slot_pages, self.num_pages, page_size,
                                   self.rcfg.streaming)
    self.cache = paged.empty_cache(self.num_pages, page_size, cfg.head_dim, dtype, *shape,
                                   slot_pages)
    self.step_params = split_layers(params) if layer_loop == "split" else params
    self.rows: list[Request | None] = [None] * max_batch
    self.queue: list[Request] = []
    self.prefilling: list[tuple[Request, object]] = []   # (request, its layer_steps), oldest first
    self._ids = itertools.count()

  @staticmethod
  def _max_seq_len(cfg: ModelConfig, max_seq_len) -> int:
    """The longest request: up to the model's limit, but within max_position_embeddings
    under dynamic RoPE, whose table follows the longest position of the whole batch (one
    request's tokens would then depend on the others')."""
    dynamic = cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "dynamic"
    limit = cfg.max_position_embeddings if dynamic else cfg.max_length
    if max_seq_len is None:
      return limit
    if not isinstance(max_seq_len, (int, np.integer)) or not 1 <= max_seq_len <= limit:
      raise ElasticJaxError(f"max_seq_len must be an integer in [1, {limit}]"
                            + (" (max_position_embeddings: the engine does not run past it "
                               "under dynamic RoPE)" if dynamic else "")
                            + f", got {max_seq_len!r}")
    return int(max_seq_len)

  @classmethod
  def from_model(cls, model, attention: str | None = None, **kwargs) -> "Engine":
    """An engine for an `ElasticModel` (its params, config, routers and router config):
    attention "elastic" where it has routers, else "full", unless given."""
    if attention is None:
      attention = "elastic" if model.router_params is not None else "full"
    kwargs.setdefault("attn_impl", "auto" if model.attn_impl == "reference" else
                      model.attn_impl)
    return cls(model.params, model.config, attention=attention, rcfg=model.router_config,
               router_params=model.router_params, **kwargs)

  def _known_modes(self, gates) -> np.ndarray | None:
    """The modes [L, K] every request's cache keeps, where known before a prefill (all but
    elastic attention)."""
    shape = (self.cfg.num_layers, self.cfg.num_kv_heads)
    if self.attention == "forced":
      try:
        g = np.asarray(gates, np.float32)
      except (TypeError, ValueError):
        g = None
      if g is None or g.shape != shape:
        raise ElasticJaxError(f"gates must be an array of numbers [L, K] = {list(shape)}, "
                              f"got {type(gates).__name__} {list(np.shape(gates))}")
      self.gates = g
    if self.rcfg.patterns == "fa-xa" or self.attention == "full":
      return np.ones(shape, bool)            # XAttention heads decode as full heads
    if self.attention == "forced":
      return self.gates > 0.5
    return np.zeros(shape, bool) if self.attention == "sparse" else None

  def pages_for(self, request: Request) -> int:
    """The pages reserved when `request` is admitted (module docstring)."""
    if self.known_full is not None:
      return self.tables.need(self.known_full, request.positions)
    per_head = max(paged.full_pages(request.positions, self.page_size), self.stream_pages)
    return self.cfg.num_layers * self.cfg.num_kv_heads * per_head

  def submit(self, prompt_ids: Sequence[int], sampling: SamplingConfig = SamplingConfig(), *,
             stop: Sequence[int] = (), max_new_tokens: int | None = None) -> Request:
    """Queue a request (token ids); it is admitted at a later `step`. stop: token ids that
    end it (besides the engine's EOS ids); max_new_tokens: its limit (default the
    sampling's). Refused at once where it can never fit the pool or the model."""
    arr = np.asarray(prompt_ids)
    if isinstance(prompt_ids, (str, bytes)) or arr.ndim != 1 or arr.size == 0 or not (
        np.issubdtype(arr.dtype, np.integer)):
      raise ElasticJaxError("a prompt must be a non-empty list of integer token ids")
    if ((arr < 0) | (arr >= self.cfg.vocab_size)).any():
      raise ElasticJaxError(f"a prompt holds a token id outside the vocabulary [0, "
                            f"{self.cfg.vocab_size})")
    if not isinstance(sampling, SamplingConfig):
      raise ElasticJaxError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if sampling.stop:
      raise ElasticJaxError("the engine stops on token ids (stop=[...]), not on stop strings")
    limit = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
    limit = dataclasses.replace(sampling, max_new_tokens=limit).max_new_tokens  # checked
    stops = np.asarray(list(stop))
    if stops.size and not np.issubdtype(stops.dtype, np.integer):
      raise ElasticJaxError(f"stop must be a list of integer token ids, got {list(stop)!r}")
    request = Request(next(self._ids), arr.astype(int).tolist(), limit,
                      frozenset(int(x) for x in stops), sampling)
    if len(request.prompt) + limit > self.max_seq_len:
      raise ElasticJaxError(f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({limit}) "
                            f"exceeds the engine's max_seq_len ({self.max_seq_len})")
    need = self.pages_for(request)
    if need > self.num_pages:
      raise ElasticJaxError(
          f"the request needs {need} pages of {self.page_size} tokens"
          + (" (its routing is decided only at prefill, so every head counts as full)"
             if self.known_full is None else "")
          + f" and can never fit the pool of {self.num_pages} pages")
    self.queue.append(request)
    return request

  def cancel(self, request: Request) -> None:
    """End a request now (queued or decoding): its pages return to the pool; it gets no more
    events. Ended requests are left as they are."""
    if request.finish is not None:
      return
    if request in self.queue:
      self.queue.remove(request)
    for entry in self.prefilling:
      if entry[0] is request:
        self.prefilling.remove(entry)
        entry[1].close()                 # its layers' keys and values are dropped
        break
    request.finish = "cancelled"
    self._release(request)

  def _release(self, request: Request) -> None:
    if request.row is not None:
      self.tables.clear(request.row)
      self.rows[request.row] = None
      request.row = None
    self.alloc.release(request.id)

  @property
  def idle(self) -> bool:
    return not self.queue and not any(self.rows)

  def _prefill(self, request: Request, interleaved: bool):
    """The prefill of `request` alone: its `Prefilled`, or (interleaved) its
    `prefill.layer_steps` generator."""
    rows = prefill.arrange([request.prompt], pack=False)
    capacity = prefill.round_up(int(rows.ids.shape[1]), self.page_size)
    forced = None
    if self.attention == "forced":
      forced = jnp.asarray(self.gates[:, None])
    args = (self.params, self.cfg, rows, self.router_params, forced)
    how = dict(attention=self.attention, rcfg=self.rcfg, attn_impl=self.attn_impl,
               capacity=capacity)
    if interleaved:
      return prefill.layer_steps(*args, chunk=self.prefill_chunk or 0, **how)
    if self.prefill_chunk is not None and rows.ids.shape[1] > self.prefill_chunk:
      return prefill.by_layer(*args, chunk=self.prefill_chunk, **how)
    return prefill.whole(*args, **how)

  def _admit(self, request: Request, row: int) -> Event | None:
    """Start `request` in batch row `row` (its reservation already made): prefilled now and
    its first token's event returned, or (prefill_layers) its prefill queued for
    `_advance_prefills`."""
    request.row, self.rows[row] = row, request
    if self.prefill_layers is not None:
      self.prefilling.append((request, self._prefill(request, interleaved=True)))
      return None
    return self._start_decoding(request, self._prefill(request, interleaved=False))

  def _advance_prefills(self) -> list[Event]:
    """At most `prefill_layers` layers of the prefills under way, oldest first; the first
    token's event of each that completes."""
    events, budget = [], self.prefill_layers or 0
    while budget and self.prefilling:
      request, steps = self.prefilling[0]
      budget -= 1
      try:
        next(steps)
      except StopIteration as done:
        self.prefilling.pop(0)
        events.append(self._start_decoding(request, done.value))
    return events

  def _start_decoding(self, request: Request, pre: prefill.Prefilled) -> Event:
    """`request`'s prefill done: its routing known, its pages filled, its first token
    chosen."""
    row = request.row
    request.full = paged.cache_modes(pre.cache, self.cfg.num_layers, self.cfg.num_kv_heads)
    self.alloc.shrink(request.id, self.tables.need(request.full, request.positions))
    self.tables.assign(row, request.full, len(request.prompt), self.alloc, request.id)
    for first, c in paged.head_cache_layers(pre.cache):
      full_dest, st_dest = paged.copy_plan(c, first, self.tables.table[row], self.num_pages,
                                           self.page_size, self.stream_pages)
      self.cache = paged.copy_in(self.cache, c.full_k, c.full_v, c.st_k, c.st_v, full_dest,
                                 st_dest)
    s = request.sampling
    tok = _choose(pre.logits, jnp.asarray([s.temperature], jnp.float32),
                  jnp.asarray([s.top_p], jnp.float32), jnp.asarray([self._seed(s)], jnp.int32),
                  jnp.zeros((1,), jnp.int32))
    return self._take(request, int(tok[0]))

  @staticmethod
  def _seed(sampling: SamplingConfig) -> int:
    return sampling.seed % (1 << 31)

  def _take(self, request: Request, tok: int) -> Event:
    """A new token for `request`: its event, and its end where it stopped."""
    request.tokens.append(tok)
    if tok in self.eos:
      request.finish = "eos"
    elif tok in request.stop:
      request.finish = "stop"
    elif len(request.tokens) >= request.max_new_tokens:
      request.finish = "length"
    if request.finish is not None:
      self._release(request)
    return Event(request, (tok,), request.finish is not None)

  def _admit_waiting(self) -> list[Event]:
    events = []
    while self.queue and None in self.rows:
      request = self.queue[0]
      need = self.pages_for(request)
      if need > self.alloc.available:
        break                       # first come, first served: the head waits for pages
      self.queue.pop(0)
      self.alloc.reserve(request.id, need)
      event = self._admit(request, self.rows.index(None))
      if event is not None:
        events.append(event)
    return events

  def step(self) -> list[Event]:
    """Admit what fits, then one decode step of every active request (module docstring);
    the events of this step, in row order after the admissions'."""
    events = self._admit_waiting() + self._advance_prefills()
    # A request decodes once its prefill has decided its modes (`_start_decoding`).
    live = [(row, r) for row, r in enumerate(self.rows) if r is not None and r.full is not None]
    if not live:
      return events
    b = len(self.rows)
    tok, pos, count, seed = (np.zeros(b, np.int32) for _ in range(4))
    temperature, top_p = np.zeros(b, np.float32), np.ones(b, np.float32)
    pos[:] = -1
    for row, r in live:
      pos[row] = len(r.prompt) + len(r.tokens) - 1
      tok[row], count[row], seed[row] = r.tokens[-1], len(r.tokens), self._seed(r.sampling)
      temperature[row], top_p[row] = r.sampling.temperature, r.sampling.top_p
      self.tables.grow(row, int(pos[row]), self.alloc, r.id)
    dirty = self.tables.take_dirty()
    if dirty is not None:
      self.cache = paged.set_rows(self.cache, *(jnp.asarray(x) for x in dirty))
    new, self.cache = _step(self.step_params, self.cache, *(jnp.asarray(x) for x in (
        tok, pos, temperature, top_p, seed, count)), cfg=self.cfg, rcfg=self.rcfg,
        impl=self.decode_impl)
    new = np.asarray(new)
    return events + [self._take(r, int(new[row])) for row, r in live]

  def events(self) -> Iterator[Event]:
    """Steps until every request ended, yielding each step's events (requests submitted or
    cancelled between events take effect at the next step)."""
    while not self.idle:
      yield from self.step()

  def run(self) -> None:
    """Steps until every request ended."""
    for _ in self.events():
      pass
