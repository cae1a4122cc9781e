"""Tools above the engine: the benches, the comparison with llama.cpp and transformers, validation."""
