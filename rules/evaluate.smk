# Acceptance length, servable exports, and the report's figures.


rule evaluate:
    input:
        drafter=f"{RESULTS}/drafter",
        # simulated τ reads the eval split's hidden states with the target in-process: hf only
        eval_ranges=lambda w: range_dirs("eval") if evaluate_engine() == "hf" else [],
        eval_data=f"{RESULTS}/merged/eval.jsonl",
        target=target_input(),
        prompt_files=evaluate_prompt_files(),
        served=evaluate_served(),
    output:
        json=f"{RESULTS}/eval/acceptance.json",
        csv=f"{RESULTS}/eval/acceptance.csv",
        outputs=f"{RESULTS}/eval/outputs.jsonl",
    log:
        f"{LOGS}/evaluate.log",
    benchmark:
        f"{BENCH}/evaluate.tsv"
    conda:
        CONDA_ENV
    threads: evaluate_threads()
    resources:
        gpu=evaluate_gpus(),
    params:
        settings=lambda w: as_settings(
            split_settings("evaluate", evaluate_settings())[0]
        ),
        runtime=lambda w: Operational(
            split_settings("evaluate", evaluate_settings())[1]
        ),
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
        out_dir=lambda w, output: os.path.dirname(output.json),
        state=f"{STATE}/evaluate",
        served=" ".join(f"--served-drafter {d}" for d in evaluate_served()),
    shell:
        "draftflow --threads {threads} evaluate --drafter {input.drafter} --target {params.target}"
        " --eval-ranges {input.eval_ranges} --eval-data {input.eval_data} {params.served}"
        " --settings {params.settings:q} --runtime {params.runtime:q} --output-dir {params.out_dir}"
        " --state-dir {params.state} > {log} 2>&1"


rule export:
    input:
        drafter=f"{RESULTS}/drafter",
        target=target_input(),
    output:
        sglang=directory(f"{RESULTS}/export/sglang"),
        vllm=directory(f"{RESULTS}/export/vllm"),
        summary=f"{RESULTS}/export/export.json",
    log:
        f"{LOGS}/export.log",
    conda:
        CONDA_ENV
    params:
        settings=lambda w: as_settings(
            {**config["export"], "aux_layer_ids": resolved_aux_layer_ids()}
        ),
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
        out_dir=lambda w, output: os.path.dirname(output.summary),
    shell:
        "draftflow --threads {threads} export --drafter {input.drafter} --target {params.target}"
        " --settings {params.settings:q} --output-dir {params.out_dir} > {log} 2>&1"


rule plot_lengths:
    input:
        train=f"{RESULTS}/merged/train.jsonl",
        eval=f"{RESULTS}/merged/eval.jsonl",
        manifest=f"{RESULTS}/merged/manifest.json",
    output:
        report(
            f"{RESULTS}/plots/lengths.png",
            caption="../report/lengths.rst",
            category="1. Data",
        ),
    log:
        f"{LOGS}/plots/lengths.log",
    conda:
        CONDA_ENV
    shell:
        "draftflow --threads {threads} plot --kind lengths --train-data {input.train} --eval-data {input.eval}"
        " --manifest {input.manifest} --output {output} > {log} 2>&1"


rule plot_storage:
    input:
        plan=f"{RESULTS}/merged/storage_plan.json",
        data_config=f"{RESULTS}/hidden_states/data_config.json",
    output:
        report(
            f"{RESULTS}/plots/storage.png",
            caption="../report/storage.rst",
            category="2. Hidden states",
        ),
    log:
        f"{LOGS}/plots/storage.log",
    conda:
        CONDA_ENV
    shell:
        "draftflow --threads {threads} plot --kind storage --plan {input.plan}"
        " --data-config {input.data_config} --output {output} > {log} 2>&1"


rule plot_training:
    input:
        drafter=f"{RESULTS}/drafter",
    output:
        report(
            f"{RESULTS}/plots/training.png",
            caption="../report/training.rst",
            category="3. Training",
        ),
    log:
        f"{LOGS}/plots/training.log",
    conda:
        CONDA_ENV
    shell:
        "draftflow --threads {threads} plot --kind training --metrics {input.drafter}/metrics.jsonl"
        " --output {output} > {log} 2>&1"


rule plot_acceptance:
    input:
        acceptance=f"{RESULTS}/eval/acceptance.json",
    output:
        report(
            f"{RESULTS}/plots/acceptance.png",
            caption="../report/acceptance.rst",
            category="4. Acceptance",
        ),
    log:
        f"{LOGS}/plots/acceptance.log",
    conda:
        CONDA_ENV
    shell:
        "draftflow --threads {threads} plot --kind acceptance --acceptance {input.acceptance}"
        " --output {output} > {log} 2>&1"
