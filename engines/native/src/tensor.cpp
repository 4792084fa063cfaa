#include "tensor.h"

#include <cstring>
#include <stdexcept>

namespace k2n {

void Weight::row(int64_t n, float *out) const {
    if (!int4()) {
        std::memcpy(out, f32 + n * cols, cols * sizeof(float));
        return;
    }
    const uint8_t *packed = qw + n * (cols / 2);
    const float *sc = scales.data() + n * (cols / group);
    for (int64_t k = 0; k < cols; ++k) {
        int q = ((packed[k >> 1] >> (4 * (k & 1))) & 0xF) - 8;  // offset binary: nibble 0 is -8
        out[k] = static_cast<float>(q) * sc[k / group];          // exact for bf16 scales, one rounding for f32
    }
}

Weight load_weight(const Bundle &b, const std::string &name, int64_t rows, int64_t cols) {
    Weight w;
    w.name = name;
    w.rows = rows;
    w.cols = cols;
    const nlohmann::json &q = b.meta()["quantization"];
    bool quantized = false;
    if (!q.is_null())
        for (const auto &t : q["tensors"]) quantized = quantized || t.get<std::string>() == name;
    auto check = [&](const std::string &t, uint64_t r, uint64_t c) {
        const kdtr_tensor &info = b.tensor(t);
        if (info.rank != 2 || info.dims[0] != r || info.dims[1] != c)
            throw std::runtime_error("tensor " + t + " has an unexpected shape (want [" + std::to_string(r) + ", " +
                                     std::to_string(c) + "])");
    };
    if (!quantized) {
        check(name, rows, cols);
        w.f32 = static_cast<const float *>(b.data(name, KDTR_F32));
        return w;
    }
    w.group = q["group_size"].get<int64_t>();
    if (w.group <= 0 || cols % w.group != 0 || cols % 2 != 0)
        throw std::runtime_error("tensor " + name + ": in-dimension not a multiple of the INT4 group size");
    check(name + ".qw", rows, cols / 2);
    if (b.tensor(name + ".qw").packing != KDTR_PACK_INT4)
        throw std::runtime_error("tensor " + name + ".qw is not int4-packed");
    w.qw = static_cast<const uint8_t *>(b.data(name + ".qw", KDTR_U8));
    std::string sc = name + ".sc";
    check(sc, rows, cols / w.group);
    size_t n = static_cast<size_t>(rows * (cols / w.group));
    w.scales.resize(n);
    if (q["scale_dtype"].get<std::string>() == "bfloat16") {
        const uint8_t *bits = static_cast<const uint8_t *>(b.data(sc, KDTR_BF16));
        for (size_t i = 0; i < n; ++i) {
            uint32_t u = static_cast<uint32_t>(bits[2 * i] | bits[2 * i + 1] << 8) << 16;  // little-endian bf16
            std::memcpy(&w.scales[i], &u, sizeof(float));
        }
    } else {
        std::memcpy(w.scales.data(), b.data(sc, KDTR_F32), n * sizeof(float));
    }
    return w;
}

float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
    for (; i < n; ++i) acc[i & 7] += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

void linear(const Weight &w, const float *x, int64_t T, float *y) {
    std::vector<float> row(static_cast<size_t>(w.cols));
    for (int64_t n = 0; n < w.rows; ++n) {
        // A fork's GEMM/GEMV kernel replaces this loop; dequantizing a row once serves all T inputs.
        const float *wr = w.int4() ? (w.row(n, row.data()), row.data()) : w.f32 + n * w.cols;
        for (int64_t t = 0; t < T; ++t) y[t * w.rows + n] = dot(x + t * w.cols, wr, w.cols);
    }
}

}  // namespace k2n
