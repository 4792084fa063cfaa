"""Named conventions: where inference engines and the golden's reference (transformers) differ by design.

Each is a variant of the reference model, given as the `ReferenceModel` settings (keyword arguments, and
attributes of the same name) that make it, from the model spec. An engine that follows one computes a
different, defensible model: against the golden it is over the float32 budget, against the variant at its
own precision's noise. The rule `convention` (k2vec.stages.convention) makes each variant's golden; the report
names an engine that matches a variant where it fails the golden (class `convention`), or judges an engine
against the variant of the conventions it declares (`engines.<name>.conventions`); docs/report.md "Conventions".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from k2vec.errors import K2VecError


class ConventionError(K2VecError):
    """An unknown convention name, or conventions that cannot be followed together."""


@dataclass(frozen=True)
class Convention:
    name: str           # the config's name (engines.<name>.conventions) and the variant file's
    label: str          # how the report names it: what it sets, and who follows it
    description: str
    settings: Callable[[Mapping[str, Any]], dict[str, Any]]   # model spec -> ReferenceModel settings


CONVENTIONS: dict[str, Convention] = {c.name: c for c in (
    Convention(
        "latent_norm_eps_rms", "latent_norm_eps=rms_norm_eps (vLLM, SGLang, llama.cpp)",
        "q_a_layernorm and kv_a_layernorm use the config's rms_norm_eps, where transformers and DeepSeek's code "
        "use the RMSNorm default 1e-6 (docs/model.md, the latent-norm epsilon)",
        lambda model: {"latent_norm_eps": float(model["rms_norm_eps"])}),
)}


def variant_key(names: Iterable[str]) -> str:
    """The name of the variant that follows every convention of `names` (its file, its report key)."""
    return "+".join(sorted(names))


def variant_settings(names: Iterable[str], model: Mapping[str, Any]) -> dict[str, Any]:
    """The ReferenceModel settings of the variant that follows the conventions `names` on `model`."""
    out: dict[str, Any] = {}
    for name in sorted(names):
        if name not in CONVENTIONS:
            raise ConventionError(f"unknown convention {name!r}; known: {', '.join(CONVENTIONS)}")
        for k, v in CONVENTIONS[name].settings(model).items():
            if k in out and out[k] != v:
                raise ConventionError(f"conventions {variant_key(names)!r} set {k} to different values")
            out[k] = v
    return out
