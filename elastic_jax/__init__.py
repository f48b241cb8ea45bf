"""elastic_jax: Elastic Attention (test-time adaptive sparsity) for JAX/Flax.

    import elastic_jax as ej
    model = ej.ElasticModel.from_pretrained("path/to/model", routers="runs/x/export/elastic_jax")
    print(model.generate(["Where is the key?"]).texts[0])
    model.save_pretrained("out")      # HF safetensors (the authors' layout when it has routers)
"""

from elastic_jax import deprecated
from elastic_jax.attention.hybrid import hybrid_attention
from elastic_jax.config import ModelConfig, config_from_hf_dict
from elastic_jax.elastic_model import (ElasticModel, attach_routers, from_pretrained,
                                       save_converted, save_pretrained)
from elastic_jax.errors import ElasticJaxError
from elastic_jax.generation.generate import Generation, SamplingConfig
from elastic_jax.heads import ATTENTION
from elastic_jax.router import RouterConfig
from elastic_jax.router_io import Routers, load_routers

__version__ = "0.1.0"

deprecated.install()

__all__ = ["ATTENTION", "ElasticJaxError", "ElasticModel", "Generation", "ModelConfig",
           "RouterConfig", "Routers", "SamplingConfig", "attach_routers", "config_from_hf_dict",
           "from_pretrained", "hybrid_attention", "load_routers", "save_converted",
           "save_pretrained"]
