// k2vec_native: the engine contract's command line (docs/engine-contract.md §2).
//   k2vec_native --bundle B.kdtr --mode greedy|score|ddtree --budget N --output R.json
// Exit 0 after writing the result; a message on stderr and exit 1 on any error.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>

#include "bundle.h"
#include "ddtree.h"
#include "decode.h"
#include "model.h"
#include "result.h"

namespace {

int usage(const char *why) {
    std::fprintf(stderr, "k2vec_native: %s\nusage: k2vec_native --bundle B.kdtr --mode greedy|score|ddtree --budget N "
                         "--output R.json\n", why);
    return 2;
}

}  // namespace

int main(int argc, char **argv) {
    std::string bundle_path, mode, output;
    int budget = 0;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (i + 1 >= argc) return usage(("missing value after " + a).c_str());
        std::string v = argv[++i];
        if (a == "--bundle") bundle_path = v;
        else if (a == "--mode") mode = v;
        else if (a == "--output") output = v;
        else if (a == "--budget") budget = std::stoi(v);
        else return usage(("unknown option " + a).c_str());
    }
    if (bundle_path.empty() || mode.empty() || output.empty()) return usage("--bundle, --mode and --output are required");
    try {
        auto t0 = std::chrono::steady_clock::now();
        k2n::Bundle bundle(bundle_path);
        const nlohmann::json &meta = bundle.meta();
        k2n::Config config = k2n::Config::from_bundle(meta);
        k2n::Model model(bundle, config);
        double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

        const int n_new = meta.at("decoding").at("max_new_tokens").get<int>();
        const int k = meta.at("decoding").at("top_k").get<int>();
        const int n_prompts = meta.at("golden").at("prompts").get<int>();
        k2n::Timing timing;
        nlohmann::json prompts = nlohmann::json::array(), runs = nlohmann::json::array();
        if (mode == "greedy" || mode == "score") {
            for (int i = 0; i < n_prompts; ++i) {
                std::vector<int> prompt = bundle.ints("prompt.p" + std::to_string(i) + ".tokens");
                // score: the one golden tensor an engine may read, and only in this mode (contract §3)
                std::vector<int> forced;
                if (mode == "score") forced = bundle.ints("golden.p" + std::to_string(i) + ".tokens");
                prompts.push_back(k2n::prompt_json(
                    k2n::decode(model, prompt, n_new, k, mode == "score" ? &forced : nullptr, timing)));
            }
            runs.push_back({{"drafter", nullptr}, {"prompts", prompts}});
        } else if (mode == "ddtree") {
            // one run per drafter accuracy, in the bundle's order, each from its recorded drafts (docs/ddtree.md §5)
            const nlohmann::json &accuracies = meta.at("golden").at("ddtree").at("accuracies");
            for (size_t a = 0; a < accuracies.size(); ++a) {
                nlohmann::json ps = nlohmann::json::array();
                for (int i = 0; i < n_prompts; ++i) {
                    std::string pre = "drafts.a" + std::to_string(a) + ".p" + std::to_string(i) + ".";
                    const kdtr_tensor &t = bundle.tensor(pre + "ids");
                    if (t.rank != 3) throw std::runtime_error(pre + "ids must be [starts, depth, k]");
                    k2n::Drafts d;
                    d.n_starts = static_cast<int64_t>(t.dims[0]);
                    d.depth = static_cast<int64_t>(t.dims[1]);
                    d.k = static_cast<int64_t>(t.dims[2]);
                    d.ids = bundle.ints(pre + "ids");
                    if (bundle.numel(pre + "logprobs") != d.ids.size())
                        throw std::runtime_error(pre + "logprobs must have the shape of " + pre + "ids");
                    const float *lp = static_cast<const float *>(bundle.data(pre + "logprobs", KDTR_F32));
                    d.logprobs.assign(lp, lp + d.ids.size());
                    std::vector<int> prompt = bundle.ints("prompt.p" + std::to_string(i) + ".tokens");
                    ps.push_back(k2n::ddtree_json(k2n::ddtree_decode(model, prompt, d, budget, n_new, timing)));
                }
                runs.push_back({{"drafter", {{"accuracy", accuracies[a]}}}, {"prompts", ps}});
            }
        } else {
            return usage(("unknown mode " + mode).c_str());
        }
        k2n::write_result(output, runs, "cpu (k2vec native engine, C++17, float32)", load_s, timing);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "k2vec_native: %s\n", e.what());
        return 1;
    }
    return 0;
}
