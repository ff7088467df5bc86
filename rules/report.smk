# The report's first page: headline figures and tables as text (draftflow/summary.py).
# The Snakefile makes it the report's description once it exists.


rule summary:
    input:
        manifest=f"{RESULTS}/merged/manifest.json",
        stats=f"{RESULTS}/merged/stats.csv",
        plan=f"{RESULTS}/merged/storage_plan.json",
        data_config=f"{RESULTS}/hidden_states/data_config.json",
        drafter=expand(f"{RESULTS}/drafter/{{method}}", method=METHODS),
        acceptance=expand(f"{RESULTS}/eval/{{method}}/acceptance.json", method=METHODS),
        export=expand(f"{RESULTS}/export/{{method}}/export.json", method=METHODS),
        # the exports' gate (export.check): the page reports its verdict
        serve_check=[path for method in METHODS for path in serve_check_outputs(method)],
    output:
        SUMMARY_PAGE,
    log:
        f"{LOGS}/summary.log",
    conda:
        CONDA_ENV
    params:
        # the page reads the run's outputs under results/ (the inputs above, and more to come)
        results=lambda w, input: os.path.dirname(os.path.dirname(input.manifest)),
        methods=" ".join(METHODS),
    shell:
        "draftflow --threads {threads} summary --results {params.results} --methods {params.methods}"
        " --output {output}"
        " > {log} 2>&1"
