"""The names a user picks from on the command line and in the Dashboard: loading strategies,
target dtypes, demo presets, model families. Spelled out here, free of torch, so that `tpviz
--help`, the widgets' controls and the forkserver's preload choice import nothing heavy; each
mirrors its registry (tpviz.strategies.STRATEGIES, tpviz.models.demo.PRESETS), and
tests/test_cli_help.py keeps them equal."""

STRATEGIES = ("sliced", "rank0_broadcast", "replicated")
TARGET_DTYPES = ("float32", "bfloat16", "float16")  # what --dtype offers
COMPUTE_DTYPES = (*TARGET_DTYPES, "float64")  # what a model computes in: Python takes these
SIXTEEN_BIT_DTYPES = ("bfloat16", "float16")  # whose rounding verify's bound allows for
PRESETS = ("tiny", "small", "medium")

# The longest duration accepted (30 days), far above any real load, for every duration
# argument alike. The load timeout becomes the ranks' collective timeout, which gloo adds in
# nanoseconds to a clock: from about 9.2e9 s (2**63 ns) that overflows into a hang or an
# instant time-out, and from 1e13 s gloo refuses it or Python cannot pass it at all.
MAX_SECONDS = 30 * 24 * 3600

LLAMA_ARCHITECTURES = frozenset({"LlamaForCausalLM"})
# the rope types tpviz's Llama computes, and what each reads from its scaling beyond rope_theta
BUILTIN_ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
BUILTIN_ROPE_TYPES = frozenset(BUILTIN_ROPE_FIELDS)
BUILTIN_ACTIVATIONS = frozenset({"silu", "swish"})  # transformers' names for SiLU


def model_family(config: dict, model: str | None) -> str:
    """The adapter `--model` names for this config: under `auto`, tpviz's own Llama for the
    Llama family with a rope scaling it computes, transformers for everything else; other
    names as given."""
    choice = model or "auto"
    if choice != "auto":
        return choice
    arch = set(config.get("architectures") or [])
    is_llama = config.get("model_type") == "llama" and (not arch or arch <= LLAMA_ARCHITECTURES)
    return "builtin" if is_llama and builtin_cannot_compute(config) is None else "hf"


def builtin_cannot_compute(config: dict) -> str | None:
    """The first setting of a Llama config that tpviz's own Llama does not compute, said as
    "KEY VALUE (what it computes)", or None. Each is a setting transformers' Llama reads: a
    model built without it would load the same tensors and give other logits."""
    kind = rope_type(config)
    if kind not in BUILTIN_ROPE_TYPES:
        return f"rope type {kind!r} (it computes {', '.join(sorted(BUILTIN_ROPE_TYPES))})"
    activation = config.get("hidden_act", "silu")
    if activation not in BUILTIN_ACTIVATIONS:
        return f"hidden_act {activation!r} (its MLP is SwiGLU, with silu)"
    return None


def rope_type(config: dict) -> str:
    """The rope scaling a config asks for: 5.x `rope_parameters` or 4.x `rope_scaling`."""
    params = config.get("rope_parameters")
    scaling = params if isinstance(params, dict) else config.get("rope_scaling")
    if not isinstance(scaling, dict):
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"
