"""The dimensions of the tiny transformers models the Hugging Face tests build and save."""

TINY_DIMS = dict(
    vocab_size=1003,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
