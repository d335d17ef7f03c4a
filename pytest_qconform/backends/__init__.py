"""Backend adapters behind one interface (``base.Backend``), found through ``registry``.

Each adapter module imports its library only inside its methods, so importing this
package never needs bitsandbytes, HQQ or Triton. Suites reach backends through
``registry.discover()`` / ``registry.create(name)``, never by importing an adapter.
"""

from pytest_qconform.backends.base import Availability, Backend, Capabilities, Quantized, QuantSpec

__all__ = ["Availability", "Backend", "Capabilities", "QuantSpec", "Quantized"]
