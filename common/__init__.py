"""The floor every layer imports: the config schema, the messages that cross processes, the names
actors are found by and the metrics they export. Nothing here imports cluster/, deployments/ or policies/."""
