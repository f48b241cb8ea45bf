"""elastic_jax: Elastic Attention (test-time adaptive sparsity) for JAX/Flax.

    import elastic_jax as ej
    model = ej.from_pretrained("path/to/hf_or_converted_dir", dtype="bfloat16")
    logits = model.logits(input_ids)            # float32 [B, T, vocab]
    ej.save_pretrained(model, "out_hf_dir")      # back to HF safetensors
"""

from elastic_jax import ops
from elastic_jax.api import ElasticModel, from_pretrained, save_converted, save_pretrained
from elastic_jax.config import ModelConfig, config_from_hf_dict
from elastic_jax.errors import ElasticJaxError
from elastic_jax.generate import SamplingConfig

__version__ = "0.1.0"

__all__ = ["ops", "ElasticModel", "ElasticJaxError", "ModelConfig", "SamplingConfig",
           "config_from_hf_dict", "from_pretrained", "save_converted", "save_pretrained"]
