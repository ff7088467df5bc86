# The embedded default target: a tiny Llama built and briefly trained locally (no downloads).


rule build_target:
    output:
        directory(f"{RESULTS}/target"),
    log:
        f"{LOGS}/build_target.log",
    benchmark:
        f"{BENCH}/build_target.tsv"
    conda:
        CONDA_ENV
    threads: 1  # the build computes on one thread (bit-identical weights)
    params:
        settings=as_settings(config["target"]["builtin"]),
    shell:
        "draftflow --threads {threads} build-target --settings {params.settings:q}"
        " --output {output} > {log} 2>&1"
