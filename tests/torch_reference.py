"""The PyTorch side of the parity tests: runs under a separate Python with torch + transformers.

    python torch_reference.py JOBS.json

JOBS.json is a list of jobs; each is one of
  {"op": "make", "family": "llama"|"qwen3", "config": {...}, "seed": 0, "dtype": "float32",
   "out": DIR, "max_shard_size": "20KB" (optional), "prompts": [[ids], ...], "logits": FILE}
      builds a tiny random HF model (weights drawn so that logits are O(1), not near zero),
      saves it with `save_pretrained` and writes its eager-attention logits per prompt.
  {"op": "logits", "dir": DIR, "dtype": "float32", "prompts": [...], "logits": FILE}
      loads DIR with `AutoModelForCausalLM` (safetensors only) and writes logits per prompt.
  {"op": "same_weights", "a": DIR, "b": DIR}
      loads both and asserts their state dicts are bit-identical (names, dtypes, values).
Logits files are .npz with arrays "0", "1", ... (float32 [T, V]).
"""

import json
import sys

import numpy as np
import torch
import transformers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _randomize(model, seed):
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if "norm" in name:
        value = 1.0 + 0.2 * noise
      elif name.endswith(".bias"):
        value = 0.2 * noise
      elif "embed_tokens" in name:
        value = noise
      else:
        value = noise / p.shape[-1] ** 0.5
      p.copy_(value.to(p.dtype))


def _logits(model, prompts, path):
  out = {}
  with torch.no_grad():
    for k, ids in enumerate(prompts):
      x = torch.tensor([ids], dtype=torch.long)
      out[str(k)] = model(input_ids=x).logits[0].float().numpy()
  np.savez(path, **out)


def make(job):
  cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[job["family"]]
  config = cls[0](**job["config"])
  config._attn_implementation = "eager"
  torch.manual_seed(job.get("seed", 0))
  model = cls[1](config)
  _randomize(model, job.get("seed", 0))
  model = model.to(DTYPES[job.get("dtype", "float32")]).eval()
  kwargs = {}
  if job.get("max_shard_size"):
    kwargs["max_shard_size"] = job["max_shard_size"]
  model.save_pretrained(job["out"], safe_serialization=True, **kwargs)
  if job.get("prompts"):
    _logits(model, job["prompts"], job["logits"])


def _load(directory, dtype="float32"):
  return transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=DTYPES[dtype], attn_implementation="eager", use_safetensors=True,
      local_files_only=True).eval()


def logits(job):
  _logits(_load(job["dir"], job.get("dtype", "float32")), job["prompts"], job["logits"])


def same_weights(job):
  def state(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype="auto", use_safetensors=True, local_files_only=True).state_dict()
  sa, sb = state(job["a"]), state(job["b"])
  assert sorted(sa) == sorted(sb), sorted(set(sa) ^ set(sb))
  for k in sa:
    assert sa[k].dtype == sb[k].dtype, (k, sa[k].dtype, sb[k].dtype)
    assert torch.equal(sa[k], sb[k]), f"tensor {k} differs"


def main():
  with open(sys.argv[1]) as f:
    jobs = json.load(f)
  for job in jobs:
    {"make": make, "logits": logits, "same_weights": same_weights}[job["op"]](job)
  print(json.dumps({"ok": len(jobs), "torch": torch.__version__,
                    "transformers": transformers.__version__}))


if __name__ == "__main__":
  main()
