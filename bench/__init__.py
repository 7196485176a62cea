"""Benchmarks: specserve vs target-only decoding and Hugging Face assisted generation (the tools users
run), and in figures/ the scripts that reproduce the figures docs/ cites."""

# Where a run writes unless told --out: a folder git ignores, so a trial run leaves the checkout
# clean. Published figures go to bench/results/ with an explicit --out and a citing doc.
DEFAULT_OUT_DIR = "bench-out"
