# Draft vocabulary and drafter training (torchrun; resume state outside the outputs), one
# drafter per method of train.methods, all from the same extracted ranges.


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
        eval=lambda w: eval_range_dirs(),
        vocab=lambda w: vocab_input(w.method),
        target=target_input(),
    output:
        directory(f"{RESULTS}/drafter/{{method}}"),
    log:
        f"{LOGS}/train/{{method}}.log",
    benchmark:
        f"{BENCH}/train/{{method}}.tsv"
    conda:
        CONDA_ENV
    threads: train_threads()
    resources:
        **train_resources(),
    params:
        settings=lambda w: as_settings(train_settings(w.method)),
        runtime=lambda w: train_runtime(),
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
        # paths whose content is tracked otherwise (vocab input, target identity)
        method_args=lambda w, input: Operational(
            f"--tokenizer {tokenizer_dir()}"
            if w.method == "dflash"
            else f"--vocab {input.vocab}"
        ),
        # EAGLE-3 keeps the state folder it had before methods existed (a resume stays valid)
        state=lambda w: (
            f"{STATE}/train" if w.method == "eagle3" else f"{STATE}/train-{w.method}"
        ),
        nodes=config["train"]["nodes"],
        gpus=config["train"]["gpus"],
    shell:
        "draftflow --threads {threads} launch-train --nodes {params.nodes} --gpus-per-node {params.gpus} --"
        " --train-ranges {input.train} --eval-ranges {input.eval} --target {params.target}"
        " {params.method_args} --settings {params.settings:q} --runtime {params.runtime:q}"
        " --state-dir {params.state}"
        " --output {output} > {log} 2>&1"
