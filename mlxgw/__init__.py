"""mlxgw: a team LLM server for one Apple-silicon machine.

The source folders stay at the repository's top level (gateway/, worker/, shared/, bench/,
config/, deploy/); mlxgw/<part> are committed symlinks to them, so the checkout has the
installed package's shape and an install puts a single top-level name, `mlxgw`, into
site-packages. Whatever the install (none, editable or a wheel), every `mlxgw.*` module comes
from one place: the checkout when Python runs from it, the install otherwise.
"""

__version__ = "0.2.0"
