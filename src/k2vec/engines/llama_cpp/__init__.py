"""The llama.cpp engine (docs/llama-cpp.md): `converter` puts llama.cpp's own HF -> GGUF converter where the
engine finds it, `vocabless` runs it on a tokenizer-less checkpoint, `gguf_cache` makes and keeps the bundle's
GGUF file, `engine` decodes through llama-cpp-python (`python -m k2vec.engines.llama_cpp`)."""
