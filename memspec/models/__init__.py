"""Models on disk: the GGUF reader, ONNX conversion, the tokenizer, the store and `memspec pull`."""
