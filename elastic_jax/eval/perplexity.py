"""Next-token loss and perplexity of a text under full attention (`eval.py ppl`)."""

from __future__ import annotations

import json
import time

import numpy as np

from elastic_jax.errors import ElasticJaxError


def perplexity(model_dir: str, dtype: str, *, text: str | None = None, ids: str | None = None,
               max_tokens: int = 4096) -> int:
  """Prints {"tokens", "mean_nll", "perplexity", "seconds", "dtype"} for the first
  `max_tokens` tokens of a UTF-8 text file (tokenized with the model's tokenizer) or of a
  JSON list of token ids."""
  import jax
  import elastic_jax as ej
  model = ej.from_pretrained(model_dir, dtype=dtype)
  try:
    if ids:
      with open(ids) as f:
        raw = json.load(f)
      if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                              for x in raw):
        raise ElasticJaxError(f"--ids {ids}: must hold a JSON list of token ids")
      tokens = np.asarray(raw, dtype=np.int64)
    else:
      from elastic_jax.tokenizer import load_tokenizer
      with open(text, encoding="utf-8") as f:
        body = f.read()
      tokens = np.asarray(load_tokenizer(model_dir)(body)["input_ids"], dtype=np.int64)
  except (OSError, ValueError, UnicodeDecodeError) as e:
    if isinstance(e, ElasticJaxError):
      raise
    raise ElasticJaxError(f"cannot read the evaluation input ({e})") from None
  tokens = tokens[:max_tokens]
  if tokens.ndim != 1 or tokens.size < 2:
    raise ElasticJaxError("the evaluation input needs at least two tokens")
  t0 = time.perf_counter()
  logits = model.logits(tokens)[0, :-1]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -np.asarray(logp)[np.arange(tokens.size - 1), tokens[1:]]
  dt = time.perf_counter() - t0
  print(json.dumps({"tokens": int(tokens.size), "mean_nll": float(nll.mean()),
                    "perplexity": float(np.exp(nll.mean())), "seconds": round(dt, 3),
                    "dtype": model.dtype}))
  return 0
