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


rule all:
    default_target: True
    input:
        final_outputs(),
