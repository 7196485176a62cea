"""Thin Ray Serve glue over decoding/: HTTP ingress, router, draft and target worker deployments."""
