"""Sphinx configuration of the Disco for Python documentation.

Build: ``python -m sphinx -W --keep-going -n -b html docs docs/_build/html``
(``pip install -e '.[docs]'`` and the plugins first: the API pages import them).
No extension fetches anything over the network (no intersphinx): CI reaches
package registries only.
"""

from __future__ import annotations

import os
import sys

from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform

import disco_core

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# The tutorial's plugin is documented from its folder (it is not installed).
sys.path.insert(0, os.path.join(ROOT, "examples", "plugin_tutorial"))


project = "Disco for Python"
author = "The Disco for Python authors"
copyright = "2026, The Disco for Python authors"
release = version = disco_core.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# MyST: the pages are Markdown and include sections of the READMEs.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc + napoleon: numpy-style docstrings, members in source order, type hints
# in the signatures.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_mock_imports = ["cupy"]
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_preprocess_types = True  # {"client", "server"} is a set of values, not a class
napoleon_attr_annotations = False  # autodoc shows them; napoleon would split "dict[str, int]"

html_theme = "furo"
html_title = f"Disco for Python {release}"

# -n (nitpicky): every reference must resolve. Without intersphinx, the standard
# library's, NumPy's and pluggy's names cannot; nor can the type words of numpy-style
# docstrings ("int, optional").
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(abc|argparse|collections|collections\.abc|concurrent\.futures|enum|io|logging|mmap|os"
        r"|pathlib|queue|selectors|socket|ssl|subprocess|threading|types|typing|numpy|pluggy)"
        r"(\..+)?",
    ),
    (r"py:class", r"optional|callable|sequence|iterable|array|array-like|transport|path-like"),
]


#: The READMEs link to each other; in this site each one is a page.
README_PAGES = {
    "README.md": "index",
    **{f"plugins/{p}/README.md": f"plugins/{p}" for p in ("mpi", "nccl", "rccl", "rpc", "socket")},
}


class ReadmeLinks(SphinxPostTransform):
    """Point Markdown links between READMEs at the pages that include them.

    Runs before MyST resolves its links (priority 9).
    """

    default_priority = 5

    def run(self, **kwargs) -> None:
        for node in self.document.findall(addnodes.pending_xref):
            if node.get("reftype") != "myst":
                continue
            target = node["reftarget"].split("#")[0]
            if node.get("refdomain") == "doc":  # MyST made a document name of the path
                path = os.path.join(self.env.srcdir, target) + ".md"
            else:
                path = os.path.join(os.path.dirname(node.source or ROOT), target)
            page = README_PAGES.get(os.path.relpath(os.path.normpath(path), ROOT))
            if page is not None:
                node["refdomain"], node["reftarget"], node["reftargetid"] = "doc", page, None


def _resolve_short_name(app, env, node, contnode):
    """Resolve a Python reference by its last name(s) when exactly one object has it.

    Docstrings say ``:class:`WorkerDiedError``` where the class is documented as
    ``disco_core.WorkerDiedError``; Python finds it through imports, Sphinx only
    in the current module. A name that several objects share stays unresolved
    (and fails the build), so no link goes to the wrong place.
    """
    if node.get("refdomain") != "py":
        return None
    parts = node["reftarget"].lstrip(".~").split(".")
    # A dotted name may be documented under another module (``disco_core.spi.Handshake``
    # for ``disco_core.net.security.Handshake``): drop leading parts, down to two.
    for i in range(max(len(parts) - 1, 1)):
        found = _find(app, env, node, contnode, ".".join(parts[i:]))
        if found is not None:
            return found
    return None


def _find(app, env, node, contnode, target):
    domain = env.domains["py"]
    types = domain.objtypes_for_role(node["reftype"]) or []
    # One object may have two names (``disco_core.CCL`` and its canonical
    # ``disco_core.ccl.base.CCL``): count places, not names.
    found = {
        (obj.docname, obj.node_id): name
        for name, obj in domain.objects.items()
        if (name == target or name.endswith("." + target)) and obj.objtype in types
    }
    if "module" in types:
        found.update(
            {
                (m.docname, m.node_id): n
                for n, m in domain.modules.items()
                if n.endswith("." + target)
            }
        )
    if len(found) != 1:
        return None
    (name,) = found.values()
    return domain.resolve_xref(
        env, node.get("refdoc", ""), app.builder, node["reftype"], name, node, contnode
    )


def _factory_defaults(app, what, name, obj, options, signature, return_annotation):
    """A dataclass field's ``default_factory`` shows as ``<factory>``, which Sphinx
    cannot parse as a signature (it would split the annotations at every comma)."""
    if signature and "<factory>" in signature:
        return signature.replace("<factory>", "..."), return_annotation
    return None


def setup(app):
    app.connect("missing-reference", _resolve_short_name)
    app.connect("autodoc-process-signature", _factory_defaults)
    app.add_post_transform(ReadmeLinks)
