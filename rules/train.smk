# Draft vocabulary and drafter training (torchrun; resume state outside the outputs).


rule vocab:
    input:
        train=f"{RESULTS}/merged/train.jsonl",
        target=target_input(),
    output:
        vocab=f"{RESULTS}/vocab/draft_vocab.safetensors",
        stats=f"{RESULTS}/vocab/draft_vocab.json",
    log:
        f"{LOGS}/vocab.log",
    conda:
        CONDA_ENV
    params:
        settings=as_settings({"draft_vocab_size": config["train"]["draft_vocab_size"]}),
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
    shell:
        "draftflow --threads {threads} vocab --input {input.train} --target {params.target}"
        " --settings {params.settings:q} --output {output.vocab} > {log} 2>&1"


rule train:
    input:
        train=lambda w: range_dirs("train"),
        eval=lambda w: range_dirs("eval"),
        vocab=f"{RESULTS}/vocab/draft_vocab.safetensors",
        target=target_input(),
    output:
        directory(f"{RESULTS}/drafter"),
    log:
        f"{LOGS}/train.log",
    benchmark:
        f"{BENCH}/train.tsv"
    conda:
        CONDA_ENV
    threads: train_threads()
    resources:
        **train_resources(),
    params:
        settings=lambda w: as_settings(train_settings()),
        runtime=lambda w: train_runtime(),
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
        state=f"{STATE}/train",
        nodes=config["train"]["nodes"],
        gpus=config["train"]["gpus"],
    shell:
        "draftflow --threads {threads} launch-train --nodes {params.nodes} --gpus-per-node {params.gpus} --"
        " --train-ranges {input.train} --eval-ranges {input.eval} --target {params.target}"
        " --vocab {input.vocab} --settings {params.settings:q} --runtime {params.runtime:q}"
        " --state-dir {params.state}"
        " --output {output} > {log} 2>&1"
