"""ONNX Runtime underneath: decoder sessions with their KV caches, and memory accounting."""
