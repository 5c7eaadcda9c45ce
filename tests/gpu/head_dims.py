"""The family tests' configs moved to head_dim 128, so the same layers also run on the other attention kernels."""

from tinyvllm.model.dummy import PHI_3_5_LONG_FACTOR, PHI_3_5_SHORT_FACTOR

# Phi-3.5's LongRoPE factors for 64 rotary pairs (head_dim 128), its last 16 repeated
PHI_SHORT_HD128 = PHI_3_5_SHORT_FACTOR + PHI_3_5_SHORT_FACTOR[-16:]
PHI_LONG_HD128 = PHI_3_5_LONG_FACTOR + PHI_3_5_LONG_FACTOR[-16:]
CHANGES = {
    "gemma-2-2b": dict(head_dim=128), "gemma-3-1b": dict(head_dim=128),
    # 24 heads keep Phi-3.5's hidden size
    "phi-3.5-mini": dict(num_attention_heads=24, num_key_value_heads=24, head_dim=128,
                         rope_scaling={"rope_type": "longrope", "short_factor": PHI_SHORT_HD128,
                                       "long_factor": PHI_LONG_HD128, "original_max_position_embeddings": 4096}),
}


def hd128_variants(families: dict[str, dict]) -> dict[str, dict]:
    """`<name>-hd128`: Gemma 2/3 and Phi-3.5 of `families` at head_dim 128."""
    return {f"{name}-hd128": {**families[name], **change} for name, change in CHANGES.items()}
