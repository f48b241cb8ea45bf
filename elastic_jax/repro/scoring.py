"""Teacher-forced scoring of the task mixture under any way of attending, for the frontier.

An item is scored by one forward pass over `<bos> prompt answer <eos>`: it is right when the
argmax at every answer position is the answer's next token and, after the answer, EOS. That
is exactly when greedy generation (`eval.py mixture`, which stops at EOS and compares the
whole answer) produces the answer: the first wrong argmax would be generated, and every
position before it sees the same tokens either way. The routers read the prompt only (their
pooling masks the answer out), so a routed head keeps its mode over the answer, as in
decoding. One pass per item instead of a prefill and a decode loop makes the many
evaluations of the frontier (every method, budget and head set) cheap.

Shape letters: N items, B rows, T tokens, L layers, K KV heads, A scored positions per item.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.config import ModelConfig
from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval import mixture
from elastic_jax.model import forward_routed, output_head
from elastic_jax.router import RouterConfig

SCORED = 8           # scored positions per item: the longest answer plus its EOS must fit


@dataclasses.dataclass(frozen=True)
class EvalItem:
  key: str              # task/variant/length/index, as eval.py mixture names it
  task: str
  variant: str
  prompt: np.ndarray    # <bos> context question
  answer: np.ndarray    # the answer's tokens (EOS not included)


def eval_items(seed: int, n: int, tasks: Sequence[str] = mixture.TASKS,
               lengths: Sequence[int] = (384,), heldout_lengths: Sequence[int] = (896,),
               *, wordings: str = "templates", evidence: str = "far") -> list[EvalItem]:
  """The items `eval.py mixture --seed S --samples n` evaluates (mixture.eval_samples; with
  wordings / evidence, its checks on other items)."""
  out = []
  for key, variant, s in mixture.eval_samples(seed, n, tasks, lengths, heldout_lengths,
                                              wordings=wordings, evidence=evidence):
    prompt = np.concatenate([[mixture.BOS], s.context, s.question]).astype(np.int32)
    out.append(EvalItem(key, s.task, variant, prompt, np.asarray(s.answer, np.int32)))
  return out


def _rows(items: Sequence[EvalItem], t: int) -> dict[str, np.ndarray]:
  """One item per row, right-padded to t tokens: ids, positions, segment ids (1 = the item,
  0 = padding), prompt mask, and the A scored positions with their targets."""
  b = len(items)
  ids = np.zeros((b, t), np.int32)
  prompt = np.zeros((b, t), bool)
  at = np.zeros((b, SCORED), np.int32)
  target = np.zeros((b, SCORED), np.int32)
  scored = np.zeros((b, SCORED), bool)
  for i, it in enumerate(items):
    p = len(it.prompt)
    seq = np.concatenate([it.prompt, it.answer, [mixture.EOS]])
    ids[i, :len(seq)] = seq
    prompt[i, :p] = True
    n = len(it.answer) + 1
    if n > SCORED:
      raise ElasticJaxError(f"item {it.key}: an answer of {n - 1} tokens is longer than the "
                            f"scorer's {SCORED - 1}")
    at[i, :n] = np.arange(p - 1, p - 1 + n)      # the position that predicts each target
    target[i, :n] = seq[p:p + n]
    scored[i, :n] = True
  segment = (np.arange(t)[None] < np.array([len(it.prompt) + len(it.answer) + 1
                                            for it in items])[:, None]).astype(np.int32)
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
  return {"ids": ids, "positions": positions, "segment_ids": segment, "prompt_mask": prompt,
          "at": at, "target": target, "scored": scored}


@functools.partial(jax.jit, static_argnames=("cfg", "rcfg", "attention", "attn_impl"))
def _score_rows(params, router_params, gates_lbsk, rows, *, cfg: ModelConfig,
                rcfg: RouterConfig, attention: str, attn_impl: str):
  hidden, stats = forward_routed(
      params, rows["ids"], rows["positions"], rows["segment_ids"], rows["prompt_mask"],
      cfg=cfg, rcfg=rcfg, attention="sparse" if attention == "sparse" else
      ("elastic" if attention == "elastic" else "forced"),
      router_params=router_params, forced_gates=gates_lbsk, attn_impl=attn_impl,
      packed=True, num_segments=2, return_hidden=True)
  h_bae = jnp.take_along_axis(hidden, rows["at"][:, :, None], axis=1)
  logits = jnp.einsum("bae,ev->bav", h_bae, output_head(params, cfg),
                      preferred_element_type=jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(logp, rows["target"][..., None], axis=-1)[..., 0]
  hit = jnp.argmax(logits, axis=-1) == rows["target"]
  correct = jnp.all(hit | ~rows["scored"], axis=1)
  logp_item = jnp.sum(jnp.where(rows["scored"], picked, 0.0), axis=1)
  gate = stats["gate"][:, :, 1] if "gate" in stats else None            # [L, B, K]
  return correct, logp_item, gate


@functools.partial(jax.jit, static_argnames=("cfg", "rcfg", "attn_impl"))
def _pooled_rows(params, router_params, rows, *, cfg: ModelConfig, rcfg: RouterConfig,
                 attn_impl: str):
  _, stats = forward_routed(
      params, rows["ids"], rows["positions"], rows["segment_ids"], rows["prompt_mask"],
      cfg=cfg, rcfg=rcfg, attention="elastic", router_params=router_params,
      attn_impl=attn_impl, packed=True, num_segments=2)
  return stats["pooled"][:, :, 1]                                       # [L, B, K, H]


class Scorer:
  """Scores items under full, sparse, elastic (routers) or forced (head sets) attention.

  `rows`: rows per forward pass; every batch is padded to a multiple of `bucket` tokens and
  to `rows` rows, so that few programs are compiled.
  """

  def __init__(self, params, cfg: ModelConfig, rcfg: RouterConfig, *, attn_impl: str = "auto",
               rows: int = 64, bucket: int = 128):
    self.params, self.cfg, self.rcfg = params, cfg, rcfg
    self.attn_impl, self.rows, self.bucket = attn_impl, rows, bucket

  def score(self, items: Sequence[EvalItem], attention: str = "full", *, routers=None,
            gates=None) -> dict[str, np.ndarray]:
    """{"correct": [N] bool, "logp": [N] (log-probability of answer + EOS), "gates": [N, L, K]
    (1 = full), "msr": [N]}. attention: full, sparse, elastic (`routers`: the stacked router
    params, with this scorer's router config) or forced (`gates`: [L, K] for every item or
    [N, L, K] per item)."""
    cfg = self.cfg
    lk = (cfg.num_layers, cfg.num_kv_heads)
    if attention == "elastic" and routers is None:
      raise ElasticJaxError("elastic scoring needs the routers")
    if attention == "forced":
      g = np.asarray(gates, np.float32)
      if g.shape == lk:
        g = np.broadcast_to(g, (len(items), *lk))
      if g.shape != (len(items), *lk):
        raise ElasticJaxError(f"forced gates must have shape {lk} or {(len(items), *lk)}, "
                              f"got {g.shape}")
    elif attention == "full":
      attention, g = "forced", np.ones((len(items), *lk), np.float32)
    elif attention in ("sparse", "elastic"):
      g = None
    else:
      raise ElasticJaxError(f"attention '{attention}' is not scored (full, sparse, elastic, "
                            "forced)")
    n = len(items)
    correct = np.zeros(n, bool)
    logp = np.zeros(n, np.float32)
    out_gates = np.zeros((n, *lk), np.float32)
    # Batches of items of similar length: sorted by length, then cut.
    order = sorted(range(n), key=lambda i: len(items[i].prompt) + len(items[i].answer))
    for start in range(0, n, self.rows):
      idx = order[start:start + self.rows]
      part = [items[i] for i in idx]
      longest = max(len(it.prompt) + len(it.answer) + 1 for it in part)
      t = -(-longest // self.bucket) * self.bucket
      pad = self.rows - len(part)
      rows = _rows(part + [part[-1]] * pad, t)
      gates_lbsk = None
      if g is not None:
        gb = np.concatenate([g[idx], np.repeat(g[idx[-1:]], pad, axis=0)])   # [B, L, K]
        gb = np.moveaxis(gb, 0, 1)[:, :, None]                              # [L, B, 1, K]
        gates_lbsk = jnp.asarray(np.concatenate([np.zeros_like(gb), gb], axis=2))
      c, lp, gate = _score_rows(self.params, routers, gates_lbsk,
                                {k: jnp.asarray(v) for k, v in rows.items()}, cfg=cfg,
                                rcfg=self.rcfg, attention=attention, attn_impl=self.attn_impl)
      keep = len(part)
      correct[idx] = np.asarray(c)[:keep]
      logp[idx] = np.asarray(lp)[:keep]
      if gate is not None:
        out_gates[idx] = np.moveaxis(np.asarray(gate), 1, 0)[:keep]
    if attention == "sparse":
      out_gates[:] = 0.0
    return {"correct": correct, "logp": logp, "gates": out_gates,
            "msr": 1.0 - out_gates.mean(axis=(1, 2))}


def pooled_keys(scorer: "Scorer", items: Sequence[EvalItem], routers) -> np.ndarray:
  """The routers' inputs under elastic routing: each item's pooled prompt keys, [N, L, K, H]
  (the boundary pooling of the scorer's router config)."""
  out = np.zeros((len(items), scorer.cfg.num_layers, scorer.cfg.num_kv_heads,
                  scorer.cfg.head_dim), np.float32)
  for start in range(0, len(items), scorer.rows):
    part = list(items[start:start + scorer.rows])
    longest = max(len(it.prompt) + len(it.answer) + 1 for it in part)
    t = -(-longest // scorer.bucket) * scorer.bucket
    pad = scorer.rows - len(part)
    rows = _rows(part + [part[-1]] * pad, t)
    got = _pooled_rows(scorer.params, routers, {k: jnp.asarray(v) for k, v in rows.items()},
                       cfg=scorer.cfg, rcfg=scorer.rcfg, attn_impl=scorer.attn_impl)
    out[start:start + len(part)] = np.moveaxis(np.asarray(got), 1, 0)[:len(part)]
  return out


def static_at(scores_lk: np.ndarray, msr: float, n_items: int, seed: int = 0) -> np.ndarray:
  """[n_items, L, K] gates of a static policy at exactly average MSR `msr` (to one item's
  share): the n or n + 1 pairs of highest score full, n = floor((1 - msr) L K), the n + 1
  set on round(frac x n_items) items drawn at random, independently of what the items hold.
  Every input of the policy gets one of two fixed head sets, so it stays input-independent,
  while its average MSR equals elastic's instead of the nearest whole number of heads."""
  scores = np.asarray(scores_lk, np.float64)
  want = (1.0 - msr) * scores.size
  n = int(np.floor(want + 1e-9))
  order = np.argsort(-scores.reshape(-1), kind="stable")
  small = np.zeros(scores.size, np.float32)
  small[order[:n]] = 1.0
  big = small.copy()
  big[order[min(n, scores.size - 1)]] = 1.0
  k = int(round((want - n) * n_items))
  pick = np.zeros(n_items, bool)
  pick[np.random.default_rng(seed).permutation(n_items)[:k]] = True
  return np.where(pick[:, None], big[None], small[None]).reshape(n_items, *scores.shape)


def minimal_head_set(scorer: Scorer, items: Sequence[EvalItem], *, tolerance: float = 0.02,
                     stop_at: int = 0, log=None) -> dict:
  """Greedy backward ablation over (layer, KV head) pairs: starting from every head full,
  remove at each step the head whose loss costs the least (highest accuracy over `items`,
  then highest answer log-probability) while accuracy stays within `tolerance` of full
  attention's, or, with stop_at > 0, until that many heads are left whatever the accuracy.
  Returns {"gates": [L, K] of the last set kept, "full": accuracy with every head full,
  "sparse": with none, "path": [(layer, head, accuracy, mean logp) per removal]}."""
  cfg = scorer.cfg
  lk = (cfg.num_layers, cfg.num_kv_heads)
  full = scorer.score(items, "full")
  sparse = scorer.score(items, "sparse")
  base = float(full["correct"].mean())
  current = np.ones(lk, np.float32)
  path = []
  if stop_at == 0 and sparse["correct"].mean() >= base - tolerance:
    current[:] = 0.0           # every head streaming already keeps the accuracy
    path = [(-1, -1, float(sparse["correct"].mean()), float(sparse["logp"].mean()))]
  while current.sum() > stop_at and (stop_at or current.any()):
    cand = np.argwhere(current > 0)
    gates = np.repeat(current[None], len(cand), axis=0)
    gates[np.arange(len(cand)), cand[:, 0], cand[:, 1]] = 0.0
    tiled = [it for _ in cand for it in items]
    res = scorer.score(tiled, "forced", gates=np.repeat(gates, len(items), axis=0))
    acc = res["correct"].reshape(len(cand), len(items)).mean(1)
    lp = res["logp"].reshape(len(cand), len(items)).mean(1)
    best = int(np.lexsort((-lp, -acc))[0])
    if not stop_at and acc[best] < base - tolerance:
      break
    layer, head = (int(x) for x in cand[best])
    current[layer, head] = 0.0
    path.append((layer, head, float(acc[best]), float(lp[best])))
    if log:
      log(f"  removed ({layer}, {head}): {int(current.sum())} full, accuracy "
          f"{100 * acc[best]:.1f}% (full {100 * base:.1f}%)")
  return {"gates": current, "full": base, "sparse": float(sparse["correct"].mean()),
          "path": path}
