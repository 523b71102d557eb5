"""precisebn: exact population statistics for BatchNorm-style layers ("precise BN").

Example:
    >>> import torch, precisebn
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    >>> report = precisebn.recalibrate(model, [torch.randn(32, 8) for _ in range(4)])
    >>> report.samples
    128
"""

from ._version import __version__
from .calls import untie_calls
from .errors import PreciseBNError
from .population import PopulationStats
from .recalibrate import apply, estimate, recalibrate
from .report import Report
from .scheduler import PreciseBNScheduler

__all__ = [
    "PopulationStats",
    "PreciseBNError",
    "PreciseBNScheduler",
    "Report",
    "__version__",
    "apply",
    "estimate",
    "recalibrate",
    "untie_calls",
]
