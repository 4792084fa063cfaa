// k2vec_native: the engine contract's command line (docs/engine-contract.md §2).
//   k2vec_native --bundle B.kdtr --mode greedy|score|ddtree --budget N --output R.json
// Exit 0 after writing the result; a message on stderr and exit 1 on any error.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "bundle.h"
#include "decode.h"
#include "model.h"
#include "result.h"

namespace {

int usage(const char *why) {
    std::fprintf(stderr, "k2vec_native: %s\nusage: k2vec_native --bundle B.kdtr --mode greedy|score --budget N "
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
    (void)budget;
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
        nlohmann::json prompts = nlohmann::json::array();
        if (mode == "greedy" || mode == "score") {
            for (int i = 0; i < n_prompts; ++i) {
                std::vector<int> prompt = bundle.ints("prompt.p" + std::to_string(i) + ".tokens");
                // score: the one golden tensor an engine may read, and only in this mode (contract §3)
                std::vector<int> forced;
                if (mode == "score") forced = bundle.ints("golden.p" + std::to_string(i) + ".tokens");
                prompts.push_back(k2n::prompt_json(
                    k2n::decode(model, prompt, n_new, k, mode == "score" ? &forced : nullptr, timing)));
            }
        } else {
            return usage(("mode " + mode + " is not implemented by this engine").c_str());
        }
        nlohmann::json runs = nlohmann::json::array({{{"drafter", nullptr}, {"prompts", prompts}}});
        k2n::write_result(output, runs, "cpu (k2vec native engine, C++17, float32)", load_s, timing);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "k2vec_native: %s\n", e.what());
        return 1;
    }
    return 0;
}
