"""Per-task reports (JSON and Markdown, the paper's Table 1 layout) and plots (PNG).

Plots: the routing map (how often each (layer, KV head) pair went to full attention under the
elastic attention, one panel per task; paper Fig. 6), MSR per task (with the routers' target
per task where it is known), and quality against prefill speed-up over full attention (paper
Fig. 8). Labels are legends, never text placed at the points, so they cannot collide; every
figure is laid out by matplotlib's constrained layout and titled with the model, the routers
and the setting it shows. The plots need matplotlib (pip install 'elastic-jax[eval]'); without
it `write` writes the reports and says the plots were left out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from typing import Callable, Mapping, Sequence

import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval.runner import AFTER_ELASTIC, ORDER
from elastic_jax.files import atomic_file, atomic_write_text

PLOTS_NEED = "drawing the plots needs matplotlib: pip install 'elastic-jax[eval]'"


Z95 = 1.959963984540054


def interval(scores) -> tuple[float, float]:
  """95% interval of a task's score from its items' scores (each 0-100): Wilson's for
  exact-match scores (every item 0 or 100), else the normal one of the mean."""
  x = np.asarray(scores, float)
  n = len(x)
  if n == 0:
    return float("nan"), float("nan")
  if np.isin(x, (0.0, 100.0)).all():
    p, z2 = x.mean() / 100, Z95 ** 2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return float(100 * (centre - half)), float(100 * (centre + half))
  half = Z95 * x.std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
  return float(x.mean() - half), float(x.mean() + half)


def paired_difference(a, b) -> dict:
  """Mean of a - b over the same items, with a 95% interval. Exact-match scores (every item 0
  or 100): Bonett and Price's adjusted Wald interval for paired proportions (one pseudo-item
  added to each kind of discordant pair, so it neither collapses to a point when no pair
  differs nor leaves [-100, 100]); else the normal interval of the paired differences (nan
  bounds for fewer than two items)."""
  a, b = np.asarray(a, float), np.asarray(b, float)
  d = a - b
  n = len(d)
  if n and np.isin(a, (0.0, 100.0)).all() and np.isin(b, (0.0, 100.0)).all():
    p12 = (np.count_nonzero(d > 0) + 1) / (n + 2)
    p21 = (np.count_nonzero(d < 0) + 1) / (n + 2)
    centre = p12 - p21
    half = Z95 * np.sqrt(max(p12 + p21 - centre ** 2, 0.0) / (n + 2))
    lo, hi = max(-1.0, centre - half), min(1.0, centre + half)
    return {"diff": float(d.mean()), "ci95": [float(100 * lo), float(100 * hi)]}
  half = Z95 * d.std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
  return {"diff": float(d.mean()), "ci95": [float(d.mean() - half), float(d.mean() + half)]}


def summarize(records: Mapping[tuple[str, str], dict], items, score_task: Callable,
              category_of: Callable[[str], str]) -> dict:
  """{"attention": {way: {"tasks": {task: {score, ci95, msr, msr_sd, esr, n, patterns,
  vs_full, prefill_seconds, ...}}, "categories": {...}, "average": {...}}}, "item_scores":
  {way: {item key: score}}} from the
  prediction records (way: how heads attended, heads.ATTENTION). ci95: the score's 95%
  interval (`interval`); vs_full: the paired difference to full attention over the same
  items (`paired_difference`); patterns: how many distinct routing decisions (gates over
  all layers and KV heads) the task's items got; msr_sd: the spread of MSR across them."""
  by_task: dict[str, list] = {}
  for it in items:
    by_task.setdefault(it.task, []).append(it)
  ways = [s for s in ORDER if any(k[0] == s for k in records)]
  out: dict = {"attention": {}}
  item_scores: dict[tuple[str, str], list[float]] = {}
  for s in ways:
    tasks = {}
    for task, its in by_task.items():
      recs = [records[(s, it.key)] for it in its if (s, it.key) in records]
      if len(recs) != len(its):
        continue
      item_scores[(s, task)] = [float(score_task(task, [r["prediction"]], [it]))
                                for r, it in zip(recs, its)]
      gates = [tuple(np.asarray(r["gates"]).round().astype(int).ravel().tolist())
               for r in recs if r.get("gates") is not None]
      tasks[task] = {
          "score": float(score_task(task, [r["prediction"] for r in recs], its)),
          "ci95": list(interval(item_scores[(s, task)])),
          "msr": float(np.mean([r["msr"] for r in recs])),
          "msr_sd": float(np.std([r["msr"] for r in recs])),
          "patterns": len(set(gates)),
          "esr": float(np.mean([r["esr"] for r in recs])),
          "n": len(recs), "category": category_of(task),
          "prefill_seconds": float(np.sum([r["prefill_seconds"] for r in recs])),
          "cache_bytes": float(np.mean([r["cache_bytes"] for r in recs])),
          "dense_cache_bytes": float(np.mean([r["dense_cache_bytes"] for r in recs]))}
    cats: dict[str, list] = {}
    for t in tasks.values():
      cats.setdefault(t["category"], []).append(t)
    mean = lambda rows, key: float(np.mean([r[key] for r in rows])) if rows else float("nan")
    out["attention"][s] = {
        "tasks": tasks,
        "categories": {c: {"score": mean(rows, "score"), "msr": mean(rows, "msr"),
                           "esr": mean(rows, "esr")} for c, rows in cats.items()},
        "average": {"score": mean(list(tasks.values()), "score"),
                    "msr": mean(list(tasks.values()), "msr"),
                    "esr": mean(list(tasks.values()), "esr"),
                    "prefill_seconds": float(sum(t["prefill_seconds"] for t in tasks.values()))}}
  # Per item, for paired comparisons across runs (elastic_jax.repro.report): {way: {key: score}}.
  out["item_scores"] = {s: {} for s in ways}
  for task, its in by_task.items():
    for s in ways:
      for it, x in zip(its, item_scores.get((s, task), ())):
        out["item_scores"][s][it.key] = x
  full = out["attention"].get("full")
  for s, body in out["attention"].items():
    for task, row in body["tasks"].items():
      if full and s != "full" and ("full", task) in item_scores:
        row["vs_full"] = paired_difference(item_scores[(s, task)], item_scores[("full", task)])
    body["average"]["prefill_speedup_vs_full"] = (
        full["average"]["prefill_seconds"] / body["average"]["prefill_seconds"]
        if full and body["average"]["prefill_seconds"] > 0 else None)
  out["elastic_minus"] = elastic_minus(item_scores, by_task, category_of)
  return out


def elastic_minus(item_scores: Mapping[tuple[str, str], list[float]], by_task: Mapping[str, list],
                  category_of: Callable[[str], str]) -> dict:
  """{way: {"tasks": {task: d}, "categories": {category: d}, "all": d}}: elastic minus each
  static head set taken at its average MSR (runner.AFTER_ELASTIC), d a paired difference over
  the items both scored; pooled over each category's tasks and over every task."""
  out = {}
  for way in AFTER_ELASTIC:
    pairs = {t: (item_scores[("elastic", t)], item_scores[(way, t)]) for t in by_task
             if ("elastic", t) in item_scores and (way, t) in item_scores}
    if not pairs:
      continue
    pooled = lambda tasks: paired_difference(*(sum((list(pairs[t][i]) for t in tasks), [])
                                               for i in (0, 1)))
    cats: dict[str, list[str]] = {}
    for t in pairs:
      cats.setdefault(category_of(t), []).append(t)
    out[way] = {"tasks": {t: paired_difference(*ab) for t, ab in pairs.items()},
                "categories": {c: pooled(ts) for c, ts in cats.items()},
                "all": pooled(list(pairs))}
  return out


def speed_note(device: str | None) -> str:
  """What the prefill speed-up row measures on this device."""
  where = f" on {device}" if device else ""
  text = f"Prefill times{where}, compilation excluded."
  if device and device.lower().startswith("cpu"):
    text += (" On a CPU with a small model they measure per-call overheads more than "
             "attention; the kernels' speed at long inputs on an H200 is in "
             "benchmarks/README.md.")
  return text


def markdown(summary: dict, title: str, device: str | None = None) -> str:
  """Tasks as rows grouped by category, one 'score (MSR, ESR)' column per way of attending;
  `device` names where the prefill times were measured."""
  ways = list(summary["attention"])
  if not ways:
    return f"# {title}\n\nNo finished tasks.\n"
  lines = [f"# {title}", "", "Each cell: score (MSR, ESR).", "",
           "| category | task | " + " | ".join(ways) + " |",
           "|---|---|" + "---|" * len(ways)]
  first = summary["attention"][ways[0]]["tasks"]
  order = sorted(first, key=lambda t: (first[t]["category"], t))

  def cell(row):
    if row is None:
      return "-"
    return f"{row['score']:.1f} ({row['msr']:.2f}, {row['esr']:.2f})"

  for task in order:
    cat = first[task]["category"]
    lines.append(f"| {cat} | {task} | " + " | ".join(
        cell(summary["attention"][s]["tasks"].get(task)) for s in ways) + " |")
  for cat in sorted({first[t]["category"] for t in order}):
    lines.append(f"| **{cat}** | *mean* | " + " | ".join(
        cell(summary["attention"][s]["categories"].get(cat)) for s in ways) + " |")
  lines.append("| **all** | *mean* | " + " | ".join(
      cell(summary["attention"][s]["average"]) for s in ways) + " |")
  speed = [summary["attention"][s]["average"].get("prefill_speedup_vs_full") for s in ways]
  if any(x is not None for x in speed):
    lines.append("| | prefill speed-up vs full | " + " | ".join(
        "-" if x is None else f"{x:.2f}x" for x in speed) + " |")
    lines += ["", speed_note(device)]
  lines += ["", "Per task and way: score with its 95% interval, the paired difference to full "
            "attention over the same items with its 95% interval, the number of distinct routing "
            "decisions among the task's items, and MSR's spread (sd) across them.", "",
            "| task | way | n | score [95%] | vs full [95%] | patterns | MSR (sd) |",
            "|---|---|---|---|---|---|---|"]
  fmt = lambda lo, hi: f"[{lo:.1f}, {hi:.1f}]"
  for task in order:
    for s in ways:
      row = summary["attention"][s]["tasks"].get(task)
      if row is None or "ci95" not in row:
        continue
      vs = row.get("vs_full")
      vs_text = "-" if vs is None else f"{vs['diff']:+.1f} {fmt(*vs['ci95'])}"
      lines.append(f"| {task} | {s} | {row['n']} | {row['score']:.1f} {fmt(*row['ci95'])} | "
                   f"{vs_text} | {row.get('patterns', '-')} | {row['msr']:.2f} "
                   f"({row.get('msr_sd', 0.0):.2f}) |")
  return "\n".join(lines + elastic_minus_lines(summary, order)) + "\n"


def elastic_minus_lines(summary: dict, order: Sequence[str]) -> list[str]:
  """The table of elastic against each static head set at its MSR (`elastic_minus`), by
  task, by category and over every item; none where no such head set ran."""
  diffs = summary.get("elastic_minus") or {}
  if not diffs:
    return []
  ways = list(diffs)
  cell = lambda d: "-" if d is None else f"{d['diff']:+.1f} [{d['ci95'][0]:.1f}, {d['ci95'][1]:.1f}]"
  lines = ["", "Elastic minus each static head set at elastic's average MSR, paired over the "
           "same items, points [95% interval] (most-chosen: elastic's most often full heads; "
           "static-gate: a trained static router's heads):", "",
           "| | " + " | ".join(f"elastic − {w}" for w in ways) + " |",
           "|---|" + "---|" * len(ways)]
  for task in order:
    lines.append(f"| {task} | " + " | ".join(cell(diffs[w]["tasks"].get(task)) for w in ways)
                 + " |")
  for cat in sorted({c for w in ways for c in diffs[w]["categories"]}):
    lines.append(f"| **{cat}** | " + " | ".join(cell(diffs[w]["categories"].get(cat))
                                                 for w in ways) + " |")
  lines.append("| **every item** | " + " | ".join(cell(diffs[w]["all"]) for w in ways) + " |")
  return lines


def pyplot():
  """matplotlib.pyplot on the Agg backend (files, no display); refused in one sentence naming
  the extra to install when matplotlib is missing."""
  try:
    import matplotlib
  except ImportError:
    raise ElasticJaxError(PLOTS_NEED) from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def figure_title(what: str, model: str | None = None, routers: str | None = None,
                 setting: str | None = None, width: int = 110) -> str:
  """A figure's title: what it shows, then the model, the routers and the setting (wrapped at
  `width` characters, so that a long list of runs stays within the figure)."""
  about = [f"model {model}" if model else "model not recorded",
           f"routers {routers}" if routers else None, setting]
  return what + "\n" + textwrap.fill("; ".join(x for x in about if x), width,
                                     break_on_hyphens=False)


def heatmap_grid(plt, panels: Sequence[tuple[str, np.ndarray | None]], cols: int, title: str,
                 colorbar_label: str):
  """One [layers, KV heads] heatmap (values 0..1) per panel, `cols` panels a row; a panel of
  None is left out. Tick labels and axis labels only on the outer panels (the bottom one of
  each column, the first one of each row), so no label runs into a neighbour's title."""
  rows = -(-len(panels) // cols)
  fig = plt.figure(figsize=(1.2 + 2.3 * cols, 1.0 + 2.1 * rows), layout="constrained")
  axes = fig.subplots(rows, cols, squeeze=False)
  present = [[k < len(panels) and panels[k][1] is not None
              for k in range(r * cols, r * cols + cols)] for r in range(rows)]
  im, shown = None, []
  for k, ax in enumerate(axes.flat):
    r, c = divmod(k, cols)
    if not present[r][c]:
      fig.delaxes(ax)
      continue
    name, values = panels[k]
    im = ax.imshow(np.asarray(values, float).T, aspect="auto", vmin=0, vmax=1, cmap="viridis",
                   origin="lower")
    ax.set_title(name, fontsize=9)
    ax.tick_params(labelsize=8)
    if any(present[rr][c] for rr in range(r + 1, rows)):
      ax.tick_params(labelbottom=False)
    else:
      ax.set_xlabel("layer", fontsize=8)
    if any(present[r][cc] for cc in range(c)):
      ax.tick_params(labelleft=False)
    else:
      ax.set_ylabel("KV head", fontsize=8)
    shown.append(ax)
  if im is not None:
    fig.colorbar(im, ax=shown, shrink=0.8, label=colorbar_label)
  fig.suptitle(title, fontsize=10)
  return fig


def _color(way: str) -> str:
  """One colour per way of attending, the same in every plot."""
  return f"C{ORDER.index(way) if way in ORDER else len(ORDER)}"


def plots(summary: dict, records: Mapping[tuple[str, str], dict], out_dir: str,
          targets: Mapping[str, float] | None = None, device: str | None = None,
          model: str | None = None, routers: str | None = None,
          setting: str | None = None) -> list[str]:
  """Writes the PNG plots; returns their paths. targets: target MSR per task, drawn;
  device: where the prefill times were measured (named on the speed axis); model, routers,
  setting: what the runs were (named in every figure's title)."""
  plt = pyplot()
  title = lambda what: figure_title(what, model, routers, setting)
  written = []
  elastic = [r for (s, _), r in records.items() if s == "elastic"]
  if elastic:
    tasks = sorted({r["task"] for r in elastic})
    panels = [(task, np.mean([np.asarray(r["gates"], float) for r in elastic
                              if r["task"] == task], 0)) for task in tasks]
    fig = heatmap_grid(plt, panels, min(4, len(tasks)),
                       title("Routing map of the elastic attention"),
                       "share of inputs routed to full attention (0-1)")
    written.append(save_figure(fig, out_dir, "routing_map.png"))
    plt.close(fig)
  ways = summary["attention"]
  if ways:
    names = list(next(iter(ways.values()))["tasks"])
    msr = {s: [body["tasks"].get(t, {}).get("msr", np.nan) for t in names]
           for s, body in ways.items()}
    # A way with no MSR above 0 (full attention) would be bars of no length: named on the
    # axis instead of in the legend.
    drawn = [s for s in ways if np.nan_to_num(msr[s]).any()]
    zero = [s for s in ways if s not in drawn]
    fig, ax = plt.subplots(figsize=(7.5, 1.6 + 0.18 * len(names) * max(len(drawn), 1)),
                           layout="constrained")
    height = 0.8 / max(len(drawn), 1)
    y = np.arange(len(names))
    for i, s in enumerate(drawn):
      ax.barh(y - 0.4 + (i + 0.5) * height, msr[s], height, label=s, color=_color(s))
    if targets and any(t in targets for t in names):
      ax.vlines([targets.get(t, np.nan) for t in names], y - 0.45, y + 0.45, colors="black",
                linestyles="--", linewidth=1.2, label="target MSR")
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_ylabel("task")
    ax.set_xlabel("MSR (share of heads sparse)"
                  + (f"; {', '.join(zero)}: 0 on every task" if zero else ""))
    ax.set_xlim(0, 1.05)
    if drawn:
      ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title("MSR per task"), fontsize=10)
    written.append(save_figure(fig, out_dir, "msr_per_task.png"))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 3.8), layout="constrained")
    for s, body in ways.items():
      x = body["average"].get("prefill_speedup_vs_full")
      if x is not None:
        ax.scatter([x], [body["average"]["score"]], label=s, color=_color(s))
    ax.set_xlabel("prefill speed-up over full attention (x)\n("
                  + (f"{device}, " if device else "") + "compilation excluded)")
    ax.set_ylabel("average score (%)")
    if ax.collections:
      ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title("Quality against prefill speed"), fontsize=10)
    written.append(save_figure(fig, out_dir, "quality_vs_speedup.png"))
    plt.close(fig)
  return written


def save_figure(fig, out_dir: str, name: str) -> str:
  """A figure as a PNG in out_dir, written whole or not at all; returns its path."""
  path = os.path.join(out_dir, name)
  with atomic_file(path) as tmp:
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
  return path


def _routers_of(meta: dict, out_dir: str) -> str:
  """The routers a run used, for figure titles: meta's "routers" where it names them, else
  the digest the run's setting.json records, else none."""
  if meta.get("routers"):
    return str(meta["routers"])
  try:
    with open(os.path.join(out_dir, "setting.json"), encoding="utf-8") as f:
      digest = json.load(f).get("routers")
  except (OSError, ValueError, AttributeError):
    return "not recorded"
  return f"digest {digest}" if digest else "none"


def run_setting(meta: dict) -> str:
  """The setting of an eval run, for figure titles: benchmark, items, head patterns."""
  parts = [meta.get("benchmark"), f"{meta['items']} items" if meta.get("items") else None,
           f"patterns {meta['patterns']}" if meta.get("patterns") else None]
  return ", ".join(str(p) for p in parts if p)


def write(summary: dict, records, out_dir: str, title: str, meta: dict,
          targets: Mapping[str, float] | None = None) -> list[str]:
  """report.json, report.md and the plots, each written whole or not at all; without
  matplotlib the plots are left out, with a note on stderr."""
  paths = []
  for name, text in (("report.json", json.dumps({**meta, **summary}, indent=2)),
                     ("report.md", markdown(summary, title, meta.get("device")))):
    path = os.path.join(out_dir, name)
    atomic_write_text(path, text)
    paths.append(path)
  if importlib.util.find_spec("matplotlib") is None:
    print(f"note: no plots written: {PLOTS_NEED}", file=sys.stderr)
    return paths
  return paths + plots(summary, records, out_dir, targets, meta.get("device"),
                       model=meta.get("model"), routers=_routers_of(meta, out_dir),
                       setting=run_setting(meta))

