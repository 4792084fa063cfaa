// Tensors: a weight matrix as the bundle stores it (float32, or INT4 W4A16 codes + scales) and the
// one product the model needs, linear(x, W) = x · Wᵀ (docs/model.md §0, INT4 decoding §8).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bundle.h"

namespace k2n {

// A weight W [rows, cols] = [out, in] (HF layout). Either `f32` points at rows*cols floats in the
// mapped bundle, or it is INT4: `qw` [rows, cols/2] packed bytes and per-(row, group) scales.
struct Weight {
    std::string name;
    int64_t rows = 0, cols = 0;
    const float *f32 = nullptr;
    // INT4 W4A16 (docs/int4-format.md): element 2j of a row in the low nibble of byte j, code = nibble - 8.
    const uint8_t *qw = nullptr;
    std::vector<float> scales;  // [rows, cols / group], widened to float32 (bf16: bits << 16, exact)
    int64_t group = 0;

    bool int4() const { return qw != nullptr; }
    // Row n of W as float32 into out[cols]: stored values, or code × scale (one float32 multiply).
    void row(int64_t n, float *out) const;
};

// The weight `name` of the bundle: dense float32, or the `.qw`/`.sc` pair when the bundle's
// quantization metadata lists it. `shape` checks its dimensions.
Weight load_weight(const Bundle &b, const std::string &name, int64_t rows, int64_t cols);

// y[t, n] = Σ_k x[t, k] · W[n, k] for t < T. Each row of W is decoded once and used for all T inputs.
void linear(const Weight &w, const float *x, int64_t T, float *y);

// Σ a[i]·b[i] in float32 with 8 interleaved partial sums: vectorisable without -ffast-math, and a
// shorter error chain than one running sum (pairwise-like), which keeps float32 within the exact budget.
float dot(const float *a, const float *b, int64_t n);

}  // namespace k2n
