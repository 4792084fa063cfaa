# Shared set-up: validate the config, expand it into resolved cases, and list the package
# sources each stage runs (Snakemake does not track modules imported by scripts).
import sys

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

# Parse-time imports come from this checkout; stage scripts import the same files through the
# editable install that README's commands make (`pip install -e .`).
sys.path.insert(0, os.path.join(workflow.basedir, "src"))

from k2vec.deps import module_sources
from k2vec.errors import ConfigError
from k2vec.spec import expand_config, schema_error

CONFIG_SCHEMA = "../schemas/config.schema.yaml"
try:
    validate(config, schema=CONFIG_SCHEMA)
    CASES = expand_config(config)
except (WorkflowError, ConfigError) as err:
    # Name the offending key first, whichever check found it.
    if not isinstance(err, ConfigError):
        err = schema_error(config, workflow.source_path(CONFIG_SCHEMA)) or err
    raise WorkflowError(f"Invalid configuration: {err}") from None

MODELS = sorted(CASES)


wildcard_constraints:
    model="|".join(MODELS),
    section="model|quantization|prompts|decoding",


def sources(*modules):
    """Package files executed by `modules`, declared as inputs so that editing them reruns the stage."""
    return [os.path.relpath(p) for p in module_sources(*modules)]
