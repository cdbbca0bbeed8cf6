"""The devcluster's node agent: the kubelet stand-in that runs pods as processes.

Data flow: `informer` lists and watches pods, services, PVCs and PVs; `main`
dispatches pods bound to our nodes to one `runtime.PodWorker` each; a worker
turns the pod spec into a plan (`podspec`, pure), materializes volumes
(`volumes`), creates the pod's network namespace (`network`), starts each
container through `launch` inside it, and reports status. `nodes` keeps the
Nodes Ready with Leases, `provisioner` binds PVCs of the default class,
`hosts` (pure) computes every pod's hosts file, and `logserver` serves the
kubelet log endpoint for `kubectl logs`.
"""
