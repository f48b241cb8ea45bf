"""Router training speed and memory on an 8B-shaped backbone at long context, one device.

    python benchmarks/train_router.py [--model llama3_8b|qwen3_8b] [--seq-len 65536]
        [--steps 4] [--attn-impl auto] [--packed] [--dry-run]

The backbone has the published shapes of Llama-3.1-8B or Qwen3-8B (the config dicts below,
read through the same allow-list as a real `config.json`) with random bf16 weights: no
weights are downloaded, and speed does not depend on their values. One row of --seq-len
tokens per step (one sample, unpadded, so `train.packed=false` lets the fused kernels run;
--packed forces the packed path, which runs the plain-jnp reference), 3/4 of it prompt, the
rest answer; the routers start at the neutral init. It times --steps optimizer steps after
a compiling one and prints tokens/s, the step time and the device's peak memory, beside the
authors' figure from ANCHORS (≈2.1K tokens/s per A800 for an 8B backbone at 64K; another
machine and another day: a reference point, not a side-by-side comparison).
--dry-run shrinks everything to a few layers and 512 tokens so the script runs on a CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# An 8B backbone at 64K tokens needs ~100 GiB of temporaries: let XLA take 95% of the device
# rather than its default 75% (set the variable to override).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp

from elastic_jax.config import config_from_hf_dict
from elastic_jax.model import init_params
from elastic_jax.router import RouterConfig
from elastic_jax.train.objective import ObjectiveConfig
from elastic_jax.train.step import TrainConfig, init_train_state, train_step
from elastic_jax.train.synthetic import synthetic_batch

SHAPES = {
    "llama3_8b": {  # Llama-3.1-8B
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}},
    "qwen3_8b": {  # Qwen3-8B
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "attention_bias": False, "rope_theta": 1000000.0},
}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=sorted(SHAPES), default="llama3_8b")
  p.add_argument("--seq-len", type=int, default=65536)
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--attn-impl", default="auto")
  p.add_argument("--packed", action="store_true", help="the packed (reference) path")
  p.add_argument("--no-remat", action="store_true")
  p.add_argument("--dry-run", action="store_true", help="tiny shapes, runs on a CPU")
  args = p.parse_args(argv)
  hf = dict(SHAPES[args.model])
  block, local = 128, 16
  if args.dry_run:
    hf.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=1024,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    args.seq_len, block, local = min(args.seq_len, 512), 16, 4
  cfg = config_from_hf_dict(hf, f"{args.model} shape")
  rcfg = RouterConfig(block=block, local_blocks=local)
  tcfg = TrainConfig(steps=1000, packed=args.packed)
  remat = not args.no_remat
  ocfg = ObjectiveConfig()
  dev = jax.devices()[0]
  print(f"{args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads}/{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}; T={args.seq_len}, "
        f"attn {args.attn_impl}, packed={args.packed}, remat={remat}; "
        f"{dev.device_kind}, jax {jax.__version__}", flush=True)

  t0 = time.perf_counter()
  backbone = jax.jit(lambda key: init_params(cfg, key, "bfloat16"))(jax.random.key(0))
  state = init_train_state(cfg, rcfg, tcfg, jax.random.key(1))
  jax.block_until_ready(backbone)
  print(f"random backbone: {sum(x.size for x in jax.tree.leaves(backbone)) / 1e9:.2f} B "
        f"parameters in {time.perf_counter() - t0:.1f}s", flush=True)

  t = args.seq_len
  batch = synthetic_batch(0, 1, t, cfg.vocab_size, prompt_frac=0.75, max_segments=2)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  kw = dict(cfg=cfg, rcfg=rcfg, ocfg=ocfg, tcfg=tcfg, attn_impl=args.attn_impl, remat=remat)

  t0 = time.perf_counter()
  state, m = train_step(state, backbone, batch, **kw)
  jax.block_until_ready(m["loss"])
  print(f"first step (compiles): {time.perf_counter() - t0:.1f}s, loss {float(m['loss']):.3f}",
        flush=True)
  times = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    state, m = train_step(state, backbone, batch, **kw)
    jax.block_until_ready(m["loss"])
    times.append(time.perf_counter() - t0)
  sec = statistics.median(times)
  stats = dev.memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  print(f"step {sec * 1e3:.0f} ms (median of {len(times)}), {t / sec:,.0f} tokens/s, "
        f"MSR {float(m['msr']):.2f}, peak device memory "
        f"{'n/a' if peak is None else f'{peak / 2**30:.1f} GiB'}")
  print(f"reference point (ANCHORS, another machine): authors ≈2.1K tokens/s per A800 at 64K; "
        f"ratio {t / sec / 2100:.2f}")


if __name__ == "__main__":
  main()
