"""The engines that run a target (ONNX Runtime sessions, memspec's native kernels), their KV caches,
and memory accounting.  `load_target` (memspec.runtime.target) is the entry point; this package's
import stays light (the config and the light CLI paths import memspec.runtime.config)."""


def load_target(store, name: str, variant: str | None = None, config=None, preferred: str = "q4"):
    """memspec.runtime.target.load_target: the store target `name`, planned, opened, with its tokenizer."""
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.target import load_target as load

    return load(store, name, variant, config or SessionConfig(), preferred)
