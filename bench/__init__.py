"""Benchmarks: specserve vs target-only decoding and Hugging Face assisted generation.
perfmodel (math), records, inprocess / http_rows (rows), report, run (CLI), transport."""
