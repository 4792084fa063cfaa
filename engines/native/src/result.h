// Result writing: the contract's JSON (docs/engine-contract.md §4, src/k2vec/engines/contract/result.schema.json).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddtree.h"
#include "decode.h"

namespace k2n {

// One prompt entry of a greedy or score run: tokens, top-k ids and logits, fingerprints, router experts.
nlohmann::json prompt_json(const PromptResult &r);

// One prompt entry of a DDTree run: the tokens and every round (start, tokens, parents, depths, accepted, bonus).
nlohmann::json ddtree_json(const DDTreeResult &r);

// The whole result object around `runs`; written to `path` (nothing else is written anywhere).
void write_result(const std::string &path, const nlohmann::json &runs, const std::string &device, double load_s,
                  const Timing &timing);

}  // namespace k2n
