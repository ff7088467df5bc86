# The embedded default target: a tiny Llama built and briefly trained locally (no downloads).


rule build_target:
    output:
        directory(f"{RESULTS}/target"),
    params:
        settings=as_settings(config["target"]["builtin"]),
    log:
        f"{LOGS}/build_target.log",
    benchmark:
        f"{BENCH}/build_target.tsv"
    threads: workflow.cores
    conda:
        CONDA_ENV
    shell:
        "{DRAFTFLOW} build-target --settings {params.settings:q} --output {output} > {log} 2>&1"
