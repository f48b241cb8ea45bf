"""A paged per-head key/value cache for serving many requests from one fixed pool of memory.

The modes are those of kv_cache.py (the router decides each (layer, KV head) of a request once,
at its prefill), but the memory is shared: keys and values live in one pool of pages,
  k, v [P, page, H]   P pages of `page` tokens, shared by every layer and every request.
Each (row, layer, KV head) of the decode batch [B, L, K] owns a list of pages, its page table
  table [B, L, K, S]  page ids (P: none), S = the most pages one slot can own;
  full [B, L, K]      the slot's mode (True: full attention).
A full slot keeps position p at index p of its pages (page p // page, offset p % page); its
list grows by a page whenever decoding crosses a page boundary. A streaming slot owns a fixed
`stream_pages` pages holding its sink then its ring, indexed exactly as kv_cache.py's
streaming slots (`decode_reference.stream_index`): index j at page j // page, offset j % page.

The host side (`PageAllocator`, `PageTables`) hands out pages from a free list, keeps each
request's page tables and returns its pages the moment it ends. `attend` writes the new
keys and values into their pages, then runs the attention over pages that its impl names:
`decode_reference.paged_reference` (plain jnp, the spec: it gathers every slot's whole page
table) or `attention.pallas_gpu.paged` (a Triton kernel that reads only the pages each slot
uses: a full slot's up to its position, a streaming slot's sink and ring).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.attention.decode_reference import stream_index
from elastic_jax.attention.reference import Streaming
from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation.kv_cache import HeadCache, stream_width


def stream_pages(streaming: Streaming, page_size: int) -> int:
  """Pages of one streaming slot: its sink and ring (`kv_cache.stream_width` indices)."""
  return -(-stream_width(streaming) // page_size)


def full_pages(positions: int, page_size: int) -> int:
  """Pages of a full slot that holds `positions` positions."""
  return -(-positions // page_size)


def attend(q_bnh, k_bkh, v_bkh, pos_b, cache: "PagedCache", layer, streaming: Streaming,
           scale: float, impl: str = "reference"):
  """One decode step of layer `layer` over the pages, with `kv_cache.attend`'s arguments:
  write each row's new key/value at position pos_b (into its full slots' page of pos_b, into
  its streaming slots' sink or ring), then attend (impl: `paged_kernel`'s). A row at
  position -1 is empty: it writes nothing and gets zeros. Returns (out [B, N, H], the updated
  cache)."""
  b, n, h = q_bnh.shape
  kh = k_bkh.shape[1]
  num_pages, page, _ = cache.k.shape
  sink_len = streaming.block * streaming.sink_blocks
  ring = streaming.block * streaming.local_blocks
  table, full = cache.table[:, layer], cache.full[:, layer]          # [B, K, S], [B, K]
  pos = pos_b.astype(jnp.int32)[:, None]                             # [B, 1]
  live = pos >= 0
  index = jnp.where(full, pos, stream_index(pos, sink_len, ring))    # [B, K]
  at_page = jnp.take_along_axis(table, (index // page)[..., None], -1, mode="clip")[..., 0]
  at_page = jnp.where(live, at_page, num_pages)                      # out of range: dropped
  k_pool = cache.k.at[at_page, index % page].set(k_bkh.astype(cache.k.dtype), mode="drop")
  v_pool = cache.v.at[at_page, index % page].set(v_bkh.astype(cache.v.dtype), mode="drop")
  q = q_bnh.reshape(b, kh, n // kh, h)
  kw = dict(sink_len=sink_len, ring=ring, streaming=streaming, scale=scale)
  out = paged_kernel(impl, h, page)(q, k_pool, v_pool, table, full, pos_b, **kw)
  return out.reshape(b, n, h).astype(q_bnh.dtype), cache.replace(k=k_pool, v=v_pool)


def paged_kernel(impl: str, head_dim: int, page_size: int):
  """The attention over pages that decode impl `impl` names (`registry.paged_kernel`):
  "reference" (plain jnp, gathers every slot's whole page table), a backend's kernel, which
  reads only each slot's own pages (":interpret" runs it on a CPU), or "auto" (a kernel of
  this machine that takes the shapes, else the reference)."""
  from elastic_jax.attention import registry
  from elastic_jax.attention.decode_reference import paged_reference
  fn, interpret = registry.paged_kernel(impl, head_dim, page_size)
  return paged_reference if fn is None else functools.partial(fn, interpret=interpret)


@flax.struct.dataclass
class PagedCache:
  """The device side (module docstring): the pool and the decode batch's page tables."""
  k: jax.Array          # [P, page, H]
  v: jax.Array
  table: jax.Array      # [B, L, K, S] int32, P = no page
  full: jax.Array       # [B, L, K] bool

  # `model.Attention` calls a non-HeadCache cache's own decode attention.
  decode_attend = staticmethod(attend)


def empty_cache(num_pages: int, page_size: int, head_dim: int, dtype, batch: int,
                n_layers: int, kv_heads: int, slot_pages: int) -> PagedCache:
  """A zeroed pool and empty page tables."""
  pool = jnp.zeros((num_pages, page_size, head_dim), dtype)
  return PagedCache(pool, jnp.zeros_like(pool),
                    jnp.full((batch, n_layers, kv_heads, slot_pages), num_pages, jnp.int32),
                    jnp.zeros((batch, n_layers, kv_heads), bool))


@functools.partial(jax.jit, donate_argnames=("cache",))
def set_rows(cache: PagedCache, rows, table_rows, full_rows) -> PagedCache:
  """The page tables of rows [R] replaced by table_rows [R, L, K, S], full_rows [R, L, K]
  (rows out of range are left alone)."""
  return cache.replace(table=cache.table.at[rows].set(table_rows, mode="drop"),
                       full=cache.full.at[rows].set(full_rows, mode="drop"))


class PageAllocator:
  """The host's free list of the pool's pages. A request reserves the pages it may ever need
  when it is admitted (so that decoding never runs out of pages halfway), takes them from its
  reservation as its slots fill, and gives back both its pages and what is left of its
  reservation when it ends."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, -1, -1))
    self._reserved: dict = {}        # owner -> pages reserved and not yet taken
    self._owned: dict = {}           # owner -> pages taken

  @property
  def free_pages(self) -> int:
    """Pages not owned by any request (reserved ones included)."""
    return len(self._free)

  @property
  def available(self) -> int:
    """Pages a new reservation may claim."""
    return len(self._free) - sum(self._reserved.values())

  def owned(self, owner) -> list[int]:
    return list(self._owned.get(owner, ()))

  def reserve(self, owner, n: int) -> None:
    if owner in self._reserved:
      raise ElasticJaxError(f"request {owner} already holds a reservation")
    if n > self.available:
      raise ElasticJaxError(f"{n} pages do not fit the {self.available} pages available")
    self._reserved[owner], self._owned[owner] = n, []

  def shrink(self, owner, n: int) -> None:
    """The owner's reservation lowered to n pages (its exact need, once known)."""
    if not 0 <= n <= self._reserved[owner]:
      raise ElasticJaxError(f"request {owner} cannot shrink its reservation of "
                            f"{self._reserved[owner]} pages to {n}")
    self._reserved[owner] = n

  def take(self, owner, n: int) -> list[int]:
    if n > self._reserved.get(owner, 0):
      raise ElasticJaxError(f"request {owner} takes {n} pages beyond its reservation of "
                            f"{self._reserved.get(owner, 0)}")
    pages = [self._free.pop() for _ in range(n)]
    self._reserved[owner] -= n
    self._owned[owner].extend(pages)
    return pages

  def release(self, owner) -> int:
    """Every page of the owner back to the free list, its reservation dropped; returns the
    number of pages returned."""
    pages = self._owned.pop(owner, [])
    self._reserved.pop(owner, None)
    self._free.extend(reversed(pages))
    return len(pages)


class PageTables:
  """The host copy of the decode batch's page tables [B, L, K, S] and modes [B, L, K]; rows
  are filled at admission, grown while decoding, cleared when their request ends. Rows that
  changed since `take_dirty` are uploaded with `set_rows`."""

  def __init__(self, batch: int, n_layers: int, kv_heads: int, slot_pages: int,
               num_pages: int, page_size: int, streaming: Streaming):
    self.none, self.page_size = num_pages, page_size
    self.stream_pages = stream_pages(streaming, page_size)
    self.table = np.full((batch, n_layers, kv_heads, slot_pages), num_pages, np.int32)
    self.full = np.zeros((batch, n_layers, kv_heads), bool)
    self.held = np.zeros(batch, np.int64)      # positions each row's full slots have pages for
    self.dirty: set[int] = set()

  def need(self, full_lk: np.ndarray, positions: int) -> int:
    """Pages a request with modes full_lk [L, K] needs for `positions` positions."""
    n_full = int(np.sum(full_lk))
    return (n_full * full_pages(positions, self.page_size)
            + (full_lk.size - n_full) * self.stream_pages)

  def assign(self, row: int, full_lk: np.ndarray, prompt_len: int, alloc: PageAllocator,
             owner) -> None:
    """Row `row` takes modes full_lk [L, K] and the pages of a prompt of prompt_len tokens."""
    self.full[row] = full_lk
    self.table[row] = self.none
    for layer, head in zip(*np.nonzero(full_lk)):
      n = full_pages(prompt_len, self.page_size)
      self.table[row, layer, head, :n] = alloc.take(owner, n)
    for layer, head in zip(*np.nonzero(~full_lk)):
      self.table[row, layer, head, :self.stream_pages] = alloc.take(owner, self.stream_pages)
    self.held[row] = full_pages(prompt_len, self.page_size) * self.page_size
    self.dirty.add(row)

  def grow(self, row: int, position: int, alloc: PageAllocator, owner) -> None:
    """Pages for writing `position` in every full slot of the row (one more page each where
    it starts a new page)."""
    while position >= self.held[row]:
      index = int(self.held[row]) // self.page_size
      for layer, head in zip(*np.nonzero(self.full[row])):
        self.table[row, layer, head, index] = alloc.take(owner, 1)[0]
      self.held[row] += self.page_size
      self.dirty.add(row)

  def clear(self, row: int) -> None:
    self.table[row], self.full[row], self.held[row] = self.none, False, 0
    self.dirty.add(row)

  def take_dirty(self):
    """(rows [R], their tables, their modes) changed since the last call, R padded to a power
    of two with an out-of-range row (few shapes, few compilations); None when none changed."""
    if not self.dirty:
      return None
    rows = sorted(self.dirty)
    self.dirty.clear()
    size = 1 << (len(rows) - 1).bit_length()
    pad = size - len(rows)
    idx = np.asarray(rows + [self.table.shape[0]] * pad, np.int32)
    take = np.asarray(rows + [0] * pad)
    return idx, self.table[take], self.full[take]


def head_cache_layers(cache: HeadCache | list) -> list[tuple[int, HeadCache]]:
  """(first layer, cache) pairs of a prefill's cache: one pooled HeadCache (every layer) or
  one per layer (`prefill.by_layer`)."""
  if isinstance(cache, HeadCache):
    return [(0, cache)]
  return list(enumerate(cache))


def cache_modes(cache: HeadCache | list, n_layers: int, kv_heads: int) -> np.ndarray:
  """The modes a one-request prefill cache keeps [L, K] (True: full), read from its slot
  tables (XAttention heads, which prefill sparse, decode full there)."""
  full = np.zeros((n_layers, kv_heads), bool)
  for first, c in head_cache_layers(cache):
    fb, fh = np.asarray(c.full_b), np.asarray(c.full_h)
    for i in range(fb.shape[0]):
      full[first + i, fh[i][fb[i] == 0]] = True
  return full


def copy_plan(cache: HeadCache, first: int, table_lks: np.ndarray, none: int,
              page_size: int, n_stream: int) -> tuple[np.ndarray, np.ndarray]:
  """Where one request's prefill cache (row 0 of `cache`, its layers first, first + 1, ...)
  goes in the pool: destination pages of its full pool rows [P', M / page] and of its
  streaming slots [L', S', n_stream]; `none` (dropped) where a slot is no request's or past
  the pages it owns."""
  fs, fb, fh = (np.asarray(x) for x in (cache.full_start, cache.full_b, cache.full_h))
  sb, sh = np.asarray(cache.st_b), np.asarray(cache.st_h)
  rows, capacity = cache.full_k.shape[:2]
  full_dest = np.full((rows, capacity // page_size), none, np.int32)
  width = min(full_dest.shape[1], table_lks.shape[-1])
  for i in range(fb.shape[0]):
    for slot in np.nonzero(fb[i] == 0)[0]:
      full_dest[fs[i] + slot, :width] = table_lks[first + i, fh[i, slot], :width]
  st_dest = np.full(sb.shape + (n_stream,), none, np.int32)
  for i in range(sb.shape[0]):
    for slot in np.nonzero(sb[i] == 0)[0]:
      st_dest[i, slot] = table_lks[first + i, sh[i, slot], :n_stream]
  return full_dest, st_dest


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_in(cache: PagedCache, full_k, full_v, st_k, st_v, full_dest, st_dest) -> PagedCache:
  """A prefill cache's slots written into their pages (`copy_plan`): full rows [P', M, H] and
  streaming slots [L', S', W, H]."""
  num_pages, page, h = cache.k.shape

  def paged(x, n):      # [..., W, H] -> [..., n, page, H]
    pad = n * page - x.shape[-2]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, max(pad, 0)), (0, 0)])[..., :n * page, :]
    return x.reshape(x.shape[:-2] + (n, page, h))

  k, v = cache.k, cache.v
  for dest, xk, xv in ((full_dest, full_k, full_v), (st_dest, st_k, st_v)):
    n = dest.shape[-1]
    k = k.at[dest].set(paged(xk, n).astype(k.dtype), mode="drop")
    v = v.at[dest].set(paged(xv, n).astype(v.dtype), mode="drop")
  return cache.replace(k=k, v=v)
