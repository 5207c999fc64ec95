"""Speculative decoding: sampling maths, draft proposers, the draft-and-verify loop, the engine."""
