"""The schema of train.py's run configuration: one frozen dataclass per section, their defaults
(the paper's recipe, docs/method.md §7) and the checks each section makes of its own fields.

    RunConfig(model, router, objective, train, mesh, data, checkpoint, log, export, seed, run_dir)

Each setting has one key: how the backbone runs is model.attn_impl and model.remat, the segment
slots of a row are data.max_segments. Keys that moved or went away are named with where they
went (`MOVED`). The values that a run derives from the config (output folders, the model file
or folder, the mesh's axis sizes, micro-batch passes) are properties and methods here, so that
set-up code reads them off the config. Reading YAML and overrides into these objects is
train/config_loader.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Literal, Mapping

from elastic_jax.errors import ElasticJaxError
from elastic_jax.resources import CONFIGS_DIR
from elastic_jax.router import RouterConfig
from elastic_jax.sharding import MESH_AXES
from elastic_jax.train.objective import ObjectiveConfig
from elastic_jax.train.step import TrainConfig

# Must match the keys of `elastic_jax.attention.IMPLS | HYBRID_IMPLS` (a test checks).
AttnImpl = Literal["auto", "reference", "dense", "pallas_gpu", "mosaic_gpu", "pallas_tpu"]


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """The frozen backbone."""
  path: str                          # HF or converted model dir, or a config JSON (e.g.
                                     # tiny_qwen3.json, looked up in configs/) for random init
  dtype: Literal["bfloat16", "float32", "float16", "auto"] = "auto"  # backbone parameters;
                                     # auto: the checkpoint's own dtype
  attn_impl: AttnImpl = "auto"       # attention kernels (elastic_jax.attention); auto = fused
  remat: bool = True                 # rematerialise each layer in the backward pass
  mlp_chunk: int = 0                 # > 0: each layer's MLP this many tokens at a time, each
                                     # chunk rematerialised (long rows: the backward pass
                                     # holds one chunk's [chunk, intermediate] activations)

  def __post_init__(self):
    if not self.path:
      raise ValueError("model path must not be empty")
    if isinstance(self.mlp_chunk, bool) or self.mlp_chunk < 0:
      raise ValueError(f"model.mlp_chunk must be an integer >= 0, got {self.mlp_chunk!r}")

  @property
  def random_init(self) -> bool:
    """A config JSON names a randomly initialised model; anything else is a checkpoint dir."""
    return self.path.endswith(".json")

  @functools.cached_property
  def resolved_path(self) -> str:
    """The existing file (random init) or directory (checkpoint) that `path` names, looked up
    on first use. A config JSON that is not found as given is looked up in the shipped
    configs/."""
    if self.random_init:
      for candidate in (self.path, os.path.join(CONFIGS_DIR, self.path)):
        if os.path.isfile(candidate):
          return candidate
      raise ElasticJaxError(f"model.path '{self.path}': no such config JSON (looked here and "
                            f"in {CONFIGS_DIR})")
    if not os.path.isdir(self.path):
      raise ElasticJaxError(f"model.path '{self.path}': no such model directory (download or "
                            "convert the checkpoint there, or pass model.path=DIR)")
    return self.path


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh axis sizes (elastic_jax.sharding); -1 on one axis = the remaining devices."""
  data: int = 1                      # pure data parallelism (parameters replicated)
  fsdp: int = -1                     # batch split, parameters sharded (ZeRO-3 style)
  sequence: int = 1                  # tokens split (sequence parallelism for long rows)
  tensor: int = 1                    # heads / MLP split

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    bad = [a for a, n in sizes.items() if n < 1 and n != -1]
    if bad:
      raise ValueError(f"mesh axis '{bad[0]}' must be a positive size or -1, got {sizes[bad[0]]}")
    if sum(n == -1 for n in sizes.values()) > 1:
      raise ValueError("at most one mesh axis may be -1 (the remaining devices)")

  def axis_sizes(self, n_devices: int) -> dict[str, int]:
    """Axis sizes for `sharding.make_mesh` over `n_devices`, the -1 axis taking the rest."""
    sizes = {a: getattr(self, a) for a in MESH_AXES}
    fixed = 1
    for n in sizes.values():
      fixed *= n if n != -1 else 1
    text = " ".join(f"{a}={n}" for a, n in sizes.items())
    free = [a for a, n in sizes.items() if n == -1]
    if free:
      if n_devices % fixed:
        raise ElasticJaxError(f"mesh {text}: the fixed axes use {fixed} devices, which does "
                              f"not divide the {n_devices} available")
      sizes[free[0]] = n_devices // fixed
    elif fixed != n_devices:
      raise ElasticJaxError(f"mesh {text} uses {fixed} devices but {n_devices} are available "
                            "(set one axis to -1 to take the rest)")
    return sizes


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """Synthetic two-task batches (train/synthetic.py), used when data.train_path is null."""
  prompt_frac: float = 0.75          # share of each row that is prompt (the rest is answer)
  eval_batches: int = 4              # held-out batches for the before/after MSR report

  def __post_init__(self):
    if not 0.0 < self.prompt_frac < 1.0:
      raise ValueError(f"synthetic prompt_frac must lie in (0, 1), got {self.prompt_frac}")
    if self.eval_batches < 0:
      raise ValueError(f"synthetic eval_batches must be >= 0, got {self.eval_batches}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Training and evaluation data, packed into rows of seq_len tokens."""
  train_path: str | None = None      # JSONL of task-tagged samples, or the authors' parquet
                                     # data (a file or a directory); null = synthetic batches
  eval_path: str | None = None       # the same, for held-out evaluation; null = none
  tokenizer: str | None = None       # tokenizer dir; null = the model dir
  seq_len: int = 65536               # tokens per packed row
  global_batch: int = 48             # rows per optimizer step
  micro_batch: int | None = None     # rows per forward/backward pass, gradients accumulated
                                     # over global_batch / micro_batch passes; null = all
  max_segments: int = 8              # segment slots per row, slot 0 being padding: a row
                                     # packs up to max_segments - 1 samples
  overlong: Literal["truncate_middle", "skip"] = "truncate_middle"  # a sample > seq_len
  shuffle_seed: int = 0              # order of the samples
  use_chat_template: bool | Literal["auto"] = "auto"  # auto: if the tokenizer has one
  synthetic: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)  # no data

  def __post_init__(self):
    if self.seq_len < 2:
      raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
    if self.global_batch < 1 or self.max_segments < 2:
      raise ValueError(f"global_batch must be >= 1 and max_segments >= 2 (slot 0 is padding), "
                       f"got {self.global_batch} and {self.max_segments}")
    if self.micro_batch is not None and (self.micro_batch < 1
                                         or self.global_batch % self.micro_batch):
      raise ValueError(f"micro_batch ({self.micro_batch}) must be a positive divisor of "
                       f"global_batch ({self.global_batch})")

  @property
  def rows_per_pass(self) -> int:
    return self.micro_batch or self.global_batch

  @property
  def micro_steps(self) -> int | None:
    """Forward/backward passes per optimizer step; None when one pass takes the whole batch."""
    if self.micro_batch and self.micro_batch < self.global_batch:
      return self.global_batch // self.micro_batch
    return None

  def check_split(self, mesh_shape: Mapping[str, int]) -> None:
    """Rows per pass must split over data x fsdp, and seq_len over the sequence axis."""
    rows = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
    if self.rows_per_pass % rows:
      which = "micro_batch" if self.micro_batch else "global_batch"
      raise ElasticJaxError(f"data.{which} ({self.rows_per_pass}) must be a multiple of "
                            f"mesh data x fsdp ({rows})")
    seq = mesh_shape.get("sequence", 1)
    if self.seq_len % seq:
      raise ElasticJaxError(f"data.seq_len ({self.seq_len}) must be a multiple of "
                            f"mesh.sequence ({seq})")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Periodic checkpoints of what trains (routers, multipliers, optimizer state, step)."""
  dir: str | None = None             # null = RUN_DIR/checkpoints
  every_steps: int = 50              # save every this many steps (and at the end); 0 = end only
  keep: int = 2                      # most recent checkpoints kept
  async_save: bool = True            # write in the background while training continues
  resume: Literal["auto", "require", "fresh"] = "auto"  # auto: from the latest if any;
                                     # require: fail if none; fresh: refuse a dir that has some

  def __post_init__(self):
    if self.every_steps < 0 or self.keep < 1:
      raise ValueError(f"checkpoint every_steps must be >= 0 and keep >= 1, got "
                       f"{self.every_steps} and {self.keep}")


@dataclasses.dataclass(frozen=True)
class LogConfig:
  """Progress lines and metric files."""
  every_steps: int = 10              # print and record metrics every this many steps
  jsonl: bool = True                 # append metrics to LOG_DIR/metrics.jsonl
  tensorboard: bool = False          # also write TensorBoard event files
  dir: str | None = None             # null = RUN_DIR

  def __post_init__(self):
    if self.every_steps < 1:
      raise ValueError(f"log every_steps must be >= 1, got {self.every_steps}")


@dataclasses.dataclass(frozen=True)
class ExportConfig:
  """What is written at the end of training."""
  ours: bool = True                  # routers + multipliers + router config, our format
  authors: bool = True               # the same under the authors' names (docs/method.md §9),
                                     # when their layout can express the router
  full_model: bool = False           # also the backbone with the routers merged in, the
                                     # authors' full-model layout (EXPORT_DIR/full_model)
  dir: str | None = None             # null = RUN_DIR/export
  overwrite: bool = False            # replace an export folder holding files that no train
                                     # run exported there (else the run refuses it up front)


# Keys of earlier versions and where their setting lives now.
MOVED = {"train.attn_impl": "set model.attn_impl", "train.remat": "set model.remat",
         "router.max_segments": "set data.max_segments",
         "router.setting": "renamed router.patterns",
         "log.eval_every_steps": "removed: the held-out MSR is reported at the end of a run",
         "data.mixture": "removed: write the task mixture with python -m elastic_jax.eval.mixture "
                         "OUT_DIR and name OUT_DIR/train.jsonl in data.train_path"}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything one training run needs."""
  model: ModelSource                 # the frozen backbone
  router: RouterConfig = RouterConfig()          # routing and the SSA pattern
  objective: ObjectiveConfig = ObjectiveConfig()  # target MSR per task type
  train: TrainConfig = TrainConfig()  # optimizer, schedules
  mesh: MeshConfig = MeshConfig()    # device mesh
  data: DataConfig = DataConfig()    # data and batch layout
  checkpoint: CheckpointConfig = CheckpointConfig()  # periodic checkpoints and resuming
  log: LogConfig = LogConfig()       # progress and metrics
  export: ExportConfig = ExportConfig()  # final router export
  seed: int = 0                      # router/multiplier init and Gumbel noise
  run_dir: str = "runs/train"        # everything the run writes, unless a section says else

  @property
  def log_dir(self) -> str:
    return self.log.dir or self.run_dir

  @property
  def checkpoint_dir(self) -> str:
    return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")

  @property
  def export_dir(self) -> str:
    return self.export.dir or os.path.join(self.run_dir, "export")

  @property
  def tokenizer_dir(self) -> str | None:
    """data.tokenizer, else the model dir; None for a random model with no tokenizer named."""
    return self.data.tokenizer or (None if self.model.random_init else self.model.path)

  def mesh_shape(self, n_devices: int) -> dict[str, int]:
    """The mesh's axis sizes over `n_devices`, checked to split the batch layout."""
    shape = self.mesh.axis_sizes(n_devices)
    self.data.check_split(shape)
    return shape
