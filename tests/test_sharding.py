"""The logical axis names really shard the model: same logits on an 8-device CPU mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import sharding
from elastic_jax.config import config_from_hf_dict
from elastic_jax.model import abstract_params, forward, init_params, positions_and_segments

CFG = config_from_hf_dict(dict(model_type="llama", vocab_size=64, hidden_size=32,
                               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=128))


@pytest.mark.parametrize("mesh_shape", [{"fsdp": 2, "tensor": 4}, {"data": 2, "fsdp": 4},
                                        {"data": 8}])
def test_sharded_forward_matches_single_device(mesh_shape):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  params = init_params(CFG, jax.random.key(0), "float32")
  ids = jax.random.randint(jax.random.key(1), (8, 24), 0, 64)
  pos, seg = positions_and_segments(jnp.ones((8, 24), jnp.int32))
  want = forward(params, ids, pos, seg, cfg=CFG)

  mesh = sharding.make_mesh(mesh_shape)
  shapes, axes = abstract_params(CFG, "float32")
  shardings = sharding.param_shardings(axes, mesh, shapes)
  sharded = jax.device_put(params, shardings)
  if "fsdp" in mesh_shape:  # the embedding axis really is split
    assert sharded["layers"]["mlp"]["up_kernel"].sharding.spec[1] == "fsdp"
  rules = sharding.rules_for(mesh)
  with jax.set_mesh(mesh):
    got = forward(sharded, ids, pos, seg, cfg=CFG, rules=rules)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_bad_mesh_is_refused():
  with pytest.raises(ValueError, match="needs 6 devices"):
    sharding.make_mesh({"data": 2, "tensor": 3})
  with pytest.raises(ValueError, match="unknown mesh axis 'pipe'"):
    sharding.make_mesh({"pipe": 8})
