"""The engines that run a target (ONNX Runtime sessions, memspec's native kernels), their KV caches,
and memory accounting.  `load_target` (memspec.runtime.target) is the entry point; this package's
import stays light (the config and the light CLI paths import memspec.runtime.config)."""


def load_target(model, backend: str = "auto", threads: int = 0, max_context: int = 2048, store=None,
                variant: str = "q4"):
    """memspec.runtime.target.load_target: a Target for a store entry's name or a GGUF path."""
    from memspec.runtime.target import load_target as load

    return load(model, backend, threads, max_context, store, variant)
