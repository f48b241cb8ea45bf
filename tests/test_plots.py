"""Every plot of the reports (eval/report.py, repro/report.py, repro/frontier_report.py), drawn
from small made-up inputs on the Agg backend. In every figure: no two drawn texts overlap, every
axis that has tick labels has a label, the title names the model, and every legend entry has a
mark drawn inside its plot. The checker itself is tested on a figure with each fault."""

import itertools
import json
import os
import sys
import types

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import text as mtext  # noqa: E402
from matplotlib.collections import Collection, LineCollection  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from elastic_jax.errors import ElasticJaxError  # noqa: E402
from elastic_jax.eval import metrics, mixture, report  # noqa: E402
from elastic_jax.repro import frontier_report  # noqa: E402
from elastic_jax.repro import report as repro_report  # noqa: E402

MODEL = "toy-qwen3-6L"
LAYERS, KV_HEADS = 6, 8


# --------------------------------------------------------------------------------------------
# The checker


def _inside(ax, xy) -> bool:
  """Whether any of the display points xy is finite and inside ax (a pixel of slack)."""
  xy = np.asarray(xy, float).reshape(-1, 2)
  box = ax.bbox
  ok = (np.isfinite(xy).all(1) & (xy[:, 0] >= box.x0 - 1) & (xy[:, 0] <= box.x1 + 1)
        & (xy[:, 1] >= box.y0 - 1) & (xy[:, 1] <= box.y1 + 1))
  return bool(ok.any())


def _has_mark(artist, ax, renderer) -> bool:
  """Whether the artist draws something visible inside its axes."""
  if isinstance(artist, BarContainer):
    return any(_has_mark(p, ax, renderer) for p in artist.patches)
  if not artist.get_visible():
    return False
  if isinstance(artist, Line2D):
    styled = artist.get_linestyle() not in ("None", "", " ") or artist.get_marker() not in (
        "None", "", " ", None)
    return styled and _inside(ax, artist.get_transform().transform(artist.get_xydata()))
  if isinstance(artist, LineCollection):
    return any(_inside(ax, artist.get_transform().transform(np.asarray(seg, float)))
               for seg in artist.get_segments() if len(seg))
  if isinstance(artist, Collection):
    offsets = np.asarray(artist.get_offsets(), float)
    sizes = artist.get_sizes() if hasattr(artist, "get_sizes") else [1]
    return (len(offsets) > 0 and (len(sizes) == 0 or np.max(sizes) > 0)
            and _inside(ax, artist.get_offset_transform().transform(offsets)))
  if isinstance(artist, Patch):
    box = artist.get_window_extent(renderer)
    if not np.isfinite([box.x0, box.x1, box.y0, box.y1]).all():
      return False
    w = min(box.x1, ax.bbox.x1) - max(box.x0, ax.bbox.x0)
    h = min(box.y1, ax.bbox.y1) - max(box.y0, ax.bbox.y0)
    return w > 0.5 and h > 0.5
  return True


def problems(fig, drawn: set) -> list[str]:
  """What is wrong with a drawn figure; drawn: the Text artists its last draw drew."""
  out = []
  renderer = fig.canvas.get_renderer()
  texts = [t for t in fig.findobj(mtext.Text)
           if t in drawn and t.get_visible() and t.get_text().strip()]
  boxes = [(t, t.get_window_extent(renderer)) for t in texts]
  for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
    w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
    h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
    if w > 0.5 and h > 0.5:
      out.append(f"text {a.get_text()!r} overlaps text {b.get_text()!r}")
  for ax in fig.axes:
    if not ax.get_visible() or not ax.axison:
      continue
    for which, ticks, label in (("x", ax.get_xticklabels(), ax.get_xlabel()),
                                ("y", ax.get_yticklabels(), ax.get_ylabel())):
      if any(t in drawn and t.get_text().strip() for t in ticks) and not label.strip():
        out.append(f"panel {ax.get_title()!r}: the {which} axis has tick labels but no label")
  suptitle = fig.get_suptitle()
  if MODEL not in suptitle:
    out.append(f"the title {suptitle!r} does not name the model")
  legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
  artists = [(ax, a) for ax in fig.axes
             for a in (*ax.containers, *ax.lines, *ax.collections, *ax.patches)]
  for legend in legends:
    for t in legend.get_texts():
      label = t.get_text()
      marks = [(ax, a) for ax, a in artists if a.get_label() == label]
      if not any(_has_mark(a, ax, renderer) for ax, a in marks):
        out.append(f"legend entry {label!r} has no mark in the plot")
  return out


@pytest.fixture
def figures(monkeypatch):
  """{file name: its problems} of every figure the plot functions save while the test runs
  (each checked as it is saved, then written as usual)."""
  drawn: set = set()
  draw = mtext.Text.draw

  def recording_draw(self, renderer):
    if self.get_visible() and self.get_text():
      drawn.add(self)
    return draw(self, renderer)

  monkeypatch.setattr(mtext.Text, "draw", recording_draw)
  found: dict[str, list[str]] = {}
  save = report.save_figure

  def checking_save(fig, out_dir, name):
    drawn.clear()
    fig.canvas.draw()
    found[name] = problems(fig, set(drawn))
    return save(fig, out_dir, name)

  monkeypatch.setattr(report, "save_figure", checking_save)
  yield found
  plt.close("all")


def test_the_checker_finds_each_fault(figures, tmp_path):
  fig, axes = plt.subplots(2, 1, figsize=(3, 3))
  axes[0].set_xlabel("layer")                      # runs into the next panel's title
  axes[1].set_title("kv (held-out)")
  axes[0].set_ylabel("KV head")
  axes[1].bar([0, 1], [0.0, 0.0], label="full")   # an entry without a mark
  axes[1].bar([0, 1], [0.5, 0.7], label="elastic")
  axes[1].legend()
  fig.suptitle("a figure of no model")
  report.save_figure(fig, str(tmp_path), "bad.png")
  found = figures["bad.png"]
  assert any("overlaps" in p for p in found), found
  assert any("the y axis has tick labels but no label" in p for p in found), found
  assert any("does not name the model" in p for p in found), found
  assert any("'full' has no mark" in p for p in found), found
  assert not any("'elastic' has no mark" in p for p in found), found


# --------------------------------------------------------------------------------------------
# Made-up inputs


def _gates(rng, sparse_share):
  return (rng.random((LAYERS, KV_HEADS)) > sparse_share).astype(int).tolist()


def _mixture_records(rng, ways=("full", "elastic", "sparse", "most-chosen"), n=2):
  """{(way, key): prediction record} over the mixture's ten task cells, n items each."""
  records, items = {}, []
  for task in mixture.TASKS:
    for variant in ("seen", "held-out"):
      length = 384 if variant == "seen" else 896
      for i in range(n):
        key = f"{task}/{variant}/{length}/{i}"
        items.append(types.SimpleNamespace(task=f"{task}@{variant}", key=key))
        for way in ways:
          share = {"full": 0.0, "sparse": 1.0}.get(way, 0.3 if task in mixture.SENSITIVE
                                                   else 0.8)
          g = _gates(rng, share)
          msr = 1 - float(np.mean(g))
          records[(way, key)] = {
              "attention": way, "key": key, "task": f"{task}@{variant}",
              "prediction": "a" if rng.random() < 0.8 else "b", "msr": msr, "esr": msr / 2,
              "gates": g, "prefill_seconds": 0.1 * (1.5 - msr), "cache_bytes": 100.0,
              "dense_cache_bytes": 200.0}
  return records, items


def _summary(records, items):
  score = lambda task, preds, its: 100.0 * float(np.mean([p == "a" for p in preds]))
  return report.summarize(records, items, score, lambda task: mixture.TASK_TYPE[
      task.split("@")[0]])


def _eval_run(tmp_path, name, rng, ways=("full", "elastic", "sparse", "most-chosen")):
  """An `eval.py mixture` output directory: report.json, predictions.jsonl."""
  records, items = _mixture_records(rng, ways)
  out = tmp_path / name
  out.mkdir()
  meta = {"benchmark": "mixture", "model": MODEL, "device": "cpu", "items": len(items),
          "patterns": "fa-ssa"}
  (out / "report.json").write_text(json.dumps({**meta, **_summary(records, items)}))
  (out / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                 for r in records.values()))
  return out, records, items, meta


# --------------------------------------------------------------------------------------------
# The plots


def test_eval_report_plots(figures, tmp_path):
  rng = np.random.default_rng(0)
  records, items = _mixture_records(rng, ("full", "elastic", "sparse", "most-chosen",
                                          "static-gate"))
  meta = {"benchmark": "mixture", "model": MODEL, "device": "cpu", "items": len(items),
          "patterns": "fa-ssa", "routers": "runs/toy/export/elastic_jax"}
  targets = {f"{t}@{v}": (0.3 if t in mixture.SENSITIVE else 1.0) for t in mixture.TASKS
             for v in ("seen", "held-out")}
  summary = _summary(records, items)
  paths = report.write(summary, records, str(tmp_path), "mixture: toy", meta, targets)
  # Elastic minus the static gate over every item, counted here from the records themselves.
  right = lambda way: np.array([records[(way, it.key)]["prediction"] == "a" for it in items])
  want = 100 * float(np.mean(right("elastic").astype(float) - right("static-gate")))
  assert summary["elastic_minus"]["static-gate"]["all"]["diff"] == pytest.approx(want)
  assert "| **every item** |" in (tmp_path / "report.md").read_text()
  assert set(figures) == {"routing_map.png", "msr_per_task.png", "quality_vs_speedup.png"}
  for name, found in figures.items():
    assert not found, (name, found)
    assert str(tmp_path / name) in paths
  # Four tasks (one row of panels), no targets, no routers: the same checks hold.
  figures.clear()
  few = {k: r for k, r in records.items() if r["task"].startswith(("kv", "hop"))}
  few_items = [it for it in items if it.task.startswith(("kv", "hop"))]
  report.plots(_summary(few, few_items), few, str(tmp_path), model=MODEL)
  assert len(figures) == 3 and not any(figures.values()), figures


def test_eval_report_write_names_the_missing_extra(tmp_path, monkeypatch, capsys):
  import importlib.util
  rng = np.random.default_rng(1)
  records, items = _mixture_records(rng, ("full", "elastic"), n=1)
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "matplotlib" else real(name, *a))
  paths = report.write(_summary(records, items), records, str(tmp_path), "t", {"model": MODEL})
  assert [os.path.basename(p) for p in paths] == ["report.json", "report.md"]
  assert "pip install 'elastic-jax[eval]'" in capsys.readouterr().err


@pytest.mark.parametrize("package,call", [
    ("matplotlib", lambda: report.pyplot()),
    ("jieba", lambda: metrics.qa_f1_zh_score("a", "b")),
    ("rouge", lambda: metrics.rouge_score("a", "b")),
])
def test_a_missing_optional_package_names_its_extra(monkeypatch, package, call):
  monkeypatch.setitem(sys.modules, package, None)                 # as if it were not installed
  metrics._jieba.cache_clear()
  metrics._rouge.cache_clear()
  try:
    with pytest.raises(ElasticJaxError, match=rf"needs {package}: pip install "
                                              r"'elastic-jax\[eval\]'$"):
      call()
  finally:
    metrics._jieba.cache_clear()
    metrics._rouge.cache_clear()


def test_repro_report_plots(figures, tmp_path):
  rng = np.random.default_rng(2)
  elastic, *_ = _eval_run(tmp_path, "eval_mixture", rng)
  static, *_ = _eval_run(tmp_path, "eval_static", rng, ("elastic",))
  xa, *_ = _eval_run(tmp_path, "eval_xa", rng, ("sparse", "elastic"))
  out = tmp_path / "plots"
  assert repro_report.main(["--run", f"elastic={elastic}", "--run", f"static-trained={static}",
                            "--run", f"xa={xa}", "--plots", str(out),
                            "--kernel-times", "0:232,0.75:65.4,1:8.12",
                            "--kernel-label", "128K tokens, one GPU"]) == 0
  assert set(figures) == {"quality_vs_sparsity.png", "routing_map.png", "quality_vs_speed.png"}
  for name, found in figures.items():
    assert not found, (name, found)
    assert (out / name).stat().st_size > 0


def test_the_old_name_of_most_chosen_still_reads_and_runs(tmp_path):
  """`static` (the way's name before it became most-chosen) still names it: on the command
  line (with a DeprecationWarning), in a predictions file and in a report written before."""
  from elastic_jax.eval import runner
  with pytest.warns(DeprecationWarning, match="most-chosen"):
    assert runner.check_attention_list(["full", "static"], router_params={}) == [
        "full", "most-chosen"]
  with pytest.raises(ElasticJaxError, match="need trained routers"):
    runner.check_attention_list(["most-chosen"], router_params=None)
  rng = np.random.default_rng(5)
  old, records, items, _ = _eval_run(tmp_path, "old", rng, ("full", "elastic", "static"))
  read = runner.read_predictions(str(old / "predictions.jsonl"))
  assert {w for w, _ in read} == {"full", "elastic", "most-chosen"}
  assert report.summarize(read, items, lambda t, p, i: 100.0 * (p[0] == "a"),
                          lambda t: "x")["attention"].keys() == {"full", "elastic",
                                                                  "most-chosen"}
  # A report.json keyed by the old name (written by hand here: summarize no longer makes one).
  rep = json.loads((old / "report.json").read_text())
  rep["attention"]["static"] = rep["attention"].pop("elastic")
  rep["item_scores"] = {"static": {it.key: 1.0 for it in items}}
  (old / "report.json").write_text(json.dumps(rep))
  got = repro_report.read_run(str(old))
  assert "most-chosen" in got["attention"] and "static" not in got["attention"]
  assert repro_report.rows_of([("elastic", got)])[-1][0] == "Static: elastic's most-chosen heads"


def _scores(rng, n=12):
  items = [{"key": f"{t}/{v}/{384 if v == 'seen' else 896}/{i}", "task": t, "variant": v}
           for t in mixture.TASKS for v in ("seen", "held-out") for i in range(n)]
  bits = lambda p: "".join("1" if x else "0" for x in rng.random(len(items)) < p)
  methods = {"full": {"correct": "1" * len(items), "msr": 0.0},
             "sparse": {"correct": bits(0.5), "msr": 1.0}}
  for t in mixture.TASKS:
    methods[f"task-set/{t}"] = {"correct": bits(0.9), "msr": 0.9,
                                "gates": _gates(rng, 0.9)}
  for run, msr in (("e30", 0.55), ("e70", 0.8)):
    methods[f"{run}/elastic"] = {"correct": bits(0.9), "msr": list(rng.uniform(msr - 0.1,
                                                                               msr + 0.1,
                                                                               len(items)))}
    methods[f"{run}/most-chosen"] = {"correct": bits(0.7), "msr": msr}
    methods[f"{run}/static:s30"] = {"correct": bits(0.6), "msr": msr}
    methods[f"{run}/static:d"] = {"correct": bits(0.8), "msr": msr, "recipe": "duo"}
    methods[f"{run}/greedy-oracle"] = {"correct": bits(0.85), "msr": msr}
  return {"items": items, "seed": 1, "samples": n, "wordings": "templates",
          "evidence": "far", "methods": methods}


def test_frontier_plots(figures, tmp_path):
  rng = np.random.default_rng(3)
  s = frontier_report.Scores(_scores(rng))
  frontier_report.plot(s, ["e30", "e70"], str(tmp_path / "frontier.png"),
                       "The accuracy-sparsity frontier", model=MODEL)
  record = {run: {"steps": [{"step": 10 * k, "saturated": list(rng.random(LAYERS)),
                             "msr_task": {t: float(rng.random()) for t in
                                          ("single_qa", "summarization", "code", "icl")}}
                            for k in range(1, 8)]}
            for run in ("round1/e30", "round1/e70", "round2/e30")}
  frontier_report.training_plot(record, list(record), str(tmp_path / "training.png"),
                                model=MODEL)
  names = list(mixture.TASKS)
  before = np.clip(rng.normal(0.2, 0.5, (5, 5)), -1, 1)
  after = np.clip(rng.normal(0.0, 0.5, (5, 5)), -1, 1)
  frontier_report.similarity_plot(names, before, after, str(tmp_path / "similarity.png"),
                                  "Task representations", model=MODEL, routers="toy routers",
                                  setting="20 items per task and variant")
  assert set(figures) == {"frontier.png", "training.png", "similarity.png"}
  for name, found in figures.items():
    assert not found, (name, found)
    assert (tmp_path / name).stat().st_size > 0
