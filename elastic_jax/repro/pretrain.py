"""Pretrains the small backbone of the reproduction on the task mixture, full attention.

  python -m elastic_jax.repro.pretrain --out runs/backbone --total-steps 24000 \\
      [--piece-seconds 540] [--resume]

Each step is one batch of --tokens tokens: a row length T is drawn from 128 and the multiples of 256
up to the step's longest row (--short-seq-len before step --long-from, --seq-len from there:
a length curriculum), with p ~ T^-0.25, and T-token rows each hold one sample, right-padded
(one input per row, so full attention runs on cuDNN on a GPU). A sample is `<bos> context
question answer <eos>`; kv and hop go on asking about every fact of their context (`question
answer <eos>` each, as many as the row holds), with 2..min(48, prompt/24) facts drawn
independently of the length, in wordings from `mixture.pretraining_wording` (half fixed, half
random words; never the held-out template's unless --heldout-in-pretraining); --tasks
names the tasks the rows hold (the five by default; RULER's families of eval/families.py
too), each also evaluated. --copy-fraction of the rows are the auxiliary copy task
(`mixture.copy_sample`). The loss is the cross-entropy of the answer
tokens, plus --eos-weight times that of the answers' EOS, plus --lm-weight times that of every
other token. AdamW in float32, computed in bfloat16; the learning rate warms up over --warmup
steps, holds, and decays linearly to --min-lr over the last --decay of --total-steps.

The run stops after the first step past --piece-seconds (or at --total-steps) and saves its state in
OUT/state (float32 weights, the optimizer's moments in bfloat16, safetensors shards under 16
MiB); `--resume` continues from there. The data of step s depends on (seed, s) alone, so a
resumed run sees the batches an unbroken one would. Every --eval-every steps, and at the end
of each piece: teacher-forced exact match per task, variant (seen templates 0-1, held-out
template 2) and prompt length, with chance (one over the candidates in the context) beside
it, and an all-streaming row (every head sink + local, --sparse-window tokens) that the
sensitive tasks must fail. At --total-steps the backbone goes to OUT/hf (Hugging Face layout,
float32 safetensors, the mixture's tokenizer, pretrain.json and pretrain_metrics.jsonl).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import multiprocessing
import os
import shutil
import sys
import time

import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval import mixture

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "backbone_config.json")
# Row tasks: every task of the mixture (the five and the families) and the auxiliary copy;
# a run draws its rows from --tasks and the copy task.
TASKS = mixture.ALL_TASKS + ("copy",)
DEFAULT_TASKS = ",".join(mixture.TASKS)
CONTEXT, ANSWER, ANSWER_EOS = 1, 2, 3      # token kinds (0: padding)
SHARD_BYTES = 15 * 2 ** 20                 # state shards stay under 16 MiB


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="run directory (state, metrics, hf/)")
  p.add_argument("--config", default=DEFAULT_CONFIG, help="HF config JSON of the backbone")
  p.add_argument("--total-steps", type=int, default=24000, help="the schedule's length")
  p.add_argument("--piece-seconds", type=float, default=None,
                 help="stop after this many seconds of training and save the state")
  p.add_argument("--resume", action="store_true", help="continue the run saved in OUT/state")
  p.add_argument("--tokens", type=int, default=32768, help="tokens per step (rows x T)")
  p.add_argument("--seq-len", type=int, default=2048, help="longest row (a multiple of 128)")
  p.add_argument("--short-seq-len", type=int, default=1024,
                 help="longest row before --long-from")
  p.add_argument("--long-from", type=int, default=3000,
                 help="the step from which rows go up to --seq-len")
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--min-lr", type=float, default=2e-4)
  p.add_argument("--warmup", type=int, default=300)
  p.add_argument("--decay", type=float, default=0.2, help="fraction of the steps decaying")
  p.add_argument("--weight-decay", type=float, default=0.01)
  p.add_argument("--lm-weight", type=float, default=0.02,
                 help="loss weight of the tokens that are not answers")
  p.add_argument("--eos-weight", type=float, default=0.2, help="loss weight of answers' EOS")
  p.add_argument("--copy-fraction", type=float, default=0.2,
                 help="rows of the auxiliary copy task")
  p.add_argument("--tasks", default=DEFAULT_TASKS,
                 help="the mixture's tasks the rows hold (also eval/families.py's mv, mq, vt, "
                      "cwe), comma-separated; every one is also evaluated")
  p.add_argument("--heldout-in-pretraining", action="store_true",
                 help="let the held-out template's wording into pretraining (the held-out "
                      "variant is then unseen by the routers only)")
  p.add_argument("--attn-impl", default="auto", help="attention (auto: cuDNN on a GPU)")
  p.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                 help="forward/backward dtype (float32 on CPUs, where bfloat16 is slow)")
  p.add_argument("--eval-every", type=int, default=1000)
  p.add_argument("--eval-samples", type=int, default=64, help="per task, variant and length")
  p.add_argument("--eval-lengths", default="384,896,1536", help="prompt lengths evaluated")
  p.add_argument("--sparse-window", default="16,1,4",
                 help="block,sink_blocks,local_blocks of the all-streaming check row")
  p.add_argument("--log-every", type=int, default=100)
  p.add_argument("--workers", type=int, default=4,
                 help="processes making batches (0: the training thread makes them)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  for name in ("total_steps", "tokens", "eval_every", "eval_samples", "log_every"):
    if getattr(args, name) < 1:
      raise ElasticJaxError(f"--{name.replace('_', '-')} must be at least 1")
  if not (args.lr > 0 and 0 <= args.min_lr <= args.lr):
    raise ElasticJaxError("--lr must be > 0 and --min-lr in [0, --lr]")
  if not (0 <= args.decay <= 1 and 0 <= args.copy_fraction < 1 and args.long_from >= 0):
    raise ElasticJaxError("--decay must lie in [0, 1], --copy-fraction in [0, 1) and "
                          "--long-from be >= 0")
  args.tasks = mixture.parse_tasks(args.tasks)
  for name in ("seq_len", "short_seq_len"):
    if getattr(args, name) % 128 or getattr(args, name) < 128:
      raise ElasticJaxError(f"--{name.replace('_', '-')} must be a multiple of 128")
  try:
    args.eval_lengths = tuple(int(x) for x in args.eval_lengths.split(","))
    args.sparse_window = tuple(int(x) for x in args.sparse_window.split(","))
  except ValueError:
    raise ElasticJaxError("--eval-lengths and --sparse-window are comma-separated whole "
                          "numbers") from None
  if len(args.sparse_window) != 3 or min(args.sparse_window) < 1 or min(args.eval_lengths) < 128:
    raise ElasticJaxError("--sparse-window is block,sink_blocks,local_blocks (each >= 1) and "
                          "every --eval-lengths value at least 128")
  return args


# ----------------------------------------------------------------------------------------------
# Data


def sample_tokens(s: mixture.Sample, limit: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, kind) of one pretraining sample, at most `limit` tokens: the context, then
  questions with their answers and EOS while they fit (at least the first, truncated if it
  must be)."""
  parts = [np.array([mixture.BOS], np.int32), s.context]
  kinds = [CONTEXT, CONTEXT]
  used = 1 + len(s.context)
  for i, (q, a) in enumerate(((s.question, s.answer), *s.extra)):
    need = len(q) + len(a) + 1
    if i and used + need > limit:
      break
    parts += [q, a, np.array([mixture.EOS], np.int32)]
    kinds += [CONTEXT, ANSWER, ANSWER_EOS]
    used += need
  tokens = np.concatenate(parts)[:limit]
  kind = np.concatenate([np.full(len(x), k, np.int8) for x, k in zip(parts, kinds)])[:limit]
  return tokens, kind


def pretraining_sample(rng: np.random.Generator, t: int, copy_fraction: float,
                       heldout: bool = False, tasks: tuple[str, ...] = mixture.TASKS):
  """(task index in TASKS, sample) for one row of t tokens, its task drawn from `tasks`."""
  length = int(rng.integers(t // 2, t - 63))
  if rng.random() < copy_fraction:
    return len(TASKS) - 1, mixture.copy_sample(rng, length)
  name = tasks[int(rng.integers(len(tasks)))]
  n_facts = None
  if name in mixture.SENSITIVE:
    n_facts = int(rng.integers(2, max(2, min(48, length // 24)) + 1))
  s = mixture.make_sample(name, rng, length, -1, extra_queries=64,
                          wording=mixture.pretraining_wording(name, rng, heldout),
                          n_facts=n_facts,
                          filler=mixture.PRETRAIN_FILLER)
  return TASKS.index(name), s


def rows_of(samples: list, t: int) -> dict[str, np.ndarray]:
  """Right-padded rows of t tokens, one sample each: ids, targets (next token), kind of the
  target (CONTEXT/ANSWER/ANSWER_EOS, 0 for none), positions, segment ids, task."""
  n = len(samples)
  ids = np.zeros((n, t), np.int32)
  kind = np.zeros((n, t), np.int8)
  for b, (_, s) in enumerate(samples):
    tok, k = sample_tokens(s, t)
    ids[b, :len(tok)], kind[b, :len(tok)] = tok, k
  targets = np.zeros_like(ids)
  targets[:, :-1] = ids[:, 1:]
  target_kind = np.zeros_like(kind)
  target_kind[:, :-1] = kind[:, 1:]     # predict token i+1 at i
  return {"ids": ids, "targets": targets, "kind": target_kind,
          "positions": np.broadcast_to(np.arange(t, dtype=np.int32), ids.shape).copy(),
          "segment_ids": (kind > 0).astype(np.int32),
          "task": np.array([task for task, _ in samples], np.int32)}


def row_length(rng: np.random.Generator, longest: int) -> int:
  """A row length: 128 or a multiple of 256 up to `longest` (few shapes, few compilations),
  p ~ T^-0.25 (short rows more often, fewer tokens in all)."""
  lengths = np.array([128] + list(range(256, longest + 1, 256)))
  p = lengths ** -0.25
  return int(rng.choice(lengths, p=p / p.sum()))


def longest_row(step: int, args) -> int:
  return args.seq_len if step >= args.long_from else args.short_seq_len


def make_batch(spec: tuple, step: int) -> dict[str, np.ndarray]:
  """The batch of `step`: a function of (seed, step) alone. spec: (seed, tokens, longest,
  copy_fraction, heldout, tasks)."""
  seed, tokens, longest, copy_fraction, heldout, tasks = spec
  rng = np.random.default_rng([seed, step])
  t = row_length(rng, longest)
  return rows_of([pretraining_sample(rng, t, copy_fraction, heldout, tasks)
                  for _ in range(max(1, tokens // t))], t)


class Batches:
  """Batches of steps start, start+1, ... made `depth` ahead by worker processes (or by the
  calling thread with workers=0), in order."""

  def __init__(self, args, start: int, workers: int, depth: int = 16):
    self._args, self._step = args, start
    self._pool = None
    self._pending: collections.deque = collections.deque()
    if workers:
      # The workers import this module by its name (also when it runs as __main__).
      from elastic_jax.repro import pretrain
      self._make = pretrain.make_batch
      self._pool = concurrent.futures.ProcessPoolExecutor(
          workers, mp_context=multiprocessing.get_context("spawn"))
      for _ in range(depth):
        self._submit()

  def _spec(self, step: int) -> tuple:
    a = self._args
    return (a.seed, a.tokens, longest_row(step, a), a.copy_fraction,
            a.heldout_in_pretraining, a.tasks)

  def _submit(self):
    s = self._step + len(self._pending)
    self._pending.append(self._pool.submit(self._make, self._spec(s), s))

  def get(self) -> dict[str, np.ndarray]:
    step = self._step
    self._step += 1
    if self._pool is None:
      return make_batch(self._spec(step), step)
    batch = self._pending.popleft().result()
    self._submit()
    return batch

  def close(self):
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------------------------
# Evaluation


def eval_set(seed: int, lengths: tuple[int, ...], n: int,
             tasks: tuple[str, ...] = mixture.TASKS) -> list[dict]:
  """Fixed evaluation cells: every task x variant (seen: templates 0 and 1, held-out:
  template 2) x prompt length, n samples each, drawn as eval.py mixture draws them. Each cell
  is {task, variant, length, chance, batch}."""
  cells = []
  variants = (("seen", mixture.TRAIN_TEMPLATES), ("held-out", (mixture.HELDOUT_TEMPLATE,)))
  for ti, task in enumerate(tasks):
    for vi, (variant, templates) in enumerate(variants):
      for length in lengths:
        rng = np.random.default_rng([seed, 7919, ti, vi, length])
        samples = [(TASKS.index(task),
                    mixture.make_sample(task, rng, length, templates[i % len(templates)]))
                   for i in range(n)]
        chance = np.mean([1 / s.candidates if s.candidates else 0.0 for _, s in samples])
        t = -(-max(s.prompt_len + len(s.answer) + 2 for _, s in samples) // 128) * 128
        cells.append({"task": task, "variant": variant, "length": length,
                      "chance": float(chance), "batch": rows_of(samples, t)})
  return cells


def exact_match(pred: np.ndarray, batch: dict) -> np.ndarray:
  """Per row: every answer token and its EOS argmax-correct."""
  scored = batch["kind"] >= ANSWER
  return np.where(scored, pred == batch["targets"], True).all(axis=1)


def evaluate(predict, params, cells, sparse_predict=None, rows: int = 32) -> dict:
  """{"task/variant/length": accuracy, ...} and, with sparse_predict, the all-streaming row
  {"sparse/task/length": accuracy} on the seen cells of the middle length."""
  import jax.numpy as jnp

  def run(fn, batch):
    hits = []
    for i in range(0, len(batch["ids"]), rows):
      part = {k: v[i:i + rows] for k, v in batch.items()}
      pred = np.asarray(fn(params, {k: jnp.asarray(v) for k, v in part.items()
                                    if k in ("ids", "positions", "segment_ids")}))
      hits.append(exact_match(pred, part))
    return float(np.concatenate(hits).mean())

  out, chance = {}, {}
  lengths = sorted({c["length"] for c in cells})
  for c in cells:
    key = f"{c['task']}/{c['variant']}/{c['length']}"
    out[key], chance[key] = run(predict, c["batch"]), c["chance"]
    if sparse_predict is not None and c["variant"] == "seen" and \
        c["length"] == lengths[len(lengths) // 2]:
      out[f"sparse/{c['task']}/{c['length']}"] = run(sparse_predict, c["batch"])
  return {"accuracy": out, "chance": chance}


def eval_table(result: dict) -> str:
  """Accuracy (chance) per task, rows = variant/length."""
  acc, chance = result["accuracy"], result["chance"]
  cols = [t for t in TASKS if any(k.startswith(f"{t}/") for k in acc)]
  rows = sorted({k.split("/", 1)[1] for k in acc if not k.startswith("sparse/")},
                key=lambda r: (r.split("/")[0] != "seen", int(r.split("/")[1])))
  lines = ["  " + " " * 16 + "".join(f"{c:>14}" for c in cols)]
  for r in rows:
    cells = []
    for c in cols:
      k = f"{c}/{r}"
      cells.append(f"{100 * acc[k]:6.1f} ({100 * chance[k]:4.1f})" if chance[k]
                   else f"{100 * acc[k]:6.1f}       ")
    lines.append(f"  {r:<16}" + "".join(f"{x:>14}" for x in cells))
  sparse = {k.split("/")[1]: v for k, v in acc.items() if k.startswith("sparse/")}
  if sparse:
    length = next(k for k in acc if k.startswith("sparse/")).split("/")[2]
    lines.append(f"  {'all streaming/' + length:<16}" +
                 "".join(f"{100 * sparse[c]:>6.1f}        " for c in cols))
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Training


def step_functions(cfg, compute, attn_impl: str, tx, args):
  """(train_step(params, opt, batch, lr) -> (params, opt, metrics), predict(params, batch)),
  jitted. The loss: answers + eos_weight x their EOS + lm_weight x the other tokens, each a
  mean over its tokens; metrics carry the answer loss per row task."""
  import jax
  import jax.numpy as jnp
  import optax
  from elastic_jax.model import transformer
  module = transformer(cfg, compute, attn_impl, False, packed=False)

  def logits_fn(p, b):
    pc = jax.tree.map(lambda x: x.astype(compute), p)
    logits, _ = module.apply({"params": pc}, b["ids"], b["positions"], b["segment_ids"])
    return logits

  def loss_fn(p, b):
    logp = jax.nn.log_softmax(logits_fn(p, b), axis=-1)
    nll = -jnp.take_along_axis(logp, b["targets"][..., None], axis=-1)[..., 0]

    def mean(mask):
      m = mask.astype(jnp.float32)
      return jnp.sum(nll * m) / jnp.maximum(m.sum(), 1.0)
    ans = b["kind"] == ANSWER
    ans_loss, eos_loss, lm_loss = mean(ans), mean(b["kind"] == ANSWER_EOS), \
        mean(b["kind"] == CONTEXT)
    row_sum = jnp.sum(nll * ans, axis=1)
    row_n = jnp.sum(ans, axis=1).astype(jnp.float32)
    per_task = (jax.ops.segment_sum(row_sum, b["task"], len(TASKS)) /
                jnp.maximum(jax.ops.segment_sum(row_n, b["task"], len(TASKS)), 1.0))
    present = jax.ops.segment_sum(row_n, b["task"], len(TASKS)) > 0
    loss = ans_loss + args.eos_weight * eos_loss + args.lm_weight * lm_loss
    return loss, {"answer_loss": ans_loss, "eos_loss": eos_loss, "lm_loss": lm_loss,
                  "task_loss": jnp.where(present, per_task, jnp.nan)}

  @jax.jit
  def train_step(params, opt, b, lr):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, b)
    updates, opt = tx.update(grads, opt, params)
    updates = jax.tree.map(lambda u: lr * u, updates)
    return (optax.apply_updates(params, updates), opt,
            {"loss": loss, **aux, "grad_norm": optax.global_norm(grads)})

  @jax.jit
  def predict(params, b):
    return jnp.argmax(logits_fn(params, b), axis=-1)
  return train_step, predict


def sparse_predictor(cfg, compute, window: tuple[int, int, int]):
  """predict(params, batch) with every head streaming (sink + local blocks), the check that
  the sensitive tasks need the far context."""
  import jax
  import jax.numpy as jnp
  from elastic_jax.model import forward_routed
  from elastic_jax.router import RouterConfig
  block, sink, local = window
  rcfg = RouterConfig(block=block, sink_blocks=sink, local_blocks=local, boundary=8)

  @jax.jit
  def predict(params, b):
    pc = jax.tree.map(lambda x: x.astype(compute), params)
    logits, _ = forward_routed(pc, b["ids"], b["positions"], b["segment_ids"],
                               b["segment_ids"] > 0, cfg=cfg, rcfg=rcfg, attention="sparse")
    return jnp.argmax(logits, axis=-1)
  return predict


def learning_rate_at(step: int, args) -> float:
  """Warm-up, stable, decay: linear warm-up over --warmup steps, --lr, then a linear decay to
  --min-lr over the last --decay of --total-steps."""
  if step < args.warmup:
    return args.lr * (step + 1) / args.warmup
  decay_from = args.total_steps * (1 - args.decay)
  if step < decay_from:
    return args.lr
  frac = min(1.0, (step - decay_from) / max(1.0, args.total_steps - decay_from))
  return args.lr + (args.min_lr - args.lr) * frac


def optimizer(args):
  import optax
  # AdamW with unit step size; the schedule's value scales the update (an argument of the
  # jitted step).
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=args.weight_decay))


# ----------------------------------------------------------------------------------------------
# State: resumable pieces


def _named_leaves(tree) -> dict[str, object]:
  import jax
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _write_shards(tensors: dict[str, np.ndarray], directory: str, prefix: str) -> list[str]:
  from safetensors.numpy import save_file
  shards: list[dict] = [{}]
  size = 0
  for name, x in tensors.items():
    if shards[-1] and size + x.nbytes > SHARD_BYTES:
      shards.append({})
      size = 0
    shards[-1][name] = np.ascontiguousarray(x)
    size += x.nbytes
  files = []
  for i, shard in enumerate(shards):
    files.append(f"{prefix}-{i + 1:02d}-of-{len(shards):02d}.safetensors")
    save_file(shard, os.path.join(directory, files[-1]))
  return files


def save_state(out: str, params, opt, info: dict) -> str:
  """OUT/state: the float32 weights, the optimizer state (moments in bfloat16) and
  state.json, written to a temporary folder and renamed into place."""
  import jax
  import ml_dtypes
  from elastic_jax.files import atomic_directory
  host_params = {k: np.asarray(v, np.float32) for k, v in _named_leaves(
      jax.device_get(params)).items()}
  host_opt = {}
  for k, v in _named_leaves(jax.device_get(opt)).items():
    v = np.asarray(v)
    host_opt[k] = v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 and v.ndim else v
  target = os.path.join(out, "state")
  with atomic_directory(target, overwrite=True) as tmp:
    files = _write_shards(host_params, tmp, "params") + _write_shards(host_opt, tmp, "optimizer")
    with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
      json.dump({**info, "files": files}, f, indent=1)
  return target


def load_state(out: str, params, opt):
  """(params, opt, info) from OUT/state, into the structure of the given trees; refuses a
  state whose tensors or shapes differ."""
  import jax
  import jax.numpy as jnp
  from safetensors.numpy import load_file
  directory = os.path.join(out, "state")
  try:
    with open(os.path.join(directory, "state.json"), encoding="utf-8") as f:
      info = json.load(f)
    tensors = {}
    for name in info["files"]:
      tensors.update(load_file(os.path.join(directory, name)))
  except (OSError, ValueError, KeyError) as e:
    raise ElasticJaxError(f"{directory}: no readable pretraining state to resume "
                          f"({type(e).__name__}: {e})") from None

  def fill(tree, prefix):
    names = _named_leaves(tree)
    leaves = []
    for k, like in names.items():
      x = tensors.get(k)
      # (safetensors keeps a scalar as shape [1])
      if x is None or tuple(x.shape) != tuple(np.shape(like)) and not (
          np.ndim(like) == 0 and x.size == 1):
        raise ElasticJaxError(f"{directory}: {prefix} tensor {k} is missing or has another "
                              "shape (another backbone config?)")
      leaves.append(jnp.asarray(np.asarray(x, like.dtype).reshape(np.shape(like))))
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)
  return fill(params, "params"), fill(opt, "optimizer"), info


def save_backbone(params, cfg, raw, out: str, info: dict, metrics_path: str) -> str:
  """The backbone as a float32 HF directory (its trained weights, so that dtype "auto" loads
  them as they are) with the mixture's tokenizer, pretrain.json and the metrics of the run."""
  import jax
  import jax.numpy as jnp
  import elastic_jax as ej
  from elastic_jax.files import atomic_write_text
  model = ej.ElasticModel(cfg, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32),
                                            jax.device_get(params)), raw)
  target = os.path.join(out, "hf")
  ej.save_pretrained(model, target, dtype="float32", overwrite=True)
  mixture.build_tokenizer(target)
  atomic_write_text(os.path.join(target, "pretrain.json"), json.dumps(info, indent=1) + "\n")
  shutil.copyfile(metrics_path, os.path.join(target, "pretrain_metrics.jsonl"))
  return target


def _jsonable(m: dict) -> dict:
  out = {}
  for k, v in m.items():
    v = np.asarray(v)
    if v.ndim:
      out[k] = {t: (None if np.isnan(x) else round(float(x), 5)) for t, x in zip(TASKS, v)}
    else:
      out[k] = float(v)
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax
  import jax.numpy as jnp
  from elastic_jax.config import read_config_file
  from elastic_jax.files import check_creatable, repair_jsonl_tail
  from elastic_jax.model import init_params

  mixture.check_wordings()
  check_creatable(args.out, "--out")
  cfg, raw = read_config_file(args.config)
  if cfg.vocab_size < len(mixture.VOCAB):
    raise ElasticJaxError(f"{args.config}: vocab_size {cfg.vocab_size} is below the mixture's "
                          f"{len(mixture.VOCAB)} tokens")
  if args.seq_len > cfg.max_position_embeddings or max(args.eval_lengths) + 64 > \
      cfg.max_position_embeddings:
    raise ElasticJaxError(f"--seq-len and --eval-lengths must stay within the config's "
                          f"{cfg.max_position_embeddings} positions")
  state_dir = os.path.join(args.out, "state")
  if os.path.exists(state_dir) and not args.resume:
    raise ElasticJaxError(f"{args.out} holds a pretraining state: pass --resume to continue "
                          "it, or choose another --out")
  if args.resume and not os.path.exists(state_dir):
    raise ElasticJaxError(f"--resume: {state_dir} does not exist")
  os.makedirs(args.out, exist_ok=True)
  tx = optimizer(args)
  params = init_params(cfg, jax.random.key(args.seed), "float32")
  opt = tx.init(params)
  info = {"step": 0, "tokens": 0, "pieces": []}
  if args.resume:
    params, opt, info = load_state(args.out, params, opt)
    kept = {k: info["args"][k] for k in ("seed", "tokens", "seq_len", "short_seq_len",
                                          "long_from", "copy_fraction", "lr", "warmup",
                                          "decay", "min_lr", "weight_decay", "lm_weight",
                                          "eos_weight", "heldout_in_pretraining")}
    # (states saved before --tasks existed drew the five tasks)
    kept["tasks"] = tuple(info["args"].get("tasks", mixture.TASKS))
    now = {k: getattr(args, k) for k in kept}
    if kept != now:
      changed = ", ".join(f"--{k.replace('_', '-')} {kept[k]} -> {now[k]}"
                          for k in kept if kept[k] != now[k])
      raise ElasticJaxError(f"--resume: the saved run was started with other data or "
                            f"optimizer settings ({changed})")
    # The length of the schedule may change while its decay has not begun (the learning rate
    # until then does not depend on it).
    old_total = info["args"]["total_steps"]
    if args.total_steps != old_total and info["step"] >= min(
        old_total, args.total_steps) * (1 - args.decay):
      raise ElasticJaxError(f"--resume: --total-steps can change ({old_total} -> "
                            f"{args.total_steps}) only before the learning rate decays; the "
                            f"run is at step {info['step']}")
    print(f"resuming {args.out} at step {info['step']} ({info['tokens'] / 1e6:.0f}M tokens, "
          f"{len(info['pieces'])} pieces so far)", flush=True)
  compute = jnp.dtype(args.compute_dtype)
  train_step, predict = step_functions(cfg, compute, args.attn_impl, tx, args)
  sparse = sparse_predictor(cfg, compute, args.sparse_window)
  cells = eval_set(args.seed, args.eval_lengths, args.eval_samples, args.tasks)
  metrics_path = os.path.join(args.out, "metrics.jsonl")
  if os.path.exists(metrics_path):
    repair_jsonl_tail(metrics_path)
    # Lines past the saved step belong to a piece that stopped before saving: drop them.
    with open(metrics_path, encoding="utf-8") as f:
      keep = [ln for ln in f if json.loads(ln)["step"] <= info["step"]]
    with open(metrics_path, "w", encoding="utf-8") as f:
      f.writelines(keep)

  step, tokens = info["step"], info["tokens"]
  batches = Batches(args, step, args.workers)
  t0 = time.perf_counter()
  piece = {"start_step": step, "device": jax.devices()[0].device_kind,
           "date": time.strftime("%Y-%m-%d")}
  last_eval = None

  def run_eval(step):
    result = evaluate(predict, params, cells, sparse)
    print(f"evaluation at step {step}: teacher-forced exact match % (chance %)\n"
          + eval_table(result), flush=True)
    return result

  try:
    with open(metrics_path, "a", encoding="utf-8") as log:
      while step < args.total_steps:
        elapsed = time.perf_counter() - t0
        if args.piece_seconds is not None and elapsed > args.piece_seconds and \
            step > piece["start_step"]:
          break
        b = {k: jnp.asarray(v) for k, v in batches.get().items()}
        lr = learning_rate_at(step, args)
        params, opt, m = train_step(params, opt, b, lr)
        step += 1
        tokens += b["ids"].size
        if step % args.log_every == 0 or step == args.total_steps:
          m = _jsonable(jax.device_get(m))
          if not np.isfinite(m["loss"]):
            raise ElasticJaxError(f"step {step}: the loss is {m['loss']}; nothing is saved "
                                  "from this piece")
          el = time.perf_counter() - t0
          rate = (tokens - info["tokens"]) / el
          rec = {"step": step, **m, "lr": lr, "tokens": tokens, "seconds": round(el, 1),
                 "tokens_per_s": round(rate)}
          if step % args.eval_every == 0:
            last_eval = run_eval(step)
            rec["eval"] = last_eval
          log.write(json.dumps(rec) + "\n")
          log.flush()
          steps_per_s = (step - piece["start_step"]) / el
          left = (args.total_steps - step) / steps_per_s
          if args.piece_seconds is not None:
            left = min(left, args.piece_seconds - el)
          tl = " ".join(f"{t} {v:.2f}" for t, v in m["task_loss"].items() if v is not None)
          print(f"step {step}/{args.total_steps} loss {m['loss']:.3f} answer "
                f"{m['answer_loss']:.3f} eos {m['eos_loss']:.3f} lm {m['lm_loss']:.3f} "
                f"[{tl}] lr {lr:.2e} | {steps_per_s:.1f} steps/s {rate / 1e3:.0f}K tok/s, "
                f"piece ends in {max(left, 0) / 60:.1f} min", flush=True)
  finally:
    batches.close()
  seconds = time.perf_counter() - t0
  if last_eval is None or step % args.eval_every:
    last_eval = run_eval(step)
    with open(metrics_path, "a", encoding="utf-8") as log:
      log.write(json.dumps({"step": step, "tokens": tokens, "eval": last_eval}) + "\n")
  piece.update(end_step=step, seconds=round(seconds, 1),
               tokens_per_s=round((tokens - info["tokens"]) / max(seconds, 1e-9)))
  info = {"step": step, "tokens": tokens, "pieces": info["pieces"] + [piece],
          "args": {**{k: v for k, v in vars(args).items() if k not in ("out", "resume")},
                   "config": os.path.basename(args.config)}}
  if not all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(params)):
    raise ElasticJaxError(f"step {step}: the weights hold NaN or inf; the state is not saved")
  save_state(args.out, params, opt, info)
  print(f"saved the state at step {step} ({tokens / 1e6:.0f}M tokens) in {state_dir}",
        flush=True)
  if step >= args.total_steps:
    info["final_eval"] = last_eval
    target = save_backbone(params, cfg, raw, args.out, info, metrics_path)
    print(f"wrote the backbone to {target}", flush=True)
  return 0


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
