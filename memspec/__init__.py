"""memspec: a memory-aware speculative-decoding runtime for edge devices."""

__version__ = "0.1.0"
