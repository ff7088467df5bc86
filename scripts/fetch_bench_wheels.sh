#!/usr/bin/env bash
# Download, on this machine, the wheels the H200 machine needs for the GPU benchmarks
# (bench/README.md): speculators 0.9's EAGLE-3 training path and draftflow's storage codec.
# The H200 image has Python 3.12, torch, transformers, numpy, safetensors, pyarrow, pandas,
# fsspec, huggingface-hub, httpx, anyio, rich, tqdm, typer, xxhash … but no package index;
# everything below is missing there (found by running bench/speculators_compare.py --tiny in
# a venv holding only the image's packages and adding one package per ModuleNotFoundError).
# Never add torch, transformers, numpy, safetensors, torchvision or torchaudio: the wheels
# are installed with --target in front of the machine's own packages and would shadow them.
#
# Idempotent: a wheel already in .whl is kept; another version of the same package is
# replaced (pip refuses two versions of one package in a single install).
#
# usage: scripts/fetch_bench_wheels.sh [--set bench|workflow|real|all] [DEST]   (default: bench, .whl)
#   bench     speculators' training path + the storage codec (bench/*_throughput.py, speculators_compare.py)
#   workflow  Snakemake and what it needs beyond the image + the codec (bench/multi_gpu.py runs the
#             real workflow there)
#   real      bench + workflow without pulp (16 MB; Snakemake imports it only for its ILP scheduler:
#             run it with --scheduler greedy): bench/real_target.py's call, which also carries a target
#   all       bench + workflow
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
set_name=bench
if [ "${1:-}" = "--set" ]; then set_name="$2"; shift 2; fi
dest="${1:-$repo/.whl}"
mkdir -p "$dest"

bench_wheels=(
    # speculators' training path (speculators.train.cli / trainer / dataloader, models.eagle3)
    speculators==0.9.0
    hs-connectors==0.9.0          # hs_connectors.FileTransfer reads hidden_states/hs_{i}.safetensors
    datasets==5.1.0               # load_from_disk (speculators: datasets<=5.1.0); also draftflow's exporter
    dill==0.4.1                   # datasets
    multiprocess==0.70.19         # datasets
    pydantic==2.14.4              # speculators' config classes and TrainConfig
    pydantic-core==2.50.5         # pydantic (compiled, cp312)
    annotated-types==0.8.0        # pydantic
    typing-inspection==0.4.5      # pydantic
    typing-extensions==4.16.0     # pydantic 2.14 declares >=4.16; newer than any older copy it shadows
    pydantic-settings==2.16.3     # speculators.train.config.TrainConfig (BaseSettings)
    python-dotenv==1.2.4          # pydantic-settings
    loguru==0.7.3                 # speculators' logging
    openai==3.57.0                # imported at module level by speculators.train.data (unused offline)
    httpx2==2.16.2                # openai
    sniffio==1.3.1                # openai
    # draftflow's storage codec (bench/train_throughput.py and the export)
    zstandard==0.25.0
    # draftflow.config validates every config with jsonschema (every bench imports it); the
    # image has attrs but not these
    jsonschema==4.26.0
    jsonschema-specifications==2025.9.1
    referencing==0.37.0
    rpds-py==2026.9.1
)

# Snakemake 9.27.1's closure minus what the image already has (attrs, jinja2, numpy, pandas,
# psutil, pyyaml, requests, tabulate, wrapt, ...): found by resolving snakemake's requirements
# in the project's venv and dropping every name in the image's package list (KINDS.md).
workflow_wheels=(
    snakemake==9.27.1
    snakemake-interface-common==1.23.0
    snakemake-interface-executor-plugins==9.4.0
    snakemake-interface-logger-plugins==2.1.0
    snakemake-interface-report-plugins==1.3.0
    snakemake-interface-scheduler-plugins==2.0.2
    snakemake-interface-storage-plugins==4.4.1
    annotated-types==0.8.0 argparse-dataclass==2.0.0 conda-inject==1.3.2 configargparse==1.9.0
    docutils==0.22.4 dpath==2.2.0 fastjsonschema==2.22.3 gitdb==4.0.12 gitpython==3.2.1
    greenlet==3.5.6 humanfriendly==10.0 immutables==0.21 jsonschema==4.26.0
    jsonschema-specifications==2025.9.1 jupyter-core==5.9.1 nbformat==5.11.1 platformdirs==4.14.9
    pulp==3.3.2 pydantic==2.14.4 pydantic-core==2.50.5 referencing==0.37.0 rpds-py==2026.9.1
    smart-open==7.7.1 smmap==5.0.3 sqlalchemy==2.0.58 sqlmodel==0.0.37 tenacity==9.2.1
    throttler==1.2.3 traitlets==5.16.1 typing-inspection==0.4.5 typing-extensions==4.16.0 yte==1.9.4
    zstandard==0.25.0
)
# Published as a source distribution only: built here into a (pure-Python) wheel.
workflow_sdists=(connection-pool==0.0.3)

case "$set_name" in
    bench) wheels=("${bench_wheels[@]}"); sdists=() ;;
    workflow) wheels=("${workflow_wheels[@]}"); sdists=("${workflow_sdists[@]}") ;;
    all) wheels=("${bench_wheels[@]}" "${workflow_wheels[@]}"); sdists=("${workflow_sdists[@]}") ;;
    real)
        wheels=("${bench_wheels[@]}")
        for w in "${workflow_wheels[@]}"; do [ "${w%%==*}" = pulp ] || wheels+=("$w"); done
        sdists=("${workflow_sdists[@]}") ;;
    *) echo "unknown set $set_name (bench, workflow, real, all)" >&2; exit 2 ;;
esac

norm() { echo "$1" | tr 'A-Z-.' 'a-z__'; }  # wheel file names: lower case, '-' and '.' as '_'

fetched=0
for spec in "${wheels[@]}"; do
    name="${spec%%==*}"
    version="${spec##*==}"
    want="$(norm "$name")"
    have=""
    for f in "$dest"/*.whl; do
        [ -e "$f" ] || continue
        base="$(basename "$f")"
        fname="$(norm "${base%%-*}")"
        rest="${base#*-}"
        fversion="${rest%%-*}"
        if [ "$fname" = "$want" ]; then
            if [ "$fversion" = "$version" ]; then
                have="$f"
            else
                echo "removing $base (want $name $version)"
                rm -f "$f"
            fi
        fi
    done
    [ -n "$have" ] && continue
    python3 -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d "$dest" "$spec" 2> >(grep -v "^WARNING: Location" >&2)
    fetched=$((fetched + 1))
done

for spec in "${sdists[@]}"; do
    want="$(norm "${spec%%==*}")-${spec##*==}-"
    ls "$dest" | grep -qi "^$want" && continue
    python3 -m pip wheel -q --no-deps -w "$dest" "$spec" 2> >(grep -v "^WARNING: Location" >&2)
    fetched=$((fetched + 1))
done

total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
echo "$fetched downloaded; $(ls "$dest"/*.whl | wc -l) wheels in $dest, $((total / 1024)) KiB"
if [ "$total" -gt $((56 * 1024 * 1024)) ]; then
    echo "error: $dest holds more than 56 MB; the working tree that travels to the device is capped at 64 MiB" >&2
    exit 1
fi
