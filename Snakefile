# draftflow: raw conversations -> EAGLE-3 drafter served by SGLang / vLLM.
# Logic lives in the draftflow package; rules declare files and call `draftflow <stage>`.
from snakemake.utils import min_version

min_version("9.19")


# The embedded default, unless a config is given: Snakemake would otherwise merge
# a user's --configfile into it (and keep the default's sample datasets).
if not workflow.config_settings.configfiles:

    configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/data.smk"
include: "rules/merge.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"


# The report (`snakemake --report`) opens on this page: the run's headline figures and
# tables once rule summary wrote them, before that the workflow's description.
report: os.path.abspath(SUMMARY_PAGE) if os.path.exists(SUMMARY_PAGE) else "report/workflow.rst"


rule all:
    default_target: True
    input:
        final_outputs(),
