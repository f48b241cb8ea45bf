"""Decode attention over the per-head cache: the jnp reference and the Pallas kernels (Triton
and TPU, interpret mode) against attention recomputed from each row's whole key history.

The oracle keeps every position's key and value and applies the streaming rule
(`Streaming.allows`) to positions directly; it never sees the sink/ring layout, which the test
fills from the same history the way decoding writes it (index p for p < sink_len, else
sink_len + p % ring).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from elastic_jax.attention import decode
from elastic_jax.attention.reference import Streaming
from elastic_jax.kv_cache import stream_width

ST = Streaming(sink_blocks=1, local_blocks=3, block=8)
SINK, RING = 8, 24
D, G = 16, 4


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


def _case(seed, full_pos, st_pos, capacity=96, pool=7, start=2, layers=3, layer=1):
  rng = np.random.default_rng(seed)
  f, s_n = len(full_pos), len(st_pos)
  width = stream_width(ST)
  full_k, full_v = rng.normal(size=(2, pool, capacity, D))
  st_k, st_v = rng.normal(size=(2, layers, s_n, width, D))   # stale entries stay as noise
  want_full, want_st = [], []
  q_f, q_s = rng.normal(size=(f, G, D)), rng.normal(size=(s_n, G, D))
  for i, p in enumerate(full_pos):
    want_full.append(_oracle(q_f[i], full_k[start + i], full_v[start + i], p, False))
  for i, p in enumerate(st_pos):
    hist_k, hist_v = rng.normal(size=(2, max(p, 0) + 1, D))
    for t in range(p + 1):            # what decoding leaves in the slot after position p
      at = t if t < SINK else SINK + t % RING
      st_k[layer, i, at], st_v[layer, i, at] = hist_k[t], hist_v[t]
    want_st.append(_oracle(q_s[i], hist_k, hist_v, p, True))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  args = (f32(q_f), f32(q_s), f32(full_k), f32(full_v), jnp.int32(start),
          jnp.asarray(full_pos, jnp.int32), f32(st_k), f32(st_v), jnp.int32(layer),
          jnp.asarray(st_pos, jnp.int32))
  return args, np.stack(want_full), np.stack(want_st)


KW = dict(sink_len=SINK, ring=RING, streaming=ST, scale=D ** -0.5)
# Full slots at positions inside the first block, mid-capacity and at its end, one empty slot;
# streaming slots inside the sink, before the ring first wraps, after several wraps, and empty.
FULL_POS, ST_POS = [3, 50, -1, 95], [5, 20, 31, 77, -1, 140]


@pytest.mark.parametrize("impl", ["reference", "triton:interpret", "tpu:interpret"])
def test_decode_attention_matches_history(impl):
  if impl == "tpu:interpret" and not jax.devices("cpu"):
    pytest.skip("Pallas TPU interpret mode needs a CPU device")
  args, want_full, want_st = _case(0, FULL_POS, ST_POS)
  got_full, got_st = decode.attention(impl, *args, **KW)
  np.testing.assert_allclose(np.asarray(got_full), want_full, atol=2e-5)
  np.testing.assert_allclose(np.asarray(got_st), want_st, atol=2e-5)
  if impl == "triton:interpret":   # several key splits per slot, small key blocks
    got_full, got_st = decode.triton(*args, **KW, splits=5, block=16, interpret=True)
    np.testing.assert_allclose(np.asarray(got_full), want_full, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_st), want_st, atol=2e-5)


@pytest.mark.parametrize("kind", ["no full slot", "no streaming slot"])
def test_decode_attention_with_one_kind_of_slot(kind):
  full_pos, st_pos = ([], [9, 60]) if kind == "no full slot" else ([7, 40], [])
  args, want_full, want_st = _case(1, full_pos or [0], st_pos or [0])
  args = list(args)
  if not full_pos:
    args[0], args[5] = args[0][:0], args[5][:0]
  if not st_pos:
    args[1], args[9] = args[1][:0], args[9][:0]
  for impl in ("reference", "triton:interpret"):
    got_full, got_st = decode.attention(impl, *args, **KW)
    assert got_full.shape == (len(full_pos), G, D) and got_st.shape == (len(st_pos), G, D)
    if full_pos:
      np.testing.assert_allclose(np.asarray(got_full), want_full, atol=2e-5)
    if st_pos:
      np.testing.assert_allclose(np.asarray(got_st), want_st, atol=2e-5)
