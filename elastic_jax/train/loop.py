"""The router-training run behind train.py: mesh, frozen backbone, data, train state,
checkpoints, progress, metrics, evaluation and the final router export.

Every process runs this same code (`jax.distributed` for many hosts). The backbone is loaded
once, sharded over the mesh by its logical axes and never saved; only the routers, the
multipliers, the optimizer state, the step and the data order are checkpointed, so a resumed
run continues bit-exactly. SIGTERM or SIGINT make the run save at the end of the current step
and stop cleanly.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from elastic_jax import sharding
from elastic_jax.config import ModelConfig, read_config_file, read_hf_config
from elastic_jax.errors import ElasticJaxError
from elastic_jax.model import abstract_params, forward_routed_jit, init_params
from elastic_jax.router import msr
from elastic_jax.train import export
from elastic_jax.train.checkpointing import PreemptionGuard, TrainCheckpointer, train_fingerprint
from elastic_jax.train.objective import TASK_TYPES
from elastic_jax.train.run_config import (RunConfig, check_batch_layout, dump_run_config,
                                          resolve_mesh_shape, resolve_model_path)
from elastic_jax.train.step import all_finite, init_train_state, train_step
from elastic_jax.utils import DirectoryLock, check_apart, check_creatable
from elastic_jax.train.synthetic import synthetic_batch


def say(msg: str) -> None:
  """Progress for people: printed by the first process only."""
  if jax.process_index() == 0:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Backbone and mesh


def mesh_layout(cfg: RunConfig, devices=None):
  """The run's mesh over `devices` (default: all): (axis sizes, mesh, sharding rules, number of
  micro-batch passes per step or None). Checks that the batch splits over it."""
  n = jax.device_count() if devices is None else len(devices)
  mesh_shape = resolve_mesh_shape(cfg.mesh, n)
  check_batch_layout(cfg, mesh_shape)
  mesh = sharding.make_mesh(mesh_shape, devices)
  d = cfg.data
  micro = (d.global_batch // d.micro_batch
           if d.micro_batch and d.micro_batch < d.global_batch else None)
  return mesh_shape, mesh, sharding.rules_for(mesh), micro


def backbone_shardings(mcfg: ModelConfig, dtype: str, mesh):
  """(abstract parameter shapes, their logical axes, their shardings on `mesh`)."""
  shapes, axes = abstract_params(mcfg, dtype)
  return shapes, axes, sharding.param_shardings(axes, mesh, shapes)


def abstract_train_state(cfg: RunConfig, mcfg: ModelConfig, mesh):
  """The train state's shapes, replicated on `mesh` as the run keeps it."""
  replicated = NamedSharding(mesh, PartitionSpec())
  abstract = jax.eval_shape(lambda key: init_train_state(mcfg, cfg.router, cfg.train, key),
                            jax.random.key(0))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                      abstract)


def load_backbone(cfg: RunConfig, mesh) -> tuple[ModelConfig, dict]:
  """The frozen backbone, placed on the mesh by its logical axes (random for a config JSON)."""
  path = resolve_model_path(cfg.model)
  if cfg.model.random_init:
    mcfg, _ = read_config_file(path)
    _, _, shardings = backbone_shardings(mcfg, cfg.model.dtype, mesh)
    init = jax.jit(lambda key: init_params(mcfg, key, cfg.model.dtype), out_shardings=shardings)
    return mcfg, init(jax.random.key(cfg.seed + 7919))
  from elastic_jax.api import from_pretrained
  model = from_pretrained(path, cfg.model.dtype, show_progress=jax.process_index() == 0)
  _, _, shardings = backbone_shardings(model.config, cfg.model.dtype, mesh)
  return model.config, jax.device_put(model.params, shardings)


# A batch's fields (train/step.py) and their types: [rows, T] per token, [rows, slots] task ids.
BATCH_DTYPES = {"input_ids": "int32", "targets": "int32", "loss_mask": "bool",
                "segment_ids": "int32", "positions": "int32", "prompt_mask": "bool",
                "task_ids": "int32"}


def batch_sharding(mesh, micro: bool) -> dict[str, NamedSharding]:
  """Rows over data x fsdp, tokens over sequence; task ids follow the rows."""
  rows = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
  seq = "sequence" if mesh.shape["sequence"] > 1 else None
  lead = (None,) if micro else ()
  tokens = NamedSharding(mesh, PartitionSpec(*lead, rows, seq))
  slots = NamedSharding(mesh, PartitionSpec(*lead, rows, None))
  return {k: slots if k == "task_ids" else tokens for k in BATCH_DTYPES}


def to_global(local: dict[str, np.ndarray], shardings, micro: int | None) -> dict:
  """This process's rows -> global arrays; micro-batched as [M, rows/M, ...] when asked."""
  out = {}
  for k, x in local.items():
    if micro:
      x = x.reshape(micro, x.shape[0] // micro, *x.shape[1:])
      global_shape = (micro, x.shape[1] * jax.process_count(), *x.shape[2:])
    else:
      global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
    out[k] = jax.make_array_from_process_local_data(shardings[k], x, global_shape)
  return out


# ----------------------------------------------------------------------------------------------
# Data


class SyntheticData:
  """Synthetic two-task rows (train/synthetic.py) with the TrainData interface."""

  def __init__(self, cfg: RunConfig, vocab: int, seed_offset: int = 0):
    self.cfg, self.vocab, self.seed = cfg, vocab, cfg.data.shuffle_seed + seed_offset
    self.step = 0
    self.stats = {"source": "synthetic"}

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    d = self.cfg.data
    b = synthetic_batch(self.step, d.global_batch, d.seq_len, self.vocab,
                        prompt_frac=d.synthetic.prompt_frac, max_segments=d.max_segments,
                        seed=self.seed)
    self.step += 1
    per = d.global_batch // jax.process_count()
    lo = jax.process_index() * per
    return {k: v[lo:lo + per] for k, v in b.items()}

  def state(self) -> dict:
    return {"synthetic_step": self.step, "fingerprint": f"synthetic-{self.seed}"}

  def restore(self, state: dict) -> "SyntheticData":
    if state.get("fingerprint") != f"synthetic-{self.seed}":
      raise ElasticJaxError("the checkpoint's data state is not this run's synthetic data")
    self.step = int(state["synthetic_step"])
    return self

  @property
  def fingerprint(self) -> str:
    return f"synthetic-{self.seed}"


def mixture_paths(cfg: RunConfig) -> tuple[str, str | None]:
  """Writes the task mixture's train and eval JSONL under RUN_DIR/data (process 0; the files
  are deterministic in the config, so a resumed run rewrites the same bytes)."""
  from elastic_jax.repro import mixture
  from elastic_jax.train.data import load_tokenizer
  if cfg.tokenizer_dir is None:
    raise ElasticJaxError("data.mixture needs a tokenizer: the model's directory or data.tokenizer")
  mixture.check_tokenizer(load_tokenizer(cfg.tokenizer_dir), cfg.tokenizer_dir)
  mx = cfg.data.mixture
  variant = mixture.Variant("train", mx.templates, mx.min_len, mx.max_len)
  d = os.path.join(cfg.run_dir, "data")
  train_path, eval_path = os.path.join(d, "train.jsonl"), os.path.join(d, "eval.jsonl")
  if jax.process_index() == 0:
    n = mixture.write_jsonl(train_path, variant, mx.per_task, mx.seed)
    say(f"mixture: {n} training records ({', '.join(mixture.TASKS)}; prompts of "
        f"{mx.min_len}-{mx.max_len} tokens, templates {list(mx.templates)}) in {train_path}")
    if mx.eval_per_task:
      mixture.write_jsonl(eval_path, variant, mx.eval_per_task, mx.seed + 1)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("mixture data written")
  return train_path, (eval_path if mx.eval_per_task else None)


def make_data(cfg: RunConfig, vocab: int, path: str | None, *, eval_split: bool = False):
  if path is None:
    return SyntheticData(cfg, vocab, seed_offset=1000 if eval_split else 0)
  from elastic_jax.train.data import TrainData
  if cfg.tokenizer_dir is None:
    raise ElasticJaxError("data.tokenizer must name a tokenizer dir when the model is a random "
                          "config and data.train_path is set")
  d = cfg.data
  data = TrainData(path, cfg.tokenizer_dir, d.seq_len, d.global_batch, d.max_segments,
                   overlong=d.overlong, seed=d.shuffle_seed + (1 if eval_split else 0),
                   use_chat_template=d.use_chat_template, process_index=jax.process_index(),
                   process_count=jax.process_count(), num_epochs=1 if eval_split else None)
  tokens = data.encoded.tokens
  bad = tokens[(tokens < 0) | (tokens >= vocab)]
  if bad.size:
    raise ElasticJaxError(f"{path}: holds token ids outside the model's vocabulary [0, {vocab}) "
                          f"(e.g. {int(bad[0])}, {bad.size} in all)")
  return data


def data_fingerprint(data) -> str:
  return data.fingerprint if isinstance(data, SyntheticData) else data.state()["fingerprint"]


# ----------------------------------------------------------------------------------------------
# Metrics


class Metrics:
  """metrics.jsonl (appended, one object per logged step) and TensorBoard when asked."""

  def __init__(self, cfg: RunConfig):
    self.jsonl = self.tb = None
    if jax.process_index() != 0:
      return
    os.makedirs(cfg.log_dir, exist_ok=True)
    if cfg.log.jsonl:
      self.jsonl = open(os.path.join(cfg.log_dir, "metrics.jsonl"), "a")
    if cfg.log.tensorboard:
      try:
        from tensorboardX import SummaryWriter
      except ImportError:
        raise ElasticJaxError("log.tensorboard needs the tensorboardX package (pip install "
                              "tensorboardX), or set log.tensorboard=false") from None
      self.tb = SummaryWriter(os.path.join(cfg.log_dir, "tensorboard"))

  def write(self, record: dict[str, Any]) -> None:
    if self.jsonl:
      self.jsonl.write(json.dumps(record) + "\n")
      self.jsonl.flush()
    if self.tb:
      for k, v in _flatten(record).items():
        if k != "step" and isinstance(v, (int, float)):
          self.tb.add_scalar(k, v, record["step"])

  def close(self) -> None:
    for f in (self.jsonl, self.tb):
      if f is not None:
        f.close()


def _flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def step_record(step: int, m: dict, tokens_per_s: float | None, eta_s: float | None) -> dict:
  """One metrics record from a train step's (host) metrics; rates are None until a step after
  the compiling one has been timed."""
  count = np.asarray(m["task_count"])
  seen = [t for t in range(len(TASK_TYPES)) if count[t] > 0]
  return {
      "step": step, "loss": float(m["loss"]), "lm_loss": float(m["lm_loss"]),
      "penalty": float(m["penalty"]), "msr": float(m["msr"]), "tau": float(m["tau"]),
      "msr_task": {TASK_TYPES[t]: float(m["msr_task"][t]) for t in seen},
      "lambda1": {TASK_TYPES[t]: float(m["lambda1"][t]) for t in seen},
      "lambda2": {TASK_TYPES[t]: float(m["lambda2"][t]) for t in seen},
      "tokens_per_s": tokens_per_s, "eta_s": eta_s}


def progress_line(r: dict, steps: int) -> str:
  tasks = " ".join(f"{k} {v:.2f}" for k, v in r["msr_task"].items())
  lam = "/".join(f"{v:.3f}" for v in r["lambda1"].values())
  rate, eta = r["tokens_per_s"], r["eta_s"]
  eta = "?" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta))
  rate = "?" if rate is None else f"{rate:,.0f}"
  return (f"step {r['step']:5d}/{steps}  loss {r['loss']:.4f}  lm {r['lm_loss']:.4f}  "
          f"msr {r['msr']:.2f} [{tasks}]  tau {r['tau']:.2f}  l1 {lam}  "
          f"{rate} tok/s  eta {eta}")


# ----------------------------------------------------------------------------------------------
# Evaluation: noiseless routing on held-out rows


def evaluate_msr(cfg: RunConfig, mcfg: ModelConfig, backbone, router, data, batches: int,
                 shardings, rules) -> dict[str, float]:
  """Mean MSR per task type over up to `batches` held-out batches (inference routing)."""
  sums = np.zeros(len(TASK_TYPES))
  counts = np.zeros(len(TASK_TYPES))
  for i, local in enumerate(data):
    if i >= batches:
      break
    b = to_global(local, shardings, None)
    _, stats = forward_routed_jit(backbone, b["input_ids"], b["positions"], b["segment_ids"],
                                  b["prompt_mask"], cfg=mcfg, rcfg=cfg.router,
                                  router_params=router, attn_impl=cfg.model.attn_impl,
                                  rules=rules, packed=cfg.train.packed)
    m = np.asarray(multihost_utils.process_allgather(msr(stats["gate"]), tiled=True))
    tasks = np.asarray(multihost_utils.process_allgather(b["task_ids"], tiled=True))
    valid = tasks >= 0
    np.add.at(sums, tasks[valid], m[valid])
    np.add.at(counts, tasks[valid], 1)
  return {TASK_TYPES[t]: float(sums[t] / counts[t]) for t in range(len(TASK_TYPES))
          if counts[t]}


# ----------------------------------------------------------------------------------------------
# The run


def preflight(cfg: RunConfig) -> ModelConfig:
  """Checks what can be checked before the backbone loads and before anything is written:
  the model's config, the logging backend, the tokenizer against the model's vocabulary,
  outputs apart from the inputs, the full-model export. Returns the model config."""
  path = resolve_model_path(cfg.model)
  mcfg = (read_config_file(path) if cfg.model.random_init else read_hf_config(path))[0]
  if cfg.log.tensorboard:
    try:
      import tensorboardX  # noqa: F401
    except ImportError:
      raise ElasticJaxError("log.tensorboard needs the tensorboardX package (pip install "
                            "tensorboardX), or set log.tensorboard=false") from None
  for data_path, key in ((cfg.data.train_path, "data.train_path"),
                         (cfg.data.eval_path, "data.eval_path")):
    if data_path is not None and not os.path.exists(data_path):
      raise ElasticJaxError(f"{key} '{data_path}': no such file or directory")
  for out, key in ((cfg.run_dir, "run_dir"), (cfg.log_dir, "log.dir"),
                   (cfg.export_dir, "export.dir"), (cfg.checkpoint_dir, "checkpoint.dir")):
    if "://" not in out:   # every output folder can be made: found before any work is done
      check_creatable(out, key)
  uses_tokenizer = cfg.data.train_path is not None or cfg.data.mixture.per_task
  if uses_tokenizer and cfg.tokenizer_dir is not None:
    from elastic_jax.train.data import check_vocabulary, load_tokenizer
    check_vocabulary(load_tokenizer(cfg.tokenizer_dir), mcfg.vocab_size, cfg.tokenizer_dir)
  inputs = [None if cfg.model.random_init else path, cfg.data.train_path, cfg.data.eval_path,
            cfg.data.tokenizer]
  for out, what in ((cfg.export_dir, "export.dir"), (cfg.checkpoint_dir, "checkpoint.dir"),
                    (cfg.log_dir, "log.dir"), (cfg.run_dir, "run_dir")):
    try:
      check_apart(out, inputs, "an input of the run (model, data or tokenizer)")
    except ElasticJaxError as e:
      raise ElasticJaxError(f"{what} {e}") from None
  if cfg.export.full_model:
    if jax.process_count() > 1:
      raise ElasticJaxError("export.full_model runs in a single process; on many hosts, merge "
                            "the exported routers afterwards with python -m elastic_jax.convert "
                            "MODEL OUT --to-hf --routers EXPORT_DIR/elastic_jax")
    problem = export.authors_layout_problem(cfg.router)
    if problem:
      raise ElasticJaxError(f"export.full_model: {problem}")
  return mcfg


def train(cfg: RunConfig) -> dict[str, Any]:
  """Trains the routers as `cfg` says; returns a summary (final step, metrics, eval MSR).

  The run directory is locked for the run's duration: a second train.py on the same
  run_dir is refused (process 0 holds the lock)."""
  mesh_layout(cfg)            # the batch must split over the mesh: checked before anything
  preflight(cfg)
  if jax.process_index() != 0:
    return _train(cfg)
  with DirectoryLock(cfg.run_dir) as lock:
    if lock.taken_over:
      say(f"note: {cfg.run_dir} was locked by {lock.taken_over}, which has ended; continuing")
    return _train(cfg)


def _nonfinite_error(step: int) -> ElasticJaxError:
  return ElasticJaxError(
      f"step {step}: the loss or a router gradient is not finite (NaN or inf); training "
      "stopped, and nothing from that step on was saved or exported (the last checkpoint, if "
      "any, is intact); likely causes: backbone weights holding NaN or inf, token ids outside "
      "the model's vocabulary, or a learning rate far too large")


def _host_int(x) -> int:
  """A replicated scalar as an int, also when it spans several processes."""
  return int(np.asarray(x.addressable_data(0)))


@jax.jit
def _first_bad(first_bad, finite, step):
  """The first step (1-based) whose loss or gradients were not finite, or 0."""
  return jnp.where((first_bad == 0) & ~finite, step, first_bad)


def _train(cfg: RunConfig) -> dict[str, Any]:
  _, mesh, rules, micro = mesh_layout(cfg)
  t0 = time.perf_counter()
  mcfg, backbone = load_backbone(cfg, mesh)
  if cfg.data.seq_len > mcfg.max_position_embeddings:
    say(f"note: data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings "
        f"({mcfg.max_position_embeddings}); RoPE positions extrapolate")
  train_path, eval_path = cfg.data.train_path, cfg.data.eval_path
  if cfg.data.mixture.per_task:
    train_path, eval_path = mixture_paths(cfg)
  data = make_data(cfg, mcfg.vocab_size, train_path)
  say(f"backbone {mcfg.family}: {mcfg.num_layers} layers x {mcfg.num_kv_heads} KV heads, "
      f"{cfg.model.dtype}, loaded in {time.perf_counter() - t0:.1f}s; mesh "
      f"{dict(mesh.shape)} over {jax.device_count()} devices, {jax.process_count()} "
      f"process(es)")

  replicated = NamedSharding(mesh, PartitionSpec())
  init = jax.jit(lambda key: init_train_state(mcfg, cfg.router, cfg.train, key),
                 out_shardings=replicated)
  abstract = abstract_train_state(cfg, mcfg, mesh)
  fingerprint = train_fingerprint(mcfg, cfg.router, cfg.objective, data_fingerprint(data))
  ckpt = TrainCheckpointer.from_run_config(cfg, fingerprint)
  resumed = ckpt.resume(abstract)
  if resumed is None:
    state = init(jax.random.key(cfg.seed))
    say(f"fresh start; checkpoints in {cfg.checkpoint_dir}")
  else:
    state, data_state, _ = resumed
    if data_state is not None:
      data.restore(data_state)
    say(f"resumed from step {int(state.step)} ({cfg.checkpoint_dir})")
    if int(state.step) >= cfg.train.steps:
      say(f"note: the checkpoint is at step {int(state.step)}, at or past train.steps="
          f"{cfg.train.steps}: nothing left to train; the routers of step {int(state.step)} "
          "are evaluated and exported")
  if jax.process_index() == 0:
    os.makedirs(cfg.run_dir, exist_ok=True)
    dump_run_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))

  shardings = batch_sharding(mesh, micro is not None)
  eval_shardings = batch_sharding(mesh, False)
  metrics = Metrics(cfg)
  steps = cfg.train.steps
  start = int(state.step)
  tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
  step_kw = dict(cfg=mcfg, rcfg=cfg.router, ocfg=cfg.objective, tcfg=cfg.train, rules=rules)
  last: dict[str, Any] = {}
  stopped = False
  t_timing = None
  timed_steps = 0
  first_bad = jnp.zeros((), jnp.int32)
  with jax.set_mesh(mesh), PreemptionGuard() as guard, ckpt:
    for step in range(start, steps):
      if step == start:
        say("compiling the train step (the first step includes it) ...")
      batch = to_global(next(data), shardings, micro)
      state, m = train_step(state, backbone, batch, **step_kw)
      done = step + 1
      first_bad = _first_bad(first_bad, m["finite"], done)
      if t_timing is None:  # the first step compiles: time from its end
        jax.block_until_ready(m["loss"])
        t_timing, timed_steps = time.perf_counter(), 0
      else:
        timed_steps += 1
      # Agreeing on a signal is a collective across processes: poll it at the logging cadence
      # there, so the host does not wait for every step.
      poll = jax.process_count() == 1 or done % cfg.log.every_steps == 0 or done == steps
      stop = guard.sync() if poll else False
      logged = done % cfg.log.every_steps == 0 or done == steps
      saving = ckpt.should_save(done) or stop or done == steps
      if (logged or saving) and _host_int(first_bad):
        metrics.close()
        raise _nonfinite_error(_host_int(first_bad))
      if logged:
        m = jax.device_get(m)
        elapsed = time.perf_counter() - t_timing
        rate = timed_steps * tokens_per_step / elapsed if timed_steps else None
        eta = (steps - done) * tokens_per_step / rate if timed_steps else None
        last = step_record(done, m, rate, eta)
        say(progress_line(last, steps))
        metrics.write(last)
      if saving:
        ckpt.save(done, state, data.state(), force=stop or done == steps)
      if stop:
        say(f"signal received: saved step {done} to {cfg.checkpoint_dir}; stopping")
        stopped = True
        break
  metrics.close()
  if not all_finite(state.trainable):
    raise ElasticJaxError("the trained routers hold NaN or inf values (restored from a damaged "
                          "checkpoint?); nothing was exported")

  summary: dict[str, Any] = {"step": int(state.step), "stopped": stopped, "last": last}
  if stopped:
    return summary
  eval_batches = (cfg.data.synthetic.eval_batches if train_path is None
                  else 0 if eval_path is None else 10 ** 9)
  if eval_batches:
    eval_data = make_data(cfg, mcfg.vocab_size, eval_path, eval_split=True)
    with jax.set_mesh(mesh):
      summary["eval_msr"] = evaluate_msr(cfg, mcfg, backbone, state.trainable["router"],
                                         eval_data, eval_batches, eval_shardings, rules)
    if jax.process_index() == 0:
      with open(os.path.join(cfg.log_dir, "eval.json"), "w") as f:
        json.dump({"step": summary["step"], "msr_task": summary["eval_msr"],
                   "targets": dict(zip(TASK_TYPES, cfg.objective.targets))}, f, indent=1)
  if jax.process_index() == 0 and (cfg.export.ours or cfg.export.authors):
    summary["export"] = export.export_routers(cfg, mcfg, jax.device_get(state.trainable))
    if "notes" in summary["export"]:
      say(f"note: {summary['export']['notes']}")
  if cfg.export.full_model:
    trainable = jax.device_get(state.trainable)
    summary.setdefault("export", {})["full_model"] = export.export_full_model(
        cfg, mcfg, backbone, trainable)
    say(f"full model (backbone + routers, the authors' layout): "
        f"{summary['export']['full_model']}")
  return summary

