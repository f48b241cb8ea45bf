"""The OpenAI-compatible endpoint (generation/server.py) on localhost, through a real HTTP
client: completions and chat completions, streamed and not, give `generate`'s text for the
same prompt; bad requests get one-sentence 400s without disturbing a request in flight; a
client that goes away frees its pages."""

import http.client
import json
import socket
import threading
import time

import pytest

import elastic_jax as ej
from elastic_jax.generation.engine import Engine
from elastic_jax.generation.generate import SamplingConfig
from toktools import CHAT_TEMPLATE, save_tiny_model

uvicorn = pytest.importorskip("uvicorn")
server_mod = pytest.importorskip("elastic_jax.generation.server")

WORDS = "the grass is green and the sky is blue while rivers run to the sea at night"
NUM_PAGES, PAGE, MAX_SEQ = 48, 16, 256


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  root = tmp_path_factory.mktemp("serve")
  save_tiny_model(root / "m", [WORDS], seed=3, max_position_embeddings=1024,
                  chat_template=CHAT_TEMPLATE)
  model = ej.from_pretrained(root / "m", dtype="float32", show_progress=False)
  eos = model.tokenizer.eos_token_id
  engine = Engine.from_model(model, "full", eos_ids=[eos], num_pages=NUM_PAGES, page_size=PAGE,
                             max_batch=4, max_seq_len=MAX_SEQ, attn_impl="reference")
  worker = server_mod.Worker(engine)
  app = server_mod.build_app(worker, model.tokenizer, name="tiny")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.time() + 30
  while not server.started and time.time() < deadline:
    time.sleep(0.05)
  assert server.started
  yield model, engine, port
  server.should_exit = True
  thread.join(timeout=30)
  worker.close()


def _post(port, path, body, *, raw=None):
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
  data = raw if raw is not None else json.dumps(body).encode()
  conn.request("POST", path, data, {"Content-Type": "application/json"})
  resp = conn.getresponse()
  return resp.status, resp.read().decode(), resp.getheader("content-type")


def _events(text: str):
  """The JSON payloads of a server-sent event stream, and whether it ended with [DONE]."""
  datas = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
  done = bool(datas) and datas[-1] == "[DONE]"
  return [json.loads(d) for d in datas if d != "[DONE]"], done


def _generated(model, ids, n):
  gen = model.generate([list(ids)], attention="full", max_new_tokens=n,
                       sampling=SamplingConfig(max_new_tokens=n), attn_impl="reference")
  return gen.texts[0]


def test_completions_plain_and_streamed_equal_generate(served):
  model, engine, port = served
  prompt = "the sky is blue and the grass"
  ids = model.tokenizer(prompt)["input_ids"]
  want = _generated(model, ids, 12)
  status, body, _ = _post(port, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                     "max_tokens": 12, "temperature": 0})
  assert status == 200, body
  out = json.loads(body)
  assert out["object"] == "text_completion" and out["choices"][0]["text"] == want
  assert out["choices"][0]["finish_reason"] in ("stop", "length")
  assert out["usage"]["prompt_tokens"] == len(ids)
  status, body, kind = _post(port, "/v1/completions", {"prompt": ids, "max_tokens": 12,
                                                        "temperature": 0, "stream": True})
  assert status == 200 and kind.startswith("text/event-stream")
  chunks, done = _events(body)
  assert done and "".join(c["choices"][0]["text"] for c in chunks) == want
  assert chunks[-1]["choices"][0]["finish_reason"] == out["choices"][0]["finish_reason"]


def test_chat_completions_use_the_chat_template(served):
  model, _, port = served
  messages = [{"role": "user", "content": "is the sea blue"}]
  ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  ids = ids["input_ids"] if hasattr(ids, "keys") else ids
  want = _generated(model, ids, 10)
  status, body, _ = _post(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 10,
                                                          "temperature": 0})
  assert status == 200, body
  out = json.loads(body)
  assert out["object"] == "chat.completion"
  assert out["choices"][0]["message"] == {"role": "assistant", "content": want}
  status, body, _ = _post(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 10,
                                                          "temperature": 0, "stream": True})
  chunks, done = _events(body)
  assert done and all(c["object"] == "chat.completion.chunk" for c in chunks)
  assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want


def test_requests_in_flight_together_each_get_their_own_text(served):
  model, _, port = served
  prompts = ["the grass", "rivers run to the sea at night and", "green"]
  want = [_generated(model, model.tokenizer(p)["input_ids"], n)
          for p, n in zip(prompts, (9, 14, 5))]
  got = [None] * 3

  def ask(i, n):
    got[i] = _post(port, "/v1/completions", {"prompt": prompts[i], "max_tokens": n,
                                             "temperature": 0, "stream": i == 1})
  threads = [threading.Thread(target=ask, args=(i, n)) for i, n in enumerate((9, 14, 5))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert json.loads(got[0][1])["choices"][0]["text"] == want[0]
  assert "".join(c["choices"][0]["text"] for c in _events(got[1][1])[0]) == want[1]
  assert json.loads(got[2][1])["choices"][0]["text"] == want[2]


def test_stop_strings_cut_the_text(served):
  model, _, port = served
  prompt = "the sky is blue and the grass"
  full = _generated(model, model.tokenizer(prompt)["input_ids"], 20)
  stop = full[len(full) // 2:len(full) // 2 + 2]
  assert stop
  want = full[:full.find(stop)]
  for stream in (False, True):
    status, body, _ = _post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 20,
                                                       "temperature": 0, "stop": stop,
                                                       "stream": stream})
    assert status == 200
    text = ("".join(c["choices"][0]["text"] for c in _events(body)[0]) if stream
            else json.loads(body)["choices"][0]["text"])
    assert text == want


@pytest.mark.parametrize("body, raw, words", [
    (None, b"{not json", "not valid JSON"),
    ({"prompt": "the sky", "best_temperature": 1}, None, "unknown field 'best_temperature'"),
    ({"prompt": "the sky", "n": 2}, None, "'n' is not supported by this server (only 1)"),
    ({"prompt": "the sky", "max_tokens": 0}, None, "'max_tokens' must be in [1"),
    ({"prompt": ""}, None, "'prompt' must be a non-empty string or a list of token ids"),
    ({"prompt": [1, 2, 9999]}, None, "outside the vocabulary"),
    ({"prompt": list(range(3, 3 + MAX_SEQ))}, None, f"takes at most {MAX_SEQ - 1}"),
    ({"prompt": list(range(3, 103)), "max_tokens": 200}, None, "exceed the 256 tokens"),
    # 100 + 150 positions need 16 pages for each of the 4 heads: more than the pool's 48
    ({"prompt": list(range(3, 103)), "max_tokens": 150}, None, "pages"),
    ({"prompt": "the sky", "stop": ["a", "b", "c", "d", "e"]}, None, "at most 4"),
])
def test_bad_requests_get_one_sentence_and_leave_others_running(served, body, raw, words):
  model, engine, port = served
  result = {}
  runner = threading.Thread(target=lambda: result.update(out=_post(
      port, "/v1/completions", {"prompt": "the grass is", "max_tokens": 24, "temperature": 0,
                                "stream": True})))
  runner.start()
  status, text, _ = _post(port, "/v1/completions", body, raw=raw)
  runner.join(timeout=120)
  assert status == 400, text
  message = json.loads(text)["error"]["message"]
  assert words in message and "\n" not in message
  chunks, done = _events(result["out"][1])
  assert done and "".join(c["choices"][0]["text"] for c in chunks) == _generated(
      model, model.tokenizer("the grass is")["input_ids"], 24)


def test_a_client_that_goes_away_frees_its_pages(served, monkeypatch):
  _, engine, port = served
  step = engine.step                      # 20 ms a step: the request outlasts the disconnect
  monkeypatch.setattr(engine, "step", lambda: time.sleep(0.02) or step())
  cancelled = json.loads(_get(port, "/health"))["finished"].get("cancelled", 0)
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  conn.request("POST", "/v1/completions", json.dumps(
      {"prompt": "the grass", "max_tokens": 180, "temperature": 0, "stream": True}),
      {"Content-Type": "application/json"})
  resp = conn.getresponse()
  assert resp.status == 200
  resp.fp.readline()                      # the first event: the request is decoding
  conn.sock.shutdown(socket.SHUT_RDWR)
  conn.close()
  deadline = time.time() + 60
  while time.time() < deadline:
    health = json.loads(_get(port, "/health"))
    if health["free_pages"] == NUM_PAGES and health["running"] == 0:
      break
    time.sleep(0.2)
  finished = health.pop("finished")
  assert health == {"status": "ok", "free_pages": NUM_PAGES, "pages": NUM_PAGES, "running": 0,
                    "waiting": 0}
  assert finished["cancelled"] == cancelled + 1          # ended by the cancel, not its limit
  assert engine.alloc.available == NUM_PAGES     # no reservation left behind either


def _get(port, path):
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  conn.request("GET", path)
  resp = conn.getresponse()
  assert resp.status == 200
  return resp.read().decode()


def test_models_lists_the_served_name(served):
  _, _, port = served
  assert [m["id"] for m in json.loads(_get(port, "/v1/models"))["data"]] == ["tiny"]


def test_the_command_serves_a_model_directory(served, tmp_path):
  """`python -m elastic_jax.generation.server MODEL` (the elastic-jax-serve command): refuses
  a missing directory in one sentence, then serves /health and a completion."""
  import subprocess
  import sys
  model, _, _ = served
  with pytest.raises(ej.ElasticJaxError, match="nothing"):
    server_mod.main([str(tmp_path / "nothing"), "--num-pages", "8"])
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen([sys.executable, "-m", "elastic_jax.generation.server",
                           str(model.source_dir), "--num-pages", str(NUM_PAGES),
                           "--max-seq-len", str(MAX_SEQ), "--port", str(port),
                           "--attention", "full", "--attn-impl", "reference", "--name", "t"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 240
    while time.time() < deadline:
      try:
        if json.loads(_get(port, "/health"))["status"] == "ok":
          break
      except OSError:
        time.sleep(0.5)
    status, body, _ = _post(port, "/v1/completions", {"model": "t", "prompt": "the grass",
                                                       "max_tokens": 6, "temperature": 0})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == _generated(
        model, model.tokenizer("the grass")["input_ids"], 6)
  finally:
    proc.terminate()
    proc.wait(timeout=60)


@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_text_equals_the_whole_decode(tmp_path, seed):
  """The streamed text (tokens added a few at a time, decoded with a short window) is at
  every step a prefix of the tokenizer's decode of all tokens so far, the final text equals
  that decode, and a stop string cuts at its first occurrence as on the whole text. Random
  byte-level tokens, so multi-byte characters split across events occur."""
  import random

  from transformers import AutoTokenizer

  from toktools import make_tokenizer
  tok = AutoTokenizer.from_pretrained(make_tokenizer(tmp_path / "t", [WORDS, "café über naïve ☃ 雪"]))
  rng = random.Random(seed)
  ids = [rng.randrange(3, len(tok)) for _ in range(300)]
  whole = lambda n: tok.decode(ids[:n], skip_special_tokens=True)
  text = server_mod.Text(tok, (), frozenset())
  n = 0
  while n < len(ids):
    k = rng.randint(1, 4)
    last = n + k >= len(ids)
    text.add(ids[n:n + k], "length" if last else None)
    n = min(n + k, len(ids))
    assert whole(n).startswith(text.text)
    # Held back: at most the last 3 tokens (an unfinished character).
    assert len(text.text) >= len(whole(max(n - 3, 0))) - 1
  assert text.text == whole(len(ids))
  stop = whole(len(ids))[150:153]
  cut = server_mod.Text(tok, (stop,), frozenset())
  for i in range(0, len(ids), 3):
    cut.add(ids[i:i + 3], None)
    if cut.stopped:
      break
  assert cut.stopped and cut.text == whole(len(ids))[:whole(len(ids)).find(stop)]
