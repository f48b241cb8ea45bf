"""Fault-tolerant checkpoints of router training, on orbax's CheckpointManager.

    fingerprint = train_fingerprint(model_cfg, run.router, run.objective,
                                    data.state()["fingerprint"])
    with TrainCheckpointer.from_run_config(run, fingerprint) as ckpt, PreemptionGuard() as guard:
      restored = ckpt.resume(state)            # None: start from the initial `state`
      if restored:
        state, data_state, _ = restored
        data.restore(data_state)
      step = int(state.step)
      while step < run.train.steps:
        state, metrics = train_step(state, backbone, next(data), ...)
        step = int(state.step)
        if guard.sync():                       # every process stops at the same step
          break
        ckpt.save(step, state, data.state())   # writes only every checkpoint.every_steps
      ckpt.save(step, state, data.state(), force=True)   # the end or the preemption: on disk

Layout. Only what trains is saved: the TrainState (step, routers, multipliers, optimizer state,
PRNG key; orbax stores a typed key as its key data and rewraps it on restore). The frozen
backbone never is.

    CHECKPOINT_DIR/
      <step>/                        one finished checkpoint
        state/                       the TrainState (orbax StandardSave)
        data/metadata                the data iterator state as JSON ({} = none, e.g. synthetic)
        meta/metadata                JSON: format, version, step, fingerprint, run_config, time,
                                     checksum (sha256 of the state's arrays, checked at restore)
        commit_success.txt           orbax's finalize marker, written before the final rename
      <step>.orbax-checkpoint-tmp-*  a save in progress, or one killed midway: never read

Atomicity. Orbax writes a step into a temporary directory and renames it when complete. A step
directory without commit_success.txt (e.g. a partial copy) is not a checkpoint either: it is
never listed, restored or pruned, and is moved aside (to <step>.incomplete-<ns>) if a save
needs its name. Leftover temporary directories are removed when a checkpointer opens the dir.

Resuming (checkpoint.resume). auto: the latest finished checkpoint, if any; require: the same,
but none is an error; fresh: a directory that already holds checkpoints is an error. A latest
checkpoint that cannot be read is an error under every policy, never a silent fallback to an
older step (that would redo steps and then collide with the newer one); the message names the
step to move aside. A checkpoint written for another model, router, objective or data
(`train_fingerprint`), or whose arrays do not match the expected state, is an error too. The
train config (learning rate, steps, ...) may change between runs.

Saves never overwrite: a step that another run wrote, or one below the latest step on disk,
is refused (unless it is the step this run restored or saved itself, which is a no-op).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import threading
import time
from typing import Any, Iterator, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from elastic_jax.config import ModelConfig
from elastic_jax.errors import ElasticJaxError
from elastic_jax.router import RouterConfig, init_router_params
from elastic_jax.train.objective import ObjectiveConfig
from elastic_jax.train.run_config import CheckpointConfig, RunConfig, run_config_to_dict
from elastic_jax.train.step import TrainState

log = logging.getLogger(__name__)

FORMAT = "elastic_jax.train_checkpoint"
VERSION = 1
COMMIT_FILE = "commit_success.txt"        # orbax's per-step finalize marker
_FINGERPRINT_NAMES = {"model": "model config", "router": "router config",
                      "router_shapes": "router parameter shapes", "objective": "objective",
                      "data": "training data"}
_MISSING = object()


def _plain(obj: Any) -> Any:
  """JSON-plain copy (tuples become lists), as it reads back from disk."""
  return json.loads(json.dumps(obj))


def train_fingerprint(cfg: ModelConfig, rcfg: RouterConfig, ocfg: ObjectiveConfig,
                      data_fingerprint: str | None = None) -> dict[str, Any]:
  """What must match between a checkpoint and the run that resumes it.

  data_fingerprint: `TrainData.state()["fingerprint"]`, or None for synthetic batches.
  """
  shapes = jax.eval_shape(lambda: init_router_params(cfg, rcfg, jax.random.key(0)))
  return _plain({"model": dataclasses.asdict(cfg), "router": dataclasses.asdict(rcfg),
                 "router_shapes": {k: list(v.shape) for k, v in sorted(shapes.items())},
                 "objective": dataclasses.asdict(ocfg), "data": data_fingerprint})


def _difference(saved: Any, current: Any, key: str) -> str | None:
  """The first dotted key where two JSON values differ, as 'key: saved X, now Y'."""
  if isinstance(saved, dict) and isinstance(current, dict):
    for k in list(current) + [k for k in saved if k not in current]:
      diff = _difference(saved.get(k, _MISSING), current.get(k, _MISSING), f"{key}.{k}")
      if diff:
        return diff
    return None
  if saved == current:
    return None
  show = lambda v: "nothing" if v is _MISSING else json.dumps(v)[:80]
  return f"{key}: saved {show(saved)}, now {show(current)}"


# ----------------------------------------------------------------------------------------------
# Step directories: only committed ones count.


class _CommittedSteps(ocp.step.NameFormat):
  """orbax's standard step names (`<step>`), listing only steps with a commit marker."""

  def __init__(self):
    self.base = ocp.step.standard_name_format()

  def build_name(self, step: int) -> str:
    return self.base.build_name(step)

  def find_all(self, base_path) -> Iterator[Any]:
    return (m for m in self.base.find_all(base_path) if _committed(m.path))

  def find_step(self, base_path, step: int):
    metadata = self.base.find_step(base_path, step)
    if not _committed(metadata.path):
      raise ValueError(f"{metadata.path} has no {COMMIT_FILE}: not a finished checkpoint")
    return metadata

  def __str__(self):
    return f"CommittedSteps({self.base})"


def _committed(path) -> bool:
  return (epath.Path(path) / COMMIT_FILE).exists()


def _path_name(path) -> str:
  """'opt_state.inner_states.router.inner_state.1.0.mu.router.route_w1' for a tree path."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return ".".join(parts)


def _describe(shape, dtype) -> str:
  return f"{np.dtype(dtype).name}[{', '.join(map(str, shape))}]"


def _stored_spec(leaf) -> tuple[tuple[int, ...], np.dtype]:
  """Shape and dtype as orbax stores the leaf (a typed PRNG key as its uint32 key data)."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
  return tuple(leaf.shape), np.dtype(leaf.dtype)


def _abstract(tree):
  """ShapeDtypeStructs with shardings; a leaf without one goes to the first local device."""
  default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def one(x):
    sharding = getattr(x, "sharding", None) or default
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(one, tree)


def _scalar(x) -> int:
  """A replicated scalar array as an int (also when it spans several processes)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_shards[0].data
  return int(np.asarray(jax.device_get(x)))


def state_checksum(state) -> str:
  """sha256 over every array of a TrainState (names, dtypes, shapes, bytes): written into a
  checkpoint's metadata at save and checked after restore, so that damaged bytes (a size-
  preserving corruption the storage layer does not notice) are found instead of trained on."""
  import hashlib
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      leaf = leaf.addressable_data(0)
    arr = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
    h.update(f"{_path_name(path)}|{arr.dtype.str}|{arr.shape}|".encode())
    h.update(arr.tobytes())
  return h.hexdigest()


def _reason(e: BaseException) -> str:
  """One short line from an orbax / tensorstore exception: the system's words for a write the
  place refused (`files.write_failure`: a full disk, a read-only folder), else its first line."""
  from elastic_jax.files import write_failure
  found = write_failure(e)
  if found is not None:
    return found[0]
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = text.split(" [tensorstore_spec", 1)[0].split("[tensorstore_spec", 1)[0].strip()
  if len(text) > 300:
    text = text[:297] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ----------------------------------------------------------------------------------------------
# The checkpointer


class TrainCheckpointer:
  """Saves and restores (TrainState, data iterator state, metadata) under `directory`.

  config: keep (most recent checkpoints kept), every_steps (0 = forced saves only),
  async_save, resume (see the module docstring). fingerprint: `train_fingerprint(...)` of this
  run; a checkpoint restores only if its fingerprint is equal. run_config: recorded in each
  checkpoint's metadata for reference (a RunConfig or its dict).
  """

  def __init__(self, directory: str | epath.PathLike, config: CheckpointConfig = CheckpointConfig(),
               *, fingerprint: Mapping[str, Any],
               run_config: RunConfig | Mapping[str, Any] | None = None):
    text = os.fspath(directory)
    self.directory = epath.Path(text if "://" in text else os.path.abspath(text))
    if self.directory.exists() and not self.directory.is_dir():
      raise ElasticJaxError(f"{self.directory}: checkpoint dir exists and is not a directory")
    self.config = config
    self.fingerprint = _plain(dict(fingerprint))
    if isinstance(run_config, RunConfig):
      run_config = run_config_to_dict(run_config)
    self.run_config = _plain(run_config) if run_config is not None else None
    self._known: set[int] = set()        # steps this object saved or restored
    self._closed = False
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler()}
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.keep, enable_async_checkpointing=config.async_save,
        step_name_format=_CommittedSteps(), cleanup_tmp_directories=True, create=True)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options,
                                            item_handlers=handlers)
    except OSError as e:
      raise ElasticJaxError(f"{self.directory}: cannot open the checkpoint dir ({_reason(e)})"
                            ) from None

  @classmethod
  def from_run_config(cls, cfg: RunConfig, fingerprint: Mapping[str, Any]) -> TrainCheckpointer:
    """A checkpointer in cfg.checkpoint_dir with cfg.checkpoint's settings."""
    return cls(cfg.checkpoint_dir, cfg.checkpoint, fingerprint=fingerprint, run_config=cfg)

  # -- listing ---------------------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Steps of the finished checkpoints (and of saves this object has in flight), ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(step)

  # -- saving ----------------------------------------------------------------------------------

  def should_save(self, step: int) -> bool:
    """Whether `save(step, ...)` without force writes: every `every_steps`, once per step."""
    every = self.config.every_steps
    return every > 0 and step % every == 0 and step not in self._known

  def save(self, step: int, state: TrainState, data_state: Mapping[str, Any] | None = None, *,
           force: bool = False) -> bool:
    """Writes a checkpoint of `state` (whose step must be `step`) if due; True if it did.

    force: write whatever `every_steps` says (preemption, end of training) and return only
    once it is on disk. A step this object saved or restored already is not written again.
    With async_save, an unforced save returns once the arrays are copied off the devices.
    """
    self._check_open()
    if not isinstance(state, TrainState):
      raise TypeError(f"save() takes the TrainState (what trains), got {type(state).__name__}")
    step = int(step)
    if step in self._known:
      if force:
        self.wait_until_finished()
      return False
    if not force and not self.should_save(step):
      return False
    if _scalar(state.step) != step:
      raise ValueError(f"save(step={step}) was given a TrainState at step {_scalar(state.step)}")
    if data_state is not None and not isinstance(data_state, Mapping):
      raise TypeError(f"data_state must be a dict (TrainData.state()), got "
                      f"{type(data_state).__name__}")
    data_json = _plain(dict(data_state or {}))
    existing = self.all_steps()
    if existing and step <= existing[-1]:
      raise ElasticJaxError(
          f"{self.directory}: already holds checkpoint step {existing[-1]}, at or after step "
          f"{step} that this run would save; refusing to overwrite it or to save behind it (use "
          f"another checkpoint.dir, or move the newer steps aside)")
    self._move_aside_incomplete(step)
    meta = {"format": FORMAT, "version": VERSION, "step": step, "fingerprint": self.fingerprint,
            "run_config": self.run_config, "checksum": state_checksum(state),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "process_count": jax.process_count()}
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=ocp.args.JsonSave(data_json), meta=ocp.args.JsonSave(meta))
    try:
      self._manager.save(step, args=args, force=True)
    except Exception as e:  # noqa: BLE001 - a full disk, a lost mount: one sentence
      raise ElasticJaxError(f"{self.directory}: checkpoint step {step} could not be written "
                            f"({_reason(e)}); earlier checkpoints are intact") from None
    self._known.add(step)
    if force or not self.config.async_save:
      self.wait_until_finished()
    log.info("checkpoint step %d %s %s", step,
             "written to" if force or not self.config.async_save else "being written to",
             self.step_dir(step))
    return True

  def _move_aside_incomplete(self, step: int) -> None:
    """A step dir without a commit marker (not a checkpoint) that blocks saving `step`."""
    path = self.step_dir(step)
    if jax.process_index() != 0 or not path.exists() or _committed(path):
      return
    aside = path.parent / f"{path.name}.incomplete-{time.time_ns()}"
    log.warning("%s has no %s (an unfinished or partly copied checkpoint); moving it to %s",
                path, COMMIT_FILE, aside)
    path.rename(aside)

  def wait_until_finished(self) -> None:
    """Blocks until every save in flight is on disk; a background save that failed (a full
    disk, a lost mount) is reported in one sentence."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise ElasticJaxError(f"{self.directory}: a checkpoint could not be written "
                            f"({_reason(e)}); earlier checkpoints are intact") from None

  def close(self) -> None:
    """Finishes the saves in flight and releases orbax's threads; idempotent."""
    if not self._closed:
      self._closed = True
      try:
        self.wait_until_finished()
      finally:
        self._manager.close()

  def __enter__(self) -> TrainCheckpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError(f"checkpointer of {self.directory} is closed")

  # -- restoring -------------------------------------------------------------------------------

  def resume(self, abstract_state) -> tuple[TrainState, dict | None, dict] | None:
    """Applies checkpoint.resume: the restored (state, data_state, metadata), or None to start
    fresh. `abstract_state`: as for `restore` (e.g. the freshly initialised state)."""
    self._check_open()
    self.wait_until_finished()
    self._manager.reload()
    steps = self.all_steps()
    policy = self.config.resume
    if policy == "fresh":
      if steps:
        raise ElasticJaxError(
            f"{self.directory}: already holds checkpoints (steps {', '.join(map(str, steps))}) "
            f"and checkpoint.resume is 'fresh'; pick another checkpoint.dir or use "
            f"checkpoint.resume=auto to continue from step {steps[-1]}")
      return None
    if not steps:
      if policy == "require":
        raise ElasticJaxError(f"{self.directory}: holds no finished checkpoint to resume from "
                              f"(checkpoint.resume is 'require')")
      return None
    restored = self.restore(steps[-1], abstract_state)
    log.info("resumed from checkpoint step %d in %s", steps[-1], self.directory)
    return restored

  def restore(self, step: int | None = None, abstract_state=None
              ) -> tuple[TrainState, dict | None, dict]:
    """(TrainState, data_state or None, metadata) of checkpoint `step` (None: the latest).

    abstract_state: the TrainState of this run as ShapeDtypeStructs or arrays; the restored
    arrays get their shardings (a leaf without one: the first local device). A checkpoint whose
    arrays, shapes or dtypes differ from it, whose fingerprint differs from this run's, or that
    cannot be read raises ElasticJaxError naming the step directory and the item.
    """
    self._check_open()
    if abstract_state is None:
      raise TypeError("restore() needs abstract_state (the TrainState of this run, abstract or "
                      "concrete)")
    self.wait_until_finished()
    self._manager.reload()
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise ElasticJaxError(f"{self.directory}: holds no finished checkpoint")
      step = steps[-1]
    elif step not in steps:
      have = ", ".join(map(str, steps)) or "none"
      raise ElasticJaxError(f"{self.directory}: has no finished checkpoint of step {step} "
                            f"(finished steps: {have})")
    step = int(step)
    try:
      items = self._manager.restore(step, args=ocp.args.Composite(
          data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
      meta, data_state = items["meta"], items["data"]
    except Exception as e:  # noqa: BLE001 - any failure to read is a damaged checkpoint
      raise self._unreadable(step, steps, e) from None
    self._check_meta(step, meta)
    if not isinstance(data_state, dict):
      raise self._unreadable(step, steps, ValueError("data item is not a JSON object"))
    target = _abstract(abstract_state)
    self._check_state(step, steps, target)
    try:
      state = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target)))["state"]
    except Exception as e:  # noqa: BLE001
      raise self._unreadable(step, steps, e) from None
    if "checksum" in meta and state_checksum(state) != meta["checksum"]:
      raise self._unreadable(step, steps, ValueError(
          "its arrays do not match the checksum written when it was saved"))
    self._known.add(step)
    return state, (data_state or None), meta

  def _unreadable(self, step: int, steps: list[int], e: BaseException) -> ElasticJaxError:
    older = [s for s in steps if s < step]
    hint = (f"; move it out of {self.directory} to resume from step {older[-1]}" if older
            else "")
    return ElasticJaxError(f"{self.step_dir(step)}: checkpoint step {step} is unreadable, "
                           f"truncated or damaged ({_reason(e)}){hint}")

  def _check_meta(self, step: int, meta: Any) -> None:
    where = f"{self.step_dir(step)}: checkpoint step {step}"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise ElasticJaxError(f"{where} is not an elastic_jax training checkpoint")
    if meta.get("version") != VERSION:
      raise ElasticJaxError(f"{where} has format version {meta.get('version')!r}; this "
                            f"elastic_jax reads version {VERSION}")
    saved = meta.get("fingerprint")
    saved = saved if isinstance(saved, dict) else {}
    for item in list(self.fingerprint) + [k for k in saved if k not in self.fingerprint]:
      diff = _difference(saved.get(item, _MISSING), self.fingerprint.get(item, _MISSING), item)
      if diff:
        raise ElasticJaxError(
            f"{where} was saved for a different {_FINGERPRINT_NAMES.get(item, item)} ({diff}); "
            f"resume with the settings it was saved with, or use another checkpoint.dir")

  def _check_state(self, step: int, steps: list[int], target) -> None:
    """The saved arrays must be exactly the target's, with equal shapes and dtypes."""
    try:
      saved_tree = self._manager.item_metadata(step)["state"]
      if saved_tree is None:
        raise FileNotFoundError(f"no array metadata in {self.step_dir(step) / 'state'}")
      saved = {_path_name(p): (tuple(m.shape), np.dtype(m.dtype))
               for p, m in jax.tree_util.tree_leaves_with_path(saved_tree)}
    except Exception as e:  # noqa: BLE001
      raise self._unreadable(step, steps, e) from None
    want = {_path_name(p): _stored_spec(x)
            for p, x in jax.tree_util.tree_leaves_with_path(target)}
    where = f"{self.step_dir(step)}: checkpoint step {step}"
    for name in want:
      if name not in saved:
        raise ElasticJaxError(f"{where} has no state item '{name}' that this run's TrainState "
                              f"has (saved by other training code?)")
      if saved[name] != want[name]:
        raise ElasticJaxError(f"{where} has state item '{name}' as {_describe(*saved[name])}, "
                              f"this run expects {_describe(*want[name])}")
    extra = sorted(set(saved) - set(want))
    if extra:
      raise ElasticJaxError(f"{where} has state item '{extra[0]}' that this run's TrainState "
                            f"does not have (saved by other training code?)")


# ----------------------------------------------------------------------------------------------
# Preemption


class PreemptionGuard:
  """Turns SIGTERM / SIGINT into a flag that the training loop polls (`requested`, `sync()`).

  The handlers only set the flag, so a signal never interrupts a step or a save; the loop saves
  (forced) and exits cleanly. A second SIGINT while one is pending is handled as before the
  guard (Ctrl-C twice interrupts at once); repeated SIGTERMs only keep the flag. The previous
  handlers come back on exit. Enter it in the main thread.
  """

  def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
    self.signals = tuple(signals)
    self.received: int | None = None   # the first signal number caught
    self._previous: dict[int, Any] = {}

  @property
  def requested(self) -> bool:
    return self.received is not None

  def _handle(self, signum, frame) -> None:
    if self.received is None:
      self.received = signum
      return
    if signum == signal.SIGINT:
      previous = self._previous.get(signum, signal.SIG_DFL)
      if callable(previous):
        previous(signum, frame)
      elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

  def __enter__(self) -> PreemptionGuard:
    if threading.current_thread() is not threading.main_thread():
      raise RuntimeError("PreemptionGuard must be entered in the main thread (signal handlers "
                         "can only be installed there)")
    self.received = None
    for s in self.signals:
      self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, previous in self._previous.items():
      signal.signal(s, previous if previous is not None else signal.SIG_DFL)
    self._previous.clear()

  def sync(self) -> bool:
    """Whether to stop now: this process's flag, or on a multi-process run whether any process
    caught a signal (a collective: every process must call it at the same steps)."""
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.asarray(self.requested, np.int32))
    return bool(np.any(np.asarray(flags)))
