"""The backbone shapes the benchmarks build with random weights (Hugging Face config
dictionaries), shared by scripts that run with and without JAX."""

SHAPES = {
    "llama3_8b": {  # Llama-3.1-8B
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}},
    "qwen3_8b": {  # Qwen3-8B
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "attention_bias": False, "rope_theta": 1000000.0},
}
