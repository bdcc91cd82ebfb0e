"""The CSI v1 adapter: gRPC front door that writes desired-volume files."""
