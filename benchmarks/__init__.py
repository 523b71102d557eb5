"""precisebn's benchmarks (not part of the test suite, not shipped in the wheel).

* ``python -m benchmarks.run`` (``make bench``): cost against the floor (the same
  forward passes with nothing kept), fvcore's ``update_bn_stats`` and torch's
  ``swa_utils.update_bn``; then the estimation-quality study.
* ``python -m benchmarks.quality``: the estimation-quality study alone.
* ``python benchmarks/gpu_check.py`` (``make gpu-check``): CUDA-only checks.

Results go to ``benchmarks/results/``.
"""
