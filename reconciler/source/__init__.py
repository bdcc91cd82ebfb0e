"""The GitOps source (docs/gitops-source.md): fetch a repository, verify
signed commits, export each verified revision and switch the directory the
daemon reads with one rename(2)."""
