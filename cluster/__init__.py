"""Configuration (pydantic), the app builder and Serve config YAML, local bring-up and the CLI."""
