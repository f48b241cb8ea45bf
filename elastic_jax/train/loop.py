"""The router-training run behind train.py: the loop over steps, with checkpoints, progress,
metrics, the held-out MSR report and the final exports. Set-up (preflight, mesh, backbone,
data) is train/setup.py; reporting is train/metrics.py.

Every process runs this same code (`jax.distributed` for many hosts). The backbone is loaded
once, sharded over the mesh by its logical axes and never saved; only the routers, the
multipliers, the optimizer state, the step and the data order are checkpointed, so a resumed
run continues bit-exactly. SIGTERM or SIGINT make the run save at the end of the current step
and stop cleanly. A step whose loss or gradient is not finite stops the run before anything
from it is saved.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from elastic_jax import router_io
from elastic_jax.config import ModelConfig, read_config_file, read_hf_config
from elastic_jax.errors import ElasticJaxError
from elastic_jax.files import DirectoryLock, atomic_write_text
from elastic_jax.model import forward_routed_jit
from elastic_jax.router import msr
from elastic_jax.tasks import TASK_TYPES
from elastic_jax.train.checkpointing import PreemptionGuard, TrainCheckpointer, train_fingerprint
from elastic_jax.train.metrics import Metrics, progress_line, say, step_record
from elastic_jax.train.config_loader import dump_run_config
from elastic_jax.train.config_schema import RunConfig
from elastic_jax.train.setup import (EXPORT_MANIFEST, abstract_train_state, batch_sharding,
                                     check_export_target, data_fingerprint, export_targets,
                                     files_under, load_backbone, make_data, mesh_layout,
                                     preflight, read_export_manifest, to_global)
from elastic_jax.train.step import all_finite, init_train_state, train_step


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
                                  rules=rules, packed=cfg.train.packed,
                                  num_segments=b["task_ids"].shape[-1])
    m = np.asarray(multihost_utils.process_allgather(msr(stats["gate"]), tiled=True))
    tasks = np.asarray(multihost_utils.process_allgather(b["task_ids"], tiled=True))
    valid = tasks >= 0
    np.add.at(sums, tasks[valid], m[valid])
    np.add.at(counts, tasks[valid], 1)
  return {TASK_TYPES[t]: float(sums[t] / counts[t]) for t in range(len(TASK_TYPES))
          if counts[t]}


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
  data = make_data(cfg, mcfg.vocab_size, train_path)
  say(f"backbone {mcfg.family}: {mcfg.num_layers} layers x {mcfg.num_kv_heads} KV heads, "
      f"{jax.tree.leaves(backbone)[0].dtype}, loaded in {time.perf_counter() - t0:.1f}s; mesh "
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
  step_kw = dict(cfg=mcfg, rcfg=cfg.router, ocfg=cfg.objective, tcfg=cfg.train,
                 attn_impl=cfg.model.attn_impl, remat=cfg.model.remat, rules=rules,
                 mlp_chunk=cfg.model.mlp_chunk)
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
        say(progress_line(last, steps, getattr(data, "task_names", None)))
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
      atomic_write_text(os.path.join(cfg.log_dir, "eval.json"), json.dumps(
          {"step": summary["step"], "msr_task": summary["eval_msr"],
           "targets": dict(zip(TASK_TYPES, cfg.objective.targets))}, indent=1))
  if jax.process_index() == 0:
    summary["export"] = export(cfg, mcfg, backbone, jax.device_get(state.trainable))
  return summary


def export(cfg: RunConfig, mcfg: ModelConfig, backbone, trainable: dict) -> dict[str, str]:
  """Writes what cfg.export asks for under cfg.export_dir (router_io's layouts; the full
  model in the authors' layout); returns {layout: path}. A layout that cannot hold these
  routers is said, not written. Each folder is written whole or not at all, and replaces only
  what a train run exported there (`setup.check_export_target`); a failure (a full disk) says
  so in one sentence, keeping the checkpoint the routers come from."""
  export_dir = cfg.export_dir
  created = not os.path.exists(export_dir)
  try:
    return _export(cfg, mcfg, backbone, trainable)
  except BaseException as e:
    with contextlib.suppress(OSError):
      if created and set(os.listdir(export_dir)) <= {EXPORT_MANIFEST}:
        with contextlib.suppress(FileNotFoundError):   # leave no empty export folder behind
          os.remove(os.path.join(export_dir, EXPORT_MANIFEST))
        os.rmdir(export_dir)
    if not isinstance(e, ElasticJaxError):
      raise
    raise ElasticJaxError(f"{e}; the trained routers are kept in the last checkpoint "
                          f"({cfg.checkpoint_dir}), and the same command exports them again"
                          ) from None


def _export(cfg: RunConfig, mcfg: ModelConfig, backbone, trainable: dict) -> dict[str, str]:
  routers = router_io.Routers(trainable["router"], cfg.router, trainable["lambdas"])
  targets = export_targets(cfg)
  manifest = read_export_manifest(cfg.export_dir)
  paths = {}

  def write(layout: str, save) -> None:
    target = targets[layout]
    check_export_target(cfg, layout, target, manifest)
    paths[layout] = save(target)
    manifest[os.path.basename(target)] = files_under(target)
    atomic_write_text(os.path.join(cfg.export_dir, EXPORT_MANIFEST),
                      json.dumps(manifest, indent=1) + "\n")

  if cfg.export.ours:
    write("ours", lambda d: router_io.save_routers(d, routers, mcfg,
                                                   targets=cfg.objective.targets))
  problem = router_io.authors_layout_problem(cfg.router)
  if cfg.export.authors and problem:
    say(f"note: export.authors skipped: {problem}")
  elif cfg.export.authors:
    write("authors", lambda d: router_io.save_routers_authors(d, routers, mcfg))
  if cfg.export.full_model:
    from elastic_jax.elastic_model import ElasticModel, save_pretrained
    path = cfg.model.resolved_path
    raw = (read_config_file(path) if cfg.model.random_init else read_hf_config(path))[1]
    model = ElasticModel(mcfg, backbone, raw,
                         source_dir=None if cfg.model.random_init else path,
                         router_params=routers.params, router_config=routers.config,
                         lambdas=routers.lambdas)

    def save_full(d):
      save_pretrained(model, d, overwrite=True)
      return d
    write("full_model", save_full)
  return paths
