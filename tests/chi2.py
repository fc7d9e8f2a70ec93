"""Chi-square survival function shared by the statistical tests."""
from __future__ import annotations

import math


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x): scipy when installed, else the Wilson-Hilferty approximation."""
    if math.isinf(x):
        return 0.0
    if df <= 0:
        return 1.0
    try:
        from scipy.stats import chi2

        return float(chi2.sf(x, df))
    except ImportError:
        z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
        return 0.5 * math.erfc(z / math.sqrt(2))
