"""An OpenAI-compatible HTTP endpoint on the continuous-batching engine (engine.py).

    elastic-jax-serve MODEL [--routers DIR] [--port 8000] [--num-pages N | --memory-fraction F]

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (models whose tokenizer has a
chat template), each streamed (server-sent events, `"stream": true`) or not; `GET /v1/models`;
`GET /health`. Built on Starlette and served by uvicorn (the `serve` extra).

One thread owns the engine (`Worker`): the request handlers hand it submissions and
cancellations and receive each request's new tokens on an asyncio queue, so every request in
flight advances in the engine's shared decode step. A bad request (malformed JSON, an unknown
field, a setting this server does not take, a prompt too long for the model or for the whole
page pool) gets a 400 with one sentence and never reaches the engine's running requests; a
client that goes away has its request cancelled, and its pages return to the pool at once.

Stop strings are matched on the decoded text (the engine stops on token ids): a streamed
response holds back the last characters that could still begin a stop string.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import queue
import threading
import time
import uuid
from typing import Any

from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation.engine import Engine, Event, Request
from elastic_jax.generation.generate import SamplingConfig

# Fields of OpenAI's requests that this server reads, and those it accepts only at the value
# that means "not used" (so that harnesses sending them at their defaults work unchanged).
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "stop", "stream",
                     "seed", "user", "stream_options")
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature",
               "top_p", "stop", "stream", "seed", "user", "stream_options")
NEUTRAL = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (None, False),
           "top_logprobs": (None, 0), "presence_penalty": (0, 0.0),
           "frequency_penalty": (0, 0.0), "logit_bias": (None, {}), "suffix": (None, ""),
           "response_format": (None, {"type": "text"}), "tools": (None, []),
           "tool_choice": (None, "none"), "parallel_tool_calls": (None,)}
DEFAULT_COMPLETION_TOKENS = 16          # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4


class BadRequest(Exception):
  """A request this server refuses (HTTP 400), in one sentence."""


# ----------------------------------------------------------------------------------------------
# The engine's thread


class Worker:
  """Runs the engine in one thread: submissions and cancellations arrive from the handlers
  (any thread), each request's events go to the asyncio queue it was submitted with."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self.failure: str | None = None
    self.finished: collections.Counter = collections.Counter()   # ended requests by reason
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
    self._thread.start()

  def submit(self, prompt, sampling, stop_ids, max_new_tokens, sink) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._inbox.put(("submit", (prompt, sampling, stop_ids, max_new_tokens, sink), future))
    return future

  def cancel(self, request: Request) -> None:
    self._inbox.put(("cancel", request, None))

  def close(self) -> None:
    self._stop.set()
    self._inbox.put(("wake", None, None))
    self._thread.join(timeout=30)

  def _handle(self, kind, payload, future) -> None:
    if kind == "submit":
      prompt, sampling, stop_ids, max_new_tokens, sink = payload
      try:
        request = self.engine.submit(prompt, sampling, stop=stop_ids,
                                     max_new_tokens=max_new_tokens)
      except ElasticJaxError as e:
        future.set_exception(BadRequest(str(e)))
        return
      self._sinks[request.id] = sink
      future.set_result(request)
    elif kind == "cancel" and payload.finish is None:
      self.engine.cancel(payload)
      self._deliver(Event(payload, (), True))

  def _deliver(self, event: Event) -> None:
    sink = self._sinks.get(event.request.id)
    if sink is None:
      return
    loop, q = sink
    if event.finished:
      del self._sinks[event.request.id]
      self.finished[event.request.finish] += 1
    try:
      loop.call_soon_threadsafe(q.put_nowait, event)
    except RuntimeError:       # the handler's loop has closed: nobody is waiting
      pass

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        block = self.engine.idle
        while True:
          kind, payload, future = self._inbox.get(block=block, timeout=0.5 if block else None)
          self._handle(kind, payload, future)
          block = False
      except queue.Empty:
        pass
      if self._stop.is_set() or self.engine.idle:
        continue
      try:
        events = self.engine.step()
      except Exception as e:  # noqa: BLE001 - reported to every request and to /health
        self.failure = f"{type(e).__name__}: {e}"
        for request in [r for r in self.engine.rows if r is not None] + list(self.engine.queue):
          self.engine.cancel(request)
          self._deliver(Event(request, (), True))
        continue
      for event in events:
        self._deliver(event)


# ----------------------------------------------------------------------------------------------
# Requests


@dataclasses.dataclass
class Job:
  """One parsed request: its prompt ids, sampling, limits and how to answer."""
  prompt: list[int]
  sampling: SamplingConfig
  max_new_tokens: int
  stop_strings: tuple[str, ...]
  stream: bool
  chat: bool
  model: str


def _check_fields(body: dict, fields: tuple[str, ...]) -> None:
  for key, value in body.items():
    if key in fields:
      continue
    if key in NEUTRAL:
      if value not in NEUTRAL[key]:
        raise BadRequest(f"'{key}' is not supported by this server (only {NEUTRAL[key][0]!r})")
      continue
    raise BadRequest(f"unknown field '{key}' (accepted: {', '.join(fields)})")


def _number(body, key, default, kind=float, lo=None, hi=None):
  value = body.get(key, default)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
    raise BadRequest(f"'{key}' must be {'a number' if kind is float else 'an integer'}, "
                     f"got {value!r}")
  if (lo is not None and value < lo) or (hi is not None and value > hi):
    raise BadRequest(f"'{key}' must be in [{lo}, {hi if hi is not None else 'inf'}], "
                     f"got {value!r}")
  return kind(value)


def _stop_strings(body) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  stop = [stop] if isinstance(stop, str) else stop
  if (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
      or len(stop) > MAX_STOP_STRINGS):
    raise BadRequest(f"'stop' must be a non-empty string or a list of at most "
                     f"{MAX_STOP_STRINGS} of them")
  return tuple(stop)


def _prompt_ids(body, tokenizer) -> list[int]:
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]                      # a batch of one
  if isinstance(prompt, str) and prompt:
    if tokenizer is None:
      raise BadRequest("this model has no tokenizer: send 'prompt' as a list of token ids")
    return list(tokenizer(prompt)["input_ids"])
  if (isinstance(prompt, list) and prompt
      and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
    return prompt
  raise BadRequest("'prompt' must be a non-empty string or a list of token ids (one prompt "
                   "per request)")


def _chat_ids(body, tokenizer) -> list[int]:
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str)
      and isinstance(m.get("content"), str) for m in messages):
    raise BadRequest("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} "
                     "with text contents")
  if tokenizer is None or not getattr(tokenizer, "chat_template", None):
    raise BadRequest("this model has no chat template: use /v1/completions")
  try:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  except Exception as e:  # noqa: BLE001 - a template's own error, reported as the client's
    raise BadRequest(f"the chat template cannot render these messages ({e})") from None
  if isinstance(ids, dict) or hasattr(ids, "keys"):
    ids = ids["input_ids"]
  return [int(t) for t in ids]


def parse(body: Any, *, chat: bool, tokenizer, max_seq_len: int, name: str) -> Job:
  """The Job of a request body, or BadRequest."""
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object")
  _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
  prompt = _chat_ids(body, tokenizer) if chat else _prompt_ids(body, tokenizer)
  if len(prompt) >= max_seq_len:
    raise BadRequest(f"the prompt has {len(prompt)} tokens; this server takes at most "
                     f"{max_seq_len - 1} (prompt and output together: {max_seq_len})")
  room = max_seq_len - len(prompt)
  key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
  default = room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
  max_new = _number(body, key, default, int, 1)
  if max_new > room:
    raise BadRequest(f"the prompt ({len(prompt)} tokens) and '{key}' ({max_new}) exceed the "
                     f"{max_seq_len} tokens a request may have")
  sampling = SamplingConfig(max_new_tokens=max_new,
                            temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
                            top_p=_number(body, "top_p", 1.0, float, 1e-6, 1.0),
                            seed=_number(body, "seed", 0, int))
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise BadRequest(f"'stream' must be true or false, got {stream!r}")
  model = body.get("model", name)
  if not isinstance(model, str):
    raise BadRequest(f"'model' must be a string, got {model!r}")
  return Job(prompt, sampling, max_new, _stop_strings(body), stream, chat, model)


class Text:
  """The decoded text of a request's tokens, cut at the first stop string; `ready()` is what
  may be sent so far (a tail that could begin a stop string is held back).

  Decoding is incremental: each event decodes its new tokens with a few tokens of left
  context (a window from the previous event's start), not the whole output again, and stop
  strings are searched only in the new text and the tail before it. So the work per event
  does not grow with the output's length. A window that ends inside a multi-byte character
  (decoded as U+FFFD) waits for up to 3 more tokens. When the request ends, the whole output is
  decoded once, so the final text is exactly the tokenizer's decode of it.
  """

  def __init__(self, tokenizer, stop_strings, eos: frozenset):
    self.tokenizer, self.stop_strings, self.eos = tokenizer, stop_strings, eos
    self.tokens: list[int] = []
    self.text, self.stopped, self.sent = "", False, 0
    self._prefix = self._read = 0     # token offsets: the decode window's context and end
    self._searched = 0                # text already searched for stop strings
    self._longest = max((len(x) for x in stop_strings), default=0)

  def _decode(self, ids) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=True)

  def add(self, tokens, finish: str | None) -> None:
    if self.stopped:
      return
    self.tokens += tokens
    n = len(self.tokens)
    if finish in ("eos", "stop") and n:           # the token that ended it is not text
      n -= 1
    if self.tokenizer is None:
      return
    if finish is not None:
      self.text = self._decode(self.tokens[:n])
    elif n > self._read:
      before = self._decode(self.tokens[self._prefix:self._read])
      window = self._decode(self.tokens[self._prefix:n])
      # A character of up to 4 bytes may still complete; past that, U+FFFD is the text.
      if window.endswith("\ufffd") and n - self._read < 4:
        pass
      elif window.startswith(before):
        self.text += window[len(before):]
        self._prefix, self._read = self._read, n
      else:                                         # the context changed earlier text
        self.text = self._decode(self.tokens[:n])
        self._prefix = self._read = n
    start = 0 if finish is not None else max(0, self._searched - self._longest + 1)
    cut = min((i for i in (self.text.find(x, start) for x in self.stop_strings) if i >= 0),
              default=-1)
    if cut >= 0:
      self.text, self.stopped = self.text[:cut], True
    self._searched = len(self.text)

  def ready(self, finished: bool) -> str:
    end = len(self.text)
    if not finished and not self.stopped and self.stop_strings:
      end -= self._longest - 1
    end = max(end, self.sent)
    chunk, self.sent = self.text[self.sent:end], end
    return chunk


# ----------------------------------------------------------------------------------------------
# The application


def _error(status: int, message: str):
  from starlette.responses import JSONResponse
  return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                 "code": status}}, status_code=status)


def _finish_reason(request: Request, text: Text) -> str:
  if text.stopped or request.finish in ("eos", "stop"):
    return "stop"
  return "length" if request.finish == "length" else "stop"


def _usage(job: Job, request: Request) -> dict:
  return {"prompt_tokens": len(job.prompt), "completion_tokens": len(request.tokens),
          "total_tokens": len(job.prompt) + len(request.tokens)}


def _choice(job: Job, text: str, finish, *, delta: bool) -> dict:
  if not job.chat:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
  body = {"role": "assistant", "content": text}
  return ({"index": 0, "delta": body, "finish_reason": finish} if delta else
          {"index": 0, "message": body, "finish_reason": finish})


def _envelope(job: Job, rid: str, created: int, choice: dict, *, chunk: bool) -> dict:
  kind = ("chat.completion" if job.chat else "text_completion") + (
      ".chunk" if chunk and job.chat else "")
  return {"id": rid, "object": kind, "created": created, "model": job.model,
          "choices": [choice]}


def build_app(worker: Worker, tokenizer, *, name: str):
  """The Starlette application serving `worker`'s engine under the model name `name`."""
  from starlette.applications import Starlette
  from starlette.responses import JSONResponse, StreamingResponse
  from starlette.routing import Route

  engine = worker.engine

  async def run(job: Job):
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    future = worker.submit(job.prompt, job.sampling, [], job.max_new_tokens,
                           (loop, events))
    request = await asyncio.wrap_future(future)
    return request, events, Text(tokenizer, job.stop_strings, engine.eos)

  async def next_event(events, request, text, http_request):
    """The request's next event; None once it has ended (finished, stopped or the client
    gone, in which case it is cancelled)."""
    while True:
      try:
        event = await asyncio.wait_for(events.get(), timeout=0.5)
      except asyncio.TimeoutError:
        if await http_request.is_disconnected():
          worker.cancel(request)
          return None
        continue
      text.add(list(event.tokens), request.finish if event.finished else None)
      if text.stopped and not event.finished:
        worker.cancel(request)
      return event

  async def complete(http_request, chat: bool):
    try:
      body = json.loads(await http_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return _error(400, f"the request body is not valid JSON ({e})")
    if worker.failure:
      return _error(503, f"the engine has stopped: {worker.failure}")
    try:
      job = parse(body, chat=chat, tokenizer=tokenizer, max_seq_len=engine.max_seq_len,
                  name=name)
      request, events, text = await run(job)
    except BadRequest as e:
      return _error(400, str(e))
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
    if job.stream:
      return StreamingResponse(_stream(job, request, events, text, http_request, rid, created),
                               media_type="text/event-stream")
    while True:
      event = await next_event(events, request, text, http_request)
      if event is None or event.finished:
        break
    if request.finish == "cancelled" and not text.stopped:
      return _error(503, "the request was cancelled before it finished"
                    + (f" ({worker.failure})" if worker.failure else ""))
    out = _envelope(job, rid, created, _choice(job, text.text, _finish_reason(request, text),
                                               delta=False), chunk=False)
    out["usage"] = _usage(job, request)
    return JSONResponse(out)

  async def _stream(job, request, events, text, http_request, rid, created):
    finished = False
    try:
      if job.chat:
        first = _choice(job, "", None, delta=True)
        first["delta"] = {"role": "assistant", "content": ""}
        yield _sse(_envelope(job, rid, created, first, chunk=True))
      while not finished:
        event = await next_event(events, request, text, http_request)
        if event is None:
          return
        finished = event.finished
        chunk = text.ready(finished)
        if chunk or finished:
          reason = _finish_reason(request, text) if finished else None
          yield _sse(_envelope(job, rid, created, _choice(job, chunk, reason, delta=True),
                               chunk=True))
      yield "data: [DONE]\n\n"
    finally:
      if not finished:           # the client went away mid-stream
        worker.cancel(request)

  async def completions(http_request):
    return await complete(http_request, chat=False)

  async def chat_completions(http_request):
    return await complete(http_request, chat=True)

  async def models(_):
    return JSONResponse({"object": "list", "data": [{"id": name, "object": "model",
                                                     "owned_by": "elastic_jax"}]})

  async def health(_):
    if worker.failure:
      return JSONResponse({"status": "failed", "error": worker.failure}, status_code=503)
    return JSONResponse({"status": "ok", "free_pages": engine.alloc.free_pages,
                         "pages": engine.num_pages,
                         "running": sum(r is not None for r in engine.rows),
                         "waiting": len(engine.queue), "finished": dict(worker.finished)})

  return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                           Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                           Route("/v1/models", models, methods=["GET"]),
                           Route("/health", health, methods=["GET"])])


def _sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"


# ----------------------------------------------------------------------------------------------
# The command


def build_parser() -> argparse.ArgumentParser:
  from elastic_jax.cli import prog_name
  p = argparse.ArgumentParser(prog=prog_name("python -m elastic_jax.generation.server"),
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model", help="a model directory (HF or the authors' checkpoint)")
  p.add_argument("--routers", help="trained routers (a train.py export) to attach")
  p.add_argument("--name", help="the model name clients send (default: the directory's name)")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on")
  p.add_argument("--port", type=int, default=8000, help="port to listen on")
  pool = p.add_mutually_exclusive_group()
  pool.add_argument("--num-pages", type=int, help="pages in the cache pool")
  pool.add_argument("--memory-fraction", type=float,
                    help="the pool as a fraction of the device's free memory (default 0.9)")
  p.add_argument("--page-size", type=int, default=16, help="tokens per page")
  p.add_argument("--max-batch", type=int, default=8, help="requests decoding at once")
  p.add_argument("--max-seq-len", type=int, help="the longest prompt plus output of a request")
  p.add_argument("--attention", choices=("elastic", "full", "sparse"),
                 help="default: elastic where the model has routers, else full")
  p.add_argument("--dtype", default="auto",
                 help="auto (default: the checkpoint's own dtype) | float32 | bfloat16")
  p.add_argument("--attn-impl", default="auto",
                 help="prefill attention implementation (auto, reference, a kernel's name)")
  p.add_argument("--decode-impl", default="reference",
                 help="decode attention over the pages: reference (plain jnp), pallas_gpu "
                      "(a kernel that reads only each head's pages) or auto")
  p.add_argument("--prefill-layers", type=int,
                 help="interleave prefills with decoding, this many layers of prefill per "
                      "step (default: a prefill runs whole at its admission)")
  return p


def main(argv=None) -> int:
  import os
  import elastic_jax as ej
  args = build_parser().parse_args(argv)
  model = ej.from_pretrained(args.model, routers=args.routers, dtype=args.dtype,
                             attn_impl=args.attn_impl)
  tokenizer = model.tokenizer if model.source_dir is not None else None
  eos = getattr(tokenizer, "eos_token_id", None)
  engine = Engine.from_model(
      model, args.attention, eos_ids=() if eos is None else [int(eos)],
      num_pages=args.num_pages,
      memory_fraction=(None if args.num_pages else args.memory_fraction or 0.9),
      page_size=args.page_size, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
      decode_impl=args.decode_impl, prefill_layers=args.prefill_layers)
  import uvicorn
  worker = Worker(engine)
  name = args.name or os.path.basename(os.path.normpath(args.model))
  try:
    uvicorn.run(build_app(worker, tokenizer, name=name), host=args.host, port=args.port,
                log_level="info")
  finally:
    worker.close()
  return 0


def console() -> int:
  from elastic_jax.cli import run_cli
  return run_cli(main)


if __name__ == "__main__":
  raise SystemExit(console())
