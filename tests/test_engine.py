"""The continuous-batching engine (generation/engine.py) and its paged cache (paged.py).

References: decode attention over pages against `decode_reference.reference` on the same keys
laid out as kv_cache.py's slots; the engine's tokens against `generate` run on each prompt
alone (its own cache, its own decode loop: no page, no shared batch).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.attention import decode_reference
from elastic_jax.elastic_model import ElasticModel
from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation import paged
from elastic_jax.generation.engine import Engine
from elastic_jax.generation.generate import SamplingConfig, generate
from elastic_jax.router import init_router_params

from test_generate import RCFG, _model

PAGE = 8


def _alone(params, cfg, prompt, limit, **kw):
  """`generate` on one prompt: (tokens, gates [L, K])."""
  gen = generate(params, cfg, [prompt], rcfg=RCFG, attn_impl="reference",
                 sampling=SamplingConfig(max_new_tokens=limit), **kw)
  return gen.tokens[0], gen.gates[:, 0]


def _check_pool(engine):
  """Every page is free or owned by a running request, never both, and none is owned twice."""
  owned = [p for r in engine.rows if r is not None for p in engine.alloc.owned(r.id)]
  assert len(owned) == len(set(owned))
  assert engine.alloc.free_pages + len(owned) == engine.num_pages
  for row, r in enumerate(engine.rows):
    used = engine.tables.table[row][engine.tables.table[row] < engine.num_pages]
    assert sorted(used.tolist()) == sorted(engine.alloc.owned(r.id) if r else [])


def test_paged_attention_equals_decode_reference():
  """Random keys laid out as kv_cache.py's slots (a pool of full slots, sink-and-ring rows)
  and as pages in a shuffled pool: the same outputs for every (row, KV head), full and
  streaming, the same key written at the same position, and an empty row writes nothing."""
  rng = np.random.default_rng(0)
  b, kh, g, h, cap, layer = 4, 2, 2, 8, 48, 1
  st = RCFG.streaming
  sink, ring = st.block * st.sink_blocks, st.block * st.local_blocks
  width = paged.stream_pages(st, PAGE) * PAGE
  pos = np.asarray([23, 9, 40, -1], np.int32)               # row 3 is empty
  full = np.asarray([[1, 0], [0, 1], [1, 0], [1, 1]], bool)
  x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k_new, v_new = x(b, kh * g, h), x(b, kh, h), x(b, kh, h)
  slots_k, slots_v = x(b, kh, cap, h), x(b, kh, cap, h)     # each slot's stored keys
  # kv_cache layout: full slots of live rows [F, M, H], streaming slots [L=2, S, W, H].
  fslots = [(i, j) for i in range(3) for j in range(kh) if full[i, j]]
  sslots = [(i, j) for i in range(3) for j in range(kh) if not full[i, j]]
  st_k = jnp.zeros((2, len(sslots), width, h)).at[layer].set(
      jnp.stack([slots_k[i, j, :width] for i, j in sslots]))
  st_v = jnp.zeros((2, len(sslots), width, h)).at[layer].set(
      jnp.stack([slots_v[i, j, :width] for i, j in sslots]))
  rows = lambda slots: jnp.asarray([i * kh + j for i, j in slots], jnp.int32)
  (want_full, want_st), (wfk, _, wsk, _) = decode_reference.reference(
      q.reshape(b * kh, g, h), k_new.reshape(b * kh, h), v_new.reshape(b * kh, h),
      jnp.stack([slots_k[i, j] for i, j in fslots]), jnp.stack([slots_v[i, j] for i, j in fslots]),
      jnp.int32(0), rows(fslots), jnp.asarray(pos[[i for i, _ in fslots]]), st_k, st_v,
      jnp.int32(layer), rows(sslots), jnp.asarray(pos[[i for i, _ in sslots]]),
      sink_len=sink, ring=ring, streaming=st, scale=h ** -0.5)
  # Pages: every slot's pages drawn from a shuffled pool of 64.
  order = iter(rng.permutation(64).tolist())
  table = np.full((b, 2, kh, cap // PAGE), 64, np.int32)
  pool_k, pool_v = np.zeros((64, PAGE, h), np.float32), np.zeros((64, PAGE, h), np.float32)
  for i in range(b):
    for j in range(kh):
      n = cap // PAGE if full[i, j] else width // PAGE
      table[i, layer, j, :n] = [next(order) for _ in range(n)]
      pool_k[table[i, layer, j, :n]] = np.asarray(slots_k[i, j, :n * PAGE]).reshape(n, PAGE, h)
      pool_v[table[i, layer, j, :n]] = np.asarray(slots_v[i, j, :n * PAGE]).reshape(n, PAGE, h)
  modes = np.zeros((b, 2, kh), bool)
  modes[:, layer] = full
  cache = paged.PagedCache(jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(table),
                           jnp.asarray(modes))
  out, new = jax.jit(paged.attend, static_argnames=("streaming", "scale"))(
      q, k_new, v_new, jnp.asarray(pos), cache, jnp.int32(layer), streaming=st,
      scale=h ** -0.5)
  out = np.asarray(out).reshape(b, kh, g, h)
  got_k = np.asarray(new.k)[np.minimum(table[:, layer], 63)].reshape(b, kh, -1, h)
  for n_slot, (i, j) in enumerate(fslots):
    np.testing.assert_allclose(out[i, j], want_full[n_slot], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_k[i, j, :cap], wfk[n_slot])
  for n_slot, (i, j) in enumerate(sslots):
    np.testing.assert_allclose(out[i, j], want_st[n_slot], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_k[i, j, :width], wsk[layer, n_slot])
  assert not np.asarray(out[3]).any()
  np.testing.assert_array_equal(np.asarray(new.k)[table[3, layer]], pool_k[table[3, layer]])
  changed = (np.asarray(new.k) != pool_k).any(axis=(1, 2))
  assert changed.sum() == 6                                  # one page per live slot


# Elastic: fewer prompts, as `generate` compiles its decode loop again for each new routing
# (its cache's shapes follow the modes; the engine's pages do not).
@pytest.mark.parametrize("routing,lengths,limits,pages", [
    ("full", (37, 21, 5, 44, 30, 12), (10, 3, 17, 6, 8, 1), 80),
    ("elastic", (37, 21, 44, 12), (10, 3, 6, 1), 64)])
def test_engine_tokens_equal_generate_alone(routing, lengths, limits, pages):
  """Requests of different prompt lengths and limits, some submitted while others decode,
  fewer rows than requests and a pool that makes one wait for pages: each request's greedy
  tokens are `generate`'s for its prompt alone, and its routing (elastic: some heads
  streaming, prefilled layer by layer here) is the one `generate` decides. No page leaks at
  any step, a finished request's pages return at once and the pool is whole at the end.
  Elastic runs with prefills interleaved with decoding (one layer a step): a newcomer's
  prefill spans steps in which the requests already decoding each get their token, and its
  cancel mid-prefill returns its reservation."""
  cfg, params = _model("qwen3")
  kw = dict(attention=routing)
  if routing == "elastic":
    kw["router_params"] = init_router_params(cfg, RCFG, jax.random.key(3))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
  engine = Engine(params, cfg, rcfg=RCFG, num_pages=pages, page_size=PAGE, max_batch=3,
                  attn_impl="reference", layer_loop="split" if routing == "elastic" else "scan",
                  prefill_chunk=64 if routing == "elastic" else None,
                  prefill_layers=1 if routing == "elastic" else None, **kw)
  first = len(prompts) // 2
  handles = [engine.submit(p, max_new_tokens=m) for p, m in zip(prompts[:first],
                                                                   limits[:first])]
  waited, seen, overlapped, dropped = False, {}, 0, None
  for step in range(200):
    if step == 2:                                   # these arrive while the first decode
      handles += [engine.submit(p, max_new_tokens=m) for p, m in zip(prompts[first:],
                                                                      limits[first:])]
      if routing == "elastic":
        dropped = engine.submit(prompts[0][::-1], max_new_tokens=4)
    if dropped is not None and dropped.finish is None and any(
        r is dropped for r, _ in engine.prefilling):
      engine.cancel(dropped)                        # mid-prefill: its reservation returns
      assert dropped.row is None and engine.alloc.owned(dropped.id) == []
      assert dropped not in engine.rows and not dropped.tokens
    under_way = {r.id for r, _ in engine.prefilling}
    events = engine.step()
    # A step that neither began nor ended a prefill still under way decoded the others.
    decoded = {e.request.id for e in events} - under_way
    overlapped += bool(under_way & {r.id for r, _ in engine.prefilling}) and bool(decoded)
    for event in events:
      seen.setdefault(event.request.id, []).extend(event.tokens)
      if event.finished:
        assert engine.alloc.owned(event.request.id) == [] and event.request.row is None
    # A row stayed free through the admission (more free rows than requests that finished
    # this step) while the queue's head waited: it waited for pages.
    free = engine.rows.count(None) - sum(e.finished for e in events)
    waited |= bool(engine.queue) and free > 0
    _check_pool(engine)
    if engine.idle:
      break
  assert engine.idle and engine.alloc.free_pages == engine.alloc.available == pages
  assert waited, "no request waited for pages while a row was free"
  assert overlapped if routing == "elastic" else not engine.prefilling
  assert routing != "elastic" or dropped.finish == "cancelled" and not dropped.tokens
  mixed = 0
  for handle, prompt, limit in zip(handles, prompts, limits):
    want, gates = _alone(params, cfg, prompt, limit, **kw)
    assert handle.tokens == want == seen[handle.id] and handle.finish == "length"
    np.testing.assert_array_equal(handle.full, gates > 0.5)
    mixed += 0 < handle.full.mean() < 1
  assert mixed > 0 if routing == "elastic" else mixed == 0


def test_forced_mix_stop_tokens_sampling_and_cancel():
  """Forced mixed modes; in one batch: a request ended by its stop token, one ended by the
  engine's EOS, a sampled one (the same tokens as when sampled alone: its key depends on its
  seed and count only), a near-zero temperature one (greedy), and two cancelled (one queued,
  one decoding), whose pages return at once."""
  cfg, params = _model("qwen3")
  gates = np.asarray([[1, 0], [0, 1], [0, 0]], np.float32)
  kw = dict(attention="forced", gates=gates)
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (33, 18, 9, 26, 14, 40)]
  greedy = [_alone(params, cfg, p, 8, **kw)[0] for p in prompts[:4]]
  stop_tok, eos_tok = greedy[0][3], greedy[1][4]
  # Each ends its own request there (first seen there) and no other greedy request.
  assert stop_tok not in greedy[0][:3] + greedy[1] + greedy[3]
  assert eos_tok not in greedy[0] + greedy[1][:4] + greedy[3]
  sampled = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=7)
  new = lambda: Engine(params, cfg, rcfg=RCFG, num_pages=80, page_size=PAGE, max_batch=5,
                       eos_ids=[eos_tok], attn_impl="reference", **kw)
  solo = new()
  alone = solo.submit(prompts[2], sampled)
  solo.run()
  engine = new()
  stop = engine.submit(prompts[0], stop=[stop_tok], max_new_tokens=8)
  eos = engine.submit(prompts[1], max_new_tokens=8)
  draw = engine.submit(prompts[2], sampled)
  cold = engine.submit(prompts[3], SamplingConfig(max_new_tokens=8, temperature=1e-30, seed=3))
  dropped = [engine.submit(p, max_new_tokens=8) for p in prompts[4:]]
  engine.step()
  assert dropped[0].row is not None and dropped[1] in engine.queue    # decoding, queued
  for r in dropped:
    engine.cancel(r)
    assert r.finish == "cancelled" and r.row is None and engine.alloc.owned(r.id) == []
    _check_pool(engine)
  held = [len(r.tokens) for r in dropped]
  engine.run()
  assert [len(r.tokens) for r in dropped] == held                 # no event after a cancel
  assert stop.tokens == greedy[0][:4] and stop.finish == "stop"
  assert eos.tokens == greedy[1][:5] and eos.finish == "eos"
  assert draw.tokens == alone.tokens and draw.finish == alone.finish
  assert draw.tokens != greedy[2][:len(draw.tokens)]                 # sampled, not greedy
  assert cold.tokens == greedy[3] and cold.finish == "length"
  assert engine.alloc.free_pages == 80 and engine.idle
  np.testing.assert_array_equal(stop.full, gates > 0.5)


def test_admission_refuses_what_never_fits_and_admits_what_fits_later():
  cfg, params = _model("llama")
  engine = Engine(params, cfg, attention="full", rcfg=RCFG, num_pages=16, page_size=PAGE,
                  max_batch=4, attn_impl="reference")
  # all 4 (layer, head) slots full: 4 * ceil((60 + 10 - 1) / 8) = 36 pages > 16
  with pytest.raises(ElasticJaxError, match="needs 36 pages of 8 tokens and can never fit "
                                            "the pool of 16 pages"):
    engine.submit(list(range(60)), max_new_tokens=10)
  assert not engine.queue
  first = engine.submit(list(range(20, 45)), max_new_tokens=6)      # 4 * 4 = 16 pages
  second = engine.submit(list(range(3, 30)), max_new_tokens=4)      # 4 * 4 = 16: waits
  engine.step()
  assert first.row is not None and second in engine.queue and engine.alloc.available == 0
  while first.finish is None:
    assert second in engine.queue
    engine.step()
  engine.step()                                                       # admitted now
  assert second not in engine.queue and second.tokens
  engine.run()
  assert second.finish == "length" and len(second.tokens) == 4
  assert second.tokens == _alone(params, cfg, list(range(3, 30)), 4, attention="full")[0]
  assert engine.alloc.free_pages == 16


def test_bad_requests_and_settings():
  cfg, params = _model("llama")
  router = init_router_params(cfg, RCFG, jax.random.key(0))
  with pytest.raises(ElasticJaxError, match="exactly one of num_pages and memory_fraction"):
    Engine(params, cfg, attention="full", rcfg=RCFG)
  with pytest.raises(ElasticJaxError, match="needs trained routers"):
    Engine(params, cfg, rcfg=RCFG, num_pages=8)
  with pytest.raises(ElasticJaxError, match=r"gates must be an array of numbers \[L, K\]"):
    Engine(params, cfg, attention="forced", gates=np.ones(3), rcfg=RCFG, num_pages=8)
  with pytest.raises(ElasticJaxError, match="memory_fraction needs a device that reports"):
    Engine(params, cfg, attention="full", rcfg=RCFG, memory_fraction=0.5)   # a CPU
  with pytest.raises(ElasticJaxError, match=r"max_seq_len must be an integer in \[1, 512\]"):
    Engine(params, cfg, attention="full", rcfg=RCFG, num_pages=8, max_seq_len=600)
  for bad in (0, 1.5, True):
    with pytest.raises(ElasticJaxError, match="prefill_layers must be an integer >= 1"):
      Engine(params, cfg, attention="full", rcfg=RCFG, num_pages=8, prefill_layers=bad)
  model = ElasticModel(config=cfg, params=params, hf_config={}, router_params=router,
                       router_config=RCFG)
  made = Engine.from_model(model, num_pages=8)
  assert (made.attention, made.router_params, made.rcfg) == ("elastic", router, RCFG)
  elastic = Engine(params, cfg, router_params=router, rcfg=RCFG, num_pages=20, page_size=PAGE)
  # Routing unknown before the prefill: every head counts as full, 4 * 4 = 16 pages.
  elastic.submit(list(range(25)), max_new_tokens=4)
  with pytest.raises(ElasticJaxError, match="every head counts as full"):
    elastic.submit(list(range(40)), max_new_tokens=4)
  for bad, words in (([], "non-empty list of integer token ids"),
                     ("abc", "non-empty list of integer token ids"),
                     ([1, 200], "outside the vocabulary"),
                     ([1] * 510, "exceeds the engine's max_seq_len")):
    with pytest.raises(ElasticJaxError, match=words):
      elastic.submit(bad, max_new_tokens=4)
  with pytest.raises(ElasticJaxError, match="not on stop strings"):
    elastic.submit([1, 2], SamplingConfig(stop=("x",)))
  with pytest.raises(ElasticJaxError, match="max_new_tokens must be an integer >= 1"):
    elastic.submit([1, 2], max_new_tokens=0)
  with pytest.raises(ElasticJaxError, match="stop must be a list of integer token ids"):
    elastic.submit([1, 2], stop=["a"])


@pytest.mark.parametrize("seed", [0, 1])
def test_paged_kernel_reads_only_the_slots_pages(seed):
  """The Triton kernel over pages (interpret mode) against the plain-jnp spec: random pools
  and tables, full slots at positions on and off page boundaries, streaming slots past their
  window, an empty row, any number of splits. Pages past what a slot uses hold NaN: the
  kernel must not read them (the spec masks them, so its output is finite too)."""
  from elastic_jax.attention.pallas_gpu.paged import paged_attention
  rng = np.random.default_rng(seed)
  b, kh, g, h, page, num_pages = 4, 2, 3, 16, 16, 48
  st = RCFG.streaming
  sink, ring = st.block * st.sink_blocks, st.block * st.local_blocks
  used_st = paged.stream_pages(st, page)
  pos = np.asarray([rng.integers(40, 90), 47, rng.integers(0, 16), -1], np.int32)
  full = rng.random((b, kh)) < 0.5
  width = 6
  table = np.full((b, kh, width), num_pages, np.int32)
  order = iter(rng.permutation(num_pages).tolist())
  pool_k = rng.standard_normal((num_pages, page, h)).astype(np.float32)
  pool_v = rng.standard_normal((num_pages, page, h)).astype(np.float32)
  spare = []
  for i in range(b):
    for j in range(kh):
      n = 0 if pos[i] < 0 else (pos[i] // page + 1 if full[i, j] else used_st)
      table[i, j, :n] = [next(order) for _ in range(n)]
      extra = next(order)                     # a page past the slot's use, in its table
      if n < width:
        table[i, j, n] = extra
      spare.append(extra)
  pool_k[spare], pool_v[spare] = np.nan, np.nan
  q = jnp.asarray(rng.standard_normal((b, kh, g, h)), jnp.float32)
  args = (q, jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(table), jnp.asarray(full),
          jnp.asarray(pos))
  kw = dict(sink_len=sink, ring=ring, streaming=st, scale=h ** -0.5)
  clean = [jnp.where(jnp.isnan(x), 0.0, x) for x in args[1:3]]
  want = decode_reference.paged_reference(args[0], *clean, *args[3:], **kw)
  for splits in (None, 1, 4):
    got = paged_attention(*args, splits=splits, interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  assert not np.asarray(got[3]).any()


def test_engine_decodes_through_the_paged_kernel():
  """The engine with decode_impl='pallas_gpu:interpret' gives the reference engine's tokens
  (elastic routing: full and streaming heads), and refuses an unknown impl or shapes the
  kernel does not take."""
  cfg, params = _model("qwen3")
  router = init_router_params(cfg, RCFG, jax.random.key(3))
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 21, 44)]
  tokens = {}
  for impl in ("reference", "pallas_gpu:interpret"):
    engine = Engine(params, cfg, rcfg=RCFG, router_params=router, num_pages=64, page_size=16,
                    max_batch=3, attn_impl="reference", prefill_chunk=None, max_seq_len=96,
                    decode_impl=impl)
    handles = [engine.submit(p, max_new_tokens=m) for p, m in zip(prompts, (9, 4, 6))]
    engine.run()
    tokens[impl] = [h.tokens for h in handles]
    assert any(0 < h.full.mean() < 1 for h in handles)
  assert tokens["reference"] == tokens["pallas_gpu:interpret"]
  with pytest.raises(ElasticJaxError, match="over pages 'mosaic' is not one of reference, "
                                             "auto, pallas_gpu"):
    Engine(params, cfg, attention="full", rcfg=RCFG, num_pages=8, decode_impl="mosaic")
  with pytest.raises(ElasticJaxError, match="has no decode kernel over pages"):
    Engine(params, cfg, attention="full", rcfg=RCFG, num_pages=8, decode_impl="pallas_tpu")
  with pytest.raises(ElasticJaxError, match="does not take head dim 16 with pages of 8"):
    Engine(params, cfg, attention="full", rcfg=RCFG, num_pages=8, page_size=8,
           decode_impl="pallas_gpu")
