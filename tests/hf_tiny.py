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


VISION = dict(  # a vision or audio tower of a multimodal config
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)


def tiny_text(**changes) -> dict:
    """The tiny text model of a multimodal config (its `text_config`)."""
    return dict(TINY_DIMS, pad_token_id=0, head_dim=16, **changes)


def gemma4_with_vision():
    """Gemma 4 whole, vision tower included (no audio): its forward reads the pad row of the
    text embedding's weight itself, outside the embedding module."""
    import transformers

    text = tiny_text(vocab_size_per_layer_input=1003)
    vision = dict(VISION, num_key_value_heads=2, head_dim=16)
    return transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)


def save_tiny(config, path, seed: int, auto: str = "AutoModelForCausalLM"):
    """Build transformers' model (`auto` class) for `config` from `seed`, its norms moved away
    from one (so a misplaced row shows), and save it in several files; returns `path`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, auto).from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="300KB")
    return path
