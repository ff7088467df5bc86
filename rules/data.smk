# Per dataset shard: normalize -> (regenerate) -> tokenize.


rule prepare:
    input:
        source=lambda w: existing(dataset_config(w.dataset)["path"]),
    output:
        shard=f"{RESULTS}/datasets/{{dataset}}/shard-{{shard}}.jsonl.zst",
        rejects=f"{RESULTS}/datasets/{{dataset}}/shard-{{shard}}.rejects.jsonl",
    log:
        f"{LOGS}/prepare/{{dataset}}/shard-{{shard}}.log",
    conda:
        CONDA_ENV
    params:
        settings=lambda w: as_settings(prepare_settings(w.dataset)),
    shell:
        "draftflow --threads {threads} prepare --dataset {wildcards.dataset} --shard {wildcards.shard}"
        " --settings {params.settings:q} --output {output.shard} --rejects {output.rejects}"
        " > {log} 2>&1"


# Before any regeneration job: the configured servers answer and serve the right model.
# A checkpoint, so that regenerate jobs (linked to it by an ancient() input only) are
# re-checked after it reran: Snakemake 9.27 does not check a job's own params in the pass
# where an upstream job reruns, and a changed regenerate setting would go unnoticed.
checkpoint preflight_servers:
    output:
        f"{RESULTS}/regenerated/preflight.json",
    log:
        f"{LOGS}/preflight_servers.log",
    conda:
        CONDA_ENV
    params:
        # what the server checks read: engine, endpoints, served model, API key variable
        settings=as_settings({"regenerate": servers_settings()}),
        path=lambda w, output: os.path.dirname(output[0]),
    shell:
        "draftflow --threads {threads} preflight --path {params.path} --settings {params.settings:q}"
        " --output {output} > {log} 2>&1"


rule regenerate:
    input:
        # ancient: a re-check of the servers alone must not redo finished shards.
        preflight=ancient(f"{RESULTS}/regenerated/preflight.json"),
        shard=lambda w: prepared_shard(w.dataset, w.shard),
        target=target_input(),
    output:
        f"{RESULTS}/regenerated/{{dataset}}/shard-{{shard}}.jsonl.zst",
    log:
        f"{LOGS}/regenerate/{{dataset}}/shard-{{shard}}.log",
    benchmark:
        f"{BENCH}/regenerate/{{dataset}}/shard-{{shard}}.tsv"
    conda:
        CONDA_ENV
    threads: regenerate_threads()
    params:
        settings=as_settings(
            {
                **split_settings("regenerate", config["regenerate"])[0],
                "trust_remote_code": config["target"]["trust_remote_code"],
            }
        ),
        runtime=content_and_runtime("regenerate", config["regenerate"])[1],
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
        state=f"{STATE}/regenerate",
    shell:
        "draftflow --threads {threads} regenerate --dataset {wildcards.dataset} --input {input.shard}"
        " --target {params.target} --settings {params.settings:q} --runtime {params.runtime:q}"
        " --state-dir {params.state} --output {output} > {log} 2>&1"


rule tokenize:
    input:
        shard=conversation_shard,
        tokenizer=tokenizer_input(),
    output:
        f"{RESULTS}/tokenized/{{dataset}}/shard-{{shard}}.jsonl.zst",
    log:
        f"{LOGS}/tokenize/{{dataset}}/shard-{{shard}}.log",
    conda:
        CONDA_ENV
    params:
        # max_seq_len bounds the work per record (merge keeps no more tokens than that)
        settings=as_settings(
            {
                **config["tokenize"],
                "trust_remote_code": config["target"]["trust_remote_code"],
                "max_seq_len": config["merge"]["max_seq_len"],
            }
        ),
        tokenizer_identity=lambda w: tokenizer_identity(),
        tokenizer=lambda w: Operational(tokenizer_dir()),
    shell:
        "draftflow --threads {threads} tokenize --input {input.shard} --tokenizer {params.tokenizer}"
        " --settings {params.settings:q} --output {output} > {log} 2>&1"
