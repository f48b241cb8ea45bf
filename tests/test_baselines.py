"""DuoAttention's and PruLong's recipes (repro/baselines.py): the hard-concrete mask against
sampling, DuoAttention's loss at its start, and both command lines end to end on a tiny
random backbone."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import router_io
from elastic_jax.repro import baselines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def test_hard_concrete_matches_its_expected_l0():
  log_alpha = jnp.asarray([-3.0, -0.5, 0.0, 1.0, 4.0])
  u = jax.random.uniform(jax.random.key(0), (200_000, 5), minval=1e-6, maxval=1 - 1e-6)
  z = baselines.hard_concrete(jnp.broadcast_to(log_alpha, u.shape), u)
  assert float(z.min()) == 0.0 and float(z.max()) == 1.0
  np.testing.assert_allclose(np.asarray((z > 0).mean(0)),
                             np.asarray(baselines.kept_probability(log_alpha)), atol=0.005)


@pytest.mark.parametrize("recipe", ["duo", "prulong"])
def test_recipes_train_and_export_a_ranked_static_gate(tmp_path, recipe, capsys):
  run = tmp_path / recipe
  argv = [recipe, "--config", TINY, "train.steps=3", "log.every_steps=1", "train.lr=5e-2",
          f"run_dir={run}"] + (["--records", "0", "--l1", "0.5"] if recipe == "duo"
                                else ["--target", "0.9"])
  assert baselines.main(argv) == 0
  r = router_io.load_routers(run / "export" / "elastic_jax")
  assert r.config.static and r.params["static_logits"].shape[-1] == 2
  import json
  rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
  assert [x["step"] for x in rows] == [1, 2, 3]
  gates = np.asarray(rows[-1]["gates"])
  margin = np.asarray(r.params["static_logits"])[..., 1]
  np.testing.assert_allclose(margin, gates - 0.5 if recipe == "duo" else gates, atol=1e-4)
  if recipe == "duo":
    # alpha starts at 1, where the mixed model is the full one (up to rounding): the first
    # step's loss is the L1 term alone, and the L1 weight then pulls every alpha down.
    assert rows[0]["distill"] < 1e-8 and rows[0]["loss"] == pytest.approx(0.5 * margin.size)
    assert (gates < 1).all() and (gates >= 0).all()
  else:
    assert rows[-1]["expected_streaming"] > rows[0]["expected_streaming"]
    assert rows[-1]["l1"] < 0          # ascent: the target is above the expected share
