"""How much of the dense attention XAttention heads compute on a model's own activations.

    python benchmarks/xattention_density.py --model DIR [--length 4096] [--threshold 0.9]
        [--text FILE] [--stride 16] [--block 128] [--attn-impl auto]

Loads a Hugging Face directory through the converter, runs one prefill of --length tokens with
every head XAttention (patterns fa-xa, all heads routed to the sparse side) and prints, per
layer and overall, the fraction of the causal (query, key) pairs the kept blocks cover: the
fraction of dense attention FLOPs the XA heads computed. The input is --text tokenized with the
model's tokenizer (repeated to the length), or uniformly random token ids without one.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import elastic_jax as ej  # noqa: E402
from elastic_jax.model import forward_routed_jit  # noqa: E402
from elastic_jax.router import RouterConfig  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True)
  p.add_argument("--length", type=int, default=4096)
  p.add_argument("--threshold", type=float, default=0.9)
  p.add_argument("--stride", type=int, default=16)
  p.add_argument("--block", type=int, default=128)
  p.add_argument("--text", help="UTF-8 text to tokenize (default: random token ids)")
  p.add_argument("--dtype", default="auto",
                 help="bfloat16, float32, float16 or auto (the checkpoint's own; default)")
  p.add_argument("--attn-impl", default="auto")
  args = p.parse_args(argv)
  model = ej.from_pretrained(args.model, dtype=args.dtype, show_progress=False)
  cfg = model.config
  if args.length > cfg.max_position_embeddings:
    sys.exit(f"error: --length {args.length} exceeds the model's {cfg.max_position_embeddings}"
             " positions")
  if args.text:
    from elastic_jax.tokenizer import load_tokenizer
    with open(args.text, encoding="utf-8") as f:
      ids = load_tokenizer(args.model)(f.read())["input_ids"]
    if not ids:
      sys.exit(f"error: {args.text} holds no tokens")
    ids = np.resize(np.asarray(ids, np.int32), args.length)
    source = f"text {os.path.basename(args.text)}"
  else:
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.length).astype(np.int32)
    source = "random token ids"
  rcfg = RouterConfig(patterns="fa-xa", xa_threshold=args.threshold, xa_stride=args.stride,
                      xa_block=args.block)
  ids = jnp.asarray(ids)[None]
  pos = jnp.arange(args.length, dtype=jnp.int32)[None]
  seg = jnp.ones_like(ids)
  _, stats = forward_routed_jit(model.params, ids, pos, seg, seg > 0, cfg=cfg, rcfg=rcfg,
                                attention="sparse", attn_impl=args.attn_impl, packed=False)
  kept = np.asarray(stats["xa_kept"])[:, 0]                                   # [L, K]
  print(f"{os.path.basename(os.path.normpath(args.model))}: {cfg.num_layers} layers, "
        f"{cfg.num_kv_heads} KV heads; {args.length} tokens of {source}; XA stride "
        f"{args.stride}, block {args.block}, threshold {args.threshold}")
  for layer, row in enumerate(kept):
    print(f"  layer {layer:>3}: {row.mean():.3f}  (heads {' '.join(f'{x:.2f}' for x in row)})")
  print(f"XA heads computed {kept.mean():.3f} of the dense causal attention FLOPs "
        f"(min head {kept.min():.3f}, max {kept.max():.3f})")


if __name__ == "__main__":
  main()
