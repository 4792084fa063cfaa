# Config files, read strictly before Snakemake's own loader: a YAML syntax error or a duplicated
# key is reported with its file and line (Snakemake would give no line, or keep the last key).
import atexit

from snakemake.exceptions import WorkflowError

from k2vec.config.check_cache import ConfigCheckCache, check_config_files
from k2vec.config.read import ConfigFileError, defined_engines

DEFAULT_CONFIG = os.path.join(workflow.basedir, "config.yaml")
# --configfile files (already merged into `config` by Snakemake, which does not see duplicates).
CONFIG_FILES = [*workflow.overwrite_configfiles, DEFAULT_CONFIG]
# Config checks kept across starts (k2vec.config.check_cache): a file or config checked before is not checked again.
CONFIG_CHECKS = ConfigCheckCache(".snakemake/k2vec/config-check.json")
atexit.register(CONFIG_CHECKS.save)
try:
    check_config_files(CONFIG_FILES, CONFIG_CHECKS)
except ConfigFileError as err:
    raise WorkflowError(f"Invalid configuration: {err}") from None


configfile: DEFAULT_CONFIG
