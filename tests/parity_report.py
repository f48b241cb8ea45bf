"""Prints the parity figures behind tests/test_parity.py (which only asserts bounds).

    ELASTIC_JAX_TORCH_PYTHON=.venv-torch/bin/python .venv/bin/python tests/parity_report.py

Builds the same tiny random models with transformers, loads them with elastic_jax and prints,
per model, the largest |logit difference| over the test prompts, the largest |logit| and their
ratio; then, for the RoPE scaling types of tests/test_rope_parity.py, the largest difference
per prompt length and over the greedy decoding steps.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_parity import BASE, MODELS, PROMPTS  # noqa: E402
import test_rope_parity as rope  # noqa: E402

import elastic_jax as ej  # noqa: E402


def main():
  python = os.environ.get("ELASTIC_JAX_TORCH_PYTHON",
                          os.path.join(os.path.dirname(HERE), ".venv-torch", "bin", "python"))
  with tempfile.TemporaryDirectory() as root:
    jobs = [{"op": "make", "family": family, "config": {**BASE, **overrides}, "seed": seed,
             "dtype": dtype, "out": f"{root}/{name}", "max_shard_size": shard,
             "prompts": PROMPTS, "logits": f"{root}/{name}.npz"}
            for seed, (name, (family, overrides, dtype, shard)) in enumerate(MODELS.items())]
    with open(f"{root}/jobs.json", "w") as f:
      json.dump(jobs, f)
    subprocess.run([python, os.path.join(HERE, "torch_reference.py"), f"{root}/jobs.json"],
                   check=True, capture_output=True)
    print(f"{'model':<28} {'dtype':<9} {'max|diff|':>10} {'max|logit|':>11} {'ratio':>9}")
    for name, (_, _, dtype, _) in MODELS.items():
      model = ej.from_pretrained(f"{root}/{name}", dtype="auto", show_progress=False)
      ref = np.load(f"{root}/{name}.npz")
      diff = max(float(np.abs(np.asarray(model.logits(p))[0] - ref[str(i)]).max())
                 for i, p in enumerate(PROMPTS))
      top = max(float(np.abs(ref[str(i)]).max()) for i in range(len(PROMPTS)))
      print(f"{name:<28} {dtype:<9} {diff:>10.3g} {top:>11.3g} {diff / top:>9.2g}")
    rope_report(python, root)


def rope_report(python, root):
  from elastic_jax.generation.generate import SamplingConfig
  jobs = []
  for seed, (name, (family, overrides)) in enumerate(rope.MODELS.items()):
    jobs.append({"op": "make", "family": family, "config": {**rope.BASE, **overrides},
                 "seed": 10 + seed, "out": f"{root}/{name}", "prompts": rope.PROMPTS,
                 "logits": f"{root}/{name}.npz"})
    jobs.append({"op": "greedy", "dir": f"{root}/{name}", "prompts": [rope.DECODE_PROMPT],
                 "steps": rope.DECODE_STEPS, "logits": f"{root}/{name}_greedy.npz"})
  with open(f"{root}/rope_jobs.json", "w") as f:
    json.dump(jobs, f)
  subprocess.run([python, os.path.join(HERE, "torch_reference.py"), f"{root}/rope_jobs.json"],
                 check=True, capture_output=True)
  lengths = [len(p) for p in rope.PROMPTS]
  head = " ".join(f"{f'T={n}':>9}" for n in lengths)
  print(f"\n{'rope model (float32)':<28} {'anchor':>6} {head} {'decode':>9}")
  for name in rope.MODELS:
    model = ej.from_pretrained(f"{root}/{name}", dtype="float32", show_progress=False)
    s = model.config.rope_scaling
    anchor = (s.original_max_position_embeddings or model.config.max_position_embeddings
              if s.rope_type != "linear" else "-")
    ref = np.load(f"{root}/{name}.npz")
    diffs = [float(np.abs(np.asarray(model.logits(p))[0] - ref[str(i)]).max())
             for i, p in enumerate(rope.PROMPTS)]
    greedy = np.load(f"{root}/{name}_greedy.npz")
    gen = model.generate([rope.DECODE_PROMPT], attention="full", attn_impl="reference",
                         sampling=SamplingConfig(max_new_tokens=rope.DECODE_STEPS),
                         return_logits=True)
    dec = float(np.abs(gen.logits[:, 0] - greedy["0"]).max())
    print(f"{name:<28} {anchor:>6} " + " ".join(f"{d:>9.2g}" for d in diffs) + f" {dec:>9.2g}")


if __name__ == "__main__":
  main()
