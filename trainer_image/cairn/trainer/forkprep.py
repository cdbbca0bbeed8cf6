"""Imported last by the warm launcher's fork server: what every worker would
load on first use is loaded once, then the server's heap leaves the garbage
collector's reach.

Two costs every restarted worker paid in its first second, measured on the
devcluster (warm launcher, 2 nodes, in-place restarts, stacks sampled every
5 ms in both workers), both of them work a fork can inherit instead:

- **botocore's data.** The checkpoint manager's S3 client read S3's service
  model, endpoint rules and partitions from gzipped JSON (0.15-0.2 s per
  worker under load). `s3transport.warm_loader` fills the process's shared
  botocore loader here, so a worker's client is built from cached models
  (0.015 s instead of 0.083 s in a fork, idle).
- **The garbage collector.** The server imports torch, the checkpoint
  library and the trainer: about 400,000 objects the collector tracks, and a
  fork's full collection walked all of them (one ``gc.collect()`` in such a
  fork: 0.23 s; each worker stalled 0.26-0.28 s once during its restore,
  with no Python thread able to run, while the other rank waited for it at
  the next barrier). Walking them also writes every object's GC header, so
  the forks copied those pages instead of sharing them. ``gc.freeze()``
  after one collection moves everything alive into the permanent generation,
  which collections skip (the pattern the ``gc`` docs give for a process
  that forks without exec): a fork's full collection walks only what the
  worker allocated. What is frozen is import-time state that lives as long
  as the process anyway.

`cairn.trainer.launch` appends this module to the fork server's preload list
(multiprocessing imports them in order), so it runs once, in the server,
after every other preload. Multiprocessing forgives a preload only an
ImportError; anything else would end the server and every worker with it,
so a failed warm-up is logged and the workers read the models themselves.
"""

from __future__ import annotations

import gc
import logging

from cairn.checkpoint import s3transport

log = logging.getLogger(__name__)

try:
    s3transport.warm_loader()
except Exception as exc:  # a fork server that raises here would fail every worker
    log.warning("fork server: botocore's models not preloaded (%s); each worker reads them", exc)
gc.collect()
gc.freeze()
