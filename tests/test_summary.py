"""The report's summary page (draftflow/summary.py): tables as RST grid tables, sections that
skip what a partial run has not written, and a page docutils renders without a warning.
(The end-to-end test checks the page of a real run inside the Snakemake report.)"""

from __future__ import annotations

import json
from pathlib import Path

import docutils.core

from draftflow.summary import SECTIONS, RunFiles, render_page, table, write_summary


def rst_to_html(page: str) -> str:
    """What Snakemake does with the description: Jinja (our raw block), then docutils."""
    from jinja2 import Environment

    text = Environment().from_string(page).render()
    parts = docutils.core.publish_parts(text, writer="html", settings_overrides={"halt_level": 2, "report_level": 5})
    return parts["html_body"]


def test_grid_table_reads_as_text_and_renders_as_html():
    lines = table(["method", "K", "τ"], [["eagle3", 3, "2.500"], ["-ngram|x", None, 1234567]])
    assert lines == [
        "+-----------+---+-----------+",
        "| method    | K | τ         |",
        "+===========+===+===========+",
        "| eagle3    | 3 | 2.500     |",
        "+-----------+---+-----------+",
        "| \\-ngram/x | – | 1,234,567 |",
        "+-----------+---+-----------+",
    ]
    html = rst_to_html("\n".join(lines) + "\n")
    assert "<td>eagle3</td>" in html and "<td>1,234,567</td>" in html and "<td>-ngram/x</td>" in html


def test_a_partial_run_gets_the_sections_it_has(tmp_path: Path):
    results = tmp_path / "results"
    assert all(section(RunFiles(results)) is None for section in SECTIONS)
    (results / "merged").mkdir(parents=True)
    (results / "merged" / "stats.csv").write_text(
        "dataset,split,samples,tokens\nchat,train,4,449\nchat,eval,1,{{x}}\ntotal,all,5,500\n"
    )
    (results / "merged" / "manifest.json").write_text(json.dumps(
        {"total": {"all": {"samples": 5, "tokens": 500}, "train": {"samples": 4}, "eval": {"samples": 1}}}
    ))  # fmt: skip
    page = write_summary(results, results / "report" / "summary.rst")
    assert (results / "report" / "summary.rst").read_text() == page
    assert "Datasets (merged/stats.csv)" in page and "Acceptance length by draft tokens K" not in page
    html = rst_to_html(page)
    assert "<td>5 samples, 500 tokens</td>" in html
    assert "<td>{{x}}</td>" in html  # Jinja leaves the page's text alone
    assert "<style>" in html  # the report's first page starts at the top, not centred


def test_every_section_is_one_function_in_page_order():
    names = [s.__name__ for s in SECTIONS]
    assert names[0] == "section_headline" and all(n.startswith("section_") for n in names)
    assert len(set(names)) == len(names)
    assert render_page(RunFiles(Path("/nonexistent"))).count("\n-") == 0


def test_acceptance_at_temperature_one_is_on_the_page(tmp_path: Path):
    """An hf evaluation at temperatures [0, 1]: the headline has T = 1's real and simulated τ, the
    per-set table its rows (real and simulated)."""
    def part(t: float, real: float, sim: float) -> dict:
        return {"temperature": t, "acceptance_length": real, "acceptance_length_simulated": sim,
                "eagle3": {"7": {"acceptance_length": real}}, "ngram": {"7": {"acceptance_length": 1.25}}}  # fmt: skip

    rows = [{"prompt_set": "eval", "method": m, "measured": meas, "draft_tokens": 7, "temperature": t,
             "acceptance_length": v} for t, v in ((0.0, 4.5), (1.0, 2.75))
            for m, meas in (("eagle3", "real"), ("eagle3", "simulated"))]  # fmt: skip
    acc = {**part(0.0, 4.5, 4.625), "temperatures": {"0": part(0.0, 4.5, 4.625), "1": part(1.0, 2.75, 2.875)},
           "settings": {"temperatures": [0.0, 1.0]}, "per_set": rows}  # fmt: skip
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "acceptance.json").write_text(json.dumps(acc))
    page = render_page(RunFiles(tmp_path))
    assert "| τ at temperature 1, real / simulated (K = 7) | 2.750 / 2.875" in page
    assert "| eval       | eagle3 | simulated | 7 | 1           | 2.750 |" in page
    assert "<td>2.750 / 2.875</td>" in rst_to_html(page)
