"""Benchmarks: specserve vs target-only decoding and Hugging Face assisted generation.
prompts (fixed set), perfmodel (math), records, inprocess / http_rows (rows), report, run (CLI), transport."""
