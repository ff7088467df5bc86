# Config validation, paths and input functions shared by every rule.
import json
import os
import shlex
import sys
from functools import lru_cache
from pathlib import Path

from snakemake.exceptions import WorkflowError

from draftflow.errors import DraftflowError
from draftflow.config import (
    ConfigError,
    check_config_files,
    coerce_overrides,
    default_aux_layer_ids,
    enabled_datasets,
    split_settings,
    validate_config,
    TRAIN_KEYS_ADDED_LATER,
)

try:
    # A target written after --configfile is read as a config file: say so.
    check_config_files(workflow.config_settings.configfiles)
    # --config reads nested values as strings ('{learning_rate: 0.001}'): coerce by the schema.
    config.update(
        validate_config(coerce_overrides(config, workflow.config_settings.config))
    )
except ConfigError as e:
    raise WorkflowError(str(e)) from None


# Rules run `draftflow <stage>` through scripts/bin/draftflow, with the package from
# this checkout and the first python3 on PATH: the interpreter running Snakemake (so an
# un-activated virtualenv works), or the rule's env under --sdm conda.
def _prepend(var: str, *paths: str) -> None:
    # Once only: the Snakefile may be parsed again in the same process (tests, the API).
    current = [p for p in os.environ.get(var, "").split(os.pathsep) if p]
    if current[: len(paths)] != list(paths):
        os.environ[var] = os.pathsep.join([*paths, *current])


_prepend("PATH", f"{workflow.basedir}/scripts/bin", os.path.dirname(sys.executable))
_prepend("PYTHONPATH", workflow.basedir)
CONDA_ENV = "../envs/draftflow.yaml"

RESULTS = config["results"]
LOGS = f"{RESULTS}/logs"
BENCH = f"{RESULTS}/benchmarks"
STATE = f"{RESULTS}/state"
SUMMARY_PAGE = f"{RESULTS}/report/summary.rst"
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


class Operational:
    """A param the job receives but whose change never reruns it. Snakemake's params trigger
    compares the repr of builtin-typed values (str, dict, …) and skips any other object, so
    operational settings (draftflow.config.OPERATIONAL_KEYS: how a stage runs, not what it
    writes) and paths whose content is tracked otherwise (the target folder, by its identity)
    travel in this wrapper. In a shell command it formats as its JSON (or the plain string).
    """

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __str__(self) -> str:
        return self.value if isinstance(self.value, str) else as_settings(self.value)

    def __repr__(self) -> str:
        return f"Operational({self.value!r})"


def content_and_runtime(section: str, values: dict) -> tuple[dict, Operational]:
    """A config section split into the params that rerun a rule and those that do not."""
    content, operational = split_settings(section, values)
    return content, Operational(operational)


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
    """The builtin target is built by a rule: an input. A model folder given in the config is
    not declared at all: its content identity (a param) reruns what depends on it, so a moved
    or copied model reruns nothing."""
    if config["target"]["model"] == BUILTIN_TARGET:
        return [f"{RESULTS}/target"]
    return []


def tokenizer_input() -> list:
    if config["target"]["tokenizer"]:
        return []
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


def rejects_files() -> dict[str, list[str]]:
    """Prepare's rejects files per dataset (merge counts them into the manifest)."""
    return {
        name: [
            f"{RESULTS}/datasets/{name}/shard-{i}.rejects.jsonl"
            for i in shard_ids(name)
        ]
        for name in DATASETS
    }


def servers_settings() -> dict:
    """The part of config `regenerate` the server preflight checks (draftflow.engines.servers)."""
    regenerate = config["regenerate"]
    if regenerate["engine"] != "openai":
        return {"engine": regenerate["engine"]}  # nothing to check
    openai = {k: regenerate["openai"][k] for k in ("endpoints", "model", "api_key_env")}
    return {"engine": regenerate["engine"], "openai": openai}


def merge_input_args(wildcards, input) -> str:
    """`--input NAME=FILE` and `--rejects NAME=FILE` pairs, in config order and shard order."""
    pairs = []
    for name, files in tokenized_shards().items():
        pairs += [f"--input {name}={file}" for file in files]
    for name, files in rejects_files().items():
        pairs += [f"--rejects {name}={file}" for file in files]
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


def eval_range_dirs() -> list[str]:
    """The eval split's range folders for training, which measures the drafter on
    them: an empty eval split stops the plan here, with the fix."""
    dirs = range_dirs("eval")
    if not dirs:
        raise WorkflowError(
            f"{RESULTS}/merged/manifest.json: the eval split is empty (every sample went to train), but "
            "training measures the drafter on it. Raise merge.eval_fraction or merge.min_eval_samples "
            "(with at least one sample more than it), or add data."
        )
    return dirs


def range_of(wildcards) -> dict:
    name = f"rows_{wildcards.start}-{wildcards.end}"
    for entry in ranges(wildcards.split):
        if entry["name"] == name:
            return entry
    raise WorkflowError(
        f"{name} is not in the {wildcards.split} range plan of the merge manifest; "
        "the merge changed since this target was requested — rerun without naming it."
    )


@lru_cache(maxsize=None)
def _content_identity(kind: str, path: str) -> str:
    """Cached per Snakemake process: a few small reads per call, but params ask per job."""
    from draftflow.target import target_identity as model_identity, tokenizer_identity

    return (model_identity if kind == "model" else tokenizer_identity)(path)


def target_identity() -> str:
    """The target as the params of the rules reading it see it: by content, not path (config,
    tokenizer, weight headers and sampled bytes; draftflow.target.target_identity). The builtin
    target is defined by its build settings, known before it is built."""
    if config["target"]["model"] == BUILTIN_TARGET:
        return f"{BUILTIN_TARGET}:{as_settings(config['target']['builtin'])}"
    path = Path(target_dir())
    if not (path / "config.json").exists():
        return f"absent:{path}"  # dry-run of a config whose model is not there yet
    return _content_identity("model", str(path.resolve()))


def tokenizer_identity() -> str:
    """What tokenization depends on: the tokenizer files only (new weights do not re-tokenize)."""
    if (
        not config["target"]["tokenizer"]
        and config["target"]["model"] == BUILTIN_TARGET
    ):
        return target_identity()
    path = Path(tokenizer_dir())
    if not path.is_dir():
        return f"absent:{path}"
    return _content_identity("tokenizer", str(path.resolve()))


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
    """What a range's stored samples depend on (draftflow.config.split_settings: engine,
    layers, dtype, the engine's numerics keys), plus the range's own content digest: a range
    is stale exactly when one of these, or the target identity (its own param), changes.
    """
    settings, _ = split_settings("extract", config["extract"])
    settings["aux_layer_ids"] = captured_layer_ids()
    settings["range_digest"] = range_of(wildcards)["digest"]
    return as_settings(settings)


def extract_runtime() -> Operational:
    """How extraction runs (batching, threads, device, disk margin …): never reruns a range."""
    _, runtime = content_and_runtime("extract", config["extract"])
    runtime.value["trust_remote_code"] = config["target"]["trust_remote_code"]
    return runtime


METHODS = config["train"]["methods"]


def final_outputs() -> list:
    outputs = [
        f"{RESULTS}/merged/manifest.json",
        f"{RESULTS}/merged/storage_plan.json",
        f"{RESULTS}/hidden_states/data_config.json",
        SUMMARY_PAGE,
        f"{RESULTS}/plots/lengths.png",
        f"{RESULTS}/plots/storage.png",
        f"{RESULTS}/plots/methods.png",
    ]
    for method in METHODS:
        outputs += [
            f"{RESULTS}/drafter/{method}",
            f"{RESULTS}/eval/{method}/acceptance.json",
            f"{RESULTS}/export/{method}/export.json",
            *serve_check_outputs(method),
            f"{RESULTS}/plots/{method}/training.png",
            f"{RESULTS}/plots/{method}/acceptance.png",
        ]
    return outputs


def export_settings(method: str) -> dict:
    """config `export` as the export stage reads it: its gate's keys belong to serve_check."""
    settings = {
        k: v for k, v in config["export"].items() if k not in ("check", "serve_check")
    }
    return {**settings, "aux_layer_ids": method_layer_ids(method)}


def serve_check_outputs(method: str) -> list:
    if config["export"]["check"] == "off":
        return []
    return [f"{RESULTS}/export/{method}/serve_check.json"]


def serve_check_python() -> str | None:
    """export.serve_check.python, else $DRAFTFLOW_VLLM_PYTHON, else this workflow's .venv-vllm
    (make vllm-setup), else None (the stage then looks in its own Python)."""
    given = config["export"]["serve_check"]["python"] or os.environ.get(
        "DRAFTFLOW_VLLM_PYTHON"
    )
    if given:
        return given
    local = Path(workflow.basedir) / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else None


def gate_serves() -> bool:
    """Whether the export gate will serve vLLM: export.check vllm, or auto with a vLLM found
    (export.serve_check.python, $DRAFTFLOW_VLLM_PYTHON, .venv-vllm, or this Python)."""
    import importlib.util

    check = config["export"]["check"]
    if check == "off":
        return False
    return (
        check == "vllm"
        or bool(serve_check_python())
        or importlib.util.find_spec("vllm") is not None
    )


def serve_check_gpus() -> int:
    """GPUs for the gate: export.tensor_parallel when it will serve vLLM on a GPU workflow
    (extraction has GPUs), else none: the static part and a CPU vLLM need no GPU, and a
    cluster job that asks for one waits for it."""
    if not config["extract"]["gpus_per_job"] or not gate_serves():
        return 0
    return config["export"]["tensor_parallel"]


TARGET_ALONE = f"{RESULTS}/export/target_alone.json"


def serve_check_settings() -> tuple[dict, Operational]:
    """The gate's settings: what it checks (reruns it when changed), and how it serves (never)."""
    s = config["export"]["serve_check"]
    content = {
        "check": config["export"]["check"],
        "prompts": s["prompts"],
        "max_new_tokens": s["max_new_tokens"],
        "tolerance": s["tolerance"],
        "trust_remote_code": config["target"]["trust_remote_code"],
    }
    runtime = {
        "python": serve_check_python(),
        "extra_args": s["extra_args"],
        "startup_timeout_s": s["startup_timeout_s"],
    }
    return content, Operational(runtime)


def serve_target_settings() -> tuple[dict, dict, Operational]:
    """serve_target's (export settings, gate settings, runtime): only what the target alone's
    greedy outputs depend on, so that a drafter's or the tolerance's change does not serve it again.
    """
    content, runtime = serve_check_settings()
    content = {k: v for k, v in content.items() if k != "tolerance"}
    return {"dtype": config["export"]["dtype"]}, content, runtime


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


# train keys only EAGLE-3 reads: DFlash's drafter never reruns for them
EAGLE3_TRAIN_KEYS = (
    "num_hidden_layers",
    "draft_vocab_size",
    "ttt_steps",
    "step_weight_decay",
    "loss",
    "target_temperature",
    "freeze_lm_head",
    "lm_head_lr_scale",
    "norm_before_fc",
    "norm_before_residual",
    "norm_output",
    "batching",
)


def train_settings(method: str) -> dict:
    """What one method's drafter depends on: the shared content keys, the layers it reads;
    DFlash also its own subtree and not EAGLE-3's keys (EAGLE-3's settings stay as they were
    before methods existed). The operational rest goes through `train_runtime`."""
    content, _ = split_settings("train", config["train"])
    skip = ("methods", "dflash") + (EAGLE3_TRAIN_KEYS if method == "dflash" else ())
    settings = {k: v for k, v in content.items() if k not in skip}
    # keys added later, at their defaults: params as before they could be set
    for key, default in TRAIN_KEYS_ADDED_LATER.items():
        if settings.get(key) == default:
            del settings[key]
    settings["aux_layer_ids"] = method_layer_ids(method)
    if method == "dflash":
        settings["method"] = method
        dflash = config["train"]["dflash"]
        # D-PACE's keys only where it is on: a decay run keeps the params it had before they existed
        unused = {"target_layer_ids"}
        if dflash["loss_weighting"] == "decay":
            unused |= {"loss_weighting", "dpace_alpha"}
        settings["dflash"] = {k: v for k, v in dflash.items() if k not in unused}
    return settings


def vocab_input(method: str) -> list:
    """EAGLE-3 drafts over its draft vocabulary; DFlash over the target's whole vocabulary."""
    return [] if method == "dflash" else [f"{RESULTS}/vocab/draft_vocab.safetensors"]


def train_runtime() -> Operational:
    return content_and_runtime("train", config["train"])[1]


# ---- CPU threads per job (Snakemake clamps them to --cores; `draftflow --threads` applies them) ----


def regenerate_threads() -> int:
    """In-process HF generation computes on CPU threads; an OpenAI-compatible server does not."""
    return 4 if config["regenerate"]["engine"] == "hf" else 1


def extract_threads() -> int:
    """The writer pool (encoding, zstd, fsync) plus the capture loop."""
    return config["extract"]["writer_threads"] + 1


def evaluate_threads() -> int:
    """The HF engine decodes on CPU threads, and so do the servers the stage launches (which
    inherit the job's thread variables); against a running endpoint it only sends requests.
    """
    return 4 if evaluate_engine() == "hf" or evaluate_launches() else 1


def train_threads() -> int:
    """Per node. GPUs: each process drives its GPU from one thread, with train.num_workers
    DataLoader workers beside it. CPU: one process whose torch pool takes what is left.
    """
    workers = config["train"]["num_workers"]
    if config["train"]["gpus"]:
        return config["train"]["gpus"] * (1 + workers)
    return 8 + workers


def train_resources() -> dict:
    """GPUs on one node: `gpu` (sbatch --gpus, and the local GPU limit). Several nodes:
    one srun task per node that runs torchrun, with `gpus` GPUs on each node."""
    gpus, nodes = config["train"]["gpus"], config["train"]["nodes"]
    if nodes == 1:
        return {"gpu": gpus}
    resources = {"nodes": nodes, "tasks": nodes, "mpi": "srun", "tasks_per_gpu": 0}
    return {**resources, "gres": f"gpu:{gpus}"} if gpus else resources


# ---- evaluate ------------------------------------------------------------------------


def evaluate_engine() -> str:
    return config["evaluate"]["engine"]


def evaluate_launches() -> bool:
    """A served engine without a running endpoint: the stage starts servers on the GPUs."""
    return evaluate_engine() != "hf" and not config["evaluate"]["server"]["endpoint"]


def evaluate_settings(method: str) -> dict:
    """config `evaluate` + what it reads elsewhere (the method's layers); the hf engine
    ignores `server`."""
    engine = evaluate_engine()
    settings = {**config["evaluate"], "aux_layer_ids": method_layer_ids(method)}
    settings["trust_remote_code"] = config["target"]["trust_remote_code"]
    # the default dtype is left out: an evaluation from before the key keeps its params
    if settings.get("dtype") == "auto":
        settings.pop("dtype")
    if engine == "hf":
        settings.pop("server")
    else:  # the exported drafter is written for this release (its aux ids depend on it)
        settings.pop("seed", None)  # the engine samples with its own seeds
        settings["engine_version"] = config["export"][f"{engine}_version"]
    return settings


def evaluate_served(method: str) -> list:
    """The exported drafter a launched engine loads (none for hf or a running endpoint)."""
    if not evaluate_launches():
        return []
    return [f"{RESULTS}/export/{method}/{evaluate_engine()}"]


def evaluate_prompt_files() -> list:
    sets = config["evaluate"]["prompt_sets"].values()
    return [f for s in sets if s["path"] for f in existing(s["path"])]


def evaluate_gpus() -> int:
    if evaluate_engine() == "hf":
        return min(1, config["extract"]["gpus_per_job"])
    return config["evaluate"]["server"]["tensor_parallel"] if evaluate_launches() else 0


def extract_command() -> Operational:
    """The command an extract job runs: `draftflow`, or for engine vllm with extract.vllm.python
    set, `<that python> -m draftflow.cli` (vLLM runs in the job's process, so the job needs a
    Python that has vllm; PYTHONPATH, set above, gives it this checkout's package)."""
    python = (
        config["extract"]["vllm"].get("python")
        if config["extract"]["engine"] == "vllm"
        else None
    )
    if not python:
        return Operational("draftflow")
    return Operational(f"{shlex.quote(str(python))} -m draftflow.cli")
