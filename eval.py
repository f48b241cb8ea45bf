"""python eval.py --model DIR (--text FILE | --ids FILE) [--dtype D] [--max-tokens N]

Next-token loss and perplexity of a text under full attention: a first check that a converted
model behaves like its original. Long-context benchmarks (RULER, LongBench), sparsity and speed
reports are to come. DIR is an HF directory or one `python -m elastic_jax.convert` wrote; --text
needs the tokenizer files in DIR; --ids reads a JSON list of token ids.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True)
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--text", help="UTF-8 text file, tokenized with DIR's tokenizer")
  src.add_argument("--ids", help="JSON file holding a list of token ids")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--max-tokens", type=int, default=4096, help="truncate the input (default 4096)")
  args = p.parse_args(argv)

  import jax
  import elastic_jax as ej
  from elastic_jax.errors import ElasticJaxError

  model = ej.from_pretrained(args.model, dtype=args.dtype)
  try:
    if args.ids:
      with open(args.ids) as f:
        ids = np.asarray(json.load(f), dtype=np.int64)
    else:
      from transformers import AutoTokenizer
      with open(args.text, encoding="utf-8") as f:
        text = f.read()
      tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
      ids = np.asarray(tok(text)["input_ids"], dtype=np.int64)
  except (OSError, ValueError, UnicodeDecodeError) as e:
    raise ElasticJaxError(f"cannot read the evaluation input ({e})") from None
  ids = ids[: args.max_tokens]
  if ids.ndim != 1 or ids.size < 2:
    raise ElasticJaxError("the evaluation input needs at least two tokens")
  t0 = time.perf_counter()
  logits = model.logits(ids)[0, :-1]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -np.asarray(logp)[np.arange(ids.size - 1), ids[1:]]
  dt = time.perf_counter() - t0
  print(json.dumps({"tokens": int(ids.size), "mean_nll": float(nll.mean()),
                    "perplexity": float(np.exp(nll.mean())), "seconds": round(dt, 3),
                    "dtype": model.dtype}))
  return 0


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
