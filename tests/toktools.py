"""Tiny Hugging Face tokenizers built inside the tests (no hub, no downloads).

A byte-level BPE trained on a few texts: every string round-trips exactly, whatever words the
training texts held, so tests may tokenize any text.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(out_dir, texts, *, chat_template: str | None = None,
                   vocab_size: int = 400) -> str:
  """Train a byte-level BPE on `texts`, save it (adds <s> in front; </s> is EOS) to `out_dir`
  with `save_pretrained` and return the directory as a string."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  from transformers import PreTrainedTokenizerFast
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
      list(texts), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                       show_progress=False,
                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
  hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                               pad_token="<pad>")
  if chat_template is not None:
    hf.chat_template = chat_template
  Path(out_dir).mkdir(parents=True, exist_ok=True)
  hf.save_pretrained(out_dir)
  return str(out_dir)
