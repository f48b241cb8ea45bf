"""The reproduction's results table (the paper's Table 1 layout) and plots, from eval.py runs.

  python -m elastic_jax.repro.report --run elastic=runs/eval_mixture \\
      [--run static-trained=runs/eval_mixture_static] [--run xa=runs/eval_mixture_xa] \\
      --out docs/results_table.md [--plots docs/] [--kernel-times 0:232,0.75:65.4,1:8.12]

Each --run is LABEL=DIR, DIR an `eval.py mixture` output directory (report.json and
predictions.jsonl; another benchmark's run is refused), each LABEL once. The methods are that
directory's ways of attending; LABEL names the routers behind them: `full` and `sparse` rows
come from the first run that has them, `elastic` and `most-chosen` rows are named after LABEL
(e.g. the elastic attention of the static-trained routers is the trained static gate). Cells:
accuracy % (MSR) per task type, seen and held-out variants.

Then, where the runs evaluated the same items (same --seed, --samples, --lengths and
--heldout-lengths): elastic against every other method, paired over those items, with 95%
intervals (eval/report.py's `paired_difference`), and the paper's targets, each met or missed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval import mixture
from elastic_jax.heads import canonical

METHOD_NAMES = {
    ("*", "full"): "Full attention",
    ("*", "sparse"): "All heads SSA",
    ("elastic", "elastic"): "Elastic (ours)",
    ("elastic", "most-chosen"): "Static: elastic's most-chosen heads",
    ("static-trained", "elastic"): "Static gate, trained (no input dependence)",
    ("xa", "sparse"): "All heads XAttention",
    ("xa", "elastic"): "Elastic, FA-XA",
}
VARIANTS = ("seen", "held-out")


def read_run(directory: str) -> dict:
  """An `eval.py mixture` run's report.json; refused in one sentence when it is another
  benchmark's, or has no finished task of the mixture."""
  path = os.path.join(directory, "report.json")
  try:
    with open(path, encoding="utf-8") as f:
      rep = json.load(f)
  except (OSError, ValueError) as e:
    raise ElasticJaxError(f"{path}: cannot read an eval report ({e})") from None
  benchmark = rep.get("benchmark") if isinstance(rep, dict) else None
  if benchmark not in (None, "mixture"):
    raise ElasticJaxError(f"{path}: a report of `eval.py {benchmark}`, not of `eval.py "
                          "mixture`, the only runs this table is made from")
  cells = {f"{t}@{v}" for t in mixture.TASKS for v in VARIANTS}
  bodies = rep.get("attention") if isinstance(rep, dict) else None
  if not isinstance(bodies, dict) or not any(
      isinstance(b, dict) and cells & set(b.get("tasks") or ()) for b in bodies.values()):
    raise ElasticJaxError(f"{path}: holds no finished task of the mixture "
                          f"({', '.join(mixture.TASKS)}), so it is no `eval.py mixture` report "
                          "this table can be made from")
  # A report written before a way was renamed (static -> most-chosen) reads as today's.
  for part in ("attention", "item_scores"):
    if isinstance(rep.get(part), dict):
      rep[part] = {canonical(way, warn=False): body for way, body in rep[part].items()}
  return rep


def rows_of(runs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
  """(method name, body of one way of attending) in table order, each method once."""
  rows, seen = [], set()
  for label, rep in runs:
    for way, body in rep["attention"].items():
      key = (label, way)
      name = METHOD_NAMES.get(key) or METHOD_NAMES.get(("*", way)) or f"{label}: {way}"
      if ("*", way) in METHOD_NAMES and label != "xa":
        key = ("*", way)
      if key in seen:
        continue
      seen.add(key)
      rows.append((name, body))
  return rows


def cell(tasks: dict, task: str, variant: str) -> tuple[float, float] | None:
  row = tasks.get(f"{task}@{variant}")
  return None if row is None else (row["score"], row["msr"])


def table(runs: list[tuple[str, dict]]) -> str:
  head = [f"{mixture.TASK_TYPE[t]} ({t})" for t in mixture.TASKS]
  lines = []
  for variant in VARIANTS:
    lines += [f"**{variant}** — each cell: accuracy % (MSR)", "",
              "| method | " + " | ".join(head) + " | sensitive avg | robust avg | MSR avg |",
              "|---|" + "---|" * (len(head) + 3)]
    for name, body in rows_of(runs):
      cells = [cell(body["tasks"], t, variant) for t in mixture.TASKS]
      if all(c is None for c in cells):
        continue
      sens = [c[0] for t, c in zip(mixture.TASKS, cells) if c and t in mixture.SENSITIVE]
      rob = [c[0] for t, c in zip(mixture.TASKS, cells) if c and t not in mixture.SENSITIVE]
      msr = [c[1] for c in cells if c]
      lines.append(f"| {name} | " + " | ".join(
          "-" if c is None else f"{c[0]:.1f} ({c[1]:.2f})" for c in cells)
          + f" | {np.mean(sens):.1f} | {np.mean(rob):.1f} | {np.mean(msr):.2f} |")
    lines.append("")
  return "\n".join(lines)


def method_items(runs: list[tuple[str, dict]]) -> dict[str, dict[str, float]]:
  """{method name: {item key: score}} from the runs' per-item scores (as `rows_of` names them)."""
  out: dict[str, dict[str, float]] = {}
  for label, rep in runs:
    for way, scores in rep.get("item_scores", {}).items():
      name = (METHOD_NAMES.get((label, way)) or METHOD_NAMES.get(("*", way))
              or f"{label}: {way}")
      out.setdefault(name, scores)
  return out


def _paired(a: dict[str, float], b: dict[str, float], task: str, variant: str):
  """Paired difference a - b over the items of task@variant both scored, or None."""
  from elastic_jax.eval.report import paired_difference
  prefix = f"{task}/{variant}/"
  keys = sorted(k for k in a if k.startswith(prefix) and k in b)
  return (paired_difference([a[k] for k in keys], [b[k] for k in keys]), len(keys)) if keys \
      else None


def paired_table(runs: list[tuple[str, dict]]) -> str:
  """Elastic minus each other method per task and variant, paired over the same items."""
  scores = method_items(runs)
  mine = scores.get(METHOD_NAMES[("elastic", "elastic")])
  if mine is None:
    return ""
  others = [m for m in scores if m != METHOD_NAMES[("elastic", "elastic")]]
  lines = ["Elastic minus each method, paired over the same items: difference in points "
           "[95% interval].", "",
           "| cell | n | " + " | ".join(f"− {m}" for m in others) + " |",
           "|---|---|" + "---|" * len(others)]
  for task in mixture.TASKS:
    for variant in VARIANTS:
      cells, n = [], 0
      for m in others:
        got = _paired(mine, scores[m], task, variant)
        if got is None:
          cells.append("-")
          continue
        d, n = got
        cells.append(f"{d['diff']:+.1f} [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]")
      if n:
        lines.append(f"| {task} {variant} | {n} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def targets(runs: list[tuple[str, dict]], sensitive_max: float = 0.75,
            robust_min: float = 0.9, margin: float = 2.0) -> list[dict]:
  """The paper's claims as checks on these runs, one per (claim, variant): met or missed, with
  the figures behind the verdict."""
  rows = dict(rows_of(runs))
  scores = method_items(runs)
  el_name, full_name = METHOD_NAMES[("elastic", "elastic")], METHOD_NAMES[("*", "full")]
  el, full = rows.get(el_name), rows.get(full_name)
  if el is None or full is None:
    return []
  out = []
  robust = [t for t in mixture.TASKS if t not in mixture.SENSITIVE]
  for variant in VARIANTS:
    def task_rows(tasks, body=el):
      return {t: body["tasks"].get(f"{t}@{variant}") for t in tasks
              if body["tasks"].get(f"{t}@{variant}")}
    rob, sens = task_rows(robust), task_rows(mixture.SENSITIVE)
    if rob:
      f = task_rows(robust, full)
      ok = all(r["msr"] >= robust_min and f[t]["score"] - r["score"] <= margin
               for t, r in rob.items())
      out.append({"variant": variant, "claim": f"robust tasks: elastic MSR >= {robust_min} "
                  f"and accuracy within {margin:g} points of full", "met": ok,
                  "figures": ", ".join(f"{t} MSR {r['msr']:.2f}, {r['score'] - f[t]['score']:+.1f}"
                                       for t, r in rob.items())})
    if not sens:
      continue
    out.append({"variant": variant, "claim": f"sensitive tasks: elastic MSR <= {sensitive_max}",
                "met": all(r["msr"] <= sensitive_max for r in sens.values()),
                "figures": ", ".join(f"{t} {r['msr']:.2f}" for t, r in sens.items())})
    figs, ok = [], True
    for t in sens:
      got = _paired(scores[full_name], scores[el_name], t, variant)
      if got is None:
        ok = False
        continue
      d = got[0]
      ok &= d["diff"] <= margin and d["ci95"][0] <= 0 <= d["ci95"][1]
      figs.append(f"{t} {d['diff']:+.1f} [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]")
    out.append({"variant": variant, "claim": f"sensitive tasks: full - elastic <= {margin:g} "
                "points, its paired interval including 0", "met": ok and bool(figs),
                "figures": ", ".join(figs)})
    for other, claim, want in (
        (METHOD_NAMES[("*", "sparse")], "sensitive tasks: elastic above all heads SSA "
         "(paired interval excluding 0)", None),
        (METHOD_NAMES[("static-trained", "elastic")], "sensitive tasks: elastic above the "
         "trained static gate at equal average MSR (paired interval excluding 0)", None),
        (METHOD_NAMES[("elastic", "most-chosen")], "sensitive tasks: elastic above its own "
         "most-chosen heads at equal average MSR (paired interval excluding 0)", None)):
      if other not in scores:
        continue
      figs, ok = [], True
      for t in sens:
        got = _paired(scores[el_name], scores[other], t, variant)
        if got is None:
          ok = False
          continue
        d = got[0]
        ok &= d["ci95"][0] > 0
        figs.append(f"{t} {d['diff']:+.1f} [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]")
      out.append({"variant": variant, "claim": claim, "met": ok and bool(figs),
                  "figures": ", ".join(figs)})
  return out


def targets_table(checks: list[dict]) -> str:
  if not checks:
    return ""
  lines = ["| variant | claim | met | figures |", "|---|---|---|---|"]
  lines += [f"| {c['variant']} | {c['claim']} | {'**met**' if c['met'] else 'missed'} | "
            f"{c['figures']} |" for c in checks]
  return "\n".join(lines) + "\n"


def parse_kernel_times(text: str) -> list[tuple[float, float]]:
  """'MSR:ms,MSR:ms,...' (measured attention times at some MSRs) -> sorted pairs; MSR 0 and 1
  must be among them so that every MSR in between interpolates."""
  try:
    pts = sorted((float(a), float(b)) for a, b in (x.split(":") for x in text.split(",")))
  except ValueError:
    raise ElasticJaxError(f"--kernel-times {text!r}: expected MSR:ms pairs, e.g. "
                     "0:232,0.75:65.4,1:8.12") from None
  if not all(np.isfinite(x) for pair in pts for x in pair):
    raise ElasticJaxError(f"--kernel-times {text!r}: MSRs and times must be finite numbers")
  if pts[0][0] != 0.0 or pts[-1][0] != 1.0 or any(ms <= 0 for _, ms in pts):
    raise ElasticJaxError("--kernel-times needs MSR 0 and 1 and positive times")
  return pts


def describe(runs: list[tuple[str, dict]]) -> tuple[str, str, str]:
  """(model, routers, setting) of the runs, for figure titles: the models their reports name,
  the runs' labels (which name the routers) and the mixture's prompt lengths and item count,
  read off the items' keys (TASK/VARIANT/LENGTH/INDEX)."""
  models = sorted({str(rep.get("model")) for _, rep in runs if rep.get("model")})
  lengths: dict[str, set[str]] = {}
  items: set[str] = set()
  for _, rep in runs:
    for scores in rep.get("item_scores", {}).values():
      for key in scores:
        parts = key.split("/")
        items.add(key)
        if len(parts) == 4:
          lengths.setdefault(parts[1], set()).add(parts[2])
  sizes = ", ".join(f"{v} {','.join(sorted(lengths[v], key=int))} tokens" for v in VARIANTS
                    if v in lengths and all(x.isdigit() for x in lengths[v]))
  setting = "task mixture" + (f": {sizes}" if sizes else "") + (
      f"; {len(items)} items" if items else "")
  return (", ".join(models) or None, ", ".join(label for label, _ in runs), setting)


def _regime_panels(runs, x_of, xlabel: str, title: str, out_dir: str, name: str,
                   log_x: bool = False, about: tuple | None = None) -> str:
  """Accuracy of each method (sensitive and robust tasks, one panel each, seen and held-out
  variants averaged) against x_of(its task rows); one legend below the panels, so labels
  never sit on the points. about: (model, routers, setting) for the title (default: the
  runs' own, `describe`)."""
  from elastic_jax.eval.report import figure_title, pyplot, save_figure
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True, layout="constrained")
  legend: dict[str, object] = {}
  for ax, group, panel in ((axes[0], mixture.SENSITIVE, "sensitive tasks (kv, hop)"),
                           (axes[1], tuple(t for t in mixture.TASKS
                                           if t not in mixture.SENSITIVE),
                            "robust tasks (summary, pattern, fewshot)")):
    markers = iter("osD^v<>phX*")
    for i, (method, body) in enumerate(rows_of(runs)):
      pts = [body["tasks"].get(f"{t}@{v}") for t in group for v in VARIANTS]
      pts = [p for p in pts if p]
      marker = next(markers, "o")
      if not pts:
        continue
      mark = ax.scatter([x_of(pts)], [np.mean([p["score"] for p in pts])], s=40,
                        marker=marker, color=f"C{i % 10}", label=method)
      legend.setdefault(method, mark)
    ax.set_title(panel, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=8 if "\n" in xlabel else None)
    if log_x:
      ax.set_xscale("log")
    else:
      ax.set_xlim(-0.05, 1.05)
  axes[0].set_ylabel("accuracy (%)")
  fig.legend(list(legend.values()), list(legend), fontsize=8, loc="outside lower center",
             ncols=min(3, len(legend)))
  fig.suptitle(figure_title(title, *(about or describe(runs))), fontsize=10)
  path = save_figure(fig, out_dir, name)
  plt.close(fig)
  return path


def plot_kernel_speed(runs, kernel: list[tuple[float, float]], label: str, out_dir: str,
                      model: str | None = None, routers: str | None = None,
                      setting: str | None = None) -> str:
  """Accuracy (sensitive and robust tasks) against the attention speed-up over full that the
  method's average MSR buys at the scale the kernel times were measured (interpolated
  between measured MSRs). model, routers, setting: for the title (default: the runs' own)."""
  ms, ts = np.array([p[0] for p in kernel]), np.array([p[1] for p in kernel])
  speedup = lambda pts: ts[0] / float(np.interp(np.mean([p["msr"] for p in pts]), ms, ts))
  return _regime_panels(runs, speedup, "attention speed-up over full at the method's MSR (x)"
                        + (f"\n{label}" if label else ""),
                        "Quality against measured attention speed", out_dir,
                        "quality_vs_speed.png", log_x=True,
                        about=_about(runs, model, routers, setting))


def _about(runs, model, routers, setting) -> tuple:
  own = describe(runs)
  return (model or own[0], routers or own[1], setting or own[2])


def read_elastic_records(directory: str) -> list[dict]:
  """The elastic attention's prediction records of a run (its predictions.jsonl)."""
  path = os.path.join(directory, "predictions.jsonl")
  recs = []
  try:
    with open(path, encoding="utf-8") as f:
      for line in f:
        if line.strip():
          r = json.loads(line)
          if r.get("attention") == "elastic":
            recs.append(r)
  except (OSError, ValueError) as e:
    raise ElasticJaxError(f"{path}: cannot read the run's predictions ({e})") from None
  return recs


def plot(runs: list[tuple[str, dict]], elastic_dir: str | None, out_dir: str,
         model: str | None = None, routers: str | None = None,
         setting: str | None = None) -> list[str]:
  """quality_vs_sparsity.png and, from elastic_dir's predictions, routing_map.png. model,
  routers, setting: for the titles (default: the runs' own, `describe`; the routing map's
  routers: those of the run labelled elastic)."""
  from elastic_jax.eval.report import figure_title, heatmap_grid, pyplot, save_figure
  plt = pyplot()
  os.makedirs(out_dir, exist_ok=True)
  about = _about(runs, model, routers, setting)
  written = [_regime_panels(runs, lambda pts: np.mean([p["esr"] for p in pts]),
                            "ESR (share of causal attention pruned, last layer)",
                            "Quality against attention pruned", out_dir,
                            "quality_vs_sparsity.png", about=about)]
  if elastic_dir:
    recs = read_elastic_records(elastic_dir)
    panels = []
    for variant in VARIANTS:
      for task in mixture.TASKS:
        g = [np.asarray(r["gates"], float) for r in recs if r["task"] == f"{task}@{variant}"]
        panels.append((f"{task} ({variant})", np.mean(g, 0) if g else None))
    if any(v is not None for _, v in panels):
      fig = heatmap_grid(plt, panels, len(mixture.TASKS),
                         figure_title("Routing map of the elastic attention", about[0],
                                      routers or "elastic", about[2]),
                         "share of inputs sent to full attention (0-1)")
      written.append(save_figure(fig, out_dir, "routing_map.png"))
      plt.close(fig)
  return written


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--run", action="append", required=True, metavar="LABEL=DIR")
  p.add_argument("--out", help="write the table here (Markdown); default: print it")
  p.add_argument("--plots", help="directory for quality_vs_sparsity.png and routing_map.png")
  p.add_argument("--kernel-times", metavar="MSR:MS,...",
                 help="measured attention times at several MSRs (0 and 1 among them), e.g. "
                      "the 128K forward of benchmarks/README.md: also plots quality against "
                      "the speed-up each method's MSR buys (quality_vs_speed.png)")
  p.add_argument("--kernel-label", default="",
                 help="where --kernel-times were measured (printed on the plot's axis)")
  args = p.parse_args(argv)
  # Every argument checked before anything is written.
  kernel = parse_kernel_times(args.kernel_times) if args.kernel_times else None
  if kernel and not args.plots:
    raise ElasticJaxError("--kernel-times draws a plot: pass --plots DIR too")
  from elastic_jax.files import atomic_write_text, check_creatable
  if args.out:
    if os.path.isdir(args.out):
      raise ElasticJaxError(f"--out {args.out}: is a directory; name the table's file")
    check_creatable(os.path.dirname(os.path.abspath(args.out)), "--out's folder")
  if args.plots:
    check_creatable(args.plots, "--plots")
  runs, dirs = [], {}
  for spec in args.run:
    label, sep, directory = spec.partition("=")
    if not sep or not directory:
      raise ElasticJaxError(f"--run {spec!r}: expected LABEL=DIR")
    if label in dirs:
      raise ElasticJaxError(f"--run {spec!r}: the label {label!r} is given twice (also "
                            f"{label}={dirs[label]}); give every run its own label")
    runs.append((label, read_run(directory)))
    dirs[label] = directory
  if args.plots and "elastic" in dirs:
    read_elastic_records(dirs["elastic"])       # readable before anything is written
  text = table(runs)
  extra = [x for x in (paired_table(runs), targets_table(targets(runs))) if x]
  text = "\n".join([text, *extra])
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    atomic_write_text(args.out, text)
  print(text)
  if args.plots:
    paths = plot(runs, dirs.get("elastic"), args.plots)
    if kernel:
      paths.append(plot_kernel_speed(runs, kernel, args.kernel_label, args.plots))
    for path in paths:
      print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
