"""LongBench / LongBench-E / LongBench v2 loading and model inputs, on small fabricated files.

Expected prompts, generation lengths and excluded tasks are written out by hand from the
published THUDM/LongBench configuration, so a wrong template or number in the json fails here.
Truncation is checked against character offsets of the tokens, not by re-running the slicing.
"""

from __future__ import annotations

import json

import pytest

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval import longbench as lb
from toktools import CHAT_TEMPLATE, make_tokenizer

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega question answer passage the of and").split()


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
  """{"plain": tokenizer (adds BOS), "chat": same vocabulary with CHAT_TEMPLATE}."""
  from transformers import AutoTokenizer
  texts = [" ".join(WORDS), " ".join(reversed(WORDS)), "Answer the question: what? Paris.\n"]
  plain = make_tokenizer(tmp_path_factory.mktemp("plain"), texts)
  chat = make_tokenizer(tmp_path_factory.mktemp("chat"), texts, chat_template=CHAT_TEMPLATE)
  return {"plain": AutoTokenizer.from_pretrained(plain),
          "chat": AutoTokenizer.from_pretrained(chat)}


def v1_obj(i=0, **over):
  obj = {"input": f"question {i}?", "context": f"passage {i} alpha beta", "answers": [f"a{i}"],
         "length": 7 + i, "dataset": "hotpotqa", "language": "en", "all_classes": None,
         "_id": f"id{i}"}
  obj.update(over)
  return obj


def write_jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                  encoding="utf-8")
  return path


def record(dataset, context="CTX", input="INP"):
  return lb.Record(dataset=dataset, id="x", input=input, context=context, answers=("a",),
                   length=1, language="en", all_classes=None, e=False, source="t:1")


def v2_obj(i=0, **over):
  obj = {"_id": f"v2-{i}", "domain": "Single-Document QA", "sub_domain": "Legal",
         "difficulty": "easy", "length": "short", "question": f" Which one {i}? ",
         "choice_A": " a ", "choice_B": "b", "choice_C": "c", "choice_D": "d\n", "answer": "B",
         "context": f"\n doc {i} \n"}
  obj.update(over)
  return obj


def write_v2(dir_path, rows, indent=None):
  dir_path.mkdir(parents=True, exist_ok=True)
  (dir_path / "data.json").write_text(json.dumps(rows, indent=indent), encoding="utf-8")
  return dir_path


# ----------------------------------------------------------------------------- the specification

def test_task_lists_and_excluded_tasks():
  assert len(lb.DATASETS) == 21 and lb.DATASETS[0] == "narrativeqa"
  assert lb.DATASETS[-1] == "repobench-p"
  assert lb.DATASETS_E == ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report",
                           "multi_news", "trec", "triviaqa", "samsum", "passage_count",
                           "passage_retrieval_en", "lcc", "repobench-p")
  assert lb.NO_CHAT_DATASETS == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
  assert set(lb.PROMPTS) == set(lb.DATASETS) == set(lb.MAX_NEW_TOKENS)
  assert "THUDM/LongBench" in lb.SOURCE and "THUDM/LongBench" in lb.__doc__


def test_max_new_tokens_are_the_published_ones():
  expected = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32,
              "dureader": 128, "gov_report": 512, "vcsum": 512, "trec": 64, "triviaqa": 32,
              "samsum": 128, "passage_count": 32, "passage_retrieval_zh": 32, "lcc": 64,
              "repobench-p": 64}
  assert {k: lb.MAX_NEW_TOKENS[k] for k in expected} == expected
  assert lb.V2_MAX_NEW_TOKENS == 128
  assert lb.MODEL_MAX_LENGTH["llama2-7b-chat-4k"] == 3500
  assert lb.MODEL_MAX_LENGTH["chatglm3-6b-32k"] == 31500
  assert lb.V2_MODEL_MAX_LENGTH["Llama-3.1-8B-Instruct"] == 120000


def test_prompts_match_hand_written_templates():
  ask = "Answer the question based on the given passages. Only give me the answer and do not " \
        "output any other words."
  assert lb.build_prompt(record("hotpotqa", "P1 {x}", "Q?")) == (
      f"{ask}\n\nThe following are given passages.\nP1 {{x}}\n\n{ask}\n\nQuestion: Q?\nAnswer:")
  assert lb.build_prompt(record("trec", "C", "I")) == (
      "Please determine the type of the question below. Here are some examples of questions."
      "\n\nC\nI")
  assert lb.build_prompt(record("repobench-p", "code()\n", "x = ")) == (
      "Please complete the code given below. \ncode()\nx = Next line of code:\n")
  assert lb.build_prompt(record("multifieldqa_zh", "文", "问")) == (
      "阅读以下文字并用中文简短回答：\n\n文\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，"
      "不要输出任何其他字词。\n\n问题：问\n回答：")
  assert lb.build_prompt(record("passage_count", "P")).endswith(
      "\n\nP\n\nPlease enter the final count of unique paragraphs after removing duplicates. "
      "The output format should only contain the number, such as 1, 2, 3, and so on.\n\n"
      "The final answer is: ")
  # The published narrativeqa template has "asconcisely" (sic): kept as published.
  assert lb.build_prompt(record("narrativeqa")).startswith(
      "You are given a story, which can be either a novel or a movie script, and a question. "
      "Answer the question asconcisely as you can")


# ----------------------------------------------------------------------------------- v1 loading

def test_load_v1_and_e(tmp_path):
  write_jsonl(tmp_path / "hotpotqa.jsonl", [v1_obj(0), v1_obj(1)])
  write_jsonl(tmp_path / "trec.jsonl", [v1_obj(2, dataset="trec", all_classes=["A", "B"])])
  write_jsonl(tmp_path / "hotpotqa_e.jsonl", ["", v1_obj(3, dataset="hotpotqa_e")])
  recs = lb.load_longbench(tmp_path, ["trec", "hotpotqa"])
  assert [(r.dataset, r.id) for r in recs] == [("trec", "id2"), ("hotpotqa", "id0"),
                                               ("hotpotqa", "id1")]
  r = recs[1]
  assert (r.input, r.context, r.answers, r.length, r.language, r.all_classes, r.e) == (
      "question 0?", "passage 0 alpha beta", ("a0",), 7, "en", None, False)
  assert recs[0].all_classes == ("A", "B")
  assert recs[2].source.endswith("hotpotqa.jsonl:2")
  assert [r.id for r in lb.load_longbench(tmp_path, "hotpotqa", limit=1)] == ["id0"]
  (e,) = lb.load_longbench(tmp_path, ["hotpotqa"], e=True)
  assert (e.dataset, e.id, e.e) == ("hotpotqa", "id3", True) and e.source.endswith(":2")
  assert lb.build_prompt(e) == lb.PROMPTS["hotpotqa"].format(context=e.context, input=e.input)


def test_v1_missing_directory_and_file(tmp_path):
  missing = tmp_path / "nowhere"
  with pytest.raises(ElasticJaxError, match="directory '.*nowhere' not found.*THUDM/LongBench"):
    lb.load_longbench(missing, ["hotpotqa"])
  with pytest.raises(ElasticJaxError) as info:
    lb.load_longbench(tmp_path, ["hotpotqa"])
  msg = str(info.value)
  assert f"'{tmp_path / 'hotpotqa.jsonl'}' not found" in msg and msg.endswith(f"in {tmp_path}")
  with pytest.raises(ElasticJaxError, match="hotpotqa_e.jsonl' not found.*LongBench-E"):
    lb.load_longbench(tmp_path, ["hotpotqa"], e=True)
  write_jsonl(tmp_path / "qasper.jsonl", [v1_obj(0)])
  with pytest.raises(ElasticJaxError, match="narrativeqa.jsonl' not found"):
    lb.load_longbench(tmp_path)  # every task: the first one is missing


def test_v1_bad_lines(tmp_path):
  path = write_jsonl(tmp_path / "hotpotqa.jsonl", [v1_obj(0), v1_obj(1), '{"input": "x",'])
  with pytest.raises(ElasticJaxError, match=r"hotpotqa.jsonl', line 3: the line is not valid JSON"):
    lb.load_longbench(tmp_path, ["hotpotqa"])
  assert len(lb.load_longbench(tmp_path, ["hotpotqa"], limit=2)) == 2  # stops before line 3
  bad = v1_obj(1)
  del bad["context"]
  write_jsonl(path, [v1_obj(0), bad])
  with pytest.raises(ElasticJaxError, match=r"hotpotqa.jsonl', line 2: .*no field 'context'"):
    lb.load_longbench(tmp_path, ["hotpotqa"])
  write_jsonl(path, [v1_obj(0, answers="a0")])
  with pytest.raises(ElasticJaxError, match=r"line 1: field 'answers' must be a list"):
    lb.load_longbench(tmp_path, ["hotpotqa"])
  write_jsonl(path, ["[1, 2]"])
  with pytest.raises(ElasticJaxError, match=r"line 1: holds a JSON list"):
    lb.load_longbench(tmp_path, ["hotpotqa"])
  path.write_bytes(b"\n")
  with pytest.raises(ElasticJaxError, match="holds no records"):
    lb.load_longbench(tmp_path, ["hotpotqa"])


def test_v1_bad_arguments(tmp_path):
  write_jsonl(tmp_path / "narrativeqa_e.jsonl", [v1_obj(0)])
  with pytest.raises(ElasticJaxError, match="'narrativeqa' is not a LongBench-E task"):
    lb.load_longbench(tmp_path, ["narrativeqa"], e=True)
  with pytest.raises(ElasticJaxError, match="'hotpot' is not a LongBench task"):
    lb.load_longbench(tmp_path, ["hotpot"])
  with pytest.raises(ElasticJaxError, match="limit"):
    lb.load_longbench(tmp_path, ["qasper"], limit=0)


# ------------------------------------------------------------------------------------ truncation

PROMPT = " ".join(WORDS[i % len(WORDS)] for i in range(0, 300, 7))


def content_offsets(tok, text):
  """(start, end) characters of each token of text, special tokens left out."""
  return tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def test_truncate_middle_keeps_first_and_last_halves(toks):
  tok = toks["plain"]
  offs = content_offsets(tok, PROMPT)
  n = len(offs)
  assert tok(PROMPT)["input_ids"][0] == tok.bos_token_id and n > 40
  assert lb.truncate_middle(PROMPT, tok, n + 1) == PROMPT   # n tokens + BOS fit
  for max_length in (20, 21):  # half = 10: BOS + 9 tokens at the start, 10 at the end
    got = lb.truncate_middle(PROMPT, tok, max_length)
    assert got == PROMPT[:offs[8][1]] + PROMPT[offs[n - 10][0]:]
  got = lb.truncate_middle(PROMPT, tok, n, add_special_tokens=False)
  assert got == PROMPT
  got = lb.truncate_middle(PROMPT, tok, 20, add_special_tokens=False)
  assert got == PROMPT[:offs[9][1]] + PROMPT[offs[n - 10][0]:]
  with pytest.raises(ElasticJaxError, match="max_length"):
    lb.truncate_middle(PROMPT, tok, 1)


def test_truncate_middle_v2_keeps_one_more_at_the_end_when_odd(toks):
  tok = toks["plain"]
  offs = content_offsets(tok, PROMPT)
  n = len(offs)
  assert lb.truncate_middle_v2(PROMPT, tok, n + 1) == PROMPT
  # 20: BOS + 9 tokens, then 10 tokens; 21: BOS + 9 tokens, then 11 tokens.
  assert lb.truncate_middle_v2(PROMPT, tok, 20) == PROMPT[:offs[8][1]] + PROMPT[offs[n - 10][0]:]
  assert lb.truncate_middle_v2(PROMPT, tok, 21) == PROMPT[:offs[8][1]] + PROMPT[offs[n - 11][0]:]


# ------------------------------------------------------------------------------------------ chat

def test_chat_rule_per_task(toks):
  excluded = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
  for name in lb.DATASETS:
    assert lb.uses_chat_template(record(name), toks["chat"]) == (name not in excluded), name
    assert lb.uses_chat_template(record(name), toks["chat"], chat=True) == (name not in excluded)
    assert not lb.uses_chat_template(record(name), toks["chat"], chat=False)
    assert not lb.uses_chat_template(record(name), toks["plain"])
  with pytest.raises(ElasticJaxError, match="no chat template"):
    lb.uses_chat_template(record("hotpotqa"), toks["plain"], chat=True)


def test_model_input_v1(toks):
  chat, plain = toks["chat"], toks["plain"]
  rec = record("hotpotqa", "alpha beta", "gamma?")
  prompt = lb.build_prompt(rec)
  assert lb.model_input(rec, chat, 10_000) == (f"<|user|>{prompt}<|end|><|assistant|>", 32, True)
  assert lb.model_input(rec, plain, 10_000) == (prompt, 32, False)
  assert lb.model_input(rec, chat, 10_000, chat=False) == (prompt, 32, False)
  trec = record("trec", "alpha", "beta")
  assert lb.model_input(trec, chat, 10_000) == (lb.build_prompt(trec), 64, False)
  # Truncation is measured on the prompt without the template, then the template wraps it.
  long = record("gov_report", PROMPT)
  text, new, wrapped = lb.model_input(long, chat, 80)
  cut = lb.truncate_middle(lb.build_prompt(long), chat, 80)
  assert (new, wrapped) == (512, True) and text == f"<|user|>{cut}<|end|><|assistant|>"
  assert cut.startswith("You are given a report") and cut.endswith("\n\nSummary:")
  assert len(cut) < len(lb.build_prompt(long)) - len(PROMPT) // 2
  ids = lb.input_ids(text, chat, wrapped)
  assert ids.count(chat.bos_token_id) == 0 and ids[0] == chat.convert_tokens_to_ids("<|user|>")
  assert lb.input_ids(prompt, plain, False)[0] == plain.bos_token_id


def test_samsum_generation_extras(toks):
  tok = toks["plain"]
  newline = tok("\n", add_special_tokens=False)["input_ids"]
  assert len(newline) == 1
  assert lb.extra_stop_ids(record("samsum"), tok) == (newline[0],)
  assert lb.extra_stop_ids(record("hotpotqa"), tok) == ()
  assert (lb.min_new_tokens(record("samsum")), lb.min_new_tokens(record("trec"))) == (1, 0)


# ------------------------------------------------------------------------------------------- v2

V2_EXPECTED = (
    "Please read the following text and answer the question below.\n\n<text>\ndoc 0\n</text>\n\n"
    "What is the correct answer to this question: Which one 0?\nChoices:\n(A) a\n(B) b\n(C) c\n"
    "(D) d\n\nFormat your response as follows: \"The correct answer is (insert answer here)\".")


def test_load_v2_filters_and_prompt(tmp_path, toks):
  rows = [v2_obj(0), v2_obj(1, difficulty="hard"), v2_obj(2, length="long"),
          v2_obj(3, difficulty="hard", length="medium")]
  write_v2(tmp_path, rows, indent=1)
  recs = lb.load_longbench_v2(tmp_path)
  assert [r.id for r in recs] == ["v2-0", "v2-1", "v2-2", "v2-3"]
  r = recs[0]
  assert (r.domain, r.sub_domain, r.difficulty, r.length, r.answer) == (
      "Single-Document QA", "Legal", "easy", "short", "B")
  assert r.choices == (" a ", "b", "c", "d\n") and r.source.endswith("data.json, record 1")
  assert [r.id for r in lb.load_longbench_v2(tmp_path, difficulty="hard")] == ["v2-1", "v2-3"]
  assert [r.id for r in lb.load_longbench_v2(tmp_path, length=["long", "medium"])] == [
      "v2-2", "v2-3"]
  assert [r.id for r in lb.load_longbench_v2(tmp_path, difficulty="easy", length="short")] == [
      "v2-0"]
  assert [r.id for r in lb.load_longbench_v2(tmp_path, difficulty="hard", limit=1)] == ["v2-1"]
  assert lb.build_prompt(r) == lb.build_prompt_v2(r) == V2_EXPECTED
  assert lb.model_input(r, toks["plain"], 120_000) == (V2_EXPECTED, 128, False)
  text, new, wrapped = lb.model_input(r, toks["chat"], 120_000)
  assert (text, new, wrapped) == (f"<|user|>{V2_EXPECTED}<|end|><|assistant|>", 128, True)


def test_v2_replacement_is_sequential_as_published(tmp_path):
  write_v2(tmp_path, [v2_obj(0, context="see $Q$", question="Q")])
  (r,) = lb.load_longbench_v2(tmp_path)
  assert "<text>\nsee Q\n</text>" in lb.build_prompt_v2(r)


def test_v2_errors(tmp_path):
  with pytest.raises(ElasticJaxError, match="directory '.*v2' not found.*THUDM/LongBench-v2"):
    lb.load_longbench_v2(tmp_path / "v2")
  with pytest.raises(ElasticJaxError, match=r"data.json' not found: put the published data.json"):
    lb.load_longbench_v2(tmp_path)
  (tmp_path / "data.json").write_text('[\n{"_id": "a"},\n{oops}\n]\n')
  with pytest.raises(ElasticJaxError, match="data.json' is not valid JSON .* line 3"):
    lb.load_longbench_v2(tmp_path)
  bad = v2_obj(1)
  del bad["choice_C"]
  write_v2(tmp_path, [v2_obj(0), bad])
  with pytest.raises(ElasticJaxError, match=r"record 2 \(_id 'v2-1'\): .*no field 'choice_C'"):
    lb.load_longbench_v2(tmp_path)
  write_v2(tmp_path, [v2_obj(0, answer="E")])
  with pytest.raises(ElasticJaxError, match="field 'answer' is 'E'"):
    lb.load_longbench_v2(tmp_path)
  write_v2(tmp_path, [v2_obj(0)])
  with pytest.raises(ElasticJaxError, match="difficulty 'medium' is unknown"):
    lb.load_longbench_v2(tmp_path, difficulty="medium")
  write_v2(tmp_path, {"_id": "x"})
  with pytest.raises(ElasticJaxError, match="holds a JSON dict"):
    lb.load_longbench_v2(tmp_path)
