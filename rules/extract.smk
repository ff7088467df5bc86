# Hidden states of the target for every merged sample, one job per range of the plan.
# Samples live in a content-keyed store outside the declared outputs, so a rerun
# (Snakemake deletes a range folder first) or a re-merge reuses every finished sample.


# A checkpoint, so that the extract jobs are re-evaluated after it ran: with a plain rule,
# Snakemake 9.27 never re-checks jobs downstream of a rerun job whose only links to it are
# ancient() inputs, and a re-merge would leave new ranges unextracted until a second run.
checkpoint preflight:
    input:
        plan=f"{RESULTS}/merged/storage_plan.json",
    output:
        f"{RESULTS}/hidden_states/preflight.json",
    log:
        f"{LOGS}/preflight.log",
    conda:
        CONDA_ENV
    params:
        settings=as_settings(
            {"free_disk_margin": config["extract"]["free_disk_margin"]}
        ),
        path=lambda w, output: os.path.dirname(output[0]),
    shell:
        "draftflow --threads {threads} preflight --plan {input.plan} --path {params.path}"
        " --settings {params.settings:q} --output {output} > {log} 2>&1"


rule extract:
    input:
        # ancient: a re-merge rewrites these files, but a range is stale only when its
        # own samples change, which the range digest in params tracks.
        records=ancient(f"{RESULTS}/merged/{{split}}.jsonl"),
        # The checkpoint's first output: inside a cluster job, params that read the
        # merge manifest need it declared.
        merged=ancient(f"{RESULTS}/merged/train.jsonl"),
        # A plain path, not checkpoints.preflight.get(): an input that is a pending checkpoint
        # target makes Snakemake 9.27 skip this job's params check in planning, so a changed
        # engine or target would silently rerun nothing (pinned by tests/test_rerun_table.py).
        preflight=ancient(f"{RESULTS}/hidden_states/preflight.json"),
        target=ancient(target_input()),
    output:
        directory(f"{RESULTS}/hidden_states/{{split}}/rows_{{start}}-{{end}}"),
    log:
        f"{LOGS}/extract/{{split}}/rows_{{start}}-{{end}}.log",
    benchmark:
        f"{BENCH}/extract/{{split}}/rows_{{start}}-{{end}}.tsv"
    conda:
        CONDA_ENV
    threads: extract_threads()
    resources:
        gpu=config["extract"]["gpus_per_job"],
    params:
        settings=extract_settings,
        runtime=lambda w: extract_runtime(),
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
        store=f"{RESULTS}/hidden_states/store",
        draftflow=lambda w: extract_command(),
    shell:
        "{params.draftflow} --threads {threads} extract --input {input.records} --split {wildcards.split}"
        " --start {wildcards.start} --end {wildcards.end} --target {params.target}"
        " --store {params.store} --settings {params.settings:q} --runtime {params.runtime:q}"
        " --output {output} > {log} 2>&1"


rule summarize_hidden_states:
    input:
        train=lambda w: range_dirs("train"),
        eval=lambda w: range_dirs("eval"),
    output:
        data_config=f"{RESULTS}/hidden_states/data_config.json",
        sample_lengths=f"{RESULTS}/hidden_states/sample_lengths.json",
    log:
        f"{LOGS}/summarize_hidden_states.log",
    conda:
        CONDA_ENV
    params:
        out_dir=lambda w, output: os.path.dirname(output.data_config),
        max_seq_len=config["merge"]["max_seq_len"],
    shell:
        "draftflow --threads {threads} summarize-hidden-states --ranges {input.train} {input.eval}"
        " --output-dir {params.out_dir} --max-seq-len {params.max_seq_len} > {log} 2>&1"
