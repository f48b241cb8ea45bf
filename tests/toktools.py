"""Tiny Hugging Face tokenizers built inside the tests (no hub, no downloads).

A byte-level BPE trained on a few texts (and `save_tiny_model`, a tiny random model beside
one): every string round-trips exactly, whatever words the
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


def save_tiny_model(out_dir, texts, *, seed: int = 0, max_position_embeddings: int = 4096,
                    chat_template: str | None = None):
  """A tiny random Qwen3 (2 layers, 4 query / 2 KV heads, head_dim 16, vocab 512) saved to
  `out_dir` with a tokenizer trained on `texts` (`make_tokenizer`); returns its ModelConfig."""
  import jax
  import elastic_jax as ej
  from elastic_jax.config import config_from_hf_dict
  from elastic_jax.model import init_params
  cfg = config_from_hf_dict(dict(model_type="qwen3", vocab_size=512, hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=max_position_embeddings))
  ej.save_pretrained(ej.ElasticModel(cfg, init_params(cfg, jax.random.key(seed), "float32"),
                                     cfg.to_hf_dict()), out_dir)
  make_tokenizer(out_dir, texts, chat_template=chat_template)
  return cfg
