"""The PyTorch side of benchmarks/attention.py: FlexAttention with the hybrid per-head block mask,
and PyTorch's own dense causal attention (`scaled_dot_product_attention` pinned to its cuDNN
and its FlashAttention backend: torch's cuDNN build may be newer than JAX's).

attention.py runs this file in a subprocess, so that torch is imported only here and gives its
GPU memory back before JAX times anything; attention.py also imports `timed` from here, so both
libraries are timed by the same rule. The one argument is a JSON request (shapes, SSA pattern,
cases, timing policy; see attention.py's `torch_request`). Progress goes to stderr; each result is
one stdout line `@flex {json}`, printed as soon as it is measured, so a run cut short still
reports what it finished. Nothing here raises: a missing torch, no GPU, a failed compile or an
out-of-memory case becomes a record with an "error" field.

The mask, per query head h of KV head h // G (G = N / K); the last S KV heads stream, the others
are full, as in attention.py's gates:
  full head       key <= query
  streaming head  key <= query and (key block < sink_blocks or query block - key block <
                  local_blocks), blocks of `block` tokens: the SSA of elastic_jax's reference.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings

TAG = "@flex"


def timed(call, reps: int, min_reps: int, budget_s: float):
  """Times `call()`, which must return only when its work is done.

  Two warm-up calls (the first compiles), then `reps` timed calls at most, stopping after
  `min_reps` once the timed calls have taken `budget_s` together (long cases get fewer).
  Returns (median seconds, calls timed, seconds of the first call).
  """
  t0 = time.perf_counter()
  call()
  first = time.perf_counter() - t0
  call()
  samples = []
  while len(samples) < reps and (len(samples) < min_reps or sum(samples) < budget_s):
    t0 = time.perf_counter()
    call()
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples), len(samples), first


def time_attention(torch, attend, q, k, v, cot, sync, req: dict, rec: dict) -> None:
  """Times attend(q, k, v) (with cot: and the gradients of sum(out * cot) w.r.t. q, k, v) by
  `timed`'s rule into rec's ms, reps and first_s."""
  def call():
    out = attend(q, k, v)
    if cot is not None:
      torch.autograd.grad(out, (q, k, v), cot)
    sync()

  sec, reps, first = timed(call, req["reps"], req["min_reps"], req["seconds"])
  rec.update(ms=sec * 1e3, reps=reps, first_s=first)


def emit(record: dict):
  print(TAG, json.dumps(record), flush=True)


def log(msg: str):
  print(f"[torch] {msg}", file=sys.stderr, flush=True)


def short(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def one_length(torch, create_block_mask, flex, req: dict, device: str, mode: str, t: int,
               streams: list):
  """Times Flex at length t for each number of streaming KV heads in `streams`; emits each."""
  n, kh = req["heads"]
  d, blk = req["head_dim"], req["block"]
  sink, local, g = req["sink_blocks"], req["local_blocks"], n // kh
  train = mode == "train"
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  try:
    q, k, v = (torch.randn(1, h, t, d, device=device, dtype=torch.bfloat16,
                           requires_grad=train) for h in (n, kh, kh))
    cot = torch.randn(1, n, t, d, device=device, dtype=torch.bfloat16) if train else None
  except Exception as e:
    for s in streams:
      emit({"mode": mode, "T": t, "streams": s, "error": short(e)})
    return
  # Which KV heads stream: filled in place per case, so one compiled graph serves them all.
  streaming_kv = torch.zeros(kh, dtype=torch.bool, device=device)

  def mask_mod(b, h, q_idx, kv_idx):
    qb, kb = q_idx // blk, kv_idx // blk
    keep = ~streaming_kv[h // g] | (kb < sink) | (qb - kb < local)
    return (kv_idx <= q_idx) & keep

  for s in streams:
    rec = {"mode": mode, "T": t, "streams": s}
    streaming_kv.copy_(torch.arange(kh, device=device) >= kh - s)
    try:
      t0 = time.perf_counter()
      with warnings.catch_warnings():  # _compile=True: deprecated in 2.13, memory-safe
        warnings.simplefilter("ignore", DeprecationWarning)
        bm = create_block_mask(mask_mod, 1, n, t, t, device=device, BLOCK_SIZE=blk,
                               _compile=True)
      sync()
      rec["mask_s"] = time.perf_counter() - t0

      time_attention(torch, lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True),
                     q, k, v, cot, sync, req, rec)
      if not train and t <= req["count_pairs_max"]:
        # The mask's (query, key) pairs over all query heads, for attention.py to compare.
        idx = torch.arange(t, device=device)
        rec["pairs"] = sum(int(mask_mod(0, h, idx[:, None], idx[None, :]).sum())
                           for h in range(n))
      log(f"{mode} T={t} streaming {s}/{kh}: {rec['ms']:.3f} ms ({rec['reps']} reps, "
          f"first call {rec['first_s']:.1f} s, block mask {rec['mask_s']:.1f} s)")
    except Exception as e:  # out of memory, a compile failure, no backward on CPU, ...
      rec["error"] = short(e)
      log(f"{mode} T={t} streaming {s}/{kh}: {rec['error']}")
    bm = None
    if device == "cuda":
      torch.cuda.empty_cache()
    emit(rec)


# key: (torch's SDPBackend, the name attention.py prints)
SDPA_BACKENDS = {"sdpa_cudnn": ("CUDNN_ATTENTION", "cuDNN"),
                 "sdpa_flash": ("FLASH_ATTENTION", "FlashAttention")}


def sdpa_length(torch, req: dict, device: str, mode: str, t: int):
  """Times causal SDPA (GQA) at length t on each backend of SDPA_BACKENDS; emits each as
  {"mode", "T", "streams": the backend's key, "ms", ...}."""
  from torch.nn.attention import SDPBackend, sdpa_kernel
  from torch.nn.functional import scaled_dot_product_attention as sdpa
  n, kh = req["heads"]
  d, train = req["head_dim"], mode == "train"
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  for key, (backend, _) in SDPA_BACKENDS.items():
    rec = {"mode": mode, "T": t, "streams": key}
    try:
      if device != "cuda":
        raise RuntimeError(f"{backend} needs a CUDA device")
      q, k, v = (torch.randn(1, h, t, d, device=device, dtype=torch.bfloat16,
                             requires_grad=train) for h in (n, kh, kh))
      cot = torch.randn(1, n, t, d, device=device, dtype=torch.bfloat16) if train else None

      with sdpa_kernel(getattr(SDPBackend, backend)):
        time_attention(torch, lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True),
                       q, k, v, cot, sync, req, rec)
      log(f"{mode} T={t} SDPA {backend}: {rec['ms']:.3f} ms ({rec['reps']} reps)")
    except Exception as e:  # a backend that does not take these shapes, out of memory, ...
      rec["error"] = short(e)
      log(f"{mode} T={t} SDPA {backend}: {rec['error']}")
    q = k = v = cot = None
    if device == "cuda":
      torch.cuda.empty_cache()
    emit(rec)


def main():
  req = json.loads(sys.argv[1])
  try:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
  except Exception as e:  # no torch, or one without FlexAttention
    emit({"kind": "meta", "error": f"torch with FlexAttention is not importable ({short(e)})"})
    return
  if torch.cuda.is_available():
    device = "cuda"
  elif req["allow_cpu"]:
    device = "cpu"
  else:
    emit({"kind": "meta", "error": f"torch {torch.__version__} sees no CUDA device"})
    return
  try:
    import triton
    triton_version = triton.__version__
  except Exception:
    triton_version = None
  emit({"kind": "meta", "torch": torch.__version__, "triton": triton_version,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"})
  # One compiled graph per length and mode; keep dynamo from giving up on recompiles.
  for knob in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, knob):
      setattr(torch._dynamo.config, knob, 64)
  flex = torch.compile(flex_attention, dynamic=False)
  for mode, lengths, streams in (("forward", req["lengths"], req["streams"]),
                                 ("train", req["train_lengths"], req["train_streams"])):
    for t in lengths:
      one_length(torch, create_block_mask, flex, req, device, mode, t, streams)
      sdpa_length(torch, req, device, mode, t)
      if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
  main()
