"""The PyTorch side of the parity tests: runs under a separate Python with torch + transformers.

    python torch_reference.py JOBS.json

JOBS.json is a list of jobs; each is one of
  {"op": "make", "family": "llama"|"qwen3", "config": {...}, "seed": 0, "dtype": "float32",
   "out": DIR, "max_shard_size": "20KB" (optional), "prompts": [[ids], ...], "logits": FILE}
      builds a tiny random HF model (weights drawn so that logits are O(1), not near zero),
      saves it with `save_pretrained` and writes its eager-attention logits per prompt.
  {"op": "make_paw", ... as "make", plus "paw": {config keys}, "router_logits": 2 | 1,
   "lambdas": true, "extras": true}
      the same, saved the way the authors' PawQwen3ForCausalLM saves itself: a router per
      layer (`self_attn.mask_allocator`, their Linear modules) and the task multipliers
      registered on the model, so `save_pretrained` writes them under their names beside the
      backbone; their config keys and architecture name in config.json. "extras" adds the
      tensors their model saves but evaluation never reads (static masks, global
      multipliers, the temperature buffer).
  {"op": "logits", "dir": DIR, "dtype": "float32", "prompts": [...], "logits": FILE}
      loads DIR with `AutoModelForCausalLM` (safetensors only) and writes logits per prompt.
  {"op": "same_weights", "a": DIR, "b": DIR}
      loads both and asserts their state dicts are bit-identical (names, dtypes, values).
  {"op": "greedy", "dir": DIR, "prompts": [...], "steps": N, "logits": FILE}
      greedy decoding with transformers' KV cache, written by hand (prefill, then one token
      per call at its cache position); FILE gets per prompt the logits of every step [N, V]
      and "tokens_K" the tokens chosen.
  {"op": "keys", "dir": DIR, "prompts": [...], "out": FILE}
      the keys each layer's attention router reads (after k_norm for Qwen3, after k_proj for
      Llama; before RoPE), per prompt and layer: "P_L" float32 [T, K, H].
Every prompt runs on a fresh RoPE state: transformers' dynamic NTK RoPE keeps the longest
length it has seen between calls, which would make one prompt's result depend on the last.
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


def _fresh_rope(model):
  """Undoes what earlier calls left in a dynamic RoPE (its grown frequency table)."""
  rot = model.model.rotary_emb
  if "dynamic" in str(getattr(rot, "rope_type", "")):
    rot.inv_freq = rot.original_inv_freq.clone()
    rot.max_seq_len_cached = rot.original_max_seq_len


def _logits(model, prompts, path):
  out = {}
  with torch.no_grad():
    for k, ids in enumerate(prompts):
      _fresh_rope(model)
      x = torch.tensor([ids], dtype=torch.long)
      out[str(k)] = model(input_ids=x).logits[0].float().numpy()
  np.savez(path, **out)


def _random_model(job):
  cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[job["family"]]
  config = cls[0](**job["config"])
  config._attn_implementation = "eager"
  torch.manual_seed(job.get("seed", 0))
  model = cls[1](config)
  _randomize(model, job.get("seed", 0))
  return config, model


def make(job):
  _, model = _random_model(job)
  model = model.to(DTYPES[job.get("dtype", "float32")]).eval()
  kwargs = {}
  if job.get("max_shard_size"):
    kwargs["max_shard_size"] = job["max_shard_size"]
  model.save_pretrained(job["out"], safe_serialization=True, **kwargs)
  if job.get("prompts"):
    _logits(model, job["prompts"], job["logits"])


class _Router(torch.nn.Module):
  """The authors' AttentionRouter's parameters, under their module names."""

  def __init__(self, d, logits, gen, extras):
    super().__init__()
    nn = torch.nn
    self.cls_feat_extractor = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))
    self.cls_router_head_agnostic = nn.Sequential(
        nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d), nn.SiLU(), nn.Linear(d, logits))
    with torch.no_grad():
      for name, p in self.named_parameters():
        fan_in = p.shape[-1]
        scale = 3.0 if name.startswith("cls_router_head_agnostic.4") else 1.5
        p.copy_(scale * torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
    if extras:
      self.register_buffer("log_temp", torch.log(torch.tensor(0.2)))


def make_paw(job):
  config, model = _random_model(job)
  gen = torch.Generator().manual_seed(1000 + job.get("seed", 0))
  kv = config.num_key_value_heads
  d = config.head_dim
  for layer in model.model.layers:
    layer.self_attn.mask_allocator = _Router(d, job.get("router_logits", 2), gen,
                                             job.get("extras", False))
    if job.get("extras"):
      layer.self_attn.attn_mask_log_alphas = torch.nn.Parameter(torch.full((kv,), 4.5))
  if job.get("lambdas", True):
    model.model.sparsity_lambda1_task = torch.nn.Parameter(torch.rand(5, generator=gen) * 0.5)
    model.model.sparsity_lambda2_task = torch.nn.Parameter(torch.rand(5, generator=gen) * 0.5)
  if job.get("extras"):
    model.model.sparsity_lambda_1 = torch.nn.Parameter(torch.zeros(1))
    model.model.sparsity_lambda_2 = torch.nn.Parameter(torch.zeros(1))
  arch = {"llama": "PawLlamaForCausalLM", "qwen3": "PawQwen3ForCausalLM"}[job["family"]]
  model.config.architectures = [arch]
  for key, value in job["paw"].items():
    setattr(model.config, key, value)
  model = model.to(DTYPES[job.get("dtype", "float32")]).eval()
  # Pass the architecture explicitly: save_pretrained would otherwise write the class name.
  model.config.architectures = [arch]
  model.save_pretrained(job["out"], safe_serialization=True)
  with open(f"{job['out']}/config.json") as f:
    saved = json.load(f)
  saved["architectures"] = [arch]
  with open(f"{job['out']}/config.json", "w") as f:
    json.dump(saved, f, indent=2)
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


def greedy(job):
  model = _load(job["dir"], job.get("dtype", "float32"))
  out = {}
  with torch.no_grad():
    for k, ids in enumerate(job["prompts"]):
      _fresh_rope(model)
      cache = transformers.DynamicCache(config=model.config)
      x = torch.tensor([ids], dtype=torch.long)
      step_logits, tokens = [], []
      pos = 0
      for _ in range(job["steps"]):
        res = model(input_ids=x, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(pos, pos + x.shape[1]))
        pos += x.shape[1]
        cache = res.past_key_values
        last = res.logits[0, -1].float()
        step_logits.append(last.numpy())
        tokens.append(int(last.argmax()))
        x = torch.tensor([[tokens[-1]]], dtype=torch.long)
      out[str(k)] = np.stack(step_logits)
      out[f"tokens_{k}"] = np.asarray(tokens)
  np.savez(job["logits"], **out)


def keys(job):
  model = _load(job["dir"], job.get("dtype", "float32"))
  captured = {}

  def hook(layer):
    def fn(module, args, output):
      captured[layer] = output
    return fn

  handles = []
  for i, block in enumerate(model.model.layers):
    attn = block.self_attn
    target = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj
    handles.append(target.register_forward_hook(hook(i)))
  out = {}
  with torch.no_grad():
    for k, ids in enumerate(job["prompts"]):
      _fresh_rope(model)
      captured.clear()
      model(input_ids=torch.tensor([ids], dtype=torch.long))
      for i, value in captured.items():
        kv = model.config.num_key_value_heads
        out[f"{k}_{i}"] = value[0].float().reshape(len(ids), kv, -1).numpy()
  for h in handles:
    h.remove()
  np.savez(job["out"], **out)


def main():
  with open(sys.argv[1]) as f:
    jobs = json.load(f)
  for job in jobs:
    {"make": make, "make_paw": make_paw, "logits": logits, "same_weights": same_weights, "greedy": greedy,
     "keys": keys}[job["op"]](job)
  print(json.dumps({"ok": len(jobs), "torch": torch.__version__,
                    "transformers": transformers.__version__}))


if __name__ == "__main__":
  main()
