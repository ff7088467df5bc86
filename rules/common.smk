# Config validation, paths and input functions shared by every rule.
import json
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from draftflow.errors import DraftflowError
from draftflow.config import (
    ConfigError,
    default_aux_layer_ids,
    enabled_datasets,
    validate_config,
)

try:
    config.update(validate_config(config))
except ConfigError as e:
    raise WorkflowError(str(e)) from None


# Rules run `draftflow <stage>` through scripts/bin/draftflow, with the package from
# this checkout and the first python3 on PATH: the interpreter running Snakemake (so an
# un-activated virtualenv works), or the rule's env under --sdm conda.
def _prepend(var: str, *paths: str) -> None:
    os.environ[var] = os.pathsep.join([*paths, *filter(None, [os.environ.get(var)])])


_prepend("PATH", f"{workflow.basedir}/scripts/bin", os.path.dirname(sys.executable))
_prepend("PYTHONPATH", workflow.basedir)
CONDA_ENV = "../envs/draftflow.yaml"

RESULTS = config["results"]
LOGS = f"{RESULTS}/logs"
BENCH = f"{RESULTS}/benchmarks"
STATE = f"{RESULTS}/state"
BUILTIN_TARGET = "builtin:tiny-llama"


wildcard_constraints:
    method=r"eagle3|dflash",
    dataset=r"[A-Za-z0-9][A-Za-z0-9_-]*",
    shard=r"\d+",
    split=r"train|eval",
    start=r"\d+",
    end=r"\d+",


def as_settings(value) -> str:
    """A config subtree as the JSON a stage reads; params compare by repr, so keep it canonical."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def existing(path) -> list:
    """An external input, declared only when present: dry-runs of configs whose data is
    not there yet still plan every job, and the stage itself reports a missing file."""
    return [path] if Path(path).exists() else []


# ---- target -------------------------------------------------------------------------


def target_dir() -> str:
    model = config["target"]["model"]
    return f"{RESULTS}/target" if model == BUILTIN_TARGET else model


def tokenizer_dir() -> str:
    return config["target"]["tokenizer"] or target_dir()


def target_input() -> list:
    if config["target"]["model"] == BUILTIN_TARGET:
        return [f"{RESULTS}/target"]
    return existing(config["target"]["model"])


def tokenizer_input() -> list:
    if config["target"]["tokenizer"]:
        return existing(config["target"]["tokenizer"])
    return target_input()


# ---- datasets ------------------------------------------------------------------------

DATASETS = enabled_datasets(config)
# Keys that shape a dataset's shards; weight and max_merged only matter to merge.
PREPARE_KEYS = (
    "path",
    "format",
    "split",
    "shards",
    "max_samples",
    "on_error",
    "regenerate",
)


def dataset_config(name: str) -> dict:
    return config["datasets"][name]


def prepare_settings(name: str) -> dict:
    return {key: dataset_config(name)[key] for key in PREPARE_KEYS}


def shard_ids(name: str) -> list[int]:
    return list(range(dataset_config(name)["shards"]))


def prepared_shard(dataset, shard) -> str:
    return f"{RESULTS}/datasets/{dataset}/shard-{shard}.jsonl.zst"


def conversation_shard(wildcards) -> str:
    """Tokenize reads the regenerated shard when the dataset asks for regeneration."""
    if dataset_config(wildcards.dataset)["regenerate"]:
        return f"{RESULTS}/regenerated/{wildcards.dataset}/shard-{wildcards.shard}.jsonl.zst"
    return prepared_shard(wildcards.dataset, wildcards.shard)


def tokenized_shards() -> dict[str, list[str]]:
    return {
        name: [
            f"{RESULTS}/tokenized/{name}/shard-{i}.jsonl.zst" for i in shard_ids(name)
        ]
        for name in DATASETS
    }


def merge_input_args(wildcards, input) -> str:
    """`--input NAME=FILE` pairs, in config order and shard order."""
    pairs = []
    for name, files in tokenized_shards().items():
        pairs += [f"--input {name}={file}" for file in files]
    return " ".join(pairs)


def merge_settings() -> dict:
    per_dataset = {
        name: {
            "weight": dataset_config(name)["weight"],
            "max_merged": dataset_config(name)["max_merged"],
        }
        for name in DATASETS
    }
    return {**config["merge"], "datasets": per_dataset}


# ---- ranges (data-dependent: read from merge's manifest) --------------------------------


def manifest() -> dict:
    """The merge checkpoint's manifest; raises IncompleteCheckpointException until merge ran."""
    with open(checkpoints.merge.get().output.manifest) as f:
        return json.load(f)


def ranges(split: str) -> list[dict]:
    return manifest()["ranges"][split]


def range_dirs(split: str) -> list[str]:
    return [f"{RESULTS}/hidden_states/{split}/{r['name']}" for r in ranges(split)]


def range_of(wildcards) -> dict:
    name = f"rows_{wildcards.start}-{wildcards.end}"
    for entry in ranges(wildcards.split):
        if entry["name"] == name:
            return entry
    raise WorkflowError(
        f"{name} is not in the {wildcards.split} range plan of the merge manifest; "
        "the merge changed since this target was requested — rerun without naming it."
    )


def target_identity() -> str:
    """Identity of the target as the capture settings see it (path + config, not weights).
    The builtin target is defined by its build settings, known before it is built."""
    if config["target"]["model"] == BUILTIN_TARGET:
        return f"{BUILTIN_TARGET}:{as_settings(config['target']['builtin'])}"
    path = Path(target_dir())
    if not (path / "config.json").exists():
        return f"absent:{path}"  # dry-run of a config whose model is not there yet
    from draftflow.target import target_identity as identity

    return identity(path)


def num_target_layers():
    """Decoder layers of the target, known without reading it for the builtin target."""
    if config["target"]["num_hidden_layers"] is not None:
        return config["target"]["num_hidden_layers"]
    if config["target"]["model"] == BUILTIN_TARGET:
        return config["target"]["builtin"]["num_hidden_layers"]
    if (Path(target_dir()) / "config.json").exists():
        from draftflow.hidden_states.plan import resolve_model_dims

        return resolve_model_dims(Path(target_dir()), config["target"])[0]
    return None


def extract_settings(wildcards) -> str:
    """Everything a range's captures depend on, plus the range's own content digest:
    a range is stale exactly when one of these changes."""
    settings = dict(config["extract"])
    settings["aux_layer_ids"] = captured_layer_ids()
    settings["trust_remote_code"] = config["target"]["trust_remote_code"]
    settings["target_identity"] = target_identity()
    settings["range_digest"] = range_of(wildcards)["digest"]
    return as_settings(settings)


METHODS = config["train"]["methods"]


def final_outputs() -> list:
    outputs = [
        f"{RESULTS}/merged/manifest.json",
        f"{RESULTS}/merged/storage_plan.json",
        f"{RESULTS}/hidden_states/data_config.json",
        f"{RESULTS}/plots/lengths.png",
        f"{RESULTS}/plots/storage.png",
        f"{RESULTS}/plots/methods.png",
    ]
    for method in METHODS:
        outputs += [
            f"{RESULTS}/drafter/{method}",
            f"{RESULTS}/eval/{method}/acceptance.json",
            f"{RESULTS}/export/{method}/export.json",
            f"{RESULTS}/plots/{method}/training.png",
            f"{RESULTS}/plots/{method}/acceptance.png",
        ]
    return outputs


def resolved_aux_layer_ids():
    """Config aux ids (checked against the target's depth when known), or the default."""
    from draftflow.hidden_states.plan import resolve_aux_layer_ids

    num_layers = num_target_layers()
    if num_layers is None:
        return config["extract"]["aux_layer_ids"]
    try:
        return resolve_aux_layer_ids(config["extract"]["aux_layer_ids"], num_layers)
    except DraftflowError as e:
        raise WorkflowError(f"extract.aux_layer_ids: {e}") from None


def dflash_layer_ids():
    """train.dflash.target_layer_ids resolved: null = the layers extraction stores anyway,
    spread = DFlash's own layout for this target, or the list (checked against the target).
    """
    from draftflow.drafters.dflash import spread_target_layer_ids
    from draftflow.hidden_states.plan import resolve_aux_layer_ids

    dflash = config["train"]["dflash"]
    ids, num_layers = dflash["target_layer_ids"], num_target_layers()
    if ids is None:
        return resolved_aux_layer_ids()
    if num_layers is None:  # a dry-run of a config whose model is not there yet
        return None if ids == "spread" else ids
    try:
        if ids == "spread":
            return spread_target_layer_ids(num_layers, dflash["num_hidden_layers"])
        ids = resolve_aux_layer_ids(ids, num_layers)
    except DraftflowError as e:
        raise WorkflowError(f"train.dflash.target_layer_ids: {e}") from None
    if ids != sorted(ids):
        raise WorkflowError(
            f"train.dflash.target_layer_ids {ids} must be increasing: engines concatenate captured layers in layer order"
        )
    return ids


def method_layer_ids(method: str):
    """The stored aux layers a drafter method reads."""
    return dflash_layer_ids() if method == "dflash" else resolved_aux_layer_ids()


def captured_layer_ids():
    """What extraction captures: EAGLE-3's layers (extract.aux_layer_ids) plus DFlash's when set
    explicitly, whichever methods this run trains, so that toggling train.methods never changes
    what is stored (samples are keyed by their captured layers)."""
    aux = resolved_aux_layer_ids()
    if config["train"]["dflash"]["target_layer_ids"] is None or aux is None:
        return aux
    extra = dflash_layer_ids()
    return aux if extra is None else sorted(set(aux) | set(extra))


def train_settings(method: str) -> dict:
    """The `train` subtree for one method: shared keys, the method, the layers it reads; DFlash
    also gets its own subtree (EAGLE-3's stays as it was before methods existed)."""
    settings = {
        k: v for k, v in config["train"].items() if k not in ("methods", "dflash")
    }
    settings["aux_layer_ids"] = method_layer_ids(method)
    if method == "dflash":
        settings["method"] = method
        settings["dflash"] = {
            k: v
            for k, v in config["train"]["dflash"].items()
            if k != "target_layer_ids"
        }
    return settings


def vocab_input(method: str) -> list:
    """EAGLE-3 drafts over its draft vocabulary; DFlash over the target's whole vocabulary."""
    return [] if method == "dflash" else [f"{RESULTS}/vocab/draft_vocab.safetensors"]


def train_resources() -> dict:
    """GPUs on one node: `gpu` (sbatch --gpus, and the local GPU limit). Several nodes:
    one srun task per node that runs torchrun, with `gpus` GPUs on each node."""
    gpus, nodes = config["train"]["gpus"], config["train"]["nodes"]
    if nodes == 1:
        return {"gpu": gpus}
    resources = {"nodes": nodes, "tasks": nodes, "mpi": "srun", "tasks_per_gpu": 0}
    return {**resources, "gres": f"gpu:{gpus}"} if gpus else resources
