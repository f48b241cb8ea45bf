"""The run configuration of train.py: a YAML file plus dotted overrides -> frozen dataclasses.

    cfg = load_run_config("configs/tiny.yaml", ["train.steps=300", "mesh.fsdp=4"])

Two modules hold it: train/config_schema.py, every section and key with its default, comment
and checks, and what a run derives from them (`RunConfig.checkpoint_dir`,
`RunConfig.mesh_shape`, `ModelSource.resolved_path`, ...); train/config_loader.py, reading a
file and overrides into those dataclasses and writing them back as YAML. This module hands on
the names of both, and the earlier function forms of the derived values.
"""

from __future__ import annotations

from typing import Mapping

from elastic_jax.router import RouterConfig
from elastic_jax.train.config_loader import (INPUT_PATHS, PACKAGE_PREFIX, describe_config,
                                             dump_run_config, load_run_config,
                                             resolve_input_path, run_config_to_dict)
from elastic_jax.train.config_schema import (MOVED, AttnImpl, CheckpointConfig, DataConfig,
                                             ExportConfig, LogConfig, MeshConfig, ModelSource,
                                             RunConfig, SyntheticConfig)
from elastic_jax.train.objective import ObjectiveConfig
from elastic_jax.train.step import TrainConfig

__all__ = [
    "INPUT_PATHS", "MOVED", "PACKAGE_PREFIX", "AttnImpl", "CheckpointConfig", "DataConfig",
    "ExportConfig", "LogConfig", "MeshConfig", "ModelSource", "ObjectiveConfig", "RouterConfig",
    "RunConfig", "SyntheticConfig", "TrainConfig", "check_batch_layout", "describe_config",
    "dump_run_config", "load_run_config", "resolve_input_path", "resolve_mesh_shape",
    "resolve_model_path", "run_config_to_dict"]


def resolve_mesh_shape(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
  """Axis sizes for `sharding.make_mesh`, the -1 axis taking the remaining devices
  (`MeshConfig.axis_sizes`)."""
  return mesh.axis_sizes(n_devices)


def check_batch_layout(cfg: RunConfig, mesh_shape: Mapping[str, int]) -> None:
  """Rows per pass must split over data x fsdp, and seq_len over the sequence axis
  (`DataConfig.check_split`)."""
  cfg.data.check_split(mesh_shape)


def resolve_model_path(model: ModelSource) -> str:
  """The existing file (random init) or directory (checkpoint) that `model.path` names
  (`ModelSource.resolved_path`)."""
  return model.resolved_path
