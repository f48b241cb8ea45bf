"""The routed model and the min-max train step on a tiny random backbone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import elastic_jax as ej
from elastic_jax.config import config_from_hf_dict
from elastic_jax.model import forward, forward_routed_jit, init_params
from elastic_jax.router import RouterConfig, init_router_params, msr
from elastic_jax.train.objective import (TASK_TYPES, ObjectiveConfig,
                                         chunked_answer_cross_entropy, sparsity_penalty)
from elastic_jax.train.step import TrainConfig, init_train_state, temperature, train_step

CFG = config_from_hf_dict(dict(model_type="qwen3", vocab_size=64, hidden_size=32,
                               intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                               max_position_embeddings=256))
RCFG = RouterConfig(block=8, sink_blocks=1, local_blocks=2, boundary=8)
S = 3                                      # segment slots of the batches here
SINGLE_QA, CODE = TASK_TYPES.index("single_qa"), TASK_TYPES.index("code")


@pytest.fixture(scope="module")
def backbone():
  return init_params(CFG, jax.random.key(0), "float32")


def _batch(b=4, t=64, prompt=48):
  """Rows alternate between a 'code' input (tokens 0-31) and a 'single_qa' one (32-63)."""
  rng = np.random.default_rng(0)
  ids = np.zeros((b, t), np.int32)
  task = np.full((b, S), -1, np.int32)
  for i in range(b):
    lo = 0 if i % 2 == 0 else 32
    ids[i] = rng.integers(lo, lo + 32, t)
    task[i, 1] = CODE if i % 2 == 0 else SINGLE_QA
  ar = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  return dict(input_ids=jnp.asarray(ids), targets=jnp.asarray(np.roll(ids, -1, 1)),
              loss_mask=jnp.asarray(ar >= prompt), segment_ids=jnp.ones((b, t), jnp.int32),
              positions=jnp.asarray(ar), prompt_mask=jnp.asarray(ar < prompt),
              task_ids=jnp.asarray(task))


def _inference_msr(backbone, router, batch):
  _, stats = forward_routed_jit(backbone, batch["input_ids"], batch["positions"],
                                batch["segment_ids"], batch["prompt_mask"], cfg=CFG, rcfg=RCFG,
                                router_params=router, num_segments=S)
  return np.asarray(msr(stats["gate"]))[:, 1]


def test_routed_model_modes(backbone):
  b = _batch()
  ids, pos, seg, pm = b["input_ids"], b["positions"], b["segment_ids"], b["prompt_mask"]
  full = forward(backbone, ids, pos, seg, cfg=CFG)
  run = lambda **kw: forward_routed_jit(backbone, ids, pos, seg, pm, cfg=CFG, rcfg=RCFG,
                                       num_segments=S, **kw)
  ones = jnp.ones((2, 4, 3, 4))
  forced_full, stats = run(attention="forced", forced_gates=ones)
  np.testing.assert_allclose(np.asarray(forced_full), np.asarray(full), atol=1e-5)
  assert np.all(np.asarray(msr(stats["gate"])) == 0)
  sparse, _ = run(attention="sparse")
  forced_sparse, _ = run(attention="forced", forced_gates=jnp.zeros_like(ones))
  np.testing.assert_allclose(np.asarray(forced_sparse), np.asarray(sparse), atol=1e-5)
  assert np.abs(np.asarray(sparse) - np.asarray(full)).max() > 1e-3  # T spans > sink + local
  router = init_router_params(CFG, RCFG, jax.random.key(1))
  elastic, stats = run(attention="elastic", router_params=router)
  assert stats["gate"].shape == (2, 4, 3, 4) and stats["logits"].shape == (2, 4, 3, 4, 2)
  gate = np.asarray(stats["gate"])
  assert set(np.unique(gate)) <= {0.0, 1.0}
  # The elastic output is the forced output under the gates the routers chose.
  again, _ = run(attention="forced", forced_gates=stats["gate"])
  np.testing.assert_allclose(np.asarray(elastic), np.asarray(again), atol=1e-6)


def test_unpacked_rows_skip_segments_and_match(backbone):
  """packed=False (the path the fused kernels take) changes nothing for unpadded rows."""
  b = _batch()
  router = init_router_params(CFG, RCFG, jax.random.key(1))
  run = lambda packed, impl: forward_routed_jit(
      backbone, b["input_ids"], b["positions"], b["segment_ids"], b["prompt_mask"], cfg=CFG,
      rcfg=RCFG, router_params=router, packed=packed, attn_impl=impl, num_segments=S)
  want, _ = run(True, "reference")
  for impl in ("reference", "auto"):
    got, _ = run(False, impl)
    if impl == "auto" and jax.default_backend() != "cpu":
      # A GPU kernel's float32 products run in tf32: compare relatively.
      rel = np.linalg.norm(np.asarray(got - want)) / np.linalg.norm(np.asarray(want))
      assert rel < 1e-2, rel
    else:
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_xattention_settings(backbone):
  """FA-XA and XA-SSA: fixed points against the other modes, and router gradients."""
  b = _batch()
  ids, pos, seg, pm = b["input_ids"], b["positions"], b["segment_ids"], b["prompt_mask"]
  full = forward(backbone, ids, pos, seg, cfg=CFG)

  def run(setting, threshold=0.9, **kw):
    rcfg = dataclasses.replace(RCFG, patterns=setting, xa_stride=4, xa_block=16,
                               xa_threshold=threshold)
    return forward_routed_jit(backbone, ids, pos, seg, pm, cfg=CFG, rcfg=rcfg, num_segments=S,
                              **kw)

  zeros = jnp.zeros((2, 4, 3, 4))
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  # FA heads are untouched by fa-xa; XA heads that keep every block are full attention.
  close(run("fa-xa", attention="forced", forced_gates=jnp.ones_like(zeros))[0], full)
  close(run("fa-xa", 1.0, attention="sparse")[0], full)
  xa_only, stats = run("fa-xa", 0.5, attention="sparse")
  assert np.abs(np.asarray(xa_only - full)).max() > 1e-4
  kept = np.asarray(stats["xa_kept"])
  assert kept.shape == (2, 4, 4) and (kept > 0).all() and (kept < 1).any()
  # xa-ssa's sparse heads are fa-ssa's.
  close(run("xa-ssa", attention="sparse")[0], run("fa-ssa", attention="sparse")[0])
  # The routers get gradients through the XA heads (fa-xa trains in test_train_loop.py).
  router = init_router_params(CFG, RCFG, jax.random.key(1))

  def loss(router):
    logits, st = run("xa-ssa", 0.5, attention="elastic", router_params=router,
                     key=jax.random.key(4))
    return logits[:, -1, 0].sum() + st["gate"].sum()

  grads = jax.grad(loss)(router)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  assert np.abs(np.asarray(grads["route_w3"])).max() > 0


def test_model_logits_api(backbone):
  model = ej.ElasticModel(CFG, backbone, CFG.to_hf_dict(), router_config=RCFG,
                          router_params=init_router_params(CFG, RCFG, jax.random.key(2)))
  ids = np.asarray(_batch()["input_ids"][:2])
  full = model.logits(ids)
  forced, rep = model.logits(ids, attention="forced", gates=np.ones((2, 4)),
                             return_routing=True)
  np.testing.assert_allclose(np.asarray(forced), np.asarray(full), atol=1e-5)
  assert np.all(np.asarray(rep["msr"]) == 0) and np.all(np.asarray(rep["esr"]) == 0)
  _, rep = model.logits(ids, attention="sparse", return_routing=True)
  assert np.all(np.asarray(rep["msr"]) == 1) and np.all(np.asarray(rep["esr"]) > 0.3)
  _, rep = model.logits(ids, attention="elastic", prompt_lengths=[40, 50], return_routing=True)
  g = np.asarray(rep["gates"])
  np.testing.assert_allclose(np.asarray(rep["msr"]), 1 - g.mean(axis=(0, 2)))
  with pytest.raises(ej.ElasticJaxError, match="gates must be"):
    model.logits(ids, attention="forced", gates=np.ones((3, 4)))
  with pytest.raises(ej.ElasticJaxError, match="needs trained routers"):
    dataclasses.replace(model, router_params=None).logits(ids, attention="elastic")


def test_penalty_averages_per_task_then_over_tasks():
  msr_bs = jnp.asarray([[0.0, 0.5, 1.0], [0.0, 0.9, -1.0]])
  task = jnp.asarray([[-1, 0, 3], [-1, 0, -1]])
  lam = {"l1": jnp.asarray([1.0, 0, 0, 2.0, 0]), "l2": jnp.asarray([0.0, 0, 0, 1.0, 0])}
  ocfg = ObjectiveConfig(targets=(0.7, 0.7, 1.0, 0.6, 1.0))
  penalty, msr_task, count = sparsity_penalty(msr_bs, task, lam, ocfg)
  qa = (abs(0.5 - 0.7) + abs(0.9 - 0.7)) / 2          # task 0: mean over its 2 samples
  code = 2.0 * abs(1.0 - 0.6) + (1.0 - 0.6) ** 2       # task 3: one sample
  assert float(penalty) == pytest.approx((qa + code) / 2)
  assert float(msr_task[0]) == pytest.approx(0.7) and np.isnan(float(msr_task[1]))
  np.testing.assert_array_equal(np.asarray(count), [2, 0, 0, 1, 0])
  # The paper's signed l1 term: l1 (MSR - t), below the target a negative contribution.
  signed, _, _ = sparsity_penalty(msr_bs, task, lam, ObjectiveConfig(
      targets=(0.7, 0.7, 1.0, 0.6, 1.0), linear_term="signed"))
  assert float(signed) == pytest.approx(((0.5 - 0.7 + 0.9 - 0.7) / 2 + code) / 2)


def test_saturated_share_counts_margins_past_the_threshold():
  from elastic_jax.train.step import SATURATED_MARGIN, saturated_share
  m = np.zeros((2, 1, 2, 3, 2), np.float32)                  # [L, B, S, K, C]
  m[0, 0, 1, :, 1] = [SATURATED_MARGIN * 2 + 1, 1.0, -40.0]  # margins 31, 1, -40 at tau 2
  m[1, 0, 0, :, 1] = 100.0                                   # an empty slot: not counted
  share = saturated_share(jnp.asarray(m), jnp.asarray([[False, True]]), 2.0)
  np.testing.assert_allclose(np.asarray(share), [2 / 3, 0.0])


@pytest.mark.parametrize("t, chunk", [(50, 16), (64, 64), (7, 1024)])
def test_chunked_cross_entropy_matches_full_logits(t, chunk):
  """Value and gradient equal the plain CE of x @ head (NumPy), with padding and with chunks
  that hold no answer token (skipped)."""
  rng = np.random.default_rng(t)
  b, e, v = 2, 8, 40
  x = rng.normal(size=(b, t, e)).astype(np.float32)
  head = rng.normal(size=(e, v)).astype(np.float32)
  tgt = rng.integers(0, v, (b, t)).astype(np.int32)
  mask = np.zeros((b, t), bool)
  mask[0, t - 3:] = True                                # only the last chunk of row 0 counts
  mask[1, :2] = True
  got, grad = jax.value_and_grad(chunked_answer_cross_entropy)(
      jnp.asarray(x), jnp.asarray(head), jnp.asarray(tgt), jnp.asarray(mask), chunk=chunk)
  logits = x.astype(np.float64) @ head
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = logz - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
  want = (nll * mask).sum() / mask.sum()
  p = np.exp(logits - logz[..., None])
  p[np.arange(b)[:, None], np.arange(t)[None], tgt] -= 1.0
  want_grad = (p * mask[..., None] / mask.sum()) @ head.T
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)
  # The head's gradient, when the head is differentiated (its own rule computes it then).
  head_grad = jax.grad(chunked_answer_cross_entropy, argnums=1)(
      jnp.asarray(x), jnp.asarray(head), jnp.asarray(tgt), jnp.asarray(mask), chunk=chunk)
  want_head = np.einsum("bte,btv->ev", x, p * mask[..., None] / mask.sum())
  np.testing.assert_allclose(np.asarray(head_grad), want_head, rtol=1e-4, atol=1e-6)


def test_chunked_cross_entropy_keeps_no_per_chunk_copy_of_the_head():
  """What the backward pass keeps does not grow with the number of chunks: the inputs
  themselves, not one [E, V] head (or [c, V] logits) per chunk, which at 32K tokens and an 8B
  model's vocabulary took 31 GiB."""
  b, t, e, v = 1, 4096, 16, 512
  x = jnp.ones((b, t, e), jnp.bfloat16)
  head = jnp.ones((e, v), jnp.bfloat16)
  tgt = jnp.zeros((b, t), jnp.int32)
  mask = jnp.ones((b, t), bool)
  for chunk in (1024, 128):
    _, vjp = jax.vjp(lambda x: chunked_answer_cross_entropy(x, head, tgt, mask, chunk=chunk), x)
    kept = sum(leaf.nbytes for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "nbytes"))
    inputs = x.nbytes + head.nbytes + tgt.nbytes + mask.size * 4
    assert kept <= inputs + 64, (chunk, kept, inputs)          # + a few scalars


def test_mlp_chunks_give_the_same_step_and_hold_one_chunk():
  """model.mlp_chunk under remat: the same updated routers and loss as the whole-row MLP (it
  runs per token), and the compiled step's temporaries shrink by about what the paper model
  says: the backward pass holds one chunk's [chunk, F] MLP activations, not the row's."""
  cfg = dataclasses.replace(CFG, intermediate_size=8192)       # the MLP sets the peak
  params = init_params(cfg, jax.random.key(0), "float32")
  tcfg, t, chunk = TrainConfig(steps=10), 256, 32
  kw = dict(cfg=cfg, rcfg=RCFG, ocfg=ObjectiveConfig(), tcfg=tcfg, remat=True)
  batch = _batch(b=2, t=t, prompt=192)
  out, temp = {}, {}
  for c in (0, chunk):
    state = init_train_state(cfg, RCFG, tcfg, jax.random.key(3))
    step = train_step.lower(state, params, batch, mlp_chunk=c, **kw).compile()
    temp[c] = step.memory_analysis().temp_size_in_bytes
    for _ in range(2):               # the second step has a nonzero learning rate
      state, m = step(state, params, batch)
    out[c] = (state.trainable, float(m["loss"]))
  for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[chunk][0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(out[chunk][1], out[0][1], rtol=1e-5)
  # Gate, up, their product and the three gradients in float32, for the tokens not in the chunk.
  saved = 6 * cfg.intermediate_size * 4 * 2 * (t - chunk)
  assert temp[0] - temp[chunk] >= 0.5 * saved, (temp, saved)
  with pytest.raises(ej.ElasticJaxError, match=r"mlp_chunk must be an integer >= 0 .*got -4"):
    train_step(state, params, batch, mlp_chunk=-4, **kw)     # not a step without the MLP


def test_temperature_schedules():
  t = TrainConfig(steps=100)
  assert float(temperature(0, t)) == pytest.approx(1.5)
  assert float(temperature(30, t)) == pytest.approx(1.25)
  assert float(temperature(60, t)) == pytest.approx(1.0)
  assert float(temperature(99, t)) == pytest.approx(1.0)
  e = TrainConfig(steps=100, tau_schedule="exponential")
  assert float(temperature(50, e)) == pytest.approx(max(1.0, 1.5 * np.exp(-0.3)))


def test_training_moves_msr_toward_each_target(backbone):
  """Targets 1.0 (code) and 0.3 (single QA): a few dozen steps separate the two tasks, the
  multipliers grow while the constraint is violated, and the backbone does not change."""
  ocfg = ObjectiveConfig(targets=(0.3, 0.7, 1.0, 1.0, 1.0))
  tcfg = TrainConfig(steps=60, lr=3e-2, warmup_frac=0.1)
  batch = _batch()
  state = init_train_state(CFG, RCFG, tcfg, jax.random.key(1))
  before = jax.tree.map(lambda x: np.array(x), backbone)
  lam0 = jax.tree.map(np.array, state.trainable["lambdas"])
  msr0 = _inference_msr(backbone, state.trainable["router"], batch)
  grad_norms = []
  for _ in range(tcfg.steps):
    state, m = train_step(state, backbone, batch, cfg=CFG, rcfg=RCFG, ocfg=ocfg, tcfg=tcfg)
    grad_norms.append(np.asarray(m["router_grad_norm_per_layer"]))
  msr1 = _inference_msr(backbone, state.trainable["router"], batch)
  code_rows, qa_rows = [0, 2], [1, 3]
  # Both start near the neutral 0.5; each moves to its own side.
  assert msr1[code_rows].mean() >= 0.85, (msr0, msr1)
  assert msr1[qa_rows].mean() <= 0.5, (msr0, msr1)
  lam1 = state.trainable["lambdas"]
  for t in (SINGLE_QA, CODE):  # present and violated: ascent increases them
    assert float(lam1["l1"][t]) > lam0["l1"][t] and float(lam1["l2"][t]) > lam0["l2"][t]
  absent = [i for i in range(len(TASK_TYPES)) if i not in (SINGLE_QA, CODE)]
  np.testing.assert_allclose(np.asarray(lam1["l1"])[absent], lam0["l1"][absent], atol=1e-6)
  # Router gradients reach every layer; the backbone is bit-identical.
  assert (np.stack(grad_norms).max(0) > 0).all()
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(backbone)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_optimizer_state_covers_only_routers_and_lambdas():
  tcfg = TrainConfig(steps=10)
  state = init_train_state(CFG, RCFG, tcfg, jax.random.key(0))
  n_trainable = sum(x.size for x in jax.tree.leaves(state.trainable))
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
  assert n_opt == 2 * n_trainable  # Adam's two moments of the trainables; none for the backbone
  assert n_opt < CFG.num_params()


def test_micro_batches_accumulate(backbone):
  """A leading micro-batch axis: one micro-batch is the plain step; two micro-batches of
  a task-sorted batch (each holding one task) report each task's MSR, not NaN, and the mean
  LM loss of the halves."""
  tcfg = TrainConfig(steps=10)
  ocfg = ObjectiveConfig()
  kw = dict(cfg=CFG, rcfg=RCFG, ocfg=ocfg, tcfg=tcfg)
  b = _batch()
  state = lambda: init_train_state(CFG, RCFG, tcfg, jax.random.key(3))
  s_plain, s_one = state(), state()
  for _ in range(2):  # the second step has a nonzero learning rate (warm-up starts at 0)
    s_plain, m_plain = train_step(s_plain, backbone, b, **kw)
    s_one, m_one = train_step(s_one, backbone, jax.tree.map(lambda x: x[None], b), **kw)
  for a, c in zip(jax.tree.leaves(s_plain.trainable), jax.tree.leaves(s_one.trainable)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(float(m_one["loss"]), float(m_plain["loss"]), rtol=1e-6)

  order = np.argsort(np.asarray(b["task_ids"])[:, 1], kind="stable")  # single_qa rows, code rows
  halves = jax.tree.map(lambda x: x[order].reshape(2, 2, *x.shape[1:]), b)
  _, m_two = train_step(state(), backbone, halves, **kw)
  assert float(m_two["task_count"][CODE]) == 2 and float(m_two["task_count"][SINGLE_QA]) == 2
  assert np.isfinite(float(m_two["msr_task"][CODE]))
  assert np.isfinite(float(m_two["msr_task"][SINGLE_QA]))
  assert np.isnan(float(m_two["msr_task"][TASK_TYPES.index("summarization")]))


def test_packed_train_step_runs_on_the_kernels_not_the_reference(backbone, monkeypatch):
  """train.packed (the paper's recipe, rows of several samples and padding) compiles a step
  whose attention is the kernels' pallas_calls and never the reference's chunk loop."""
  from elastic_jax.attention import reference as ref_module
  seg_row = np.r_[np.full(27, 1), np.full(29, 2), np.zeros(8)].astype(np.int32)   # 2 + pad
  pos_row = np.r_[np.arange(27), np.arange(29), np.zeros(8)].astype(np.int32)
  b = _batch()
  b = dict(b, segment_ids=jnp.asarray(np.tile(seg_row, (4, 1))),
           positions=jnp.asarray(np.tile(pos_row, (4, 1))),
           prompt_mask=jnp.asarray(np.tile((pos_row < 20) & (seg_row > 0), (4, 1))),
           loss_mask=jnp.asarray(np.tile((pos_row >= 20) & (seg_row > 0), (4, 1))),
           task_ids=jnp.asarray(np.tile([-1, SINGLE_QA, CODE], (4, 1)).astype(np.int32)))
  tcfg = TrainConfig(steps=10, packed=True)
  kw = dict(cfg=CFG, rcfg=RCFG, ocfg=ObjectiveConfig(), tcfg=tcfg)
  state = lambda: init_train_state(CFG, RCFG, tcfg, jax.random.key(2))   # steps donate it
  calls = []
  real = ref_module._attend
  monkeypatch.setattr(ref_module, "_attend", lambda *a, **k: calls.append(1) or real(*a, **k))
  jaxpr = str(jax.make_jaxpr(lambda s, x: train_step(
      s, backbone, x, attn_impl="pallas_gpu:interpret", **kw))(state(), b))
  assert "pallas_call" in jaxpr and "elastic_packed_forward_train" in jaxpr
  assert "elastic_packed_dkv" in jaxpr and not calls
  # The TPU kernels, traced only (as a TPU would compile them: Pallas TPU's interpret mode
  # carries state that flax's scan over layers refuses).
  jaxpr = str(jax.make_jaxpr(lambda s, x: train_step(
      s, backbone, x, attn_impl="pallas_tpu", **kw))(state(), b))
  assert "elastic_packed_forward_train_tpu" in jaxpr and "elastic_packed_backward_dkv_tpu" in jaxpr
  assert not calls
  # The step runs there (its values against the reference: tests/test_packed_kernels.py).
  _, m_kernel = train_step(state(), backbone, b, attn_impl="pallas_gpu:interpret", **kw)
  assert np.isfinite(float(m_kernel["loss"])) and not calls
  jax.make_jaxpr(lambda s, x: train_step(s, backbone, x, attn_impl="reference", **kw))(
      state(), b)
  assert calls                                        # the reference path does call it


def test_padded_batches_run_on_the_kernels(backbone, monkeypatch):
  """Left and right padding (attention masks, as batched evaluation makes them): the routed
  forward with mixed forced gates and the plain backbone (`full`) run on the packed kernels,
  never the reference, and give the reference's logits on the real tokens."""
  from elastic_jax.attention import reference as ref_module
  from elastic_jax.model import positions_and_segments
  rng = np.random.default_rng(5)
  ids = jnp.asarray(rng.integers(0, 64, (2, 40)).astype(np.int32))
  mask = np.ones((2, 40), np.int32)
  mask[0, :7] = 0                                    # left padding
  mask[1, 35:] = 0                                   # right padding
  pos, seg = positions_and_segments(mask)
  g = np.zeros((CFG.num_layers, 2, 2, CFG.num_kv_heads), np.float32)
  g[:, :, 1, ::2] = 1.0                              # half the heads full, half streaming
  run = lambda impl: forward_routed_jit(
      backbone, ids, pos, seg, jnp.asarray(mask > 0), cfg=CFG, rcfg=RCFG, attention="forced",
      forced_gates=jnp.asarray(g), attn_impl=impl, packed=True, num_segments=2)[0]
  real = mask > 0
  want = np.asarray(run("reference"))[real]
  want_full = np.asarray(forward(backbone, ids, pos, seg, cfg=CFG, attn_impl="reference"))[real]
  calls = []
  real_attend = ref_module._attend
  monkeypatch.setattr(ref_module, "_attend",
                      lambda *a, **k: calls.append(1) or real_attend(*a, **k))
  got = np.asarray(run("pallas_gpu:interpret"))[real]
  got_full = np.asarray(forward(backbone, ids, pos, seg, cfg=CFG,
                                attn_impl="pallas_gpu:interpret"))[real]
  assert not calls
  np.testing.assert_allclose(got, want, atol=2e-4)
  np.testing.assert_allclose(got_full, want_full, atol=2e-4)
