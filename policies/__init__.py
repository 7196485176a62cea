"""Decisions, pure and testable without Ray: per-request depth (depth), and cluster-wide depth and
replica counts (cost_curve, goodput, replicas, load, decision); actor and autoscaling are the Ray glue."""
