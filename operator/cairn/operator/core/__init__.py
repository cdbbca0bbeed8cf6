"""The operator's pure core: decisions, builders, typed payloads, tunables.

Imports nothing outside ``cairn.operator.core`` and ``cairn.api`` that does
IO: no kopf, Kubernetes client, boto3 (``.importlinter``,
``tests/unit/test_layout.py``). Values in, values out; time comes in as an
argument (``clock``).
"""
