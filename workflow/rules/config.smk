# Config files, read strictly before Snakemake's own loader: a YAML syntax error or a duplicated
# key is reported with its file and line (Snakemake would give no line, or keep the last key).
from snakemake.exceptions import WorkflowError

from k2vec.config.read import ConfigFileError, check_config_files, defined_engines

DEFAULT_CONFIG = os.path.join(workflow.basedir, "config.yaml")
# --configfile files (already merged into `config` by Snakemake, which does not see duplicates).
CONFIG_FILES = [*workflow.overwrite_configfiles, DEFAULT_CONFIG]
try:
    check_config_files(CONFIG_FILES)
except ConfigFileError as err:
    raise WorkflowError(f"Invalid configuration: {err}") from None


configfile: DEFAULT_CONFIG
