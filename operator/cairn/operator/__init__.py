"""The Cairn control plane.

Two layers. ``core/`` is pure (no kopf, Kubernetes client or boto3; the
import contract in ``.importlinter`` and ``tests/unit/test_layout.py`` keep
it so): every decision, builder and typed payload. The modules beside it do
IO, each named for what it touches, in one scheme: ``<area>observe`` reads,
``core/<area>plan`` decides, ``<area>apply`` writes, for the job reconcile
(``reconcile``: ``core.jobobserve`` -> ``core.jobplan`` -> ``jobapply``),
S3 (``s3observe`` -> ``core.s3plan`` -> ``s3apply``, run by ``s3pass``),
Kueue (``kueueapply.read`` -> ``core.kueueplan`` -> ``kueueapply.sync``) and
prefix ownership (``core.prefixplan`` -> ``prefixapply``). ``handlers`` is
only the kopf wiring; its state lives in one ``runtime.Runtime``.
docs/architecture.md draws the layers.
"""
