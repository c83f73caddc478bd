"""The names a user picks from on the command line and in the Dashboard: loading strategies,
target dtypes, demo presets, model families. Spelled out here, free of torch, so that `tpviz
--help`, the widgets' controls and the forkserver's preload choice import nothing heavy; each
mirrors its registry (tpviz.strategies.STRATEGIES, tpviz.models.demo.PRESETS), and
tests/test_cli_help.py keeps them equal."""

STRATEGIES = ("sliced", "rank0_broadcast", "replicated")
TARGET_DTYPES = ("float32", "bfloat16", "float16")  # what --dtype offers; Python takes any float
PRESETS = ("tiny", "small", "medium")

LLAMA_ARCHITECTURES = frozenset({"LlamaForCausalLM"})
BUILTIN_ROPE_TYPES = frozenset({"default", "linear", "llama3"})  # what tpviz's Llama computes


def model_family(config: dict, model: str | None) -> str:
    """The adapter `--model` names for this config: under `auto`, tpviz's own Llama for the
    Llama family with a rope scaling it computes, transformers for everything else; other
    names as given."""
    choice = model or "auto"
    if choice != "auto":
        return choice
    arch = set(config.get("architectures") or [])
    is_llama = config.get("model_type") == "llama" and (not arch or arch <= LLAMA_ARCHITECTURES)
    return "builtin" if is_llama and rope_type(config) in BUILTIN_ROPE_TYPES else "hf"


def rope_type(config: dict) -> str:
    """The rope scaling a config asks for: 5.x `rope_parameters` or 4.x `rope_scaling`."""
    params = config.get("rope_parameters")
    scaling = params if isinstance(params, dict) else config.get("rope_scaling")
    if not isinstance(scaling, dict):
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"
