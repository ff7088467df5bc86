# Acceptance length, servable exports, and the report's figures, per drafter method; the
# methods compared in one figure.


rule evaluate:
    input:
        drafter=f"{RESULTS}/drafter/{{method}}",
        # simulated τ reads the eval split's hidden states with the target in-process: hf only
        eval_ranges=lambda w: range_dirs("eval") if evaluate_engine() == "hf" else [],
        eval_data=f"{RESULTS}/merged/eval.jsonl",
        target=target_input(),
        prompt_files=evaluate_prompt_files(),
        served=lambda w: evaluate_served(w.method),
    output:
        json=f"{RESULTS}/eval/{{method}}/acceptance.json",
        csv=f"{RESULTS}/eval/{{method}}/acceptance.csv",
        outputs=f"{RESULTS}/eval/{{method}}/outputs.jsonl",
    log:
        f"{LOGS}/evaluate/{{method}}.log",
    benchmark:
        f"{BENCH}/evaluate/{{method}}.tsv"
    conda:
        CONDA_ENV
    threads: evaluate_threads()
    resources:
        gpu=evaluate_gpus(),
    params:
        settings=lambda w: as_settings(
            split_settings("evaluate", evaluate_settings(w.method))[0]
        ),
        runtime=lambda w: Operational(
            split_settings("evaluate", evaluate_settings(w.method))[1]
        ),
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
        out_dir=lambda w, output: os.path.dirname(output.json),
        # EAGLE-3 keeps the state folder it had before methods existed
        state=lambda w: (
            f"{STATE}/evaluate"
            if w.method == "eagle3"
            else f"{STATE}/evaluate-{w.method}"
        ),
        served=lambda w: " ".join(
            f"--served-drafter {d}" for d in evaluate_served(w.method)
        ),
    shell:
        "draftflow --threads {threads} evaluate --drafter {input.drafter} --target {params.target}"
        " --eval-ranges {input.eval_ranges} --eval-data {input.eval_data} {params.served}"
        " --settings {params.settings:q} --runtime {params.runtime:q} --output-dir {params.out_dir}"
        " --state-dir {params.state} > {log} 2>&1"


rule export:
    input:
        drafter=f"{RESULTS}/drafter/{{method}}",
        target=target_input(),
    output:
        sglang=directory(f"{RESULTS}/export/{{method}}/sglang"),
        vllm=directory(f"{RESULTS}/export/{{method}}/vllm"),
        summary=f"{RESULTS}/export/{{method}}/export.json",
    log:
        f"{LOGS}/export/{{method}}.log",
    conda:
        CONDA_ENV
    params:
        settings=lambda w: as_settings(export_settings(w.method)),
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
        out_dir=lambda w, output: os.path.dirname(output.summary),
    shell:
        "draftflow --threads {threads} export --drafter {input.drafter} --target {params.target}"
        " --settings {params.settings:q} --output-dir {params.out_dir} > {log} 2>&1"


rule serve_target:
    input:
        target=target_input(),
        eval_data=f"{RESULTS}/merged/eval.jsonl",
    output:
        TARGET_ALONE,
    log:
        f"{LOGS}/serve_check/target_alone.log",
    benchmark:
        f"{BENCH}/serve_check/target_alone.tsv"
    conda:
        CONDA_ENV
    # the launched vLLM runs on the job's CPU threads (or its GPUs)
    threads: 4
    resources:
        gpu=serve_check_gpus(),
    params:
        export_settings=lambda w: as_settings(serve_target_settings()[0]),
        settings=lambda w: as_settings(serve_target_settings()[1]),
        runtime=lambda w: serve_target_settings()[2],
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
    shell:
        "draftflow --threads {threads} serve-target --target {params.target} --eval-data {input.eval_data}"
        " --export-settings {params.export_settings:q} --settings {params.settings:q} --runtime {params.runtime:q}"
        " --output {output} > {log} 2>&1"


rule serve_check:
    input:
        export=f"{RESULTS}/export/{{method}}/export.json",
        drafter=f"{RESULTS}/drafter/{{method}}",
        target=target_input(),
        eval_data=f"{RESULTS}/merged/eval.jsonl",
        # the target alone, served once for every method's gate (or why not: no vLLM found)
        target_alone=TARGET_ALONE,
    output:
        f"{RESULTS}/export/{{method}}/serve_check.json",
    log:
        f"{LOGS}/serve_check/{{method}}.log",
    benchmark:
        f"{BENCH}/serve_check/{{method}}.tsv"
    conda:
        CONDA_ENV
    # the launched vLLM runs on the job's CPU threads (or its GPUs)
    threads: 4
    resources:
        gpu=serve_check_gpus(),
    params:
        export_settings=lambda w: as_settings(export_settings(w.method)),
        settings=lambda w: as_settings(serve_check_settings()[0]),
        runtime=lambda w: serve_check_settings()[1],
        target_identity=lambda w: target_identity(),
        target=lambda w: Operational(target_dir()),
        export_dir=lambda w, input: os.path.dirname(input.export),
    shell:
        "draftflow --threads {threads} serve-check --export-dir {params.export_dir} --drafter {input.drafter}"
        " --target {params.target} --eval-data {input.eval_data} --export-settings {params.export_settings:q}"
        " --settings {params.settings:q} --runtime {params.runtime:q} --target-alone {input.target_alone}"
        " --output {output} > {log} 2>&1"


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
        drafter=f"{RESULTS}/drafter/{{method}}",
    output:
        report(
            f"{RESULTS}/plots/{{method}}/training.png",
            caption="../report/training.rst",
            category="3. Training",
            subcategory="{method}",
        ),
    log:
        f"{LOGS}/plots/{{method}}/training.log",
    conda:
        CONDA_ENV
    shell:
        "draftflow --threads {threads} plot --kind training --metrics {input.drafter}/metrics.jsonl"
        " --output {output} > {log} 2>&1"


rule plot_acceptance:
    input:
        acceptance=f"{RESULTS}/eval/{{method}}/acceptance.json",
    output:
        report(
            f"{RESULTS}/plots/{{method}}/acceptance.png",
            caption="../report/acceptance.rst",
            category="4. Acceptance",
            subcategory="{method}",
        ),
    log:
        f"{LOGS}/plots/{{method}}/acceptance.log",
    conda:
        CONDA_ENV
    shell:
        "draftflow --threads {threads} plot --kind acceptance --acceptance {input.acceptance}"
        " --output {output} > {log} 2>&1"


rule plot_methods:
    input:
        acceptance=expand(f"{RESULTS}/eval/{{method}}/acceptance.json", method=METHODS),
    output:
        report(
            f"{RESULTS}/plots/methods.png",
            caption="../report/methods.rst",
            category="4. Acceptance",
        ),
    log:
        f"{LOGS}/plots/methods.log",
    conda:
        CONDA_ENV
    shell:
        "draftflow plot --kind methods --acceptance {input.acceptance}"
        " --output {output} > {log} 2>&1"
