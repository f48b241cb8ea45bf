"""The frontier's tools (repro/scoring.py, repro/frontier.py, repro/frontier_report.py):
teacher-forced scoring against greedy generation, the greedy head-set ablation against a
known answer, static sets at a budget, and the report's paired figures against a direct
count."""

import json
import os

import numpy as np
import pytest

import elastic_jax as ej
from elastic_jax.eval import mixture
from elastic_jax.generation.generate import SamplingConfig, generate
from elastic_jax.repro import frontier, frontier_report, scoring
from elastic_jax.resources import PACKAGE_DIR

BACKBONE = os.path.join(PACKAGE_DIR, "repro", "backbone")
ROUTERS = os.path.join(PACKAGE_DIR, "repro", "routers")


@pytest.fixture(scope="module")
def model():
  return ej.from_pretrained(BACKBONE, dtype="float32", routers=ROUTERS, show_progress=False)


def test_teacher_forced_scoring_is_greedy_generation(model):
  """An item scores right exactly when greedy generation returns its answer and then EOS, and
  the routers decide the same heads as at generation's prefill."""
  items = scoring.eval_items(7, 2, lengths=(160,), heldout_lengths=(224,))
  sc = scoring.Scorer(model.params, model.config, model.router_config, attn_impl="reference",
                      rows=len(items))
  for attention in ("elastic", "sparse"):
    res = sc.score(items, attention, routers=model.router_params)
    gen = generate(model.params, model.config, [list(it.prompt) for it in items],
                   attention=attention, rcfg=model.router_config,
                   router_params=model.router_params,
                   sampling=SamplingConfig(max_new_tokens=4), eos_ids=(mixture.EOS,),
                   attn_impl="reference")
    for i, it in enumerate(items):
      toks = list(gen.tokens[i])
      want = list(it.answer) + [mixture.EOS]
      assert res["correct"][i] == (toks[:len(want)] == want), (attention, it.key, toks)
    np.testing.assert_allclose(res["msr"], gen.msr, atol=1e-6)
    assert res["correct"].any() and (attention == "elastic" or not res["correct"].all())


class _Needs:
  """A stand-in scorer: an item of task t is right iff every head of t's required set is
  full; its log-probability falls with each missing head (an independent oracle)."""
  cfg = type("C", (), {"num_layers": 3, "num_kv_heads": 4})

  def __init__(self, need):
    self.need = need

  def score(self, items, attention="full", *, gates=None, routers=None):
    n = len(items)
    g = {"full": np.ones((n, 3, 4)), "sparse": np.zeros((n, 3, 4))}.get(attention)
    if g is None:
      g = np.broadcast_to(np.asarray(gates, float), (n, 3, 4))
    missing = np.array([sum(1 - g[i][h] for h in self.need[it.task])
                        for i, it in enumerate(items)])
    return {"correct": missing == 0, "logp": -missing.astype(float),
            "gates": g, "msr": 1 - g.mean((1, 2))}


def test_greedy_ablation_finds_the_needed_heads():
  need = {"kv": [(0, 1), (2, 3)], "summary": []}
  items = [scoring.EvalItem(f"{t}/{i}", t, "seen", np.zeros(3, np.int32),
                            np.zeros(1, np.int32)) for t in need for i in range(4)]
  sc = _Needs(need)
  got = scoring.minimal_head_set(sc, [it for it in items if it.task == "kv"])
  assert sorted(map(tuple, np.argwhere(got["gates"] > 0))) == need["kv"]
  assert got["full"] == 1.0 and got["sparse"] == 0.0 and len(got["path"]) == 10
  assert scoring.minimal_head_set(sc, [it for it in items if it.task == "summary"])[
      "gates"].sum() == 0
  path = scoring.minimal_head_set(sc, items, stop_at=1)["path"]
  assert tuple(path[-1][:2]) in need["kv"] and len(path) == 11


def test_static_sets_at_a_budget():
  scores = np.array([[0.1, 5.0, 3.0], [2.0, -1.0, 0.5]])
  g = scoring.static_at(scores, 0.5, 10)                        # exactly 3 of 6 heads
  assert (g == [[0, 1, 1], [1, 0, 0]]).all()
  g = scoring.static_at(scores, 1 - 3.4 / 6, 10, seed=2)      # 3.4 heads on average
  per_item = g.sum((1, 2))
  assert sorted(set(per_item)) == [3, 4] and per_item.mean() == pytest.approx(3.4)
  assert (g[per_item == 4] == [[0, 1, 1], [1, 0, 1]]).all()   # the next-ranked head added
  assert (1 - g.mean()) == pytest.approx(1 - 3.4 / 6)
  assert scoring.static_at(scores, 1.0, 4).sum() == 0
  assert scoring.static_at(scores, 0.0, 4).sum() == 24


def _scores_file(rng, n=40):
  items = [{"key": f"{t}/{v}/{i}", "task": t, "variant": v}
           for t in mixture.TASKS for v in ("seen", "held-out") for i in range(n)]
  bits = lambda p: "".join("1" if x else "0" for x in rng.random(len(items)) < p)
  return {"items": items, "methods": {
      "full": {"correct": "1" * len(items), "msr": 0.0},
      "sparse": {"correct": bits(0.5), "msr": 1.0},
      "a/elastic": {"correct": bits(0.9), "msr": list(rng.uniform(0.7, 0.9, len(items)))},
      "a/most-chosen": {"correct": bits(0.7), "msr": 0.8},
      "a/static:s1": {"correct": bits(0.6), "msr": 0.8},
      "a/static:s2": {"correct": bits(0.8), "msr": 0.8},
      "a/static:d": {"correct": bits(0.95), "msr": 0.8, "recipe": "duo"},
      "a/greedy-oracle": {"correct": bits(0.85), "msr": 0.8}}}


def test_report_pairs_the_same_items(tmp_path):
  raw = _scores_file(np.random.default_rng(3))
  s = frontier_report.Scores(raw)
  c = {m: np.array([ch == "1" for ch in body["correct"]]) for m, body in raw["methods"].items()}
  held = np.array([it["variant"] == "held-out" and it["task"] in mixture.SENSITIVE
                   for it in raw["items"]])
  assert s.best_trained("a") == max(("a/static:s1", "a/static:s2"),
                                    key=lambda m: c[m][np.array([it["task"] in mixture.SENSITIVE
                                                                 for it in raw["items"]])].mean())
  d = s.paired("a/elastic", "a/greedy-oracle", "held-out", mixture.SENSITIVE)
  assert d["diff"] == pytest.approx(100 * (c["a/elastic"][held].mean()
                                           - c["a/greedy-oracle"][held].mean()))
  assert d["ci95"][0] < d["diff"] < d["ci95"][1]
  path = tmp_path / "scores.json"
  path.write_text(json.dumps(raw))
  from elastic_jax.repro.frontier import main
  out = tmp_path / "frontier.md"
  assert main(["report", str(path), "--out", str(out), "--plot", str(tmp_path / "f.png"),
               "--tables"]) == 0
  text = out.read_text()
  assert f"{d['diff']:+.1f} [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]" in text
  # A baseline's own column (DuoAttention's gate is not among the trained gates); none for
  # PruLong, which this file lacks.
  assert "DuoAttention's recipe" in text and "PruLong" not in text
  assert s.best_trained("a", "duo") == "a/static:d"
  assert (tmp_path / "f.png").stat().st_size > 10_000


def test_pooled_keys_are_what_the_routers_decide_on(model):
  """The router inputs `pooled_keys` returns give, through the router, the very head choices
  of elastic scoring (so Fig. 5's representations are the routers' own)."""
  import jax
  from elastic_jax.router import router_logits
  items = scoring.eval_items(4, 1, lengths=(160,), heldout_lengths=(192,))
  sc = scoring.Scorer(model.params, model.config, model.router_config, attn_impl="reference",
                      rows=len(items))
  pooled = scoring.pooled_keys(sc, items, model.router_params)          # [N, L, K, H]
  gates = sc.score(items, "elastic", routers=model.router_params)["gates"]
  for layer in range(pooled.shape[1]):
    z = np.asarray(router_logits(jax.tree.map(lambda x: x[layer], model.router_params),
                                 jax.numpy.asarray(pooled[:, layer][:, None])))[:, 0]
    np.testing.assert_array_equal(z[..., 1] > z[..., 0], gates[:, layer] > 0)


def test_task_similarity_separates_clusters():
  rng = np.random.default_rng(0)
  shared = rng.normal(size=(1, 2, 3, 8)) * 10                 # a component every item shares
  a, b = rng.normal(size=(1, 2, 3, 8)), rng.normal(size=(1, 2, 3, 8))
  x = np.concatenate([shared + a + 0.1 * rng.normal(size=(6, 2, 3, 8)),
                      shared + b + 0.1 * rng.normal(size=(6, 2, 3, 8))])
  names, sim = frontier_report.task_similarity(x, ["kv"] * 6 + ["summary"] * 6)
  assert names == ["kv", "summary"]
  assert sim[0, 0] > 0.9 and sim[1, 1] > 0.9 and sim[0, 1] < -0.5
  np.testing.assert_allclose(sim, sim.T)


def test_report_sets_score_files_of_the_same_items_side_by_side(tmp_path, capsys):
  """Two rounds' files combine for the runs asked for; a run name both hold with other
  results, or files of other items, are refused."""
  records = os.path.join(os.path.dirname(PACKAGE_DIR), "docs", "records")
  r1, r2 = (os.path.join(records, f"frontier_round{i}.json") for i in (1, 2))
  if not os.path.isfile(r1):
    pytest.skip("the records are not in an installed package")
  out = tmp_path / "kept.md"
  assert frontier.main(["report", r1, r2, "--runs", "boundary100,e80-nocap-lr5e-4",
                        "--out", str(out)]) == 0
  text = out.read_text()
  assert "| boundary100 (0.832) |" in text and "| e80-nocap-lr5e-4 (0.871) |" in text
  with pytest.raises(ej.ElasticJaxError, match="elastic is also in an earlier file"):
    frontier.main(["report", r1, r2])
  other = json.load(open(r2))
  other["items"] = other["items"][1:]
  (tmp_path / "other.json").write_text(json.dumps(other))
  with pytest.raises(ej.ElasticJaxError, match="scores other items"):
    frontier.main(["report", r1, str(tmp_path / "other.json"), "--runs", "boundary100"])


def test_heads_keep_reads_an_earlier_file_of_the_same_settings(tmp_path):
  """`frontier heads --keep`: the tasks of an earlier file with the same settings are kept;
  one made with other settings, or not a heads file, is refused in one sentence."""
  import json

  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.repro.frontier import _earlier_heads
  settings = {"seed": 3, "samples": 64, "tolerance": 0.02, "lengths": 384}
  path = tmp_path / "heads.json"
  assert _earlier_heads(str(path), settings) == {}
  kv = {"gates": [[0, 1]], "size": 1, "full": 1.0, "sparse": 0.1, "path": []}
  path.write_text(json.dumps({**settings, "tasks": {"kv": kv}}))
  assert _earlier_heads(str(path), settings) == {"kv": kv}
  with pytest.raises(ElasticJaxError, match="made with other samples"):
    _earlier_heads(str(path), {**settings, "samples": 32})
  path.write_text("[1, 2]")
  with pytest.raises(ElasticJaxError, match="is not a heads file"):
    _earlier_heads(str(path), settings)
