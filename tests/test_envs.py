"""envs/*.yaml (for --sdm conda) stay consistent with pyproject.toml and the rules."""

import re
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower()


def _pip_requirements(env_file: Path) -> dict[str, str]:
    env = yaml.safe_load(env_file.read_text())
    reqs = {}
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            reqs.update({_name(r): r.replace(" ", "") for r in dep.get("pip", [])})
    return reqs


def test_env_files_match_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # Snakemake and its plugins run the workflow; they are not needed inside a job's env.
    runtime = {
        _name(r): r.replace(" ", "")
        for r in project["dependencies"]
        if not _name(r).startswith("snakemake")
    }
    for env_file in sorted((REPO / "envs").glob("*.yaml")):
        reqs = _pip_requirements(env_file)
        assert reqs == runtime, f"{env_file.name} differs from pyproject.toml dependencies"


def test_every_rule_uses_an_existing_env():
    rule_files = sorted((REPO / "rules").glob("*.smk"))
    common = (REPO / "rules" / "common.smk").read_text()
    env_ref = re.search(r'CONDA_ENV = "(.+?)"', common).group(1)
    assert (REPO / "rules" / env_ref).resolve().exists()
    for path in rule_files:
        text = path.read_text()
        n_rules = len(re.findall(r"^(?:rule|checkpoint) \w+:", text, flags=re.M))
        n_conda = text.count("conda:\n        CONDA_ENV")
        assert n_conda == n_rules, f"{path.name}: {n_rules} rules but {n_conda} conda directives"
