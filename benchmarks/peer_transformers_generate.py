"""The peer row of generate_speed.py: `transformers`' own greedy generation (PyTorch, SDPA
attention, its default dynamic cache, eager) on the same backbone shape with random bf16
weights, one prompt of each length.

    python benchmarks/peer_transformers_generate.py [--model llama3_8b] [--lengths 32768]
        [--new-tokens 64]

Prints one JSON object per length: ttft (seconds of `generate` with one new token: the
prefill and the first token), decode (tokens/s of the tokens after the first: (n - 1) / (time
of n tokens - time of one)), prefill_peak (torch's peak allocated bytes over the one-token
call, weights included), device and versions. Each call is made once untimed first.
generate_speed.py --peer runs it in a subprocess before JAX takes the device and prints the
ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None):
  import torch
  import transformers
  from transformers import AutoConfig, AutoModelForCausalLM

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from shapes import SHAPES

  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=sorted(SHAPES), default="llama3_8b")
  p.add_argument("--lengths", type=int, nargs="+", default=[32768])
  p.add_argument("--new-tokens", type=int, default=64)
  args = p.parse_args(argv)
  if not torch.cuda.is_available():
    sys.exit("peer_transformers_generate.py needs a CUDA device")
  shape = dict(SHAPES[args.model])
  shape["max_position_embeddings"] = max(shape["max_position_embeddings"],
                                         max(args.lengths) + args.new_tokens)
  cfg = AutoConfig.for_model(**shape)
  torch.manual_seed(0)
  torch.set_default_dtype(torch.bfloat16)
  with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
  model.eval()
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0

  def run(ids, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
      out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + n
    return time.perf_counter() - t0

  for t in args.lengths:
    ids = torch.randint(0, cfg.vocab_size, (1, t), device="cuda")
    run(ids, 2)
    torch.cuda.reset_peak_memory_stats()
    one = run(ids, 1)
    peak = torch.cuda.max_memory_allocated()
    many = run(ids, args.new_tokens)
    print(json.dumps({"length": t, "ttft": one, "decode": (args.new_tokens - 1) / (many - one),
                      "prefill_peak": peak, "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "transformers": transformers.__version__}),
          flush=True)


if __name__ == "__main__":
  main()
