"""Sphinx configuration: the site is docs/*.md (MyST) and an API reference from the public docstrings.

Build it: ``python -m sphinx -W -b html docs docs/_build`` (``tests/test_docs_site.py`` builds it in
strict mode); serve it: ``python -m http.server -d docs/_build``.
"""

import jshard

project = "jshard"
release = version = jshard.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_default_options = {"members": True, "imported-members": True}
autodoc_typehints = "description"
napoleon_google_docstring = True
html_theme = "alabaster"
# Strict builds (-W -n) resolve every reference. Types from other libraries (no intersphinx: the
# build must not need the network) and jshard's internal types shown in signatures are not pages here.
nitpick_ignore_regex = [
    ("py:.*", r"(collections|typing|jax|jaxlib|optax|flax|numpy|orbax)(\..*)?"),
    ("py:.*", r"jshard\._.*"),
    ("py:.*", r"(UnitMeta|T)"),
]
