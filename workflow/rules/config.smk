# Config files, read strictly before Snakemake's own loader: a YAML syntax error or a duplicated
# key is reported with its file and line (Snakemake would give no line, or keep the last key).
from snakemake.exceptions import WorkflowError

from k2vec.config.read import ConfigFileError, check_config_files

DEFAULT_CONFIG = os.path.join(workflow.basedir, "config.yaml")
try:
    # --configfile files (already merged into `config` by Snakemake, which does not see duplicates).
    check_config_files([*workflow.overwrite_configfiles, DEFAULT_CONFIG])
except ConfigFileError as err:
    raise WorkflowError(f"Invalid configuration: {err}") from None


configfile: DEFAULT_CONFIG
