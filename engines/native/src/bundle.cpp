#include "bundle.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace k2n {

Bundle::Bundle(const std::string &path) : path_(path) {
    int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) throw std::runtime_error("cannot open bundle " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0 || st.st_size <= 0) {
        close(fd);
        throw std::runtime_error("cannot stat bundle (or it is empty): " + path);
    }
    size_ = static_cast<size_t>(st.st_size);
    // Read-only mapping: weights are used in place, never copied (INT4 stays packed in memory).
    map_ = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map_ == MAP_FAILED) {
        map_ = nullptr;
        throw std::runtime_error("cannot map bundle " + path + ": " + std::strerror(errno));
    }
    if (kdtr_open(&file_, map_, size_) != 0) throw std::runtime_error(path + ": " + file_.error);
    if (kdtr_verify(&file_) != 0) throw std::runtime_error(path + ": " + file_.error);
    meta_ = nlohmann::json::parse(file_.metadata, file_.metadata + file_.meta_size);
    kdtr_tensor t;
    uint64_t cursor = 0;
    while (kdtr_next(&file_, &cursor, &t)) index_.emplace(std::string(t.name, t.name_len), t);
}

Bundle::~Bundle() {
    if (map_) munmap(map_, size_);
}

const kdtr_tensor &Bundle::tensor(const std::string &name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw std::runtime_error("tensor " + name + " is missing from " + path_);
    return it->second;
}

uint64_t Bundle::numel(const std::string &name) const {
    const kdtr_tensor &t = tensor(name);
    uint64_t n = 1;
    for (unsigned i = 0; i < t.rank; ++i) n *= t.dims[i];
    return n;
}

const void *Bundle::data(const std::string &name, unsigned want) const {
    const kdtr_tensor &t = tensor(name);
    if (t.dtype != want)
        throw std::runtime_error("tensor " + name + " is " + kdtr_dtype_name(t.dtype) + ", expected " +
                                 kdtr_dtype_name(want));
    return t.data;
}

std::vector<int> Bundle::ints(const std::string &name) const {
    const kdtr_tensor &t = tensor(name);
    uint64_t n = numel(name);
    std::vector<int> out(n);
    if (t.dtype == KDTR_I32) {
        std::memcpy(out.data(), t.data, n * sizeof(int32_t));  // memcpy: no aliasing or alignment assumptions
    } else if (t.dtype == KDTR_I64) {
        std::vector<int64_t> wide(n);
        std::memcpy(wide.data(), t.data, n * sizeof(int64_t));
        for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<int>(wide[i]);
    } else {
        throw std::runtime_error("tensor " + name + " is " + kdtr_dtype_name(t.dtype) + ", expected i32 or i64");
    }
    return out;
}

}  // namespace k2n
