// Bundle loading: a KDTR file mapped read-only and opened with include/kdtr.h, its metadata parsed
// as JSON, its tensors looked up by name. Nothing else in the engine touches the file.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

extern "C" {
#include "kdtr.h"
}

namespace k2n {

class Bundle {
public:
    // Maps `path`, checks the header, directory and metadata (kdtr_open) and every tensor's CRC-32
    // (kdtr_verify); throws std::runtime_error with the reader's message on any problem.
    explicit Bundle(const std::string &path);
    ~Bundle();
    Bundle(const Bundle &) = delete;
    Bundle &operator=(const Bundle &) = delete;

    const nlohmann::json &meta() const { return meta_; }
    bool has(const std::string &name) const { return index_.count(name) != 0; }
    // The tensor `name`; throws naming it when absent.
    const kdtr_tensor &tensor(const std::string &name) const;
    // A tensor's elements after checking its dtype and packing: `name` must be dtype `want` (KDTR_*).
    const void *data(const std::string &name, unsigned want) const;
    uint64_t numel(const std::string &name) const;
    // Small integer tensors (prompts, drafts), widened to int.
    std::vector<int> ints(const std::string &name) const;

private:
    std::string path_;
    void *map_ = nullptr;
    size_t size_ = 0;
    kdtr_file file_{};
    nlohmann::json meta_;
    std::unordered_map<std::string, kdtr_tensor> index_;
};

}  // namespace k2n
