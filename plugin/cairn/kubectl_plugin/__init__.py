"""``kubectl cairn``: a kubectl plugin for Cairn TrainingJobs.

Data flow: ``cli`` parses arguments and prints; ``kube`` is the only module
that talks to the API server (kubeconfig, get/patch the job, list pods, read
logs); ``download`` fetches and verifies a step from S3 (boto3, imported
only by that command); ``views`` is pure (status in, tables, summaries,
patches and progress lines out).
Installed as the console script ``kubectl-cairn``, which kubectl finds on
``PATH`` as the ``cairn`` subcommand.
"""
