"""Per-task reports (JSON and Markdown, the paper's Table 1 layout) and plots (PNG).

Plots: the routing map (how often each (layer, KV head) pair went to full attention under the
elastic attention, one panel per task; paper Fig. 6), MSR per task (with the routers' target
per task where it is known), and quality against prefill speed-up over full attention (paper
Fig. 8). Labels are legends, never text placed at the points, so they cannot collide.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Mapping

import numpy as np

from elastic_jax.eval.runner import ORDER
from elastic_jax.files import atomic_file, atomic_write_text


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
  return "\n".join(lines) + "\n"


def plots(summary: dict, records: Mapping[tuple[str, str], dict], out_dir: str,
          targets: Mapping[str, float] | None = None, device: str | None = None) -> list[str]:
  """Writes the PNG plots; returns their paths. targets: target MSR per task, drawn;
  device: where the prefill times were measured (named on the speed axis)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  written = []
  elastic = [r for (s, _), r in records.items() if s == "elastic"]
  if elastic:
    tasks = sorted({r["task"] for r in elastic})
    cols = min(4, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    for ax in axes.flat[len(tasks):]:
      ax.axis("off")
    for ax, task in zip(axes.flat, tasks):
      freq = np.mean([np.asarray(r["gates"], float) for r in elastic if r["task"] == task], 0)
      im = ax.imshow(freq.T, aspect="auto", vmin=0, vmax=1, cmap="viridis", origin="lower")
      ax.set_title(task, fontsize=9)
      ax.set_xlabel("layer")
      ax.set_ylabel("KV head")
    fig.colorbar(im, ax=axes, shrink=0.8, label="share of inputs routed to full attention")
    written.append(save_figure(fig, out_dir, "routing_map.png"))
    plt.close(fig)
  ways = summary["attention"]
  if ways:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(next(iter(ways.values()))["tasks"])
    width = 0.8 / len(ways)
    for i, (s, body) in enumerate(ways.items()):
      ax.bar(np.arange(len(names)) + i * width,
             [body["tasks"].get(t, {}).get("msr", np.nan) for t in names], width, label=s)
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=30, ha="right",
                  fontsize=8)
    if targets:
      x = np.arange(len(names))
      ys = [targets.get(t, np.nan) for t in names]
      ax.hlines(ys, x - width / 2, x + 0.8 - width / 2, colors="black", linestyles="--",
                linewidth=1.2, label="target MSR")
    ax.set_ylabel("MSR")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    written.append(save_figure(fig, out_dir, "msr_per_task.png"))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    for s, body in ways.items():
      x = body["average"].get("prefill_speedup_vs_full")
      if x is not None:
        ax.scatter([x], [body["average"]["score"]], label=s)
    ax.set_xlabel("prefill speed-up over full attention\n(" + (f"{device}, " if device else "")
                  + "compilation excluded)")
    ax.set_ylabel("average score")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    written.append(save_figure(fig, out_dir, "quality_vs_speedup.png"))
    plt.close(fig)
  return written


def save_figure(fig, out_dir: str, name: str) -> str:
  """A figure as a PNG in out_dir, written whole or not at all; returns its path."""
  path = os.path.join(out_dir, name)
  with atomic_file(path) as tmp:
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
  return path


def write(summary: dict, records, out_dir: str, title: str, meta: dict,
          targets: Mapping[str, float] | None = None) -> list[str]:
  """report.json, report.md and the plots, each written whole or not at all."""
  paths = []
  for name, text in (("report.json", json.dumps({**meta, **summary}, indent=2)),
                     ("report.md", markdown(summary, title, meta.get("device")))):
    path = os.path.join(out_dir, name)
    atomic_write_text(path, text)
    paths.append(path)
  return paths + plots(summary, records, out_dir, targets, meta.get("device"))

