"""The evaluation loop: generate for every item under every way of attending, resumably.

The ways (heads.ATTENTION): full (the unmodified backbone, dense cache), elastic (the routers
decide per input; needs routers), sparse (every head on the sparse side), most-chosen (one
fixed head set for every input, at the average MSR elastic reached on the same items: the
(layer, KV head) pairs elastic sent to full attention most often stay full; a
DuoAttention-style static baseline, run after elastic), static-gate (a trained static
router's head set, `--static-routers`: its pairs ranked by their logit margin, as many full as
elastic's average; the input-independent baseline trained by the same objective). Records
written under the old name `static` are read as most-chosen.

Each finished item is appended to `predictions.jsonl` in the output directory at once, so an
interrupted run resumes where it stopped: items already there are not generated again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation.generate import SamplingConfig, generate
from elastic_jax.files import append_whole, repair_jsonl_tail, write_error
from elastic_jax.heads import canonical

# most-chosen and static-gate take elastic's average MSR, so they come after it
ORDER = ("full", "elastic", "sparse", "most-chosen", "static-gate")
AFTER_ELASTIC = ("most-chosen", "static-gate")


@dataclasses.dataclass(frozen=True)
class Item:
  """One prompt to answer: `key` is unique within its benchmark run."""
  key: str
  task: str
  prompt_ids: tuple[int, ...]
  max_new_tokens: int
  stop_ids: tuple[int, ...] = ()
  meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)


def read_predictions(path: str) -> dict[tuple[str, str], dict]:
  """{(attention, key): line} of a predictions file; a torn last line (a run killed while
  writing) is dropped, any other unreadable line is an error."""
  out: dict[tuple[str, str], dict] = {}
  if not os.path.exists(path):
    return out
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  for i, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
      rec["attention"] = canonical(rec["attention"], warn=False)
      out[(rec["attention"], rec["key"])] = rec
    except (json.JSONDecodeError, KeyError, TypeError):
      if i >= len(lines) - 1:          # the last line, cut short
        continue
      raise ElasticJaxError(f"{path}, line {i}: not a prediction record; move the file away "
                            "to start over") from None
  return out


def ranked_gates(scores_lk, elastic_records: Sequence[dict]) -> np.ndarray:
  """[L, K] gates keeping full the highest-scoring (layer, KV head) pairs, as many as
  elastic's average share of full pairs over these records (ties: the first pair); scores
  None: the pairs elastic chose most often (most-chosen)."""
  freq = np.mean([np.asarray(r["gates"], np.float32) for r in elastic_records], axis=0)
  scores = freq if scores_lk is None else np.asarray(scores_lk, np.float32)
  n_full = int(round(freq.mean() * freq.size))
  gates = np.zeros(freq.size, np.float32)
  gates[np.argsort(-scores.reshape(-1), kind="stable")[:n_full]] = 1.0
  return gates.reshape(freq.shape)


def check_attention_list(attention: Sequence[str], router_params,
                         static_margin=None) -> list[str]:
  """The ways to evaluate under their current names, each known; elastic, most-chosen and
  static-gate only with routers, static-gate only with a static router's margins."""
  attention = [canonical(a) for a in attention]
  for a in attention:
    if a not in ORDER:
      raise ElasticJaxError(f"attention '{a}' is not evaluated (known: {', '.join(ORDER)})")
  if {"elastic", *AFTER_ELASTIC} & set(attention) and router_params is None:
    raise ElasticJaxError("elastic, most-chosen and static-gate attention need trained "
                          "routers (--routers)")
  if "static-gate" in attention and static_margin is None:
    raise ElasticJaxError("static-gate attention needs a trained static router "
                          "(--static-routers)")
  return attention


def run(model, tokenizer, items: Sequence[Item], attention: Sequence[str], out_dir: str, *,
        batch_size: int = 1, attn_impl: str = "auto", static_margin=None, log=print) -> dict:
  """Generates every (attention, item) not yet in `out_dir/predictions.jsonl` with `model`
  (and its routers); returns all records of the file for these items, {(attention, key):
  record}. static_margin: [L, K] a static router's ranking (router.static_margin), for
  static-gate."""
  router_params = model.router_params
  attention = check_attention_list(attention, router_params, static_margin)
  if batch_size < 1:
    raise ElasticJaxError(f"batch size must be >= 1, got {batch_size}")
  path = os.path.join(out_dir, "predictions.jsonl")
  try:
    os.makedirs(out_dir, exist_ok=True)
    if repair_jsonl_tail(path):
      log(f"{path}: dropped a torn last line (a run stopped while writing it)")
    with open(path, "ab", buffering=0) as f:
      return _run(model, tokenizer, items, attention, path, f, batch_size, attn_impl,
                  static_margin, log)
  except OSError as e:
    error = write_error(path, e, "; the predictions written before are kept, and a rerun goes "
                                 "on from them")
    if error is None:
      raise
    raise error from None


def _run(model, tokenizer, items, attention, path, f, batch_size, attn_impl, static_margin,
         log) -> dict:
  router_params = model.router_params
  done = read_predictions(path)
  eos = () if tokenizer.eos_token_id is None else tuple(
      int(x) for x in np.atleast_1d(tokenizer.eos_token_id))
  order = [s for s in ORDER if s in attention]
  after = [s for s in order if s in AFTER_ELASTIC]
  if after and "elastic" not in order:
    order.insert(order.index(after[0]), "elastic")   # they take elastic's average MSR
  for way in order:
    gates = None
    if way in AFTER_ELASTIC:
      gates = ranked_gates(static_margin if way == "static-gate" else None,
                           [done[("elastic", it.key)] for it in items])
    todo = [it for it in items if (way, it.key) not in done]
    if not todo:
      continue
    log(f"{way}: {len(todo)} of {len(items)} items to generate")
    groups: dict[tuple, list[Item]] = {}
    for it in todo:
      groups.setdefault((it.max_new_tokens, it.stop_ids), []).append(it)
    # A failure closes the bar first, so that its one-line error starts on a line of its own.
    with tqdm(total=len(todo), desc=way, unit="item", file=sys.stderr,
              dynamic_ncols=True) as bar:
      for (max_new, stop_ids), group in groups.items():
        for start in range(0, len(group), batch_size):
          batch = group[start:start + batch_size]
          gen = generate(model.params, model.config, [list(it.prompt_ids) for it in batch],
                         attention="forced" if way in AFTER_ELASTIC else way,
                         rcfg=model.router_config, router_params=router_params,
                         gates=gates, sampling=SamplingConfig(max_new_tokens=max_new),
                         eos_ids=eos + stop_ids, attn_impl=attn_impl)
          for i, it in enumerate(batch):
            toks = [t for t in gen.tokens[i] if t not in eos + stop_ids]
            rec = {"attention": way, "key": it.key, "task": it.task,
                   "prediction": tokenizer.decode(toks, skip_special_tokens=True),
                   "msr": float(gen.msr[i]),
                   "esr": float(gen.esr[i]), "gates": gen.gates[:, i].astype(int).tolist(),
                   "prompt_tokens": len(it.prompt_ids), "new_tokens": len(gen.tokens[i]),
                   "prefill_seconds": gen.prefill_seconds / len(batch),
                   "decode_seconds": gen.decode_seconds / len(batch),
                   "cache_bytes": gen.cache_bytes // len(batch),
                   "dense_cache_bytes": gen.dense_cache_bytes // len(batch),
                   "time": time.time()}
            append_whole(f, (json.dumps(rec) + "\n").encode("utf-8"))
            done[(way, it.key)] = rec
          bar.update(len(batch))
  keys = {it.key for it in items}
  return {k: v for k, v in done.items() if k[1] in keys and k[0] in order}
