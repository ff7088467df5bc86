# One merged, shuffled training set; its manifest plans the extraction ranges.


checkpoint merge:
    input:
        shards=[file for files in tokenized_shards().values() for file in files],
        rejects=[file for files in rejects_files().values() for file in files],
    output:
        train=f"{RESULTS}/merged/train.jsonl",
        eval=f"{RESULTS}/merged/eval.jsonl",
        manifest=f"{RESULTS}/merged/manifest.json",
        stats=report(
            f"{RESULTS}/merged/stats.csv",
            caption="../report/dataset_stats.rst",
            category="1. Data",
        ),
    log:
        f"{LOGS}/merge.log",
    benchmark:
        f"{BENCH}/merge.tsv"
    conda:
        CONDA_ENV
    params:
        settings=as_settings(merge_settings()),
        inputs=merge_input_args,
        out_dir=lambda w, output: os.path.dirname(output.manifest),
    shell:
        "draftflow --threads {threads} merge {params.inputs} --settings {params.settings:q}"
        " --out-dir {params.out_dir} > {log} 2>&1"


# The storage plan is its own small rule so that changing dtype or layers re-plans
# without re-merging (which would make every downstream output stale).
rule plan_storage:
    input:
        manifest=f"{RESULTS}/merged/manifest.json",
        target=target_input(),
    output:
        f"{RESULTS}/merged/storage_plan.json",
    log:
        f"{LOGS}/plan_storage.log",
    conda:
        CONDA_ENV
    params:
        settings=lambda w: as_settings(
            {
                "aux_layer_ids": captured_layer_ids(),
                "dtype": config["extract"]["dtype"],
                "expected_compression_ratio": config["extract"][
                    "expected_compression_ratio"
                ],
                "hidden_size": config["target"]["hidden_size"],
                "num_hidden_layers": config["target"]["num_hidden_layers"],
                "storage": config["extract"]["storage"],
            }
        ),
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
    shell:
        "draftflow --threads {threads} plan-storage --manifest {input.manifest} --target {params.target}"
        " --settings {params.settings:q} --output {output} > {log} 2>&1"
