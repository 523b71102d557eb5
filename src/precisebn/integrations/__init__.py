"""Training-loop integrations (optional extras; importing :mod:`precisebn` imports none).

* :mod:`precisebn.integrations.lightning` — ``PreciseBN`` and ``PreciseWeightAveraging``
  callbacks for ``lightning.pytorch`` (``pip install 'precisebn[lightning]'``).
* :mod:`precisebn.integrations.pytorch_lightning` — the same callbacks for the legacy
  ``pytorch_lightning`` package.

For a plain PyTorch loop, use :class:`precisebn.PreciseBNScheduler`.
"""
