"""Hybrid FA/SSA attention on the GPU: our fused kernel and its peers, side by side in one run.

    python benchmarks/attention.py [--lengths 8192 32768 131072] [--msr 0 0.5 0.75 0.875]
        [--train-lengths 16384 65536] [--skip-torch] [--skip-train] [--triton-training]
        [--json results.json]
    python benchmarks/attention.py --dry-run [--torch-python PY]   # CPU smoke test, tiny shapes

Shape: B = 1, 32 query / 8 KV heads, head_dim 128, bf16 (the Llama-3.1-8B attention); SSA =
sink 1 block + local 16 blocks of 128 tokens. MSR m sends round(m * 8) of the 8 KV heads (the
last ones) to SSA and the others to full causal attention. In order:

1. Check, at the smallest length: ours against the float32 reference
   (`hybrid_attention(attn_impl="reference")`) on the same inputs, relative error
   ||out - ref|| / ||ref||, for the forward at every MSR timed and at mixed fractional gates,
   and for the gradients (dq, dk, dv, dgate) at the first --train-msr. A forward error over
   1e-2 stops the run. Also the (query, key) pair counts behind TFLOP/s against a brute-force
   count of the mask.
2. PyTorch FlexAttention (torch.compile; create_block_mask, BLOCK_SIZE = the SSA block, with
   the same per-head pattern), forward and forward+backward, in a subprocess
   (attention_torch.py): torch is never imported here, and it has given its GPU memory back
   before JAX times anything; the same worker times PyTorch's dense causal attention
   (`scaled_dot_product_attention(is_causal=True, enable_gqa=True)` pinned to its cuDNN and to
   its FlashAttention backend), forward and forward+backward. No torch, an out-of-memory case
   or a failure marks a row "n/a" with the reason.
3. Forward at --lengths: cuDNN causal (`jax.nn.dot_product_attention(implementation="cudnn",
   is_causal=True)`); cuDNN sliding window of sink + local tokens (no sink: the window-only
   cost of an all-streaming model); on a Hopper GPU, JAX's own Mosaic GPU flash attention,
   causal (`jax.experimental.pallas.ops.gpu.attention_mgpu`, FlashAttention-3's structure;
   it takes float16 only, so it gets the same inputs in float16, whose products run at bf16's
   rate; its output is compared with cuDNN's, and ours at MSR 0 against it is printed after
   the targets); ours (`hybrid_attention(attn_impl=--attn-impl)`, auto: on a
   Hopper GPU the Mosaic GPU forward) at each MSR and at 0 and 1, and any --also impls and
   --tiles / --mosaic-tiles kernel variants beside it; Flex hybrid; the ideal composition
   min(full kernels: cuDNN causal, tokamax causal, JAX Mosaic causal, PyTorch SDPA cuDNN and
   FlashAttention causal, ours MSR 0) * (1 - MSR)
   + min(window kernels: cuDNN window, tokamax window, ours MSR 1) * MSR, and the peers'
   composition, the same without ours; after the targets, ours at MSR 0 against each full
   peer and against the fastest of them. With --tokamax (a Hopper GPU): tokamax's Mosaic GPU
   attention (`tokamax.dot_product_attention(implementation="mosaic")`), causal and causal
   within the same window as cuDNN's, forward and forward+backward, its outputs compared
   with cuDNN's.
4. Training at --train-lengths: gradients of sum(out * cot) w.r.t. q, k, v (and the gate for
   ours, `jax.grad` through `hybrid_attention(attn_impl=--attn-impl)`) for cuDNN causal, cuDNN
   window, ours at each --train-msr and with every gate at 0.5 (all heads mixed, as under a
   relaxed router), and Flex hybrid. On a Hopper GPU ours trains on the Mosaic GPU training
   kernels; --triton-training adds ours through the Triton training kernels
   (`mosaic_gpu.make_hybrid(training="triton")`, rows "ours, Triton ..."), whose gradients
   step 1 also checks, at the gradient check's MSR and at mixed gates.
Then the bf16 matrix-product ceiling of the device, measured in the same run (a square
8192 product, the faster of bf16 and float32 output), a table per length (printed as each
finishes; each row's TFLOP/s also as a fraction of that ceiling), the product measured again
after the rows (the ceiling of the targets and the JSON is the faster of the two: on one H100
it measured 550 and 587 TFLOP/s in two runs minutes apart), where the Hopper kernel issue's
targets stand, and --json. Each forward speed target also shows its value "at the
ceiling": what a kernel whose full heads ran at that ceiling (and whose streaming heads took
the fastest window kernel's time) would reach against the same peers: a target past that
value asks for full heads faster than the run's own matrix product. That product is a
measured yardstick, not a bound: our full heads have outrun it (630 against 556 TFLOP/s on
an H200, benchmarks/README.md).

Times are medians after two warm-up calls, by one rule for both libraries
(`attention_torch.timed`): --reps calls at most, fewer (not under 3) once they have taken
--seconds. The JAX rows of one length (cuDNN's and ours at every MSR, forward or training) are
timed interleaved, in rounds that call each once (`measure_together`): the card's clock drifts
as it heats, and timed one after another, rows minutes apart differed by up to 9% for the same
kernel (an H100, 128K). Flex runs in its own process before them. A speed-up is the peer's time
over the row's time (> 1: the row is faster). TFLOP/s counts the work the pattern needs: 4 * D
FLOPs per (query, key) pair; causal pairs for full heads, SSA's kept pairs for streaming heads
(`router.streaming_kept_fraction`), the window's pairs for cuDNN window; forward+backward counts
3.5 forwards. In training ours also computes the gate's gradient, which needs O_FA of the
streaming heads too: not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from elastic_jax import hybrid_attention
from elastic_jax.attention import HYBRID_IMPLS, Streaming, mosaic_gpu
from elastic_jax.attention.pallas_gpu import Tiles, hybrid_forward, make_hybrid
from elastic_jax.router import streaming_kept_fraction

from attention_torch import SDPA_BACKENDS, TAG, short, timed  # imports no torch

FWD_ERR_MAX = 1e-2       # the check's limit on the forward's relative error
MIN_REPS = 3
PAIR_COUNT_MAX = 16384   # brute-force mask counts (T^2 elements) up to this length
TRAIN_FLOPS = 3.5        # forward + backward, in forwards
_START = time.perf_counter()


def log(msg: str):
  print(f"[{time.perf_counter() - _START:5.0f} s] {msg}", flush=True)


def jax_mosaic_inputs(q, k, v):
  """The inputs of `jax_mosaic_causal` (made outside the timed call): q, k, v in float16, the
  one dtype that kernel takes, q scaled by 1 / sqrt(D), since it applies no softmax scale."""
  return [x.astype(jnp.float16) for x in (q.astype(jnp.float32) * q.shape[-1] ** -0.5, k, v)]


def jax_mosaic_causal(q, k, v):
  """JAX's own Mosaic GPU flash attention (`jax.experimental.pallas.ops.gpu.attention_mgpu`,
  FlashAttention-3's warp-specialised structure), causal, at the tiles of its own example:
  64-row query blocks per warpgroup, 128-key tiles, 2 slots; on `jax_mosaic_inputs`."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                       causal=True)
  return attention_mgpu.attention(q, k, v, config)


def import_tokamax():
  """(tokamax, its version) or (None, why not). tokamax 0.0.17 imports xprof's profiler
  command line when it loads (for its own benchmarking tools, which this script does not
  use); where xprof is missing, that one import gets an empty stand-in."""
  import importlib.util
  import types
  if importlib.util.find_spec("tokamax") is None:
    return None, "tokamax is not installed"
  if importlib.util.find_spec("xprof") is None:
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
      sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
  try:
    import tokamax
  except Exception as e:   # noqa: BLE001 - a peer that does not load is reported, not fatal
    return None, f"tokamax does not load ({type(e).__name__}: {e})"
  return tokamax, tokamax.__version__


def tokamax_attention(q, k, v, *, window: int | None = None):
  """tokamax's Mosaic GPU flash attention (`tokamax.dot_product_attention(implementation=
  "mosaic")`), causal, or causal within the last `window` keys (local_window_size)."""
  import tokamax
  return tokamax.dot_product_attention(
      q, k, v, is_causal=True, implementation="mosaic",
      local_window_size=None if window is None else (window - 1, 0))


@dataclasses.dataclass(frozen=True)
class Bench:
  """The problem and the functions under test (built once; jit retraces per length)."""
  n: int              # query heads
  kh: int             # KV heads
  d: int              # head dim
  st: Streaming
  dry_run: bool
  timing: tuple       # (reps, min_reps, seconds) for `timed`
  tiles: tuple        # extra kernel variants, (block_q, block_k, num_stages[, warps]) each
  train_tiles: tuple = ()  # extra training variants: "FWD/DQ/DKV", each BQxBKxS[xWARPS]
  impl: str = "auto"       # ours: hybrid_attention(attn_impl=...)
  also: tuple = ()         # other impls timed beside it (forward)
  mosaic_tiles: tuple = ()  # Mosaic GPU kernel variants, "BQxBKVxSLOTS[+flag...]" each
  triton_training: bool = False  # on Hopper, also train through the Triton training kernels
  jax_mosaic: bool = False  # on Hopper, also time JAX's own Mosaic GPU flash attention
  tokamax: bool = False     # also time tokamax's Mosaic GPU attention (causal and window)

  @property
  def window(self) -> int:
    """Tokens of the cuDNN sliding window: SSA's sink + local span."""
    return (self.st.sink_blocks + self.st.local_blocks) * self.st.block

  @property
  def peer(self) -> str:
    return "XLA" if self.dry_run else "cuDNN"

  def pairs(self, t: int):
    """(query, key) pairs one head needs at length t: (causal, SSA kept, window)."""
    causal = t * (t + 1) // 2
    kept = float(streaming_kept_fraction(jnp.asarray(t), self.st)) * causal
    w = min(t, self.window)
    return causal, kept, w * (w + 1) // 2 + (t - w) * w

  def hybrid_work(self, t: int, s: int) -> float:
    """Forward FLOPs with s of the KV heads streaming."""
    causal, kept, _ = self.pairs(t)
    return 4 * self.d * (self.n // self.kh) * ((self.kh - s) * causal + s * kept)

  def gate(self, s: int) -> jax.Array:
    """[1, K]: the last s KV heads stream (r = 0), the others are full (r = 1)."""
    return jnp.asarray([[1.0] * (self.kh - s) + [0.0] * s], jnp.float32)

  def inputs(self, t: int, with_cot: bool = False):
    """Random bf16 q [1, T, N, D], k and v [1, T, K, D] (and a cotangent shaped like q)."""
    keys = jax.random.split(jax.random.key(t), 4)
    shapes = [(1, t, self.n, self.d), (1, t, self.kh, self.d), (1, t, self.kh, self.d)]
    shapes += [(1, t, self.n, self.d)] if with_cot else []
    return [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]

  # The functions under test: q, k, v[, gate] -> out.
  def cudnn(self, q, k, v, *, window: bool = False):
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="xla" if self.dry_run else "cudnn",
        local_window_size=(self.window - 1, 0) if window else None)

  def ours(self, q, k, v, gate, *, attn_impl: str | None = None):
    attn_impl = attn_impl or self.impl
    extra = {"interpret": True} if self.dry_run and attn_impl != "reference" else {}
    return hybrid_attention(q, k, v, gate, sink_blocks=self.st.sink_blocks,
                            local_blocks=self.st.local_blocks, block=self.st.block,
                            attn_impl=attn_impl, **extra)

  def tiled(self, tiles):
    bq, bk, stages, *warps = tiles
    tiles = Tiles(block_q=bq, block_k=bk, num_stages=stages,
                  num_warps=warps[0] if warps else None)
    return jax.jit(functools.partial(hybrid_forward, streaming=self.st, tiles=tiles,
                                     interpret=self.dry_run))

  def mosaic(self, spec: str):
    sizes, *flags = spec.split("+")
    persistent = [int(x[1:]) for x in flags if x.startswith("p") and x[1:].isdigit()]
    block_q, block_kv, slots = (int(x) for x in sizes.split("x"))
    tiles = mosaic_gpu.Tiles(block_q=block_q, block_kv=block_kv, slots=slots,
                             overlap="overlap" in flags,
                             persistent=persistent[0] if persistent else 0,
                             multicast="multicast" in flags,
                             q_registers="qreg" in flags,
                             chain="chain" in flags)
    return jax.jit(functools.partial(mosaic_gpu.hybrid_forward_hard, streaming=self.st,
                                     tiles=tiles, interpret=self.dry_run))

  def variants(self) -> dict:
    """Forward variants timed beside ours: name -> (row key, fn(q, k, v, gate))."""
    out = {f"ours, {impl}": (f"ours_{impl}", jax.jit(functools.partial(self.ours, attn_impl=impl)))
           for impl in self.also}
    out.update({f"ours, tiles {'x'.join(map(str, tl))}": (f"ours[{'x'.join(map(str, tl))}]",
                                                           self.tiled(tl))
                for tl in self.tiles})
    out.update({f"ours, mosaic {spec}": (f"ours_mosaic[{spec}]", self.mosaic(spec))
                for spec in self.mosaic_tiles})
    return out

  def triton_trained(self):
    """q, k, v, gate -> out through `mosaic_gpu.make_hybrid(training="triton")`."""
    fn = mosaic_gpu.make_hybrid(training="triton")
    return lambda q, k, v, gate: fn(q, k, v, gate, self.st, self.dry_run)

  def trained(self, spec: str):
    """q, k, v, gate -> out through `make_hybrid` with the tiles of a --train-tiles spec."""
    f, dq, dkv = (Tiles(*(int(x) for x in part.split("x"))) for part in spec.split("/"))
    fn = make_hybrid(train_forward_tiles=f, dq_tiles=dq, dkv_tiles=dkv)
    return lambda q, k, v, gate: fn(q, k, v, gate, self.st, self.dry_run)


def fwd_bwd(attend, n_args: int):
  """jit of the gradients of sum(attend(*args) * cot) w.r.t. all n_args args: f(cot, *args)."""
  def loss(cot, *args):
    return jnp.sum(attend(*args).astype(jnp.float32) * cot.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=tuple(range(1, n_args + 1))))


@dataclasses.dataclass
class Row:
  """One case of a table. Speed-ups and targets look rows up by `key` (cudnn_causal,
  cudnn_window, ours, ours[BQxBKxS], ours_mixed, ours_triton_train[_mixed], flex, ideal)
  and `streams` (KV heads streaming; None where no routing applies); `work` is the FLOPs the
  pattern needs."""
  kernel: str
  key: str
  streams: int | None
  work: float
  sec: float | None = None
  reps: int = 0
  first_s: float | None = None
  error: str | None = None
  note: str | None = None


def msr_label(row: Row, kh: int) -> str:
  if row.key == "ours_mixed":
    return "mix"
  return "-" if row.streams is None else f"{row.streams / kh:g}"


def measure_together(b: Bench, label: str, cases) -> list[Row]:
  """Times each case (row, fn, args) into its row, interleaved: two warm-up calls each (the
  first compiles), then rounds that call every case once, so that a drift of the card's clock
  over the run (it slows as it heats) falls on every row alike and the ratios between rows
  hold. Rounds: --reps at most, fewer (not under 3) once they have taken --seconds per case.
  A case that fails (a peer that does not run here) is recorded and left out. Returns the
  rows, in the cases' order."""
  reps, min_reps, seconds = b.timing
  what = lambda row: f"{label}: {row.kernel} {msr_label(row, b.kh)}"

  def fail(row, e):
    row.error = short(e)
    log(f"{what(row)}: failed, {row.error}")

  live = []
  for row, fn, args in cases:
    call = lambda fn=fn, args=args: jax.block_until_ready(fn(*args))
    try:
      start = time.perf_counter()
      call()
      row.first_s = time.perf_counter() - start
      call()
      live.append((row, call, []))
    except Exception as e:
      fail(row, e)
  rounds = spent = 0
  while live and rounds < reps and (rounds < min_reps or spent < seconds * len(live)):
    for row, call, samples in list(live):
      try:
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
        spent += samples[-1]
      except Exception as e:
        fail(row, e)
        live.remove((row, call, samples))
    rounds += 1
  for row, _, samples in live:
    row.sec, row.reps = statistics.median(samples), len(samples)
    log(f"{what(row)}: {row.sec * 1e3:.3f} ms ({row.reps} reps, first call {row.first_s:.1f} s)")
  return [row for row, _, _ in cases]


@dataclasses.dataclass
class Flex:
  """The PyTorch worker's results keyed (mode, T, streams), its versions, why any are missing."""
  results: dict
  meta: dict
  missing: str

  def row(self, mode: str, t: int, s, work: float) -> Row:
    """Flex's row at s streaming KV heads, or (s a key of attention_torch.SDPA_BACKENDS) the
    dense causal SDPA row of that backend."""
    if isinstance(s, str):
      row = Row(f"PyTorch SDPA {SDPA_BACKENDS[s][1]} causal", f"{s}_causal", None, work)
    else:
      row = Row("Flex hybrid", "flex", s, work)
    rec = self.results.get((mode, t, s))
    if rec is None:
      row.error = self.missing
    elif "error" in rec:
      row.error = rec["error"]
    else:
      row.sec, row.reps, row.first_s = rec["ms"] / 1e3, rec["reps"], rec["first_s"]
    return row


def torch_request(args, b: Bench, streams, train_streams) -> dict:
  reps, min_reps, seconds = b.timing
  return {"heads": [b.n, b.kh], "head_dim": b.d, "block": b.st.block,
          "sink_blocks": b.st.sink_blocks, "local_blocks": b.st.local_blocks,
          "lengths": args.lengths, "streams": streams,
          "train_lengths": [] if args.skip_train else args.train_lengths,
          "train_streams": train_streams, "reps": reps, "min_reps": min_reps,
          "seconds": seconds, "count_pairs_max": min(PAIR_COUNT_MAX, min(args.lengths)),
          "allow_cpu": args.dry_run}


def run_torch(args, request: dict) -> Flex:
  """Runs attention_torch.py in a subprocess and collects its `@flex` lines."""
  if args.skip_torch:
    return Flex({}, {"error": "--skip-torch"}, "--skip-torch")
  cmd = [args.torch_python, str(Path(__file__).with_name("attention_torch.py")),
         json.dumps(request)]
  log(f"FlexAttention in a subprocess ({args.torch_python}) ...")
  out, note = "", None
  try:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.torch_timeout)
    out = proc.stdout
    if proc.returncode:
      note = f"torch worker exited with status {proc.returncode}"
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    note = f"torch worker stopped after --torch-timeout {args.torch_timeout:g} s"
  except OSError as e:
    note = f"torch worker did not start ({short(e)})"
  results, meta = {}, {}
  for line in out.splitlines():
    if line.startswith(TAG + " "):
      rec = json.loads(line[len(TAG) + 1:])
      if rec.get("kind") == "meta":
        meta = rec
      else:
        results[(rec["mode"], rec["T"], rec["streams"])] = rec
    elif line.strip():
      print(f"[torch stdout] {line}")
  if note:
    meta["note"] = note
  missing = meta.get("error") or note or "not measured by the torch worker"
  log(f"FlexAttention done: {len(results)} cases"
      + (f" ({missing})" if meta.get("error") or note else ""))
  return Flex(results, meta, missing)


def dist_version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def rel_err(got, want) -> float:
  """||got - want|| / ||want||; the absolute error where want is 0 (dgate when T fits in the
  SSA window, so that SSA = FA); infinite if got is not finite."""
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  if not bool(jnp.isfinite(got).all()):
    return float("inf")
  err, norm = float(jnp.linalg.norm(got - want)), float(jnp.linalg.norm(want))
  return err / norm if norm > 0 else err


def check(b: Bench, t: int, streams, grad_streams: int):
  """Ours against the float32 reference at length t, and the pair counts (see the docstring).

  Returns (results, the names of the variants that run here).
  """
  out = {"T": t}
  if t <= PAIR_COUNT_MAX:
    p = jnp.arange(t)
    causal_qk = p[None, :] <= p[:, None]
    causal = int(causal_qk.sum())
    kept = int((causal_qk & b.st.allows(p[:, None], p[None, :])).sum())
    _, closed, _ = b.pairs(t)
    ok = causal == t * (t + 1) // 2 and abs(closed - kept) <= 1e-6 * causal
    out["pairs_brute_force"] = {"causal": causal, "kept": kept, "kept_closed_form": closed,
                                "agree": ok}
    log(f"check T={t}: one head's pairs, brute force over the mask: causal {causal}, SSA kept "
        f"{kept}; closed form {closed:.0f}: {'agree' if ok else 'DISAGREE'}")
  q, k, v, cot = b.inputs(t, with_cot=True)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  ref = jax.jit(functools.partial(b.ours, attn_impl="reference"))
  ours = {"ours": jax.jit(b.ours)}
  ours.update({name: fn for name, (_, fn) in b.variants().items()})
  mixed = jnp.asarray([[(1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.2, 0.0)[i % 8]
                        for i in range(b.kh)]], jnp.float32)
  gates = [(f"msr {s / b.kh:g}", b.gate(s)) for s in streams] + [("mixed gates", mixed)]
  fwd = {}
  for label, gate in gates:
    want = ref(*up, gate)
    for name, fn in list(ours.items()):
      if gate is mixed and ", mosaic " in name:  # the raw Mosaic kernel takes hard gates only
        continue
      try:
        err = rel_err(fn(q, k, v, gate), want)
      except Exception as e:
        if name == "ours":  # the kernel does not run: the run stops on this infinite error
          err = float("inf")
          out["error"] = short(e)
          log(f"check T={t} forward {label} ours: failed, {out['error']}")
        else:  # a variant over the shared-memory limit, say
          log(f"check T={t} {name} does not run here, dropped: {short(e)}")
          del ours[name]
          continue
      fwd[f"{name} {label}"] = err
      log(f"check T={t} forward {label} {name}: rel err {err:.2e} (limit {FWD_ERR_MAX:g})")
  out["forward"] = fwd
  gate = b.gate(grad_streams)
  try:
    got = fwd_bwd(b.ours, 4)(cot, q, k, v, gate)
    want = fwd_bwd(functools.partial(b.ours, attn_impl="reference"), 4)(cot, *up, gate)
    out["grad"] = {name: rel_err(g, w) for name, g, w in zip(("dq", "dk", "dv", "dgate"),
                                                             got, want)}
    log(f"check T={t} gradients at msr {grad_streams / b.kh:g}: " + ", ".join(
        f"{name} rel err {e:.2e}" for name, e in out["grad"].items()))
  except Exception as e:
    out["grad"] = {"error": short(e)}
    log(f"check T={t} gradients: failed, {out['grad']['error']}")
  if b.triton_training:   # at the MSR of the gradient check and at mixed gates
    ref_grads = fwd_bwd(functools.partial(b.ours, attn_impl="reference"), 4)
    for label, g in ((f"msr {grad_streams / b.kh:g}", gate), ("mixed gates", mixed)):
      key = f"grad, Triton training, {label}"
      try:
        got = fwd_bwd(b.triton_trained(), 4)(cot, q, k, v, g)
        want = ref_grads(cot, *up, g)
        out[key] = {name: rel_err(x, w) for name, x, w in zip(("dq", "dk", "dv", "dgate"),
                                                             got, want)}
        log(f"check T={t} Triton training gradients at {label}: " + ", ".join(
            f"{name} rel err {e:.2e}" for name, e in out[key].items()))
      except Exception as e:
        out[key] = {"error": short(e)}
        log(f"check T={t} Triton training gradients at {label}: failed, {short(e)}")
  return out, tuple(ours)


def forward_rows(b: Bench, t: int, streams, flex: Flex) -> list[Row]:
  q, k, v = b.inputs(t)
  causal, kept, window = b.pairs(t)
  label = f"forward T={t}"
  cases = [(Row(f"{b.peer} causal", "cudnn_causal", None, b.hybrid_work(t, 0)),
            jax.jit(b.cudnn), (q, k, v)),
           (Row(f"{b.peer} window {b.window}", "cudnn_window", None, 4 * b.d * b.n * window),
            jax.jit(functools.partial(b.cudnn, window=True)), (q, k, v))]
  if b.tokamax:
    cases += [(Row("tokamax Mosaic GPU causal", "tokamax_causal", None, b.hybrid_work(t, 0)),
               jax.jit(tokamax_attention), (q, k, v)),
              (Row(f"tokamax Mosaic GPU window {b.window}", "tokamax_window", None,
                   4 * b.d * b.n * window),
               jax.jit(functools.partial(tokamax_attention, window=b.window)), (q, k, v))]
  if b.jax_mosaic:
    cases.append((Row("JAX Mosaic GPU causal", "jax_mosaic_causal", None, b.hybrid_work(t, 0)),
                  jax.jit(jax_mosaic_causal), jax_mosaic_inputs(q, k, v)))
  peers = len(cases)
  ours = jax.jit(b.ours)
  variants = b.variants()  # jitted once per length: each compiles once, not once per MSR
  for s in streams:
    work, gate = b.hybrid_work(t, s), b.gate(s)
    cases.append((Row("ours", "ours", s, work), ours, (q, k, v, gate)))
    cases += [(Row(name, key, s, work), fn, (q, k, v, gate))
              for name, (key, fn) in variants.items()]
  timed_rows = measure_together(b, label, cases)
  rows = timed_rows[:peers]
  if b.jax_mosaic and rows[-1].sec is not None:   # the same function as cuDNN's?
    got, want = (fn(*a).astype(jnp.float32) for _, fn, a in (cases[peers - 1], cases[0]))
    err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    rows[-1].note = f"output against cuDNN causal's: relative difference {err:.2e}"
    log(f"{label}: JAX Mosaic GPU causal: {rows[-1].note}")
  for i, row in enumerate(rows):   # tokamax's outputs against cuDNN's of the same pattern
    if row.key.startswith("tokamax_") and row.sec is not None:
      want_case = cases[0 if row.key == "tokamax_causal" else 1]
      got = cases[i][1](*cases[i][2]).astype(jnp.float32)
      want = want_case[1](*want_case[2]).astype(jnp.float32)
      err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
      row.note = f"output against cuDNN's: relative difference {err:.2e}"
      log(f"{label}: {row.kernel}: {row.note}")
  sdpa = [flex.row("forward", t, key, b.hybrid_work(t, 0)) for key in SDPA_BACKENDS]
  rows += sdpa
  for s in streams:
    work = b.hybrid_work(t, s)
    rows += [r for r in timed_rows[peers:] if r.streams == s]
    rows.append(flex.row("forward", t, s, work))
    rec = flex.results.get(("forward", t, s), {})
    if "pairs" in rec:
      want = (b.n // b.kh) * ((b.kh - s) * causal + s * kept)
      ok = abs(rec["pairs"] - want) <= 1e-6 * want
      rows[-1].note = (f"mask keeps {rec['pairs']} pairs, ours {want:.0f}: "
                       + ("same pattern" if ok else "MISMATCH"))
      log(f"{label}: Flex {msr_label(rows[-1], b.kh)}: {rows[-1].note}")
    rows.append(ideal(timed_rows + sdpa, b.kh, s, work))
    rows.append(ideal(timed_rows + sdpa, b.kh, s, work, peers_only=True))
  return rows


def ideal(rows: list[Row], kh: int, s: int, work: float, peers_only: bool = False) -> Row:
  """min(full kernels) * (1 - MSR) + min(window kernels) * MSR, from the length's rows; with
  peers_only, of the peers' kernels alone (what a user could compose without ours: a causal
  call for the full heads plus a local-window call for the streaming ones)."""
  def best(*which):
    secs = [r.sec for r in rows if (r.key, r.streams) in which and r.sec is not None]
    return min(secs) if secs else None
  m = s / kh
  ours_full, ours_window = ((), ()) if peers_only else ((("ours", 0),), (("ours", kh),))
  full = best(("cudnn_causal", None), ("tokamax_causal", None), ("jax_mosaic_causal", None),
              *((f"{key}_causal", None) for key in SDPA_BACKENDS), *ours_full) if m < 1 else 0.0
  window = best(("cudnn_window", None), ("tokamax_window", None),
                *ours_window) if m > 0 else 0.0
  row = (Row("peers' composition", "peers_ideal", s, work) if peers_only
         else Row("ideal composition", "ideal", s, work))
  if full is None or window is None:
    row.error = "its parts were not timed"
  else:
    row.sec = full * (1 - m) + window * m
  return row


def train_rows(b: Bench, t: int, train_streams, flex: Flex) -> list[Row]:
  q, k, v, cot = b.inputs(t, with_cot=True)
  label = f"train T={t}"
  full = TRAIN_FLOPS * b.hybrid_work(t, 0)
  _, _, window = b.pairs(t)
  cases = [(Row(f"{b.peer} causal", "cudnn_causal", None, full),
            fwd_bwd(b.cudnn, 3), (cot, q, k, v)),
           (Row(f"{b.peer} window {b.window}", "cudnn_window", None,
                TRAIN_FLOPS * 4 * b.d * b.n * window),
            fwd_bwd(functools.partial(b.cudnn, window=True), 3), (cot, q, k, v))]
  if b.tokamax:
    cases += [(Row("tokamax Mosaic GPU causal", "tokamax_causal", None, full),
               fwd_bwd(tokamax_attention, 3), (cot, q, k, v)),
              (Row(f"tokamax Mosaic GPU window {b.window}", "tokamax_window", None,
                   TRAIN_FLOPS * 4 * b.d * b.n * window),
               fwd_bwd(functools.partial(tokamax_attention, window=b.window), 3),
               (cot, q, k, v))]
  peers = len(cases)
  ours = fwd_bwd(b.ours, 4)
  mixed = jnp.full((1, b.kh), 0.5, jnp.float32)
  cases += [(Row("ours", "ours", s, TRAIN_FLOPS * b.hybrid_work(t, s)), ours,
             (cot, q, k, v, b.gate(s))) for s in train_streams]
  cases.append((Row("ours, every gate 0.5", "ours_mixed", None, full), ours,
                (cot, q, k, v, mixed)))
  if b.triton_training:
    triton = fwd_bwd(b.triton_trained(), 4)
    cases += [(Row("ours, Triton training", "ours_triton_train", s,
                   TRAIN_FLOPS * b.hybrid_work(t, s)), triton, (cot, q, k, v, b.gate(s)))
              for s in train_streams]
    cases.append((Row("ours, Triton, gates 0.5", "ours_triton_train_mixed", None, full), triton,
                  (cot, q, k, v, mixed)))
  for spec in b.train_tiles:
    variant = fwd_bwd(b.trained(spec), 4)
    cases += [(Row(f"ours, tiles {spec}", f"ours[{spec}]", s, TRAIN_FLOPS * b.hybrid_work(t, s)),
               variant, (cot, q, k, v, b.gate(s))) for s in train_streams]
  rows = measure_together(b, label, cases)
  # the table: the peers' rows, ours at each MSR, Flex's at each, then the rest
  at = len(train_streams) + peers
  return (rows[:peers] + [flex.row("train", t, key, full) for key in SDPA_BACKENDS]
          + rows[peers:at] + [flex.row("train", t, s, TRAIN_FLOPS * b.hybrid_work(t, s))
                              for s in train_streams] + rows[at:])


def matmul_ceiling(b: Bench) -> dict:
  """The bf16 matrix-product ceiling of this device, measured now: a square product
  [M, M] x [M, M] (M = 8192: 1.1 TFLOP a call) in two forms, bf16 out (the plain product) and
  float32 out cast to bf16, each timed by the same rule as the kernels; the ceiling is the
  faster (one form alone can understate the card: the second gave 580 TFLOP/s on an H100,
  well under the ~790 its bf16 products are known to reach). {"size", "tflops", "ms",
  "forms"}."""
  m = 256 if b.dry_run else 8192
  x, y = (jax.random.normal(jax.random.key(i), (m, m), jnp.bfloat16) for i in (1, 2))
  products = {
      "bf16 out": jax.jit(lambda x, y: jnp.matmul(x, y)),
      "float32 out, cast": jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32)
                                   .astype(jnp.bfloat16)),
  }
  forms = {}
  for name, product in products.items():
    sec, reps, _ = timed(lambda: jax.block_until_ready(product(x, y)), *b.timing)
    forms[name] = {"tflops": 2 * m ** 3 / sec / 1e12, "ms": sec * 1e3}
    log(f"matrix product [{m}, {m}] x [{m}, {m}] bf16, {name}: {sec * 1e3:.3f} ms ({reps} "
        f"reps): {forms[name]['tflops']:.1f} TFLOP/s")
  best = max(forms.values(), key=lambda f: f["tflops"])
  return {"size": m, "tflops": best["tflops"], "ms": best["ms"], "forms": forms}


def combined_ceiling(runs: dict) -> dict:
  """One ceiling from several `matmul_ceiling` measurements of a run ({label: measurement},
  e.g. before and after its rows): the fastest, since a card's clock only lowers what a
  product reaches; every measurement kept under "runs", their max / min under "spread"."""
  best = max(runs.values(), key=lambda c: c["tflops"])
  low = min(c["tflops"] for c in runs.values())
  return {**{k: v for k, v in best.items() if k != "forms"}, "runs": runs,
          "spread": best["tflops"] / low}


def annotate(rows: list[Row], kh: int, ceiling: float | None = None) -> list[dict]:
  """Rows as dicts with ms, TFLOP/s (and its fraction of the matrix-product `ceiling`,
  TFLOP/s) and speed-ups over cuDNN causal and Flex (same MSR)."""
  base = next((r.sec for r in rows if r.key == "cudnn_causal"), None)
  flex = {r.streams: r.sec for r in rows if r.key == "flex"}
  out = []
  for r in rows:
    f = flex.get(r.streams) if r.streams is not None and r.key != "flex" else None
    ok = r.sec is not None
    out.append(dict(dataclasses.asdict(r), msr=msr_label(r, kh),
                    ms=r.sec * 1e3 if ok else None,
                    tflops=r.work / r.sec / 1e12 if ok else None,
                    of_ceiling=r.work / r.sec / 1e12 / ceiling if ok and ceiling else None,
                    vs_cudnn_causal=base / r.sec if ok and base else None,
                    vs_flex=f / r.sec if ok and f else None))
  return out


def print_table(title: str, rows: list[dict]):
  w = max([24] + [len(r["kernel"]) for r in rows])   # the kernel column fits every name
  print(f"\n{title}")
  print(f"  {'kernel':<{w}} {'MSR':>5} {'ms':>10} {'reps':>4} {'TFLOP/s':>8} {'of matmul':>9} "
        f"{'vs cuDNN causal':>15} {'vs Flex hybrid':>14}")
  x = lambda v: f"{v:.2f}x" if v is not None else "-"
  for r in rows:
    if r["ms"] is None:
      print(f"  {r['kernel']:<{w}} {r['msr']:>5} {'n/a':>10}  ({r['error']})")
      continue
    reps = r["reps"] or "-"
    share = "-" if r["of_ceiling"] is None else f"{r['of_ceiling']:.0%}"
    print(f"  {r['kernel']:<{w}} {r['msr']:>5} {r['ms']:>10.3f} {reps:>4} {r['tflops']:>8.1f} "
          f"{share:>9} {x(r['vs_cudnn_causal']):>15} {x(r['vs_flex']):>14}")


def targets(fwd: dict, train: dict, kh: int, ceiling: float | None = None) -> list[dict]:
  """Where the Hopper kernel issue's targets stand: full heads at 32K and 128K (or the
  longest length timed), 128K MSR 0.75 against Flex and cuDNN, training at 64K. Each forward
  speed target also gets its `bound`: the value a kernel would reach with its full heads at
  the matrix-product `ceiling` (TFLOP/s, this run's) and its streaming heads at the fastest
  window kernel's time: a target past it asks for full heads faster than the run's matrix
  product."""
  def sec(rows, key, s=None):
    return next((r["sec"] for r in rows if r["key"] == key and r["streams"] == s), None)

  def at_ceiling(rows, s):
    """Seconds of the composition at the ceiling for s of kh streaming heads."""
    full = next((r["work"] for r in rows if r["key"] == "ours" and r["streams"] == 0), None)
    windows = [x for x in (sec(rows, "cudnn_window"), sec(rows, "ours", kh)) if x is not None]
    if not ceiling or full is None or (s and not windows):
      return None
    return (1 - s / kh) * full / (ceiling * 1e12) + (s / kh * min(windows) if s else 0.0)

  def share(rows, key, s=None):
    return next((r["of_ceiling"] for r in rows if r["key"] == key and r["streams"] == s),
                None)

  def ratio(a, b):
    return a / b if a is not None and b is not None else None

  out = []
  s75 = round(0.75 * kh)
  m75 = f"MSR {s75 / kh:g}"
  if fwd:
    for t in sorted({t for t in (32768, 131072) if t in fwd} or {max(fwd)}):
      rows = fwd[t]
      out += [(f"T={t} MSR 0: ours / cuDNN causal throughput",
               ratio(sec(rows, "cudnn_causal"), sec(rows, "ours", 0)), ">=", 1.12,
               ratio(sec(rows, "cudnn_causal"), at_ceiling(rows, 0))),
              (f"T={t} MSR 0: ours' TFLOP/s / the matrix-product ceiling",
               share(rows, "ours", 0), ">=", 0.82, None)]
    t = 131072 if 131072 in fwd else max(fwd)
    rows = fwd[t]
    cc, cw = sec(rows, "cudnn_causal"), sec(rows, "cudnn_window")
    ours = lambda s: sec(rows, "ours", s)
    bound = at_ceiling(rows, s75)
    out += [
        (f"T={t} {m75}: ours vs Flex hybrid, speed-up",
         ratio(sec(rows, "flex", s75), ours(s75)), ">=", 1.6,
         ratio(sec(rows, "flex", s75), bound)),
        (f"T={t} {m75}: ours vs cuDNN causal, speed-up", ratio(cc, ours(s75)), ">=", 4.2,
         ratio(cc, bound)),
        (f"T={t} MSR 1: ours vs cuDNN window, speed-up", ratio(cw, ours(kh)), ">=", 1.0,
         None)]
  if train:
    t = 65536 if 65536 in train else max(train)
    rows = train[t]
    cc = sec(rows, "cudnn_causal")
    out += [(f"train T={t} {m75}: ours / cuDNN causal fwd+bwd time",
             ratio(sec(rows, "ours", s75), cc), "<=", 0.75, None),
            (f"train T={t} every gate 0.5: ours / cuDNN causal fwd+bwd time",
             ratio(sec(rows, "ours_mixed"), cc), "<=", 1.4, None)]
  return [{"target": name, "value": v, "goal": f"{op} {goal:g}", "bound": bound,
           "met": None if v is None else (v >= goal if op == ">=" else v <= goal)}
          for name, v, op, goal, bound in out]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072],
                 help="forward lengths T (the smallest is also the check's)")
  p.add_argument("--msr", type=float, nargs="+", default=[0, 0.5, 0.75, 0.875],
                 help="forward MSRs (0 and 1 are always timed for ours and Flex)")
  p.add_argument("--train-lengths", type=int, nargs="+", default=[16384, 65536])
  p.add_argument("--train-msr", type=float, nargs="+", default=[0.75],
                 help="training MSRs (the first is also the gradient check's)")
  p.add_argument("--reps", type=int, default=20, help="timed calls per case, at most")
  p.add_argument("--seconds", type=float, default=2.0,
                 help="stop timing a case after this many seconds of timed calls (and >= 3)")
  p.add_argument("--skip-torch", action="store_true", help="no FlexAttention")
  p.add_argument("--tokamax", action="store_true",
                 help="also time tokamax's Mosaic GPU attention (causal and local window), "
                      "forward and forward+backward, on a Hopper GPU")
  p.add_argument("--skip-train", action="store_true", help="forward only")
  p.add_argument("--triton-training", action="store_true",
                 help="on a Hopper GPU (where ours trains on the Mosaic GPU kernels), also "
                      "train through the Triton training kernels")
  p.add_argument("--json", type=Path, help="also write every result here")
  p.add_argument("--tiles", nargs="+", default=[], metavar="BQxBKxS[xW]",
                 help="also time the raw kernel (hybrid_forward) with these tiles, e.g. "
                      "128x64x3: block_q x block_k x num_stages [x num_warps]")
  p.add_argument("--attn-impl", default="auto",
                 help="ours: hybrid_attention(attn_impl=...) (auto, pallas_gpu, mosaic_gpu)")
  p.add_argument("--also", nargs="+", default=[], metavar="IMPL",
                 help="also time the forward of these impls, e.g. pallas_gpu")
  p.add_argument("--mosaic-tiles", nargs="+", default=[],
                 metavar="BQxBKVxSLOTS[+overlap|+chain][+multicast][+qreg][+pP]",
                 help="also time the Mosaic GPU kernel alone with these tiles, e.g. 64x128x2; "
                      "+overlap: FlashAttention-3's intra-warpgroup overlap "
                      "(mosaic_gpu.Tiles.overlap); +multicast: each K/V tile "
                      "multicast to a cluster of two programs (Tiles.multicast); +qreg: "
                      "QK^T reads Q from registers (Tiles.q_registers); +p132: "
                      "132 persistent programs (Tiles.persistent); +chain: each "
                      "warpgroup's QK^T and PV issued in one turn (Tiles.chain; without it "
                      "chain=False)")
  p.add_argument("--train-tiles", nargs="+", default=[], metavar="FWD/DQ/DKV",
                 help="also time training with these tiles of the training forward, dQ and "
                      "dK/dV kernels, each BQxBKxSTAGES[xWARPS], e.g. 128x64x3/64x64x2/64x64x2")
  p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("N", "K"))
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--block", type=int, default=128, help="SSA block (and Flex BLOCK_SIZE)")
  p.add_argument("--sink-blocks", type=int, default=1)
  p.add_argument("--local-blocks", type=int, default=16)
  p.add_argument("--torch-python", default=sys.executable,
                 help="interpreter for the PyTorch worker (default: this one)")
  p.add_argument("--torch-timeout", type=float, default=360,
                 help="seconds the PyTorch worker may take in all")
  p.add_argument("--dry-run", action="store_true",
                 help="CPU smoke test of the plumbing: tiny shapes (unless given), our kernel "
                      "in interpret mode, XLA in place of cuDNN, Flex on CPU; times mean nothing")
  args = p.parse_args(argv)
  if args.dry_run:
    p.set_defaults(lengths=[256], train_lengths=[256], heads=[16, 8], head_dim=32, block=16,
                   local_blocks=4, reps=2)
    args = p.parse_args(argv)
  n, kh = args.heads
  if n < 1 or kh < 1 or n % kh:
    p.error(f"--heads {n} {kh}: query heads must be a positive multiple of the KV heads")
  if min(args.lengths + args.train_lengths) < 1:
    p.error("--lengths and --train-lengths must be positive")
  if not all(0 <= m <= 1 for m in args.msr + args.train_msr):
    p.error("--msr and --train-msr values must lie in [0, 1]")
  for spec in args.tiles:
    parts = spec.split("x")
    if len(parts) not in (3, 4) or not all(x.isdigit() and int(x) > 0 for x in parts):
      p.error(f"--tiles {spec}: expected BQxBKxSTAGES[xWARPS], e.g. 128x64x3")
  args.tiles = [tuple(int(x) for x in spec.split("x")) for spec in args.tiles]
  for impl in [args.attn_impl, *args.also]:
    if impl not in HYBRID_IMPLS:
      p.error(f"--attn-impl/--also {impl}: unknown (known: {', '.join(sorted(HYBRID_IMPLS))})")
  for spec in args.mosaic_tiles:
    sizes, *flags = spec.split("+")
    parts = sizes.split("x")
    known = lambda f: f in ("overlap", "multicast", "qreg", "chain") or (
        f[:1] == "p" and f[1:].isdigit() and int(f[1:]) > 0)
    if (len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts)
        or not all(map(known, flags)) or len(flags) != len(set(f[0] for f in flags))
        or ("chain" in flags and ("overlap" in flags or any(f[0] == "p" for f in flags)))):
      p.error(f"--mosaic-tiles {spec}: expected "
              f"BQxBKVxSLOTS[+overlap|+chain][+multicast][+qreg][+pP] (+chain without +pP), "
              f"e.g. 64x128x2+overlap+p132")
  for spec in args.train_tiles:
    parts = [x.split("x") for x in spec.split("/")]
    if len(parts) != 3 or not all(len(x) in (3, 4) and all(y.isdigit() and int(y) > 0
                                                             for y in x) for x in parts):
      p.error(f"--train-tiles {spec}: expected FWD/DQ/DKV, each BQxBKxSTAGES[xWARPS]")
  return args


def main(argv=None):
  args = parse_args(argv)
  # JAX takes GPU memory as it needs it (not 75% up front), so the torch worker has room too.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.dry_run:
    jax.config.update("jax_platforms", "cpu")
  b = Bench(*args.heads, args.head_dim,
            Streaming(args.sink_blocks, args.local_blocks, args.block), args.dry_run,
            (args.reps, min(MIN_REPS, args.reps), args.seconds), tuple(args.tiles),
            tuple(args.train_tiles), args.attn_impl, tuple(args.also), tuple(args.mosaic_tiles))
  # On a Hopper GPU where their layout holds, ours (auto, mosaic_gpu) trains on the Mosaic GPU
  # kernels; --triton-training adds rows through the Triton ones beside it.
  shapes = ((1, 1, b.n, b.d), (1, 1, b.kh, b.d), jnp.bfloat16, b.st)
  hopper = str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
  mosaic_trains = (hopper and not args.dry_run and b.impl in ("auto", "mosaic_gpu")
                   and mosaic_gpu.trains(*shapes))
  if hopper and not args.dry_run:
    b = dataclasses.replace(b, jax_mosaic=True)
  tokamax_version = None
  if args.tokamax:
    tokamax, tokamax_version = import_tokamax()
    version = tokamax_version
    if tokamax is None:
      log(f"tokamax rows: not added ({version})")
    elif not hopper or args.dry_run:
      log("tokamax rows: not added (its Mosaic GPU kernels need a Hopper GPU)")
    else:
      b = dataclasses.replace(b, tokamax=True)
  if args.triton_training and mosaic_trains:
    b = dataclasses.replace(b, triton_training=True)
  elif args.triton_training:
    log("Triton training rows: not added (ours does not train on the Mosaic kernels here)")
  streams = sorted({round(m * b.kh) for m in args.msr} | {0, b.kh})
  train_streams = list(dict.fromkeys(round(m * b.kh) for m in args.train_msr))
  meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
          "jax": jax.__version__, "python": platform.python_version(), "argv": sys.argv,
          "shape": {"B": 1, "N": b.n, "K": b.kh, "D": b.d, "dtype": "bfloat16"},
          "streaming": dataclasses.asdict(b.st), "dry_run": args.dry_run,
          "tokamax": tokamax_version}
  report = {"meta": meta}

  def finish(code: int = 0):
    if args.json:
      args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
      log(f"wrote {args.json}")
    sys.exit(code)

  if args.skip_torch:
    torch_versions = "torch skipped"
  elif args.torch_python == sys.executable:  # read from the installed metadata: no import
    torch_versions = f"torch {dist_version('torch')}, triton {dist_version('triton')}"
  else:
    torch_versions = f"torch from {args.torch_python}"
  print(f"{meta['date']}  {meta['device']} ({meta['backend']})  jax {jax.__version__}  "
        f"{torch_versions}  python {meta['python']}")
  print(f"B=1, {b.n}/{b.kh} heads, D={b.d}, bf16; SSA sink {b.st.sink_blocks} + local "
        f"{b.st.local_blocks} blocks of {b.st.block} (window peers: {b.window} tokens)"
        + ("; DRY RUN on CPU: times mean nothing" if args.dry_run else ""))

  t_check = min(args.lengths + ([] if args.skip_train else args.train_lengths))
  report["check"], working = check(b, t_check, streams, train_streams[0])
  runs = lambda what, tl: (f"ours, {what} "
                           f"{tl if isinstance(tl, str) else 'x'.join(map(str, tl))}" in working)
  b = dataclasses.replace(b, tiles=tuple(tl for tl in b.tiles if runs("tiles", tl)),
                          mosaic_tiles=tuple(tl for tl in b.mosaic_tiles if runs("mosaic", tl)),
                          also=tuple(i for i in b.also if f"ours, {i}" in working))
  worst = max(report["check"]["forward"].values())
  if worst > FWD_ERR_MAX:
    log(f"ABORT: forward rel err {worst:.2e} > {FWD_ERR_MAX:g}; nothing timed")
    finish(1)

  flex = run_torch(args, torch_request(args, b, streams, train_streams))
  meta["torch"] = flex.meta
  print(f"torch {flex.meta.get('torch', 'n/a')}, triton {flex.meta.get('triton', 'n/a')}, "
        f"device {flex.meta.get('device', 'n/a')}"
        + (f"  (Flex n/a: {flex.missing})" if not flex.results else ""))

  before = matmul_ceiling(b)
  fwd_rows, fwd_bwd_rows = {}, {}
  for t in args.lengths:
    fwd_rows[t] = forward_rows(b, t, streams, flex)
    print_table(f"Forward, T = {t} (of matmul: of the {before['tflops']:.0f} TFLOP/s "
                "measured before the rows)", annotate(fwd_rows[t], b.kh, before["tflops"]))
  if not args.skip_train:
    for t in args.train_lengths:
      fwd_bwd_rows[t] = train_rows(b, t, train_streams, flex)
      print_table(f"Forward + backward (dq, dk, dv; ours also dgate), T = {t}",
                  annotate(fwd_bwd_rows[t], b.kh, before["tflops"]))
  # Measured again after the rows: the yardstick is the faster of the two.
  ceiling = combined_ceiling({"before the rows": before, "after the rows": matmul_ceiling(b)})
  log(f"matrix-product ceiling: {ceiling['runs']['before the rows']['tflops']:.1f} TFLOP/s "
      f"before the rows, {ceiling['runs']['after the rows']['tflops']:.1f} after; the targets "
      f"(and the JSON's 'of matmul') use the larger, {ceiling['tflops']:.1f}")
  report["matmul_ceiling"] = ceiling
  fwd = {t: annotate(r, b.kh, ceiling["tflops"]) for t, r in fwd_rows.items()}
  train = {t: annotate(r, b.kh, ceiling["tflops"]) for t, r in fwd_bwd_rows.items()}
  report["forward"], report["train"] = fwd, train
  report["targets"] = targets(fwd, train, b.kh, ceiling["tflops"])
  print(f"\nKernel issue targets ({meta['device']}, jax {jax.__version__}, "
        f"torch {flex.meta.get('torch', 'n/a')}):")
  width = max((len(tg["target"]) for tg in report["targets"]), default=0)
  for tg in report["targets"]:
    v = "n/a" if tg["value"] is None else f"{tg['value']:.2f}"
    state = {None: "n/a", True: "met", False: "NOT met"}[tg["met"]]
    bound = "" if tg["bound"] is None else f"  (at the ceiling: {tg['bound']:.2f})"
    print(f"  {tg['target']:<{width}} {v:>6}  target {tg['goal']:<7} {state:<7}{bound}"
          .rstrip())
  # Full heads against the other FlashAttention-3-class kernels of the run, and the hybrid
  # forward against the fastest composition of the peers' kernels (no targets here).
  report["full_heads_vs_jax_mosaic"], report["full_heads_vs_tokamax"] = {}, {}
  report["full_heads_vs_sdpa_cudnn"], report["full_heads_vs_sdpa_flash"] = {}, {}
  report["full_heads_vs_fastest_peer"], report["hybrid_vs_peers_composition"] = {}, {}
  full_peers = (("cudnn_causal", f"{b.peer} causal", None),
                ("jax_mosaic_causal", "JAX Mosaic GPU causal", "full_heads_vs_jax_mosaic"),
                ("tokamax_causal", "tokamax Mosaic GPU causal", "full_heads_vs_tokamax"),
                ("sdpa_cudnn_causal", "PyTorch SDPA cuDNN causal", "full_heads_vs_sdpa_cudnn"),
                ("sdpa_flash_causal", "PyTorch SDPA FlashAttention causal",
                 "full_heads_vs_sdpa_flash"))
  for t, rows in fwd.items():
    sec = {r["key"]: r["sec"] for r in rows if r["streams"] in (None, 0) and r["sec"]}
    for key, name, out in full_peers:
      if out and key in sec and "ours" in sec:
        report[out][t] = sec[key] / sec["ours"]
        print(f"  T={t} MSR 0: ours / {name} throughput {report[out][t]:.2f} (no target)")
    timed_peers = [(sec[key], name) for key, name, _ in full_peers if key in sec]
    if timed_peers and "ours" in sec:
      best, name = min(timed_peers)
      report["full_heads_vs_fastest_peer"][t] = {"peer": name, "ratio": best / sec["ours"]}
      print(f"  T={t} MSR 0: ours / the fastest peer's throughput ({name}) "
            f"{best / sec['ours']:.2f} (the Hopper issue's target: >= 1)")
    for s in streams:
      if 0 < s < b.kh:
        at = {r["key"]: r["sec"] for r in rows if r["streams"] == s and r["sec"]}
        if "peers_ideal" in at and "ours" in at:
          x = at["peers_ideal"] / at["ours"]
          report["hybrid_vs_peers_composition"][f"{t}/{s}"] = x
          print(f"  T={t} MSR {s / b.kh:g}: ours / the peers' fastest composition "
                f"{x:.2f} (no target)")
  log("done")
  finish(0)


if __name__ == "__main__":
  main()
