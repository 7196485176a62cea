"""The one installed namespace: each entry here links to the repository's top-level folder of that
name (specserve.decoding is decoding/, specserve/models the shipped pair), so a wheel installs
specserve.decoding, specserve.cluster, ... and specserve/models/default, while a checkout keeps its
layout and `PYTHONPATH=<checkout>` imports the same names the wheel does."""
