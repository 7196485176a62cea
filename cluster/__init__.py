"""The roof: the app builder and Serve config YAML, local bring-up, status, KubeRay manifests and
the CLI. It imports every other package; none imports it (the config schema lives in common/)."""
