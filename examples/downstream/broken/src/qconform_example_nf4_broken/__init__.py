"""The example downstream backend with one planted bug, to show what a failing run looks like."""

from qconform_example_nf4_broken.backend import SwappedNibblesNF4Backend

__all__ = ["SwappedNibblesNF4Backend"]
