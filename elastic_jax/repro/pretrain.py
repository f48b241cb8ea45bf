"""Pretrains the small backbone of the reproduction on the task mixture, full attention.

  python -m elastic_jax.repro.pretrain --out runs/backbone [--time-budget 540] [--steps N]

Each step is one batch of --tokens tokens: a row length T is drawn from the multiples of 128
up to --seq-len (short rows more often), and T-token rows each hold one mixture sample (any
task and template) whose prompt has between T/2 and T-64 tokens, right-padded: one input per
row, so full attention runs on cuDNN on a GPU. A sample is `<bos> context question answer
<eos>`; a sensitive one goes on with more questions on the same context (`question answer
<eos>` each). The loss is the cross-entropy of the answer tokens and their EOS, plus
--lm-weight times that of every other token. AdamW in float32, computed in bfloat16.

The run lasts --steps steps or --time-budget seconds, whichever ends first; the learning rate
warms up over --warmup steps and then decays on a cosine over the budget (steps or time).
Every --eval-every steps: teacher-forced exact match per task on fixed held-out samples (all
answer tokens argmax-correct). At the end the backbone goes to OUT/hf (Hugging Face layout,
bfloat16 safetensors, with the mixture's tokenizer) and OUT/hf/pretrain.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import sys
import threading
import time

import numpy as np

from elastic_jax.eval import mixture

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "backbone_config.json")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="run directory (state, metrics, hf/)")
  p.add_argument("--config", default=DEFAULT_CONFIG, help="HF config JSON of the backbone")
  p.add_argument("--steps", type=int, default=10 ** 6)
  p.add_argument("--tokens", type=int, default=32768, help="tokens per step (rows x T)")
  p.add_argument("--seq-len", type=int, default=1024, help="longest row (a multiple of 128)")
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--warmup", type=int, default=300)
  p.add_argument("--weight-decay", type=float, default=0.01)
  p.add_argument("--lm-weight", type=float, default=0.02,
                 help="loss weight of the non-answer tokens")
  p.add_argument("--attn-impl", default="auto", help="attention (auto: cuDNN on a GPU)")
  p.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                 help="forward/backward dtype (float32 on CPUs, where bfloat16 is slow)")
  p.add_argument("--eval-every", type=int, default=500)
  p.add_argument("--log-every", type=int, default=50)
  p.add_argument("--time-budget", type=float, default=None,
                 help="train for at most this many seconds (the schedule decays over them)")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Data


def sample_tokens(s: mixture.Sample) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, is_answer) of one pretraining sample: answers and their EOS are marked."""
  parts, marks = [np.array([mixture.BOS], np.int32), s.context], [0, 0]
  for q, a in ((s.question, s.answer), *s.extra):
    parts += [q, a, np.array([mixture.EOS], np.int32)]
    marks += [0, 1, 1]
  tokens = np.concatenate(parts)
  answer = np.concatenate([np.full(len(x), m, bool) for x, m in zip(parts, marks)])
  return tokens, answer


def row_lengths(seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """The row lengths T (multiples of 128 up to seq_len) and their probabilities (~ 1/sqrt T:
  short rows more often, though fewer tokens in all)."""
  lengths = np.arange(128, seq_len + 1, 128)
  p = lengths ** -0.5
  return lengths, p / p.sum()


def make_rows(rng: np.random.Generator, rows: int, t: int, max_extra: int = 6,
              templates=(0, 1, 2)) -> dict[str, np.ndarray]:
  """`rows` rows of t tokens, one sample each (prompt of t/2 .. t-64 tokens), right-padded."""
  ids = np.zeros((rows, t), np.int32)
  answer = np.zeros((rows, t), bool)
  real = np.zeros((rows, t), bool)
  for b in range(rows):
    task = mixture.TASKS[int(rng.integers(len(mixture.TASKS)))]
    extra = int(rng.integers(0, max_extra + 1)) if task in mixture.SENSITIVE else 0
    length = int(rng.integers(t // 2, t - 63))
    s = mixture.make_sample(task, rng, length, templates[int(rng.integers(len(templates)))],
                            extra_queries=extra)
    tok, ans = sample_tokens(s)
    tok, ans = tok[:t], ans[:t]
    ids[b, :len(tok)], answer[b, :len(tok)], real[b, :len(tok)] = tok, ans, True
  return _with_targets(ids, answer, real)


def _with_targets(ids, answer, real) -> dict[str, np.ndarray]:
  targets = np.zeros_like(ids)
  targets[:, :-1] = ids[:, 1:]
  valid = np.zeros_like(real)
  valid[:, :-1] = real[:, 1:]          # predict token t+1 at t, where t+1 is a real token
  is_answer = np.zeros_like(answer)
  is_answer[:, :-1] = answer[:, 1:]
  pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
  return {"ids": ids, "targets": targets, "positions": pos, "segment_ids": real.astype(np.int32),
          "valid": valid, "answer": is_answer & valid}


def eval_batches(seed: int, lengths: tuple[int, ...], per_task: int):
  """Fixed held-out rows: {task: batch} with per_task samples at each row length."""
  rng = np.random.default_rng([seed, 777])
  out = {}
  for task in mixture.TASKS:
    ids, ans, real = [], [], []
    t = max(lengths)
    for n in lengths:
      for _ in range(per_task // len(lengths)):
        s = mixture.make_sample(task, rng, int(rng.integers(n // 2, n - 63)),
                                int(rng.integers(0, 3)))
        tok, a = sample_tokens(s)
        row = np.zeros(t, np.int32)
        row[:len(tok)] = tok
        ids.append(row)
        ans.append(np.pad(a, (0, t - len(a))))
        real.append(np.arange(t) < len(tok))
    out[task] = _with_targets(np.stack(ids), np.stack(ans), np.stack(real))
  return out


class Prefetch:
  """Batches made on a background thread, `depth` ahead of the training loop."""

  def __init__(self, make, depth: int = 4):
    self._q: queue.Queue = queue.Queue(depth)
    self._make = make
    threading.Thread(target=self._run, daemon=True).start()

  def _run(self):
    step = 0
    while True:
      self._q.put(self._make(step))
      step += 1

  def get(self):
    return self._q.get()


# ----------------------------------------------------------------------------------------------
# Training


def step_functions(cfg, compute, attn_impl: str, tx, lm_weight: float):
  """(train_step(params, opt, batch, lr) -> (params, opt, metrics), predict(params, batch)),
  jitted: the answer loss plus `lm_weight` times the loss on the other real tokens."""
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
    ans = b["answer"].astype(jnp.float32)
    rest = (b["valid"] & ~b["answer"]).astype(jnp.float32)
    ans_loss = jnp.sum(nll * ans) / jnp.maximum(ans.sum(), 1.0)
    rest_loss = jnp.sum(nll * rest) / jnp.maximum(rest.sum(), 1.0)
    return ans_loss + lm_weight * rest_loss, (ans_loss, rest_loss)

  @jax.jit
  def train_step(params, opt, b, lr):
    (loss, (ans_loss, rest_loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, b)
    updates, opt = tx.update(grads, opt, params)
    updates = jax.tree.map(lambda u: lr * u, updates)
    return (optax.apply_updates(params, updates), opt,
            {"loss": loss, "answer_loss": ans_loss, "lm_loss": rest_loss,
             "grad_norm": optax.global_norm(grads)})

  @jax.jit
  def predict(params, b):
    return jnp.argmax(logits_fn(params, b), axis=-1)
  return train_step, predict


def accuracy(predict, params, evals) -> dict[str, float]:
  """Teacher-forced exact match of the answer tokens per task."""
  import jax.numpy as jnp
  acc = {}
  for task, b in evals.items():
    pred = np.asarray(predict(params, {k: jnp.asarray(v) for k, v in b.items()}))
    acc[task] = float(np.where(b["answer"], pred == b["targets"], True).all(axis=1).mean())
  return acc


def learning_rate_at(step: int, elapsed: float, args) -> float:
  """Linear warm-up, then cosine to 10% of the peak over the steps (or the time budget,
  whichever runs out first)."""
  if step < args.warmup:
    return args.lr * (step + 1) / args.warmup
  frac = (step - args.warmup) / max(1, args.steps - args.warmup)
  if args.time_budget:
    frac = max(frac, elapsed / args.time_budget)
  frac = min(frac, 1.0)
  return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def save_backbone(params, cfg, raw, out: str, info: dict) -> str:
  """The backbone as a bf16 HF directory with the mixture's tokenizer and pretrain.json."""
  import jax
  import jax.numpy as jnp
  import elastic_jax as ej
  from elastic_jax.files import atomic_write_text
  model = ej.ElasticModel(cfg, jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16),
                                            jax.device_get(params)), raw)
  target = os.path.join(out, "hf")
  ej.save_pretrained(model, target, dtype="bfloat16", overwrite=True)
  mixture.build_tokenizer(target)
  atomic_write_text(os.path.join(target, "pretrain.json"), json.dumps(info, indent=1) + "\n")
  return target


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax
  import jax.numpy as jnp
  import optax
  from elastic_jax.config import read_config_file
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.model import init_params

  cfg, raw = read_config_file(args.config)
  if cfg.vocab_size < len(mixture.VOCAB):
    raise ElasticJaxError(f"{args.config}: vocab_size {cfg.vocab_size} is below the mixture's "
                          f"{len(mixture.VOCAB)} tokens")
  if args.seq_len % 128 or not 128 <= args.seq_len <= cfg.max_position_embeddings:
    raise ElasticJaxError(f"--seq-len must be a multiple of 128 in [128, "
                          f"{cfg.max_position_embeddings}], got {args.seq_len}")
  os.makedirs(args.out, exist_ok=True)
  # AdamW with unit step size; the step is scaled by the schedule's value, an argument of the
  # jitted step, so that the decay can follow wall-clock time.
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=args.weight_decay))
  params = init_params(cfg, jax.random.key(args.seed), "float32")
  opt = tx.init(params)
  compute = jnp.dtype(args.compute_dtype)
  train_step, predict = step_functions(cfg, compute, args.attn_impl, tx, args.lm_weight)
  evals = eval_batches(args.seed, (args.seq_len // 4, args.seq_len), 24)
  lengths, probs = row_lengths(args.seq_len)

  def make(step: int):
    rng = np.random.default_rng([args.seed, step])
    t = int(rng.choice(lengths, p=probs))
    return make_rows(rng, max(1, args.tokens // t), t)

  data = Prefetch(make)
  t0 = time.perf_counter()
  step, tokens = 0, 0
  with open(os.path.join(args.out, "metrics.jsonl"), "w", encoding="utf-8") as log:
    while step < args.steps:
      elapsed = time.perf_counter() - t0
      if args.time_budget is not None and elapsed > args.time_budget:
        break
      b = {k: jnp.asarray(v) for k, v in data.get().items()}
      lr = learning_rate_at(step, elapsed, args)
      try:
        params, opt, m = jax.block_until_ready(train_step(params, opt, b, lr)) if step == 0 \
            else train_step(params, opt, b, lr)
      except Exception as e:  # a backend without a fused kernel for this shape
        if step or args.attn_impl == "reference":
          raise
        print(f"attention '{args.attn_impl}' failed ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:200]}); using the reference", flush=True)
        train_step, predict = step_functions(cfg, compute, "reference", tx, args.lm_weight)
        params, opt, m = train_step(params, opt, b, lr)
      step += 1
      tokens += b["ids"].size
      if step % args.log_every == 0:
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        el = time.perf_counter() - t0
        rec = {"step": step, **m, "lr": lr, "tokens": tokens, "seconds": el,
               "tokens_per_s": tokens / el}
        if step % args.eval_every == 0:
          rec["accuracy"] = accuracy(predict, params, evals)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        left = (args.time_budget - el if args.time_budget else float("nan"))
        acc = " ".join(f"{k} {v:.2f}" for k, v in rec.get("accuracy", {}).items())
        print(f"step {step} loss {m['loss']:.3f} answer {m['answer_loss']:.3f} "
              f"lm {m['lm_loss']:.3f} lr {lr:.2e} | {step / el:.1f} steps/s "
              f"{tokens / el / 1e3:.0f}K tok/s, {left / 60:.1f} min left"
              f"{(' | acc ' + acc) if acc else ''}", flush=True)
  acc = accuracy(predict, params, evals)
  info = {"steps": step, "tokens": tokens, "seconds": round(time.perf_counter() - t0, 1),
          "args": {**{k: v for k, v in vars(args).items() if k != "out"},
                   "config": os.path.basename(args.config)},
          "final_accuracy_teacher_forced": acc, "device": jax.devices()[0].device_kind,
          "date": time.strftime("%Y-%m-%d")}
  target = save_backbone(params, cfg, raw, args.out, info)
  print(f"wrote {target} after {step} steps: teacher-forced accuracy {json.dumps(acc)}",
        flush=True)
  return 0


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
