"""Generation with the per-head cache: prefill routes every KV head once per request
(`prefill.py`), the cache keeps each full head's keys and each streaming head's sink and ring
(`kv_cache.py`), decode attends over it one token per step (`decode.py`), and
`generate.py` drives them (`ElasticModel.generate`), compiled ahead of time (`aot.py`)."""
