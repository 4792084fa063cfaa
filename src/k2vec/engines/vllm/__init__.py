"""The vLLM engine (docs/vllm.md): `steps` turns vLLM's per-position top-k records into the contract's per-step
rows (no vLLM import), `engine` runs vLLM on the bundle's HF checkpoint (`python -m k2vec.engines.vllm`)."""
