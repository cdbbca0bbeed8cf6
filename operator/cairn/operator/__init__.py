"""The Cairn control plane.

Data flow: kopf handlers (``handlers``) gather what they see into
``observe.Observed``; the pure ``plan.plan()`` decides children, status,
events and the next wake-up; ``effects`` applies that plan with the
Kubernetes client. Only ``handlers`` and ``effects`` import kopf or a client.
"""
