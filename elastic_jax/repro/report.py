"""The reproduction's results table (the paper's Table 1 layout) and plots, from eval.py runs.

  python -m elastic_jax.repro.report --run elastic=runs/eval_mixture \\
      [--run static-trained=runs/eval_mixture_static] [--run xa=runs/eval_mixture_xa] \\
      --out docs/results_table.md [--plots docs/]

Each --run is LABEL=DIR, DIR an `eval.py mixture` output directory (report.json and
predictions.jsonl). The methods are that directory's ways of attending; LABEL names the routers behind
them: `full` and `sparse` rows come from the first run that has them, `elastic` and `static`
rows are named after LABEL (e.g. the elastic attention of the static-trained routers is the
trained static gate). Cells: accuracy % (MSR) per task type, seen and held-out variants.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from elastic_jax.eval import mixture

METHOD_NAMES = {
    ("*", "full"): "Full attention",
    ("*", "sparse"): "All heads SSA",
    ("elastic", "elastic"): "Elastic (ours)",
    ("elastic", "static"): "Static: elastic's most-chosen heads",
    ("static-trained", "elastic"): "Static gate, trained (no input dependence)",
    ("xa", "sparse"): "All heads XAttention",
    ("xa", "elastic"): "Elastic, FA-XA",
}
VARIANTS = ("seen", "held-out")


def read_run(directory: str) -> dict:
  path = os.path.join(directory, "report.json")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise SystemExit(f"error: {path}: cannot read an eval report ({e})")


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


def plot(runs: list[tuple[str, dict]], elastic_dir: str | None, out_dir: str) -> list[str]:
  from elastic_jax.eval.report import save_figure
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  os.makedirs(out_dir, exist_ok=True)
  written = []
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for ax, group, title in ((axes[0], mixture.SENSITIVE, "sensitive tasks (kv, hop)"),
                           (axes[1], tuple(t for t in mixture.TASKS
                                           if t not in mixture.SENSITIVE),
                            "robust tasks (summary, pattern, fewshot)")):
    markers = iter("osD^v<>phX*")
    for name, body in rows_of(runs):
      pts = [body["tasks"].get(f"{t}@{v}") for t in group for v in VARIANTS]
      pts = [p for p in pts if p]
      if not pts:
        continue
      x, y = np.mean([p["esr"] for p in pts]), np.mean([p["score"] for p in pts])
      ax.scatter([x], [y], s=40, marker=next(markers, "o"), label=name)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("ESR: share of causal attention pruned (last layer)")
    ax.set_xlim(-0.05, 1.05)
  axes[0].set_ylabel("accuracy %")
  # One legend beside the panels: labels never sit on the points, so they cannot collide.
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
  fig.suptitle("quality against attention pruned", fontsize=11)
  written.append(save_figure(fig, out_dir, "quality_vs_sparsity.png"))
  plt.close(fig)
  if elastic_dir:
    recs = []
    with open(os.path.join(elastic_dir, "predictions.jsonl"), encoding="utf-8") as f:
      for line in f:
        if line.strip():
          r = json.loads(line)
          if r["attention"] == "elastic":
            recs.append(r)
    fig, axes = plt.subplots(2, len(mixture.TASKS), figsize=(2.6 * len(mixture.TASKS), 5),
                             squeeze=False)
    im = None
    for j, task in enumerate(mixture.TASKS):
      for i, variant in enumerate(VARIANTS):
        g = [np.asarray(r["gates"], float) for r in recs if r["task"] == f"{task}@{variant}"]
        ax = axes[i, j]
        if not g:
          ax.axis("off")
          continue
        im = ax.imshow(np.mean(g, 0).T, vmin=0, vmax=1, cmap="viridis", origin="lower",
                       aspect="auto")
        ax.set_title(f"{task} ({variant})", fontsize=9)
        ax.set_xlabel("layer", fontsize=8)
        if j == 0:
          ax.set_ylabel("KV head", fontsize=8)
    if im is not None:
      fig.colorbar(im, ax=axes, shrink=0.8, label="share of inputs sent to full attention")
    written.append(save_figure(fig, out_dir, "routing_map.png"))
    plt.close(fig)
  return written


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--run", action="append", required=True, metavar="LABEL=DIR")
  p.add_argument("--out", help="write the table here (Markdown); default: print it")
  p.add_argument("--plots", help="directory for quality_vs_sparsity.png and routing_map.png")
  args = p.parse_args(argv)
  runs, dirs = [], {}
  for spec in args.run:
    label, sep, directory = spec.partition("=")
    if not sep or not directory:
      raise SystemExit(f"error: --run {spec!r}: expected LABEL=DIR")
    runs.append((label, read_run(directory)))
    dirs[label] = directory
  text = table(runs)
  if args.out:
    from elastic_jax.files import atomic_write_text
    atomic_write_text(args.out, text)
  print(text)
  if args.plots:
    for path in plot(runs, dirs.get("elastic"), args.plots):
      print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
