#include "result.h"

#include <fstream>
#include <stdexcept>

namespace k2n {

nlohmann::json prompt_json(const PromptResult &r) {
    // nlohmann converts the nested vectors itself; floats widen exactly to JSON doubles.
    return {{"tokens", r.tokens},
            {"topk_ids", r.topk_ids},
            {"topk_logits", r.topk_logits},
            {"fingerprints", r.fingerprints},
            {"router_experts", r.router}};
}

nlohmann::json ddtree_json(const DDTreeResult &r) {
    nlohmann::json rounds = nlohmann::json::array();
    for (const Round &x : r.rounds)
        rounds.push_back({{"start", x.start}, {"tokens", x.tokens}, {"parents", x.parents}, {"depths", x.depths},
                          {"accepted", x.accepted}, {"bonus", x.bonus}});
    return {{"tokens", r.tokens}, {"rounds", rounds}};
}

void write_result(const std::string &path, const nlohmann::json &runs, const std::string &device, double load_s,
                  const Timing &timing) {
    nlohmann::json out = {{"format", "k2vec-engine-result"},
                          {"version", 1},
                          {"device", device},
                          {"timing", {{"load_s", load_s}, {"prefill_s", timing.prefill_s}, {"decode_s", timing.decode_s}}},
                          {"runs", runs}};
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write " + path);
    f << out.dump();
    if (!f.flush()) throw std::runtime_error("write failed: " + path);
}

}  // namespace k2n
