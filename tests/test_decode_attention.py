"""Decode attention over the per-head cache: the jnp reference and the Pallas kernels (Triton
and TPU, interpret mode) against attention recomputed from each row's whole key history.

The oracle keeps every position's key and value and applies the streaming rule
(`Streaming.allows`) to positions directly; it never sees the sink/ring layout, which the test
fills from the same history, before the new token, the way decoding writes it (index p for
p < sink_len, else sink_len + p % ring). The new token's key and value come with the call,
which must also leave them in the cache at their index.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from elastic_jax.attention import pallas_gpu
from elastic_jax.generation import decode
from elastic_jax.attention.reference import Streaming
from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation.kv_cache import stream_width

ST = Streaming(sink_blocks=1, local_blocks=3, block=8)
SINK, RING = 8, 24
D, G = 16, 4


@pytest.fixture(autouse=True)
def _float32_products():
  """On a GPU, XLA multiplies float32 in TF32 by default (errors near 3e-4 here); the oracle
  is float64, so the products run in full float32 on every platform."""
  with jax.default_matmul_precision("highest"):
    yield


def _oracle(q_gh, hist_k, hist_v, pos, streaming):
  """Softmax attention of one slot's G queries at position pos over positions 0..pos (those
  the streaming rule allows when `streaming`), in float64."""
  if pos < 0:
    return np.zeros((q_gh.shape[0], hist_k.shape[1]))
  keys = np.arange(pos + 1)
  if streaming:
    keys = keys[np.asarray(ST.allows(pos, keys))]
  s = q_gh @ hist_k[keys].T * D ** -0.5
  p = np.exp(s - s.max(-1, keepdims=True))
  return (p / p.sum(-1, keepdims=True)) @ hist_v[keys]


def _case(seed, full_pos, st_pos, capacity=96, pool=7, start=2, layers=3, layer=1, batch=4):
  """Slots of a layer at the given positions (-1: an empty slot), each on its own query row
  out of batch * K = 4 * 4 rows, in a shuffled order."""
  rng = np.random.default_rng(seed)
  f, s_n = len(full_pos), len(st_pos)
  width = stream_width(ST)
  rows = rng.permutation(batch * 4)[:f + s_n]
  q, k_new, v_new = rng.normal(size=(batch * 4, G, D)), *rng.normal(size=(2, batch * 4, D))
  full_k, full_v = rng.normal(size=(2, pool, capacity, D))   # stale entries stay as noise
  st_k, st_v = rng.normal(size=(2, layers, s_n, width, D))
  want_full, want_st, where = [], [], []
  for i, p in enumerate(full_pos):
    r = rows[i]
    hist_k, hist_v = full_k[start + i].copy(), full_v[start + i].copy()
    if p >= 0:
      hist_k[p], hist_v[p] = k_new[r], v_new[r]
      where.append(("full", start + i, p, r))
    want_full.append(_oracle(q[r], hist_k, hist_v, p, False))
  for i, p in enumerate(st_pos):
    r = rows[f + i]
    hist_k, hist_v = rng.normal(size=(2, max(p, 0) + 1, D))
    for t in range(p):                # what decoding left in the slot before position p
      at = t if t < SINK else SINK + t % RING
      st_k[layer, i, at], st_v[layer, i, at] = hist_k[t], hist_v[t]
    if p >= 0:
      hist_k[p], hist_v[p] = k_new[r], v_new[r]
      where.append(("stream", i, p if p < SINK else SINK + p % RING, r))
    want_st.append(_oracle(q[r], hist_k, hist_v, p, True))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  slot_rows = lambda pos, rr: jnp.asarray([r if p >= 0 else -1 for p, r in zip(pos, rr)],
                                          jnp.int32).reshape(-1)
  args = (f32(q), f32(k_new), f32(v_new), f32(full_k), f32(full_v), jnp.int32(start),
          slot_rows(full_pos, rows[:f]), jnp.asarray(full_pos, jnp.int32).reshape(-1),
          f32(st_k), f32(st_v), jnp.int32(layer), slot_rows(st_pos, rows[f:]),
          jnp.asarray(st_pos, jnp.int32).reshape(-1))
  want = (np.stack(want_full) if f else np.zeros((0, G, D)),
          np.stack(want_st) if s_n else np.zeros((0, G, D)))
  return args, want, (where, k_new, v_new, layer)


def _check(got, want, written):
  (out_full, out_st), (full_k, full_v, st_k, st_v) = got
  np.testing.assert_allclose(np.asarray(out_full), want[0], atol=2e-5)
  np.testing.assert_allclose(np.asarray(out_st), want[1], atol=2e-5)
  where, k_new, v_new, layer = written
  for kind, slot, at, r in where:      # the new key and value sit at their index
    k, v = ((full_k[slot, at], full_v[slot, at]) if kind == "full"
            else (st_k[layer, slot, at], st_v[layer, slot, at]))
    np.testing.assert_allclose(np.asarray(k), k_new[r], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(v), v_new[r], rtol=1e-6)


KW = dict(sink_len=SINK, ring=RING, streaming=ST, scale=D ** -0.5)
# Full slots at positions inside the first block, mid-capacity and at its end, one empty slot;
# streaming slots inside the sink, before the ring first wraps, after several wraps, and empty.
FULL_POS, ST_POS = [3, 50, -1, 95], [5, 20, 31, 77, -1, 140]


@pytest.mark.parametrize("impl", ["reference", "pallas_gpu:interpret", "pallas_tpu:interpret"])
def test_decode_attention_matches_history(impl):
  if impl == "pallas_tpu:interpret" and not jax.devices("cpu"):
    pytest.skip("Pallas TPU interpret mode needs a CPU device")
  args, want, written = _case(0, FULL_POS, ST_POS)
  _check(decode.attention(impl, *args, **KW), want, written)
  if impl == "pallas_gpu:interpret":   # several key splits per slot, small key blocks
    _check(pallas_gpu.decode.decode_attention(*args, **KW, splits=5,
                                              tiles=pallas_gpu.Tiles(block_k=16),
                                              interpret=True),
           want, written)
    # the prefill kernel's name takes the same decode kernel (attention.parse_impl)
    _check(decode.attention("mosaic_gpu:interpret", *args, **KW), want, written)
    with pytest.raises(ElasticJaxError, match="the only suffix is ':interpret'"):
      decode.attention("pallas_gpu:fast", *args, **KW)
    with pytest.warns(DeprecationWarning, match="now called 'pallas_gpu'"):   # decode's old name
      _check(decode.attention("triton:interpret", *args, **KW), want, written)


@pytest.mark.parametrize("kind", ["no full slot", "no streaming slot"])
def test_decode_attention_with_one_kind_of_slot(kind):
  full_pos, st_pos = ([], [9, 60]) if kind == "no full slot" else ([7, 40], [])
  args, want, written = _case(1, full_pos, st_pos)
  for impl in ("reference", "pallas_gpu:interpret"):
    got = decode.attention(impl, *args, **KW)
    assert got[0][0].shape == (len(full_pos), G, D) and got[0][1].shape == (len(st_pos), G, D)
    _check(got, want, written)


def test_decode_kernels_take_tiles_and_their_former_keywords():
  """The decode kernels' block (and on the Triton one num_warps, num_stages) keywords warn
  (DeprecationWarning) and trace to the program of `tiles=` with those fields."""
  from elastic_jax.attention import pallas_tpu
  args, _, _ = _case(0, FULL_POS, ST_POS)
  trace = lambda fn, **kw: str(jax.make_jaxpr(lambda *a: fn(*a, **KW, **kw))(*args))
  gpu, tpu = pallas_gpu.decode.decode_attention, pallas_tpu.decode.decode_attention
  with pytest.warns(DeprecationWarning, match="tiles=Tiles"):
    old = trace(gpu, splits=5, block=16, num_warps=8)
  assert old == trace(gpu, splits=5, tiles=pallas_gpu.Tiles(block_k=16, num_stages=2,
                                                            num_warps=8))
  with pytest.warns(DeprecationWarning, match="tiles=Tiles"):
    old = trace(tpu, block=32)
  assert old == trace(tpu, tiles=pallas_tpu.Tiles(block_k=32))
