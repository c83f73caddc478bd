"""The names a user picks from on the command line and in the Dashboard: loading strategies,
target dtypes, demo presets. Spelled out here, free of torch, so that `tpviz --help` and the
widgets' controls import nothing heavy; each mirrors its registry (tpviz.strategies.STRATEGIES,
tpviz.models.demo.PRESETS), and tests/test_cli_help.py keeps them equal."""

STRATEGIES = ("sliced", "rank0_broadcast", "replicated")
TARGET_DTYPES = ("float32", "bfloat16", "float16")  # what --dtype offers; Python takes any float
PRESETS = ("tiny", "small", "medium")
