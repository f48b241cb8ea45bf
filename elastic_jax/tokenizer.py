"""Tokenizers from local directories (never remote code), checked against the model, and the
chat template's user turn: what training data and evaluation prompts are built with."""

from __future__ import annotations

import contextlib
import logging
import os

from elastic_jax.errors import ElasticJaxError

# Files a Hugging Face tokenizer is read from; a directory with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tiktoken.model", "vocab.model")


class _NoTorchNotice(logging.Filter):
  """Drops transformers' notice that PyTorch is missing: tokenizers need no PyTorch."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "PyTorch was not found" not in record.getMessage()


@contextlib.contextmanager
def tokenizer_only():
  """While a tokenizer alone is imported or loaded: transformers' 'PyTorch was not found'
  notice is not printed (its other messages are)."""
  log = logging.getLogger("transformers")
  quiet = _NoTorchNotice()
  log.addFilter(quiet)
  try:
    yield
  finally:
    log.removeFilter(quiet)


def load_tokenizer(path: str | os.PathLike):
  """A Hugging Face tokenizer from a local directory (never remote code); must have an EOS."""
  with tokenizer_only():
    from transformers import AutoTokenizer
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise ElasticJaxError(f"{path}: no such tokenizer directory")
  if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES) and not any(
      f.endswith(".tiktoken") for f in os.listdir(path)):
    raise ElasticJaxError(f"{path}: holds no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, "
                          "...); copy the model's tokenizer there or name one with "
                          "data.tokenizer")
  try:
    with tokenizer_only():
      tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
  except (OSError, ValueError, KeyError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ElasticJaxError(f"{path}: cannot load a tokenizer ({first})") from e
  if len(tok) < 2 or not tok("a b c", add_special_tokens=False)["input_ids"]:
    raise ElasticJaxError(f"{path}: the tokenizer is empty (it encodes text to no tokens)")
  if tok.eos_token_id is None:
    raise ElasticJaxError(f"{path}: the tokenizer defines no EOS token")
  return tok


def check_vocabulary(tokenizer, vocab_size: int, where: str) -> None:
  """Refuses a tokenizer whose ids reach past the model's vocabulary."""
  n = len(tokenizer)
  if n > vocab_size:
    example = tokenizer.convert_ids_to_tokens(n - 1)
    raise ElasticJaxError(f"{where}: the tokenizer has {n} tokens but the model's vocabulary "
                          f"has {vocab_size}: ids {vocab_size}..{n - 1} (e.g. {example!r}) would "
                          "index past its embedding table")


def render_user_turn(tokenizer, content: str) -> str:
  """The chat template applied to one user message, with the generation prompt, as text."""
  try:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             tokenize=False, add_generation_prompt=True)
  except Exception as e:  # jinja2 missing, or the template raising on a lone user turn
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ElasticJaxError(f"the tokenizer's chat template cannot be rendered ({first})") from e
  if not isinstance(rendered, str):
    raise ElasticJaxError("the tokenizer's chat template did not render to a string")
  return rendered


