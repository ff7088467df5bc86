"""draftflow: train EAGLE-3 speculative-decoding drafters with a reproducible Snakemake workflow."""

__version__ = "0.1.0"
