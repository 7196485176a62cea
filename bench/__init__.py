"""Benchmarks: specserve vs target-only decoding and Hugging Face assisted generation (the tools users
run), and in figures/ the scripts that reproduce the figures docs/ cites."""
