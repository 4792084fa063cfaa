"""How much the stages hold in memory at once: the figures the stages stream by and the resource
estimate (k2vec.config.resources) counts with, defined once."""

# A weight whose compute-dtype copy is larger than this is never held whole: the reference model's
# `WeightStore.mm` multiplies by it a block of rows at a time (K2's 18432 x 7168 dense MLP is 1 GB in
# float64). Smaller weights, and so every weight of the small presets, take the whole-tensor path.
STREAM_BYTES = 64 << 20

# float64 weights the golden stage keeps between forward calls: every weight of the small presets
# (small: ~40 MB), the attention latents of k2slice; the big weights are streamed anyway (STREAM_BYTES).
WEIGHT_CACHE_BYTES = 512 << 20

# Values the weights stage draws at once: 4M values are ~80 MB of temporaries (uint64 stream, float32 result).
CHUNK_VALUES = 1 << 22
