"""mlxgw: a team LLM server for one Apple-silicon machine.

The source folders stay at the repository's top level (gateway/, worker/, shared/, bench/)
and install as subpackages of this one package (see pyproject.toml's package-dir), so an
install puts a single top-level name, `mlxgw`, into site-packages.
"""

__version__ = "0.2.0"
