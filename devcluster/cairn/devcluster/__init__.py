"""A Docker-free local Kubernetes control plane for Cairn's tests and demo.

`devcluster` builds the real control-plane binaries from their Go modules,
runs them on loopback with certificates of its own, starts a node agent that
runs pods as local processes, and an S3-compatible server (SeaweedFS). Its
entry points are the `devcluster` command (`cli`) and the pytest fixtures in
`tests/conftest.py`, both of which drive `cluster`.
"""
