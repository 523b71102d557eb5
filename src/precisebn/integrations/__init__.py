"""Training-loop integrations (optional extras; importing :mod:`precisebn` imports none).

* :mod:`precisebn.integrations.lightning` — ``PreciseBN`` and ``PreciseWeightAveraging``
  callbacks for ``lightning.pytorch`` (``pip install 'precisebn[lightning]'``).
* :mod:`precisebn.integrations.pytorch_lightning` — the same callbacks for the legacy
  ``pytorch_lightning`` package.
* :mod:`precisebn.integrations.mmengine` — ``ExactPreciseBNHook`` for OpenMMLab's Runner
  (``pip install 'precisebn[mmengine]'``).
* :mod:`precisebn.integrations.transformers` — ``PreciseBNCallback`` for the Hugging Face
  ``Trainer`` (``pip install 'precisebn[transformers]'``).
* :mod:`precisebn.integrations.ignite` — the ``PreciseBN`` handler for Ignite engines
  (``pip install 'precisebn[ignite]'``).

All of them fire through one shared trigger (``_trigger.Trigger``, built on
:class:`precisebn.PreciseBNScheduler`): at most one computation per training step, random
number generators and the data's own generators put back, the model unchanged on failure.
For a plain PyTorch loop (or Accelerate), use :class:`precisebn.PreciseBNScheduler`.
"""
