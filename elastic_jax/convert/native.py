"""Our own on-disk format for a converted backbone: orbax parameters beside the HF config.

    OUT_DIR/
      elastic_jax.json   {"format": "elastic_jax.backbone", "version": 1, "dtype": ...}
      config.json        the HF config the model was converted from (validated again on load)
      params/            orbax checkpoint of the parameter tree
      tokenizer files    copied from the HF directory, if it had any
"""

from __future__ import annotations

import json
import os
import shutil

import jax

from elastic_jax.errors import ElasticJaxError
from elastic_jax.model import check_shapes

MARKER = "elastic_jax.json"
FORMAT = "elastic_jax.backbone"
VERSION = 1
# Files of an HF directory that are not weights but that users of the model need.
_SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
_NOT_SIDE_FILES = {"config.json", "model.safetensors.index.json",
                   "pytorch_model.bin.index.json", MARKER}


def is_our_checkpoint(directory: str) -> bool:
  return os.path.isfile(os.path.join(directory, MARKER))


def copy_side_files(src_dir: str | None, dst_dir: str) -> None:
  """Copies tokenizer/generation files (never weights, never code) from `src_dir`."""
  if not src_dir or not os.path.isdir(src_dir):
    return
  for name in sorted(os.listdir(src_dir)):
    path = os.path.join(src_dir, name)
    if (os.path.isfile(path) and name.endswith(_SIDE_FILE_SUFFIXES)
        and name not in _NOT_SIDE_FILES):
      shutil.copy2(path, os.path.join(dst_dir, name))


def save_params(directory: str, params, hf_config: dict, dtype: str) -> None:
  """Writes params + config into `directory` (which the caller made and will publish)."""
  import orbax.checkpoint as ocp
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(directory, "params"), params)
  ckptr.wait_until_finished()
  with open(os.path.join(directory, MARKER), "w") as f:
    json.dump({"format": FORMAT, "version": VERSION, "dtype": dtype}, f, indent=2)


def read_marker(directory: str) -> dict:
  path = os.path.join(directory, MARKER)
  try:
    with open(path) as f:
      meta = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ElasticJaxError(f"{path}: unreadable ({e})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ElasticJaxError(f"{path}: not an elastic_jax backbone checkpoint")
  if meta.get("version") != VERSION:
    raise ElasticJaxError(f"{path}: format version {meta.get('version')!r} is not supported "
                          f"(this elastic_jax reads version {VERSION})")
  return meta


def restore_params(directory: str, abstract, shardings=None):
  """Restores the parameter tree; `abstract` gives the shapes and target dtypes.

  The saved tree must match `abstract` leaf for leaf (names and shapes); dtypes are cast.
  """
  import orbax.checkpoint as ocp
  path = os.path.join(os.path.abspath(directory), "params")
  if not os.path.isdir(path):
    raise ElasticJaxError(f"{directory}: has no params/ folder")
  ckptr = ocp.StandardCheckpointer()
  try:
    saved = ckptr.metadata(path)
    saved = getattr(saved, "item_metadata", saved)
    saved_shapes = {jax.tree_util.keystr(k): tuple(v.shape)
                    for k, v in jax.tree_util.tree_leaves_with_path(saved)}
  except Exception as e:
    raise ElasticJaxError(f"{path}: unreadable orbax checkpoint ({e})") from None
  want = {jax.tree_util.keystr(k): tuple(v.shape)
          for k, v in jax.tree_util.tree_leaves_with_path(abstract)}
  check_shapes(saved_shapes, want, f"{path}: parameter")
  if shardings is None:
    dev = jax.devices()[0]
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(dev), abstract)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
  try:
    return ckptr.restore(path, target)
  except Exception as e:
    raise ElasticJaxError(f"{path}: could not be restored ({e})") from None
