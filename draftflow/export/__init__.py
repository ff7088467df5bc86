"""Servable drafters for SGLang and vLLM, and drafters from other trainers into ours.

`stage` (the `export` and `import-drafter` CLI) picks `eagle3` or `dflash` by the drafter's
method; both build on `common` and never import each other; `importing` reads SpecForge /
SGLang-format and speculators EAGLE-3 checkpoints.
"""
